"""The MLA decoder layer option of the EAGLE-3 drafter (DraftConfig.layer = "mla"): one DeepSeek
multi-head latent attention layer in the layout vLLM's deepseek_eagle3.py
(Eagle3DeepseekV2ForCausalLM / Eagle3DeepseekV3ForCausalLM) and SGLang's kimi_k25_eagle3.py load.
Pure PyTorch; draft.Eagle3Drafter holds it under `midlayer.self_attn` and runs it through the same
qkv() -> attention pattern -> finish() seam as the Llama layer.

Facts carried over from those engines (read there; no code taken):
  - the 2H input concat(input_layernorm(embed), hidden_norm(hidden)) feeds q_a_proj (q-LoRA) or
    q_proj, and kv_a_proj_with_mqa; every other sub-layer is the DeepSeek one:
        q_a_proj [q_lora_rank, 2H], q_a_layernorm [q_lora_rank], q_b_proj [nh*Dqk, q_lora_rank]
        (or q_proj [nh*Dqk, 2H] without q-LoRA)
        kv_a_proj_with_mqa [kv_lora_rank + qk_rope, 2H], kv_a_layernorm [kv_lora_rank],
        kv_b_proj [nh*(qk_nope + v_head), kv_lora_rank], o_proj [H, nh*v_head]
    with Dqk = qk_nope_head_dim + qk_rope_head_dim; the MLP is dense (gate/up/down,
    intermediate_size), never MoE; RMSNorm eps = rms_norm_eps everywhere.
  - RoPE on the qk_rope part only, one key rope part shared by all heads, pairs interleaved
    (vLLM's DeepSeek MLA: is_neox_style=False; transformers' DeepseekV3 with rope_interleave).
    Both rotate (x[2i], x[2i+1]) by frequency i; here the rotated pairs come out as
    [evens | odds], transformers' layout: a permutation applied to q and k alike, so q·k is
    the same number.
  - softmax scale Dqk^-0.5, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN
    ("deepseek_yarn" in vLLM, which also scales cos/sin by
    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)). The attention patterns
    of the drafter's callers scale by q.shape[-1]^-0.5 = Dqk^-0.5, so the YaRN factor is folded
    into q here. Other rope scalings are refused.
  - vLLM's loader maps kv_a_proj_with_mqa into `fused_qkv_a_proj`, which exists only with
    q-LoRA (so its export needs q_lora_rank); SGLang's refuses a config without q_lora_rank.

For training and the builtin decoder, keys/values are expanded per head (k [B, nh, S, Dqk],
v [B, nh, S, Dv]), so ttt.py's diagonal attention and serve's DraftKV run unchanged; the engines
cache the latent (kv_lora_rank + qk_rope per token) instead, which computes the same attention.

    python -m eagle3_ray.train.mla      # a tiny MLA drafter step: shapes of q, k, v and output
"""
from __future__ import annotations

import math

import torch
from torch import nn

# A non-DeepSeek verifier has no MLA dims: the drafter then takes DeepSeek-V3's / Kimi-K2.5's
# per-head dims (the shapes vLLM's MLA kernels are built for; its CPU MLA backend wants
# kv_lora_rank + qk_rope_head_dim = 576) and a q-LoRA rank of min(1536, H) (DeepSeek-V3: 1536
# at H = 7168; more than H buys nothing for a 2H input on a small model).
DEFAULT_DIMS = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128}
DEFAULT_Q_LORA_RANK = 1536
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def dims_from_verifier(text_config) -> dict:
    """The MLA dims of a drafter for a verifier's text config: the verifier's own when it is
    DeepSeek-shaped (has kv_lora_rank), else DEFAULT_DIMS (module constants)."""
    if getattr(text_config, "kv_lora_rank", None):
        return {k: getattr(text_config, k, None) for k in MLA_KEYS}
    return dict(DEFAULT_DIMS, q_lora_rank=min(DEFAULT_Q_LORA_RANK, text_config.hidden_size))


def check_config(c) -> None:
    """Refuse an MLA DraftConfig that is incomplete or that no engine runs."""
    missing = [k for k in MLA_KEYS[1:] if not getattr(c, k)]
    if missing:
        raise ValueError(f"layer 'mla' needs {missing} (positive ints; DraftConfig."
                         "from_verifier_config fills them from the verifier)")
    if c.q_lora_rank is not None and c.q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank must be positive or None, got {c.q_lora_rank}")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.parallel:
        raise ValueError("drafting 'parallel' with layer 'mla': no engine runs one (vLLM's "
                         "deepseek_eagle3.py Eagle3DeepseekV2ForCausalLM has no mask_hidden / "
                         "parallel drafting); train a chain MLA drafter or a parallel Llama one")
    rope_kind(c)


