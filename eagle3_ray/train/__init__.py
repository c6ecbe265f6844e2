"""Stage 2: hidden states -> a drafter. The first five are pure PyTorch (no Ray).

draft       the EAGLE-3 drafter model
mla         its DeepSeek MLA decoder layer option (vLLM's Eagle3DeepseekV3ForCausalLM)
ttt         the training-time-test unroll and its loss, per-position metrics
vocab       the reduced draft vocabulary (d2t / t2d)
checkpoint  the drafter directory: save, load, export to SGLang / vLLM / speculators
trainer     the Ray Train loop: workers, checkpoints, resume, eval
online      extraction streamed straight into the trainer (no Parquet in between)
"""
