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
_LOCAL_RAY = False      # init_ray started the Ray this process uses: this machine is the cluster
MIN_CPUS = 0.1          # the least Ray CPUs fit_cpus gives a worker or replica


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to `address` / $RAY_ADDRESS (set by `ray job submit`), else start a local Ray."""
    global _LOCAL_RAY
    import ray
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:  # "local" ignores a stale /tmp/ray/ray_current_cluster
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 runtime_env={"worker_process_setup_hook": "eagle3_ray.launch.quiet_workers"})
        _LOCAL_RAY = True


def fit_cpus(reserved: float = 0.0, **groups: tuple[float | None, int]) -> dict[str, float]:
    """Ray CPUs per member of each group, {name: (CPUs each, or None for the default; members)}
    -> {name: CPUs each}. A given value stands: explicit flags win. A default one is 1, except
    on a local Ray that init_ray started (this machine is the whole cluster) where 1 each would
    not fit: there the CPUs left after `reserved` (the pipeline's read and tokenizer tasks) and
    the given groups are shared equally by the default groups' members (2 cores, one training
    worker and one verifier replica beside the online pipeline's 0.25 of read tasks: 0.87
    each), at least
    MIN_CPUS. On a cluster the autoscaler brings the CPUs a plan asks for: 1 each."""
    out = {k: v for k, (v, _) in groups.items() if v is not None}
    open_members = sum(n for k, (v, n) in groups.items() if v is None)
    share = 1.0
    if _LOCAL_RAY and open_members:
        import ray
        left = ray.cluster_resources().get("CPU", 0) - reserved - sum(
            v * n for v, n in groups.values() if v is not None)
        share = min(1.0, max(MIN_CPUS, int(100 * left / open_members) / 100))
    return {**{k: share for k, (v, _) in groups.items() if v is None}, **out}


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
