"""The cost model: what a speculation round costs on a node, which depth pays best, and which
drafter kind to serve (../shared/DESIGN.md, "Cost model").

With conditional acceptance a_j at draft position j and p_i = Π_{j<=i} a_j (the chance that
position i is accepted):
    E[τ](k)      = 1 + Σ_{i<k} p_i                      tokens per round at depth k
    AR(m)        = α + 2(n−1)/n · m / BW                one all-reduce of m bytes on n GPUs
                   or a measured all-reduce curve       (allreduce_curve_us)
    comm(t)      = N_ar·AR(t·H·B)                       N_ar all-reduces of t tokens
    t_verify(t)  = compute(t) + comm(t)                 compute(t): the profile's table
    t_draft      = t_step + C·AR(H·B)                   one chain drafter forward: compute
                                                        (draft_step_ms) + its C collectives
                                                        (draft_collectives) of one token
    D_chain(k)   = k·t_draft                            k sequential forwards (EAGLE-3; the
                                                        first also absorbs the accepted tokens)
    D_par(k)     = t_par(k) + C·AR(k·H·B), 0 at k = 0   ONE forward of k query tokens (bonus
                                                        token + k−1 mask slots, P-EAGLE):
                                                        t_par(k) from draft_parallel_ms
    D_block(k)   = t_block(k) + C_block·AR((k+1)·H·B),  ONE forward of k+1 query tokens (bonus
                   0 at k = 0                           token + k mask slots, non-causal in
                                                        the block) through n_layers layers
                                                        (DFlash): t_block from draft_block_ms,
                                                        else n_layers x t_par(k+1);
                                                        C_block = 2 + 2·n_layers at TP
    T_round(k)   = D(k) + t_verify(k+1)
    tokens/s(k)  = E[τ](k) / T_round(k),   speedup(k) = E[τ](k) · T_round(0) / T_round(k)
A round's fixed costs (N_ar·α of all-reduce latency, reading the weights once) buy more tokens
the deeper it drafts, so a node with slow all-reduces (PCIe) goes deeper than one with fast ones
(NVLink); growing per-token costs (draft steps, MoE experts touched, transfer) stop it.
vLLM and SGLang run a drafter at the verifier's tensor-parallel degree, so on a TP node every
drafter forward pays its collectives (profiles.draft_collectives_tp): a chain pays them k times
a round, a parallel or block drafter once. A parallel drafter's acceptance is lower (it does
not see its own earlier drafts), a block drafter's higher (several layers, the verifier's
states in every one) at a dearer forward, so which kind wins depends on the node and on the
acceptance curves: choose_drafting() prices each and says whether acceptance or cost decided.

    eagle3-ray plan --acceptance 0.8,0.75,0.7,0.65 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --compare nvlink-8x-h100-kimi-k2.5 --out /tmp/plan          # CPU, a second
    eagle3-ray plan --acceptance 0.8,0.75,0.7 --parallel-acceptance 0.7,0.65,0.6 \\
        --block-acceptance 0.8,0.8,0.78 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 --out /tmp/plan
    eagle3-ray plan --sweep-kinds 0.5 0.7 0.9 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --out /tmp/plan                                 # the three kinds, collectives on/off
"""
from __future__ import annotations

import bisect
import dataclasses
import math

from eagle3_ray.plan.acceptance import (BLOCK_FIRST_RATIO, BLOCK_REST_RATIO,
                                        EXTRAPOLATION_DECAY, EXTRAPOLATION_WINDOW,
                                        PARALLEL_FIRST_RATIO, PARALLEL_REST_RATIO,
                                        block_from_chain, extend_acceptance, parallel_from_chain)
from eagle3_ray.plan.output import allreduce_model, kind_summary, why, why_drafting
from eagle3_ray.plan.profiles import (DRAFT_COLLECTIVES_PER_LAYER, NodeProfile, message_bytes,
                                      profile_to_dict)
from eagle3_ray.train import ttt

# How a round drafts, the kinds the planner prices (train.draft.DRAFTING: those the trainer
# trains): k forwards of one layer, one forward of k tokens, one of k+1 through several layers.
DRAFTING = ("chain", "parallel", "block")
BLOCK_LAYERS = 2              # a block drafter's decoder layers unless told (our trainer's)
BLOCK_SIZE = 16               # a block drafter's drafts a round at most, unless told (our
                              # trainer's block_size: the bonus token + 16 mask slots)
