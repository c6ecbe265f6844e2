"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

bench quality / bench recipe (drafters compared by served acceptance): see quality.py.
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

from eagle3_ray import data, ttt, verifier


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
            "outside_batches_s": wall - r["actor_batch_s"],   # driver + actor start, finalize
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
    from eagle3_ray.extract import ExtractConfig, replica_threads
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


# --- bench serve -----------------------------------------------------------------------------
# The decoder the server runs (speculate.Speculator: the same code, minus HTTP), on the embedded
# verifier with a trained drafter, at each depth on the same held-out prompts. Depths are
# interleaved per prompt (in a rotating order) so machine noise hits them alike. The peers
# (transformers' plain greedy generate and its prompt-lookup speculation, the choices a user
# has without training) are arms of the same interleaved run (hf_generate; --no-peers skips).
#
#     eagle3-ray bench serve --drafter runs/bench/quality/ttt4/drafter --samples 4 --max-tokens 32
#     eagle3-ray bench serve --drafter DIR --samples 2 --max-tokens 16 --depths 0 2 \
#         --prompt-lookup-tokens 10 3

SERVE_DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


def best_quality_drafter(out_dir: str = "runs/bench", depth: int = 8) -> str:
    """The drafter of `bench quality` with the highest served acceptance length at `depth`."""
    path = os.path.join(out_dir, "quality.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no bench quality result; pass --drafter")
    q = json.load(open(path))
    arm = max(q["runs"], key=lambda k: q["runs"][k]["served"]["tau_by_depth"][depth])
    return os.path.join(out_dir, "quality", arm, "drafter")


SERVE_BRANCHES = ()      # tree arms (--branches K): K chains forked at the first draft
                         # (Speculator branches); none by default: on a 2-core CPU they lose
                         # (docs/benchmarks.md#bench-serve)
SERVE_TREE_DEPTHS = (2, 3, 4)   # the fixed depths (of those run) that get tree arms
SERVE_PROMPT_LOOKUP = (10, 3)   # transformers' docs suggest ~10 tokens; 3 ~ a shallow depth
SERVE_LOOKUP_DEPTHS = (3, 4, 8)  # arms "lookup{d}": depth d with the server's lookup fallback
SERVE_LOOKUP_BRANCHES = ()       # arms "branch-lookup{d}": depth d, the lookup's match verified
                                 # beside the drafter's chain (a tree; none by default)


class _ChunkClock:
    """A transformers streamer: when and how many token ids each put() of generate() carries
    (the first put is the prompt, then one per verifier forward)."""

    def __init__(self):
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def hf_generate(model, prompt: list[int], max_tokens: int, eos_ids, prompt_lookup: int = 0):
    """transformers' own greedy `model.generate` on one prompt (prompt_lookup > 0: with its
    prompt-lookup speculation of that many tokens, `prompt_lookup_num_tokens`), stopping at
    `eos_ids` after at most `max_tokens` -> {tokens (EOS left out, as speculate.Speculator
    does), wall_s, prefill_s (until the first token), rounds (verifier forwards after the
    prefill), drafted, accepted (prompt-lookup tokens proposed / accepted)}. Counted with a
    streamer (tokens per forward) and a forward pre-hook (tokens fed per forward)."""
    clock, fed = _ChunkClock(), []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: fed.append((kw.get("input_ids") if "input_ids" in kw else args[0])
                                       .shape[1]), with_kwargs=True)
    eos = list(eos_ids)
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    x = torch.tensor([prompt], device=model.device)                       # [1, P]
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos or None,
                                 pad_token_id=eos[0] if eos else None, streamer=clock,
                                 **extra)                                  # [1, P + n]
        wall = time.perf_counter() - t0
    finally:
        hook.remove()
    out = seq[0, len(prompt):].tolist()
    out = out[:next((i for i, t in enumerate(out) if t in eos), len(out))]
    chunks = clock.sizes[1:]                      # tokens emitted per forward (prefill first)
    return {"tokens": out, "wall_s": wall, "prefill_s": clock.times[1] - t0,
            "rounds": len(chunks) - 1, "drafted": sum(n - 1 for n in fed[1:]),
            "accepted": sum(n - 1 for n in chunks[1:])}


