"""Conversations in, and the contract of what extraction writes: no Ray here.

conversations  read ShareGPT / OpenAI-messages JSON, JSONL or Parquet; chat template, assistant
               loss mask, held-out prompts
schema         the hidden-state dataset: Parquet columns, manifest.json, facts a reader checks
"""