# with one kind's acceptance only, the kind priced beside it at the same acceptance (a what-if)
WHAT_IF = {"chain": "parallel", "parallel": "chain", "block": "chain"}


# --- the arithmetic --------------------------------------------------------------------------

def _interp(xs: list, ys: list, x: float) -> float:
    """Linear between the points (xs sorted), linear from the outer two beyond them, >= 0."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)                     # the segment [xs[i-1], xs[i]]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def compute_s(profile: NodeProfile, tokens: int) -> float:
    """Verify compute for `tokens` from the profile's verify_ms table (interpolated)."""
    return _interp(profile._xs, profile._ys, tokens) / 1e3


def allreduce_curve_us(curve: dict[int, float], nbytes: float) -> float:
    """One all-reduce of `nbytes` from a measured curve {bytes: µs}: straight lines between the
    points on log-log axes (latency and bandwidth regimes are both straight there); below the
    smallest size, the smallest time (a message is never cheaper than the latency floor);
    above the largest, the last segment's log-log slope continued (extrapolated: plan() says
    so)."""
    xs = sorted(curve)
    if nbytes <= xs[0]:
        return float(curve[xs[0]])
    i = min(bisect.bisect_left(xs, nbytes), len(xs) - 1)       # the segment [xs[i-1], xs[i]]
    x0, x1 = xs[i - 1], xs[i]
    slope = math.log(curve[x1] / curve[x0]) / math.log(x1 / x0)
    if nbytes > x1:                             # past the data: never below its last point
        return float(curve[x1] * (nbytes / x1) ** max(slope, 0.0))
    return float(curve[x0] * (nbytes / x0) ** slope)


def _allreduce_s(profile: NodeProfile, tokens: int) -> float:
    n, ic = profile.gpus, profile.interconnect
    if n <= 1:
        return 0.0
    msg = message_bytes(profile, tokens)                               # bytes
    if ic.allreduce_us:
        return allreduce_curve_us(ic.allreduce_us, msg) * 1e-6
    return ic.latency_us * 1e-6 + 2 * (n - 1) / n * msg / (ic.bandwidth_gbps * 1e9)


def comm_s(profile: NodeProfile, tokens: int) -> float:
    """N_ar · AR(tokens·H·B) with a measured all-reduce curve AR (allreduce_curve_us), else
    N_ar · (α + 2(n−1)/n · tokens·H·B / BW); 0 on one GPU."""
    return profile.interconnect.allreduces_per_forward * _allreduce_s(profile, tokens)


def verify_s(profile: NodeProfile, tokens: int) -> float:
    return compute_s(profile, tokens) + comm_s(profile, tokens)


def draft_comm_s(profile: NodeProfile, tokens: int) -> float:
    """The collectives of one drafter forward over `tokens` query tokens: C·AR(tokens·H·B),
    C = draft_collectives (each priced as an all-reduce of the drafter's hidden states, the
    lm_head gather included); 0 on one GPU."""
    return profile.draft_collectives * _allreduce_s(profile, tokens)


def draft_s(profile: NodeProfile) -> float:
    """t_draft: one chain drafter forward, compute + its collectives of one token."""
    return profile.draft_step_ms / 1e3 + draft_comm_s(profile, 1)


def draft_parallel_compute_s(profile: NodeProfile, k: int) -> float:
    """t_par(k): one drafter forward of k query tokens, compute only: the profile's
    draft_parallel_ms interpolated (linear, continued past its ends); without one, modelled
    flat at draft_step_ms (a forward of a few tokens reads the same weights as one of one)."""
    if not profile._pxs:
        return profile.draft_step_ms / 1e3
    return _interp(profile._pxs, profile._pys, k) / 1e3


def _check_kind(drafting: str, block_layers: int = BLOCK_LAYERS) -> None:
    if drafting not in DRAFTING:
        raise ValueError(f"drafting must be one of {DRAFTING}, got {drafting!r}")
    if not (isinstance(block_layers, int) and block_layers >= 1):
        raise ValueError(f"block_layers must be an integer >= 1, got {block_layers!r}")


