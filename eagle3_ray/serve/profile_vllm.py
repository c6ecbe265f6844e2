"""Measure the serving engine itself for the planner: vLLM's decode round over batch size x depth
-> a node profile's `round_batch_ms` and `plain_batch_ms`, which plan/load.py prices the
depth-by-load schedule with instead of composing it from the builtin's verify surface.

Why: under load the schedule serves vLLM, and its round is vLLM's (scheduler, drafter, sampler,
its kernels), which transformers' batched forward does not predict. And vLLM's schedule cannot
switch the drafter off: at k = 0 its proposer still runs the drafter's first forward every step
to keep the draft KV cache in sync (vllm/v1/spec_decode/llm_base_proposer.py), so a schedule's
0 costs more than an engine without a drafter. Both are measured here.

How: one vllm.LLM per arm, each in its own process run by vLLM's environment's python
(.venv-vllm), started with the engine arguments `serve --engine vllm` gives the same ServeConfig
(dtype, eager, KV space, threads, the engine core in its own process as served):
  plain     no drafter                                      -> plain_batch_ms[B]
  k = 0     the drafter loaded, a schedule of 0 at every batch size (its upkeep only)
  k >= 1    num_speculative_tokens k                         -> round_batch_ms[k][B]
For each B, `reps` times: B requests of `context` random prompt tokens added at once, greedy,
ignore_eos, and the engine stepped by hand (LLMEngine.step): the time between two steps in
which all B sequences decoded is one round of B at depth k; the median over them is the
profile's. A step's time does not depend on how many drafts were accepted (but for the
drafter's first forward, over 1 + accepted tokens per sequence), so the real drafter at its
real acceptance is timed, and the tokens per sequence per step (1 + accepted) come along: the
served acceptance length at each batch.
vLLM's synthetic rejection sampler (`rejection_sample_method: "synthetic"`: acceptance at a
rate you set, any drafter of the right shape) is `--synthetic-acceptance A` here, for nodes
without a trained drafter yet; vLLM's CPU sampler refuses it ("Synthetic acceptance not
supported with CPU sampling", vllm/utils/cpu_triton_utils.py), so it is refused on CPU.

    eagle3-ray profile --engine vllm --drafter runs/demo/train/drafter --verifier DIR \\
        --round-depths 0 1 2 3 --batch-sizes 1 2 4 8 16 --out /tmp/vllm.yaml   # ~5 min, 2 cores
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROUND_DEPTHS = (0, 1, 2, 3)
ROUND_BATCHES = (1, 2, 4, 8, 16)
ROUND_TOKENS = 33               # max_tokens per request: ~30 rounds timed per repetition
ROUND_CONTEXT = 64              # prompt tokens per sequence
ARM_TIMEOUT_S = 900


def arm_kwargs(cfg, export: str | None, k: int | None, max_batch: int,
               synthetic: float | None = None) -> dict:
    """vLLM engine arguments of one arm: serve.vllm.engine_kwargs of `cfg` (as `serve --engine
    vllm` starts the engine) at depth k (None: no drafter; 0: the drafter with a schedule of 0
    everywhere), max_num_seqs >= the largest batch. synthetic: vLLM's synthetic rejection
    sampler at this conditional acceptance per position (GPUs only)."""
    from eagle3_ray.serve import vllm as serve_vllm
    arm = dataclasses.replace(cfg, depth=max(1, k or 0), depth_schedule=None)
    kw = serve_vllm.engine_kwargs(arm, export if k is not None else None)
    kw["max_num_seqs"] = max(int(max_batch), kw.get("max_num_seqs", 0))
    spec = kw.get("speculative_config")
    if spec and k == 0:
        spec["num_speculative_tokens_per_batch_size"] = [[1, max(256, max_batch), 0]]
    if spec and synthetic is not None:
        n = spec["num_speculative_tokens"]
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[float(synthetic) ** (i + 1) for i in range(n)])
    return kw


def measure_rounds(cfg, depths=ROUND_DEPTHS, batches=ROUND_BATCHES, tokens: int = ROUND_TOKENS,
                   context: int = ROUND_CONTEXT, reps: int = 2,
                   synthetic: float | None = None, plain: bool = True) -> dict:
    """Every arm (plain unless `plain` is False, then each depth in `depths`) in its own engine
    process -> {"engine": what ran, "plain_batch_ms": {B: ms}, "round_batch_ms": {k: {B: ms}},
    "arms": each arm's record (its steps, spread and tokens per step)}. cfg: the ServeConfig to
    be served (engine vllm, a drafter)."""
    from eagle3_ray.engine import vllm as engine_vllm
    from eagle3_ray.serve import vllm as serve_vllm
    if not cfg.drafter:
        raise ValueError("profile --engine vllm needs --drafter: its rounds run the drafter")
    if tokens < 4:
        raise ValueError(f"tokens must be >= 4 (rounds to time between steps), got {tokens}")
    if synthetic is not None and not float(cfg.gpus_per_replica or 0):
        raise ValueError("--synthetic-acceptance: vLLM's CPU sampler refuses synthetic "
                         "acceptance ('Synthetic acceptance not supported with CPU sampling', "
                         "vllm/utils/cpu_triton_utils.py); on CPU the profile times the "
                         "drafter's own rounds")
    depths = sorted({int(k) for k in depths})
    batches = sorted({int(b) for b in batches})
    if not batches or batches[0] < 1 or (depths and depths[0] < 0):
        raise ValueError(f"batch sizes >= 1 and depths >= 0, got {batches}, {depths}")
    export = serve_vllm.prepare(dataclasses.replace(cfg, depth=max(1, max(depths or [1]))))
    python = engine_vllm.engine_python()
    env = dict(os.environ, **engine_vllm.engine_env(serve_vllm.engine_threads(cfg),
                                                    in_process=False))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    model = serve_vllm.verifier_source(cfg)
    out = {"engine": None, "plain_batch_ms": {}, "round_batch_ms": {}, "arms": {}}
    for k in [None] * plain + depths:
        name = "plain" if k is None else f"k{k}"
        job = {"model": model, "kwargs": arm_kwargs(cfg, export, k, batches[-1], synthetic),
               "batches": batches, "tokens": tokens, "context": context, "reps": reps}
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "arm.json")
            t0 = time.perf_counter()
            run = subprocess.run([python, "-m", "eagle3_ray.serve.profile_vllm", json.dumps(job),
                                  path], env=env, cwd=root, capture_output=True, text=True,
                                 timeout=ARM_TIMEOUT_S)
            if run.returncode or not os.path.isfile(path):
                raise RuntimeError(f"profile --engine vllm, arm {name}: the engine process "
                                   f"exited {run.returncode}:\n{_cause(run.stderr or '')}")
            with open(path) as f:
                got = json.load(f)
        got["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"[profile vllm] {name}: " + ", ".join(
            f"B={b} {ms:.1f} ms" for b, ms in got["round_ms"].items())
            + f" ({got['wall_s']:.0f}s)", flush=True)
        out["engine"] = got["engine"]
        out["arms"][name] = got
        ms = {int(b): v for b, v in got["round_ms"].items()}
        if k is None:
            out["plain_batch_ms"] = ms
        else:
            out["round_batch_ms"][k] = ms
    return out


def _cause(stderr: str, tail: int = 25) -> str:
    """What a dead engine process's stderr says: its exception lines (the engine core's and
    workers' come as log lines, their prefixes cut), then its last lines."""
    lines = [re.sub(r"^\(.*?\) ERROR .*?\] ", "", x) for x in stderr.splitlines()]
    errors = list(dict.fromkeys(x for x in lines if re.match(r"^[\w.]*(Error|Exception)\b", x)))
    return "\n".join(errors[:6] + ["--- its last lines:"] + lines[-tail:])


# --- one arm, in vLLM's environment -------------------------------------------------------------

def run_arm(job: dict) -> dict:
    """One engine: the round time at each batch size (module docstring) -> {"round_ms": {B: ms},
    "checks": per B the steps timed, their spread and the tokens per sequence per step (1 +
    accepted: the served acceptance length at that batch), "engine", "startup_s"}."""
    import random
    import vllm
    from vllm import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], enable_prefix_caching=False,
              seed=0, **job["kwargs"])
    startup = time.perf_counter() - t0
    engine, vocab = llm.llm_engine, llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    n, ctx, reps = int(job["tokens"]), int(job["context"]), int(job["reps"])
    # CUMULATIVE (SamplingParams' default): every step returns each request that got tokens
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def steps(b: int, tag: str) -> tuple[list[float], list[float]]:
        """B requests at once; (seconds of each step in which all B decoded, the new tokens per
        sequence in it)."""
        for i in range(b):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": [
                rng.randrange(vocab) for _ in range(ctx)]}, sp)
        seen, last, dts, per_seq = {}, None, [], []
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            if not outs:
                continue
            grew = [len(o.outputs[0].token_ids) - seen.get(o.request_id, 0) for o in outs]
            decoding = len(outs) == b and all(o.request_id in seen for o in outs)
            if decoding and last is not None and not any(o.finished for o in outs):
                dts.append(now - last)
                per_seq.append(sum(grew) / b)
            seen.update({o.request_id: len(o.outputs[0].token_ids) for o in outs})
            last = now
        return dts, per_seq

    steps(max(job["batches"]), "warmup")
    round_ms, checks = {}, {}
    for b in job["batches"]:
        dts, per_seq = [], []
        for r in range(reps):
            d, t = steps(b, f"b{b}-r{r}")
            dts += d
            per_seq += t
        if not dts:
            raise RuntimeError(f"batch {b}: no step decoded all {b} sequences (tokens {n})")
        round_ms[b] = round(statistics.median(dts) * 1e3, 3)
        q = statistics.quantiles(dts, n=10) if len(dts) > 1 else [dts[0]] * 9
        checks[b] = {"steps": len(dts), "p10_ms": round(q[0] * 1e3, 3),
                     "p90_ms": round(q[-1] * 1e3, 3),
                     "tokens_per_step": round(statistics.mean(per_seq), 4)}
    return {"engine": f"vllm {vllm.__version__}", "startup_s": round(startup, 1),
            "speculative_config": job["kwargs"].get("speculative_config"),
            "round_ms": round_ms, "checks": checks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one arm of profile --engine vllm (internal)")
    p.add_argument("job", help="the arm as JSON (measure_rounds builds it)")
    p.add_argument("out", help="JSON file to write")
    a = p.parse_args(argv)
    result = run_arm(json.loads(a.job))
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
