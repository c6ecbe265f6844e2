"""Seed one extra KV group of a verifier-initialised drafter as a copy (induction) head.

Where the verifier is sure and the drafter is wrong, the token is mostly a copy from the context
(a name, an identifier, a repeated phrase; docs/benchmarks.md, "Where position 0 is lost"). The
verifier copies with induction heads; a one-layer drafter has to build one in a single layer, and
from verifier init nothing learns it: the embedding half of its attention starts at zero. This
module writes the circuit in. At drafter position j the layer sees the token x_{j+1} (embedding
half) and the verifier's states of x_j (hidden half), so one head can do the lookup:

    fc          the low aux state (which still spells out x_j) -> a unit code of x_j, written
                into `pairs` weak directions of the residual (weak for the verifier's lm_head
                and for the high aux state, whose part there fc clears)
    key         that code, read back through hidden_norm (a ridge fit), in the head's
                low-frequency RoPE dimensions, where rotation hardly changes a score over the
                context (pairs head_dim/2 - `pairs` .. head_dim/2 - 1)
    query       the same code of the input token x_{t+1}, from the embedding half
    value       a whitened code of x_{j+1} from the embedding half at j, `value_dims` wide
    o_proj      reads it back so that the lm_head (after the final norm) favours x_{j+1}

So the head attends where the current token occurred before and proposes what came next: a
learned prompt lookup. Only the first query head of the group gets the circuit; the group's
other query heads and their o_proj columns start at zero (capacity that training may use).
The fits need the verifier's aux states of a few thousand real tokens (`aux`, `ids`); the
trainer takes the first training samples. The result is a plain EAGLE-3 drafter with one more
KV group in its config: SGLang and vLLM read it as any other.

Measured on the embedded default against plain verifier init, side by side at equal minutes
(docs/benchmarks.md, "A seeded copy head"): teacher-forced acc 0 +0.014 on two hosts (ttt 4 /
12 minutes and ttt 8 / 30 minutes; +0.10 on the positions a bigram lookup gets right, level
elsewhere) at ~11% fewer steps; served tau(8) +2.6%, inside the noise, and none with the
decoder's lookup fallback on (both take the same copied spans). Off by default.

    eagle3-ray train --dataset runs/demo/data --output /tmp/copy --copy-head --max-steps 20
"""
from __future__ import annotations

import math

import torch

from eagle3_ray import draft


def _ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """argmin_A |x A^T - y|^2 + lam |A|^2: x [N, I], y [N, O] -> A [O, I] (fp64 solve)."""
    x, y = x.double(), y.double()
    a = torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)
    return a.T.float()


def with_copy_group(c: draft.DraftConfig) -> draft.DraftConfig:
    """The config of the same drafter with one more KV group (and its query heads)."""
    group = c.num_attention_heads // c.num_key_value_heads
    return draft.DraftConfig(**{**c.to_dict(), "num_key_value_heads": c.num_key_value_heads + 1,
                                "num_attention_heads": c.num_attention_heads + group})


