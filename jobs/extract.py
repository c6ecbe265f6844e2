"""`ray job submit` entrypoint for hidden-state extraction (same flags as `eagle3-ray extract`).

    ray job submit --working-dir . -- python jobs/extract.py \
        --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3_ray.cli import add_extract_args, extract_config  # noqa: E402
from eagle3_ray.launch import job_main  # noqa: E402


def run(a):
    from eagle3_ray.extract.pipeline import run_extract
    run_extract(extract_config(a), a.address)


if __name__ == "__main__":
    sys.exit(job_main("Extract verifier hidden states (Ray Data).", add_extract_args, run))
