"""Measure this machine for the planner: a verifier forward over 1..k tokens after a KV cache,
a drafter step as a round runs it, a drafter forward of k query tokens (a parallel round's one
forward), the verify surface over batch size x tokens per sequence (a batched forward), and
with several GPUs the all-reduce curve -> a node profile (plan/planner.py reads it).

    eagle3-ray profile --max-tokens 9 --out /tmp/cpu.yaml              # CPU, ~1 min
"""
from __future__ import annotations

import dataclasses
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from eagle3_ray.engine import hf as verifier
from eagle3_ray.plan import planner
from eagle3_ray.serve import speculate
from eagle3_ray.train import checkpoint, kinds


PARALLEL_KS = (1, 2, 4, 8, 16)      # query tokens of the drafter forwards `profile` times
BATCH_SIZES = (1, 2, 4, 8)          # batches of the verify surface `profile` times
BATCH_TOKENS = (1, 2, 3, 5)         # tokens per sequence in each: depths 0, 1, 2, 4


def measure_profile(spec: str | None = None, drafter_dir: str | None = None,
                    max_tokens: int = 33, context: int = 256, reps: int = 5, warmup: int = 1,
                    name: str | None = None, parallel_ks=PARALLEL_KS,
                    draft_collectives: int | None = None, batch_sizes=BATCH_SIZES,
                    batch_tokens=BATCH_TOKENS) -> planner.NodeProfile:
    """Time this machine: one verifier forward over 1..max_tokens tokens after a `context`-token
    KV cache (median of `reps`, the decoder's own verify call, aux hooks included), one drafter
    step (a trained drafter dir, else an untrained one of the same shape), one drafter forward
    of k query tokens for k in `parallel_ks` (measure_draft_parallel), and, only with several
    GPUs, the NCCL all-reduce curve (add_allreduce_curve; α/β fitted to it as the fallback),
    and the verify surface over `batch_sizes` x `batch_tokens` (measure_verify_batch; none
    given: batch 1 only). -> a NodeProfile (gpus=1, N_ar=0 on one device). draft_collectives:
    per drafter forward (default: 0 on one device; with several,
    planner.DRAFT_COLLECTIVES_TP, as vLLM and SGLang run the drafter at the verifier's
    tensor-parallel degree)."""
    spec = spec or verifier.EMBEDDED_VERIFIER
    ngpu = torch.cuda.device_count()
    model = verifier.load_verifier(spec, num_gpus=ngpu)                   # its default dtype
    cfg = model.config
    surface = (measure_verify_batch(model, batch_sizes, batch_tokens, context, reps, warmup)
               if batch_sizes else None)   # before the Speculator makes it a batch-1 decoder
    if drafter_dir:
        drafter = checkpoint.load_trained_drafter(drafter_dir, spec)[0]
    else:
        drafter = kinds.untrained_drafter(spec, min(32000, cfg.vocab_size))[0]
    dec = speculate.Speculator(model, drafter.eval())
    verify_ms, draft_ms = measure_speculator(dec, max_tokens, context, reps, warmup)
    parallel_ms = measure_draft_parallel(drafter, parallel_ks, context, reps, warmup) \
        if parallel_ks else None
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
                        if ngpu > 1 else "")
                     + ("; a PARALLEL drafter: draft_step_ms is its 4-draft round's one forward "
                        "/ 4, draft_parallel_ms its forward of k tokens"
                        if getattr(drafter.config, "parallel", False) else "")
                     + (f"; verify_batch_ms: the plain batched forward (transformers' own "
                        f"kernels, as a batching engine runs one), batches {sorted(surface)}"
                        if surface else "")),
        draft_parallel_ms=parallel_ms, verify_batch_ms=surface)
    if ngpu > 1:                        # NCCL all-reduce time per message size: the curve
        p = planner.add_allreduce_curve(p, ngpu, 2 * verifier.text_config(cfg).num_hidden_layers + 2)
    if draft_collectives is None:
        draft_collectives = planner.DRAFT_COLLECTIVES_TP if ngpu > 1 else 0
    return dataclasses.replace(p, draft_collectives=draft_collectives)


def measure_verify_batch(model, batch_sizes=BATCH_SIZES, tokens=BATCH_TOKENS,
                         context: int = 256, reps: int = 5, warmup: int = 1
                         ) -> dict[int, dict[int, float]]:
    """The verify surface: one forward of B sequences with t new tokens each after a
    `context`-token KV cache per sequence (random tokens), for B in `batch_sizes` and t in
    `tokens` -> {B: {t: median ms}}, each row made non-decreasing. The model's own batched
    forward (transformers' kernels, logits of every position), so it must run before a
    Speculator turns the model into a batch-1 decoder; its batch-1 row (B = 1 in
    `batch_sizes`) is that forward's too, which the schedule prices batch 1 with instead of
    the decoder's verify_ms, so that batch 1 and 2 compare like with like. The shapes are
    timed round robin, `warmup + reps` rounds; each cache is cropped back after each forward."""
    bs, ts = sorted({int(b) for b in batch_sizes}), sorted({int(t) for t in tokens})
    if not bs or bs[0] < 1 or bs[-1] < 2 or not ts or ts[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, one of them >= 2, and tokens >= 1, got "
                         f"{bs}, {ts}")
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    vocab = verifier.text_config(model.config).vocab_size
    g = torch.Generator().manual_seed(0)
    samples = {(b, t): [] for b in bs for t in ts}
    with torch.inference_mode():
        for b in bs:
            ids = torch.randint(0, vocab, (b, context + ts[-1]), generator=g).to(dev)  # [B, C+T]
            cache = DynamicCache()
            model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
            for _ in range(warmup + reps):
                for t in ts:
                    pos = torch.arange(context, context + t, device=dev)[None].expand(b, t)
                    sync()
                    t0 = time.perf_counter()
                    model(input_ids=ids[:, context:context + t], cache=cache, use_cache=True,
                          position_ids=pos)                                # logits [B, t, V]
                    sync()
                    samples[(b, t)].append(time.perf_counter() - t0)
                    cache.crop(-t)                                     # back to the context
    return {b: planner.monotone_curve({t: statistics.median(samples[(b, t)][warmup:]) * 1e3
                                       for t in ts}) for b in bs}