@torch.no_grad()
def seed_copy_head(drafter: draft.Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor,
                   pairs: int = 12, beta: float = 128.0, sharpness: float = 8.0,
                   gain: float = 2048.0, value_dims: int = 64, value_scale: float = 32.0) -> dict:
    """Write the copy circuit (module docstring) into the last KV group of `drafter`, which
    must be verifier-initialised (fc a pass-through of the high aux state) with that group
    still free (draft.init_from_verifier leaves it at zero). aux [N, 3H]: the verifier's aux
    states at N real positions (any dtype); ids [N]: the token at each (x_j).
    beta: the code's size in the residual; sharpness: score of a perfect match (before the
    softmax scale is undone); gain: the readout's logit scale; value_scale moves magnitude
    from o_proj into v_proj (the same product, smaller gradients). The defaults are the
    measured ones (head_dim 64); a smaller head uses at most head_dim/4 pairs and head_dim
    value dims. Returns fit facts: {"code_r2", "key_r2", "tokens"}."""
    c, attn = drafter.config, drafter.midlayer.self_attn
    h, hd, v = c.hidden_size, c.head_dim, c.vocab_size
    nkv, group = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
    if nkv < 2:
        raise ValueError("seed_copy_head needs a drafter with a spare KV group (with_copy_group)")
    pairs, value_dims = min(pairs, hd // 4), min(value_dims, hd)   # a small head: fewer dims
    if aux.shape[0] != ids.shape[0] or aux.shape[-1] != 3 * h:
        raise ValueError(f"aux {tuple(aux.shape)} / ids {tuple(ids.shape)}: expected [N, {3 * h}]"
                         " / [N]")
    if aux.shape[0] < 2 * h:
        raise ValueError(f"{aux.shape[0]} positions are too few to fit the copy head "
                         f"(at least {2 * h})")
    aux = aux.float()
    w = drafter.embed_tokens.weight.float()                                  # [V, H]
    e = draft.rms_norm(w, 1.0, 1e-6)                                         # [V, H]
    _, s_e, vh_e = torch.linalg.svd(e, full_matrices=False)
    _, s_w, vh_w = torch.linalg.svd(w, full_matrices=False)
    dims = list(range(hd // 2 - pairs, hd // 2))
    dims = torch.tensor(dims + [i + hd // 2 for i in dims])                  # [2p] low-freq
    dc = len(dims)
    code = vh_e[1:dc + 1] / s_e[1:dc + 1, None] * math.sqrt(v / dc)          # [dc, H] (whitened)
    target = e[ids] @ code.T                                                 # [N, dc]
    target = target / target.norm(dim=-1, keepdim=True).clamp_min(1e-6)     # unit codes of x_j
    low, high = aux[:, :h], aux[:, 2 * h:]
    to_code = _ridge(low, target, 1.0)                                       # [dc, H]
    code_r2 = 1 - (low @ to_code.T - target).pow(2).sum() / target.pow(2).sum()
    # weak directions: little of the lm_head and of the high state lies there
    cov_h, cov_w = high.T @ high / len(high), w.T @ w / len(w)
    weak = torch.linalg.eigh(cov_h / cov_h.trace() + cov_w / cov_w.trace())[1][:, :dc].T  # [dc, H]

    fc = drafter.fc.weight
    fc[:, 2 * h:] -= (weak.T @ weak).to(fc.dtype)                            # clear them
    fc[:, :h] = (beta * weak.T @ to_code).to(fc.dtype)                       # write the code
    seen = drafter.midlayer.hidden_norm(drafter.fc(aux.to(fc.dtype))).float()   # [N, H]
    key = _ridge(seen, target, 1e-2)                                         # [dc, H]
    key_r2 = 1 - (seen @ key.T - target).pow(2).sum() / target.pow(2).sum()

    kv0, q0 = (nkv - 1) * hd, (nkv - 1) * group * hd                         # the spare group
    for p in (attn.k_proj, attn.v_proj):
        p.weight[kv0:kv0 + hd] = 0
    attn.q_proj.weight[q0:q0 + group * hd] = 0
    attn.o_proj.weight[:, q0:q0 + group * hd] = 0
    dt = attn.q_proj.weight.dtype
    attn.k_proj.weight[kv0 + dims, h:] = key.to(dt)
    attn.q_proj.weight[q0 + dims, :h] = (sharpness * math.sqrt(hd) * code).to(dt)
    basis = vh_w[1:value_dims + 1] / s_w[1:value_dims + 1, None]            # [dv, H]
    attn.v_proj.weight[kv0:kv0 + value_dims, :h] = \
        (basis * math.sqrt(v / value_dims) * value_scale).to(dt)
    attn.o_proj.weight[:, q0:q0 + value_dims] = \
        (gain / value_scale * basis.T / drafter.norm.weight.float()[:, None]).to(dt)
    return {"code_r2": float(code_r2), "key_r2": float(key_r2), "tokens": int(len(ids))}