def block_collectives(profile: NodeProfile, layers: int = BLOCK_LAYERS) -> int:
    """C_block: collectives of one forward of a `layers`-layer block drafter at the profile's
    tensor parallelism. The profile's draft_collectives count a one-layer drafter's forward
    (DRAFT_COLLECTIVES_TP = 2 + 2·1 at TP); each further layer adds its o_proj and down_proj
    all-reduces: C + 2·(layers − 1), = 2 + 2·layers at TP; 0 where the drafter pays none (one
    GPU)."""
    c = profile.draft_collectives
    return 0 if c == 0 else c + DRAFT_COLLECTIVES_PER_LAYER * (layers - 1)


def draft_block_compute_s(profile: NodeProfile, k: int, layers: int = BLOCK_LAYERS) -> float:
    """t_block(k): one forward of a `layers`-layer block drafter over k+1 query tokens (the
    bonus token and k mask slots), compute only: the profile's draft_block_ms at k+1 tokens
    (interpolated, continued past its ends; scaled by layers / draft_block_layers when those
    differ), else modelled as `layers` one-layer forwards of k+1 tokens,
    layers x draft_parallel_compute_s(k+1) (itself flat at draft_step_ms without
    draft_parallel_ms). block_forward_model() says which."""
    if profile._bxs:
        ms = _interp(profile._bxs, profile._bys, k + 1)
        return ms * layers / profile.draft_block_layers / 1e3
    return layers * draft_parallel_compute_s(profile, k + 1)


def block_forward_model(profile: NodeProfile, layers: int = BLOCK_LAYERS) -> str:
    """How draft_block_compute_s prices a block drafter's forward on `profile`, in words."""
    if profile._bxs:
        scaled = (f", scaled x{layers}/{profile.draft_block_layers} layers"
                  if layers != profile.draft_block_layers else "")
        return f"draft_block_ms (measured, {profile.draft_block_layers} layers{scaled})"
    if profile._pxs:
        return f"modelled: {layers} layers x draft_parallel_ms at k+1 tokens"
    return (f"modelled flat: {layers} layers x draft_step_ms ({profile.draft_step_ms:g} ms; "
            f"no draft_parallel_ms either)")


def draft_round_s(profile: NodeProfile, k: int, drafting: str = "chain",
                  block_layers: int = BLOCK_LAYERS) -> float:
    """A round's drafting at depth k: D_chain(k) = k·t_draft; D_par(k) = t_par(k) +
    C·AR(k·H·B) (one forward of k tokens, its collectives once); D_block(k) = t_block(k) +
    C_block·AR((k+1)·H·B) (one forward of k+1 tokens through block_layers layers); 0 at 0."""
    _check_kind(drafting, block_layers)
    if drafting == "chain":
        return k * draft_s(profile)
    if k == 0:
        return 0.0
    if drafting == "parallel":
        return draft_parallel_compute_s(profile, k) + draft_comm_s(profile, k)
    return (draft_block_compute_s(profile, k, block_layers)
            + block_collectives(profile, block_layers) * _allreduce_s(profile, k + 1))


def draft_round_comm_s(profile: NodeProfile, k: int, drafting: str = "chain",
                       block_layers: int = BLOCK_LAYERS) -> float:
    """The collectives' part of draft_round_s: k·C·AR(H·B) (chain), C·AR(k·H·B) (parallel) or
    C_block·AR((k+1)·H·B) (block)."""
    if k == 0:
        return 0.0
    if drafting == "chain":
        return k * draft_comm_s(profile, 1)
    if drafting == "parallel":
        return draft_comm_s(profile, k)
    return block_collectives(profile, block_layers) * _allreduce_s(profile, k + 1)


def draft_round_collectives(profile: NodeProfile, k: int, drafting: str = "chain",
                            block_layers: int = BLOCK_LAYERS) -> int:
    """How many collectives a round's drafting pays at depth k: k·C, C or C_block (0 at 0)."""
    if drafting == "block":
        return min(k, 1) * block_collectives(profile, block_layers)
    return (k if drafting == "chain" else min(k, 1)) * profile.draft_collectives


def round_s(profile: NodeProfile, k: int, drafting: str = "chain",
            block_layers: int = BLOCK_LAYERS) -> float:
    """One speculation round at depth k: its drafting + a verify of k+1 tokens."""
    return draft_round_s(profile, k, drafting, block_layers) + verify_s(profile, k + 1)


# --- the best depth --------------------------------------------------------------------------

