"""eagle3_ray: deep EAGLE-3 drafters on Ray — extract hidden states, train, serve, plan.

Stages live in their own modules (extract, train, serve, plan); the model-side pieces
(data, verifier, schema) are plain PyTorch/pyarrow and import no Ray.
"""
import os

__version__ = "0.1.0"

# OpenMP's default spin-waiting makes each torch matmul ~20x slower when a host runs more busy
# threads than it has cores (measured on 2 cores: an extractor actor beside the tokenizer actor
# and the driver). Waiting passively costs little on a dedicated host. Set before torch loads
# here, so drivers and every Ray worker that imports this package get it; export the variable
# yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
