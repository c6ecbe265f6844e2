"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

bench quality / bench recipe (drafters compared by served acceptance): see quality.py.
bench serve (the server's decoder at each depth, beside transformers' own): see serving.py.
bench storage (bf16 vs fp8_e4m3 hidden states: bytes/token, drafter accuracy): its block below.

bench extract: the Ray Data extraction pipeline against a plain transformers forward loop over
the same samples that computes what the pipeline stores (the 3 aux states and the last one in
bf16, the full-vocabulary argmax per position), with the same verifier, tokens, dtype and torch
threads; the loop does no I/O, no tokenization, no Ray. Repeats interleave the two (loop,
pipeline, loop, pipeline, ...); the headline is the median of the per-repeat ratios (target
>= 0.9). Writes <out>/extract.json and <out>/extract.png.

    eagle3-ray bench extract --samples 32 --max-length 256 --repeats 1
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import ttt


def save_result(out_dir: str, name: str, result: dict, plot) -> None:
    """<out_dir>/<name>.json and <name>.png (plot(result, path))."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(out_dir, f"{name}.png"))


def plain_loop(spec: str, seqs: list[list[int]], layer_ids: list[int], threads: int) -> dict:
    """What a user would write to get what the pipeline stores per sample: load the model,
    forward each sample with output_hidden_states=True (the 3 aux states) and a hook on the
    final norm (the last state before it), argmax of the full-vocabulary logits (target_ids),
    the 4 states in bf16. Same dtype (load_verifier's) and torch threads as the extractor."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        model = verifier.load_verifier(spec)
        load_s = time.perf_counter() - t0
        last = {}
        hook = verifier.final_norm(model).register_forward_pre_hook(
            lambda module, args: last.update(h=args[0]))
        t1 = time.perf_counter()
        with torch.inference_mode():
            for ids in seqs:
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True,
                            use_cache=False)
                hs = out.hidden_states
                _ = [hs[i].to(torch.bfloat16) for i in layer_ids] + [last["h"].to(torch.bfloat16)]
                _ = out.logits.argmax(-1)                                  # [1, S] target_ids
        loop_s = time.perf_counter() - t1
        hook.remove()
    finally:
        torch.set_num_threads(before)
    tokens = sum(len(s) for s in seqs)
    return {"load_s": load_s, "loop_s": loop_s, "tokens": tokens, "threads": threads,
            "dtype": str(model.dtype).removeprefix("torch."),
            "tokens_per_s": tokens / loop_s, "tokens_per_s_with_load": tokens / (load_s + loop_s)}


def pipeline(spec: str, samples: int, max_length: int, engine: str = "hf",
             dtype: str | None = None) -> dict:
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    out = tempfile.mkdtemp(prefix="bench-extract-")
    try:
        t0 = time.perf_counter()
        m = run_extract(ExtractConfig(verifier=spec, output=out, sample_limit=samples,
                                      max_length=max_length, batch_rows=16, engine=engine,
                                      dtype=dtype))
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    s, r = m["summary"], m["summary"]["this_run"]
    return {"wall_s": wall, "tokens": s["tokens"], "samples": s["samples"],
            "tokens_per_s": s["tokens"] / wall, "actor_init_s": r["actor_init_s"],
            "actor_batch_s": r["actor_batch_s"],
            "actor_tokens_per_s": s["tokens"] / r["actor_batch_s"],
            "outside_batches_s": wall - r["actor_batch_s"],   # driver + actor start, finalize
            "bytes_per_token": s["bytes_per_token"],
            "hidden_bytes_per_token": s["hidden_bytes_per_token"]}


