"""The EAGLE-3 drafter (pure PyTorch, no Ray, no TTT logic — that lives in ttt.py).

    fc: 3H -> H fuses the verifier's (low, mid, high) aux states (EAGLE-3.1 fc_norm: each of
        the three first RMS-normed by its own fc_norm.{0,1,2}, as vLLM's combine_hidden_states)
    midlayer: one decoder layer, Llama (layer="llama") or DeepSeek MLA (layer="mla", mla.py),
              whose attention input is concat(input_layernorm(embed(token)), hidden_norm(hidden))
              = 2H; its residual stream is the incoming *hidden* (pre-hidden_norm), not the
              embedding; a dense MLP either way
    norm, lm_head: H -> draft_vocab_size
    the next draft step is fed the layer's output, or norm(output) with EAGLE-3.1 norm_output
        (vLLM's aux_output): forward applies that norm to an incoming [.., H] state itself, so
        callers always hand back the pre-norm output they got
    d2t [Vd] int64 offsets (draft id i -> target id i + d2t[i]), t2d [V] bool
    embed_tokens: the verifier's, frozen

Weight names follow the SGLang/vLLM "LlamaForCausalLMEagle3" layout (see DESIGN.md), the MLA
layer's vLLM's "Eagle3DeepseekV3ForCausalLM" (mla.py). The layer is split into pieces — `qkv`
(norms, concat, projections, RoPE), an attention pattern supplied by the caller, `finish`
(o_proj + residual + MLP), `logits` — so the TTT unroll (ttt.py) and a KV-cached speculative
decoder reuse the same math with their own attention (q/k heads of width Dqk, values of Dv:
they differ for MLA; scale Dqk^-0.5).

`build_drafter` reads only the verifier's embedding, final norm and lm_head (by tensor name,
from its safetensors shards) and returns the drafter plus a frozen `Teacher` (verifier norm +
lm_head split into draft-vocab rows and the rest) that ttt.py uses for the target distribution.

    python -m eagle3_ray.train.draft embedded:smollm2     # prints the drafter config and #params
"""
from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import mla

