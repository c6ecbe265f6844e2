"""bench engines: the train/serve gap measured in the real engine. One trained drafter, the same
held-out prompts (bench serve's, data.heldout_prompts), greedy, batch 1, in two engines:

  builtin  the server's decoder (speculate.Speculator, lookup fallback off: the pure drafter),
           in this process, at depth 0 and each depth;
  vllm     vllm.LLM with speculative_config {"method": "eagle3", "model": <the drafter's vLLM
           export>, "num_speculative_tokens": d} (+ "parallel_drafting": true where the export
           is a P-EAGLE drafter; method "dflash" for a block, DFlash, drafter:
           serve.vllm.eagle3_speculative_config), one engine per depth
           (and depth 0 without speculation), each held by a Ray actor in vLLM's environment
           (engine.vllm.runtime_env); per-position acceptance from vLLM's spec-decode counters.

Where torch sees CUDA (or gpus=1) both run on one GPU: the builtin verifier on it in this
process, the vLLM actors each on a 1/arms share of it (Ray num_gpus) with vLLM's CUDA defaults
(CUDA graphs, torch.compile) and VLLM_GPU_SHARE / arms of its memory (gpu_memory_utilization;
all arms live for the whole bench), started one after another. Sized for small verifiers (the
embedded default): every arm holds a copy of the verifier. Without CUDA: the CPU engines.

Both see the same chat-templated token ids (vLLM gets prompt_token_ids) and the same dtype
(engine.vllm.engine_dtype: bf16 on GPUs and where the CPU multiplies bf16 natively, else fp32).
Every arm runs every prompt, in an order rotating per prompt (bench serve's interleaving, so
machine drift hits the arms alike), after one warm-up prompt; only the generate calls are timed.
Next to them the teacher-forced estimate from the drafter's meta.json (final_metrics
eval/cond_acc_k, eval/p_k: the held-out split of its own training data). Reported per depth and
engine: per-position acceptance (unconditional p_k = P(drafts 1..k+1 accepted), conditional
a_k), tokens per verify round, tokens/s, speedup over the engine's own depth 0, outputs
identical to depth 0 and between engines (prompts), the binomial standard error of each
position, and the positions where the engines differ by more than 2 standard errors of the
difference.
Writes <out>/engines.json + engines.png.

    eagle3-ray bench engines --drafter runs/demo_bf16/train/drafter --samples 4 --max-tokens 32 \\
        --depths 3 --out /tmp/bench                                  # a few minutes on 2 cores
"""
from __future__ import annotations

import math
import os
import time

ENGINE_DEPTHS = (3, 8)
VLLM_GPU_SHARE = 0.5    # of the GPU's memory, for all vLLM arms together (the rest: the builtin)
PAUSE_S = 0.25          # between arms, untimed: the previous arm's OpenMP threads stop spinning
ENGINES = ("builtin", "vllm")


class VllmArm:
    """One vllm.LLM (the embedded verifier, speculating with `spec`, the speculative_config of
    the drafter's export, or None: depth 0), in vLLM's environment. generate() decodes one
    prompt greedily and returns its tokens, wall time and the spec-decode counters it added
    (vLLM's Prometheus counters, read before and after)."""

    def __init__(self, model: str, spec: dict | None, engine_args: dict):
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM
        self.depth = int(spec["num_speculative_tokens"]) if spec else 0
        self.llm = LLM(model=model, tokenizer=model, speculative_config=spec,
                       enable_prefix_caching=False, disable_log_stats=False, seed=0,
                       **engine_args)
        self.facts = {"vllm": vllm.__version__, "startup_s": time.perf_counter() - t0,
                      "pid": os.getpid(), "speculative_config": spec,
                      "engine_args": engine_args}

    def info(self) -> dict:
        return self.facts

    def counters(self) -> dict:
        """vLLM's spec-decode counters now (all zero without speculation)."""
        from vllm.v1.metrics.reader import Counter, Vector
        got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_at": [0] * self.depth}
        names = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
        for m in self.llm.get_metrics():
            if isinstance(m, Counter) and m.name in names:
                got[names[m.name]] += int(m.value)
            elif isinstance(m, Vector) and m.name == \
                    "vllm:spec_decode_num_accepted_tokens_per_pos":
                for k, v in enumerate(m.values[:self.depth]):
                    got["accepted_at"][k] += int(v)
        return got

    def generate(self, prompt: list[int], max_tokens: int, eos_ids: list[int]) -> dict:
        from vllm import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                                stop_token_ids=list(eos_ids))
        before = self.counters()
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        after = self.counters()
        tokens = list(out.outputs[0].token_ids)
        while tokens and tokens[-1] in eos_ids:      # the builtin leaves EOS out
            tokens.pop()
        ttft = getattr(out.metrics, "first_token_latency", None) if out.metrics else None
        delta = {k: (after[k] - before[k]) if k != "accepted_at"
                 else [a - b for a, b in zip(after[k], before[k])] for k in after}
        return {"tokens": tokens, "wall_s": wall, "prefill_s": ttft or 0.0, **delta}