def best_depth(cond_acc: list[float], profile: NodeProfile, max_depth: int | None = None,
               drafting: str = "chain", block_layers: int = BLOCK_LAYERS) -> int:
    """argmax over k = 0..max_depth of tokens/s (ties: the shallower). Cheap enough to call per
    round from a dynamic-depth server: one pass over the depths, a few floats each. Positions
    past len(cond_acc) are extrapolated (extend_acceptance)."""
    max_depth = len(cond_acc) if max_depth is None else max_depth
    if max_depth > len(cond_acc):
        cond_acc = extend_acceptance(cond_acc, max_depth)[0]
    best, best_rate, tau, chain = 0, 1.0 / round_s(profile, 0), 1.0, 1.0
    for k in range(1, max_depth + 1):
        chain *= cond_acc[k - 1]
        tau += chain
        rate = tau / round_s(profile, k, drafting, block_layers)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class DynamicDepth:
    """A request's depth policy (Speculator.generate's `depth` callable): before each round,
    the depth with the best expected tokens/s on `profile`, from this request's own per-position
    acceptance so far plus a prior.

    Each position's conditional acceptance is its prior (`prior`: the drafter's held-out
    acceptance, worth `prior_rounds` rounds) updated by the rounds that reached it (drafts
    before it all accepted): (prior_rounds·a + accepted) / (prior_rounds + reached). Positions
    past both the prior and the deepest one drafted so far are extrapolated from the request's
    own figures (extend_acceptance), so a request whose drafts keep being accepted goes deeper
    and one that keeps missing (code vs chat, say) backs off. Rounds drafted by the lookup
    fallback, or won by the lookup's chain of a tree (Round.lookup), are left out: their
    acceptance is the n-gram match's, not the drafter's. drafting: how the drafter's rounds
    are priced (a parallel or block drafter's round is one forward, draft_round_s);
    block_layers: a block drafter's layer count."""

    def __init__(self, profile: NodeProfile, prior: list[float], max_depth: int,
                 prior_rounds: float = 8.0, drafting: str = "chain",
                 block_layers: int = BLOCK_LAYERS):
        if not prior:
            raise ValueError("DynamicDepth needs a prior acceptance for at least position 0")
        _check_kind(drafting, block_layers)
        self.drafting, self.block_layers = drafting, block_layers
        self.profile, self.max_depth, self.seen = profile, max_depth, 0
        self.known = min(len(prior), max_depth)                     # positions the prior gives
        self.prior = extend_acceptance(list(prior), max(max_depth, len(prior)))[0][:max_depth]
        self.prior_rounds = prior_rounds
        self.reached = [0] * max_depth                              # rounds per position that
        self.accepted = [0] * max_depth                             # reached / accepted it
        self.deepest = 0                                            # positions drafted so far
        self.depths: list[int] = []                                 # chosen per round

    def cond_acc(self) -> list[float]:
        n = max(self.known, self.deepest)
        own = [(self.prior_rounds * a + k) / (self.prior_rounds + r)
               for a, k, r in zip(self.prior[:n], self.accepted, self.reached)]
        return extend_acceptance(own, self.max_depth)[0]

    def __call__(self, history) -> int:
        for r in history[self.seen:]:                               # speculate.Round
            if getattr(r, "lookup", False):
                continue
            drafted = min(r.drafted, self.max_depth)
            self.deepest = max(self.deepest, drafted)
            for k in range(min(drafted, r.accepted + 1)):           # reached: 0..k-1 accepted
                self.reached[k] += 1
                self.accepted[k] += k < r.accepted
        self.seen = len(history)
        d = best_depth(self.cond_acc(), self.profile, self.max_depth, self.drafting,
                       self.block_layers)
        self.depths.append(d)
        return d


# --- one plan ----------------------------------------------------------------------------------

