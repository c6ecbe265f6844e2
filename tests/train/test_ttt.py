"""The TTT unroll (eagle3_ray/train/ttt.py) against a naive reference: every step's keys of every
position concatenated, one full boolean mask, full logits, no chunking."""
import math

import pytest
import torch

from eagle3_ray.train import ttt
from eagle3_ray.train.draft import DraftConfig, Eagle3Drafter, Teacher, rms_norm

B, S, V, VD = 2, 12, 50, 20


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, dtype=torch.float64, drafting="chain", **config):
    """A tiny drafter + teacher + batch: right padding in sample 1, masked positions, a draft
    vocab that misses some teacher argmaxes. config: more DraftConfig fields (layer, ...)."""
    g = torch.Generator().manual_seed(seed)
    c = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=48, vocab_size=V, draft_vocab_size=VD, rope_theta=100.0,
                    drafting=drafting, **config)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(c).to(dtype)
    with torch.no_grad():  # bigger weights than the 0.02 init so every term matters
        for p in drafter.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3, generator=g)
        drafter.norm.weight.uniform_(0.5, 1.5, generator=g)
        for n in getattr(drafter, "fc_norm", []):
            n.weight.uniform_(0.5, 1.5, generator=g)
        if drafting == "parallel":
            drafter.mask_hidden.normal_(0, 1.0, generator=g)
    target_ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values       # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    d2t = target_ids - torch.arange(VD)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    head = torch.randn(V, 32, generator=g, dtype=dtype)                      # verifier lm_head
    norm_w = torch.rand(32, generator=g, dtype=dtype) + 0.5
    teacher = Teacher(norm_w, head[target_ids], head[~t2d], c.rms_norm_eps)
    attention = torch.ones(B, S, dtype=torch.long)
    attention[1, 9:] = 0                                                     # right padding
    loss_mask = (torch.rand(B, S, generator=g) > 0.25).long() * attention
    batch = {"input_ids": torch.randint(0, V, (B, S), generator=g) * attention,
             "loss_mask": loss_mask, "attention_mask": attention,
             "aux_hidden_states": torch.randn(B, S, 96, generator=g, dtype=dtype),
             "last_hidden_states": torch.randn(B, S, 32, generator=g, dtype=dtype)}
    full = {"head": head, "norm": norm_w, "t2d": t2d, "target_ids": target_ids}
    return drafter, teacher, batch, full