# The verifier tensors a drafter is built from (Llama-like names; DeepSeek/Kimi use the same).
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass
class DraftConfig:
    hidden_size: int                     # H, = the verifier's (target_hidden_size)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                      # V, the verifier's vocabulary
    draft_vocab_size: int = 32000        # Vd <= V
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # the verifier's rope_scaling / rope_parameters extras
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    aux_layer_ids: list[int] = field(default_factory=list)  # vLLM convention (schema.py)
    initializer_range: float = 0.02      # std of the random init of fc / midlayer weights
    drafting: str = "chain"              # "chain": EAGLE-3, one forward per draft, each fed the
                                         # previous step's state; "parallel": P-EAGLE, k drafts
                                         # from one forward whose slots past the first hold
                                         # mask_token_id and fc(mask_hidden); "block": DFlash,
                                         # a block of drafts from one forward of block_layers
                                         # layers conditioned on the aux states (block.py)
    mask_token_id: int | None = None     # parallel / block: the token of the mask slots (its
                                         # embedding is the verifier's, frozen; parallel: what
                                         # sets a slot apart is the learned mask_hidden);
                                         # default vocab_size - 1
    block_size: int = 16                 # block: drafts per block (a round's query slots are
                                         # the bonus token + block_size masks)
    block_layers: int = 2                # block: decoder layers of the block drafter
    layer: str = "llama"                 # the decoder layer: "llama" (GQA) or "mla" (DeepSeek
                                         # MLA, vLLM's Eagle3DeepseekV3ForCausalLM; mla.py)
    fc_norm: bool = False                # EAGLE-3.1: an RMSNorm per aux state before fc
    norm_output: bool = False            # EAGLE-3.1: the next draft step is fed norm(output)
    # MLA dims (layer "mla" only; from_verifier_config: the verifier's, or mla.DEFAULT_DIMS)
    q_lora_rank: int | None = None       # None: a plain q_proj (no q-LoRA)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self):
        if self.drafting not in DRAFTING:
            raise ValueError(f"drafting must be one of {DRAFTING}, got {self.drafting!r}")
        if self.layer not in LAYERS:
            raise ValueError(f"layer must be one of {LAYERS}, got {self.layer!r}")
        if self.layer == "mla":
            mla.check_config(self)
            self.num_key_value_heads = self.num_attention_heads   # MLA: a key/value per head
        else:               # refuse an unsupported rope now, not at a worker's first forward
            llama_rope_kind(self)
        if self.drafting == "block" and self.layer != "llama":
            raise ValueError("a block drafter's layers are Qwen3-style GQA layers (vLLM's "
                             f"DFlashQwen3); layer {self.layer!r} is for chain drafters")
        if self.drafting == "block" and not (1 <= self.block_size <= 32
                                             and self.block_layers >= 1):
            raise ValueError(f"block drafter: need 1 <= block_size <= 32 and block_layers >= 1, "
                             f"got {self.block_size}, {self.block_layers}")
        if self.drafting in ("parallel", "block") and self.mask_token_id is None:
            self.mask_token_id = self.vocab_size - 1
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary "
                             f"0..{self.vocab_size - 1}")

    @property
    def parallel(self) -> bool:
        return self.drafting == "parallel"

    @property
    def qk_head_dim(self) -> int:
        """Dqk: the width of a query/key head (MLA: qk_nope + qk_rope)."""
        if self.layer == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def value_head_dim(self) -> int:
        """Dv: the width of a value head, = of attn_out per head (MLA: v_head_dim)."""
        return self.v_head_dim if self.layer == "mla" else self.head_dim

    @classmethod
    def from_verifier_config(cls, config, draft_vocab_size: int = 32000,
                             aux_layer_ids: list[int] | None = None, **overrides) -> "DraftConfig":
        """Shapes from a transformers config of the verifier (its text model's, for a
        vision-language wrapper); any field can be overridden. head_dim is the verifier's
        Llama head_dim, or H / heads for a DeepSeek (MLA) verifier, whose config's head_dim is
        qk_rope_head_dim. layer="mla" takes the MLA dims from a DeepSeek-shaped verifier, else
        mla.DEFAULT_DIMS (DeepSeek-V3's)."""
        config = config.get_text_config(decoder=True)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or \
            getattr(config, "rope_scaling", None)
        if scaling and scaling.get("rope_type", "default") == "default":
            scaling = None
        heads = config.num_attention_heads
        deepseek = bool(getattr(config, "kv_lora_rank", None))     # MLA: head_dim = qk_rope
        kw = dict(
            hidden_size=config.hidden_size, num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=(None if deepseek else getattr(config, "head_dim", None))
            or config.hidden_size // heads,
            intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
            draft_vocab_size=min(draft_vocab_size, config.vocab_size),
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
            hidden_act=getattr(config, "hidden_act", "silu"),
            aux_layer_ids=list(aux_layer_ids or []))
        if overrides.get("layer") == "mla":
            kw.update(mla.dims_from_verifier(config))
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


DRAFTING = ("chain", "parallel", "block")
LAYERS = ("llama", "mla")


# --- building blocks ------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalize in fp32 (or fp64), scale in the input dtype."""
    dtype = x.dtype
    xf = x.float() if dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """The projections only: the attention pattern belongs to the caller (causal in
    `causal_attention`, the TTT diagonal in ttt.py, a KV cache when serving)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(2 * h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)


_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        if c.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {c.hidden_act!r} not supported ({sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[c.hidden_act]
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # [.., I] -> [.., H]


class DecoderLayer(nn.Module):
    """Holds the midlayer's weights under their checkpoint names; Eagle3Drafter runs them."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)   # on the token embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)       # on the incoming hidden
        self.self_attn = mla.MLAAttention(c, RMSNorm) if c.layer == "mla" else Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


LLAMA_ROPE = ("default", "linear", "llama3")