def plan(cond_acc: list[float], profile: NodeProfile, max_depth: int = 32,
         known_depth: int | None = None, train_costs: dict[int, float] | None = None,
         drafting: str = "chain", block_layers: int = BLOCK_LAYERS) -> dict:
    """Per depth 0..max_depth: E[τ], round time (draft and its collectives / verify compute /
    comm), tokens/s, speedup, extrapolated; the best depth, the ttt_steps to train for it, the
    training cost of each ttt_steps choice (train_costs: ttt_steps -> seconds per step, from
    `bench train`), and a plain-words reason. `known_depth`: how many leading entries of
    cond_acc are measured (default: all); the rest is extrapolated. `drafting`: how the rounds
    draft ("chain", "parallel" or "block", draft_round_s), and so what cond_acc is the
    acceptance of; `block_layers`: a block drafter's layer count (its forward and collectives:
    result["block"])."""
    _check_kind(drafting, block_layers)
    if not 1 <= max_depth <= 64:
        raise ValueError(f"max_depth must be in 1..64, got {max_depth}")
    known = len(cond_acc) if known_depth is None else min(known_depth, len(cond_acc))
    if known == 0:
        raise ValueError("no measured acceptance (cond_acc is empty)")
    bad = [a for a in cond_acc[:known] if not 0.0 <= a <= 1.0]
    if bad:
        raise ValueError(f"conditional acceptance must lie in [0, 1], got {bad}")
    acc, extrapolated = extend_acceptance(cond_acc[:known], max_depth)
    taus = ttt.accept_lengths(acc)                      # 1 + Σ_{i<k} Π_{j<=i} a_j
    r0 = round_s(profile, 0)
    rows = []
    for k in range(max_depth + 1):
        r = round_s(profile, k, drafting, block_layers)
        rows.append({"depth": k, "accept_len": taus[k], "round_ms": r * 1e3,
                     "draft_ms": draft_round_s(profile, k, drafting, block_layers) * 1e3,
                     "draft_comm_ms": draft_round_comm_s(profile, k, drafting,
                                                         block_layers) * 1e3,
                     "draft_collectives": draft_round_collectives(profile, k, drafting,
                                                                  block_layers),
                     "verify_compute_ms": compute_s(profile, k + 1) * 1e3,
                     "comm_ms": comm_s(profile, k + 1) * 1e3,
                     "tokens_per_s": taus[k] / r, "speedup": taus[k] * r0 / r,
                     "extrapolated": k > known})
    best = best_depth(acc, profile, max_depth, drafting, block_layers)
    ttt_steps = max(1, min(32, best))
    result = {
        "profile": profile.name, "simulated": profile.simulated, "max_depth": max_depth,
        "drafting": drafting,
        "acceptance": {"cond_acc": acc, "extrapolated": extrapolated, "known_depth": known,
                       "extrapolation": f"past position {known - 1}: min(last, mean of last "
                                        f"{EXTRAPOLATION_WINDOW}) x "
                                        f"{EXTRAPOLATION_DECAY}^distance"},
        "depths": rows, "best_depth": best, "best": rows[best], "ttt_steps": ttt_steps,
        "allreduce_model": allreduce_model(profile),
        "warnings": [], "profile_detail": profile_to_dict(profile)}
    if drafting == "block":
        result["block"] = {"layers": block_layers,
                           "collectives_per_forward": block_collectives(profile, block_layers),
                           "query_tokens": "depth + 1 (the bonus token and depth mask slots)",
                           "forward_ms": block_forward_model(profile, block_layers)}
    curve = profile.interconnect.allreduce_us
    if curve and profile.gpus > 1 and message_bytes(profile, max_depth + 1) > max(curve):
        first = next(k for k in range(max_depth + 1)
                     if message_bytes(profile, k + 1) > max(curve))
        result["warnings"].append(
            f"the all-reduce curve is measured up to {max(curve)} bytes; from depth {first} on "
            f"a verify sends more ({message_bytes(profile, first + 1)} bytes at depth {first}, "
            f"{message_bytes(profile, max_depth + 1)} at depth {max_depth}): its time there is "
            f"extrapolated from the curve's last two points (log-log)")
    if best > known:
        result["warnings"].append(
            f"acceptance is measured for positions 0..{known - 1} only: depth {best} relies on "
            f"extrapolated positions {known}..{best - 1}; train with ttt_steps={ttt_steps} and "
            f"measure again")
    if best == 0:
        result["warnings"].append("speculation does not pay here: no depth beats plain decoding "
                                  "with this acceptance on this node")
    result["warnings"] += _draft_table_notes(profile, drafting, max_depth, block_layers)
    if train_costs:
        base = min(train_costs)                 # costs relative to the shallowest ttt_steps
        result["train"] = [{"ttt_steps": s, "step_s": c, "relative_cost": c / train_costs[base],
                            "speedup_if_served_at_depth": rows[min(s, max_depth)]["speedup"]}
                           for s, c in sorted(train_costs.items())]
        xs = sorted(train_costs)
        cost = _interp(xs, [train_costs[x] for x in xs], ttt_steps)
        result["ttt_steps_step_s"] = cost
        result["ttt_steps_relative_cost"] = cost / train_costs[base]
        result["train_relative_to"] = base
    result["why"] = why(result, profile)
    return result


