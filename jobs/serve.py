"""`ray job submit` entrypoint for the speculative-decoding server (same flags as
`eagle3-ray serve`). The job deploys the Serve app and keeps running; stop it with
`ray job stop <id>` (or deploy cluster/serve.yaml with `serve deploy` for a long-lived app).

    ray job submit --working-dir . -- python jobs/serve.py \
        --drafter /tmp/train/drafter --depth 8 --node-resource pcie_node --host 0.0.0.0
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eagle3_ray.cli import add_serve_args, serve_config  # noqa: E402
from eagle3_ray.launch import job_main  # noqa: E402


def run(a):
    from eagle3_ray.serve.app import run_serve
    run_serve(serve_config(a), a.address)


if __name__ == "__main__":
    sys.exit(job_main("Serve verifier + EAGLE-3 drafter (Ray Serve, OpenAI API).",
                      add_serve_args, run))
