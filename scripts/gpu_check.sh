#!/usr/bin/env bash
# The check anyone with a GPU runs first (a few minutes, one JSON):
#   bf16 extraction of 300 samples with the embedded verifier, a short bf16 training run with
#   DDP and with FSDP on the GPUs present, bench serve at depths 0-16, eagle3-ray profile (the
#   NCCL all-reduce curve when there are several GPUs); with .venv-vllm also extraction in vLLM
#   and bench engines (the drafter served by vLLM beside the builtin decoder, one GPU)
#   -> runs/gpu_check.json
# Without CUDA it says so, runs the CPU path of the same steps at tiny sizes (bench engines is
# printed, not run) and exits 0 when they pass. Details: eagle3_ray/gpu_check.py. Options:
# --out JSON, --work DIR, --quick (CUDA steps at a few minutes' sizes), --quality-minutes M
# (train M minutes, then served acceptance).
#
#   scripts/gpu_check.sh                     # from a checkout set up with scripts/setup.sh
#   PYTHON=/path/to/python scripts/gpu_check.sh --out /tmp/gc.json --work /tmp/gc
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" -m eagle3_ray.gpu_check "$@"
