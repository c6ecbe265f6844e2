"""eagle3_ray: deep EAGLE-3 drafters on Ray — extract hidden states, train, serve, plan.

Stages live in their own modules (extract, train, serve, plan); the model-side pieces
(data, verifier, schema) are plain PyTorch/pyarrow and import no Ray.
"""
__version__ = "0.1.0"