def naive_loss(drafter, batch, full, steps, decay, deep=None, counts=None, hard=False):
    """Reference: explicit keys of all steps × all positions with a full mask, full logits.
    deep [B, S]: the positions whose steps past 0 count (all if None); counts: a list that gets
    each step's number of valid positions; hard: one-hot targets at the teacher's argmax."""
    c = drafter.config
    ids, att = batch["input_ids"], batch["attention_mask"].bool()
    # teacher over the FULL vocab
    normed = rms_norm(batch["last_hidden_states"], full["norm"], c.rms_norm_eps)  # [B, S, H]
    logits_full = normed @ full["head"].T                                     # [B, S, V]
    in_draft = full["t2d"][logits_full.argmax(-1)]                            # [B, S]
    p = logits_full[..., full["target_ids"]].softmax(-1)                      # [B, S, Vd]
    if hard:
        p = torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).to(p.dtype)
    ok = batch["loss_mask"].bool() & att & in_draft
    hidden = drafter.fuse(batch["aux_hidden_states"])
    pos = torch.arange(S)
    keys, values, losses = [], [], []
    for k in range(steps):
        tok = torch.zeros_like(ids)                                           # token t+1+k
        tok[:, :S - 1 - k] = ids[:, 1 + k:]
        q, kk, vv = drafter.qkv(tok, hidden, (pos + k)[None].expand(B, S))
        keys.append(kk)
        values.append(vv)
        K = torch.cat(keys, dim=2)                                            # [B, nkv, (k+1)S, D]
        Vv = torch.cat(values, dim=2)
        rep = c.num_attention_heads // c.num_key_value_heads
        K, Vv = K.repeat_interleave(rep, 1), Vv.repeat_interleave(rep, 1)     # [B, nh, (k+1)S, D]
        # mask[b, t, (j, s)]: j == 0: s <= t and key s real (or s == t); j >= 1: s == t
        kpos = pos.repeat(k + 1)                                              # [(k+1)S]
        kstep = torch.arange(k + 1).repeat_interleave(S)
        qpos = pos[:, None]
        mask = torch.where(kstep[None] == 0,
                           ((kpos[None] <= qpos)[None] & att[:, None, :].repeat(1, 1, k + 1))
                           | (kpos[None] == qpos)[None],
                           (kpos[None] == qpos)[None])                        # [B, S, (k+1)S]
        scores = q @ K.transpose(-1, -2) / math.sqrt(c.qk_head_dim)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        out = scores.softmax(-1) @ Vv                                         # [B, nh, S, Dv]
        out = drafter.finish(hidden, out.transpose(1, 2).reshape(B, S, -1))  # [B, S, H]
        logp = drafter.logits(out).log_softmax(-1)                            # [B, S, Vd]
        hidden = drafter.norm(out) if c.norm_output else out   # EAGLE-3.1: fed post-norm
        tgt = torch.zeros_like(p)
        valid = torch.zeros_like(ok)
        if k + 1 < S:
            tgt[:, :S - 1 - k] = p[:, 1 + k:]
            valid[:, :S - 1 - k] = ok[:, 1 + k:]
        if deep is not None and k > 0:
            valid &= deep
        if counts is not None:
            counts.append(int(valid.sum()))
        per_pos = -(tgt * logp).sum(-1)
        losses.append((per_pos * valid).sum() / valid.sum().clamp(min=1))
    w = [decay ** k for k in range(steps)]
    return sum(wi * li for wi, li in zip(w, losses)) / sum(w)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def matches_reference(drafter, teacher, batch, full, steps: int):
    """ttt_loss's loss and gradients equal naive_loss's (every trainable parameter gets one);
    returns the reference loss, its gradients and ttt_loss's metrics."""
    ref = naive_loss(drafter, batch, full, steps, 0.8)
    ref.backward()
    g_ref = grads(drafter)
    drafter.zero_grad()
    loss, m = ttt.ttt_loss(drafter, teacher, batch, steps, 0.8, chunk_size=5)
    loss.backward()
    g = grads(drafter)
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (loss, ref)
    assert set(g) == set(g_ref)
    for n in g:
        assert torch.allclose(g[n], g_ref[n], rtol=1e-8, atol=1e-11), n
        assert g[n].abs().sum() > 0, n
    return ref, g_ref, m


@pytest.mark.parametrize("steps,block", [(1, 256), (2, 256), (5, 256), (5, 5)])
def test_matches_naive_reference(steps, block, monkeypatch):
    monkeypatch.setattr(ttt, "ATTN_BLOCK", block)  # 5: queries in 3 blocks of the 12 positions
    drafter, teacher, batch, full = tiny()
    ref, g_ref, m = matches_reference(drafter, teacher, batch, full, steps)
    assert m["count"][0] > 0 and len(m["acc_k"]) == steps
    # no checkpointing / no chunking: same numbers
    drafter.zero_grad()
    loss2, _ = ttt.ttt_loss(drafter, teacher, batch, steps, 0.8, chunk_size=1000,
                            checkpoint_attention=False, checkpoint_logits=False)
    loss2.backward()
    assert torch.allclose(loss2, ref, rtol=1e-10)
    for n, v in grads(drafter).items():
        assert torch.allclose(v, g_ref[n], rtol=1e-8, atol=1e-11), n


MLA = dict(layer="mla", q_lora_rank=12, kv_lora_rank=20, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5)


@pytest.mark.parametrize("config", [MLA, dict(MLA, fc_norm=True, norm_output=True),
                                    dict(fc_norm=True, norm_output=True)],
                         ids=["mla", "mla-3.1", "llama-3.1"])
def test_mla_and_eagle31_unrolls_match_the_naive_reference(config):
    """An MLA drafter (Dqk 10 != Dv 5, a key/value per head) and the EAGLE-3.1 toggles (fc_norm
    in fuse; norm_output: step k+1 fed norm(output of step k)) through the diagonal unroll give
    the direct per-step computation's loss and gradients."""
    matches_reference(*tiny(**config), 3)


