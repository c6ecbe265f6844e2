"""The training-time-test (TTT) unroll of the EAGLE-3 drafter: loss and per-position metrics.

Step k = 0..K-1 at position t (all positions of a batch at once):
    input token   input_ids[t+1+k]           (0 past the end: such positions are never valid)
    hidden input  fc(aux[t]) at k = 0, else the drafter's own output of step k-1 at t (with
                  EAGLE-3.1 norm_output: its final-norm'd output; draft.Eagle3Drafter.forward
                  applies that norm to the state it is handed back, so the unroll is the same)
    RoPE position t + k                      (SpecForge: position_ids + number of cached steps)
    target        p_teacher[t+1+k] = softmax over the draft vocab of the verifier's
                  lm_head[draft rows] · norm(last_hidden[t+1+k])  (predicts token t+2+k)
    valid         loss_mask[t+1+k] & attention_mask[t+1+k] & t+1+k < S: counted by the metrics
    learnable     valid & the verifier's full-vocab argmax at t+1+k (target_ids, or the
                  teacher's) is in the draft vocab: only these carry loss. A valid position
                  outside the draft vocab is a rejection in any engine (the drafter can never
                  propose that token), so the metrics count it as wrong, never drop it
Attention of step k: the query at t sees the step-0 keys causally (positions <= t) plus the keys
of steps 1..k at the same position t (the "diagonal"), one joint softmax. That is one S×S block
plus k diagonal terms per step; the attention core is recomputed in backward (activation
checkpointing), so no S×S tensor is kept per step and memory grows linearly with K.
Deep selection (deep_fraction < 1): steps 1..K-1 at position t depend only on the step-0 keys
and on t's own chain, so they can run on a random share of the positions: each deep step then
costs ~that share, with its loss an unbiased estimate of the full one (step 0 runs everywhere).
Served-like chains: a served step k+1 is fed the accepted draft k, i.e. the verifier's greedy
token, while a teacher-forced one is fed the data's token t+2+k, which on data not written by
the verifier (ChatGPT's answers) often differs. The conditional accuracy therefore counts step
k only on chains where the data agreed with the verifier's greedy token at t+1+j for every
j < k (and steps 0..k-1 were right): an estimate of the served conditional acceptance on the
data's contexts.
Loss: cross-entropy on the learnable positions of each step (mean) against p_teacher (soft) or
its argmax, the verifier's greedy token (hard: with target_ids stored the teacher never runs);
total Σ_k w^k loss_k / Σ_k w^k. lm_head + log_softmax run on gathered valid rows only, in
chunks that are recomputed in backward (checkpoint_logits) where memory is short, so no [S, Vd]
fp32 logits are held per step.

Mask as in SpecForge: its step-0 keys are plain causal at every step too (specforge/modeling/
draft/flex_attention.py generate_eagle3_mask: causal block | same-position suffix keys; the mask
that hid one more diagonal per step went in SpecForge #245, "remove attention mask shift").
Difference from SpecForge (specforge/algorithms/eagle3/model.py, formerly core/eagle3.py, on
purpose): the loss mask is taken at the target's position t+1+k (SpecForge: t+k).

    python -m eagle3_ray.train.ttt --ttt-steps 4   # tiny random drafter + batch: loss and metrics
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# Per-step sums that aggregate across batches and workers by plain addition.
#   count: valid positions of step k        correct: valid, in the draft vocab, argmax right
#   cond_count: valid at k, on a served-like chain: steps 0..k-1 valid + correct, and the data's
#               tokens fed to steps 1..k are the verifier's greedy ones (module docstring)
#   all_correct: those of cond_count whose step k is correct too
#   loss_count: learnable positions (target in vocab)
#   loss_sum: Σ soft cross-entropy over the learnable positions
COUNT_KEYS = ("count", "correct", "cond_count", "all_correct", "loss_count", "loss_sum")


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """y[:, t] = x[:, t + n], `fill` past the end. [B, S] -> [B, S]"""
    b, s = x.shape[:2]
    if n >= s:
        return torch.full_like(x, fill)
    return torch.cat([x[:, n:], x.new_full((b, n) + x.shape[2:], fill)], dim=1)  # [B, S]


ATTN_BLOCK = 256  # query rows per block: a block's scores stop at its last key (skips ~40%)


def _attend(hidden_keys: torch.Tensor, key_limit: tuple, q: torch.Tensor, k0: torch.Tensor,
            v0: torch.Tensor, *diag: torch.Tensor) -> torch.Tensor:
    """Joint softmax over the step-0 keys (causal; `hidden_keys` [B, 1, 1, Q, S] True = masked)
    and the diagonal keys of steps 1..k. q [B, nh, Q, D] (Q = S, or the positions a deep
    selection kept); k0 [B, nkv, S, D], v0 [B, nkv, S, Dv]; each diagonal k [B, nkv, Q, D], v
    [B, nkv, Q, Dv] (MLA: Dv != D); diag = (k_1..k_k, v_1..v_k). Scale D^-0.5. key_limit[i]:
    step-0 keys query row i (and every row before it) needs. Returns [B, Q, nh*Dv]. Queries
    go in blocks of ATTN_BLOCK rows that score only the keys up to the block's limit. The
    softmax is written out (shared row max, exp, one normalization after the value sums), in
    place on the fresh score matrix, so no S×S tensor is concatenated, sliced or copied."""
    b, nh, s, d = q.shape                               # s: query rows
    nkv, dv = k0.shape[1], v0.shape[-1]
    g = nh // nkv                                       # query heads per kv head (GQA)
    kd, vd = diag[:len(diag) // 2], diag[len(diag) // 2:]
    acc = torch.promote_types(q.dtype, torch.float32)   # softmax precision (fp32, or fp64)
    qg = q.reshape(b, nkv, g, s, d) * (1.0 / math.sqrt(d))  # [B, nkv, g, S, D]; head = kv*g + r
    outs = []
    for start in range(0, s, ATTN_BLOCK):
        end = min(s, start + ATTN_BLOCK)
        n, keys = end - start, key_limit[end - 1]
        qb = qg[:, :, :, start:end]                                        # [B, nkv, g, n, D]
        scores = (qb.reshape(b, nkv, g * n, d) @ k0[:, :, :keys].transpose(-1, -2)).to(acc)
        # scores [B, nkv, g*n, keys]: rows r*n + i = query head kv*g + r at query row start + i
        hide = hidden_keys[..., start:end, :keys].expand(b, 1, g, n, keys)  # [B, 1, g, n, keys]
        hide = hide.reshape(b, 1, g * n, keys)                             # [B, 1, g*n, keys]
        scores.masked_fill_(hide, float("-inf"))                           # [B, nkv, g*n, keys]
        with torch.no_grad():                           # a constant shift: exact gradients
            row_max = scores.amax(-1, keepdim=True)                        # [B, nkv, g*n, 1]
        if kd:
            diagonal = torch.stack([(qb * kj[:, :, None, start:end]).sum(-1) for kj in kd], -1)
            diagonal = diagonal.reshape(b, nkv, g * n, len(kd)).to(acc)    # [B, nkv, g*n, k]
            row_max = torch.maximum(row_max, diagonal.detach().amax(-1, keepdim=True))
        e = scores.sub_(row_max).exp_()                 # [B, nkv, g*n, keys]; masked -> 0
        total = e.sum(-1, keepdim=True)                                    # [B, nkv, g*n, 1]
        out = (e.to(v0.dtype) @ v0[:, :, :keys]).to(acc)                   # [B, nkv, g*n, Dv]
        if kd:
            ed = (diagonal - row_max).exp()                                # [B, nkv, g*n, k]
            total = total + ed.sum(-1, keepdim=True)
            out = out.view(b, nkv, g, n, dv)                               # [B, nkv, g, n, Dv]
            for j, vj in enumerate(vd):
                w = ed[..., j].view(b, nkv, g, n, 1)                       # [B, nkv, g, n, 1]
                out = out + w * vj[:, :, None, start:end]                  # [B, nkv, g, n, Dv]
        out = out.reshape(b, nkv, g * n, dv) / total                       # [B, nkv, g*n, Dv]
        outs.append(out.view(b, nkv, g, n, dv))                            # [B, nkv, g, n, Dv]
    out = torch.cat(outs, dim=3).to(q.dtype)                               # [B, nkv, g, Q, Dv]
    return out.reshape(b, nh, s, dv).transpose(1, 2).reshape(b, s, nh * dv)  # [B, Q, nh*Dv]


class DiagonalAttention:
    """The `attend(q, k, v)` of Eagle3Drafter.forward for one TTT unroll. Its first call (step 0)
    stores the step-0 keys/values; call k appends step k's as diagonal terms. Holds references
    only: no growing concatenation of keys across positions. After `select`, the later steps run
    on a subset of the query positions only (a subset of the last one's: COD)."""

    def __init__(self, attention_mask: torch.Tensor, checkpoint_core: bool = True):
        s = attention_mask.shape[1]
        idx = torch.arange(s, device=attention_mask.device)
        causal = idx[None, :] <= idx[:, None]                              # [S, S] key <= query
        # Padded keys hidden too; a query always sees its own position, so no row is empty.
        allowed = (causal & attention_mask.bool()[:, None, :]) | (idx[None, :] == idx[:, None])
        self.allowed = allowed                                             # [B, S, S]
        self.hidden_keys = ~allowed[:, None, None]                         # [B, 1, 1, S, S]
        self.key_limit = tuple(range(1, s + 1))         # query row t needs the keys 0..t
        self.checkpoint_core = checkpoint_core
        self.k0 = self.v0 = None
        self.kd: list[torch.Tensor] = []
        self.vd: list[torch.Tensor] = []

    def select(self, sub: torch.Tensor, at: torch.Tensor) -> None:
        """From the next step on, the queries are the current query rows sub [B, n] (ascending
        per row), at sequence positions at [B, n]; the diagonal keys so far follow them."""
        s = self.allowed.shape[-1]
        rows = self.allowed.gather(1, at[:, :, None].expand(-1, -1, s))   # [B, n, S]
        self.hidden_keys = ~rows[:, None, None]                            # [B, 1, 1, n, S]
        self.key_limit = tuple((at.amax(0) + 1).tolist())  # rows ascending: nondecreasing
        idx = sub[:, None, :, None]                                        # [B, 1, n, 1]
        self.kd = [x.gather(2, idx.expand(-1, x.shape[1], -1, x.shape[3])) for x in self.kd]
        self.vd = [x.gather(2, idx.expand(-1, x.shape[1], -1, x.shape[3])) for x in self.vd]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:
            self.kd.append(k)
            self.vd.append(v)
        args = (self.hidden_keys, self.key_limit, q, self.k0, self.v0, *self.kd, *self.vd)
        if self.checkpoint_core and torch.is_grad_enabled():
            return checkpoint(_attend, *args, use_reentrant=False)
        return _attend(*args)


def _cross_entropy(drafter, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor):
    """hidden [n, H], targets[rows] -> (Σ_rows cross-entropy, drafter argmax [n]). targets:
    [M, Vd] probabilities (soft: -Σ_v p log q) or [M] draft ids (hard: -log q[id]). They are
    gathered inside, so a checkpoint saves only the row indices."""
    logits = drafter.logits(hidden)                                        # [n, Vd]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # fp32 (fp64 stays)
    if targets.dtype == torch.long:
        ce = torch.nn.functional.cross_entropy(logits, targets[rows], reduction="none")  # [n]
    else:
        ce = -(targets[rows] * logits.log_softmax(-1)).sum(-1)            # [n]
    return ce.sum(), logits.argmax(-1)


def _step_loss(drafter, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
               chunk_size: int, recompute: bool = True):
    """Over the valid positions (rows >= 0) of one step: (loss sum, drafter argmax).
    hidden [B, S, H], rows [B, S] (teacher row per position, -1 = invalid), targets [M, Vd] or
    [M] (_cross_entropy).
    recompute: the chunks' logits are recomputed in backward (activation checkpointing: memory
    of one chunk) instead of kept (no second lm_head)."""
    valid = rows >= 0
    h, r = hidden[valid], rows[valid]                                      # [N, H], [N]
    if len(r) == 0:  # keep lm_head/norm in the graph (DDP expects a grad for every parameter)
        h = hidden.reshape(-1, hidden.shape[-1])[:1]                       # [1, H]
        t = targets.new_zeros((1,) + targets.shape[1:])                    # [1, Vd] or [1]
        loss, _ = _cross_entropy(drafter, h, t, torch.zeros(1, dtype=torch.long, device=h.device))
        return loss * 0, r
    total, preds = 0.0, []
    for c in range(0, len(r), chunk_size):
        args = (drafter, h[c:c + chunk_size], targets, r[c:c + chunk_size])  # [n, H], [n]
        if torch.is_grad_enabled() and recompute:
            loss, pred = checkpoint(_cross_entropy, *args, use_reentrant=False)
        else:
            loss, pred = _cross_entropy(*args)
        total, preds = total + loss, preds + [pred]
    return total, torch.cat(preds)


def deep_selection(useful: torch.Tensor, fraction: float, generator=None):
    """The positions that run TTT steps 1..K-1: in each row, a uniform random `fraction`
    (rounded up) of its `useful` positions ([B, S] bool: some step past 0 has a target there).
    -> sel [B, n] (ascending per row; n = the largest row's share) and keep [B, n] (False on the
    padding of rows with a smaller share)."""
    b, s = useful.shape
    want = (useful.sum(1).double() * fraction).ceil().long()               # [B]
    n = max(1, int(want.max()))
    u = torch.rand(b, s, generator=generator).to(useful.device)            # [B, S]
    order = u.masked_fill(~useful, 2.0).argsort(1)[:, :n]  # useful first, in random order
    keep = torch.arange(n, device=useful.device)[None] < want[:, None]     # [B, n]
    sel, perm = order.sort(1)
    return sel, keep.gather(1, perm)


TARGETS = ("soft", "hard")

@dataclass
class Targets:
    """What every step of a batch is scored against, computed once per batch.
    target [M, Vd] probabilities (soft) or [M] draft ids (hard), teacher_top [M] the teacher's
    argmax (draft ids), target_row [B, S] the row of position u's target (the verifier's
    distribution of token u+1; -1 = none), learn_row [B, S] the same where that token is in the
    draft vocab (only those carry loss), agree [B, S] the data's token u+1 is the verifier's
    greedy token and in the draft vocab (a served chain goes on only along such tokens)."""
    target: torch.Tensor
    teacher_top: torch.Tensor
    target_row: torch.Tensor
    learn_row: torch.Tensor
    agree: torch.Tensor

    @classmethod
    def of(cls, drafter, teacher, batch: dict, targets: str) -> "Targets":
        ids = batch["input_ids"].long()                                    # [B, S]
        b, s = ids.shape
        # Teacher only where some step can use it: u >= 1, masked in, a real token.
        wanted = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, S]
        wanted[:, 0] = False
        greedy = batch.get("target_ids")      # the verifier's argmax, stored at extraction
        if targets == "hard" and greedy is not None:                       # no teacher needed
            top = greedy[wanted]                                           # [M] target ids
            in_draft = drafter.t2d[top]                                    # [M]
            teacher_top = (drafter.t2d.cumsum(0) - 1)[top].clamp(min=0)    # [M] draft ids
        else:
            p_rows, in_draft = teacher(batch["last_hidden_states"][wanted],
                                       check=greedy is None)               # [M, Vd], [M]
            if greedy is not None:
                in_draft = drafter.t2d[greedy[wanted]]
            teacher_top = p_rows.argmax(-1)                                # [M]
        target = p_rows if targets == "soft" else teacher_top              # [M, Vd] or [M]
        agree = torch.zeros_like(wanted)                                   # [B, S]
        agree[wanted] = in_draft & (shift_left(ids, 1, -1)[wanted]
                                    == drafter.draft_to_target(teacher_top))
        target_row = torch.full((b, s), -1, dtype=torch.long, device=ids.device)
        target_row[wanted] = torch.arange(len(teacher_top), device=ids.device)
        learn_row = target_row.clone()
        learn_row[wanted] = torch.where(in_draft, target_row[wanted], -1)
        return cls(target, teacher_top, target_row, learn_row, agree)


