"""Drafting kinds: what differs between them in training, in one place (draft.DRAFTING names them).

    chain     EAGLE-3: k drafts from k drafter forwards, trained with the TTT unroll (ttt.py)
    parallel  P-EAGLE: k drafts from one forward (mask slots), the same unroll with mask slots
    block     DFlash: a block of k drafts from one forward of a few layers, each layer
              conditioned on the aux states; its own model and loss (block.py), trained at its
              full block size from the first step (its slots see each other, so a smaller
              block is another input, not an easier one: no depth curriculum)

A kind is its model (`build`), its loss (`loss`) and what it asks of the settings (`check`,
`min_depth`); its serving round is serve/speculate.py's. The loop (loop.py), the offline eval
(trainer.evaluate_drafter) and the recipe sweep (bench/sweep.py) call only these, so a new kind
is a branch in each function here, not one spread through the loop. Pure PyTorch, no Ray.

    python -m eagle3_ray.train.ttt --ttt-steps 4       # chain and parallel's loss, a tiny drafter
    python -m eagle3_ray.train.block --block-size 4    # the block drafter's
"""
from __future__ import annotations

import torch

from eagle3_ray.engine import hf
from eagle3_ray.train import block, draft, ttt


def drafting(model) -> str:
    """The kind of a drafter, or of a DDP/FSDP wrapper of one."""
    return getattr(model, "module", model).config.drafting


def check(kind: str, ttt_steps: int, draft_layer: str) -> None:
    """Refuse settings a kind cannot train (TrainConfig's drafting, ttt_steps, draft_layer)."""
    if kind not in draft.DRAFTING:
        raise ValueError(f"drafting must be one of {draft.DRAFTING}, got {kind!r}")
    if kind == "parallel" and ttt_steps < 2:
        raise ValueError("a parallel drafter needs ttt_steps >= 2 (step 1 on is its mask slots)")
    if draft_layer == "mla" and kind == "block":
        raise ValueError("--draft-layer mla with --drafting block: a block drafter's layers are "
                         "Qwen3-style GQA layers (vLLM's DFlashQwen3), whatever the verifier's")
    if draft_layer == "mla" and kind == "parallel":
        raise ValueError("--draft-layer mla with --drafting parallel: no engine runs a parallel "
                         "MLA drafter (vLLM's deepseek_eagle3.py has no mask_hidden / parallel "
                         "drafting); train a chain MLA drafter or a parallel Llama one")


def min_depth(kind: str) -> int:
    """The shallowest unroll the depth curriculum may start at (config.depth_at). A parallel
    drafter starts at 2: its mask state is trained from the first step on (and DDP expects a
    gradient for every parameter)."""
    return 2 if kind == "parallel" else 1


def model_class(dcfg: draft.DraftConfig):
    """The module class of dcfg's kind: block.BlockDrafter, else draft.Eagle3Drafter (chain
    and parallel are one model; parallel adds its mask state)."""
    return block.BlockDrafter if dcfg.drafting == "block" else draft.Eagle3Drafter


def build(verifier: str, dcfg: draft.DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor, *,
          teacher_check: bool, init: str):
    """A fresh drafter of dcfg.drafting's kind for the verifier `verifier` (a spec), with the
    draft vocabulary d2t/t2d -> (drafter, teacher). teacher_check: the teacher keeps the lm_head
    rows outside the draft vocab (datasets without target_ids); init: draft.INIT_MODES."""
    if dcfg.drafting == "block":
        drafter, teacher = draft.build_drafter(verifier, dcfg, d2t, t2d, init=init,
                                               teacher_check=teacher_check,
                                               cls=model_class(dcfg))
        if init == "verifier":
            block.init_from_verifier(drafter, verifier)
        return drafter, teacher
    return draft.build_drafter(verifier, dcfg, d2t, t2d, teacher_check=teacher_check, init=init)


def loss(model, teacher, batch: dict, depth: int, *, step_weight_decay: float = 0.8,
         targets: str = "soft", deep_fraction: float = 1.0, cod_ratio: float = 1.0,
         cod_min: float = 0.0, recompute: bool = True, evaluating: bool = False,
         loss_steps: int | None = None) -> tuple[torch.Tensor, dict]:
    """One batch's loss and metrics (ttt.ttt_loss's: the COUNT_KEYS sums per position and their
    ratios) for `model` (a drafter or its DDP/FSDP wrapper), `depth` positions deep.
    The keywords are TrainConfig's (config.loss_settings): step_weight_decay, targets,
    deep_fraction, cod_ratio and cod_min (position sampling of the deep steps), recompute
    (activation checkpointing of the attention core and logits in backward).
    evaluating: measure every position (the sampling settings are not used); loss_steps: only
    positions 0..loss_steps-1 enter the loss, the rest are measured only (the eval probe)."""
    kind = drafting(model)
    if kind == "block":        # its full block while training; evaluating: `depth` slots
        size = depth if evaluating else getattr(model, "module", model).config.block_size
        return block.block_loss(model, teacher, batch, size, step_weight_decay,
                                anchor_fraction=deep_fraction, targets=targets,
                                checkpoint_attention=recompute, checkpoint_logits=recompute,
                                loss_steps=loss_steps)
    if kind in ("chain", "parallel"):
        return ttt.ttt_loss(model, teacher, batch, depth, step_weight_decay, targets=targets,
                            deep_fraction=1.0 if evaluating else deep_fraction,
                            cod_ratio=1.0 if evaluating else cod_ratio,
                            cod_min=0.0 if evaluating else cod_min,
                            checkpoint_attention=recompute, checkpoint_logits=recompute,
                            loss_steps=loss_steps)
    raise ValueError(f"drafting must be one of {draft.DRAFTING}, got {kind!r}")


def untrained_drafter(spec: str, draft_vocab_size: int | None = None, seed: int = 0,
                      drafting: str = "chain", **config):
    """A randomly initialised drafter for `spec` with the first `draft_vocab_size` token ids
    (default: the full vocabulary) as its draft vocab: for tests, benchmarks of the decoding
    machinery, and `serve` before any training. `config`: DraftConfig fields (layer="mla",
    fc_norm, norm_output, block_size, ...). Returns (drafter, teacher)."""
    cfg = hf.text_config(hf.load_config(spec))
    c = draft.DraftConfig.from_verifier_config(cfg, draft_vocab_size or cfg.vocab_size,
                                         hf.default_aux_layer_ids(cfg.num_hidden_layers),
                                         drafting=drafting, **config)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[:c.draft_vocab_size] = True
    torch.manual_seed(seed)
    return build(spec, c, torch.zeros(c.draft_vocab_size, dtype=torch.long), t2d,
                 teacher_check=True, init="random")
