"""Benchmarks, measured side by side in one run (these machines are shared and noisy).

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

from eagle3_ray import data, verifier


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
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "extract.json"), "w") as f:
        json.dump(result, f, indent=2)
    _plot(result, os.path.join(out_dir, "extract.png"))
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