def bench_serve(drafter_dir: str | None = None, depths=SERVE_DEPTHS, prompts: int = 8,
                max_tokens: int = 64, out_dir: str = "runs/bench",
                spec: str = verifier.EMBEDDED_VERIFIER, threads: int = 0,
                simulate: str | None = None, dynamic: bool = True, peers: bool = True,
                prompt_lookup=SERVE_PROMPT_LOOKUP, num_gpus: int = 0,
                branches=SERVE_BRANCHES, lookup_depths=SERVE_LOOKUP_DEPTHS,
                lookup_branches=SERVE_LOOKUP_BRANCHES) -> dict:
    """Greedy tokens/s and acceptance length per depth, speedup over depth 0, whether every
    depth's output equals depth 0's, and the planner's prediction for each depth next to the
    measurement: this machine's verify/draft times are measured first (planner.
    measure_speculator), acceptance per position is counted over the runs. simulate: a node
    profile whose all-reduce time every verify also sleeps (a SIMULATION of that node's
    interconnect). dynamic: also a run with per-request dynamic depth (planner.DynamicDepth)
    and one with confidence-gated chains ("gated": depth up to the deepest fixed one, each
    chain stopped where the drafter's own chain probability falls below planner.
    chain_threshold of this machine's costs).
    branches: tree arms "tree{k}x{d}" for each k > 1 here and each depth d of SERVE_TREE_DEPTHS
    run: k chains of d drafts forked at the first, verified in one forward (Speculator
    branches); measured only, no planner prediction.
    lookup_depths: arms "lookup{d}" (depth d) and, with dynamic, "dynamic-lookup": the same
    decoder with the server's lookup fallback (speculate.LookupParams(); serve's default);
    measured only, no planner prediction.
    lookup_branches: arms "branch-lookup{d}" (depth d) and, for each k of `branches`,
    "tree{k}x{d}+lookup", and with dynamic "dynamic-branch-lookup": the lookup's match
    verified as one more chain of the tree (speculate.LookupParams(branch=True)); measured
    only.
    peers: also transformers' own greedy `generate` and its prompt-lookup speculation with each
    k in `prompt_lookup` (hf_generate), on a second, unpatched copy of the verifier, as arms of
    the same interleaved run -> result["peers"] (not simulated: no interconnect sleep).
    num_gpus: the verifier's GPUs (0: CPU; the GPU check runs this on one GPU).
    Writes <out_dir>/serve.json + serve.png (serve-sim-<profile>.* when simulating)."""
    import functools
    from eagle3_ray import planner, speculate
    from eagle3_ray.train import load_trained_drafter
    if threads:
        torch.set_num_threads(threads)
    depths = tuple(sorted(set(depths)))
    if depths[0] != 0 or len(depths) < 2:
        raise ValueError(f"depths {list(depths)}: need 0 (the baseline) and at least one > 0")
    if peers and any(int(k) <= 0 for k in prompt_lookup):
        raise ValueError(f"prompt lookup tokens {list(prompt_lookup)}: each must be > 0")
    drafter_dir = drafter_dir or best_quality_drafter(out_dir)
    tok, model = verifier.load_tokenizer(spec), verifier.load_verifier(spec, num_gpus=num_gpus)
    drafter, _, meta = load_trained_drafter(drafter_dir, spec)
    dec = speculate.Speculator(model, drafter.eval())    # patches `model` (batch invariance)
    max_depth = max(depths)
    # the peers run on their own copy: transformers as a user has it (its default attention)
    hf = verifier.load_verifier(spec, dtype=model.dtype, num_gpus=num_gpus) if peers else None
    peer_ks = {"generate": 0} if peers else {}
    peer_ks.update({f"prompt_lookup_{k}": int(k) for k in (prompt_lookup if peers else ())})
    peer_runs = {a: {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "drafted": 0,
                     "accepted": 0, "outputs": []} for a in peer_ks}
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
    ps = data.heldout_prompts(tok, prompts)
    branch = speculate.LookupParams(branch=True)
    trees = {f"tree{k}x{d}": (int(k), d, None) for k in branches if int(k) > 1
             for d in depths if d in SERVE_TREE_DEPTHS}           # name: (k, depth, lookup)
    for d in (int(d) for d in lookup_branches if int(d) > 0):
        trees[f"branch-lookup{d}"] = (1, d, branch)
        trees.update({f"tree{k}x{d}+lookup": (int(k), d, branch) for k in branches if int(k) > 1})
    if lookup_branches and dynamic:
        trees["dynamic-branch-lookup"] = (1, "dynamic", branch)
    refused = {}                          # arms this host cannot run exactly, and why
    if trees and not dec.exact["tree"]:
        refused = {"arms": sorted(trees), "why": dec.inexact_reason("tree")}
        print(f"[bench serve] tree arms {refused['arms']} left out: {refused['why']}")
        trees = {}
    if not dec.exact["chain"]:            # measured all the same: identical_to_depth0 tells
        print(f"[bench serve] warning: {dec.inexact_reason('chain')}")
    lookups = {f"lookup{d}": int(d) for d in lookup_depths if int(d) > 0}
    look = speculate.LookupParams()                       # serve's default fallback
    if lookups and dynamic:
        lookups["dynamic-lookup"] = "dynamic"
    ours = list(depths) + (["dynamic", "gated"] if dynamic else []) + list(trees) + list(lookups)
    width = max([max_depth] + [d for d in lookups.values() if d != "dynamic"]
                + [t[1] for t in trees.values() if t[1] != "dynamic"])   # positions
    gate = planner.chain_threshold(profile, max_depth)
    names = ours + list(peer_ks)                          # every arm, interleaved per prompt
    runs = {d: {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "accepted": 0,
                "drafted": 0, "verify_s": 0.0, "draft_s": 0.0, "outputs": [], "lookup_rounds": 0,
                "drafted_at": [0] * width, "accepted_at": [0] * width} for d in ours}
    calib = []          # (the drafter's chain probability of drafts 1..k, all k accepted?)
    for i, prompt in enumerate([ps[0]] + ps):            # the first prompt once more as warm-up
        order = names[i % len(names):] + names[:i % len(names)]
        for d in order:
            if d in peer_ks:
                got = hf_generate(hf, prompt, max_tokens, sp.eos_ids, peer_ks[d])
                if i > 0:
                    s = peer_runs[d]
                    for key in ("wall_s", "prefill_s", "rounds", "drafted", "accepted"):
                        s[key] += got[key]
                    s["tokens"] += len(got["tokens"])
                    s["outputs"].append(got["tokens"])
                continue
            depth = trees[d][1] if d in trees else lookups.get(d, d)
            depth = (planner.DynamicDepth(profile, prior, max_depth) if depth == "dynamic"
                     else max_depth if d == "gated" else depth)
            t0, out, rounds = time.perf_counter(), [], []
            for r in dec.generate(prompt, sp, depth, gate if d == "gated" else 0.0,
                                  branches=trees[d][0] if d in trees else 1,
                                  lookup=look if d in lookups else
                                  trees[d][2] if d in trees else None):
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
                s["lookup_rounds"] += r.lookup
                chain = 1.0
                for k in range(r.drafted):
                    s["drafted_at"][k] += 1
                    s["accepted_at"][k] += k < r.accepted
                    if r.draft_probs:                      # trees, lookups: no chain prob
                        chain *= r.draft_probs[k]
                        calib.append((chain, k < r.accepted))
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
        if d in trees:
            row.update(branches=trees[d][0], tree_depth=trees[d][1])
            if trees[d][2]:
                row.update(lookup_branch=True, lookup_rounds=s["lookup_rounds"])
        elif d in lookups:
            row.update(lookup_rounds=s["lookup_rounds"], lookup_depth=lookups[d])
        elif d not in ("dynamic", "gated"):
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
              "few_row_kernels": {str(k): v for k, v in dec.few_row_kernels.items()},
              "exact": dec.exact, "refused_arms": refused,
              "simulated_interconnect": simulate,
              "runs": result_runs, "best_depth": best["depth"], "best_speedup": best["speedup"],
              "all_identical": all(r["identical_to_depth0"] for r in result_runs.values()),
              "calibration": calibration(calib),
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
    notes = {"tree": "tree{k}x{d}: k greedy chains of d drafts forked at the first draft (the "
                     "drafter's top-k first tokens), verified in one forward; tau = tokens per "
                     "round, acceptance per position = the longest accepted chain's; "
                     "branch-lookup{d} / tree{k}x{d}+lookup: the lookup's match (if any) is one "
                     "more chain of that tree; lookup_rounds: rounds the lookup's chain won",
             "lookup": f"lookup{{d}} / dynamic-lookup: the decoder with the server's lookup "
                       f"fallback (a first draft with drafter probability < {look.below} gives "
                       f"way to the continuation of the latest earlier n-gram of "
                       f"{look.min_n}-{look.max_n} tokens ending the context); lookup_rounds: "
                       f"rounds that verified the lookup's drafts"}
    for kind, arms in (("tree", trees), ("lookup", lookups)):
        if arms:
            top = max(arms, key=lambda d: result_runs[d]["decode_tokens_per_s"])
            result.update({f"best_{kind}": top, f"best_{kind}_speedup": result_runs[top]["speedup"],
                           f"{kind}_note": notes[kind]})
    if dynamic:
        for name in ("dynamic", "gated") + (("dynamic-lookup",) if lookups else ()) + (
                ("dynamic-branch-lookup",) if lookup_branches else ()):
            d = result_runs[name]
            d["vs_best_fixed"] = d["decode_tokens_per_s"] / best["decode_tokens_per_s"]
        result_runs["gated"]["chain_threshold"] = gate
    if peers:
        result["peers"] = _peer_rows(peer_runs, peer_ks, result_runs[str(depths[0])],
                                     base["outputs"], len(ps))
        result["peers_note"] = (
            "transformers' own model.generate (greedy, max_new_tokens = max_tokens, "
            "eos_token_id = the verifier's EOS ids) on a second, unmodified copy of the verifier "
            "(its default attention, " + hf.config._attn_implementation + "), interleaved per "
            "prompt with the depth runs; prompt_lookup_K = prompt_lookup_num_tokens=K; "
            "speedup / decode_speedup: over depth 0 of this run; prefill_s: until generate's "
            "first token (includes generate's setup); identical_prompts: greedy output equal to "
            "depth 0's (in bf16 HF's attention may round differently from the batch-invariant "
            "path, so a mismatch is not a decoder error); acceptance_length: tokens per verifier "
            "forward after the prefill, acceptance_rate: accepted / proposed lookup tokens"
            + ("; no simulated interconnect sleep" if simulate else ""))
    name = f"serve-sim-{node.name}" if node else "serve"
    save_result(out_dir, name, result, _plot_serve)
    for r in result_runs.values():
        extra = (f", predicted {r['predicted_tokens_per_s']:.1f} ({r['predicted_error']:+.0%})"
                 if "predicted_tokens_per_s" in r else f", mean depth {r['mean_depth']:.2f}")
        print(f"[bench] serve depth {r['depth']!s:>7}: {r['tokens_per_s']:.1f} tok/s, "
              f"x{r['speedup']:.2f}, tau {r['acceptance_length']:.2f}, decode "
              f"{r['decode_tokens_per_s']:.1f} tok/s{extra}, identical {r['identical_to_depth0']}")
    for a, r in result.get("peers", {}).items():
        extra = (f", tau {r['acceptance_length']:.2f}, lookup accepted "
                 f"{r['accepted']}/{r['drafted']}" if r["prompt_lookup_num_tokens"] else "")
        print(f"[bench] serve peer {a}: {r['tokens_per_s']:.1f} tok/s, x{r['speedup']:.2f}, "
              f"decode {r['decode_tokens_per_s']:.1f} tok/s (x{r['decode_speedup']:.2f}){extra}, "
              f"identical {r['identical_prompts']}/{r['prompts']}")
    print(f"[bench] planner chose depth {chosen}; fastest measured {measured[:2]}")
    print("[bench] served acceptance by the drafter's chain probability: " + ", ".join(
        f"[{c['chain_prob_from']:g},{c['chain_prob_to']:g}) {c['accepted_rate']:.2f} "
        f"({c['drafts']})" for c in result["calibration"] if c["drafts"]))
    return result