def test_hard_targets_match_the_reference_and_never_run_the_teacher():
    """targets="hard": cross-entropy against the verifier's argmax; with target_ids stored the
    teacher is not called, and the metrics (which only need the argmax) equal the soft run's."""
    drafter, teacher, batch, full = tiny()
    ref = naive_loss(drafter, batch, full, 3, 0.8, hard=True)
    ref.backward()
    g_ref = grads(drafter)
    normed = rms_norm(batch["last_hidden_states"], full["norm"], drafter.config.rms_norm_eps)
    greedy = {**batch, "target_ids": (normed @ full["head"].T).argmax(-1)}    # [B, S]

    def no_teacher(*a, **k):
        raise AssertionError("the teacher ran")

    for recompute in (True, False):
        drafter.zero_grad()
        loss, m = ttt.ttt_loss(drafter, no_teacher, greedy, 3, 0.8, chunk_size=5,
                               targets="hard", checkpoint_logits=recompute)
        loss.backward()
        assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (loss, ref)
        for n, v in grads(drafter).items():
            assert torch.allclose(v, g_ref[n], rtol=1e-8, atol=1e-11), n
    with torch.no_grad():
        _, m_soft = ttt.ttt_loss(drafter, teacher, greedy, 3, 0.8)
    for key in ("count", "correct", "all_correct", "loss_count"):
        assert m[key] == m_soft[key], key
    assert m["loss_count"][0] > 0
    with pytest.raises(ValueError, match="targets"):
        ttt.ttt_loss(drafter, teacher, batch, 3, targets="argmax")


@pytest.mark.parametrize("fraction,block", [(0.5, 256), (0.3, 2)])
def test_deep_selection_matches_the_reference_on_its_positions(fraction, block, monkeypatch):
    """deep_fraction < 1 runs steps 1..K-1 on a random share of the positions only: loss,
    gradients and counts equal the full reference restricted to those positions (the other
    positions' deep chains never touch them). block 2: the subset queries span many blocks."""
    monkeypatch.setattr(ttt, "ATTN_BLOCK", block)
    steps = 4
    drafter, teacher, batch, full = tiny(seed=1)
    # positions where some step past 0 has a target: the reference's own validity, shifted
    logits_full = rms_norm(batch["last_hidden_states"], full["norm"], 1e-6) @ full["head"].T
    ok = batch["loss_mask"].bool() & batch["attention_mask"].bool() & \
        full["t2d"][logits_full.argmax(-1)]
    ok[:, 0] = False
    useful = torch.zeros(B, S, dtype=torch.bool)
    for k in range(1, steps):
        useful |= ttt.shift_left(ok, 1 + k, False)
    sel, keep = ttt.deep_selection(useful, fraction, torch.Generator().manual_seed(7))
    deep = torch.zeros(B, S, dtype=torch.bool)
    deep.scatter_(1, sel, keep)
    assert (deep <= useful).all() and 0 < deep.sum() < useful.sum()
    assert deep.sum(1).tolist() == [math.ceil(fraction * n) for n in useful.sum(1).tolist()]
    counts = []
    ref = naive_loss(drafter, batch, full, steps, 0.8, deep=deep, counts=counts)
    ref.backward()
    g_ref = grads(drafter)
    drafter.zero_grad()
    loss, m = ttt.ttt_loss(drafter, teacher, batch, steps, 0.8, chunk_size=5,
                           deep_fraction=fraction, generator=torch.Generator().manual_seed(7))
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (loss, ref)
    for n, g in grads(drafter).items():
        assert torch.allclose(g, g_ref[n], rtol=1e-8, atol=1e-11), n
    assert m["loss_count"] == counts and counts[1] < naive_count(drafter, batch, full, steps)[1]
    with pytest.raises(ValueError, match="deep_fraction"):
        ttt.ttt_loss(drafter, teacher, batch, steps, deep_fraction=0.0)


def naive_count(drafter, batch, full, steps):
    counts = []
    with torch.no_grad():
        naive_loss(drafter, batch, full, steps, 0.8, counts=counts)
    return counts


def test_step0_is_plain_causal_forward():
    drafter, _, batch, _ = tiny()
    ids = batch["input_ids"]
    tok = torch.cat([ids[:, 1:], ids[:, :1] * 0], 1)
    pos = torch.arange(S)[None].expand(B, S)
    plain = drafter(tok, batch["aux_hidden_states"], pos)                    # SDPA causal
    diag = drafter(tok, batch["aux_hidden_states"], pos,
                   attend=ttt.DiagonalAttention(torch.ones(B, S), checkpoint_core=False))
    assert torch.allclose(plain, diag, rtol=1e-10, atol=1e-12)