# --- the two engines' totals -> rows ---------------------------------------------------------

def _totals(width: int) -> dict:
    """An arm's running totals (bench serve's layout: serving._add_run fills the builtin's)."""
    return {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "accepted": 0,
            "drafted": 0, "verify_s": 0.0, "draft_s": 0.0, "outputs": [], "lookup_rounds": 0,
            "drafted_at": [0] * width, "accepted_at": [0] * width}


def _add_vllm(s: dict, got: dict, depth: int) -> None:
    """Add one prompt's vLLM run: rounds = verify steps with drafts (depth 0: one per token
    after the first), each drafted `depth` positions (vLLM's num_draft_tokens tells if not)."""
    s["tokens"] += len(got["tokens"])
    s["wall_s"] += got["wall_s"]
    s["prefill_s"] += got["prefill_s"]
    s["outputs"].append(got["tokens"])
    if depth:
        s["rounds"] += got["drafts"]
        s["drafted"] += got["draft_tokens"]
        s["accepted"] += got["accepted"]
        for k in range(depth):
            s["drafted_at"][k] += got["drafts"]
            s["accepted_at"][k] += got["accepted_at"][k]
    else:
        s["rounds"] += max(0, len(got["tokens"]) - 1)


def se(p: float | None, n: int) -> float | None:
    """Binomial standard error of a rate p over n trials."""
    return math.sqrt(p * (1 - p) / n) if p is not None and n > 0 else None


def positions(drafted_at: list[int], accepted_at: list[int], depth: int) -> list[dict]:
    """Per draft position k (0-based): unconditional p_k = accepted_k / drafted_k and
    conditional a_k = accepted_k / accepted_{k-1} (a_0 = p_0), each with its binomial SE."""
    out = []
    for k in range(depth):
        n = drafted_at[k]
        p = accepted_at[k] / n if n else None
        m = accepted_at[k - 1] if k else n                     # trials of a_k
        c = accepted_at[k] / m if m else None
        out.append({"position": k + 1, "drafted": n, "accepted": accepted_at[k],
                    "p": p, "p_se": se(p, n), "cond": c, "cond_se": se(c, m), "cond_n": m})
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _row(depth: int, s: dict, base: dict, prompts: int) -> dict:
    """One engine's depth: its totals against that engine's depth 0 (`base`)."""
    decode_s = s["wall_s"] - s["prefill_s"]
    tps, base_tps = s["tokens"] / s["wall_s"], base["tokens"] / base["wall_s"]
    same = [a == b for a, b in zip(s["outputs"], base["outputs"])]
    row = {"depth": depth, "tokens": s["tokens"], "wall_s": s["wall_s"],
           "prefill_s": s["prefill_s"], "tokens_per_s": tps, "speedup": tps / base_tps,
           "decode_tokens_per_s": ((s["tokens"] - prompts) / decode_s
                                   if s["prefill_s"] and decode_s > 0 else None),
           "rounds": s["rounds"], "drafted": s["drafted"], "accepted": s["accepted"],
           "tokens_per_round": (s["accepted"] + s["rounds"]) / max(1, s["rounds"]),
           "identical_to_depth0": sum(same), "mismatched_prompts_vs_depth0":
               [j for j, ok in enumerate(same) if not ok],
           "positions": positions(s["drafted_at"], s["accepted_at"], depth),
           "outputs": s["outputs"]}
    if depth and s["drafted"] != s["rounds"] * depth:
        row["note"] = (f"{s['drafted']} draft tokens in {s['rounds']} rounds: not every round "
                       f"drafted {depth} (drafted_at assumes it)")
    return row


