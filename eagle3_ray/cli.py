"""The `eagle3-ray` command: extract, train, export, demo, bench.

    eagle3-ray demo                                   # the embedded default end to end
    eagle3-ray extract --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
    eagle3-ray train --dataset /tmp/hs --output /tmp/tr --ttt-steps 4 --max-steps 20
    eagle3-ray export --drafter /tmp/tr/drafter --format vllm --output /tmp/tr/vllm
    eagle3-ray bench extract --samples 32             # pipeline vs plain forward loop, JSON+PNG
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from eagle3_ray import data, verifier
from eagle3_ray.launch import init_ray, run_main


def add_extract_args(p: argparse.ArgumentParser) -> None:
    """Flags of ExtractConfig (shared with jobs/extract.py)."""
    p.add_argument("--inputs", nargs="+", default=[data.EMBEDDED_SHAREGPT],
                   help="conversation files/dirs/URIs (.json, .jsonl, .parquet) or embedded:sharegpt")
    p.add_argument("--output", required=True, help="dataset directory: local path or URI")
    p.add_argument("--verifier", default=verifier.EMBEDDED_VERIFIER,
                   help="transformers dir, .gguf file, or embedded:smollm2")
    p.add_argument("--layer-ids", type=int, nargs=3, help="aux layers (vLLM convention)")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int, help="first N usable conversations")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=int, default=0)
    p.add_argument("--max-gpu-memory", help='per-GPU cap when sharding, e.g. "70GiB"')
    p.add_argument("--token-budget", type=int, default=16384, help="padded tokens per forward")
    p.add_argument("--batch-rows", type=int, default=64, help="samples per batch / Parquet part")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--regenerate", action="store_true", help="verifier rewrites assistant turns")
    p.add_argument("--regen-max-new-tokens", type=int, default=512)
    p.add_argument("--regen-temperature", type=float, default=0.0)
    p.add_argument("--regen-top-p", type=float, default=1.0)
    p.add_argument("--regen-seed", type=int, default=0)
    p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")


def extract_config(a: argparse.Namespace):
    from eagle3_ray.extract import ExtractConfig
    return ExtractConfig(
        inputs=a.inputs, output=a.output, verifier=a.verifier, layer_ids=a.layer_ids,
        max_length=a.max_length, sample_limit=a.limit, replicas=a.replicas,
        gpus_per_replica=a.gpus_per_replica, max_gpu_memory=a.max_gpu_memory,
        token_budget=a.token_budget, batch_rows=a.batch_rows, dtype=a.dtype,
        regenerate=a.regenerate, regen_max_new_tokens=a.regen_max_new_tokens,
        regen_temperature=a.regen_temperature, regen_top_p=a.regen_top_p, regen_seed=a.regen_seed)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags of TrainConfig (shared with jobs/train.py)."""
    p.add_argument("--dataset", required=True, help="hidden-state dataset dir/URI (extract output)")
    p.add_argument("--output", required=True, help="run dir: checkpoints, metrics, drafter/")
    p.add_argument("--verifier", default=verifier.EMBEDDED_VERIFIER)
    p.add_argument("--ttt-steps", type=int, default=8, help="TTT unroll depth (1-32)")
    p.add_argument("--step-weight-decay", type=float, default=0.8)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--max-epochs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=2, help="samples per worker per step")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")


def train_config(a: argparse.Namespace):
    from eagle3_ray.train import TrainConfig
    return TrainConfig(
        dataset=a.dataset, output=a.output, verifier=a.verifier, ttt_steps=a.ttt_steps,
        step_weight_decay=a.step_weight_decay, draft_vocab_size=a.draft_vocab_size,
        max_steps=a.max_steps, max_epochs=a.max_epochs, batch_size=a.batch_size,
        max_seq_len=a.max_seq_len, lr=a.lr, warmup_steps=a.warmup_steps,
        eval_fraction=a.eval_fraction, eval_every=a.eval_every, log_every=a.log_every,
        checkpoint_every=a.checkpoint_every, num_workers=a.num_workers, use_gpu=a.use_gpu,
        cpus_per_worker=a.cpus_per_worker, max_failures=a.max_failures)


def cmd_train(a):
    from eagle3_ray.train import run_train
    run_train(train_config(a), a.address)


def cmd_export(a):
    from eagle3_ray import checkpoint
    checkpoint.export(a.drafter, a.output, a.format)
    print(f"[export] {a.format}: {a.output}")