def test_teacher_matches_full_vocab():
    drafter, teacher, batch, full = tiny()
    h = batch["last_hidden_states"].reshape(-1, 32)
    p, inside = teacher(h)
    logits = rms_norm(h, full["norm"], 1e-6) @ full["head"].T
    assert torch.allclose(p, logits[:, full["target_ids"]].softmax(-1))
    assert torch.equal(inside, full["t2d"][logits.argmax(-1)])
    assert 0 < int(inside.sum()) < len(inside)                               # both cases occur


def test_stored_target_ids_replace_the_full_vocab_check():
    """A format-2 batch carries the verifier's argmax (target_ids): the teacher then skips the
    out-of-draft rows, and loss, gradients and metrics equal the full-vocab check's."""
    drafter, teacher, batch, full = tiny()
    normed = rms_norm(batch["last_hidden_states"], full["norm"], drafter.config.rms_norm_eps)
    greedy = (normed @ full["head"].T).argmax(-1)                             # [B, S]
    assert not full["t2d"][greedy].all()                 # some argmaxes fall outside the vocab
    runs = []
    for b in (batch, {**batch, "target_ids": greedy}):
        drafter.zero_grad()
        loss, m = ttt.ttt_loss(drafter, teacher, b, 3)
        loss.backward()
        runs.append((loss.detach(), m, [p.grad.clone() for p in drafter.parameters()
                                        if p.grad is not None]))
    (l1, m1, g1), (l2, m2, g2) = runs
    torch.testing.assert_close(l1, l2)
    assert {k: m1[k] for k in ttt.COUNT_KEYS} == {k: m2[k] for k in ttt.COUNT_KEYS}
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    # the stored ids decide: mark every target outside the draft vocab -> nothing to learn,
    # and every valid position counts as a rejection (an engine can never accept it)
    outside = torch.nonzero(~full["t2d"])[0, 0].expand(B, S)
    loss3, m3 = ttt.ttt_loss(drafter, teacher, {**batch, "target_ids": outside}, 3)
    assert sum(m3["loss_count"]) == 0 and float(loss3) == 0.0
    assert m3["count"] == m1["count"] and sum(m3["correct"]) == 0
    assert m3["acc_k"] == [0.0] * 3 and m3["in_vocab_k"] == [0.0] * 3 and m3["accept_len"] == 1


def test_perfect_drafter_accepts_everything():
    """Teacher argmax = draft id 0 everywhere; a drafter with norm weight 0 has all-zero logits,
    whose argmax is id 0 too -> acc 1 at every step, accept_len = 1 + K on data that is the
    verifier's own greedy answer."""
    drafter, _, batch, _ = tiny()
    h = 32
    x = torch.ones(h, dtype=torch.float64)
    head_draft = torch.randn(VD, h, dtype=torch.float64) * 0.01
    head_draft[0] = 5.0
    teacher = Teacher(torch.ones(h, dtype=torch.float64), head_draft,
                      torch.zeros(V - VD, h, dtype=torch.float64), 1e-6)
    greedy = int(drafter.d2t[0])                     # draft id 0 in the full vocab
    batch = {**batch, "last_hidden_states": x.expand(B, S, h).clone(),
             "input_ids": torch.full((B, S), greedy) * batch["attention_mask"]}  # greedy data
    with torch.no_grad():
        drafter.norm.weight.zero_()
    steps = 4
    _, m = ttt.ttt_loss(drafter, teacher, batch, steps)
    assert m["acc_k"] == [1.0] * steps and m["cond_acc_k"] == [1.0] * steps
    assert m["p_k"] == [1.0] * steps
    assert m["accept_len"] == 1 + steps
    # data that never continues with the greedy token: every step is still right, but no
    # chain past position 0 is what a server would see, so nothing past 0 is conditioned on
    other = {**batch, "input_ids": torch.full((B, S), greedy + 1) * batch["attention_mask"]}
    _, m = ttt.ttt_loss(drafter, teacher, other, steps)
    assert m["acc_k"] == [1.0] * steps and m["cond_count"][1:] == [0] * (steps - 1)
    assert m["accept_len"] == 2
    # data that agrees at some positions: step k is conditioned on exactly the positions t
    # whose data agreed at t+1..t+k (and that are valid at k)
    coin = torch.rand(B, S, generator=torch.Generator().manual_seed(0)) < 0.7
    mixed = {**batch, "input_ids": torch.where(coin, greedy, greedy + 1) * batch["attention_mask"]}
    _, m = ttt.ttt_loss(drafter, teacher, mixed, steps)
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    valid[:, 0] = False
    agree = valid & ttt.shift_left(mixed["input_ids"] == greedy, 1, False)   # [B, S]
    want, through = [], torch.ones(B, S, dtype=torch.bool)
    for k in range(steps):
        want.append(int((through & ttt.shift_left(valid, 1 + k, False)).sum()))
        through = through & ttt.shift_left(agree, 1 + k, False)
    assert m["cond_count"] == want and m["all_correct"] == want and want[1] > want[3] > 0
    assert m["cond_acc_k"] == [1.0] * steps


