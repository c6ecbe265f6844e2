"""Who holds the verifier. hf: transformers (the embedded default and small verifiers): load,
describe, and capture the aux hidden states with hooks. The vLLM engine goes beside it.
"""
