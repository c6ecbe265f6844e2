"""The block drafter (DFlash, arXiv 2602.06036): k drafts from ONE forward of a small stack of
decoder layers (pure PyTorch, no Ray). vLLM's `dflash` method (models/qwen3_dflash.py) runs the
same model, and its weight names are the checkpoint's.

A round after position p (the last position whose verifier states are known):
    context    the verifier's aux states of positions <= p, fused and normed once,
               ctx = hidden_norm(fc(aux)) [.., H], then projected by EVERY layer's own k_proj /
               v_proj (+ k_norm, RoPE at the context position) into that layer's keys / values:
               the target conditions each layer, not only the first
    block      k + 1 query slots at positions p+1 .. p+1+k: slot 0 holds the bonus token (the
               verifier's token at p+1), slots 1..k hold mask_token_id (its embedding is the
               verifier's, frozen); slot j's output predicts the token AT position p+1+j
    attention  every slot sees all context keys and all k + 1 slots of its block (non-causal
               inside the block), one joint softmax, scale head_dim^-0.5
    layers     Qwen3 decoder layers (per-head RMSNorm q_norm / k_norm before RoPE), H -> H:
               x += o_proj(attn(input_layernorm(x))); x += mlp(post_attention_layernorm(x))
    output     lm_head(norm(x)) over the draft vocabulary (d2t / t2d as the chain's)
Slot j of a block anchored at t is the chain's TTT step j-1 at t: the same target (the verifier's
distribution of token t+1+j) and the same per-position metrics (ttt.py), so chain, parallel and
block drafters are compared position by position.

Training (`block_loss`) anchors blocks at a random share of the positions of each sequence
(ttt.deep_selection), all at once: the queries are [B, n·(k+1)], the context keys the whole
sequence, and an anchor at t sees context keys <= t only. Memory grows with n·(k+1)·S per layer.

Weight names (vLLM's DFlashQwen3Model after its loader prefixes "model."):
    fc [H, 3H], hidden_norm, layers.{i}.{input_layernorm, post_attention_layernorm},
    layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.{q,k}_norm [head_dim],
    layers.{i}.mlp.{gate,up,down}_proj, norm, lm_head [Vd, H], d2t, t2d (+ embed_tokens, the
    verifier's, frozen, never exported)

    python -m eagle3_ray.train.block --block-size 4     # a tiny random block drafter: loss, metrics
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3_ray.train import ttt
from eagle3_ray.train.draft import (MLP, DraftConfig, RMSNorm, init_weights,
                                    read_verifier_tensors, rope_cos_sin, rotate_half)
from eagle3_ray.engine import hf as verifier


class BlockAttention(nn.Module):
    """Qwen3 attention projections (the pattern belongs to the caller's `attend`)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, c.rms_norm_eps)
        self.k_norm = RMSNorm(d, c.rms_norm_eps)


class BlockLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = BlockAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class BlockDrafter(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        if c.drafting != "block":
            raise ValueError(f"BlockDrafter needs drafting='block', got {c.drafting!r}")
        if c.num_attention_heads % c.num_key_value_heads:
            raise ValueError(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {c.num_key_value_heads}")
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)   # the verifier's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(c) for _ in range(c.block_layers))
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_weights(self, self.config.initializer_range)

    def _heads(self, attn: BlockAttention, x: torch.Tensor, proj: str, n: int) -> torch.Tensor:
        """x [B, S, H] -> proj(x) as heads [B, n, S, D], q/k per-head-normed (Qwen3)."""
        b, s, _ = x.shape
        y = getattr(attn, proj)(x).view(b, s, n, self.config.head_dim)         # [B, S, n, D]
        if proj != "v_proj":
            y = (attn.q_norm if proj == "q_proj" else attn.k_norm)(y)
        return y.transpose(1, 2)                                               # [B, n, S, D]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.config, positions)                        # [B, S, D]
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)          # [B, 1, S, D]
        return x * cos + rotate_half(x) * sin

    def context_kv(self, i: int, ctx: torch.Tensor, positions: torch.Tensor):
        """Layer i's keys / values of the context ctx [B, C, H] (hidden_norm(fc(aux))) at
        positions [B, C] -> k [B, nkv, C, D] (normed, RoPE'd), v [B, nkv, C, D]."""
        attn, nkv = self.layers[i].self_attn, self.config.num_key_value_heads
        k = self._rope(self._heads(attn, ctx, "k_proj", nkv), positions)
        return k, self._heads(attn, ctx, "v_proj", nkv)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attend,
                aux: torch.Tensor | None = None,
                aux_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The block slots token_ids [B, Q] at positions [B, Q] -> their outputs [B, Q, H]
        (pre-final-norm). aux [B, C, 3H] at aux_positions [B, C]: new context (may be None when
        `attend` already holds all of it). attend(i, q, k, v, ctx_k, ctx_v) -> [B, Q, nh*D] is
        layer i's attention: q [B, nh, Q, D], the block's k, v [B, nkv, Q, D], the new
        context's ctx_k, ctx_v [B, nkv, C, D] (None without aux)."""
        c = self.config
        ctx = None
        if aux is not None:
            ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))         # [B, C, H]
        x = self.embed_tokens(token_ids).to(self.fc.weight.dtype)                 # [B, Q, H]
        for i, layer in enumerate(self.layers):
            attn, y = layer.self_attn, layer.input_layernorm(x)
            q = self._rope(self._heads(attn, y, "q_proj", c.num_attention_heads), positions)
            k = self._rope(self._heads(attn, y, "k_proj", c.num_key_value_heads), positions)
            v = self._heads(attn, y, "v_proj", c.num_key_value_heads)           # [B, nkv, Q, D]
            ck, cv = self.context_kv(i, ctx, aux_positions) if ctx is not None else (None, None)
            x = x + attn.o_proj(attend(i, q, k, v, ck, cv))                       # [B, Q, H]
            x = x + layer.mlp(layer.post_attention_layernorm(x))                  # [B, Q, H]
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [.., H] -> [.., Vd]

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# --- attention patterns ---------------------------------------------------------------------