def agreeing(batch, full, share, seed):
    """The batch with the verifier's last states pointed at draft-vocab tokens at 80% of the
    positions (so most greedy tokens are in it) and the data's next token set to the greedy
    one at a random `share` of the positions (the data "agrees" there), and agree [B, S] as
    ttt_loss defines it: loss-masked, real, not position 0, greedy token in the draft vocab,
    data agrees."""
    g = torch.Generator().manual_seed(seed)
    rows = full["target_ids"][torch.randint(0, VD, (B, S), generator=g)]     # [B, S]
    last = (3 * full["head"][rows] / full["norm"]).to(batch["last_hidden_states"].dtype)
    point = (torch.rand(B, S, generator=g) < 0.8)[..., None]
    batch = {**batch, "last_hidden_states": torch.where(point, last, batch["last_hidden_states"])}
    logits_full = rms_norm(batch["last_hidden_states"], full["norm"], 1e-6) @ full["head"].T
    top = logits_full.argmax(-1)                                              # [B, S]
    ids, real = batch["input_ids"].clone(), batch["attention_mask"].bool()
    coin = torch.rand(B, S, generator=g) < share
    for b in range(B):
        for u in range(S - 1):
            if coin[b, u] and real[b, u + 1]:
                ids[b, u + 1] = top[b, u]
    agree = torch.zeros(B, S, dtype=torch.bool)
    agree[:, :-1] = ids[:, 1:] == top[:, :-1]
    agree &= batch["loss_mask"].bool() & real & full["t2d"][top]
    agree[:, 0] = False
    return {**batch, "input_ids": ids}, agree


def test_metric_counts_match_brute_force():
    drafter, teacher, batch, full = tiny(seed=3)
    batch, agree = agreeing(batch, full, 0.7, seed=3)
    steps = 3
    with torch.no_grad():
        _, m = ttt.ttt_loss(drafter, teacher, batch, steps)
    # brute force from the naive pieces: per (b, t) the list of (valid, correct) per step
    c = drafter.config
    logits_full = rms_norm(batch["last_hidden_states"], full["norm"], 1e-6) @ full["head"].T
    ok_pos = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    in_vocab = full["t2d"][logits_full.argmax(-1)]
    top = logits_full[..., full["target_ids"]].argmax(-1)
    hidden = drafter.fuse(batch["aux_hidden_states"])
    attend = ttt.DiagonalAttention(batch["attention_mask"], checkpoint_core=False)
    preds = []
    with torch.no_grad():
        for k in range(steps):
            tok = ttt.shift_left(batch["input_ids"], 1 + k, 0)
            hidden = drafter(tok, hidden, torch.arange(S)[None].expand(B, S) + k, attend=attend)
            preds.append(drafter.logits(hidden).argmax(-1))
    count, correct, cond_count, all_correct = [0] * steps, [0] * steps, [0] * steps, [0] * steps
    loss_count = [0] * steps
    for b in range(B):
        for t in range(S):
            chain = True
            for k in range(steps):
                u = t + 1 + k
                valid = u < S and bool(ok_pos[b, u])
                # a target outside the draft vocab is valid but never right
                right = valid and bool(in_vocab[b, u]) and int(preds[k][b, t]) == int(top[b, u])
                count[k] += valid
                loss_count[k] += valid and bool(in_vocab[b, u])
                correct[k] += right
                cond_count[k] += valid and chain
                chain = chain and right
                all_correct[k] += chain
                # a served step k+1 is fed the greedy token: only a chain along which the data
                # agreed is conditioned on
                chain = chain and u < S and bool(agree[b, u])
    assert m["count"] == count and m["correct"] == correct
    assert m["cond_count"] == cond_count and m["all_correct"] == all_correct
    assert m["loss_count"] == loss_count
    assert 0 < sum(loss_count) < sum(count)              # both kinds of target occur
    cond = [a / n if n else 0.0 for a, n in zip(all_correct, cond_count)]
    assert m["cond_acc_k"] == cond
    assert m["p_k"] == pytest.approx([math.prod(cond[:k + 1]) for k in range(steps)])
    assert c.draft_vocab_size == VD
    agg = ttt.aggregate_metrics([m, m])
    assert agg["count"] == [2 * x for x in count] and agg["acc_k"] == m["acc_k"]


