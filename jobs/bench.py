"""`ray job submit` entrypoint for the benchmarks (same arguments as `eagle3-ray bench`):
JSON + PNG under --out (a local path on the node that runs the driver).

    ray job submit --working-dir . -- python jobs/bench.py quality --minutes 12 --out /tmp/bench
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3_ray.cli import add_bench_args, cmd_bench  # noqa: E402
from eagle3_ray.launch import job_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(job_main("Benchmarks of eagle3_ray (JSON + PNG).", add_bench_args, cmd_bench))
