"""The block (DFlash) drafter: its batched training loss and gradients against a direct
per-block computation, and its serving forward (BlockKV) against the training one."""
import pytest
import torch
import torch.nn.functional as F

from eagle3_ray.train import block, ttt
from eagle3_ray.train.draft import DraftConfig, rms_norm, rope_cos_sin, rotate_half

V, H = 50, 32


def tiny(block_size: int, layers: int = 2, seed: int = 0) -> block.BlockDrafter:
    torch.manual_seed(seed)
    c = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=48, vocab_size=V, draft_vocab_size=40, drafting="block",
                    block_size=block_size, block_layers=layers, initializer_range=0.2)
    m = block.BlockDrafter(c).double()
    m.t2d[:40] = True                          # draft vocab: target ids 0..39 (d2t = 0)
    with torch.no_grad():
        for n in m.modules():                  # norms away from 1, so a missed norm shows
            if isinstance(n, block.RMSNorm):
                n.weight.uniform_(0.5, 1.5)
    return m


def batch(s: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    attention = torch.ones(2, s)
    attention[1, s - 3:] = 0                   # right padding in row 1
    return {"input_ids": torch.randint(0, V, (2, s), generator=g),
            "loss_mask": (torch.rand(2, s, generator=g) > 0.2).double(),
            "attention_mask": attention,
            "aux_hidden_states": torch.randn(2, s, 3 * H, generator=g, dtype=torch.float64),
            "target_ids": torch.randint(0, V, (2, s), generator=g)}   # some outside the vocab


def direct_block(m: block.BlockDrafter, aux: torch.Tensor, tokens: list[int], start: int):
    """One block by hand: context aux [C, 3H] at positions 0..C-1, slots `tokens` at start.. ->
    outputs [Q, H]. Plain attention over [context keys, block keys], no masks."""
    c = m.config
    ctx = rms_norm(aux @ m.fc.weight.T, m.hidden_norm.weight, c.rms_norm_eps)      # [C, H]
    x = m.embed_tokens.weight[torch.tensor(tokens)]                                 # [Q, H]

    def rope(t, pos):
        cos, sin = rope_cos_sin(c, pos)
        return t * cos.to(t.dtype) + rotate_half(t) * sin.to(t.dtype)

    def heads(w, t, norm=None):
        y = (t @ w.T).view(len(t), -1, c.head_dim)                                  # [T, n, D]
        return y if norm is None else rms_norm(y, norm, c.rms_norm_eps)

    pos_c, pos_q = torch.arange(len(ctx)), torch.arange(start, start + len(tokens))
    for layer in m.layers:
        a = layer.self_attn
        y = rms_norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = rope(heads(a.q_proj.weight, y, a.q_norm.weight).transpose(0, 1), pos_q)
        k = torch.cat([rope(heads(a.k_proj.weight, ctx, a.k_norm.weight).transpose(0, 1), pos_c),
                       rope(heads(a.k_proj.weight, y, a.k_norm.weight).transpose(0, 1), pos_q)], 1)
        v = torch.cat([heads(a.v_proj.weight, ctx), heads(a.v_proj.weight, y)]).transpose(0, 1)
        g = c.num_attention_heads // c.num_key_value_heads
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 0), v.repeat_interleave(g, 0))
        x = x + o.transpose(0, 1).reshape(len(tokens), -1) @ a.o_proj.weight.T
        x = x + layer.mlp(rms_norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps))
    return x