def test_wrapped_model_and_no_grad():
    """A DDP-like wrapper (`.module`, forward passthrough) and eval under no_grad agree."""
    drafter, teacher, batch, _ = tiny()

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m
            self.calls = 0

        def forward(self, *a, **kw):
            self.calls += 1
            return self.module(*a, **kw)

    w = Wrap(drafter)
    loss_w, _ = ttt.ttt_loss(w, teacher, batch, 3)
    assert w.calls == 3
    loss, _ = ttt.ttt_loss(drafter, teacher, batch, 3)
    with torch.no_grad():
        loss_ng, m_ng = ttt.ttt_loss(drafter, teacher, batch, 3)
    assert torch.allclose(loss_w, loss) and torch.allclose(loss_ng, loss)
    assert m_ng["loss"] == pytest.approx(float(loss))


def test_probe_steps_are_measured_but_stay_out_of_the_loss():
    """loss_steps: an unroll one step deeper (train.evaluate's probe past the trained depth)
    gives the same loss and the same metrics at the trained steps, plus the probe's metrics."""
    drafter, teacher, batch, _ = tiny()
    loss3, m3 = ttt.ttt_loss(drafter, teacher, batch, 3)
    loss4, m4 = ttt.ttt_loss(drafter, teacher, batch, 4, loss_steps=3)
    assert torch.allclose(loss4, loss3) and m4["loss"] == pytest.approx(m3["loss"])
    for key in ("acc_k", "cond_acc_k", "loss_k", "count"):
        assert len(m4[key]) == 4 and m4[key][:3] == pytest.approx(m3[key]), key
    assert m4["count"][3] > 0
    full, _ = ttt.ttt_loss(drafter, teacher, batch, 4)        # the probe's loss does count here
    assert not torch.allclose(full, loss3)


def test_loss_falls_when_training():
    torch.manual_seed(0)
    drafter, teacher, batch, _ = tiny(dtype=torch.float32)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    teacher = teacher.float()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(50):
        loss, m = ttt.ttt_loss(drafter, teacher, batch, 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert float(loss) < 0.7 * first, (first, float(loss))


def test_32_steps_run_and_empty_steps_keep_the_graph():
    drafter, teacher, batch, _ = tiny(dtype=torch.float32)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    loss, m = ttt.ttt_loss(drafter, teacher.float(), batch, 32)
    loss.backward()
    assert len(m["loss_k"]) == 32 and m["count"][-1] == 0 and m["count"][0] > 0
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)
    assert math.isfinite(float(loss))
    # a batch with no valid position at all still gives a differentiable zero loss
    empty = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    loss0, m0 = ttt.ttt_loss(drafter, teacher.float(), empty, 2)
    loss0.backward()
    assert float(loss0) == 0.0 and m0["count"] == [0, 0]


