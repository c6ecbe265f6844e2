"""The `eagle3-ray` command: extract, demo, bench.

    eagle3-ray demo                                   # the embedded default end to end
    eagle3-ray extract --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
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


def cmd_extract(a):
    from eagle3_ray.extract import run_extract
    run_extract(extract_config(a), a.address)


def cmd_demo(a):
    """Extract a small embedded-default dataset into <run-dir>/data (reruns resume)."""
    from eagle3_ray.extract import ExtractConfig, run_extract
    if a.fresh and os.path.isdir(a.run_dir):
        shutil.rmtree(a.run_dir)
    run_extract(ExtractConfig(output=os.path.join(a.run_dir, "data"), sample_limit=a.samples,
                              max_length=a.max_length, batch_rows=16), a.address)


def cmd_bench(a):
    from eagle3_ray import bench
    init_ray(a.address)
    bench.bench_extract(samples=a.samples, max_length=a.max_length, out_dir=a.out, repeats=a.repeats)


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
    d.add_argument("--fresh", action="store_true", help="delete the run dir and start over")
    d.add_argument("--address")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    b.add_argument("what", choices=["extract"])
    b.add_argument("--samples", type=int, default=128)
    b.add_argument("--max-length", type=int, default=512)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--out", default="runs/bench")
    b.add_argument("--address")
    b.set_defaults(fn=cmd_bench)

    a = p.parse_args(argv)
    return run_main(a.fn, a)


if __name__ == "__main__":
    sys.exit(main())