def cmd_extract(a):
    from eagle3_ray.extract import run_extract
    run_extract(extract_config(a), a.address)


def cmd_demo(a):
    """Embedded default: extract a small dataset, then train a drafter on it. Each stage is
    reused when it already finished (extraction and training both resume)."""
    from eagle3_ray.extract import ExtractConfig, run_extract
    from eagle3_ray.train import TrainConfig, run_train
    if a.fresh and os.path.isdir(a.run_dir):
        shutil.rmtree(a.run_dir)
    data_dir = os.path.join(a.run_dir, "data")
    run_extract(ExtractConfig(output=data_dir, sample_limit=a.samples, max_length=a.max_length,
                              batch_rows=16), a.address)
    run_train(TrainConfig(dataset=data_dir, output=os.path.join(a.run_dir, "train"),
                          ttt_steps=a.ttt_steps, draft_vocab_size=8192, max_steps=a.train_steps,
                          batch_size=2, lr=1e-3, warmup_steps=10, eval_every=a.train_steps,
                          checkpoint_every=max(10, a.train_steps // 4), num_workers=2,
                          cpus_per_worker=0.5), a.address)
    print_demo_report(a.run_dir, a.ttt_steps)


def print_demo_report(run_dir: str, ttt_steps: int) -> None:
    import json
    meta = json.load(open(os.path.join(run_dir, "train", "drafter", "meta.json")))
    m = meta["final_metrics"]
    prefix = "eval/" if "eval/acc_0" in m else "train/"
    print(f"\n[demo] drafter: {run_dir}/train/drafter (ttt_steps={ttt_steps}, "
          f"{meta['steps']} steps); plot: {run_dir}/train/drafter/accuracy.png")
    print(f"[demo] held-out per-position accuracy ({prefix.rstrip('/')}): " + ", ".join(
        f"k={k}: {m[prefix + f'acc_{k}']:.2f}" for k in range(ttt_steps)))
    print(f"[demo] estimated acceptance length at depth {ttt_steps}: "
          f"{m[prefix + 'accept_len']:.2f}")


def cmd_bench(a):
    from eagle3_ray import bench
    if a.what == "train":  # pure PyTorch, no Ray
        bench.bench_train(out_dir=a.out)
        return
    init_ray(a.address)
    if a.what == "extract":
        bench.bench_extract(samples=a.samples or 128, max_length=a.max_length, out_dir=a.out,
                            repeats=a.repeats)
    else:
        bench.bench_quality(conversations=a.samples or 1200, max_length=a.max_length,
                            minutes=a.minutes, out_dir=a.out, fresh=a.fresh)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="eagle3-ray", description="Deep EAGLE-3 drafters on Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("extract", help="conversations -> hidden-state Parquet dataset")
    add_extract_args(e)
    e.set_defaults(fn=cmd_extract)

    d = sub.add_parser("demo", help="run the pipeline on the embedded default")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--samples", type=int, default=64)
    d.add_argument("--max-length", type=int, default=512)
    d.add_argument("--ttt-steps", type=int, default=4)
    d.add_argument("--train-steps", type=int, default=60)
    d.add_argument("--fresh", action="store_true", help="delete the run dir and start over")
    d.add_argument("--address")
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="train the drafter on Ray Train (reruns resume)")
    add_train_args(t)
    t.set_defaults(fn=cmd_train)

    x = sub.add_parser("export", help="write a trained drafter in an engine's format")
    x.add_argument("--drafter", required=True, help="a drafter dir (<train output>/drafter)")
    x.add_argument("--format", required=True, choices=["sglang", "vllm", "speculators"])
    x.add_argument("--output", required=True)
    x.set_defaults(fn=cmd_export)

    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    b.add_argument("what", choices=["extract", "train", "quality"])
    b.add_argument("--samples", type=int, help="conversations (extract: 128, quality: 1200)")
    b.add_argument("--minutes", type=float, default=10.0, help="quality: training budget each")
    b.add_argument("--fresh", action="store_true", help="quality: redo extraction and training")
    b.add_argument("--max-length", type=int, default=512)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", default="runs/bench")
    b.add_argument("--address")
    b.set_defaults(fn=cmd_bench)

    a = p.parse_args(argv)
    return run_main(a.fn, a)


if __name__ == "__main__":
    sys.exit(main())