def direct_loss(m, b: dict, k: int, decay: float):
    """Every anchor t of every row, one block at a time: Σ_j w^(j-1) mean CE_j / Σ w (hard
    targets: the verifier's argmax where it lies in the draft vocab)."""
    ids, real = b["input_ids"], b["attention_mask"].bool()
    wanted = b["loss_mask"].bool() & real
    wanted[:, 0] = False
    ce_sum, ce_n = [0.0] * k, [0] * k
    for r in range(2):
        n = int(real[r].sum())
        for t in range(n - 1):
            slots = [int(ids[r, t + 1])] + [m.config.mask_token_id] * k
            out = None
            for j in range(1, k + 1):
                u = t + j                       # the target of slot j: the verifier at u
                if u >= n or not wanted[r, u] or int(b["target_ids"][r, u]) >= 40:
                    continue
                if out is None:
                    out = direct_block(m, b["aux_hidden_states"][r, :t + 1], slots, t + 1)
                logits = m.logits(out[j])
                ce_sum[j - 1] = ce_sum[j - 1] + F.cross_entropy(
                    logits[None], b["target_ids"][r, u][None])
                ce_n[j - 1] += 1
    w = [decay ** j for j in range(k)]
    return sum(wj * s / max(1, cnt) for wj, s, cnt in zip(w, ce_sum, ce_n)) / sum(w)


@pytest.mark.parametrize("k,s", [(4, 14), (16, 22)])
def test_block_loss_and_gradients_equal_a_direct_per_block_computation(k, s):
    m, b = tiny(k), batch(s)
    loss, metrics = block.block_loss(m, None, b, k, step_weight_decay=0.7, anchor_fraction=1.0,
                                     targets="hard", checkpoint_attention=True)
    loss.backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    m.zero_grad()
    ref = direct_loss(m, b, k, 0.7)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (float(loss), float(ref))
    for n, p in m.named_parameters():
        if p.requires_grad:
            assert torch.allclose(got[n], p.grad, rtol=1e-8, atol=1e-11), n
    assert len(metrics["acc_k"]) == k and metrics["count"][0] > 0


def test_block_serving_forward_equals_training_forward():
    """The served round (context absorbed in pieces into BlockKV, one block forward) gives
    the outputs block_loss's batched forward gives at the same anchor."""
    k, s = 6, 20
    m, b = tiny(k, layers=3), batch(s)
    aux, ids = b["aux_hidden_states"][:1], b["input_ids"][:1]
    anchors = torch.tensor([[4, 11, 15]])
    slots = torch.tensor([[int(ids[0, t + 1])] + [m.config.mask_token_id] * k
                          for t in anchors[0]]).view(1, -1)                   # [1, 3·Q]
    pos = (anchors[..., None] + 1 + torch.arange(k + 1)).view(1, -1)
    attend = block.AnchoredAttention(anchors, torch.ones(1, s, dtype=torch.bool), k + 1)
    batched = m(slots, pos, attend, aux=aux, aux_positions=torch.arange(s)[None])
    batched = batched.view(3, k + 1, H)
    for i, t in enumerate(anchors[0].tolist()):
        kv = block.BlockKV(len(m.layers))
        for lo, hi in ((0, 2), (2, t + 1)):          # the prompt, then a round's accepted tokens
            if hi > lo:
                pos_c = torch.arange(lo, hi)[None]
                m(slots[:, :0], pos_c[:, :0], kv, aux=aux[:, lo:hi], aux_positions=pos_c)
        assert len(kv) == t + 1
        served = m(slots[:, i * (k + 1):(i + 1) * (k + 1)], pos[:, :k + 1] - anchors[0, 0] + t,
                   kv)[0]
        assert torch.allclose(served, batched[i], rtol=1e-10, atol=1e-12), t
        direct = direct_block(m, aux[0, :t + 1], slots[0, i * (k + 1):(i + 1) * (k + 1)].tolist(),
                              t + 1)
        assert torch.allclose(served, direct, rtol=1e-10, atol=1e-12), t


def test_block_config_refusals():
    with pytest.raises(ValueError, match="Qwen3-style"):
        DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                    intermediate_size=8, vocab_size=V, drafting="block", layer="mla",
                    q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8)
    with pytest.raises(ValueError, match="block_size"):
        DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                    intermediate_size=8, vocab_size=V, drafting="block", block_size=0)
    assert ttt.TARGETS == ("soft", "hard")
