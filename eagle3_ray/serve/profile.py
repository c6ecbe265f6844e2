"""Measure this machine for the planner: a verifier forward over 1..k tokens after a KV cache,
a drafter step as a round runs it, and with several GPUs the all-reduce curve -> a node profile
(plan/planner.py reads it).

    eagle3-ray profile --max-tokens 9 --out /tmp/cpu.yaml              # CPU, ~1 min
"""
from __future__ import annotations

import platform
import statistics
import time

import torch
from transformers import DynamicCache

from eagle3_ray.engine import hf as verifier
from eagle3_ray.plan import planner
from eagle3_ray.serve import speculate
from eagle3_ray.train import checkpoint, draft


def measure_profile(spec: str | None = None, drafter_dir: str | None = None,
                    max_tokens: int = 33, context: int = 256, reps: int = 5, warmup: int = 1,
                    name: str | None = None) -> planner.NodeProfile:
    """Time this machine: one verifier forward over 1..max_tokens tokens after a `context`-token
    KV cache (median of `reps`, the decoder's own verify call, aux hooks included), one drafter
    step (a trained drafter dir, else an untrained one of the same shape), and, only with
    several GPUs, the NCCL all-reduce curve (add_allreduce_curve; α/β fitted to it as the
    fallback). -> a NodeProfile (gpus=1, N_ar=0 on one device)."""
    spec = spec or verifier.EMBEDDED_VERIFIER
    ngpu = torch.cuda.device_count()
    model = verifier.load_verifier(spec, num_gpus=ngpu)                   # its default dtype
    cfg = model.config
    if drafter_dir:
        drafter = checkpoint.load_trained_drafter(drafter_dir, spec)[0]
    else:
        drafter = draft.untrained_drafter(spec, min(32000, cfg.vocab_size))[0]
    dec = speculate.Speculator(model, drafter.eval())
    verify_ms, draft_ms = measure_speculator(dec, max_tokens, context, reps, warmup)
    dtype = next(model.parameters()).dtype
    where = torch.cuda.get_device_name(0) if ngpu else f"{platform.processor() or 'CPU'}, " \
        f"{torch.get_num_threads()} threads"
    p = planner.single_device_profile(
        name or f"measured-{platform.node() or 'host'}", verify_ms, draft_ms, cfg, dtype,
        description=(f"measured by eagle3-ray profile: verifier {spec} ({dtype}), {context}-token "
                     f"KV cache, median of {reps}, made non-decreasing; drafter "
                     f"{drafter_dir or 'untrained, same shape'}; {max(ngpu, 1)} x {where}"
                     + ("; verifier split over the GPUs by accelerate (layers, not tensor "
                        "parallel): verify_ms is close to, not exactly, compute only"
                        if ngpu > 1 else "")))
    if ngpu > 1:                        # NCCL all-reduce time per message size: the curve
        p = planner.add_allreduce_curve(p, ngpu, 2 * cfg.num_hidden_layers + 2)
    return p


def measure_speculator(dec, max_tokens: int = 33, context: int = 256, reps: int = 5,
                       warmup: int = 1) -> tuple[dict[int, float], float]:
    """A Speculator's own verify call over 1..max_tokens tokens after a `context`-token KV
    cache, and the cost per draft token of a round's drafting (medians, ms) -> (verify_ms,
    draft_step_ms). The token counts are timed round robin, `warmup + reps` rounds. Drafting is
    timed as a round does it (Speculator._draft_chain: absorb 2 tokens, then 4 drafts, right
    after a verify, so the drafter's weights start out of cache, as in a round). Any simulated
    interconnect of `dec` is left out: a profile's verify_ms is compute only."""
    sync = torch.cuda.synchronize if dec.device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    vocab = dec.model.config.vocab_size
    ids = torch.randint(0, vocab, (context + max_tokens + 1,), generator=g).tolist()
    comm = dec.simulated_comm
    dec.simulated_comm = None
    try:
        verify_ms, draft_ms = _time_speculator(dec, ids, max_tokens, context, reps, warmup,
                                               sync)
    finally:
        dec.simulated_comm = comm
    return verify_ms, draft_ms


def _time_speculator(dec, ids, max_tokens, context, reps, warmup, sync):
    with torch.inference_mode():
        cache = DynamicCache()
        _, aux = dec._verify(ids[:context], cache)                         # aux [1, ctx, 3H]
        samples = {t: [] for t in range(1, max_tokens + 1)}
        for _ in range(warmup + reps):     # round robin over the token counts: a slow stretch
            for t in samples:              # of a shared machine hits all of them alike
                sync()
                t0 = time.perf_counter()
                dec._verify(ids[context:context + t], cache)
                cache.crop(-t)                                             # back to the context
                sync()
                samples[t].append(time.perf_counter() - t0)
        verify_ms = {t: statistics.median(x[warmup:]) * 1e3 for t, x in samples.items()}  # ms
        kv = speculate.DraftKV()
        dec._draft_step(ids[1:context - 1], aux[:, :context - 2], kv)     # absorb the context
        sp, chain = speculate.SamplingParams(), 4

        def draft_round():   # as in a round: right after a verify (the drafter's weights out
            dec._verify(ids[context:context + 2], cache)                   # of cache), absorb
            cache.crop(-2)                                                 # 2 tokens, 4 drafts
            sync()
            t0 = time.perf_counter()
            dec._draft_chain(ids[context - 1:context + 1], aux[:, context - 2:], kv, chain, sp,
                             None)
            sync()
            kv.crop(context - 2)
            return time.perf_counter() - t0
        rounds = [draft_round() for _ in range(warmup + reps)][warmup:]
        draft_ms = statistics.median(rounds) * 1e3 / chain                # per draft token
    return verify_ms, draft_ms
