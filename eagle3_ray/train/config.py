"""The training run's settings: TrainConfig (every `eagle3-ray train` flag is a field), their
checks, and the schedules a step reads from them: lr (warmup + cosine), TTT depth (the
curriculum), autocast precision, recompute. Pure PyTorch, no Ray.

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch

from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import draft, kinds, ttt

# Dataset facts a drafter's verifier must share (a different max_length or regeneration is fine).
VERIFIER_FIELDS = ("verifier_config_hash", "hidden_size", "vocab_size", "layer_id_convention",
                   "tokenizer_hash")


@dataclass
class TrainConfig:
    dataset: str                          # hidden-state dataset dir/URI (eagle3-ray extract);
                                          # several joined by commas are read as one
    output: str = "runs/train"            # run dir: Ray checkpoints, metrics, final drafter/
    verifier: str | None = None           # the dataset's verifier; None: the one its manifest
                                          # names (online: the embedded default)
    ttt_steps: int = 8                    # TTT unroll depth: train for the depth you serve
    step_weight_decay: float = 0.8        # loss weight of step k: decay**k
    ttt_ramp: float = 0.5                 # depth curriculum: the unroll grows from 1 step to
                                          # ttt_steps over this share of the training (0 = off)
    deep_fraction: float = 0.25           # share of positions that run the TTT steps past 0
                                          # (random each batch; <1 makes deep steps cheaper)
    cod_ratio: float = 1.0                # COD sampling: step k >= 1 runs on deep_fraction *
                                          # cod_ratio**(k-1) of the positions (1 = the same
                                          # share at every deep step; P-EAGLE uses 0.7)
    cod_min: float = 0.0                  # ... but never fewer than this share (P-EAGLE: 0.2)
    drafting: str = "chain"               # chain: EAGLE-3, k drafts from k drafter forwards;
                                          # parallel: P-EAGLE, k drafts from one forward (mask
                                          # slots; ttt_steps = the depths trained)
                                          # block: DFlash, a block of ttt_steps drafts from
                                          # one forward of block_layers layers (block.py)
    mask_token_id: int | None = None      # parallel, block: the mask slots' token (default V-1)
    block_layers: int = 2                 # block: the block drafter's decoder layers
    draft_layer: str = "llama"            # the drafter's decoder layer: llama | mla (DeepSeek
                                          # MLA, vLLM's Eagle3DeepseekV3ForCausalLM; its dims
                                          # the verifier's if DeepSeek-shaped, train/mla.py)
    fc_norm: bool = False                 # EAGLE-3.1: an RMSNorm per aux state before fc
    norm_output: bool = False             # EAGLE-3.1: draft steps fed the post-final-norm state
    draft_vocab_size: int = 4096          # reduced draft vocab (<= verifier vocab). The lm_head
                                          # dominates a 1-layer drafter's step: on the embedded
                                          # default 4096 (counted over the verifier's argmax)
                                          # trains ~1.2x the tokens/s of 8192 and covers ~92% of
                                          # held-out targets (8192: ~97%), and won at equal
                                          # minutes (docs/benchmarks.md#drafter-recipe-bench-recipe);
                                          # for a 128k+ vocab verifier use 32000, as SpecForge does
    targets: str = "hard"                 # loss target: hard = the verifier's argmax (what
                                          # greedy acceptance checks; no teacher matmul when the
                                          # dataset stores target_ids), soft = the teacher's
                                          # distribution over the draft vocab (ttt.ttt_loss)
    recompute: str = "auto"               # recompute the attention core and lm_head chunks in
                                          # backward (memory) or keep them (compute): on, off,
                                          # auto = on for GPUs, off on CPUs (short on compute)
    init: str = "verifier"                # verifier: fc passes the highest aux state through and
                                          # the midlayer starts as that verifier layer
                                          # (draft.init_from_verifier); random: noise
    max_steps: int = 200                  # optimizer steps in total (across resumes)
    max_epochs: int = 1000                # stop after this many passes even if steps remain
    max_minutes: float = 0                # wall-clock budget of the training loop; 0 = none
    batch_size: int = 4                   # samples per worker per step (one core: 2 loses,
                                          # 4, 8 and 16 level at equal minutes)
    max_seq_len: int = 2048               # truncate samples longer than this
    lr: float = 2e-3                      # best of 1e-3..5e-3 at equal minutes (flat 2e-3..3e-3)
    min_lr_ratio: float = 0.1             # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_fraction: float = 0.05           # held-out share of samples (by sample_id hash)
    eval_every: int = 50                  # steps; 0 = only at the end
    log_every: int = 10                   # steps between reported metrics (a Ray barrier)
    checkpoint_every: int = 50            # steps
    num_workers: int = 2
    use_gpu: bool = False
    parallel: str = "ddp"                 # ddp | fsdp (FSDP2: parameters, gradients and AdamW
                                          # state sharded over the workers)
    precision: str = "auto"               # bf16 | fp32 | auto: bf16 autocast on GPU and on CPUs
                                          # with native bf16 matmul (AVX512-BF16/AMX), else fp32
    cpus_per_worker: float | None = None  # Ray CPUs per CPU worker; None: 1, or what fits a
                                          # local Ray's machine (launch.fit_cpus)
    node_resource: str | None = None      # custom resource of the node type to train on
                                          # (e.g. train_node, cluster/); a sliver per worker
    max_failures: int = 3                 # worker-group restarts (FailureConfig)
    seed: int = 0
    # tests only: "die_once:<step>:<marker>" kills rank 1 once, when it reaches <step>.
    fault_injection: str = field(default_factory=lambda: os.environ.get("EAGLE3_RAY_FAULT", ""))


def autocast_dtype(precision: str, use_gpu: bool) -> torch.dtype | None:
    """bf16 (autocast, fp32 master weights) or None (plain fp32). "auto" takes bf16 on a GPU and
    on a CPU with native bf16 matmul, where it measured ~3x faster per TTT step than fp32."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    if precision == "auto":
        precision = "bf16" if use_gpu or verifier.native_bf16() else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def progress(cfg: TrainConfig, step: int, train_s: float) -> float:
    """Share of the training done, 0..1: the larger of the step and the wall-clock fractions, so
    a time-budgeted run (max_minutes) also anneals and finishes its depth ramp."""
    p = step / max(1, cfg.max_steps)
    if cfg.max_minutes:
        p = max(p, train_s / (60 * cfg.max_minutes))
    return min(1.0, p)