def compare_positions(b: list[dict], v: list[dict], z: float = 2.0) -> list[dict]:
    """Builtin against vLLM per position: differences in p and a, the standard error of each
    difference (the two binomial SEs combined) and whether it exceeds z of them."""
    out = []
    for x, y in zip(b, v):
        row = {"position": x["position"]}
        for key in ("p", "cond"):
            if x[key] is None or y[key] is None:
                row.update({f"{key}_diff": None, f"{key}_se_diff": None, f"{key}_flag": False})
                continue
            d = x[key] - y[key]
            s = math.hypot(x[f"{key}_se"] or 0.0, y[f"{key}_se"] or 0.0)
            row.update({f"{key}_diff": d, f"{key}_se_diff": s,
                        f"{key}_flag": abs(d) > z * s if s > 0 else d != 0})
        out.append(row)
    return out


def teacher_forced(meta: dict) -> dict:
    """The drafter's teacher-forced held-out figures from meta.json final_metrics: per
    position k the conditional acceptance eval/cond_acc_k and the unconditional eval/p_k (as
    many positions as training evaluated), eval/accept_len, and tau(d) from the conditionals."""
    from eagle3_ray.train import ttt
    fm = meta.get("final_metrics") or {}
    cond, p, k = [], [], 0
    while f"eval/cond_acc_{k}" in fm:
        cond.append(fm[f"eval/cond_acc_{k}"])
        p.append(fm.get(f"eval/p_{k}"))
        k += 1
    return {"cond_acc": cond, "p": p, "accept_len": fm.get("eval/accept_len"),
            "tau_by_depth": ttt.accept_lengths(cond), "step": fm.get("step"),
            "source": "meta.json final_metrics eval/*: the held-out split of the drafter's own "
                      "training data, teacher-forced (the TTT unroll's states), a target "
                      "outside the draft vocab counted as a rejection"}


# --- the bench ---------------------------------------------------------------------------------

def arm_specs(export: str, depths) -> dict:
    """{depth: the speculative_config of the vLLM arm at that depth (None at depth 0)}: eagle3
    with the drafter's export, parallel drafting where the export is a P-EAGLE drafter, method
    dflash where it is a block (DFlash) drafter."""
    from eagle3_ray.serve.vllm import eagle3_speculative_config
    return {d: eagle3_speculative_config(export, d) if d else None for d in depths}


def vllm_setup(arms: int, gpus: int, dtype: str, max_model_len: int,
               threads: int, model: str | None = None) -> tuple[dict, dict]:
    """(vLLM engine arguments, Ray actor options) of each of `arms` VllmArm actors, which live
    side by side for the whole bench. CPU: engine.vllm's CPU sizing (eager on small hosts, KV
    space split over the arms), `threads` OpenMP threads each. CUDA (gpus 1): vLLM's CUDA
    defaults (CUDA graphs, torch.compile) in `dtype`, every arm on a 1/arms share of one GPU
    and VLLM_GPU_SHARE / arms of its memory, the rest left to the builtin verifier."""
    from eagle3_ray.engine import vllm as engine
    kwargs = engine.engine_kwargs(model=model, dtype=dtype, gpus=1 if gpus else 0,
                                  max_model_len=max_model_len, replicas=arms)
    options = {"num_cpus": 0, "runtime_env": engine.runtime_env(threads=threads, gpus=gpus)}
    if gpus:
        kwargs["gpu_memory_utilization"] = round(VLLM_GPU_SHARE / arms, 3)
        options["num_gpus"] = 1 / arms
    return kwargs, options


def _start_vllm(model: str, specs: dict, max_model_len: int, dtype: str, threads: int,
                gpus: int) -> tuple[dict, dict]:
    """({depth: a VllmArm actor}, {depth: its info()}): the engines in vLLM's environment,
    started together on CPU; on a GPU one after another (each sizes its KV cache from the
    memory it sees free while it starts, and another engine starting beside it would skew
    that); waits until all are ready."""
    import ray
    kwargs, options = vllm_setup(len(specs), gpus, dtype, max_model_len, threads, model)
    arm = ray.remote(VllmArm)
    actors = {}
    for d, spec in specs.items():
        actors[d] = arm.options(**options).remote(model, spec, kwargs)
        if gpus:
            ray.get(actors[d].info.remote())
    facts = dict(zip(actors, ray.get([a.info.remote() for a in actors.values()])))
    return actors, facts


def cuda_gpus(gpus: int | None) -> int:
    """The GPUs bench engines runs on: `gpus` (0 or 1) if given, else 1 where torch sees CUDA."""
    if gpus is None:
        import torch
        return 1 if torch.cuda.is_available() else 0
    if gpus not in (0, 1):
        raise ValueError(f"bench engines: gpus {gpus}; it runs on the CPU (0) or one GPU (1)")
    return int(gpus)