def _grouped(q: torch.Tensor, nkv: int) -> torch.Tensor:
    """[B, nh, Q, D] -> [B, nkv, g, Q, D]: query head h uses kv head h // g (transformers)."""
    b, nh, s, d = q.shape
    return q.view(b, nkv, nh // nkv, s, d)


def _merge(out: torch.Tensor) -> torch.Tensor:
    """[B, nkv, g, Q, D] -> [B, Q, nh*D]."""
    b, nkv, g, s, d = out.shape
    return out.reshape(b, nkv * g, s, d).transpose(1, 2).reshape(b, s, nkv * g * d)


class BlockKV:
    """The serving attention: each layer's context keys / values, appended as verified
    positions arrive; a block's slots see all of them and each other (non-causal). The block's
    own keys are not kept: the next round's context replaces them with the verifier's."""

    def __init__(self, layers: int):
        self.k, self.v = [None] * layers, [None] * layers                     # [1, nkv, C, D]

    def __len__(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def crop(self, n: int) -> None:
        self.k = [k if k is None else k[:, :, :n] for k in self.k]
        self.v = [v if v is None else v[:, :, :n] for v in self.v]

    def __call__(self, i, q, k, v, ck, cv) -> torch.Tensor:
        if ck is not None:
            self.k[i] = ck if self.k[i] is None else torch.cat([self.k[i], ck], 2)
            self.v[i] = cv if self.v[i] is None else torch.cat([self.v[i], cv], 2)
        b, nkv, slots, d = k.shape
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], 2), torch.cat([self.v[i], v], 2)  # [1, nkv, C+Q, D]
        rows = _grouped(q, nkv).reshape(b, nkv, -1, d)     # a KV group's g heads: [1, nkv, gQ, D]
        out = F.scaled_dot_product_attention(rows, k, v)   # no mask: all keys, both ways
        return _merge(out.view(b, nkv, q.shape[1] // nkv, slots, d))          # [1, Q, nh*D]


class AnchoredAttention:
    """The training attention of block_loss: n blocks of Q slots per sequence, block m anchored
    at anchors[:, m] = t, sees the context keys at positions <= t that are real tokens, and its
    own Q slots; no block sees another. recompute: the core is recomputed in backward."""

    def __init__(self, anchors: torch.Tensor, real: torch.Tensor, slots: int,
                 recompute: bool = False):
        s = real.shape[1]
        self.slots, self.recompute = slots, recompute
        seen = torch.arange(s, device=real.device)[None, None] <= anchors[..., None]  # [B, n, S]
        self.mask = (seen & real[:, None])[:, None, None, :, None]          # [B, 1, 1, n, 1, S]

    def _core(self, q, k, v, ck, cv):
        """q [B, nkv, g, n·Q, D] (GQA groups), the blocks' k, v [B, nkv, n·Q, D], the context's
        ck, cv [B, nkv, S, D] -> [B, nkv, g, n·Q, D]. One softmax over both key groups, kept
        apart (no [.., S+Q] concatenation), every matmul with plain batch dims (a broadcast
        batch would copy the context keys once per block)."""
        b, nkv, g, nq, d = q.shape
        n, slots, s = nq // self.slots, self.slots, ck.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        q = q * d ** -0.5                                                  # the scale, once
        s_ctx = (q.reshape(b, nkv, g * nq, d) @ ck.transpose(-1, -2)).to(acc)
        s_ctx = s_ctx.view(b, nkv, g, n, slots, s).masked_fill(~self.mask, float("-inf"))
        qb = q.view(b, nkv, g, n, slots, d).transpose(2, 3).reshape(b, nkv, n, g * slots, d)
        kb, vb = (x.view(b, nkv, n, slots, d) for x in (k, v))             # [B, nkv, n, Q, D]
        s_blk = (qb @ kb.transpose(-1, -2)).to(acc)                       # [B, nkv, n, gQ, Q]
        s_blk = s_blk.view(b, nkv, n, g, slots, slots).transpose(2, 3)    # [B, nkv, g, n, Q, Q]
        top = torch.maximum(s_ctx.amax(-1, keepdim=True), s_blk.amax(-1, keepdim=True))
        e_ctx, e_blk = (s_ctx - top).exp(), (s_blk - top).exp()          # top: finite (blocks)
        z = e_ctx.sum(-1, keepdim=True) + e_blk.sum(-1, keepdim=True)     # [B, nkv, g, n, Q, 1]
        out_ctx = (e_ctx.to(q.dtype).reshape(b, nkv, g * nq, s) @ cv).view(b, nkv, g, n, slots, d)
        e_blk = e_blk.to(q.dtype).transpose(2, 3).reshape(b, nkv, n, g * slots, slots)
        out_blk = (e_blk @ vb).view(b, nkv, n, g, slots, d).transpose(2, 3)
        return ((out_ctx + out_blk) / z.to(q.dtype)).reshape(b, nkv, g, nq, d)

    def __call__(self, i, q, k, v, ck, cv) -> torch.Tensor:
        args = (_grouped(q, k.shape[1]), k, v, ck, cv)
        if self.recompute and torch.is_grad_enabled():
            return _merge(checkpoint(self._core, *args, use_reentrant=False))
        return _merge(self._core(*args))


# --- the training loss ----------------------------------------------------------------------

def block_loss(model, teacher, batch: dict, block_size: int, step_weight_decay: float = 0.8,
               anchor_fraction: float = 0.25, generator=None, targets: str = "soft",
               chunk_size: int = 512, checkpoint_attention: bool = False,
               checkpoint_logits: bool = False, loss_steps: int | None = None):
    """The block drafter's loss and per-position metrics on one batch (ttt_loss's batch and
    metrics: position k here is draft slot k+1 of a block, the chain's step k).
    Blocks of block_size + 1 slots are anchored at a uniform random `anchor_fraction` of the
    positions where some slot has a target (ttt.deep_selection, from `generator`): an anchor t
    puts the data's token t+1 in slot 0 and mask_token_id in slots 1..block_size, at positions
    t+1..t+1+block_size, over the context of positions <= t. Loss: Σ_j w^(j-1) CE_j / Σ w over
    slots j = 1..loss_steps (default all), each CE_j the mean over its learnable anchors."""
    if targets not in ttt.TARGETS:
        raise ValueError(f"targets must be one of {ttt.TARGETS}, got {targets!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    drafter = getattr(model, "module", model)
    ids = batch["input_ids"].long()                                        # [B, S]
    b, s = ids.shape
    real = batch["attention_mask"].bool()                                  # [B, S]
    tg = ttt.Targets.of(drafter, teacher, batch, targets)
    useful = torch.zeros_like(real)                                        # a slot has a loss
    for j in range(1, block_size + 1):
        useful |= ttt.shift_left(tg.learn_row, j, -1) >= 0
    anchors, keep = ttt.deep_selection(useful, anchor_fraction, generator)  # [B, n] each
    n, slots = anchors.shape[1], block_size + 1
    tokens = ttt.shift_left(ids, 1, 0).gather(1, anchors)[..., None].repeat(1, 1, slots)
    tokens[..., 1:] = drafter.config.mask_token_id                         # [B, n, Q]
    positions = anchors[..., None] + 1 + torch.arange(slots, device=ids.device)  # [B, n, Q]
    attend = AnchoredAttention(anchors, real, slots, checkpoint_attention)
    aux = batch["aux_hidden_states"].reshape(b, s, -1)                     # [B, S, 3H]
    every = torch.arange(s, device=ids.device)[None].expand(b, s)          # [B, S]
    out = model(tokens.view(b, n * slots), positions.view(b, n * slots), attend,
                aux=aux, aux_positions=every).view(b, n, slots, -1)        # [B, n, Q, H]
    sums, losses = ttt.StepSums(keep.clone()), []
    for j in range(1, slots):
        rows = ttt.shift_left(tg.target_row, j, -1).gather(1, anchors).masked_fill(~keep, -1)
        learn = ttt.shift_left(tg.learn_row, j, -1).gather(1, anchors).masked_fill(~keep, -1)
        agree = ttt.shift_left(tg.agree, j, False).gather(1, anchors)       # [B, n]
        loss_sum, pred = ttt._step_loss(drafter, out[:, :, j], learn, tg.target, chunk_size,
                                        checkpoint_logits)
        losses.append(loss_sum / (learn >= 0).sum().clamp(min=1))
        sums.add(rows, learn, pred, tg.teacher_top, agree, loss_sum)
    weights = [step_weight_decay ** k for k in range(min(block_size, loss_steps or block_size))]
    return sums.metrics(losses, weights)


# --- building -------------------------------------------------------------------------------

@torch.no_grad()
def init_from_verifier(drafter: BlockDrafter, spec: str) -> dict:
    """Start each draft layer from one of the verifier's top layers (the last block_layers,
    in order) where the tensor shapes match (a Llama verifier: all but q_norm / k_norm, which
    start at 1), and fc as a pass-through of the highest aux state ([0 | 0 | I]). MLA or MoE
    layers do not match and keep their random init. -> {"copied": [...], "kept_random": [...]}"""
    c = drafter.config
    n = verifier.text_config(verifier.load_config(spec)).num_hidden_layers
    first = max(0, n - c.block_layers)
    names = {f"layers.{i}.{k}": f"model.layers.{min(first + i, n - 1)}.{k}"
             for i in range(c.block_layers) for k, _ in drafter.layers[i].named_parameters()}
    w = read_verifier_tensors(spec, list(names.values()), missing_ok=True)
    params, copied, kept = dict(drafter.named_parameters()), [], []
    for mine, theirs in names.items():
        src = w.get(theirs)
        if src is None or tuple(src.shape) != tuple(params[mine].shape):
            kept.append(mine)
            continue
        params[mine].copy_(src.to(params[mine].dtype))
        copied.append(mine)
    h = c.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, 2 * h:] = torch.eye(h)                            # [H, 3H]: high aux
    return {"copied": copied + ["fc.weight"], "kept_random": kept}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    c = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=100, draft_vocab_size=100,
                    drafting="block", block_layers=a.layers, block_size=a.block_size)
    m = BlockDrafter(c)
    m.t2d.fill_(True)
    batch = {"input_ids": torch.randint(0, 100, (2, 32)), "loss_mask": torch.ones(2, 32),
             "attention_mask": torch.ones(2, 32), "aux_hidden_states": torch.randn(2, 32, 192),
             "target_ids": torch.randint(0, 100, (2, 32))}
    loss, metrics = block_loss(m, None, batch, a.block_size, targets="hard")
    loss.backward()
    print(json.dumps({"loss": float(loss.detach()), "acc_k": metrics["acc_k"],
                      "params": sum(x.numel() for x in m.parameters() if x.requires_grad)}))


if __name__ == "__main__":
    main()
