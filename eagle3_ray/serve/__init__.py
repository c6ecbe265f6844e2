"""Stage 3: verifier + drafter -> served tokens. speculate and kernels are pure PyTorch.

speculate  the speculative decoder: chains, trees, lookup fallback, lossless greedy and sampling
kernels    CPU kernels that keep verification exact (batch-invariant and tree attention, few-row
           linears)
profile    measure this machine's verify and draft costs -> a node profile for the planner
app        the Ray Serve app: OpenAI-compatible HTTP, metrics, dynamic depth
validate   the request checks both engines share: API key, body, roles, sampling fields
vllm       the same API through vLLM and Ray Serve LLM
vllm_ingress  Ray Serve LLM's OpenAI ingress with the key, /health and validate's checks
"""


def __getattr__(name: str):
    """`eagle3_ray.serve:app_builder`, the Ray Serve import path of configs written before the
    stage packages, still resolves (without importing Ray for the pure modules above)."""
    if name == "app_builder":
        from eagle3_ray.serve.app import app_builder
        return app_builder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
