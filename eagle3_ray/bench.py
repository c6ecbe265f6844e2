"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

bench quality: drafters trained with ttt_steps 1, 4, 8 for the same wall-clock budget on one
embedded-default dataset (>= 1,000 ShareGPT conversations), evaluated held out at positions
0-15. Writes <out>/quality.json and <out>/quality.png (see bench_quality).

bench extract: the Ray Data extraction pipeline against a plain transformers forward loop over
the same samples (same verifier, tokens, dtype and thread count; the loop does no I/O, no
tokenization, no Ray). Repeats interleave the two (loop, pipeline, loop, pipeline, ...) and the
best of each is compared. Writes <out>/extract.json and <out>/extract.png.

    eagle3-ray bench extract --samples 32 --max-length 256 --repeats 1
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch

from eagle3_ray import data, ttt, verifier


def save_result(out_dir: str, name: str, result: dict, plot) -> None:
    """<out_dir>/<name>.json and <name>.png (plot(result, path))."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(out_dir, f"{name}.png"))


def plain_loop(spec: str, seqs: list[list[int]], layer_ids: list[int]) -> dict:
    """What a user would write: load the model, forward each sample with
    output_hidden_states=True (decoder only, no lm_head), keep the 4 states in bf16."""
    t0 = time.perf_counter()
    model = verifier.load_verifier(spec)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        for ids in seqs:
            out = model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True,
                                   use_cache=False)
            hs = out.hidden_states
            _ = [hs[i].to(torch.bfloat16) for i in layer_ids]
    loop_s = time.perf_counter() - t1
    tokens = sum(len(s) for s in seqs)
    return {"load_s": load_s, "loop_s": loop_s, "tokens": tokens,
            "tokens_per_s": tokens / loop_s, "tokens_per_s_with_load": tokens / (load_s + loop_s)}


def pipeline(spec: str, samples: int, max_length: int) -> dict:
    from eagle3_ray.extract import ExtractConfig, run_extract
    out = tempfile.mkdtemp(prefix="bench-extract-")
    try:
        t0 = time.perf_counter()
        m = run_extract(ExtractConfig(verifier=spec, output=out, sample_limit=samples,
                                      max_length=max_length, batch_rows=16))
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    s, r = m["summary"], m["summary"]["this_run"]
    return {"wall_s": wall, "tokens": s["tokens"], "samples": s["samples"],
            "tokens_per_s": s["tokens"] / wall, "actor_init_s": r["actor_init_s"],
            "actor_batch_s": r["actor_batch_s"],
            "actor_tokens_per_s": s["tokens"] / r["actor_batch_s"],
            "bytes_per_token": s["bytes_per_token"],
            "hidden_bytes_per_token": s["hidden_bytes_per_token"]}


def bench_extract(samples: int = 128, max_length: int = 512, out_dir: str = "runs/bench",
                  repeats: int = 3, spec: str = verifier.EMBEDDED_VERIFIER) -> dict:
    tok, cfg = verifier.load_tokenizer(spec), verifier.load_config(spec)
    layer_ids = verifier.default_aux_layer_ids(cfg.num_hidden_layers)
    seqs = []
    for _, messages in data.iter_samples([data.EMBEDDED_SHAREGPT], samples):
        try:
            seqs.append(data.tokenize_conversation(tok, messages, max_length)[0])
        except data.SkipRecord:
            pass
    runs = {"plain_loop": [], "pipeline": []}
    for r in range(repeats):
        runs["plain_loop"].append(plain_loop(spec, seqs, layer_ids))
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
        "tokens": best_loop["tokens"], "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "repeats": runs,
        "ratio_paired_median": paired[len(paired) // 2] if len(paired) % 2
        else (paired[len(paired) // 2 - 1] + paired[len(paired) // 2]) / 2,
        "ratio_paired": paired,
        "ratio_best_vs_best": best_pipe["tokens_per_s"] / best_loop["tokens_per_s_with_load"],
        "ratio_steady_state": best_pipe["actor_tokens_per_s"] / best_loop["tokens_per_s"],
        "note": "ratios: pipeline tokens/s end to end (actor start + model load + tokenize + "
                "forward + Parquet write + manifest) over the plain loop's (model load + forward). "
                "paired = each repeat's pipeline vs the loop run just before it; steady_state = "
                "the extractor actor's time inside its batches vs the loop's forwards. "
                "Target >= 0.85.",
    }
    save_result(out_dir, "extract", result, _plot)
    print(f"[bench] extract: pipeline / plain loop = {result['ratio_paired_median']:.2f} "
          f"(median of paired repeats {[round(x, 2) for x in paired]}), "
          f"{result['ratio_best_vs_best']:.2f} best vs best, "
          f"{result['ratio_steady_state']:.2f} steady state "
          f"-> {out_dir}/extract.json")
    return result


def _plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loop = max(result["repeats"]["plain_loop"], key=lambda x: x["tokens_per_s"])
    pipe = max(result["repeats"]["pipeline"], key=lambda x: x["tokens_per_s"])
    labels = ["plain loop\n(forwards only)", "plain loop\n(with model load)", "Ray Data pipeline\n(end to end)"]
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
#     python -c "from eagle3_ray.bench import bench_train; bench_train(ttt_steps=(1, 2), seq=256)"

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
                       seed: int, deep_fraction: float = 1.0) -> dict:
    """Runs in a fresh (spawned) process: build, then time `warmup + steps` optimizer steps."""
    import resource
    import statistics
    from eagle3_ray import ttt
    from eagle3_ray.draft import DraftConfig, Eagle3Drafter, Teacher
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    c = DraftConfig(**shapes)
    h, v, vd, s = c.hidden_size, c.vocab_size, c.draft_vocab_size, seq
    drafter = Eagle3Drafter(c)
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
        loss, m = ttt.ttt_loss(drafter, teacher, batch, ttt_steps, deep_fraction=deep_fraction)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _status_mib("VmHWM")
    return {"ttt_steps": ttt_steps, "deep_fraction": deep_fraction,
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
                deep_fraction: float = 0.25) -> dict:
    """Step time and peak memory of TTT training vs ttt_steps (fp32, CPU, B=1, random weights).
    Peak memory = the process's RSS high-water mark (VmHWM, = ru_maxrss of the fresh process)
    minus its RSS right before the first step: the step's own memory (activations, grads, AdamW
    state). `results`: every step on all positions; `deep_results` (ttt_steps > 1): the steps
    past 0 on a `deep_fraction` share of them. Writes <out_dir>/train.json and train.png."""
    import multiprocessing as mp
    shapes = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab,
                  draft_vocab_size=draft_vocab)
    results, deep_results = [], []
    ctx = mp.get_context("spawn")
    runs = [(k, 1.0) for k in ttt_steps] + [(k, deep_fraction) for k in ttt_steps
                                            if k > 1 and deep_fraction < 1]
    for k, f in runs:
        with ctx.Pool(1) as pool:  # a fresh interpreter per configuration
            r = pool.apply(_bench_train_child, (k, shapes, seq, steps, warmup, seed, f))
        (results if f == 1.0 else deep_results).append(r)
        print(f"[bench] train ttt_steps={k} deep_fraction={f}: {r['step_s'] * 1000:.0f} ms/step "
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
        "note": "step = ttt_loss forward + backward + AdamW step, median after warm-up (wall; "
                "cpu = process CPU time of all threads, less sensitive to a shared box); peak = "
                "VmHWM of a fresh process minus its RSS before the first step. Targets: memory "
                "at most linear in ttt_steps; time(16)/time(1) <= 10. deep_*: the same with "
                "the steps past 0 on a deep_fraction share of the positions.",
    }
    save_result(out_dir, "train", result, _plot_train)
    print(f"[bench] train -> {out_dir}/train.json")
    return result


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


def bench_quality(conversations: int = 1200, max_length: int = 512, ttt_list=(1, 4, 8),
                  minutes: float = 10.0, depth: int = 16, draft_vocab: int = 8192,
                  out_dir: str = "runs/bench", workers: int = 2, fresh: bool = False,
                  ttt_ramp: float = 0.5, deep_fraction: float = 1.0) -> dict:
    """Drafters trained with each ttt_steps for the same wall-clock budget on one embedded-default
    dataset, then evaluated held-out at `depth` positions. Finished stages are reused (extraction
    and each training run resume) unless fresh. Writes quality.json + quality.png."""
    from eagle3_ray.extract import ExtractConfig, run_extract
    from eagle3_ray.train import TrainConfig, evaluate_drafter, run_train
    root = os.path.join(out_dir, "quality")
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    data_dir = os.path.join(root, "data")
    t0 = time.perf_counter()
    manifest = run_extract(ExtractConfig(output=data_dir, sample_limit=conversations,
                                         max_length=max_length, batch_rows=32))
    extract_s = time.perf_counter() - t0
    runs = {}
    for k in ttt_list:
        run_dir = os.path.join(root, f"ttt{k}")
        t1 = time.perf_counter()
        run_train(TrainConfig(
            dataset=data_dir, output=run_dir, ttt_steps=k, ttt_ramp=ttt_ramp,
            deep_fraction=deep_fraction, draft_vocab_size=draft_vocab,
            max_steps=1_000_000, max_minutes=minutes, batch_size=4, max_seq_len=max_length,
            lr=1e-3, warmup_steps=30, eval_every=0, log_every=25, checkpoint_every=200,
            eval_fraction=0.05, num_workers=workers, cpus_per_worker=0.5))
        train_s = time.perf_counter() - t1
        meta = json.load(open(os.path.join(run_dir, "drafter", "meta.json")))
        t2 = time.perf_counter()
        ev = evaluate_drafter(os.path.join(run_dir, "drafter"), data_dir, depth,
                              eval_fraction=0.05, max_seq_len=max_length)
        tau = ttt.accept_lengths([ev[f"cond_acc_{i}"] for i in range(depth)])
        runs[k] = {"ttt_steps": k, "steps": meta["steps"], "train_wall_s": train_s,
                   "train_loop_s": meta["final_metrics"].get("train_s"),
                   "eval_s": time.perf_counter() - t2,
                   "acc": [ev[f"acc_{i}"] for i in range(depth)],
                   "cond_acc": [ev[f"cond_acc_{i}"] for i in range(depth)],
                   "p": [ev[f"p_{i}"] for i in range(depth)],
                   "accept_len_by_depth": tau}
        print(f"[bench] quality ttt={k}: {meta['steps']} steps in {train_s:.0f}s; held-out acc "
              f"pos0 {runs[k]['acc'][0]:.3f}; tau(depth 8) {tau[8]:.2f}, tau(16) {tau[16]:.2f}")
    s = manifest["summary"]
    result = {"bench": "quality", "conversations": conversations, "samples": s["samples"],
              "tokens": s["tokens"], "loss_tokens": s["loss_tokens"], "max_length": max_length,
              "draft_vocab_size": draft_vocab, "minutes_per_drafter": minutes, "eval_depth": depth,
              "ttt_ramp": ttt_ramp, "deep_fraction": deep_fraction, "precision": "auto",
              "extract_s": extract_s, "total_s": time.perf_counter() - t0,
              "runs": {str(k): v for k, v in runs.items()},
              "note": "accept_len_by_depth[d] = 1 + sum_{i<d} prod_{j<=i} cond_acc_j: expected "
                      "tokens per round of greedy chain speculation at depth d, from held-out "
                      "conditional accuracies; positions past a drafter's ttt_steps are "
                      "extrapolation."}
    save_result(out_dir, "quality", result, _plot_quality)
    return result


def _plot_quality(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for k, r in result["runs"].items():
        a1.plot(range(len(r["acc"])), r["acc"], "o-", ms=3, label=f"ttt_steps={k} ({r['steps']} steps)")
        a2.plot(range(len(r["accept_len_by_depth"])), r["accept_len_by_depth"], "o-", ms=3,
                label=f"ttt_steps={k}")
    a1.set_xlabel("draft position k"), a1.set_ylabel("held-out accuracy"), a1.set_ylim(0, 1)
    a1.set_title(f"{result['samples']} samples, {result['minutes_per_drafter']:.0f} min each")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("estimated acceptance length")
    for a in (a1, a2):
        a.grid(alpha=.3), a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- bench serve -----------------------------------------------------------------------------
# The decoder the server runs (speculate.Speculator: the same code, minus HTTP), on the embedded
# verifier with a trained drafter, at each depth on the same held-out prompts. Depths are
# interleaved per prompt (in a rotating order) so machine noise hits them alike.
#
#     eagle3-ray bench serve --drafter runs/bench/quality/ttt4/drafter --prompts 4 --max-tokens 32

SERVE_DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


def heldout_prompts(tok, n: int, skip: int = 5000, max_prompt: int = 256) -> list[list[int]]:
    """First user turns of embedded ShareGPT conversations past the first `skip` usable ones
    (bench quality trains on the first ~1,200), rendered with the chat template."""
    out = []
    for i, (_, messages) in enumerate(data.iter_samples([data.EMBEDDED_SHAREGPT])):
        if i < skip:
            continue
        turn = next((m for m in messages if m["role"] == "user"), None)
        if not turn:
            continue
        ids = data.prompt_ids(tok, [turn])
        if 8 <= len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == n:
            return out
    return out


def best_quality_drafter(out_dir: str = "runs/bench", depth: int = 8) -> str:
    """The drafter of `bench quality` with the highest estimated acceptance length at `depth`."""
    path = os.path.join(out_dir, "quality.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no bench quality result; pass --drafter")
    q = json.load(open(path))
    k = max(q["runs"], key=lambda k: q["runs"][k]["accept_len_by_depth"][depth])
    return os.path.join(out_dir, "quality", f"ttt{k}", "drafter")


def bench_serve(drafter_dir: str | None = None, depths=SERVE_DEPTHS, prompts: int = 8,
                max_tokens: int = 64, out_dir: str = "runs/bench",
                spec: str = verifier.EMBEDDED_VERIFIER, threads: int = 0,
                simulate: str | None = None, dynamic: bool = True) -> dict:
    """Greedy tokens/s and acceptance length per depth, speedup over depth 0, whether every
    depth's output equals depth 0's, and the planner's prediction for each depth next to the
    measurement: this machine's verify/draft times are measured first (planner.
    measure_speculator), acceptance per position is counted over the runs. simulate: a node
    profile whose all-reduce time every verify also sleeps (a SIMULATION of that node's
    interconnect). dynamic: also a run with per-request dynamic depth (planner.DynamicDepth).
    Writes <out_dir>/serve.json + serve.png (serve-sim-<profile>.* when simulating)."""
    import functools
    from eagle3_ray import planner, speculate
    from eagle3_ray.train import load_trained_drafter
    if threads:
        torch.set_num_threads(threads)
    drafter_dir = drafter_dir or best_quality_drafter(out_dir)
    tok, model = verifier.load_tokenizer(spec), verifier.load_verifier(spec)
    drafter, _, meta = load_trained_drafter(drafter_dir, spec)
    dec = speculate.Speculator(model, drafter.eval())
    max_depth = max(depths)
    node = planner.load_profile(simulate) if simulate else None

    def measured_profile(*timings):      # this machine's verify/draft times (+ the simulation)
        verify_ms = {k: sum(t[0][k] for t in timings) / len(timings) for k in timings[0][0]}
        p = planner.single_device_profile("this machine", verify_ms,
                                          sum(t[1] for t in timings) / len(timings),
                                          model.config, model.dtype)
        return planner.with_interconnect(p, node) if node else p

    before = planner.measure_speculator(dec, max_depth + 1, reps=7)
    profile = measured_profile(before)                    # what dynamic depth plans with
    if node:
        dec.simulated_comm = functools.partial(planner.comm_s, node)
    prior = planner.acceptance_from(drafter_dir)[0]
    sp = speculate.SamplingParams(max_tokens=max_tokens, eos_ids=verifier.eos_ids(model, tok))
    ps = heldout_prompts(tok, prompts)
    names = list(depths) + (["dynamic"] if dynamic else [])
    runs = {d: {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "accepted": 0,
                "drafted": 0, "verify_s": 0.0, "draft_s": 0.0, "outputs": [],
                "drafted_at": [0] * max_depth, "accepted_at": [0] * max_depth} for d in names}
    for i, prompt in enumerate([ps[0]] + ps):            # the first prompt once more as warm-up
        order = names[i % len(names):] + names[:i % len(names)]
        for d in order:
            depth = planner.DynamicDepth(profile, prior, max_depth) if d == "dynamic" else d
            t0, out, rounds = time.perf_counter(), [], []
            for r in dec.generate(prompt, sp, depth):
                out += r.tokens
                rounds.append(r)
            wall = time.perf_counter() - t0
            if i == 0:
                continue
            s = runs[d]
            s["tokens"] += len(out)
            s["wall_s"] += wall
            s["prefill_s"] += rounds[0].verify_s
            s["rounds"] += len(rounds) - 1                 # verify rounds after the prefill
            s["outputs"].append(out)
            for r in rounds[1:]:
                s["accepted"] += r.accepted
                s["drafted"] += r.drafted
                s["verify_s"] += r.verify_s
                s["draft_s"] += r.draft_s
                for k in range(r.drafted):
                    s["drafted_at"][k] += 1
                    s["accepted_at"][k] += k < r.accepted
        print(f"[bench] serve: prompt {i}/{len(ps)} done", flush=True)
    # the machine drifts over minutes (shared, turbo): predict with times measured before and
    # after the runs, averaged
    after = planner.measure_speculator(dec, max_depth + 1, reps=7)
    profile = measured_profile(before, after)
    drift = after[0][1] / before[0][1] - 1
    # acceptance per position over all fixed-depth runs (greedy: it does not depend on depth)
    fixed = [runs[d] for d in depths]
    cond = planner.cond_from_counts(
        [sum(s["drafted_at"][k] for s in fixed) for k in range(max_depth)],
        [sum(s["accepted_at"][k] for s in fixed) for k in range(max_depth)])
    pred = planner.plan(cond, profile, max_depth=max_depth)
    base = runs[depths[0]]
    result_runs = {}
    for d, s in runs.items():
        decode = (s["tokens"] - len(ps)) / (s["wall_s"] - s["prefill_s"])  # tokens after the first
        row = {"depth": d, "tokens": s["tokens"], "wall_s": s["wall_s"],
               "tokens_per_s": s["tokens"] / s["wall_s"],
               "speedup": (s["tokens"] / s["wall_s"]) / (base["tokens"] / base["wall_s"]),
               "decode_tokens_per_s": decode,
               "acceptance_length": (s["accepted"] + s["rounds"]) / max(1, s["rounds"]),
               "mean_depth": s["drafted"] / max(1, s["rounds"]), "rounds": s["rounds"],
               "verify_s_per_round": s["verify_s"] / max(1, s["rounds"]),
               "draft_s_per_round": s["draft_s"] / max(1, s["rounds"]),
               "drafted_per_position": s["drafted_at"], "accepted_per_position": s["accepted_at"],
               "identical_to_depth0": s["outputs"] == base["outputs"],
               "mismatched_prompts": [j for j, (a, b) in enumerate(zip(s["outputs"],
                                                                       base["outputs"])) if a != b]}
        if d != "dynamic":
            p = pred["depths"][d]
            row.update(predicted_tokens_per_s=p["tokens_per_s"],
                       predicted_acceptance_length=p["accept_len"],
                       predicted_error=p["tokens_per_s"] / decode - 1)
        result_runs[str(d)] = row
    measured = sorted(depths, key=lambda d: -result_runs[str(d)]["decode_tokens_per_s"])
    chosen = max(depths, key=lambda d: pred["depths"][d]["tokens_per_s"])   # among those run
    best = result_runs[str(measured[0])]
    result = {"bench": "serve", "verifier": spec, "drafter": drafter_dir,
              "drafter_ttt_steps": meta.get("ttt_steps"), "prompts": len(ps),
              "max_tokens": max_tokens, "torch_threads": torch.get_num_threads(),
              "dtype": str(model.dtype).replace("torch.", ""),
              "simulated_interconnect": simulate,
              "runs": result_runs, "best_depth": best["depth"], "best_speedup": best["speedup"],
              "all_identical": all(r["identical_to_depth0"] for r in result_runs.values()),
              "planner": {"chosen_depth": chosen, "two_fastest_measured": measured[:2],
                          "chosen_among_two_fastest": chosen in measured[:2],
                          "max_abs_error": max(abs(result_runs[str(d)]["predicted_error"])
                                               for d in depths),
                          "cond_acc": cond, "profile": planner.profile_to_dict(profile),
                          "verify_1_token_drift": drift,
                          "why": pred["why"]},
              "note": "greedy; one process, the server's decoder (speculate.Speculator) without "
                      "HTTP; depths interleaved per prompt; speedup = tokens/s over depth 0's "
                      "in the same run; acceptance_length = tokens per verify round; "
                      "decode_tokens_per_s leaves out each prompt's prefill (what the planner "
                      "predicts); prediction = planner.plan(acceptance counted here, this "
                      "machine's verify/draft times measured before and after the runs"
                      + (f" + the SIMULATED interconnect of {simulate})" if simulate else ")")}
    if dynamic:
        d = result_runs["dynamic"]
        d["vs_best_fixed"] = d["decode_tokens_per_s"] / best["decode_tokens_per_s"]
    name = f"serve-sim-{node.name}" if node else "serve"
    save_result(out_dir, name, result, _plot_serve)
    for r in result_runs.values():
        extra = (f", predicted {r['predicted_tokens_per_s']:.1f} ({r['predicted_error']:+.0%})"
                 if "predicted_tokens_per_s" in r else f", mean depth {r['mean_depth']:.2f}")
        print(f"[bench] serve depth {r['depth']!s:>7}: {r['tokens_per_s']:.1f} tok/s, "
              f"x{r['speedup']:.2f}, tau {r['acceptance_length']:.2f}, decode "
              f"{r['decode_tokens_per_s']:.1f} tok/s{extra}, identical {r['identical_to_depth0']}")
    print(f"[bench] planner chose depth {chosen}; fastest measured {measured[:2]}")
    return result


def _plot_serve(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = sorted((r for r in result["runs"].values() if r["depth"] != "dynamic"),
                  key=lambda r: r["depth"])
    ds = [r["depth"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(ds, [r["decode_tokens_per_s"] for r in runs], "o-", color="#37a", label="measured")
    a1.plot(ds, [r["predicted_tokens_per_s"] for r in runs], "s--", color="#e83",
            label="predicted (planner)")
    dyn = result["runs"].get("dynamic")
    if dyn:
        a1.axhline(dyn["decode_tokens_per_s"], color="#3a5", ls=":",
                   label=f"dynamic depth (mean {dyn['mean_depth']:.1f})")
    sim = result.get("simulated_interconnect")
    a1.set_xlabel("speculation depth"), a1.set_ylabel("decode tokens/s")
    a1.set_title(f"{'SIMULATED ' + sim if sim else 'this machine'}: planner chose depth "
                 f"{result['planner']['chosen_depth']}", fontsize=9)
    a2.plot(ds, [r["acceptance_length"] for r in runs], "o-", color="#a52", label="measured")
    a2.plot(ds, [r["predicted_acceptance_length"] for r in runs], "s--", color="#e83",
            label="from per-position acceptance")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("tokens per verify round")
    a2.set_title(f"drafter ttt_steps={result['drafter_ttt_steps']}; outputs identical: "
                 f"{result['all_identical']}", fontsize=9)
    for a in (a1, a2):
        a.set_xticks(ds), a.grid(alpha=0.3), a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
