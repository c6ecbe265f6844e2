"""Who holds the verifier.
  hf              transformers (the embedded default and small verifiers): load, describe, and
                  capture the aux hidden states with hooks
  vllm            vLLM in its own environment (.venv-vllm, Ray's py_executable): host-sized
                  engine settings, and VllmVerifier (`extract_hidden_states`) for extraction
  vllm_connector  the KV connector handing vLLM's captured states over (loaded by vLLM)
"""