def calibration(pairs, edges=(0, .05, .1, .2, .3, .5, .7, .9, 1.0)) -> list[dict]:
    """(chain probability, all accepted) pairs of every drafted position -> per bin of the
    drafter's chain probability: how often the chain through that draft was accepted. What
    confidence-gated drafting relies on: a calibrated drafter has rate ~ mean_chain_prob."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        got = [(c, hit) for c, hit in pairs if lo <= c < hi or (hi == edges[-1] and c == hi)]
        rows.append({"chain_prob_from": lo, "chain_prob_to": hi, "drafts": len(got),
                     "mean_chain_prob": sum(c for c, _ in got) / len(got) if got else None,
                     "accepted_rate": sum(h for _, h in got) / len(got) if got else None})
    return rows


def _peer_rows(peer_runs: dict, peer_ks: dict, depth0: dict, depth0_outputs: list,
               prompts: int) -> dict:
    """serve.json "peers": each transformers arm's totals against depth 0 of the same run."""
    rows = {}
    for a, s in peer_runs.items():
        tps = s["tokens"] / s["wall_s"]
        decode = (s["tokens"] - prompts) / (s["wall_s"] - s["prefill_s"])
        same = [x == y for x, y in zip(s["outputs"], depth0_outputs)]
        row = {"arm": a, "prompt_lookup_num_tokens": peer_ks[a], "tokens": s["tokens"],
               "wall_s": s["wall_s"], "prefill_s": s["prefill_s"], "tokens_per_s": tps,
               "decode_tokens_per_s": decode, "speedup": tps / depth0["tokens_per_s"],
               "decode_speedup": decode / depth0["decode_tokens_per_s"],
               "prompts": prompts, "identical_prompts": sum(same),
               "identical_to_depth0": all(same) and len(same) == prompts,
               "mismatched_prompts": [j for j, ok in enumerate(same) if not ok],
               "rounds": s["rounds"],
               "acceptance_length": (s["accepted"] + s["rounds"]) / max(1, s["rounds"])}
        if peer_ks[a]:
            row.update(drafted=s["drafted"], accepted=s["accepted"],
                       acceptance_rate=s["accepted"] / max(1, s["drafted"]),
                       mean_drafted=s["drafted"] / max(1, s["rounds"]))
        rows[a] = row
    return rows


