"""`ray job submit` entrypoint for hidden-state extraction (same flags as `eagle3-ray extract`).

    ray job submit --working-dir . -- python jobs/extract.py \
        --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3_ray.cli import add_extract_args, extract_config
from eagle3_ray.launch import run_main


def main(a):
    from eagle3_ray.extract import run_extract
    run_extract(extract_config(a), a.address)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Extract verifier hidden states (Ray Data).")
    add_extract_args(parser)
    sys.exit(run_main(main, parser.parse_args()))
