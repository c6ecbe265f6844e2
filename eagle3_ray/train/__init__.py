"""Stage 2: hidden states -> a drafter. The first seven are pure PyTorch (no Ray).

draft       the EAGLE-3 drafter model
mla         its DeepSeek MLA decoder layer option (vLLM's Eagle3DeepseekV3ForCausalLM)
ttt         the training-time-test unroll and its loss, per-position metrics
vocab       the reduced draft vocabulary (d2t / t2d)
checkpoint  the drafter directory: save, load, export to SGLang / vLLM / speculators
config      TrainConfig, its checks, the lr / depth / precision schedules
kinds       the drafting kinds (chain, parallel): their model and loss, one seam
trainer     the Ray Train stage's driver: checks, draft vocab, TorchTrainer.fit, offline eval
loop        the Ray Train worker loop: steps, reports, eval
feed        the workers' data: Parquet shards, collate, the online pipeline's shard
state       checkpoints and resume, the metrics log, the final drafter
online      extraction streamed straight into the trainer (no Parquet in between)
"""