def _plot_serve(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = sorted((r for r in result["runs"].values() if isinstance(r["depth"], int)),
                  key=lambda r: r["depth"])
    trees = [r for r in result["runs"].values() if isinstance(r.get("tree_depth"), int)]
    ds = [r["depth"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(ds, [r["decode_tokens_per_s"] for r in runs], "o-", color="#37a", label="measured")
    a1.plot(ds, [r["predicted_tokens_per_s"] for r in runs], "s--", color="#e83",
            label="predicted (planner)")
    for k, lb in sorted({(r["branches"], r.get("lookup_branch", False)) for r in trees}):
        pts = sorted((r["tree_depth"], r) for r in trees
                     if r["branches"] == k and r.get("lookup_branch", False) == lb)
        name = f"{k} branch{'es' if k > 1 else ''}" + (" + lookup" if lb else "")
        style = dict(color="#2a6" if lb else "#b22", marker="^", ls="-" if k > 1 else ":")
        a1.plot([d for d, _ in pts], [r["decode_tokens_per_s"] for _, r in pts], **style,
                label=f"{name} (tree, measured)")
        a2.plot([d for d, _ in pts], [r["acceptance_length"] for _, r in pts], **style,
                label=f"{name} (tree)")
    look = sorted((r for r in result["runs"].values() if isinstance(r.get("lookup_depth"), int)),
                  key=lambda r: r["lookup_depth"])
    if look:
        a1.plot([r["lookup_depth"] for r in look], [r["decode_tokens_per_s"] for r in look],
                "v-", color="#63a", label="with lookup fallback (measured)")
        a2.plot([r["lookup_depth"] for r in look], [r["acceptance_length"] for r in look],
                "v-", color="#63a", label="with lookup fallback")
    dyn, gated = result["runs"].get("dynamic"), result["runs"].get("gated")
    dyn_look = result["runs"].get("dynamic-lookup")
    if dyn_look:
        a1.axhline(dyn_look["decode_tokens_per_s"], color="#63a", ls=":",
                   label=f"dynamic depth + lookup (mean {dyn_look['mean_depth']:.1f})")
    if dyn:
        a1.axhline(dyn["decode_tokens_per_s"], color="#3a5", ls=":",
                   label=f"dynamic depth (mean {dyn['mean_depth']:.1f})")
    if gated:
        a1.axhline(gated["decode_tokens_per_s"], color="#c80", ls=":",
                   label=f"confidence-gated (mean depth {gated['mean_depth']:.1f})")
    peers = list(result.get("peers", {}).values())      # transformers' arms: horizontal lines
    styles = [("#777", "-."), ("#a3c", "--"), ("#c39", ":"), ("#5aa", "-.")]
    for j, r in enumerate(peers):
        color, ls = styles[j % len(styles)]
        k = r["prompt_lookup_num_tokens"]
        label = f"HF prompt lookup k={k}" if k else "HF generate (no speculation)"
        a1.axhline(r["decode_tokens_per_s"], color=color, ls=ls, lw=1,
                   label=f"{label}, identical {r['identical_prompts']}/{r['prompts']}")
        if k:
            a2.axhline(r["acceptance_length"], color=color, ls=ls, lw=1, label=label)
    if peers:                                              # room above the lines for the legend
        top = max([r["decode_tokens_per_s"]
                   for r in peers + runs + trees + look + [x for x in (dyn, gated, dyn_look) if x]]
                  + [r["predicted_tokens_per_s"] for r in runs])
        a1.set_ylim(0, top * 1.7)
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
    from eagle3_ray import regen
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
    from eagle3_ray import schema

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
    hidden = model.config.hidden_size
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
    from eagle3_ray.extract import ExtractConfig, run_extract
    from eagle3_ray.train import TrainConfig, evaluate_drafter, run_train
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