def _draft_table_notes(profile: NodeProfile, drafting: str, max_depth: int,
                       block_layers: int) -> list[str]:
    """Where a one-forward kind's drafter forward is modelled or extrapolated, in words."""
    par, block = profile.draft_parallel_ms, profile.draft_block_ms
    if drafting == "parallel" and not par:
        return [f"{profile.name} has no draft_parallel_ms: a k-token drafter forward is "
                f"modelled flat at draft_step_ms ({profile.draft_step_ms:g} ms); `eagle3-ray "
                f"profile` measures it"]
    if drafting == "parallel" and max_depth > max(par):
        return [f"draft_parallel_ms is measured up to {max(par)} tokens; deeper parallel "
                f"forwards are extrapolated linearly"]
    if drafting != "block":
        return []
    if not block:
        table = (f"{block_layers} x draft_parallel_ms at k+1 tokens" if par else
                 f"{block_layers} x draft_step_ms ({profile.draft_step_ms:g} ms), flat: no "
                 f"draft_parallel_ms either")
        return [f"{profile.name} has no draft_block_ms: a block drafter's forward of k+1 tokens "
                f"is modelled as {table} (one forward per layer); measured "
                f"draft_block_ms + draft_block_layers replace the model"]
    notes = []
    if block_layers != profile.draft_block_layers:
        notes.append(f"draft_block_ms is measured with {profile.draft_block_layers} layers; a "
                     f"{block_layers}-layer drafter's forward is scaled from it x"
                     f"{block_layers}/{profile.draft_block_layers}")
    if max_depth + 1 > max(block):
        notes.append(f"draft_block_ms is measured up to {max(block)} tokens; deeper block "
                     f"forwards are extrapolated linearly")
    return notes


def sweep(levels: list[float], profiles: list[NodeProfile], max_depth: int = 32) -> dict:
    """Best depth for each constant conditional acceptance level a (a_j = a at every position,
    so E[τ](k) = (1 − a^(k+1)) / (1 − a)) on each profile: how the choice moves with acceptance
    and with the profile (e.g. α/β against a measured all-reduce curve)."""
    if not levels or not all(0.0 <= a <= 1.0 for a in levels):
        raise ValueError(f"--sweep levels must lie in [0, 1], got {levels}")
    rows, warnings = [], {}
    for a in levels:
        row = {"acceptance": a}
        for p in profiles:
            r = plan([a] * max_depth, p, max_depth)
            row[p.name] = {"best_depth": r["best_depth"], "speedup": r["best"]["speedup"],
                           "tokens_per_s": r["best"]["tokens_per_s"],
                           "accept_len": r["best"]["accept_len"],
                           "comm_share_depth0": r["depths"][0]["comm_ms"]
                           / r["depths"][0]["round_ms"]}
            warnings.setdefault(p.name, [w for w in r["warnings"] if "curve" in w])
        rows.append(row)
    return {"kind": "sweep", "max_depth": max_depth, "profiles": [p.name for p in profiles],
            "allreduce_model": {p.name: allreduce_model(p) for p in profiles},
            "rows": rows, "warnings": warnings}


# --- which kind to draft with ------------------------------------------------------------------

def depth_bound(drafting: str, max_depth: int, block_size: int = BLOCK_SIZE) -> int:
    """The deepest round a kind can draft within max_depth: a block drafter drafts at most its
    block size a round."""
    return min(max_depth, block_size) if drafting == "block" else max_depth