class StepSums:
    """The per-step COUNT_KEYS sums of one batch, kept as tensors (one device sync at the end),
    with the served-like chain: step k is counted conditionally only where steps 0..k-1 were
    valid and right and the data agreed with the verifier's greedy tokens fed to them."""

    def __init__(self, chain: torch.Tensor):
        self.chain = chain                                                 # [B, n] bool
        self.sums = {key: [] for key in COUNT_KEYS}

    @torch.no_grad()
    def add(self, rows, learn, pred, teacher_top, agree_k, loss_sum) -> None:
        """One step: rows / learn [B, n] (target rows, -1 = none), pred [N] the drafter's
        argmax on learn's rows (in order), agree_k [B, n], loss_sum its summed loss."""
        valid, learnable = rows >= 0, learn >= 0
        ok = torch.zeros_like(valid)
        ok[learnable] = pred == teacher_top[learn[learnable]]              # in vocab & right
        s = self.sums
        s["count"].append(valid.sum())
        s["correct"].append(ok.sum())
        s["cond_count"].append((valid & self.chain).sum())
        self.chain = self.chain & ok
        s["all_correct"].append(self.chain.sum())
        self.chain = self.chain & agree_k  # step k+1 is conditioned on a served-like chain only
        s["loss_count"].append(learnable.sum())
        s["loss_sum"].append(loss_sum.detach().double())

    def metrics(self, losses: list, weights: list) -> tuple[torch.Tensor, dict]:
        """-> (Σ_k w_k loss_k / Σ_k w_k over the weighted steps, summarize()'s metrics)."""
        loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        metrics = summarize({key: torch.stack(v).tolist() for key, v in self.sums.items()})
        metrics["loss"] = float(loss.detach())
        return loss, metrics



