#!/usr/bin/env bash
# Run a command as an AVX2-only CPU (no AVX512, no native bf16) would, on an AVX512 host:
#   scripts/emulate_avx2.sh .venv/bin/python -m pytest -q
#   scripts/emulate_avx2.sh .venv/bin/eagle3-ray demo --run-dir runs/demo_avx2
# What it reproduces and what it does not: docs/benchmarks.md, "How figures are reported".
export EAGLE3_RAY_NATIVE_BF16=0      # the verifier in fp32, training without bf16 autocast
export EAGLE3_RAY_ONEDNN=0           # torch's bf16 GEMMs on ATen's own path, not oneDNN's
export ATEN_CPU_CAPABILITY=avx2      # ATen's vectorized kernels built for AVX2
export MKL_ENABLE_INSTRUCTIONS=AVX2  # MKL's fp32 GEMMs
export ONEDNN_MAX_CPU_ISA=AVX2       # oneDNN's fp32 kernels (the packed linears)
exec "$@"