def rope_kind(c) -> str:
    """"default" or "yarn" (DeepSeek's YaRN); anything else is refused by name."""
    s = c.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return kind
    if kind == "yarn" and s.get("attention_factor") == 1.0:
        raise ValueError("rope scaling yarn with attention_factor 1.0 (vLLM's "
                         "'deepseek_llama_scaling') is not supported by the MLA drafter")
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in s:
                raise ValueError(f"rope scaling yarn needs {key!r}: {s}")
        return kind
    raise ValueError(f"rope scaling {kind!r} not supported by the MLA drafter (default, yarn "
                     f"as DeepSeek/Kimi use it): {s}")


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude factor: 1 for scale <= 1, else 0.1·mscale·ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale_factor(c) -> float:
    """The factor on Dqk^-0.5: yarn_mscale(factor, mscale_all_dim)^2 under YaRN, else 1."""
    if rope_kind(c) != "yarn":
        return 1.0
    s = c.rope_scaling
    m = yarn_mscale(s["factor"], float(s.get("mscale_all_dim") or 0.0))
    return m * m


def rope_inv_freq(c, device=None) -> torch.Tensor:
    """[qk_rope/2] fp32 inverse frequencies of the rope part: default, or DeepSeek's YaRN (a
    linear ramp between interpolated and extrapolated frequencies over the correction range of
    beta_fast/beta_slow rotations at original_max_position_embeddings)."""
    d, base = c.qk_rope_head_dim, c.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, device=device).float() / d)   # [d/2]
    if rope_kind(c) == "default":
        return 1.0 / pos_freqs
    s = c.rope_scaling
    factor, old = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

    def correction_dim(rotations):
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp                                                    # [d/2]
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate


def rope_cos_sin(c, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..] -> fp32 cos, sin [.., qk_rope/2] (one angle per interleaved pair), scaled
    by yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) under YaRN."""
    freqs = positions[..., None].float() * rope_inv_freq(c, positions.device)  # [.., d/2]
    cos, sin = freqs.cos(), freqs.sin()
    if rope_kind(c) == "yarn":
        s = c.rope_scaling
        m = yarn_mscale(s["factor"], float(s.get("mscale", 1.0))) / \
            yarn_mscale(s["factor"], float(s.get("mscale_all_dim") or 0.0))
        cos, sin = cos * m, sin * m
    return cos, sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [.., d] with pairs (x[2i], x[2i+1]), cos/sin [.., d/2] -> the pairs rotated, laid out
    [rotated evens | rotated odds] [.., d] (module docstring: same q·k as interleaved)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]                                      # [.., d/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)     # [.., d]


class MLAAttention(nn.Module):
    """The projections of one MLA attention (names as the engines load them); the attention
    pattern belongs to the caller, as in draft.Attention. `norm(size, eps)` makes the layer's
    RMSNorms (draft.RMSNorm: passed in, so this module imports nothing of draft.py's)."""

    def __init__(self, c, norm):
        super().__init__()
        h, nh = c.hidden_size, c.num_attention_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(2 * h, c.q_lora_rank, bias=False)
            self.q_a_layernorm = norm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(2 * h, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, c.kv_lora_rank + c.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = norm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, h, bias=False)
        self.q_scale = softmax_scale_factor(c)   # folded into q (module docstring)

    def qkv(self, c, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, 2H], cos/sin [B, 1, S, qk_rope/2] -> q [B, nh, S, Dqk], k [B, nh, S, Dqk]
        (per head: its nope part, then the shared rope part), v [B, nh, S, Dv]."""
        b, s, _ = x.shape
        nh, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        if c.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))           # [B, S, nh*Dqk]
        else:
            q = self.q_proj(x)                                                # [B, S, nh*Dqk]
        q = q.view(b, s, nh, nope + rope).transpose(1, 2)                     # [B, nh, S, Dqk]
        q_nope, q_rope = q.split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))                     # [B, S, nh*(nope+Dv)]
        kv = kv.view(b, s, nh, nope + c.v_head_dim).transpose(1, 2)         # [B, nh, S, nope+Dv]
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        k_rope = rotate_interleaved(k_rope[:, None], cos, sin)               # [B, 1, S, rope]
        q = torch.cat([q_nope, rotate_interleaved(q_rope, cos, sin)], -1)   # [B, nh, S, Dqk]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rope.expand(b, nh, s, rope)], dim=-1)      # [B, nh, S, Dqk]
        return q, k, v.contiguous()


def main(argv=None):
    import argparse
    import json
    from types import SimpleNamespace

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    c = SimpleNamespace(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=64,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None)
    attn = MLAAttention(c, lambda size, eps: nn.RMSNorm(size, eps=eps))
    cos, sin = rope_cos_sin(c, torch.arange(10)[None])                       # [1, 10, 4] each
    q, k, v = attn.qkv(c, torch.randn(1, 10, 2 * 64), cos[:, None], sin[:, None])
    print(json.dumps({"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)}))


if __name__ == "__main__":
    main()