def bench_engines(drafter_dir: str, prompts: int = 12, max_tokens: int = 64,
                  depths=ENGINE_DEPTHS, out_dir: str = "runs/bench", dtype: str | None = None,
                  spec: str | None = None, threads: int = 2, address: str | None = None,
                  gpus: int | None = None) -> dict:
    """The builtin decoder and vLLM with the same drafter at depth 0 and each of `depths`
    (module docstring). dtype: bf16 | fp32 (default engine.vllm.engine_dtype: bf16 on GPUs and
    on a CPU with native bf16, else fp32), both engines. threads: each CPU vLLM engine's OpenMP
    threads. gpus: 1 runs both engines on one GPU, 0 on the CPU (default: 1 where torch sees
    CUDA). Starts a local Ray (`address` / $RAY_ADDRESS: that cluster's). Writes
    <out_dir>/engines.json and engines.png; returns the result."""
    import ray
    import torch
    from eagle3_ray.bench import serving
    from eagle3_ray.bench.quality import check_unseen
    from eagle3_ray.bench.stages import cpu_facts, host_flags, save_result
    from eagle3_ray.data import conversations as data
    from eagle3_ray.engine import hf as verifier, vllm as engine
    from eagle3_ray.launch import init_ray
    from eagle3_ray.serve import speculate
    from eagle3_ray.serve.vllm import check_cpu_drafter_layer, ensure_vllm_export
    from eagle3_ray.train.checkpoint import load_trained_drafter
    from types import SimpleNamespace
    t_start = time.perf_counter()
    depths = tuple(sorted({int(d) for d in depths if int(d) > 0}))
    if not depths:
        raise ValueError("bench engines: give at least one depth > 0 (depth 0 always runs)")
    arms_depths = (0,) + depths
    gpus = cuda_gpus(gpus)
    vdtype = engine.engine_dtype(dtype, gpus)               # "bfloat16" | "float32"
    drafter, _, meta = load_trained_drafter(drafter_dir, spec)
    check_unseen(drafter_dir, meta)
    spec = spec or meta["verifier"]
    model_dir = verifier.materialize(spec)                  # what vLLM loads
    export = ensure_vllm_export(SimpleNamespace(drafter=drafter_dir, verifier=model_dir))
    check_cpu_drafter_layer(model_dir, export, gpus)
    # builtin side, in this process
    tok = verifier.load_tokenizer(spec)
    model = verifier.load_verifier(spec, dtype=getattr(torch, vdtype), num_gpus=gpus)
    dec = speculate.Speculator(model, drafter.eval())      # patches `model` (batch invariance)
    eos = list(verifier.eos_ids(model, tok))
    sp = speculate.SamplingParams(max_tokens=max_tokens, eos_ids=tuple(eos))
    ps = data.heldout_prompts(tok, prompts)
    # vLLM side, one actor per depth
    init_ray(address, num_cpus=2)
    max_len = max(map(len, ps)) + max_tokens + max(depths) + 16
    max_len = max(1024, -(-max_len // 256) * 256)
    t0 = time.perf_counter()
    actors, facts = _start_vllm(model_dir, arm_specs(export, arms_depths), max_len, vdtype,
                                threads, gpus)
    startup_s = time.perf_counter() - t0
    device = torch.cuda.get_device_name(0) if gpus else "cpu"
    print(f"[bench engines] {len(actors)} vLLM engines ready in {startup_s:.0f}s "
          f"(vLLM {facts[0]['vllm']}, {vdtype}, {device}); {len(ps)} prompts x {max_tokens} "
          "tokens", flush=True)
    width = max(depths)
    runs = {e: {d: _totals(width) for d in arms_depths} for e in ENGINES}
    names = [(e, d) for e in ENGINES for d in arms_depths]
    try:
        for i, prompt in enumerate([ps[0]] + ps):            # the first once more: warm-up
            order = names[i % len(names):] + names[:i % len(names)]
            for e, d in order:
                if e == "builtin":
                    t1, out, rounds = time.perf_counter(), [], []
                    for r in dec.generate(prompt, sp, d):     # lookup=None: the pure drafter
                        out += r.tokens
                        rounds.append(r)
                    wall = time.perf_counter() - t1
                    if i > 0:
                        serving._add_run(runs[e][d], out, rounds, wall, [])
                else:
                    got = ray.get(actors[d].generate.remote(prompt, max_tokens, eos))
                    if i > 0:
                        _add_vllm(runs[e][d], got, d)
                time.sleep(PAUSE_S)
            print(f"[bench engines] prompt {i}/{len(ps)} done", flush=True)
    finally:
        for a in actors.values():
            ray.kill(a)
    result = {"bench": "engines", "verifier": spec, "verifier_dir": model_dir,
              "drafter": drafter_dir, "drafter_ttt_steps": meta.get("ttt_steps"),
              "drafter_steps": meta.get("steps"), "vllm_export": export,
              "prompts": len(ps), "max_tokens": max_tokens, "depths": list(depths),
              "dtype": vdtype, "gpus": gpus, "device": device, "host": host_flags(),
              "cpu": cpu_facts(),
              "torch_threads": torch.get_num_threads(), "vllm_threads": threads,
              "vllm": {str(d): f for d, f in facts.items()}, "vllm_startup_s": startup_s,
              "builtin_exact": dec.exact, "teacher_forced": teacher_forced(meta)}
    result.update(summarize(runs, arms_depths, len(ps)))
    against_teacher(result)
    result["total_s"] = time.perf_counter() - t_start
    result["note"] = (
        "greedy, batch 1, both engines in the same dtype on the same chat-templated prompt ids "
        "(bench serve's held-out prompts); arms interleaved per prompt in a rotating order after "
        "one warm-up prompt; only the generate calls timed (vLLM's inside its actor). "
        "positions[k]: p = P(drafts 1..k+1 all accepted) per verify round, cond = p_k / p_{k-1}; "
        "*_se: binomial standard error; compare.positions flags a position where the engines "
        "differ by more than 2 standard errors of the difference (the two SEs combined; both "
        "engines decode the same prompts, so this is the noise of the prompt sample, not a "
        "paired test); cond_off_teacher: positions whose served a_k lies more than 2 of its "
        "SEs from the teacher-forced one. tokens_per_round = (accepted + rounds) / rounds; "
        "speedup: tokens/s over that engine's depth 0; decode_tokens_per_s leaves out the "
        "prefill (vLLM: its time to first token). vLLM's acceptance from its spec-decode "
        "counters (vllm:spec_decode_*), read before and after each request. teacher_forced: "
        "meta.json final_metrics.")
    save_result(out_dir, "engines", result, plot_engines)
    print_engines(result)
    print(f"[bench engines] {time.perf_counter() - t_start:.0f}s -> {out_dir}/engines.json, "
          f"{out_dir}/engines.png")
    return result


def summarize(runs: dict, arms_depths, prompts: int) -> dict:
    """engines.json "runs" (engine -> depth -> row) and "compare" (depth -> the engines side by
    side: identical prompts, per-position differences and flags)."""
    rows = {e: {str(d): _row(d, runs[e][d], runs[e][0], prompts) for d in arms_depths}
            for e in ENGINES}
    compare = {}
    for d in arms_depths:
        b, v = rows["builtin"][str(d)], rows["vllm"][str(d)]
        div = [first_divergence(x, y) for x, y in zip(b["outputs"], v["outputs"])]
        pos = compare_positions(b["positions"], v["positions"])
        compare[str(d)] = {
            "identical_prompts": sum(x is None for x in div), "prompts": len(div),
            "first_divergence": {str(j): x for j, x in enumerate(div) if x is not None},
            "positions": pos,
            "flagged_positions": [r["position"] for r in pos if r["p_flag"] or r["cond_flag"]],
            "tokens_per_round": {"builtin": b["tokens_per_round"],
                                 "vllm": v["tokens_per_round"]},
            "speedup": {"builtin": b["speedup"], "vllm": v["speedup"]}}
    return {"runs": rows, "compare": compare}


def against_teacher(result: dict, z: float = 2.0) -> None:
    """Each served position beside the teacher-forced one (result["teacher_forced"], taken as
    exact: thousands of tokens): tf_p, tf_cond and whether the served conditional acceptance
    lies more than z of its SEs from it; per depth and engine, "cond_off_teacher" lists those
    positions."""
    tf = result["teacher_forced"]
    for e, rows in result["runs"].items():
        for row in rows.values():
            off = []
            for p in row["positions"]:
                k = p["position"] - 1
                p["tf_p"] = tf["p"][k] if k < len(tf["p"]) else None
                p["tf_cond"] = tf["cond_acc"][k] if k < len(tf["cond_acc"]) else None
                if p["tf_cond"] is not None and p["cond"] is not None and p["cond_se"]:
                    p["cond_vs_tf_z"] = (p["cond"] - p["tf_cond"]) / p["cond_se"]
                    if abs(p["cond_vs_tf_z"]) > z:
                        off.append(p["position"])
            row["cond_off_teacher"] = off


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_engines(result: dict) -> None:
    """The compact table: per depth and engine, then the gap per depth."""
    tf = result["teacher_forced"]
    print(f"[bench engines] {result['prompts']} prompts x {result['max_tokens']} tokens, "
          f"{result['dtype']}, host {' '.join(result['host'])}; drafter ttt "
          f"{result['drafter_ttt_steps']}")
    print(f"{'engine':8} {'depth':>5} {'tok/s':>6} {'x d0':>5} {'tau':>5} {'same d0':>7}  "
          f"p_k (unconditional) | a_k (conditional)")
    for d in ["0"] + [str(x) for x in result["depths"]]:
        for e in ENGINES:
            r = result["runs"][e][d]
            ps = " ".join(_fmt(p["p"]) for p in r["positions"])
            cs = " ".join(_fmt(p["cond"]) for p in r["positions"])
            print(f"{e:8} {d:>5} {r['tokens_per_s']:6.1f} {r['speedup']:5.2f} "
                  f"{r['tokens_per_round']:5.2f} {r['identical_to_depth0']:>3}/"
                  f"{result['prompts']:<3}  {ps}{' | ' + cs if cs else ''}")
        k = int(d)
        if k:
            p = [x for x in tf["p"][:k]]
            print(f"{'teacher':8} {d:>5} {'':6} {'':5} "
                  f"{_fmt(tf['tau_by_depth'][k] if k < len(tf['tau_by_depth']) else None):>5} "
                  f"{'':7}  {' '.join(_fmt(x) for x in p)} | "
                  f"{' '.join(_fmt(x) for x in tf['cond_acc'][:k])}")
        c = result["compare"][d]
        off = "" if not k else "; a_k off teacher-forced > 2 SE: " + ", ".join(
            f"{e} {result['runs'][e][d].get('cond_off_teacher') or 'none'}" for e in ENGINES)
        print(f"{'':8} {d:>5} engines identical on {c['identical_prompts']}/{c['prompts']} "
              f"prompts; engines apart > 2 SE at: {c['flagged_positions'] or 'none'}{off}")


def plot_engines(result: dict, path: str) -> None:
    """One panel per depth: per-position unconditional acceptance bars per engine (±1 SE),
    conditional acceptance as dots, the teacher-forced p_k (solid) and a_k (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depths = result["depths"]
    tf = result["teacher_forced"]
    fig, axes = plt.subplots(1, len(depths), figsize=(max(7.0, 5.5 * len(depths)), 4.4),
                             squeeze=False)
    colors = {"builtin": "#37a", "vllm": "#e83"}
    for ax, d in zip(axes[0], depths):
        x = list(range(1, d + 1))
        for j, e in enumerate(ENGINES):
            r = result["runs"][e][str(d)]
            pos = r["positions"]
            xs = [k + (j - 0.5) * 0.38 for k in x]
            ax.bar(xs, [p["p"] or 0 for p in pos], width=0.38, color=colors[e], alpha=0.8,
                   yerr=[p["p_se"] or 0 for p in pos], capsize=2,
                   label=f"{e}: tau {r['tokens_per_round']:.2f}, x{r['speedup']:.2f}")
            ax.plot(xs, [p["cond"] if p["cond"] is not None else float("nan") for p in pos],
                    "o", color=colors[e], mec="k", ms=4)
        n = min(d, len(tf["p"]))
        if n:
            ax.plot(x[:n], tf["p"][:n], "-", color="#2a6", label="teacher-forced p_k")
            ax.plot(x[:n], tf["cond_acc"][:n], "--", color="#2a6",
                    label="teacher-forced a_k (dots: served a_k)")
        c = result["compare"][str(d)]
        ax.set_title(f"depth {d}: engines identical on {c['identical_prompts']}/{c['prompts']}"
                     f" prompts, apart > 2 SE at {c['flagged_positions'] or 'none'}", fontsize=9)
        ax.set_xlabel("draft position"), ax.set_ylabel("acceptance")
        ax.set_xticks(x), ax.set_ylim(0, 1), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.suptitle(f"{result['drafter']} (ttt {result['drafter_ttt_steps']}), "
                 f"{result['prompts']} prompts x {result['max_tokens']} tokens, "
                 f"{result['dtype']}\nhost {' '.join(result['host'])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
