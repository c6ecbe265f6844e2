"""Stage 3 core: chain speculative decoding with an EAGLE-3 drafter (pure PyTorch, no Ray).

One round at depth D (n tokens already in the verifier's KV cache, `x` the next token):
    draft    the drafter proposes d_1..d_D, each step fed its own previous output state
    verify   one verifier forward over [x, d_1..d_D] (D+1 tokens) -> logits and, via hooks on the
             3 aux layers, the aux states for the drafter's next round
    accept   greedy: the longest prefix with d_i == argmax; sampling: rejection sampling (accept
             d_i with min(1, p/q), else resample from norm(max(p - q, 0))), so the output
             distribution is exactly the verifier's
    emit     the accepted d_1..d_a plus the verifier's own next token (the "bonus")
    rollback both KV caches are cropped to the accepted positions; the drafter then absorbs
             (token t+1, verifier aux state t) for the accepted positions
Depth 0 is plain decoding through the same code (no drafter, a 1-token verify), the baseline.

Parallel drafter (P-EAGLE, draft.DraftConfig.drafting = "parallel"): the draft step is ONE
drafter forward that absorbs the round's tokens and runs D-1 mask slots after them; the last
token's slot and the mask slots propose d_1..d_D at once. The rest of the round is the same.
A D-deep round then pays one drafter forward instead of D (and on a tensor-parallel node one
forward's collectives, plan/planner.py), for drafts that cannot see each other.

Block drafter (DFlash, drafting = "block", train/block.py): also ONE forward a round, of a
few layers: the round's new verifier states join every layer's context keys (block.BlockKV),
and the slots [x, D masks] at x's position on propose d_1..d_D from the mask slots, which see
each other (non-causal). The verify, accept and rollback are the chain's, so check_exact's
"chain" covers a block round's verifier forward as it does a chain's.

Branches (greedy only): the round drafts `branches` chains that fork at the first draft, the
drafter's top-k first tokens each continued greedily (one batched drafter step per depth), and
verifies them in ONE verifier forward: [x, chain 1, chain 2, ...], each chain attending to the
cache, x and its own earlier drafts only (kernels.tree_layout). The longest accepted chain
wins; the cache keeps x and its accepted drafts. It pays where a verify of k·D+1 tokens costs
about what D+1 do (a PCIe node, where all-reduce latency sets the cost); on a 2-core CPU each
path's gathered keys cost more than the top-2..k first-token hits bring (docs/serve.md).

Lookup fallback (`lookup=LookupParams(...)`): a round whose first draft the drafter gives
less than `below` probability, and whose context (prompt + output) ends in an n-gram seen
earlier in it, verifies the tokens that followed that n-gram instead of the drafter's chain
(prompt lookup, used only where the drafter doubts itself; Arctic Inference pairs suffix
decoding with its speculator in the same spirit). Measured on the embedded default, the
position-0 misses the drafter makes where the verifier is surest are mostly copies of names
and code from the prompt (docs/serve.md#lookup-fallback). Lookup branch (greedy; always in a
tree, `LookupParams(branch=True)` for a single chain): the lookup's tokens are verified as
one more chain of the tree, next to the drafter's, whatever the drafter's probability; it
pays where a verify of more tokens costs little more (an AMX CPU, a GPU node).

The drafter's KV cache holds, per position t, the keys of (token t+1, verifier state t); draft
steps append at t+1, t+2, ... and are dropped after verification — the same pattern the TTT
unroll trains (ttt.py: step-0 keys causally, plus the drafter's own steps at one position).

    python -m eagle3_ray.serve.speculate --prompt "What is Ray?" --depth 4   # embedded verifier,
                                                                      # untrained drafter
"""
from __future__ import annotations

import argparse
import copy
import functools
import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3_ray.engine import hf as verifier_lib
from eagle3_ray.serve import kernels
from eagle3_ray.train.block import BlockKV

log = logging.getLogger(__name__)


@dataclass
class Round:
    """What one round emitted. `tokens` may be cut short by EOS / max_tokens (finish_reason)."""
    tokens: list[int]
    drafted: int                          # draft tokens proposed (= depth of the round)
    accepted: int                         # of them accepted by the verifier
    finish_reason: str | None = None      # "stop" (EOS) | "length" (max_tokens) | None
    verify_s: float = 0.0                 # wall time of the verifier forward
    draft_s: float = 0.0                  # wall time of the drafter's steps
    draft_probs: tuple[float, ...] = ()   # the drafter's probability of each of its drafts
    branches: int = 1                     # chains verified together (1 = a plain chain); with
                                          # more, drafted = the longest chain's length and
                                          # draft_probs = ()
    lookup: bool = False                  # the drafts came from the lookup fallback, not the
                                          # drafter (draft_probs = ()); in a tree: the lookup's
                                          # chain was accepted longest


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0              # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    eos_ids: tuple[int, ...] = ()