def choose_drafting(profile: NodeProfile, acceptance: dict[str, tuple[list[float], int, str]],
                    max_depth: int = 32, train_costs: dict[int, float] | None = None,
                    block_layers: int = BLOCK_LAYERS, block_size: int = BLOCK_SIZE) -> dict:
    """Chain, parallel or block drafting, and the depth, on `profile`.

    acceptance: kind -> (cond_acc, known depth, source), for the kinds whose acceptance was
    measured (any subset of DRAFTING). Each given kind is planned (plan(), its own acceptance
    and draft_round_s) and the one with the highest tokens/s at its best depth is chosen (a
    tie: chain, then parallel, then block). Between the winner and the runner-up,
    `decided_by` says what decided at their best depths: "acceptance" when the winner yields
    more tokens per round (E[τ]), "cost" when it yields no more but its round is cheaper
    enough, "tie" when their tokens/s are equal; `attribution` swaps their curves
    (_attribution). With one kind only, WHAT_IF's kind at the same acceptance is added as a
    what-if: what its drafting would cost, not a choice (another kind's drafter does not
    reach the same acceptance). The block kind is planned up to its block size (depth_bound).
    -> {"choice", "plans": {kind: plan()}, "kinds": {kind: summary}, "ranking": [kinds, best
    first], "runner_up", "decided_by", "attribution", "what_if": {kind: plan()} (one kind
    given), "why"}."""
    unknown = sorted(set(acceptance) - set(DRAFTING))
    if not acceptance or unknown:
        raise ValueError(f"acceptance must be given for some of {DRAFTING}, got "
                         f"{sorted(acceptance)}")
    plans = {kind: plan(cond, profile, depth_bound(kind, max_depth, block_size), known,
                        train_costs, kind, block_layers)
             for kind, (cond, known, _) in acceptance.items()}
    for kind, (_, _, source) in acceptance.items():
        plans[kind]["acceptance"]["source"] = source
    kinds = {kind: dict(kind_summary(r), source=acceptance[kind][2]) for kind, r in plans.items()}
    ranking = sorted(plans, key=lambda k: (-plans[k]["best"]["tokens_per_s"], DRAFTING.index(k)))
    choice, runner_up = ranking[0], (ranking[1] if len(ranking) > 1 else None)
    out = {"choice": choice, "plans": plans, "kinds": kinds, "ranking": ranking,
           "runner_up": runner_up, "decided_by": None, "what_if": {}, "attribution": None}
    if runner_up:
        out["decided_by"] = decided_by(kinds[choice], kinds[runner_up])
        out["attribution"] = _attribution(profile, acceptance, choice, runner_up, max_depth,
                                          block_layers, block_size)
    else:
        other = WHAT_IF[choice]
        cond, known, _ = acceptance[choice]
        w = plan(cond, profile, max_depth, known, train_costs, other, block_layers)
        w["acceptance"]["source"] = (f"WHAT-IF: {choice}'s acceptance ({acceptance[choice][2]}) "
                                     f"priced as {other} drafting")
        out["what_if"][other] = w
    out["why"] = why_drafting(out)
    return out


def decided_by(win: dict, runner_up: dict) -> str:
    """What decided between two kinds' summaries at their best depths: "acceptance" when the
    winner's E[τ] (tokens per round) is higher than the runner-up's, "cost" when it is not
    but its round is cheaper enough to win anyway, "tie" when their tokens/s are equal."""
    if win["tokens_per_s"] <= runner_up["tokens_per_s"] * (1 + 1e-9):
        return "tie"
    return "acceptance" if win["accept_len"] > runner_up["accept_len"] * (1 + 1e-9) else "cost"


def _attribution(profile: NodeProfile, acceptance: dict, win: str, lose: str,
                 max_depth: int, block_layers: int = BLOCK_LAYERS,
                 block_size: int = BLOCK_SIZE) -> dict:
    """The winner against the runner-up with their curves swapped: each kind's best tokens/s
    with the acceptance of one and the drafting (cost) of the other. acceptance_gain = the
    winner's acceptance drafted the loser's way, cost_gain = the loser's acceptance drafted
    the winner's way, both over the loser's own; the larger one dominated ('tie': neither
    moves it, e.g. depth 0 on both)."""
    def rate(acc_kind: str, cost_kind: str) -> float:
        cond, known, _ = acceptance[acc_kind]
        return plan(cond, profile, depth_bound(cost_kind, max_depth, block_size), known,
                    drafting=cost_kind, block_layers=block_layers)["best"]["tokens_per_s"]
    base = rate(lose, lose)
    acc_gain, cost_gain = rate(win, lose) / base, rate(lose, win) / base
    if rate(win, win) <= base * (1 + 1e-9):
        dom = "tie"
    else:
        dom = "acceptance" if acc_gain >= cost_gain else "cost"
    return {"dominated": dom, "acceptance_gain": acc_gain, "cost_gain": cost_gain}