def measure_draft_parallel(drafter, ks=PARALLEL_KS, context: int = 256, reps: int = 5,
                           warmup: int = 1) -> dict[int, float]:
    """One drafter forward of k query tokens after a `context`-token drafter KV cache, with the
    logits of all k positions (a parallel round: its one forward proposes k drafts), for each k
    in `ks` -> {k: median ms}, made non-decreasing (planner.monotone_curve). The forward is
    Eagle3Drafter.forward with a serve.speculate.DraftKV as its `attend` (k > 1 query tokens:
    causal over the cache); the tokens are random and the hidden states are verifier-shaped aux
    states [1, k, 3H] through fc, as a round's first forward takes them. A parallel drafter
    (config.parallel) gets 1 real token + k-1 mask slots, as it drafts. A block drafter
    (drafting "block") runs its round: one new context state joins its cache, then the bonus
    token + k mask slots. Timed round robin over the k's, `warmup + reps` rounds; the cache is
    cropped back after each forward."""
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"parallel forward sizes must be >= 1, got {ks}")
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    c, n = drafter.config, context + ks[-1] + 1
    parallel = bool(getattr(c, "parallel", False))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (1, n), generator=g).to(dev)          # [1, ctx+K]
    aux = torch.randn(1, n, 3 * c.hidden_size, generator=g).to(dev, dtype)     # [1, ctx+K, 3H]
    pos = torch.arange(n, device=dev)[None]                                    # [1, ctx+K]
    if c.drafting == "block":
        return _measure_block(drafter, ks, ids, aux, pos, context, reps, warmup, sync)
    samples = {k: [] for k in ks}
    with torch.inference_mode():
        kv = speculate.DraftKV()
        drafter(ids[:, :context], aux[:, :context], pos[:, :context], attend=kv)   # the cache
        for _ in range(warmup + reps):
            for k in ks:
                real = 1 if parallel else k                                    # tokens given
                sync()
                t0 = time.perf_counter()
                extra = {"masked": k - 1} if parallel and k > 1 else {}
                out = drafter(ids[:, context:context + real], aux[:, context:context + real],
                              pos[:, context:context + k], attend=kv, **extra)  # [1, k, H]
                drafter.logits(out)                                            # [1, k, Vd]
                sync()
                samples[k].append(time.perf_counter() - t0)
                kv.crop(context)
    ms = {k: statistics.median(x[warmup:]) * 1e3 for k, x in samples.items()}
    return planner.monotone_curve(ms)


def with_round_forward(profile, drafter, ms: dict[int, float]):
    """`profile` plus a one-forward drafter's round times ms {depth k: ms} (as
    measure_draft_parallel gives them): a parallel drafter's draft_parallel_ms {k: ms}, a block
    drafter's draft_block_ms {k + 1 query slots: ms} with its layer count."""
    if drafter.config.drafting == "parallel":
        return dataclasses.replace(profile, draft_parallel_ms=dict(ms))
    return dataclasses.replace(profile, draft_block_ms={k + 1: v for k, v in ms.items()},
                               draft_block_layers=len(drafter.layers))


def _measure_block(drafter, ks, ids, aux, pos, context, reps, warmup, sync) -> dict[int, float]:
    samples = {k: [] for k in ks}
    mask = drafter.config.mask_token_id
    with torch.inference_mode():
        kv = speculate.BlockKV(len(drafter.layers))
        drafter(ids[:, :0], pos[:, :0], kv, aux=aux[:, :context - 1],
                aux_positions=pos[:, :context - 1])                            # the context
        for _ in range(warmup + reps):
            for k in ks:
                slots = ids[:, context:context + k + 1].clone()
                slots[:, 1:] = mask                                            # [1, k+1]
                sync()
                t0 = time.perf_counter()
                out = drafter(slots, pos[:, context:context + k + 1], kv,
                              aux=aux[:, context - 1:context],
                              aux_positions=pos[:, context - 1:context])      # [1, k+1, H]
                drafter.logits(out[:, 1:])                                     # [1, k, Vd]
                sync()
                samples[k].append(time.perf_counter() - t0)
                kv.crop(context - 1)
    ms = {k: statistics.median(x[warmup:]) * 1e3 for k, x in samples.items()}
    return planner.monotone_curve(ms)


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
    vocab = verifier.text_config(dec.model.config).vocab_size
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
        kv, sp, chain = dec._draft_cache(), speculate.SamplingParams(), 4
        dec._draft_chain(ids[1:context - 1], aux[:, :context - 2], kv, 1, sp, None)  # absorb
        kv.crop(context - 2)                                               # the context

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