def llama_rope_kind(c: DraftConfig) -> str:
    """The Llama layer's rope scaling kind, one of LLAMA_ROPE; any other is refused by name."""
    s = c.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind not in LLAMA_ROPE:
        mla_hint = ("; the MLA layer takes DeepSeek's YaRN (Kimi-K2.5's): --draft-layer mla"
                    if kind == "yarn" else "")
        raise ValueError(f"rope scaling {kind!r} not supported by the Llama drafter layer "
                         f"{LLAMA_ROPE}: {s}{mla_hint}")
    return kind


def rope_inv_freq(c: DraftConfig, device=None) -> torch.Tensor:
    """[head_dim/2] fp32 inverse frequencies: default, "linear" or "llama3" scaling (the same
    formulas as transformers' ROPE_INIT_FUNCTIONS and SGLang/vLLM's get_rope)."""
    d = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    s = c.rope_scaling or {}
    kind = llama_rope_kind(c)
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / s["factor"]
    factor, old = s["factor"], s["original_max_position_embeddings"]      # llama3
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(c: DraftConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..] -> fp32 cos, sin [.., D] of the rotary angles (transformers' layout:
    the D/2 frequencies twice)."""
    freqs = positions[..., None].float() * rope_inv_freq(c, positions.device)  # [.., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                  # [.., D]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)  # [.., D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal GQA attention: q [B, nh, S, D], k [B, nkv, S, D], v [B, nkv, S, Dv] ->
    [B, S, nh*Dv], scale D^-0.5. Right padding needs no key mask: a real query never sees a
    later (padded) key."""
    b, nh, s, _ = q.shape
    d = v.shape[-1]
    if nh != k.shape[1]:  # GQA: query head h uses kv head h // (nh / nkv), as in transformers
        k = k.repeat_interleave(nh // k.shape[1], dim=1)                   # [B, nh, S, D]
        v = v.repeat_interleave(nh // v.shape[1], dim=1)                   # [B, nh, S, Dv]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # [B, nh, S, Dv]
    return out.transpose(1, 2).reshape(b, s, nh * d)  # [B, S, nh*Dv]


@torch.no_grad()
def init_weights(drafter: nn.Module, std: float) -> None:
    """A fresh drafter's weights: linears and the embedding N(0, std), RMSNorms 1."""
    for m in drafter.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.weight.normal_(0.0, std)
        elif isinstance(m, RMSNorm):
            m.weight.fill_(1.0)


# --- the drafter ----------------------------------------------------------------------------

class Eagle3Drafter(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        if c.num_attention_heads % c.num_key_value_heads:
            raise ValueError(f"num_attention_heads {c.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {c.num_key_value_heads}")
        if c.draft_vocab_size > c.vocab_size:
            raise ValueError(f"draft_vocab_size {c.draft_vocab_size} > vocab_size {c.vocab_size}")
        h = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)   # the verifier's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * h, h, bias=False)
        if c.fc_norm:  # EAGLE-3.1: one RMSNorm per aux state (vLLM's fc_norm.{0,1,2})
            self.fc_norm = nn.ModuleList(RMSNorm(h, c.rms_norm_eps) for _ in range(3))
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        if c.parallel:  # P-EAGLE: the aux states a mask slot stands on, learned; vLLM's name
            self.mask_hidden = nn.Parameter(torch.zeros(3 * h))               # [3H]
        self._rope_table = None  # CPU: fp32 (cos, sin) [P, D] of positions 0..P-1 (rope)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init_weights(self, self.config.initializer_range)
        if self.config.parallel:
            self.mask_hidden.normal_(0.0, self.config.initializer_range)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        if self.config.fc_norm:
            parts = aux.chunk(3, dim=-1)                                   # 3 x [B, S, H]
            aux = torch.cat([n(x) for n, x in zip(self.fc_norm, parts)], -1)  # [B, S, 3H]
        return self.fc(aux)  # [B, S, 3H] -> [B, S, H]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [B, S] -> cos, sin [B, 1, S, D] (computed in fp32, like transformers; MLA:
        [B, 1, S, qk_rope/2], one angle per interleaved pair, mla.rope_cos_sin). On
        CPU read from a table of every position up to the largest seen so far (a draft step
        would otherwise spend ~10 small ops on it); elsewhere computed directly (sizing the
        table would cost a device sync per call)."""
        table = mla.rope_cos_sin if self.config.layer == "mla" else rope_cos_sin
        if positions.device.type != "cpu":
            cos, sin = table(self.config, positions)                       # [B, S, D] each
        else:
            n = int(positions.max()) + 1 if positions.numel() else 0
            if self._rope_table is None or self._rope_table[0].shape[0] < n:
                size = max(n, 256 if self._rope_table is None else 2 * len(self._rope_table[0]))
                self._rope_table = table(self.config, torch.arange(size))  # [P, D] each
            cos, sin = (t[positions] for t in self._rope_table)            # [B, S, D] each
        return cos[:, None].to(dtype), sin[:, None].to(dtype)              # [B, 1, S, D]

    def qkv(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """token_ids [B, S], hidden [B, S, H], positions [B, S] ->
        q [B, nh, S, Dqk], k [B, nkv, S, Dqk] (both RoPE'd at `positions`), v [B, nkv, S, Dv].
        MLA: nkv = nh (keys/values expanded per head), Dqk = qk_nope + qk_rope, Dv = v_head_dim,
        and the softmax scale is Dqk^-0.5 as the callers apply it (YaRN's factor is in q)."""
        c, layer = self.config, self.midlayer
        b, s = token_ids.shape
        emb = self.embed_tokens(token_ids).to(hidden.dtype)                # [B, S, H]
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)  # [B, S, 2H]
        attn = layer.self_attn
        if c.layer == "mla":
            return attn.qkv(c, x, *self.rope(positions, x.dtype))

        nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = attn.q_proj(x).view(b, s, nh, d).transpose(1, 2)               # [B, nh, S, D]
        k = attn.k_proj(x).view(b, s, nkv, d).transpose(1, 2)              # [B, nkv, S, D]
        v = attn.v_proj(x).view(b, s, nkv, d).transpose(1, 2)              # [B, nkv, S, D]
        cos, sin = self.rope(positions, q.dtype)                           # [B, 1, S, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, H] (the layer's input = its residual), attn_out [B, S, nh*Dv] ->
        the layer's output [B, S, H] (pre-final-norm; what the next draft step receives)."""
        layer = self.midlayer
        h = hidden + layer.self_attn.o_proj(attn_out)                      # [B, S, H]
        return h + layer.mlp(layer.post_attention_layernorm(h))            # [B, S, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [.., H] -> [.., Vd]

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attend=None, masked: int = 0) -> torch.Tensor:
        """One draft step: token_ids [B, S-m], hidden [B, S-m, 3H] (verifier aux states, fused by
        fc) or [B, S-m, H] (the drafter's own previous output: with norm_output fed as
        norm(output), here), positions [B, S] -> [B, S, H] (pre-final-norm).
        masked = m > 0 (a parallel drafter): m mask slots follow, token mask_token_id and hidden
        fc(mask_hidden) (P-EAGLE; S-m may be 0). `attend(q, k, v) -> [B, S, nh*Dv]` is the
        attention pattern (default: causal)."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fuse(hidden)                                     # [B, S-m, H]
        elif self.config.norm_output:  # EAGLE-3.1: the previous step's post-final-norm state
            hidden = self.norm(hidden)                                     # [B, S-m, H]
        if masked:
            if not self.config.parallel:
                raise ValueError("mask slots need a parallel drafter (drafting='parallel')")
            b = token_ids.shape[0]
            slot = self.fuse(self.mask_hidden[None])[0].to(hidden.dtype)   # [H]
            hidden = torch.cat([hidden, slot.expand(b, masked, -1)], 1)    # [B, S, H]
            mask_ids = token_ids.new_full((b, masked), self.config.mask_token_id)
            token_ids = torch.cat([token_ids, mask_ids], 1)                # [B, S]
        q, k, v = self.qkv(token_ids, hidden, positions)
        attend = causal_attention if attend is None else attend  # (an empty KV cache is falsy)
        return self.finish(hidden, attend(q, k, v))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class Teacher(nn.Module):
    """The verifier's next-token distribution over the draft vocabulary, frozen and not part of
    the drafter's checkpoint: softmax(lm_head[draft rows] · norm(last_hidden)), plus whether the
    verifier's full-vocab argmax lies in the draft vocab (SpecForge's target mask).
    head_rest=None: no rows outside the draft vocab are held (a dataset with target_ids answers
    that question), which spares the trainer (V-Vd)·H of memory: 1.9 GB in bf16 at Kimi-K2.5's
    163,840 × 7,168 with a 32k draft vocab (3.8 GB in fp32)."""

    def __init__(self, norm_weight: torch.Tensor, head_draft: torch.Tensor,
                 head_rest: torch.Tensor | None, eps: float, chunk_size: int = 1024):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight, persistent=False)  # [H]
        self.register_buffer("head_draft", head_draft, persistent=False)    # [Vd, H] draft id order
        self.register_buffer("head_rest", head_rest, persistent=False)      # [V-Vd, H] or None
        self.eps, self.chunk_size = eps, chunk_size

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor,
                check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """last_hidden [N, H] (pre-final-norm) -> p [N, Vd] fp32 (or fp64), in_draft [N] bool.
        The full-vocab argmax is in the draft vocab iff the best draft logit >= the best of the
        other rows (a tie counts as inside), so the [N, V] logits are never held, only
        [chunk, V-Vd] at a time. check=False skips that (in_draft all True): the caller knows
        the verifier's argmax from the dataset. Runs in the buffers' dtype, outside autocast."""
        if check and self.head_rest is None:
            raise ValueError("this Teacher holds no lm_head rows outside the draft vocab, so it "
                             "cannot tell whether the verifier's argmax is in it: the batch "
                             "needs target_ids (a dataset extracted with format_version >= 2)")
        dtype = self.head_draft.dtype
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        ps, inside = [], []
        with torch.autocast(last_hidden.device.type, enabled=False):  # the teacher's own dtype
            for x in last_hidden.split(self.chunk_size):
                ps_x, inside_x = self._chunk(x.to(dtype), out_dtype, check)
                ps.append(ps_x)
                inside.append(inside_x)
        if not ps:
            vd = self.head_draft.shape[0]
            return last_hidden.new_zeros(0, vd, dtype=out_dtype), \
                torch.zeros(0, dtype=torch.bool, device=last_hidden.device)
        return torch.cat(ps), torch.cat(inside)  # [N, Vd], [N]

    def _chunk(self, x: torch.Tensor, out_dtype: torch.dtype, check: bool):
        x = rms_norm(x, self.norm_weight, self.eps)                               # [n, H]
        draft = (x @ self.head_draft.T).to(out_dtype)                             # [n, Vd]
        best = draft.max(-1).values                                               # [n]
        if check and len(self.head_rest):
            best_rest = (x @ self.head_rest.T).to(out_dtype).max(-1).values       # [n]
        else:
            best_rest = torch.full_like(best, float("-inf"))
        return draft.softmax(-1), best >= best_rest


# --- building from the verifier -------------------------------------------------------------

def _resolve_name(name: str, available) -> str | None:
    """`name` itself, else the one non-layer tensor ending like it (e.g. multimodal prefixes)."""
    if name in available:
        return name
    tail = name.split(".", 1)[1] if name.startswith("model.") else name
    found = [n for n in available if n.endswith("." + tail) and ".layers." not in n]
    return found[0] if len(found) == 1 else None


def read_verifier_tensors(spec: str, names, missing_ok: bool = False) -> dict[str, torch.Tensor]:
    """Read just the named tensors of the verifier `spec` (one safe_open per shard involved, one
    get_tensor per name), never the whole model. Names are Llama-like (`model.norm.weight`);
    an unprefixed/multimodal variant ending the same way is accepted. Missing names raise
    KeyError unless missing_ok (then they are left out of the result)."""
    directory = verifier.materialize(spec)
    weight_map = verifier.weight_map(directory)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        stored = _resolve_name(name, weight_map)
        if stored is None:
            if missing_ok:
                continue
            raise KeyError(f"{directory}: verifier has no tensor {name!r}")
        by_file.setdefault(weight_map[stored], []).append((name, stored))
    out = {}
    for file, pairs in by_file.items():
        with safe_open(os.path.join(directory, file), framework="pt") as f:
            for name, stored in pairs:
                out[name] = f.get_tensor(stored)
    return out


def build_drafter(spec: str, draft_config: DraftConfig, d2t: torch.Tensor, t2d: torch.Tensor,
                  dtype: torch.dtype = torch.float32, teacher_check: bool = True,
                  init: str = "random", cls=None) -> tuple[Eagle3Drafter, Teacher]:
    """A drafter for the verifier `spec` from its embedding, final norm and lm_head (tied
    embeddings: no lm_head.weight -> the embedding). The drafter's norm and lm_head start from the
    verifier's (lm_head: the draft vocab's rows); fc and the midlayer are random, or with
    init="verifier" start from one of the verifier's decoder layers (init_from_verifier).
    Returns (drafter, teacher) — the teacher holds the verifier's norm + lm_head rows for ttt.py
    (the rows outside the draft vocab only with teacher_check: datasets with target_ids skip
    them). cls: the drafter's class (default Eagle3Drafter; train.kinds passes the block
    drafter's, whose init="verifier" is its own: block.init_from_verifier)."""
    if init not in INIT_MODES:
        raise ValueError(f"init must be one of {INIT_MODES}, got {init!r}")
    c = draft_config
    d2t, t2d = torch.as_tensor(d2t, dtype=torch.long), torch.as_tensor(t2d, dtype=torch.bool)
    if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.vocab_size,):
        raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)}: expected "
                         f"({c.draft_vocab_size},) / ({c.vocab_size},)")
    target_ids = torch.arange(c.draft_vocab_size) + d2t                     # [Vd] draft -> target
    if (target_ids.min() < 0 or target_ids.max() >= c.vocab_size
            or not t2d[target_ids].all() or int(t2d.sum()) != c.draft_vocab_size):
        raise ValueError("d2t and t2d disagree: t2d must be True exactly at arange(Vd) + d2t")

    w = read_verifier_tensors(spec, [EMBED, FINAL_NORM, LM_HEAD], missing_ok=True)
    for name in (EMBED, FINAL_NORM):
        if name not in w:
            raise KeyError(f"verifier {spec!r}: no tensor {name!r}")
    embed, norm = w[EMBED].to(dtype), w[FINAL_NORM].to(dtype)
    head = w[LM_HEAD].to(dtype) if LM_HEAD in w else embed                  # tied embeddings
    if embed.shape != (c.vocab_size, c.hidden_size) or head.shape != embed.shape:
        raise ValueError(f"verifier {spec!r}: embed {tuple(embed.shape)} / lm_head "
                         f"{tuple(head.shape)}, config says ({c.vocab_size}, {c.hidden_size})")

    drafter = (cls or Eagle3Drafter)(c).to(dtype)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
        drafter.norm.weight.copy_(norm)
        drafter.lm_head.weight.copy_(head[target_ids])                      # [Vd, H]
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    if init == "verifier" and cls is None:
        report = init_from_verifier(drafter, spec)
        if report["kept_random"]:
            warnings.warn(f"verifier {spec!r} layer {report['layer']}: no tensor of the drafter's "
                          f"shape for {report['kept_random']}; those start random")
    rest = head[~t2d].clone() if teacher_check else None                   # [V-Vd, H]
    teacher = Teacher(norm.clone(), head[target_ids].clone(), rest, c.rms_norm_eps)
    return drafter, teacher