def sweep_drafting(levels: list[float], profiles: list[NodeProfile], max_depth: int = 32,
                   first: float = PARALLEL_FIRST_RATIO, rest: float = PARALLEL_REST_RATIO,
                   block_first: float = BLOCK_FIRST_RATIO, block_rest: float = BLOCK_REST_RATIO,
                   block_layers: int = BLOCK_LAYERS, block_size: int = BLOCK_SIZE) -> dict:
    """The three kinds over a family of acceptance curves: for each level a, the chain's
    conditional acceptance is a at every position, the parallel drafter's
    parallel_from_chain() of it, the block drafter's block_from_chain() of it; on each
    profile, once with its draft_collectives and once with 0 (drafters whose collectives were
    free). Per row: each kind's best depth and speedup, which kind choose_drafting() picks,
    what decided it against the runner-up, and the parallel and block kinds at the chain's own
    acceptance (the cost difference alone). The block kind drafts at most block_size a round.
    """
    if not levels or not all(0.0 <= a <= 1.0 for a in levels):
        raise ValueError(f"--sweep-kinds levels must lie in [0, 1], got {levels}")
    if not (0 < first <= 1.5 and 0 < rest <= 1.5):
        raise ValueError(f"parallel acceptance ratios must be in (0, 1.5], got {first}, {rest}")
    if not (0 < block_first <= 1.5 and 0 < block_rest <= 1.5):
        raise ValueError(f"block acceptance ratios must be in (0, 1.5], got {block_first}, "
                         f"{block_rest}")
    rows = []
    for p in profiles:
        for c in sorted({p.draft_collectives, 0}, reverse=True):
            q = dataclasses.replace(p, draft_collectives=c)
            for a in levels:
                chain = [a] * max_depth
                curves = {"chain": (chain, max_depth, f"a = {a:g}"),
                          "parallel": (parallel_from_chain(chain, first, rest), max_depth,
                                       "derived"),
                          "block": (block_from_chain(chain, block_first, block_rest),
                                    max_depth, "derived")}
                ch = choose_drafting(q, curves, max_depth, block_layers=block_layers,
                                     block_size=block_size)
                same = {kind: kind_summary(plan(chain, q, depth_bound(kind, max_depth, block_size),
                                                drafting=kind, block_layers=block_layers))
                        for kind in ("parallel", "block")}
                rows.append({"profile": p.name, "acceptance": a, "draft_collectives": c,
                             "block_collectives": block_collectives(q, block_layers),
                             **{kind: ch["kinds"][kind] for kind in DRAFTING},
                             "pick": ch["choice"], "runner_up": ch["runner_up"],
                             "decided_by": ch["decided_by"],
                             "dominated": ch["attribution"]["dominated"],
                             "acceptance_gain": ch["attribution"]["acceptance_gain"],
                             "cost_gain": ch["attribution"]["cost_gain"],
                             "parallel_at_chain_acceptance": same["parallel"],
                             "block_at_chain_acceptance": same["block"]})
    return {"kind": "sweep_drafting", "max_depth": max_depth,
            "profiles": [p.name for p in profiles], "block_layers": block_layers,
            "block_size": block_size,
            "parallel_acceptance": {
                "first_ratio": first, "rest_ratio": rest,
                "rule": "parallel a_0 = first x chain a_0; a_j = rest x chain a_j for j >= 1",
                "source": "vLLM PR #32628, HumanEval, k = 8: P-EAGLE P0 63%, P1 38% against "
                          "EAGLE-3 71%, 49% (the defaults)"},
            "block_acceptance": {
                "first_ratio": block_first, "rest_ratio": block_rest,
                "rule": "block a_0 = first x chain a_0; a_j = rest x chain a_j for j >= 1, "
                        "capped at 1",
                "source": "ASSUMED (acceptance.BLOCK_*_RATIO): chain a = 0.8 everywhere "
                          "(E[tau](16) = 4.89) -> block E[tau](16) = 6.4, near the acceptance "
                          "length DFlash (arXiv 2602.06036) reports at block 16"},
            "allreduce_model": {p.name: allreduce_model(p) for p in profiles},
            "draft_step_ms": {p.name: p.draft_step_ms for p in profiles},
            "draft_parallel_ms": {p.name: p.draft_parallel_ms for p in profiles},
            "draft_block": {p.name: block_forward_model(p, block_layers) for p in profiles},
            "rows": rows}