def ttt_loss(model, teacher, batch: dict, ttt_steps: int, step_weight_decay: float = 0.8,
             chunk_size: int = 512, checkpoint_attention: bool = True,
             deep_fraction: float = 1.0, generator=None, targets: str = "soft",
             checkpoint_logits: bool = True, loss_steps: int | None = None,
             cod_ratio: float = 1.0, cod_min: float = 0.0):
    """The TTT unroll of `model` (an Eagle3Drafter, or a DDP wrapper of one: the steps go
    through its forward) on one batch -> (loss, metrics).

    batch: input_ids [B, S] long, loss_mask [B, S], attention_mask [B, S] (1 = real token, right
    padding), aux_hidden_states [B, S, 3H], last_hidden_states [B, S, H] (any float dtype),
    optionally target_ids [B, S] (the verifier's full-vocab argmax; else the teacher finds it).
    metrics (plain floats/lists, per step k): loss_k, acc_k, cond_acc_k (among positions whose
    steps 0..k-1 were valid and correct and whose data continued with the verifier's greedy
    tokens: what a served chain is conditioned on), p_k = Π_{j<=k} cond_acc_j (the share of
    rounds that accept steps 0..k), in_vocab_k (share of valid targets inside the draft vocab:
    the ceiling of acc_k), accept_len = 1 + Σ_k Π_{j<=k} cond_acc_j, and the additive
    COUNT_KEYS sums that `aggregate_metrics` combines across batches/workers.
    deep_fraction < 1: steps 1..K-1 run on that share of the positions only (`deep_selection`,
    drawn from `generator`); step 0 always runs on all of them. Step k's loss stays the mean over
    its valid positions, now a uniform sample of them: an unbiased estimate at ~fraction of the
    cost of each deep step. The metrics of deep steps then count the sampled positions.
    targets: "soft" = cross-entropy against the teacher's distribution over the draft vocab;
    "hard" = against its argmax only (the verifier's greedy token: what greedy acceptance
    checks); with target_ids in the batch the teacher is then never run.
    checkpoint_attention / checkpoint_logits: recompute the attention core / the lm_head chunks
    in backward (memory linear in depth, one chunk of logits at a time) or keep them (no second
    pass: cheaper where compute, not memory, is short, as on CPUs).
    loss_steps: only steps 0..loss_steps-1 enter the loss (default: all); the steps past them
    are unrolled and measured only (loop.evaluate's probe past the trained depth).
    cod_ratio < 1: COD sampling (P-EAGLE's conditional drop-token): step k >= 1 runs on a share
    deep_fraction * cod_ratio**(k-1) of the positions, never below cod_min (nor above
    deep_fraction), each step's positions a uniform subset of the step before's.
    A parallel drafter (drafter.config.drafting == "parallel") is unrolled the same way, with
    steps k >= 1 fed mask slots (token mask_token_id, hidden fc(mask_hidden)) instead of the
    data's token and the step before's state: what it sees when serving, where all k drafts
    come from one forward. The diagonal attention is then exactly its causal attention over
    the k slots of one round."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    if not 0 < deep_fraction <= 1:
        raise ValueError(f"deep_fraction must be in (0, 1], got {deep_fraction}")
    if not 0 < cod_ratio <= 1 or not 0 <= cod_min <= 1:
        raise ValueError(f"need 0 < cod_ratio <= 1 and 0 <= cod_min <= 1, got {cod_ratio}, "
                         f"{cod_min}")

    def deep_share(k: int) -> float:  # the share of positions step k runs on
        if k == 0:
            return 1.0
        return max(deep_fraction * cod_ratio ** (k - 1), min(cod_min, deep_fraction))

    drafter = getattr(model, "module", model)
    parallel = drafter.config.parallel
    ids = batch["input_ids"].long()                                        # [B, S]
    b, s = ids.shape
    real = batch["attention_mask"].bool()                                  # [B, S]
    aux = batch["aux_hidden_states"].to(drafter.fc.weight.dtype).reshape(b, s, -1)  # [B, S, 3H]
    tg = Targets.of(drafter, teacher, batch, targets)
    target, teacher_top, target_row, learn_row, agree = (
        tg.target, tg.teacher_top, tg.target_row, tg.learn_row, tg.agree)

    positions = torch.arange(s, device=ids.device)[None].expand(b, s)     # [B, S]
    attend = DiagonalAttention(real, checkpoint_attention)
    hidden, losses = aux, []
    sums = StepSums(torch.ones(b, s, dtype=torch.bool, device=ids.device))  # steps < k right
    keep = None           # once deep steps run on fewer rows ([B, n]: `positions` holds each
                          # row's t): which rows are real, not another row's padding
    for k in range(ttt_steps):
        tokens = shift_left(ids, 1 + k, 0)                                 # [B, S] token t+1+k
        rows = shift_left(target_row, 1 + k, -1)                           # [B, S]
        learn = shift_left(learn_row, 1 + k, -1)                           # [B, S]
        agree_k = shift_left(agree, 1 + k, False)                          # [B, S]
        if keep is not None:                                               # [B, n] from here on
            tokens = tokens.gather(1, positions)
            rows = rows.gather(1, positions).masked_fill(~keep, -1)
            learn = learn.gather(1, positions).masked_fill(~keep, -1)
            agree_k = agree_k.gather(1, positions)
        if parallel and k > 0:       # P-EAGLE: mask slots, blind to the drafts before them
            hidden = model(tokens[:, :0], aux[:, :0], positions + k, attend=attend,
                           masked=tokens.shape[1])                         # [B, n, H]
        else:
            hidden = model(tokens, hidden, positions + k, attend=attend)   # [B, S|n, H]
        loss_sum, pred = _step_loss(drafter, hidden, learn, target, chunk_size,
                                    checkpoint_logits)
        losses.append(loss_sum / (learn >= 0).sum().clamp(min=1))
        sums.add(rows, learn, pred, teacher_top, agree_k, loss_sum)
        if k + 1 < ttt_steps and deep_share(k + 1) < deep_share(k):       # fewer rows from k+1
            useful = torch.zeros_like(agree_k)    # some step from k+1 on has a loss there
            for j in range(k + 1, ttt_steps):
                useful |= shift_left(learn_row, 1 + j, -1).gather(1, positions) >= 0
            if keep is not None:
                useful &= keep
            sub, keep = deep_selection(useful, deep_share(k + 1) / deep_share(k), generator)
            hidden = hidden.gather(1, sub[..., None].expand(-1, -1, hidden.shape[-1]))
            positions, sums.chain = (x.gather(1, sub) for x in (positions, sums.chain))
            attend.select(sub, positions)
    weights = [step_weight_decay ** k for k in range(min(ttt_steps, loss_steps or ttt_steps))]
    return sums.metrics(losses, weights)


def accept_lengths(cond_acc: list[float]) -> list[float]:
    """Expected tokens per greedy chain-speculation round at each depth d = 0..K:
    1 + Σ_{i<d} Π_{j<=i} cond_acc_j."""
    out, chain = [1.0], 1.0
    for a in cond_acc:
        chain *= a
        out.append(out[-1] + chain)
    return out


def summarize(sums: dict) -> dict:
    """COUNT_KEYS sums (lists over steps) -> per-step ratios + accept_len (sums kept)."""
    def ratio(a, c):
        return [x / y if y else 0.0 for x, y in zip(a, c)]
    cond = ratio(sums["all_correct"], sums["cond_count"])
    return {**{key: list(sums[key]) for key in COUNT_KEYS},
            "loss_k": ratio(sums["loss_sum"], sums["loss_count"]),
            "acc_k": ratio(sums["correct"], sums["count"]),
            "in_vocab_k": ratio(sums["loss_count"], sums["count"]),
            "cond_acc_k": cond,
            "p_k": [math.prod(cond[:k + 1]) for k in range(len(cond))],
            "accept_len": accept_lengths(cond)[-1]}


def aggregate_metrics(metrics: list[dict]) -> dict:
    """Combine ttt_loss metrics of several batches/workers: add the sums, recompute ratios
    (never a mean of means). For all-reduce, sum the COUNT_KEYS lists and call summarize."""
    steps = len(metrics[0]["count"])
    sums = {key: [sum(m[key][k] for m in metrics) for k in range(steps)] for key in COUNT_KEYS}
    return summarize(sums)


def main(argv=None):
    from eagle3_ray.train.draft import DraftConfig, Eagle3Drafter, Teacher
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--deep-fraction", type=float, default=1.0)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    c = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=500, draft_vocab_size=200)
    drafter = Eagle3Drafter(c)
    head = torch.randn(c.vocab_size, c.hidden_size) * 0.1
    teacher = Teacher(torch.ones(c.hidden_size), head[:200], head[200:], c.rms_norm_eps)
    batch = {"input_ids": torch.randint(0, c.vocab_size, (2, a.seq)),
             "loss_mask": torch.ones(2, a.seq), "attention_mask": torch.ones(2, a.seq),
             "aux_hidden_states": torch.randn(2, a.seq, 3 * c.hidden_size),
             "last_hidden_states": torch.randn(2, a.seq, c.hidden_size)}
    loss, m = ttt_loss(drafter, teacher, batch, a.ttt_steps, deep_fraction=a.deep_fraction)
    loss.backward()
    print(json.dumps({k: m[k] for k in ("loss", "loss_k", "acc_k", "accept_len")}, indent=2))


if __name__ == "__main__":
    main()