INIT_MODES = ("verifier", "random")
# The midlayer projections that read the 2H input (init_from_verifier fills their hidden half).
TWO_H_INPUTS = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa")


@torch.no_grad()
def init_from_verifier(drafter: Eagle3Drafter, spec: str, layer: int | None = None) -> dict:
    """Start the trainable part of the drafter from the verifier instead of noise (the norm and
    lm_head already are the verifier's, see build_drafter):
        fc          a pass-through of the highest aux state: [0 | 0 | I]        [H, 3H]
        midlayer    the verifier's decoder layer `layer` (default: the highest aux layer id,
                    the layer that consumes that state): hidden_norm <- its input_layernorm,
                    the hidden half of q/k/v_proj (columns H:2H) <- its q/k/v_proj, o_proj,
                    post_attention_layernorm, mlp <- its own (MLA: q_a/kv_a_proj_with_mqa's
                    hidden half, q_a/kv_a_layernorm, q_b/kv_b/o_proj); the embedding half (columns
                    0:H) zero: the token enters through training only (measured on the
                    embedded default, teacher-forced: held-out position-0 accuracy 0.363
                    after 200 steps, against 0.321 with a copy of the hidden half there
                    and 0.317 from random init)
    So at step 0 the drafter is one more verifier layer on the verifier's own state: exactly
    the verifier's output of that layer (tests/train/test_draft.py), a prediction one token early.
    Tensors the verifier lacks or shapes that differ (an MoE MLP, MLA attention) keep their
    random init. Returns {"layer": j, "copied": [...], "kept_random": [...]}."""
    c, m = drafter.config, drafter.midlayer
    h = c.hidden_size
    n_layers = verifier.text_config(verifier.load_config(spec)).num_hidden_layers
    j = layer if layer is not None else (c.aux_layer_ids[-1] if c.aux_layer_ids else n_layers - 1)
    if not 0 <= j < n_layers:
        raise ValueError(f"init layer {j} outside the verifier's 0..{n_layers - 1}")
    pre = f"model.layers.{j}."
    params = dict(m.named_parameters())
    plan = {mine: "input_layernorm.weight" if mine == "hidden_norm.weight" else mine
            for mine in params if not mine.startswith("input_layernorm.")}  # same names
    w = read_verifier_tensors(spec, [pre + v for v in plan.values()], missing_ok=True)
    copied, kept = [], []
    for mine, theirs in plan.items():
        src, dst = w.get(pre + theirs), params[mine]
        region = dst[:, h:] if mine.split(".")[1] in TWO_H_INPUTS else dst
        if src is None or tuple(src.shape) != tuple(region.shape):         # 2H ones: hidden half
            kept.append(f"midlayer.{mine}")
            continue
        dst.zero_()                                    # a 2H input's embedding half: zero
        region.copy_(src.to(dst.dtype))
        copied.append(f"midlayer.{mine}")
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, 2 * h:] = torch.eye(h)                            # [H, 3H]: high aux
    copied.append("fc.weight")
    return {"layer": j, "copied": copied, "kept_random": kept}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default=verifier.EMBEDDED_VERIFIER)
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    a = p.parse_args(argv)
    cfg = verifier.text_config(verifier.load_config(a.spec))
    c = DraftConfig.from_verifier_config(cfg, a.draft_vocab_size,
                                         verifier.default_aux_layer_ids(cfg.num_hidden_layers))
    with torch.device("meta"):
        m = Eagle3Drafter(c)
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    print(json.dumps({"draft_config": c.to_dict(), "trainable_params": trainable,
                      "frozen_params": sum(p.numel() for p in m.parameters()) - trainable,
                      "state_dict": {k: list(v.shape) for k, v in m.state_dict().items()}},
                     indent=2))


if __name__ == "__main__":
    main()
