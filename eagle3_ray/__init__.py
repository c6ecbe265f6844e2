"""eagle3_ray: deep EAGLE-3 drafters on Ray — extract hidden states, train, serve, plan.

One package per stage, in the order the data flows; a module imports only from its own package
and the ones above it in this list (tests/test_imports.py):

    data/     conversations in; the hidden-state dataset contract             no Ray
    engine/   who holds the verifier (hf: transformers; vllm: its own env)     no Ray
    extract/  1. conversations -> hidden-state Parquet                        Ray Data
    train/    2. hidden states -> drafter (draft, ttt, vocab, checkpoint: no Ray)  Ray Train
    plan/     4. acceptance + node profile -> depth (serving uses its cost model)  no Ray
    serve/    3. verifier + drafter -> tokens (speculate, kernels: no Ray)     Ray Serve
    bench/    benchmarks over the stages
    demo.py, cli.py (the eagle3-ray command), gpu_check.py on top; launch.py starts Ray.
"""
import os

__version__ = "0.1.0"

# OpenMP threads (torch's libgomp) between parallel regions: spinning for libgomp's default ~3 ms
# made each matmul ~20x slower when a host runs more busy threads than it has cores (2 cores: an
# extractor actor beside the tokenizer actor and the driver), so they sleep (PASSIVE). Sleeping
# at once costs a wake-up per region, which a decode step of a small model pays hundreds of
# times: plain decoding ran x1.56 (bf16) to x1.7 (fp32) faster with a ~0.1 ms spin first
# (GOMP_SPINCOUNT, which libgomp honours over the policy), extraction the same
# (docs/benchmarks.md#openmp-wait-policy). Set before torch loads here, so drivers and every
# Ray worker that imports this package get both; export either variable to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