@dataclass
class LookupParams:
    """The lookup fallback of a round (module docstring)."""
    min_n: int = 2                        # shortest suffix n-gram that counts as a match
    max_n: int = 4                        # longest tried first
    below: float = 0.8                    # used when the drafter's first draft has p < this
                                          # (> 1: whenever there is a match)
    branch: bool = False                  # verify the match beside the drafter's chain (a
                                          # 2-chain tree, greedy) instead of in its place

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n ({self.min_n}) <= max_n ({self.max_n})")


class NgramLookup:
    """Prompt lookup over one request's tokens: propose(k) -> the up to k tokens that followed
    the latest earlier occurrence of the longest suffix n-gram (n = max_n down to min_n), or []."""

    def __init__(self, tokens: list[int], min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}   # n-gram -> where its latest follower is
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.ids)                         # t follows the n-grams ending at i - 1
            self.ids.append(t)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.after[tuple(self.ids[i - n:i])] = i

    def propose(self, k: int) -> list[int]:
        for n in range(min(self.max_n, len(self.ids)), self.min_n - 1, -1):
            j = self.after.get(tuple(self.ids[-n:]))
            if j is not None:
                return self.ids[j:j + k]
        return []


class DraftKV:
    """The drafter's KV cache, as the `attend(q, k, v)` of Eagle3Drafter.forward: appends the
    new keys/values and lets each new query see every cached key up to its own position.
    Keys [1, nkv, L, D], values [1, nkv, L, Dv] (an MLA drafter: Dv may differ from D; the
    scale is D^-0.5, SDPA's default)."""

    def __init__(self):
        self.k = self.v = None                                        # [1, nkv, L, D]

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old = len(self)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)   # [1, nkv, L, D]
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        b, nh, s, d = q.shape
        keys, values = self.k, self.v
        dv = values.shape[-1]
        if s == 1:                        # a draft step: its one query sees every cached key,
            nkv = keys.shape[1]           # so a KV group's g query heads are g unmasked rows
            rows = q.reshape(1, nkv, nh // nkv, d)                       # [1, nkv, g, D], GQA
            out = F.scaled_dot_product_attention(rows, keys, values)     # [1, nkv, g, Dv]
            return out.reshape(b, 1, nh * dv)                            # [1, 1, nh*Dv]
        if nh != keys.shape[1]:                                           # GQA
            keys = keys.repeat_interleave(nh // keys.shape[1], dim=1)     # [1, nh, L, D]
            values = values.repeat_interleave(nh // values.shape[1], dim=1)
        pos_q = torch.arange(old, old + s, device=q.device)[:, None]
        mask = torch.arange(old + s, device=q.device)[None, :] <= pos_q   # [s, L]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [1, nh, s, Dv]
        return out.transpose(1, 2).reshape(b, s, nh * dv)                # [1, s, nh*Dv]


class BranchKV:
    """The `attend(q, k, v)` of draft steps run for b chains at once (batch b, one token each),
    forked from a DraftKV: each chain's query sees the shared cached keys and its own chain's
    earlier steps, never another chain's."""

    def __init__(self, shared: DraftKV):
        self.shared, self.k, self.v = shared, None, None                  # own: [b, nkv, m, D]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)   # [b, nkv, m, D]
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        b, nh, _, d = q.shape
        nkv = k.shape[1]
        rows = q.reshape(b, nkv, nh // nkv, d)                             # [b, nkv, g, D]
        shared_k, shared_v = self.shared.k[0], self.shared.v[0]           # [nkv, L, D]
        s = torch.cat([rows @ shared_k.transpose(-1, -2),                  # [b, nkv, g, L]
                       rows @ self.k.transpose(-1, -2)], dim=-1)           # [b, nkv, g, L+m]
        p = (s.float() * d ** -0.5).softmax(-1).to(shared_v.dtype)
        n = shared_k.shape[1]
        out = p[..., :n] @ shared_v + p[..., n:] @ self.v                  # [b, nkv, g, Dv]
        return out.reshape(b, 1, nh * self.v.shape[-1])                    # [b, 1, nh*Dv]


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[.., V] logits -> the sampling distribution (temperature, then nucleus), fp32."""
    p = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_p, idx = p.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p   # mass before this token already >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


# --- a round's pieces that need no model ---------------------------------------------------------

def pick(logits: torch.Tensor, sp: SamplingParams, gen) -> int:
    """[V] logits -> the verifier's token: argmax (greedy) or a sample of probs()."""
    if sp.temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(probs(logits, sp.temperature, sp.top_p), 1, generator=gen)[0])


def accept_chain(drafts, qs, logits, sp: SamplingParams, gen) -> tuple[int, int]:
    """Acceptance of a chain verify (logits [d+1, V]) -> (accepted drafts a, the verifier's token
    after them). Greedy: the longest prefix equal to the argmax; sampling: rejection sampling."""
    if sp.temperature == 0:
        target = logits.argmax(-1).tolist()                            # [d+1]
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return a, target[a]
    for i, (tok, q) in enumerate(zip(drafts, qs)):
        p = probs(logits[i], sp.temperature, sp.top_p)                 # [V]
        u = torch.rand((), generator=gen, device=p.device)
        if u * q[tok] < p[tok]:                                        # u < p/q
            continue
        resid = (p - q).clamp(min=0)                                   # [V]
        if float(resid.sum()) <= 0:                                    # p == q numerically
            resid = p
        return i, int(torch.multinomial(resid / resid.sum(), 1, generator=gen)[0])
    return len(drafts), pick(logits[len(drafts)], sp, gen)


def accept_tree(ids: list[int], paths: list[list[int]],
                logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance of a tree verify -> (the winning path's accepted prefix: indices into
    ids, the root x, then its accepted drafts; the winner's index in paths, -1 if no draft was
    accepted): the longest run of drafts that each equal the verifier's argmax at their
    parent; the first longest wins a tie."""
    target = logits.argmax(-1).tolist()                                # [s]
    best, won = [0], -1
    for i, path in enumerate(paths):
        a = 1
        while a < len(path) and ids[path[a]] == target[path[a - 1]]:
            a += 1
        if a > len(best):
            best, won = path[:a], i
    return best, won


def keep_cache(cache: DynamicCache, n: int, keep: list[int]) -> None:
    """Rollback: keep, of the cached positions from n on, those at offsets `keep` (ascending, 0
    first), moved to n, n+1, ...; drop the rest (rejected and other chains' drafts)."""
    if keep != list(range(len(keep))):
        idx = torch.tensor(keep, device=cache.layers[0].keys.device) + n
        for layer in cache.layers:                                     # [1, nkv, L, D]
            layer.keys[:, :, n:n + len(keep)] = layer.keys[:, :, idx]
            layer.values[:, :, n:n + len(keep)] = layer.values[:, :, idx]
    cache.crop(-(cache.get_seq_length() - (n + len(keep))))  # tokens to remove


def emit(tokens, drafted, accepted, sp: SamplingParams, emitted: int, verify_s, draft_s,
         draft_probs=(), branches: int = 1, lookup: bool = False) -> Round:
    """A round's Round, its tokens cut at EOS (left out) or at max_tokens."""
    reason = None
    for i, t in enumerate(tokens):
        if t in sp.eos_ids:
            tokens, reason = tokens[:i], "stop"   # EOS ends the text and is not part of it
            break
    if reason is None and emitted + len(tokens) >= sp.max_tokens:
        tokens, reason = tokens[:sp.max_tokens - emitted], "length"
    return Round(list(tokens), drafted, accepted, reason, verify_s, draft_s, draft_probs,
                 branches, lookup)


# --- exactness on this host (Speculator.check_exact, .inexact_reason) --------------------------

EXACT_CACHED = (29, 58)               # cache lengths check_exact verifies after: the keys of its
                                      # verifies cross a 32-key block (AMX) or not
EXACT_PATHS = [[0, 1, 2, 3], [0, 4, 5], [0, 6]]   # check_exact's tree: 3 paths, 2 padded


@torch.inference_mode()
def check_exact(spec: Speculator, seed: int = 0) -> dict[str, bool]:
    """Whether, on this host's kernels, the verifier computes what decoding does: "chain", a
    4-token verify against 4 one-token forwards; "tree", each path of a 3-path tree verify
    (EXACT_PATHS) against that path verified as a chain. Random tokens after a random cache
    of each length in EXACT_CACHED. Bit for bit when batch invariant (bf16: what greedy
    equality needs), else to 1e-3 (fp32 rounds differently per token count anyway, ~1e-6).
    The forwards run every kernel a verify does: attention (MLA's too), linears, and an MoE
    verifier's routing (kernels.PerTokenMoE when batch invariant; tests/serve/
    test_speculate.py over both verifier families, test_speculate_deepseek.py).
    Costs ~20 verifier forwards, once per Speculator. Kernels, not host kinds, decide: a
    bf16 tree verify was not exact on AVX2-only CPUs until kernels._tree_attention's
    token-at-a-time path stopped attending to its padding (issue 48)."""
    comm, spec.simulated_comm = spec.simulated_comm, None    # no simulated node here
    try:
        return _check_exact(spec, seed)
    finally:
        spec.simulated_comm = comm


def _check_exact(spec: Speculator, seed: int) -> dict[str, bool]:
    g = torch.Generator().manual_seed(seed)
    same = torch.equal if spec.batch_invariant else functools.partial(
        torch.allclose, rtol=1e-3, atol=1e-3)
    width = max(map(len, EXACT_PATHS))
    ok = {"chain": True, "tree": True}
    for cached in EXACT_CACHED:
        ids = torch.randint(verifier_lib.text_config(spec.model.config).vocab_size, (cached + 7,), generator=g).tolist()
        new, cache = ids[cached:], DynamicCache()
        spec._verify(ids[:cached], cache, last_only=True)

        def verify(tokens, **kw):              # after the same `cached` keys each time
            out = spec._verify(tokens, cache, **kw)[0]
            cache.crop(cached - cache.get_seq_length())
            return out

        steps = [spec._verify([t], cache)[0] for t in new[:width]]   # decoding, 1 a forward
        cache.crop(cached - cache.get_seq_length())
        ok["chain"] &= same(verify(new[:width]), torch.cat(steps))          # [4, V]
        tree = verify(new, tree_paths=EXACT_PATHS)                           # [7, V]
        for p in EXACT_PATHS:
            ok["tree"] &= same(tree[p], verify([new[i] for i in p]))
    return ok


def inexact_reason(spec: Speculator, path: str) -> str:
    """Why check_exact's `path` ("chain" or "tree") is not exact here, and what to do."""
    dtype = str(next(spec.model.parameters()).dtype).removeprefix("torch.")
    what, other, instead = {
        "chain": ("a verify of several tokens", "those tokens decoded one at a time",
                  "serve at depth 0"),
        "tree": ("a tree verify", "its paths verified as chains",
                 "use chains (branches 1, no lookup branch)")}[path]
    if spec.batch_invariant and spec.device.type == "cpu" and dtype != "float32":
        instead += ", or run the verifier in fp32 (EAGLE3_RAY_NATIVE_BF16=0)"
    return (f"on this host's kernels {what} of the {dtype} verifier does not compute what "
            f"{other} do (Speculator.check_exact, on random tokens at start-up), so greedy "
            f"output could differ from the verifier's: {instead}")


class Speculator:
    """A verifier (a transformers causal LM) and an optional EAGLE-3 drafter (draft.py), sharing
    a device. generate() decodes one request and yields a Round per verifier forward."""

    def __init__(self, model, drafter=None, layer_ids: list[int] | None = None,
                 batch_invariant: bool | None = None, simulated_comm=None):
        """The drafter moves to the verifier's device and dtype. batch_invariant (default: when
        the verifier runs in bf16/fp16, or has MoE blocks) makes the verifier's outputs
        independent of the number of tokens per forward, for exact greedy equality
        (kernels.make_batch_invariant). An fp32 MoE verifier takes it too: a verify's ~1e-6
        rounding differences reach its router, whose top-k can flip on a near tie (experts
        chosen otherwise than decoding would; 0 of 8,960 routings on the 8-expert test model,
        but Kimi has 384), which check_exact's fp32 tolerance could not catch. It costs a
        verify ~2.8x on the test model (the MoE and attention a token at a time). Both
        models' linear layers then run on CPU kernels suited to few rows (kernels.
        use_few_row_kernels; they keep a packed copy of the weights).
        simulated_comm: a SIMULATION of a multi-GPU node's interconnect, (tokens in a verifier
        forward) -> seconds slept after each forward (planner.comm_s of a node profile)."""
        p = next(model.parameters())
        self.model, self.device, self.simulated_comm = model, p.device, simulated_comm
        self.drafter = drafter.to(device=p.device, dtype=p.dtype) if drafter is not None else None
        if batch_invariant is None:
            batch_invariant = (p.dtype in (torch.bfloat16, torch.float16)
                               or bool(kernels.moe_blocks(model)))
        if batch_invariant:
            kernels.make_batch_invariant(model)
        else:                                      # fp32: the fastest kernel for each row count
            kernels.use_few_row_kernels(model)
            kernels.allow_trees(model)        # SDPA, and trees for branches > 1
        # fp32: the kernel this host runs fastest per row count, timed on the verifier
        self.few_row_kernels = kernels.tune_few_row_kernels(model)
        if self.drafter is not None:               # its steps need no invariance; its 1-row
            kernels.use_few_row_kernels(       # linears take the verifier's pick
                self.drafter, kernels=self.few_row_kernels)
        n_layers = verifier_lib.text_config(model.config).num_hidden_layers
        self.layer_ids = None                      # no drafter: nothing to capture
        if drafter is not None:
            self.layer_ids = verifier_lib.check_layer_ids(
                layer_ids or drafter.config.aux_layer_ids
                or verifier_lib.default_aux_layer_ids(n_layers), n_layers,
                where="layer_ids" if layer_ids else "drafter.config.aux_layer_ids")
        self.batch_invariant = batch_invariant
        self.exact = self.check_exact()            # {"chain": bool, "tree": bool}, this host
        for path, ok in self.exact.items():
            if not ok:
                log.warning(self.inexact_reason(path))

    check_exact, inexact_reason = check_exact, inexact_reason   # the module's, as methods

    def with_drafter(self, drafter) -> "Speculator":
        """This verifier (patched and checked once) with another drafter trained on the same
        aux layers: to compare drafters in one process (bench serve --parallel-drafter)."""
        if self.drafter is None or list(drafter.config.aux_layer_ids) != self.layer_ids:
            raise ValueError(f"with_drafter: the drafter reads aux layers "
                             f"{drafter.config.aux_layer_ids}, this decoder captures "
                             f"{self.layer_ids}")
        other = copy.copy(self)
        p = next(self.model.parameters())
        other.drafter = drafter.to(device=p.device, dtype=p.dtype)
        kernels.use_few_row_kernels(other.drafter, kernels=self.few_row_kernels)
        return other

    # --- the two models ----------------------------------------------------------------------

    def _verify(self, ids: list[int], cache: DynamicCache, last_only: bool = False,
                tree_paths: list[list[int]] | None = None):
        """Forward `ids` after the cached positions -> logits [s, V] fp32 ([1, V] if last_only:
        a prefill needs no lm_head over the prompt), aux [1, s, 3H]. tree_paths: `ids` is a
        tree, each path (indices into ids, root first) one chain that attends to the cache and
        to itself only; a token sits at the cache length + its index in its path."""
        start = cache.get_seq_length()
        x = torch.tensor([ids], device=self.device)                       # [1, s]
        kw = dict(input_ids=x, cache=cache, use_cache=True,
                  logits_to_keep=1 if last_only else 0)
        if tree_paths is None:
            offsets = torch.arange(len(ids), device=self.device)           # [s]
        else:
            kw["tree"] = kernels.tree_layout(tree_paths, start, self.device)
            offsets = kw["tree"]["offsets"]                                # [s]
        kw["position_ids"] = (offsets + start)[None]                       # [1, s]
        aux = None
        if self.layer_ids is None:
            out = self.model(**kw)
        else:
            with verifier_lib.capture_hidden_states(self.model, self.layer_ids) as got:
                out = self.model(**kw)
            aux = torch.cat([got["aux0"], got["aux1"], got["aux2"]], dim=-1)   # [1, s, 3H]
        if self.simulated_comm:
            time.sleep(self.simulated_comm(len(ids)))
        return out.logits[0].float(), aux

    def _draft_step(self, tokens: list[int], hidden: torch.Tensor, kv: DraftKV):
        """Drafter forward of `tokens` (at the positions after kv's) with `hidden` ([1, s, 3H]
        verifier aux or [1, 1, H] its own state) -> (last output state [1, 1, H],
        draft-vocab logits of the last position [Vd])."""
        start = len(kv)
        t = torch.tensor([tokens], device=self.device)                    # [1, s]
        pos = torch.arange(start, start + len(tokens), device=self.device)[None]
        dtype = self.drafter.fc.weight.dtype
        out = self.drafter(t, hidden.to(dtype), pos, attend=kv)[:, -1:]   # [1, 1, H]
        return out, self.drafter.logits(out)[0, -1].float()               # [Vd]

    def _draft_chain(self, tokens: list[int], aux: torch.Tensor, kv: DraftKV, depth: int,
                     sp: SamplingParams, gen, fallback: list[int] = (), below: float = 0.0):
        """One round's chain: the drafter absorbs (tokens, aux [1, s, 3H]) into kv, then
        proposes `depth` drafts, each step fed its own previous state ->
        (drafts, their q over the full vocab (None if greedy), the drafter's probabilities,
        whether the drafts are `fallback`'s). fallback: drafts from elsewhere (the lookup),
        returned instead (q one-hot, no probabilities) when the drafter's first draft has
        probability < below."""
        drafts, qs, confs = [], [], []
        kind = self.drafter.config.drafting
        one_forward = kind != "chain"                  # all drafts from one forward
        if kind == "parallel":                         # P-EAGLE
            logits = self._draft_parallel(tokens, aux, kv, depth)          # [depth, Vd]
        elif kind == "block":                          # DFlash
            logits = self._draft_block(tokens, aux, kv, depth)             # [depth, Vd]
        else:
            h, first = self._draft_step(tokens, aux, kv)
            logits = first[None]                                           # [1, Vd]
        if fallback and float(logits[0].softmax(-1).max()) < below:
            vocab = self.drafter.t2d.shape[0]
            qs = [None if sp.temperature == 0 else F.one_hot(torch.tensor(t, device=self.device),
                                                             vocab).float() for t in fallback]
            return list(fallback), qs, [], True
        for i in range(depth):
            if i > 0 and not one_forward:              # a chain: one more step, fed its state
                h, step = self._draft_step([tok], h, kv)
                logits = step[None]                                        # [1, Vd]
            tok, q, conf = self._propose(logits[i if one_forward else 0], sp, gen)
            drafts.append(tok)
            qs.append(q)
            confs.append(conf)
        return drafts, qs, confs, False

    def _draft_parallel(self, tokens: list[int], aux: torch.Tensor, kv: DraftKV, depth: int):
        """A parallel drafter's round in one forward: it absorbs (tokens, aux [1, s, 3H]) into
        kv, and the last token's slot plus depth-1 mask slots after it (draft.Eagle3Drafter
        forward's `masked`) each propose one draft -> draft-vocab logits [depth, Vd]. The mask
        slots' keys stay in kv until the round's crop, like a chain's draft steps."""
        start = len(kv)
        t = torch.tensor([tokens], device=self.device)                    # [1, s]
        pos = torch.arange(start, start + len(tokens) + depth - 1, device=self.device)[None]
        dtype = self.drafter.fc.weight.dtype
        out = self.drafter(t, aux.to(dtype), pos, attend=kv, masked=depth - 1)  # [1, s+d-1, H]
        return self.drafter.logits(out[:, -depth:])[0].float()            # [depth, Vd]

    def _draft_block(self, tokens: list[int], aux: torch.Tensor, kv: BlockKV, depth: int):
        """A block drafter's round in one forward: kv absorbs the context aux [1, s, 3H] (the
        verifier states of the positions before x = tokens[-1]), and the slots [x, depth masks]
        at x's position on propose from the masks -> draft-vocab logits [depth, Vd]."""
        start, s = len(kv), aux.shape[1]
        ctx = torch.arange(start, start + s, device=self.device)[None]                # [1, s]
        slots = torch.tensor([[tokens[-1]] + [self.drafter.config.mask_token_id] * depth],
                             device=self.device)                                     # [1, Q]
        pos = torch.arange(start + s, start + s + depth + 1, device=self.device)[None]  # [1, Q]
        out = self.drafter(slots, pos, kv, aux=aux.to(self.drafter.fc.weight.dtype),
                           aux_positions=ctx)                                        # [1, Q, H]
        return self.drafter.logits(out[:, 1:])[0].float()                           # [depth, Vd]

    def _draft_cache(self):
        """A request's drafter cache: the chain's and parallel's DraftKV, or the block
        drafter's per-layer context (BlockKV)."""
        if self.drafter is not None and self.drafter.config.drafting == "block":
            return BlockKV(len(self.drafter.layers))
        return DraftKV()

    def _draft_branches(self, tokens: list[int], aux: torch.Tensor, kv: DraftKV, depth: int,
                        branches: int, match: list[int] = ()):
        """Greedy chains forked at the first draft: the drafter absorbs (tokens, aux) into kv
        as _draft_chain does; its top-`branches` first drafts are each continued greedily to
        `depth` tokens, one batched drafter step per depth.
        match: the lookup's drafts, one more chain (the last) unless a chain begins with them.
        -> (chains, whether match is one of them)."""
        h, logits_d = self._draft_step(tokens, aux, kv)                        # [1, 1, H], [Vd]
        _, top = logits_d.softmax(-1).topk(min(branches, len(logits_d)))      # [b]
        tokens = self.drafter.draft_to_target(top)                             # [b]
        chains = [[int(t)] for t in tokens]
        attend, start = BranchKV(kv), len(kv)
        hs = h.expand(len(chains), 1, h.shape[-1])                            # [b, 1, H]
        for i in range(1, depth):
            pos = torch.full((len(chains), 1), start + i - 1, device=self.device)  # [b, 1]
            hs = self.drafter(tokens[:, None], hs.to(self.drafter.fc.weight.dtype), pos,
                              attend=attend)                                   # [b, 1, H]
            _, top = self.drafter.logits(hs)[:, 0].float().softmax(-1).max(-1)  # [b]
            tokens = self.drafter.draft_to_target(top)                         # [b]
            for c, t in zip(chains, tokens.tolist()):
                c.append(t)
        if match and not any(c[:len(match)] == match for c in chains):
            return chains + [match], True
        return chains, False

    def _propose(self, logits_d: torch.Tensor, sp: SamplingParams, gen):
        """Draft-vocab logits -> (target token id, q over the full vocab or None if greedy,
        the drafter's probability of that token: its confidence)."""
        if sp.temperature == 0:
            p_d = logits_d.softmax(-1)                                    # [Vd]
            i = p_d.argmax()
            return int(self.drafter.draft_to_target(i)), None, float(p_d[i])
        q_d = probs(logits_d, sp.temperature, sp.top_p)                   # [Vd]
        i = torch.multinomial(q_d, 1, generator=gen)[0]
        q = torch.zeros(self.drafter.t2d.shape[0], device=q_d.device)     # [V]
        q[self.drafter.draft_to_target(torch.arange(len(q_d), device=q_d.device))] = q_d
        return int(self.drafter.draft_to_target(i)), q, float(q_d[i])

    # --- one request ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt: list[int], sp: SamplingParams, depth: int = 0,
                 branches: int = 1, lookup: LookupParams | None = None) -> Iterator[Round]:
        """Yield Rounds until EOS or max_tokens; the caller may stop early (stop strings, a
        disconnected client) by closing the generator. `depth` may also be a callable
        (stats so far: list[Round]) -> int, for a depth chosen per round.
        branches: draft that many chains forked at the first draft and verify them together
        (module docstring); greedy only.
        lookup: the lookup fallback's parameters (module docstring); None = off. Its drafts are
        verified like the drafter's, so the output stays exactly the verifier's. In a tree
        (branches > 1, or lookup.branch) the lookup's match is one more chain of the tree."""
        tree = self._check_request(prompt, sp, depth, branches, lookup)
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(self.device).manual_seed(sp.seed)
        cache, kv, history = DynamicCache(), self._draft_cache(), []
        ngrams = NgramLookup(prompt, lookup.min_n, lookup.max_n) if lookup else None
        t0 = time.perf_counter()
        logits, aux = self._verify(prompt, cache, last_only=True)
        x = pick(logits[-1], sp, gen)
        verify_s = time.perf_counter() - t0
        emitted = 0
        # the drafter absorbs (token t+1, aux t) for the prompt: tokens prompt[1:] + [x]
        absorb, absorb_aux = prompt[1:] + [x], aux
        if ngrams is not None:
            ngrams.extend([x])                             # the context: prompt + output
        r = emit([x], 0, 0, sp, emitted, verify_s, 0.0)
        while True:
            history.append(r)
            emitted += len(r.tokens)
            yield r
            if r.finish_reason:
                return
            d = depth(history) if callable(depth) else depth
            t0 = time.perf_counter()                       # draft
            match = ngrams.propose(d) if ngrams is not None and d > 0 else []
            drafts, qs, confs, chains, looked_up = [], [], [], [], False
            if d > 0 and tree:
                chains, looked_up = self._draft_branches(absorb, absorb_aux, kv, d, branches,
                                                         match)
                if len(chains) == 1:                       # one chain: a plain verify
                    drafts, qs, chains = chains[0], [None] * len(chains[0]), []
            elif d > 0:
                drafts, qs, confs, looked_up = self._draft_chain(
                    absorb, absorb_aux, kv, d, sp, gen, match, lookup.below if lookup else 0.0)
            t1 = time.perf_counter()                       # verify and accept
            n = cache.get_seq_length()                     # x goes to position n
            ids, keep, bonus, aux, won = self._verify_round(x, drafts, qs, chains, cache, sp, gen)
            looked_up = looked_up and (not chains or won == len(chains) - 1)  # a tree: it won
            t2 = time.perf_counter()
            keep_cache(cache, n, keep)                     # roll back both caches
            a, new = len(keep) - 1, [ids[i] for i in keep[1:]] + [bonus]
            if ngrams is not None:
                ngrams.extend(new)
            if d > 0:
                kv.crop(n)                                 # drop the draft steps' keys
                absorb, absorb_aux = new, aux[:, keep]                     # [1, a+1, 3H]
            elif self.drafter is not None:                 # a depth-0 round: absorb later
                absorb, absorb_aux = absorb + new, torch.cat([absorb_aux, aux[:, :a + 1]], 1)
            x = bonus
            drafted = max(map(len, chains)) if chains else len(drafts)
            r = emit(new, drafted, a, sp, emitted, t2 - t1, t1 - t0, tuple(confs),
                     max(1, len(chains)), looked_up)

    def _check_request(self, prompt: list[int], sp: SamplingParams, depth, branches: int,
                       lookup: LookupParams | None) -> bool:
        """Refuse a request generate() cannot decode exactly -> whether its rounds are trees."""
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        tree = branches > 1 or bool(lookup and lookup.branch)
        if tree and sp.temperature != 0:
            raise ValueError("branches > 1 and the lookup branch need greedy decoding "
                             "(temperature 0)")
        if tree and self.drafter is not None and self.drafter.config.drafting != "chain":
            raise ValueError(f"branches > 1 and the lookup branch need a chain drafter: a "
                             f"{self.drafter.config.drafting} drafter's drafts do not depend "
                             f"on each other, so its top-k first drafts would all continue "
                             f"alike")
        if tree and not self.exact["tree"]:
            raise ValueError(self.inexact_reason("tree"))
        if not prompt:
            raise ValueError("empty prompt")
        if sp.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {sp.max_tokens}")
        if self.drafter is None and (callable(depth) or depth):
            raise ValueError("depth > 0 needs a drafter")
        return tree

    def _verify_round(self, x: int, drafts: list[int], qs, chains: list[list[int]],
                      cache: DynamicCache, sp: SamplingParams, gen):
        """Verify x and a round's drafts after the cache, [x, drafts] or, with chains, the tree
        [x, chain 1, chain 2, ..], and accept -> (the ids verified, keep: indices into them of x
        and the accepted drafts, the verifier's token after those, aux [1, s, 3H], the winning
        chain's index in chains: -1 if none, 0 for a chain verify)."""
        if not chains:
            ids = [x] + drafts
            logits, aux = self._verify(ids, cache)                         # [d+1, V]
            a, bonus = accept_chain(drafts, qs, logits, sp, gen)
            return ids, list(range(a + 1)), bonus, aux, 0                  # x + accepted drafts
        ids, paths = [x], []
        for c in chains:
            paths.append([0] + list(range(len(ids), len(ids) + len(c))))
            ids += c
        logits, aux = self._verify(ids, cache, tree_paths=paths)           # [s, V]
        keep, won = accept_tree(ids, paths, logits)        # x + the winner's accepted drafts
        return ids, keep, int(logits[keep[-1]].argmax()), aux, won


class TextStream:
    """Incremental detokenization with stop strings: push(token ids) -> text safe to send now.
    Holds back an incomplete UTF-8 character and any tail that could begin a stop string;
    `stopped` turns True when a stop string appears (the text ends right before it)."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tok, self.stop = tokenizer, [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.sent = 0                     # characters of the decoded text already returned
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        end = len(text)
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and i < end:
                end, self.stopped = i, True
        if not self.stopped and not final:
            if text.endswith("\ufffd"):                                    # partial character
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:                                            # a stop may begin
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        end = max(end, self.sent)
        out, self.sent = text[self.sent:end], end
        return out


def main(argv=None):
    from eagle3_ray.data import conversations as data
    from eagle3_ray.train import kinds
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", default=verifier_lib.EMBEDDED_VERIFIER)
    p.add_argument("--drafter", help="a trained drafter dir (default: an untrained one)")
    p.add_argument("--prompt", default="What is Ray?")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args(argv)
    tok, model = verifier_lib.load_tokenizer(a.verifier), verifier_lib.load_verifier(a.verifier)
    if a.drafter:
        from eagle3_ray.train.checkpoint import load_trained_drafter
        drafter = load_trained_drafter(a.drafter, a.verifier)[0]
    else:
        drafter = kinds.untrained_drafter(a.verifier)[0]
    spec = Speculator(model, drafter.eval())
    prompt = data.prompt_ids(tok, [{"role": "user", "content": a.prompt}])
    for depth in (0, a.depth):
        t0, out, rounds = time.perf_counter(), [], 0
        sp = SamplingParams(max_tokens=a.max_tokens, eos_ids=verifier_lib.eos_ids(model, tok))
        for r in spec.generate(prompt, sp, depth):
            out += r.tokens
            rounds += 1
        dt = time.perf_counter() - t0
        print(f"depth {depth}: {len(out)} tokens in {rounds} rounds, {len(out) / dt:.1f} tok/s: "
              f"{tok.decode(out)!r}")


if __name__ == "__main__":
    main()