def bench_extract(samples: int = 128, max_length: int = 512, out_dir: str = "runs/bench",
                  repeats: int = 3, spec: str = verifier.EMBEDDED_VERIFIER) -> dict:
    tok, cfg = verifier.load_tokenizer(spec), verifier.load_config(spec)
    layer_ids = verifier.default_aux_layer_ids(verifier.text_config(cfg).num_hidden_layers)
    seqs = []
    for _, messages in data.iter_samples([data.EMBEDDED_SHAREGPT], samples):
        try:
            seqs.append(data.tokenize_conversation(tok, messages, max_length)[0])
        except data.SkipRecord:
            pass
    from eagle3_ray.extract.pipeline import ExtractConfig, replica_threads
    threads = replica_threads(ExtractConfig())  # the extractor actor's torch threads
    runs = {"plain_loop": [], "pipeline": []}
    for r in range(repeats):
        runs["plain_loop"].append(plain_loop(spec, seqs, layer_ids, threads))
        runs["pipeline"].append(pipeline(spec, samples, max_length))
        print(f"[bench] repeat {r}: loop {runs['plain_loop'][-1]['tokens_per_s']:.0f} tok/s "
              f"(with load {runs['plain_loop'][-1]['tokens_per_s_with_load']:.0f}), pipeline "
              f"{runs['pipeline'][-1]['tokens_per_s']:.0f} tok/s end to end")
    best_loop = max(runs["plain_loop"], key=lambda x: x["tokens_per_s"])
    best_pipe = max(runs["pipeline"], key=lambda x: x["tokens_per_s"])
    assert best_pipe["tokens"] == best_loop["tokens"], "pipeline and loop saw different tokens"
    # Each repeat runs the two back to back: their ratio cancels slow drifts in machine load.
    paired = sorted(p["tokens_per_s"] / l["tokens_per_s_with_load"]
                    for p, l in zip(runs["pipeline"], runs["plain_loop"]))
    result = {
        "bench": "extract", "verifier": spec, "samples": len(seqs), "max_length": max_length,
        "tokens": best_loop["tokens"], "torch_threads": threads, "dtype": best_loop["dtype"],
        "cpu_count": os.cpu_count(), "cpu": cpu_facts(), "repeats": runs,
        "ratio_paired_median": paired[len(paired) // 2] if len(paired) % 2
        else (paired[len(paired) // 2 - 1] + paired[len(paired) // 2]) / 2,
        "ratio_paired": paired,
        "ratio_best_vs_best": best_pipe["tokens_per_s"] / best_loop["tokens_per_s_with_load"],
        "ratio_steady_state": best_pipe["actor_tokens_per_s"] / best_loop["tokens_per_s"],
        "ratio_steady_paired": sorted(p["actor_tokens_per_s"] / l["tokens_per_s"]
                                      for p, l in zip(runs["pipeline"], runs["plain_loop"])),
        "note": "ratios: pipeline tokens/s end to end (actor start + model load + tokenize + "
                "forward + lm_head argmax + Parquet write + manifest) over the plain loop's "
                "(model load + forward + lm_head argmax, the states in bf16). paired = each "
                "repeat's pipeline vs the loop run just before it; steady_state = the extractor "
                "actor's time inside its batches vs the loop's forwards. Target >= 0.9.",
    }
    save_result(out_dir, "extract", result, _plot)
    print(f"[bench] extract: pipeline / plain loop = {result['ratio_paired_median']:.2f} "
          f"(median of paired repeats {[round(x, 2) for x in paired]}), "
          f"{result['ratio_best_vs_best']:.2f} best vs best, "
          f"{result['ratio_steady_state']:.2f} steady state "
          f"-> {out_dir}/extract.json")
    return result


def bench_extract_engines(samples: int = 128, max_length: int = 512, out_dir: str = "runs/bench",
                          repeats: int = 3, spec: str = verifier.EMBEDDED_VERIFIER,
                          dtype: str | None = None) -> dict:
    """Extraction tokens/s with the verifier held by vLLM against transformers (the same Ray Data
    pipeline, conversations and dtype), back to back in each repeat: `bench extract --engines`."""
    import statistics
    from eagle3_ray.engine import vllm as vllm_engine
    dtype = vllm_engine.engine_dtype(dtype)            # the host's: both engines run the same
    runs = {"hf": [], "vllm": []}
    for r in range(repeats):
        for engine in runs:
            runs[engine].append(pipeline(spec, samples, max_length, engine, dtype))
        print(f"[bench] repeat {r}: " + ", ".join(
            f"{e} {runs[e][-1]['tokens_per_s']:.0f} tok/s end to end "
            f"({runs[e][-1]['actor_tokens_per_s']:.0f} in batches, start-up "
            f"{runs[e][-1]['actor_init_s']:.0f}s)" for e in runs))
    paired = sorted(v["tokens_per_s"] / h["tokens_per_s"] for v, h in zip(runs["vllm"], runs["hf"]))
    steady = sorted(v["actor_tokens_per_s"] / h["actor_tokens_per_s"]
                    for v, h in zip(runs["vllm"], runs["hf"]))
    result = {
        "bench": "extract_engines", "verifier": spec, "samples": samples,
        "max_length": max_length, "dtype": dtype, "tokens": runs["hf"][0]["tokens"],
        "cpu_count": os.cpu_count(), "cpu": cpu_facts(), "repeats": runs,
        "ratio_paired": paired, "ratio_paired_median": statistics.median(paired),
        "ratio_steady_paired": steady, "ratio_steady_median": statistics.median(steady),
        "note": "vLLM over HF tokens/s, each repeat's two runs back to back. End to end: "
                "driver, actor start (vLLM: its engine, ~25-40 s on 2 cores), tokenize, "
                "forwards, Parquet, manifest. Steady: the extractor actor's time inside its "
                "batches only."}
    save_result(out_dir, "extract_engines", result, _plot_engines)
    print(f"[bench] extract engines ({dtype}): vLLM / HF = {result['ratio_paired_median']:.2f} "
          f"end to end, {result['ratio_steady_median']:.2f} inside batches (paired medians) "
          f"-> {out_dir}/extract_engines.json")
    return result


def _plot_engines(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (engine, color) in enumerate((("hf", "#999"), ("vllm", "#3a7"))):
        runs = result["repeats"][engine]
        for j, key in enumerate(("tokens_per_s", "actor_tokens_per_s")):
            v = sorted(r[key] for r in runs)[len(runs) // 2]
            ax.bar(j * 3 + i, v, color=color, label=engine if j == 0 else None)
            ax.text(j * 3 + i, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set_xticks([0.5, 3.5], ["end to end", "inside batches"])
    ax.set_ylabel("tokens / s (median of repeats)")
    ax.set_title(f"extract: HF vs vLLM, {result['dtype']}, {result['tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loop = max(result["repeats"]["plain_loop"], key=lambda x: x["tokens_per_s"])
    pipe = max(result["repeats"]["pipeline"], key=lambda x: x["tokens_per_s"])
    labels = ["plain loop\n(forwards + argmax)", "plain loop\n(with model load)",
              "Ray Data pipeline\n(end to end)"]
    vals = [loop["tokens_per_s"], loop["tokens_per_s_with_load"], pipe["tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, vals, color=["#999", "#bbb", "#3a7"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"extract: {result['verifier']}, {result['samples']} samples, "
                 f"{result['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- bench train ----------------------------------------------------------------------------
# One optimizer step of the TTT unroll (forward + backward + AdamW) at SmolLM2 shapes with random
# weights, per ttt_steps, each in a fresh process so its memory high-water mark is its own.
#
#     python -c "from eagle3_ray.bench.stages import bench_train; \
#                bench_train(ttt_steps=(1, 2), seq=256)"

def _status_mib(field: str) -> float:
    """VmRSS / VmHWM of this process from /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def synthetic_loss_mask(seq: int, generator: torch.Generator) -> torch.Tensor:
    """A chat-like mask: prompt runs (0) of 16-80 tokens, assistant runs (1) of 48-240 -> ~75%."""
    mask, pos, turn = torch.zeros(seq, dtype=torch.long), 0, 0
    while pos < seq:
        lo, hi = (16, 80) if turn % 2 == 0 else (48, 240)
        n = int(torch.randint(lo, hi + 1, (1,), generator=generator))
        mask[pos:pos + n] = turn % 2
        pos, turn = pos + n, turn + 1
    return mask  # [S]


def _bench_train_child(ttt_steps: int, shapes: dict, seq: int, steps: int, warmup: int,
                       seed: int, deep_fraction: float = 1.0, drafting: str = "chain") -> dict:
    """Runs in a fresh (spawned) process: build, then time `warmup + steps` optimizer steps of
    the kind's model and loss (train.kinds; a block drafter: a block of ttt_steps drafts,
    anchored at a deep_fraction share of the positions)."""
    import resource
    import statistics
    from eagle3_ray.train import kinds
    from eagle3_ray.train.draft import DraftConfig, Teacher
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    c = DraftConfig(**shapes, drafting=drafting, block_size=ttt_steps)
    h, v, vd, s = c.hidden_size, c.vocab_size, c.draft_vocab_size, seq
    drafter = kinds.model_class(c)(c)
    head = torch.randn(v, h, generator=g) * 0.02                          # verifier lm_head [V, H]
    # Non-draft rows a bit weaker: most teacher argmaxes fall in the draft vocab, as on real data.
    teacher = Teacher(torch.ones(h), head[:vd].clone(), head[vd:] * 0.8, c.rms_norm_eps)
    batch = {"input_ids": torch.randint(0, v, (1, s), generator=g),
             "loss_mask": synthetic_loss_mask(s, g)[None],                # [1, S]
             "attention_mask": torch.ones(1, s, dtype=torch.long),
             "aux_hidden_states": torch.randn(1, s, 3 * h, generator=g).to(torch.bfloat16),
             "last_hidden_states": torch.randn(1, s, h, generator=g).to(torch.bfloat16)}
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    rss_before = _status_mib("VmRSS")
    times, cpu, m = [], [], {}
    for _ in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, m = kinds.loss(drafter, teacher, batch, ttt_steps, deep_fraction=deep_fraction,
                             recompute=False)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _status_mib("VmHWM")
    return {"ttt_steps": ttt_steps, "deep_fraction": deep_fraction, "drafting": drafting,
            "step_s": statistics.median(times[warmup:]),
            "step_times_s": times, "step_cpu_s": statistics.median(cpu[warmup:]),
            "rss_before_mib": rss_before, "peak_mib": peak - rss_before,
            "vm_hwm_mib": peak,
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "valid_positions_step0": m["count"][0], "loss_mask_ones": int(batch["loss_mask"].sum()),
            "torch_threads": torch.get_num_threads()}


def bench_train(out_dir: str = "runs/bench", ttt_steps=(1, 2, 4, 8, 16), hidden: int = 576,
                seq: int = 1024, draft_vocab: int = 8192, heads: int = 9, kv_heads: int = 3,
                head_dim: int = 64, intermediate: int = 1536, vocab: int = 49152,
                steps: int = 3, warmup: int = 1, seed: int = 0,
                deep_fraction: float = 0.25, parallel: bool = False,
                block: bool = False) -> dict:
    """Step time and peak memory of TTT training vs ttt_steps (fp32, CPU, B=1, random weights).
    Peak memory = the process's RSS high-water mark (VmHWM, = ru_maxrss of the fresh process)
    minus its RSS right before the first step: the step's own memory (activations, grads, AdamW
    state). `results`: every step on all positions; `deep_results` (ttt_steps > 1): the steps
    past 0 on a `deep_fraction` share of them. parallel: the same for a parallel (P-EAGLE)
    drafter at each ttt_steps >= 2 (`parallel_results`, `parallel_deep_results`), set against
    the chain's at the same depth. block: a block (DFlash) drafter of 2 layers whose block
    holds ttt_steps drafts, anchored at every position and at a deep_fraction share of them
    (`block_results`, `block_deep_results`), against the chain at the same depth and share.
    Writes <out_dir>/train.json and train.png."""
    import multiprocessing as mp
    shapes = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab,
                  draft_vocab_size=draft_vocab)
    results, deep_results = [], []
    ctx = mp.get_context("spawn")
    runs = [(k, 1.0, "chain") for k in ttt_steps] + [
        (k, deep_fraction, "chain") for k in ttt_steps if k > 1 and deep_fraction < 1]
    chain_runs = list(runs)
    if parallel:
        runs += [(k, f, "parallel") for k, f, _ in chain_runs if k > 1]
    if block:
        runs += [(k, f, "block") for k, f, _ in chain_runs if k > 1]
    par, par_deep, blk, blk_deep = [], [], [], []
    for k, f, kind in runs:
        with ctx.Pool(1) as pool:  # a fresh interpreter per configuration
            r = pool.apply(_bench_train_child, (k, shapes, seq, steps, warmup, seed, f, kind))
        lists = {"parallel": (par, par_deep), "block": (blk, blk_deep)}.get(
            kind, (results, deep_results))
        lists[f < 1.0].append(r)                     # (all positions, a deep share)
        print(f"[bench] train {kind} ttt_steps={k} deep_fraction={f}: "
              f"{r['step_s'] * 1000:.0f} ms/step "
              f"({r['step_cpu_s'] * 1000:.0f} ms CPU), "
              f"peak +{r['peak_mib']:.0f} MiB over {r['rss_before_mib']:.0f} MiB")
    base = results[0]
    full = {r["ttt_steps"]: r for r in results}
    result = {
        "bench": "train", "shapes": {**shapes, "seq": seq, "batch": 1, "dtype": "float32"},
        "steps": steps, "warmup": warmup, "cpu_count": os.cpu_count(), "results": results,
        "time_ratio_vs_first": {r["ttt_steps"]: r["step_s"] / base["step_s"] for r in results},
        "cpu_time_ratio_vs_first": {r["ttt_steps"]: r["step_cpu_s"] / base["step_cpu_s"]
                                    for r in results},
        "memory_ratio_vs_first": {r["ttt_steps"]: r["peak_mib"] / base["peak_mib"]
                                  for r in results},
        "memory_mib_per_extra_step": [
            (b["peak_mib"] - a["peak_mib"]) / (b["ttt_steps"] - a["ttt_steps"])
            for a, b in zip(results, results[1:])],
        "deep_fraction": deep_fraction, "deep_results": deep_results,
        "deep_speedup": {r["ttt_steps"]: full[r["ttt_steps"]]["step_s"] / r["step_s"]
                         for r in deep_results},
        "deep_time_ratio_vs_first": {r["ttt_steps"]: r["step_s"] / base["step_s"]
                                     for r in deep_results},
        **(_kind_vs_chain("parallel", par, par_deep, results, deep_results) if parallel else {}),
        **(_kind_vs_chain("block", blk, blk_deep, results, deep_results) if block else {}),
        "note": "step = ttt_loss forward + backward + AdamW step, median after warm-up (wall; "
                "cpu = process CPU time of all threads, less sensitive to a shared box); peak = "
                "VmHWM of a fresh process minus its RSS before the first step. Targets: memory "
                "at most linear in ttt_steps; time(16)/time(1) <= 10. deep_*: the same with "
                "the steps past 0 on a deep_fraction share of the positions.",
    }
    save_result(out_dir, "train", result, _plot_train)
    print(f"[bench] train -> {out_dir}/train.json")
    return result


def _kind_vs_chain(kind: str, runs, deep, chain, chain_deep) -> dict:
    """bench train's section of a one-forward kind (parallel, block): its runs and their time /
    memory over the chain's at the same ttt_steps and share of positions."""
    def ratios(a, b, key):
        by_k = {r["ttt_steps"]: r for r in b}
        return {r["ttt_steps"]: r[key] / by_k[r["ttt_steps"]][key] for r in a}
    return {f"{kind}_results": runs, f"{kind}_deep_results": deep,
            f"{kind}_time_ratio_vs_chain": ratios(runs, chain, "step_s"),
            f"{kind}_memory_ratio_vs_chain": ratios(runs, chain, "peak_mib"),
            f"{kind}_deep_time_ratio_vs_chain": ratios(deep, chain_deep, "step_s"),
            f"{kind}_deep_memory_ratio_vs_chain": ratios(deep, chain_deep, "peak_mib")}


def _plot_train(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ks = [r["ttt_steps"] for r in result["results"]]
    deep = result.get("deep_results") or []
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(ks, [r["step_s"] for r in result["results"]], "o-", color="#37a", label="all positions")
    if deep:
        a.plot([r["ttt_steps"] for r in deep], [r["step_s"] for r in deep], "s--", color="#7a3",
               label=f"steps past 0 on {result['deep_fraction']:.0%}")
    for kind, color in (("parallel", "#d6a"), ("block", "#e80")):
        for rs, style, what in ((result.get(f"{kind}_results"), "D-", kind),
                                (result.get(f"{kind}_deep_results"), "D--",
                                 f"{kind}, deep share")):
            if rs:
                a.plot([r["ttt_steps"] for r in rs], [r["step_s"] for r in rs], style,
                       color=color, label=what)
                b.plot([r["ttt_steps"] for r in rs], [r["peak_mib"] for r in rs], style,
                       color=color)
    if deep or result.get("parallel_results") or result.get("block_results"):
        a.legend()
    a.set_xlabel("ttt_steps")
    a.set_ylabel("optimizer step (s)")
    a.set_title("step time")
    b.plot(ks, [r["peak_mib"] for r in result["results"]], "o-", color="#a52")
    if deep:
        b.plot([r["ttt_steps"] for r in deep], [r["peak_mib"] for r in deep], "s--", color="#7a3")
    b.set_xlabel("ttt_steps")
    b.set_ylabel("peak memory of a step (MiB)")
    b.set_title("peak memory")
    for ax in (a, b):
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    s = result["shapes"]
    fig.suptitle(f"TTT training, H={s['hidden_size']} S={s['seq']} Vd={s['draft_vocab_size']}, "
                 f"fp32 CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- bench regen -----------------------------------------------------------------------------
# Generation for `extract --regenerate`, three arms on the same prompts (first user turns of
# held-out ShareGPT conversations) and the same greedy settings: transformers' generate one
# prompt at a time (what a user has), its batched generate with left padding (what extract did
# before), and regen.BatchGenerator. Runs are sandwiched (new, batched, plain, batched, new) so
# a drift in machine load hits the arms alike; each arm's tokens/s is over all its runs.
#
#     eagle3-ray bench regen --samples 8 --max-new-tokens 32 --batch 8 --out /tmp/bench

def cpu_facts() -> dict:
    """What decides CPU matmul speed here: the CPU's flags, the ISA torch dispatches to, and
    the environment variables that cap it (an emulated AVX2-only host sets them)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        pass
    return {"avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_tile" in flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": verifier.native_bf16(),
            "env": {k: os.environ[k] for k in ("EAGLE3_RAY_NATIVE_BF16", "EAGLE3_RAY_ONEDNN",
                                               "ATEN_CPU_CAPABILITY",
                                               "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                                               "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                               "OMP_NUM_THREADS")
                    if k in os.environ}}


def host_flags() -> list[str]:
    """cpu_facts as a short label: the CPU flags that decide the fast paths here (avx2,
    avx512f, avx512_bf16, amx) and the variables that cap them."""
    facts = cpu_facts()
    return [k for k in ("avx2", "avx512f", "avx512_bf16", "amx") if facts[k]] + \
        [f"{k}={v}" for k, v in facts["env"].items()]


def bench_regen(prompts: int = 32, max_new_tokens: int = 128, batch: int = 32,
                out_dir: str = "runs/bench", name: str = "regen",
                spec: str = verifier.EMBEDDED_VERIFIER, threads: int = 0) -> dict:
    """Generated tokens/s of each arm, its ratio to the one-prompt-at-a-time loop, and how many
    greedy outputs are identical to that loop's. Writes <out_dir>/<name>.json + .png.
    threads: torch threads (0: torch's default)."""
    from eagle3_ray.extract import regen
    if threads:
        torch.set_num_threads(threads)
    model, tok = verifier.load_verifier(spec), verifier.load_tokenizer(spec)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    eos = verifier.eos_ids(model, tok)
    ps = data.heldout_prompts(tok, prompts)
    groups = regen.length_batches([len(p) for p in ps], [max_new_tokens] * len(ps), 1 << 40,
                                  batch)
    gen = regen.BatchGenerator(model, pad, eos, regen.GenerateConfig(max_batch=batch,
                                                                     token_budget=1 << 40))

    def hf_batched(ps_, m):
        out = [None] * len(ps_)
        for g in regen.length_batches([len(p) for p in ps_], [m] * len(ps_), 1 << 40, batch):
            for i, t in zip(g, regen.hf_generate(model, [ps_[i] for i in g], m, pad, eos,
                                                 batch=len(g))):
                out[i] = t
        return out

    arms = {"plain_generate": lambda ps_, m: regen.hf_generate(model, ps_, m, pad, eos, 1),
            "hf_batched_generate": hf_batched,
            "batch_generator": lambda ps_, m: gen.generate(ps_, m)}
    for fn in arms.values():                              # warm-up: first-call costs
        fn(ps[:2], 4)
    order = ["batch_generator", "hf_batched_generate", "plain_generate", "hf_batched_generate",
             "batch_generator"]
    runs, outputs, load = {k: [] for k in arms}, {}, [os.getloadavg()[0]]
    for k in order:
        t0, c0 = time.perf_counter(), time.process_time()
        got = arms[k](ps, max_new_tokens)
        sec, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = sum(len(t) for t in got)
        runs[k].append({"seconds": sec, "cpu_s": cpu, "new_tokens": n, "tokens_per_s": n / sec,
                        "tokens_per_cpu_s": n / cpu, "loadavg_after": os.getloadavg()[0]})
        outputs.setdefault(k, got)
        load.append(os.getloadavg()[0])
        print(f"[bench] regen {k}: {n} tokens in {sec:.1f}s = {n / sec:.1f} tok/s "
              f"({n / cpu:.1f} per CPU-second; load average {load[-1]:.1f})")

    def common_prefix(a, b):
        return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    ref = outputs["plain_generate"]
    result = {"bench": "regen", "verifier": spec, "dtype": str(model.dtype).replace("torch.", ""),
              "cpu": cpu_facts(), "torch_threads": torch.get_num_threads(),
              "cpu_count": os.cpu_count(), "prompts": len(ps),
              "prompt_tokens": sum(len(p) for p in ps),
              "prompt_len_min_max": [min(len(p) for p in ps), max(len(p) for p in ps)],
              "max_new_tokens": max_new_tokens, "batch": batch,
              "batches": [len(g) for g in groups], "order": order,
              "loadavg_1min": load, "arms": {}}
    for k in arms:
        sec = sum(r["seconds"] for r in runs[k])
        n = sum(r["new_tokens"] for r in runs[k])
        result["arms"][k] = {
            "runs": runs[k], "tokens_per_s": n / sec,
            "tokens_per_cpu_s": n / sum(r["cpu_s"] for r in runs[k]),
            "identical_to_plain": sum(a == b for a, b in zip(outputs[k], ref)),
            "mean_common_prefix_with_plain": sum(common_prefix(a, b) for a, b in
                                                 zip(outputs[k], ref)) / len(ps)}
    plain = result["arms"]["plain_generate"]["tokens_per_s"]
    plain_cpu = result["arms"]["plain_generate"]["tokens_per_cpu_s"]
    for k, r in result["arms"].items():
        r["ratio_to_plain"] = r["tokens_per_s"] / plain
        r["ratio_to_plain_per_cpu_s"] = r["tokens_per_cpu_s"] / plain_cpu
    result["identical_batch_generator_vs_hf_batched"] = sum(
        a == b for a, b in zip(outputs["batch_generator"], outputs["hf_batched_generate"]))
    result["batch_generator_prefill_s"] = gen.stats.prefill_s
    result["note"] = ("tokens/s = generated tokens (EOS included) / wall time of the arm's runs, "
                      "prefill included; runs sandwiched (order); tokens_per_cpu_s = the same over "
                      "this process's CPU time (less sensitive to other load on a shared host); "
                      "greedy outputs compared token for token with the plain loop (bf16 batching "
                      "changes rounding, so near-tied argmaxes can flip; fp32 should agree)")
    save_result(out_dir, name, result, _plot_regen)
    a = result["arms"]
    print(f"[bench] regen ({result['dtype']}, {len(ps)} prompts x {max_new_tokens}, batch "
          f"{batch}): plain {plain:.1f} tok/s; HF batched "
          f"{a['hf_batched_generate']['tokens_per_s']:.1f} "
          f"(x{a['hf_batched_generate']['ratio_to_plain']:.2f}); BatchGenerator "
          f"{a['batch_generator']['tokens_per_s']:.1f} "
          f"(x{a['batch_generator']['ratio_to_plain']:.2f}); identical to plain "
          f"{a['hf_batched_generate']['identical_to_plain']} / "
          f"{a['batch_generator']['identical_to_plain']} of {len(ps)} -> {out_dir}/{name}.json")
    return result


def _plot_regen(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"plain_generate": "HF generate\none prompt at a time",
              "hf_batched_generate": f"HF generate\nbatched {result['batch']}, left-padded",
              "batch_generator": f"regen.BatchGenerator\nbatch {result['batch']}"}
    arms = result["arms"]
    vals = [arms[k]["tokens_per_s"] for k in labels]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.bar(list(labels.values()), vals, color=["#999", "#bbb", "#3a7"])
    for i, k in enumerate(labels):
        ax.text(i, vals[i], f"{vals[i]:.0f} tok/s (x{arms[k]['ratio_to_plain']:.1f})\n"
                f"identical {arms[k]['identical_to_plain']}/{result['prompts']}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(vals) * 1.3)
    ax.set_ylabel("generated tokens / s")
    cpu = result["cpu"]
    ax.set_title(f"regen: {result['prompts']} prompts x {result['max_new_tokens']} new tokens, "
                 f"{result['dtype']}, ISA {cpu['torch_cpu_capability']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- bench storage --------------------------------------------------------------------------
# The same conversations extracted with bf16 and with fp8_e4m3 hidden states (extract
# --hidden-storage): bytes per token on disk, total and hidden states only, against the bf16
# floor 8·H; how far the fp8 states and their teacher are from the bf16 ones; and one drafter
# per storage trained for the same optimizer steps (same seed, TrainConfig defaults otherwise),
# each evaluated teacher-forced on the same held-out split (the bf16 states, which is what a
# served drafter sees, and its own storage's). A second bf16 drafter with another seed measures
# the seed-to-seed noise the accuracy difference is to be read against (noise="auto": only when
# fp8 and bf16 differ by more than 0.01 in held-out position-0 accuracy). Everything resumes.
#
#     eagle3-ray bench storage --samples 48 --max-length 256 --steps 10 --out /tmp/bench

STORAGES = ("bf16", "fp8_e4m3")


def _storage_error(bf16_dir: str, fp8_dir: str, spec: str, rows: int = 16) -> dict:
    """On `rows` samples (those of the bf16 dataset's first part): relative L2 error of the fp8
    states per token vector, and how often the teacher's argmax (lm_head(norm(last))) from fp8
    / bf16 states equals the verifier's own argmax at extraction (target_ids)."""
    import pyarrow.parquet as pq
    from eagle3_ray.data import schema

    def read(path, want=None):
        fs, root = schema.resolve_fs(path)
        out = {}
        for p in schema.list_parts(fs, root):
            for r in pq.read_table(p, filesystem=fs).to_pylist():
                if (r["sample_id"] in want) if want else len(out) < rows:
                    out[r["sample_id"]] = r
            if len(out) >= (len(want) if want else rows):
                break
        return out

    a = read(bf16_dir)
    b = read(fp8_dir, set(a))
    model = verifier.load_verifier(spec)
    norm, head = verifier.final_norm(model), model.get_output_embeddings()
    hidden = verifier.text_config(model.config).hidden_size
    rel = {"aux_hidden_states": [], "last_hidden_states": []}
    agree = {"bf16": 0, "fp8_e4m3": 0}
    tokens = 0
    with torch.inference_mode():
        for sid in sorted(a.keys() & b.keys()):
            ta, tb = schema.decode_row(a[sid], hidden), schema.decode_row(b[sid], hidden)
            for k in rel:
                x, y = ta[k].float(), tb[k].float()                    # [S, (3,) H]
                rel[k].append(((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).flatten())
            for name, t in (("bf16", ta), ("fp8_e4m3", tb)):
                h = t["last_hidden_states"].to(model.dtype)            # [S, H]
                agree[name] += int((head(norm(h)).argmax(-1) == ta["target_ids"]).sum())
            tokens += len(ta["target_ids"])
    return {"rows": len(a.keys() & b.keys()), "tokens": tokens,
            "rel_l2_error_mean": {k: float(torch.cat(v).mean()) for k, v in rel.items()},
            "rel_l2_error_max": {k: float(torch.cat(v).max()) for k, v in rel.items()},
            "teacher_argmax_agrees_with_target_ids": {k: v / max(1, tokens)
                                                      for k, v in agree.items()}}


def bench_storage(conversations: int = 600, max_length: int = 512, steps: int = 150,
                  out_dir: str = "runs/bench", fresh: bool = False, seed: int = 0,
                  noise: str = "auto", noise_seed: int = 1, depth: int = 8,
                  spec: str = verifier.EMBEDDED_VERIFIER) -> dict:
    """Bytes/token and held-out drafter accuracy of bf16 vs fp8_e4m3 hidden-state storage.
    noise: also train a bf16 drafter with `noise_seed` ("always"; "auto": only when the fp8
    and bf16 position-0 accuracies differ by more than 0.01; "never"). Writes
    <out_dir>/storage.json + storage.png; datasets and runs under <out_dir>/storage/."""
    if noise not in ("auto", "always", "never"):
        raise ValueError(f"noise must be auto, always or never, got {noise!r}")
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import evaluate_drafter, run_train
    root = os.path.join(out_dir, "storage")
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    datasets = {}
    for storage in STORAGES:
        path = os.path.join(root, "data", storage)
        m = run_extract(ExtractConfig(verifier=spec, output=path, sample_limit=conversations,
                                      max_length=max_length, batch_rows=32,
                                      hidden_storage=storage))
        s, floor = m["summary"], m["summary"]["bf16_hidden_bytes_per_token"]
        datasets[storage] = {
            "path": path, "format_version": m["format_version"], "samples": s["samples"],
            "tokens": s["tokens"], "bytes": s["bytes"], "bytes_per_token": s["bytes_per_token"],
            "hidden_disk_bytes_per_token": s["hidden_disk_bytes_per_token"],
            "storage_floor_bytes_per_token": s["hidden_bytes_per_token"],
            "bf16_floor_bytes_per_token": floor,
            "bytes_per_token_vs_bf16_floor": s["bytes_per_token"] / floor,
            "hidden_bytes_per_token_vs_bf16_floor": s["hidden_disk_bytes_per_token"] / floor,
            "extract_wall_s": s["this_run"]["wall_s"] if s["this_run"]["samples"] else None}
        print(f"[bench] storage {storage}: {s['bytes_per_token']:.0f} B/token on disk "
              f"(hidden states {s['hidden_disk_bytes_per_token']:.0f}) = "
              f"{s['bytes_per_token'] / floor:.3f} x the bf16 floor 8·H = {floor}", flush=True)
    if len({(d["samples"], d["tokens"]) for d in datasets.values()}) != 1:
        raise RuntimeError(f"{root}/data: the storages hold different samples: {datasets}")
    error = _storage_error(datasets["bf16"]["path"], datasets["fp8_e4m3"]["path"], spec)

    arms = {storage: (storage, seed) for storage in STORAGES}
    noise_arm = f"bf16-seed{noise_seed}"
    if noise == "always":
        arms[noise_arm] = ("bf16", noise_seed)
    runs = {}
    for name, (storage, arm_seed) in _arms_then_noise(arms, noise, noise_arm, noise_seed, runs):
        run_dir = os.path.join(root, name)
        drafter = os.path.join(run_dir, "drafter")
        meta_path = os.path.join(drafter, "meta.json")
        t1, train_s = time.perf_counter(), None          # None: a finished run, reused
        if not (os.path.exists(meta_path) and json.load(open(meta_path))["steps"] >= steps):
            run_train(TrainConfig(dataset=datasets[storage]["path"], output=run_dir,
                                  verifier=spec, max_steps=steps, max_seq_len=max_length,
                                  seed=arm_seed, num_workers=2, cpus_per_worker=0.5))
            train_s = time.perf_counter() - t1
        meta = json.load(open(meta_path))
        row = {"storage": storage, "seed": arm_seed, "steps": meta["steps"],
               "train_wall_s": train_s, "train_loop_s": meta["final_metrics"].get("train_s"),
               "eval": {}}
        for on in dict.fromkeys(("bf16", storage)):      # the served case first, then its own
            ev = evaluate_drafter(drafter, datasets[on]["path"], depth, max_seq_len=max_length)
            cond = [ev[f"cond_acc_{i}"] for i in range(depth)]
            row["eval"][on] = {"acc": [ev[f"acc_{i}"] for i in range(depth)], "cond_acc": cond,
                               "tau": ttt.accept_lengths(cond)[depth],
                               "positions_0": ev["count_0"]}
        runs[name] = row
        e = row["eval"]["bf16"]
        print(f"[bench] storage {name}: {meta['steps']} steps "
              f"({'reused' if train_s is None else f'in {train_s:.0f}s'}); held-out acc0 "
              f"{e['acc'][0]:.4f}, tau({depth}) {e['tau']:.3f} (on bf16 states)"
              + (f"; on its own fp8 states acc0 {row['eval'][storage]['acc'][0]:.4f}"
                 if storage != "bf16" else ""), flush=True)

    acc0 = {k: r["eval"]["bf16"]["acc"][0] for k, r in runs.items()}
    result = {
        "bench": "storage", "verifier": spec, "conversations": conversations,
        "max_length": max_length, "steps": steps, "depth": depth, "seed": seed,
        "host": host_flags(), "cpu": cpu_facts(), "torch_threads": torch.get_num_threads(),
        "datasets": datasets, "fp8_error": error, "runs": runs,
        "acc0_fp8_minus_bf16": acc0["fp8_e4m3"] - acc0["bf16"],
        "acc0_seed_noise": acc0[noise_arm] - acc0["bf16"] if noise_arm in acc0 else None,
        "done_when": {
            "bytes_per_token_vs_bf16_floor": datasets["fp8_e4m3"]["bytes_per_token_vs_bf16_floor"],
            "bytes_ok": datasets["fp8_e4m3"]["bytes_per_token_vs_bf16_floor"] <= 0.55,
            "acc0_ok": abs(acc0["fp8_e4m3"] - acc0["bf16"]) <= 0.01},
        "total_s": time.perf_counter() - t0,
        "note": "bytes_per_token: the whole Parquet dataset on disk (zstd; ids, masks, target_ids "
                "and footers included) over its tokens; hidden: the compressed hidden-state "
                "columns (scales included). Floors: bf16 8·H, fp8_e4m3 4·H + 16 (a float32 "
                "scale per token and slot). eval: train.evaluate_drafter teacher-forced on the "
                f"held-out split (eval_fraction 0.05 by sample_id hash), {depth} positions; "
                "'bf16' = on the bf16 states (what a served drafter sees). tau = 1 + "
                "sum_{i<d} prod_{j<=i} cond_acc_j at d = depth.",
    }
    save_result(out_dir, "storage", result, _plot_storage)
    print(f"[bench] storage: fp8 {result['done_when']['bytes_per_token_vs_bf16_floor']:.3f} x "
          f"the bf16 floor on disk; acc0 fp8 - bf16 = {result['acc0_fp8_minus_bf16']:+.4f}"
          + (f" (bf16 seed noise {result['acc0_seed_noise']:+.4f})"
             if result["acc0_seed_noise"] is not None else "") + f" -> {out_dir}/storage.json")
    return result


def _arms_then_noise(arms: dict, noise: str, noise_arm: str, noise_seed: int, runs: dict):
    """The arms in order; with noise="auto", then the noise arm if the finished bf16 and fp8
    runs (in `runs`) differ by more than 0.01 in held-out position-0 accuracy."""
    yield from arms.items()
    if noise == "auto":
        acc0 = {k: runs[k]["eval"]["bf16"]["acc"][0] for k in STORAGES}
        if abs(acc0["fp8_e4m3"] - acc0["bf16"]) > 0.01:
            print(f"[bench] storage: acc0 differs by {acc0['fp8_e4m3'] - acc0['bf16']:+.4f}; "
                  f"training bf16 with seed {noise_seed} to measure the noise", flush=True)
            yield noise_arm, ("bf16", noise_seed)


def _plot_storage(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ds, runs = result["datasets"], result["runs"]
    floor = ds["bf16"]["bf16_floor_bytes_per_token"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(ds))
    a1.bar([i - 0.2 for i in x], [d["bytes_per_token"] for d in ds.values()], 0.4,
           label="on disk, total", color="#3a7")
    a1.bar([i + 0.2 for i in x], [d["hidden_disk_bytes_per_token"] for d in ds.values()], 0.4,
           label="on disk, hidden states", color="#7b5")
    for i, d in enumerate(ds.values()):
        a1.text(i - 0.2, d["bytes_per_token"], f"{d['bytes_per_token_vs_bf16_floor']:.2f}x",
                ha="center", va="bottom", fontsize=8)
    a1.axhline(floor, color="k", ls="--", label=f"bf16 floor 8·H = {floor}")
    a1.axhline(0.55 * floor, color="r", ls=":", label="0.55 x bf16 floor")
    a1.set_xticks(list(x), list(ds)), a1.set_ylabel("bytes / token")
    a1.set_title(f"{result['conversations']} conversations, max_length {result['max_length']}")
    for i, (name, r) in enumerate(runs.items()):
        e = r["eval"]["bf16"]
        a2.plot(range(len(e["acc"])), e["acc"], "o-", ms=3, color=f"C{i}",
                label=f"{name}: acc0 {e['acc'][0]:.3f}, tau {e['tau']:.2f}")
    a2.set_xlabel("draft position k"), a2.set_ylabel("held-out accuracy (teacher-forced)")
    a2.set_ylim(0, 1)
    a2.set_title(f"{result['steps']} steps each, host {' '.join(result['host'])}", fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=.3), a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
