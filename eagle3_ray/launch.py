"""Shared entrypoint plumbing: connect to (or start) Ray, and turn failures into clear exits.

Used by the `eagle3-ray` CLI and the `jobs/*.py` entrypoints that `ray job submit` runs.

    python -c "from eagle3_ray.launch import init_ray; init_ray(None)"
"""
from __future__ import annotations

import os
import sys
import traceback

# Errors caused by the user's input: print one clear line, no traceback.
USER_ERRORS = (FileNotFoundError, ValueError, PermissionError)


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to `address` / $RAY_ADDRESS (set by `ray job submit`), else start a local Ray."""
    import ray
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # "local" ignores a stale /tmp/ray/ray_current_cluster
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env={"worker_process_setup_hook": "eagle3_ray.launch.quiet_workers"})


def quiet_workers() -> None:
    """Runs in every worker of a local Ray started here. Without the dashboard there is no
    State API, and Ray Train's PlacementGroupCleaner (a detached actor that would remove a
    crashed controller's placement group) asks it every second whether the controller is
    alive, logging a warning each time: ~500 lines in a demo's 8 training minutes. The local
    cluster ends with this process, so nothing is left to clean; its warnings are dropped."""
    import logging
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner"
                      ).setLevel(logging.ERROR)


def run_main(fn, *args) -> int:
    """Run fn(*args); user errors -> 'eagle3-ray: error: ...' on stderr and exit code 2."""
    try:
        fn(*args)
        return 0
    except USER_ERRORS as e:
        print(f"eagle3-ray: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eagle3-ray: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        return 1


def job_main(description: str, add_args, run) -> int:
    """A `ray job submit` entrypoint: argparse with add_args, then run(args) under run_main."""
    import argparse
    parser = argparse.ArgumentParser(description=description)
    add_args(parser)
    return run_main(run, parser.parse_args())