def lr_at(cfg: TrainConfig, step: int, train_s: float) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio (over `progress`)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    p = min(1.0, max(p, progress(cfg, 0, train_s)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def depth_at(cfg: TrainConfig, step: int, train_s: float) -> int:
    """TTT unroll depth of this step. Depth curriculum: over the first `ttt_ramp` share of the
    training the depth grows linearly from 1 to ttt_steps, so the cheap shallow steps teach
    position 0 (which every deeper position builds on) before the deep ones are paid for.
    A kind may start deeper (kinds.min_depth: a parallel drafter at 2)."""
    if cfg.ttt_ramp <= 0:
        return cfg.ttt_steps
    frac = progress(cfg, step, train_s) / cfg.ttt_ramp
    return max(kinds.min_depth(cfg.drafting), min(cfg.ttt_steps, 1 + int(frac * cfg.ttt_steps)))


def check_config(cfg: TrainConfig) -> None:
    """Refuse out-of-range settings before anything starts."""
    if not 1 <= cfg.ttt_steps <= 32:
        raise ValueError(f"ttt_steps must be in 1..32, got {cfg.ttt_steps}")
    for name in ("max_steps", "batch_size", "draft_vocab_size", "log_every", "checkpoint_every",
                 "num_workers", "max_seq_len"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name, allowed in (("targets", ttt.TARGETS), ("recompute", ("auto", "on", "off"))):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.init not in draft.INIT_MODES:
        raise ValueError(f"init must be one of {draft.INIT_MODES}, got {cfg.init!r}")
    if cfg.parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel must be ddp or fsdp, got {cfg.parallel!r}")
    if not 0 < cfg.deep_fraction <= 1:
        raise ValueError(f"deep_fraction must be in (0, 1], got {cfg.deep_fraction}")
    if not 0 < cfg.cod_ratio <= 1 or not 0 <= cfg.cod_min <= 1:
        raise ValueError(f"need 0 < cod_ratio <= 1 and 0 <= cod_min <= 1, got {cfg.cod_ratio}, "
                         f"{cfg.cod_min}")
    if cfg.draft_layer not in draft.LAYERS:
        raise ValueError(f"draft_layer must be one of {draft.LAYERS}, got {cfg.draft_layer!r}")
    kinds.check(cfg.drafting, cfg.ttt_steps, cfg.draft_layer)   # what the drafting kind asks
    if not 0 <= cfg.eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")


def recompute(cfg: TrainConfig) -> bool:
    """TrainConfig.recompute -> whether the loss checkpoints its attention core and logits."""
    return cfg.recompute == "on" or (cfg.recompute == "auto" and cfg.use_gpu)


def loss_settings(cfg: TrainConfig) -> dict:
    """The keywords of kinds.loss that come from cfg (a training step's and the eval's)."""
    return {"step_weight_decay": cfg.step_weight_decay, "targets": cfg.targets,
            "deep_fraction": cfg.deep_fraction, "cod_ratio": cfg.cod_ratio,
            "cod_min": cfg.cod_min, "recompute": recompute(cfg)}
