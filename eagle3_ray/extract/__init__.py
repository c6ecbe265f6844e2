"""Stage 1, Ray Data: conversations -> a hidden-state Parquet dataset (data/schema.py).

pipeline  read -> tokenize -> VerifierExtractor actors (one verifier replica each) -> Parquet
regen     batched generation: the verifier answers the prompts itself before extraction
"""