def served_parallel_loss(drafter, batch, full, steps, decay, ran=None):
    """Reference for a parallel drafter: for each position t and depth k, the forward a server
    runs (tokens 1..t+1 on aux states 0..t, then k mask slots, plain causal attention) and its
    last slot's prediction of token t+2+k, against the teacher at t+1+k. ran[k]: the [B, S]
    positions step k counts (default all) -> (loss, learnable positions per step)."""
    c = drafter.config
    ids, att = batch["input_ids"], batch["attention_mask"].bool()
    logits_full = rms_norm(batch["last_hidden_states"], full["norm"], c.rms_norm_eps) \
        @ full["head"].T                                                      # [B, S, V]
    p = logits_full[..., full["target_ids"]].softmax(-1)                      # [B, S, Vd]
    ok = batch["loss_mask"].bool() & att & full["t2d"][logits_full.argmax(-1)]
    losses, counts = [], []
    for k in range(steps):
        total, n = 0.0, 0
        for b in range(len(ids)):
            for t in range(S - 1 - k):
                if not ok[b, t + 1 + k] or (ran is not None and not ran[k][b, t]):
                    continue
                h = drafter(ids[b, 1:t + 2][None], batch["aux_hidden_states"][b, :t + 1][None],
                            torch.arange(t + 1 + k)[None], masked=k)[0, -1]   # [H]
                total = total - (p[b, t + 1 + k] * drafter.logits(h).log_softmax(-1)).sum()
                n += 1
        losses.append(total / max(n, 1))
        counts.append(n)
    w = [decay ** k for k in range(steps)]
    return sum(wi * li for wi, li in zip(w, losses)) / sum(w), counts


class Recorder(torch.nn.Module):
    """A DDP-like wrapper that records the positions each unroll step ran on."""

    def __init__(self, m):
        super().__init__()
        self.module, self.positions = m, []

    def forward(self, tokens, hidden, positions, **kw):
        self.positions.append(positions - len(self.positions))              # t, not t + k
        return self.module(tokens, hidden, positions, **kw)


@pytest.mark.parametrize("cod", [False, True])
def test_parallel_unroll_is_the_served_forward(cod):
    """A parallel (P-EAGLE) drafter's unroll computes, at every position and depth, what serving
    runs: one causal forward over the context and k mask slots. Loss and gradients (mask_hidden
    included) equal that reference, also with COD sampling, whose deep steps run on shrinking
    nested position sets (so the diagonal keys of the earlier slots follow the selection)."""
    drafter, teacher, batch, full = tiny(seed=6, drafting="parallel")
    steps = 4
    rec = Recorder(drafter)
    kw = {}
    if cod:   # one sample: no row is padded out to another's share, so `ran` is exact
        batch = {k: v[:1] for k, v in batch.items()}
        kw = dict(deep_fraction=0.8, cod_ratio=0.5, cod_min=0.1,
                  generator=torch.Generator().manual_seed(3))
    loss, m = ttt.ttt_loss(rec, teacher, batch, steps, 0.8, chunk_size=5, **kw)
    loss.backward()
    g = grads(drafter)
    ran = []
    for pos in rec.positions:
        r = torch.zeros(len(batch["input_ids"]), S, dtype=torch.bool)
        ran.append(r.scatter_(1, pos.expand(len(r), -1), True))
    drafter.zero_grad()
    ref, counts = served_parallel_loss(drafter, batch, full, steps, 0.8, ran if cod else None)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12), (loss, ref)
    for n, v in grads(drafter).items():
        assert torch.allclose(g[n], v, rtol=1e-8, atol=1e-11), n
    assert g["mask_hidden"].abs().sum() > 0
    assert m["loss_count"] == counts and counts[-1] > 0
    rows = [p.shape[1] for p in rec.positions]
    if cod:          # shares 1, .8, .4, .2 of the useful positions: fewer rows, nested sets
        assert rows[0] == S and rows[1] > rows[2] > rows[3]
        assert all((ran[k + 1] <= ran[k]).all() for k in range(steps - 1))
    else:
        assert rows == [S] * steps


def test_cod_shares_and_a_chain_with_cod_trains():
    """cod_ratio / cod_min on a chain drafter: deep steps count fewer positions, step by step,
    never below the floor; the loss stays finite and differentiable; bad values are refused."""
    drafter, teacher, batch, _ = tiny(dtype=torch.float32)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    rec = Recorder(drafter)
    loss, m = ttt.ttt_loss(rec, teacher.float(), batch, 6, deep_fraction=1.0, cod_ratio=0.5,
                           cod_min=0.3, generator=torch.Generator().manual_seed(0))
    loss.backward()
    rows = [p.shape[1] for p in rec.positions]
    assert rows[0] == rows[1] == S and rows[2] < rows[1] and rows[-1] == rows[-2] > 0
    assert math.isfinite(float(loss)) and drafter.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="cod_ratio"):
        ttt.ttt_loss(drafter, teacher, batch, 3, cod_ratio=0.0)
