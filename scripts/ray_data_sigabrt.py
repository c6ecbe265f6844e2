"""Is the SIGABRT in Ray Data's get_table_block_metadata_schema task ours or Ray's? (issue 59)

Seen on a 2-core Xeon capped at AVX2: every extraction start (`eagle3-ray demo`, `eagle3-ray
bench extract`) logs, from the worker that runs one of the `get_table_block_metadata_schema`
tasks of `ray.data.from_arrow` (extract/pipeline.py build_pipeline), `Mutex corrupt: both reader
and writer lock held` (abseil's Mutex check, an abort) with a native stack; Ray retries the task
and the run goes on. This script runs that step alone, in a fresh local Ray, in one of these
modes, then greps the session's logs:

    bare   ray + pyarrow only: nothing of this project in the driver or the workers
    ours   as `eagle3-ray extract` starts Ray: eagle3_ray imported first (OMP_WAIT_POLICY /
           GOMP_SPINCOUNT in the environment the workers inherit), torch imported and its
           OpenMP team used in the driver before Ray starts, launch.init_ray (our
           worker_process_setup_hook)
    avx2   `ours` with scripts/emulate_avx2.sh's variables plus ARROW_USER_SIMD_LEVEL=AVX2
           (Arrow's kernels dispatch on the CPU at run time), for a host that is not AVX2-only
    items  `ours` with ray.data.from_items instead of from_arrow: the same rows, with the block
           metadata computed in the driver, so no get_table_block_metadata_schema task runs
           (a workaround for build_pipeline, if the abort does not just move to the next task)

    .venv/bin/python scripts/ray_data_sigabrt.py bare [repeats]    # exit 1: the abort was logged
    .venv/bin/python scripts/ray_data_sigabrt.py ours [repeats]

If `bare` logs the abort, it is Ray's (or Arrow's): report it to Ray with this script. If only
`ours` does, it is this project's start-up.

Why it is not ours, by construction: Ray starts its workers by exec from the raylet, never by
forking the driver, so no driver thread or OpenMP state reaches them; the worker that runs
get_table_block_metadata_schema imports Ray and pyarrow only (no torch, no libgomp loaded: the
OMP_WAIT_POLICY / GOMP_SPINCOUNT this project exports are read by nobody there); and our
worker_process_setup_hook (launch.quiet_workers) only sets a logger's level.

Found on a 2-core AMD EPYC with AVX-512 (not AVX2-only): no abort in any of the four modes (10
repeats each), nor after `eagle3-ray extract --limit 8` on the embedded default, nor in any of
the 34 Ray sessions of the tests and benchmarks run there on 2026-12-07. It has not been
reproduced off the AVX2-only host: run this script there (bare, then ours, then items).
"""
import glob
import os
import sys
import time

MARKERS = ("Mutex corrupt", "SIGABRT")


def main(mode: str, repeats: int) -> int:
    if mode not in ("bare", "ours", "avx2", "items"):
        raise SystemExit(f"mode must be bare, ours, avx2 or items, got {mode!r}")
    if mode == "avx2":
        os.environ.update(EAGLE3_RAY_NATIVE_BF16="0", EAGLE3_RAY_ONEDNN="0",
                          ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
                          ONEDNN_MAX_CPU_ISA="AVX2", ARROW_USER_SIMD_LEVEL="AVX2")
    if mode != "bare":
        import eagle3_ray  # noqa: F401  (first, as the CLI: the OpenMP variables)
        import torch
        x = torch.randn(256, 256)
        for _ in range(20):                  # the driver's OpenMP team is up, as after a probe
            x = torch.tanh(x @ x)
    import pyarrow as pa
    import ray
    if mode == "bare":
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    else:
        from eagle3_ray.launch import init_ray
        init_ray(None)
    session = os.path.realpath("/tmp/ray/session_latest")
    for _ in range(repeats):               # as build_pipeline: small tables -> from_arrow
        if mode == "items":
            rows = [{"sample_id": f"s{i}", "messages_json": "[]"} for i in range(8)]
            ds = ray.data.from_items(rows, override_num_blocks=8)
        else:
            ds = ray.data.from_arrow([pa.table({"sample_id": [f"s{i}"], "messages_json": ["[]"]})
                                      for i in range(8)])
        assert ds.map_batches(lambda b: b, batch_format="pyarrow").count() == 8
    ray.shutdown()
    time.sleep(1)
    hits = []
    for path in sorted(glob.glob(os.path.join(session, "logs", "*"))):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                lines = [ln.rstrip() for ln in f if any(m in ln for m in MARKERS)]
            if lines:
                hits.append((path, lines))
    for path, lines in hits:
        print(f"{path}:\n  " + "\n  ".join(lines[:5]))
    print(f"[sigabrt] mode {mode}, {repeats} x 8 blocks, session {session}: "
          + (f"ABORT logged in {len(hits)} file(s)" if hits else "no abort logged"))
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ours",
                  int(sys.argv[2]) if len(sys.argv) > 2 else 3))
