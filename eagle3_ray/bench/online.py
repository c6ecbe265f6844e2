"""bench online: offline (extract to Parquet, then train) against online training (online.py)
and online with --cache, on the same conversations, for the same optimizer steps, in one run.

For each arm: wall time to the finished drafter, bytes written (hidden-state Parquet and the
rest: checkpoints, metrics), held-out accuracy of the drafter, teacher-forced (the offline
dataset's held-out split: the same sample ids every arm holds out) and served (the real
decoder on held-out prompts), and for the online arms the throughput balance (online.balance).
The default budget is one epoch: every arm trains on each sample once. Writes
<out>/online.json and <out>/online.png.

    eagle3-ray bench online --samples 32 --max-length 256 --served-prompts 2
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time

from eagle3_ray.bench import quality, stages as bench
from eagle3_ray.data import schema
from eagle3_ray.train import online, trainer as train
from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
from eagle3_ray.train.config import TrainConfig
from eagle3_ray.train.feed import is_eval

ARMS = ("offline", "online", "online_cache")
EVAL_DEPTH = 8


def dir_bytes(path: str) -> tuple[int, int]:
    """(bytes in *.parquet files, bytes in every other file) under path."""
    parquet = other = 0
    for root, _, files in os.walk(path):
        for f in files:
            n = os.path.getsize(os.path.join(root, f))
            parquet, other = (parquet + n, other) if f.endswith(".parquet") else (parquet, other + n)
    return parquet, other


def bench_online(samples: int = 160, max_length: int = 512, steps: int = 0,
                 out_dir: str = "runs/bench", served_prompts: int = 8, served_tokens: int = 48,
                 arms=ARMS) -> dict:
    root = os.path.join(out_dir, "online")
    shutil.rmtree(root, ignore_errors=True)      # every arm starts from nothing
    # one training worker for every arm: on 2 cores the online arms run it beside the verifier
    common = dict(num_workers=1, cpus_per_worker=1.0, max_seq_len=max_length, eval_every=0,
                  log_every=10, checkpoint_every=100_000)
    ecfg = ExtractConfig(sample_limit=samples, max_length=max_length, batch_rows=16,
                         cpus_per_replica=0.25)
    rows, offline_data = {}, os.path.join(root, "offline", "data")

    t0 = time.perf_counter()   # offline: extract, then train
    manifest = run_extract(ExtractConfig(**{**ecfg.__dict__, "output": offline_data,
                                            "cpus_per_replica": 1.0}))
    extract_s = time.perf_counter() - t0
    held_out = sum(is_eval(f, 0.05) for f in _ids(offline_data))
    steps = steps or math.ceil((manifest["summary"]["samples"] - held_out) / 4)  # one epoch
    runs = {"offline": lambda out: train.run_train(TrainConfig(
                dataset=offline_data, output=out, max_steps=steps, **common)),
            "online": lambda out: online.run_online(TrainConfig(
                dataset="", output=out, max_steps=steps, **common), ecfg),
            "online_cache": lambda out: online.run_online(TrainConfig(
                dataset="", output=out, max_steps=steps, **common), ecfg,
                cache=os.path.join(root, "online_cache", "cache"))}
    for arm in arms:
        out = os.path.join(root, arm, "run")
        t1 = time.perf_counter()
        runs[arm](out)
        wall = time.perf_counter() - t1 + (extract_s if arm == "offline" else 0.0)
        ev = train.evaluate_drafter(os.path.join(out, "drafter"), offline_data, EVAL_DEPTH,
                                    max_seq_len=max_length)
        served = quality.served_acceptance(os.path.join(out, "drafter"), served_prompts,
                                           served_tokens, depth=EVAL_DEPTH)
        parquet, other = dir_bytes(os.path.join(root, arm))
        meta = json.load(open(os.path.join(out, "drafter", "meta.json")))
        rows[arm] = {
            "wall_s": wall, "extract_s": extract_s if arm == "offline" else None,
            "steps": meta["steps"], "parquet_bytes": parquet, "other_bytes": other,
            "teacher_forced": {"acc_0": ev["acc_0"], "tau_8": ev["accept_len"]},
            "served": {"acc_0": served["cond_acc"][0], "tau_8": served["tau_by_depth"][EVAL_DEPTH],
                       "rounds": served["rounds"]},
            "throughput": _read_json(os.path.join(out, online.THROUGHPUT_FILE)),
        }
        r = rows[arm]
        print(f"[bench] {arm}: {r['wall_s']:.0f}s to the drafter, {parquet / 2**20:.1f} MiB "
              f"Parquet + {other / 2**20:.1f} MiB other; teacher-forced acc0 "
              f"{ev['acc_0']:.3f} tau(8) {ev['accept_len']:.2f}; served acc0 "
              f"{r['served']['acc_0']:.3f} tau(8) {r['served']['tau_8']:.2f}", flush=True)
    result = {"bench": "online", "samples": manifest["summary"]["samples"],
              "tokens": manifest["summary"]["tokens"], "max_length": max_length,
              "steps": steps, "host": bench.cpu_facts(), "host_flags": quality.host_flags(),
              "arms": rows,
              "note": "wall_s: start to finished drafter (offline: extraction + training). "
                      "teacher_forced: held-out split of the offline dataset at depth 8; "
                      "served: greedy Speculator at depth 8 on held-out ShareGPT prompts."}
    if "offline" in rows:
        for arm in rows:
            rows[arm]["wall_vs_offline"] = rows[arm]["wall_s"] / rows["offline"]["wall_s"]
    bench.save_result(out_dir, "online", result, plot)
    return result


def _ids(dataset: str) -> list[str]:
    fs, root = schema.resolve_fs(dataset)
    return [s for p in schema.list_parts(fs, root) for s in schema.read_column(fs, p, "sample_id")]


def _read_json(path: str) -> dict | None:
    return json.load(open(path)) if os.path.exists(path) else None


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = list(result["arms"])
    rows = [result["arms"][a] for a in arms]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].bar(arms, [r["wall_s"] / 60 for r in rows])
    ax[0].set_ylabel("minutes to the finished drafter")
    ax[1].bar(arms, [r["parquet_bytes"] / 2**20 for r in rows], label="hidden states (Parquet)")
    ax[1].bar(arms, [r["other_bytes"] / 2**20 for r in rows],
              bottom=[r["parquet_bytes"] / 2**20 for r in rows], label="checkpoints, metrics")
    ax[1].set_ylabel("MiB written"), ax[1].legend(fontsize=8)
    x = range(len(arms))
    ax[2].bar([i - 0.2 for i in x], [r["teacher_forced"]["tau_8"] for r in rows], 0.4,
              label="teacher-forced")
    ax[2].bar([i + 0.2 for i in x], [r["served"]["tau_8"] for r in rows], 0.4, label="served")
    ax[2].set_xticks(list(x), arms), ax[2].set_ylabel("tau(8)"), ax[2].legend(fontsize=8)
    fig.suptitle(f"bench online: {result['samples']} samples, {result['steps']} steps, "
                 f"{' '.join(result['host_flags'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
