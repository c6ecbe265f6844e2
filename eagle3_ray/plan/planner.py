"""The depth planner: which speculation depth to serve, how deep to train, what speedup to expect,
and whether to draft a chain (EAGLE-3) or in parallel (P-EAGLE).

Cost model (../shared/DESIGN.md, "Cost model"). With conditional acceptance a_j at draft
position j and p_i = Π_{j<=i} a_j (the chance that position i is accepted):
    E[τ](k)      = 1 + Σ_{i<k} p_i                      tokens per round at depth k
    AR(m)        = α + 2(n−1)/n · m / BW                one all-reduce of m bytes on n GPUs
                   or a measured all-reduce curve       (allreduce_curve_us)
    comm(t)      = N_ar·AR(t·H·B)                       N_ar all-reduces of t tokens
    t_verify(t)  = compute(t) + comm(t)                 compute(t): the profile's table
    t_draft      = t_step + C·AR(H·B)                   one chain drafter forward: compute
                                                        (draft_step_ms) + its C collectives
                                                        (draft_collectives) of one token
    D_chain(k)   = k·t_draft                            k sequential forwards (the first also
                                                        absorbs the accepted tokens)
    D_par(k)     = t_par(k) + C·AR(k·H·B), 0 at k = 0   ONE forward of k query tokens (bonus
                                                        token + k−1 mask slots, P-EAGLE):
                                                        t_par(k) from draft_parallel_ms
    T_round(k)   = D(k) + t_verify(k+1)
    tokens/s(k)  = E[τ](k) / T_round(k),   speedup(k) = E[τ](k) · T_round(0) / T_round(k)
A round's fixed costs (N_ar·α of all-reduce latency, reading the weights once) buy more tokens
the deeper it drafts, so a node with slow all-reduces (PCIe) goes deeper than one with fast ones
(NVLink); growing per-token costs (draft steps, MoE experts touched, transfer) stop it.
vLLM and SGLang run an EAGLE drafter at the verifier's tensor-parallel degree, so on a TP node
every drafter forward pays C ≈ 4 collectives (vocab-parallel embedding, attention o_proj, MLP
down_proj, lm_head gather): a chain pays them k times a round, a parallel drafter once. A
parallel drafter's acceptance is lower (it does not see its own earlier drafts), so which kind
wins depends on the node and on both acceptance curves: choose_drafting() prices each.

A node profile is data: a YAML file (eagle3_ray/plan/profiles/<name>.yaml, or any path) with the
verify compute time per number of tokens, the draft step time, the time of a k-token drafter
forward, the drafter's collectives per forward and the interconnect: α/β, or a measured
all-reduce time per message size (`interconnect.allreduce_us`, interpolated log-log; α/β is
the fallback when a profile has none). `eagle3-ray profile` measures one (the curve with several
GPUs); the packaged ones are derived from spec sheets or published measurements (see their
comments).
Acceptance comes from a training run, `bench quality` / `bench serve` JSON, a server's /metrics,
or a literal list; past the measured positions it is extrapolated conservatively and marked.

    eagle3-ray plan --acceptance 0.8,0.75,0.7,0.65 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --compare nvlink-8x-h100-kimi-k2.5 --out /tmp/plan          # CPU, a second
    eagle3-ray plan --acceptance 0.8,0.75,0.7 --parallel-acceptance 0.7,0.65,0.6 \\
        --profile pcie-8x-rtx-pro-6000-kimi-k2.5 --out /tmp/plan    # chain or parallel?
    eagle3-ray plan --sweep 0.5 0.6 0.7 0.8 0.9 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --compare pcie-8x-rtx-pro-6000-kimi-k2.5-allreduce-curve     # best depth vs acceptance
    eagle3-ray plan --sweep-kinds 0.5 0.6 0.7 0.8 0.9 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --out /tmp/plan                                 # chain vs parallel, collectives on/off
    eagle3-ray profile --max-tokens 9 --out /tmp/cpu.yaml              # measure this machine
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

from eagle3_ray.train import ttt
from eagle3_ray.train.draft import DRAFTING   # how a round drafts: k forwards, or one of k

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
EXTRAPOLATION_WINDOW = 3      # known positions averaged for the extrapolation base
EXTRAPOLATION_DECAY = 0.9     # each extrapolated position: base · decay^(distance past known)
# Collectives of one drafter forward when the drafter runs at the verifier's tensor-parallel
# degree (vLLM V1 and SGLang do; the profiles' comments cite the code): the vocab-parallel
# embedding, attention o_proj and MLP down_proj all-reduces, the lm_head logits gather.
DRAFT_COLLECTIVES_TP = 4
# A parallel drafter's acceptance relative to a chain's, from the per-position acceptance vLLM
# PR #32628 reports on HumanEval at k = 8 (P-EAGLE P0 63%, P1 38%; EAGLE-3 71%, 49%): position
# 0 x 63/71, each later position's conditional acceptance x (38/63) / (49/71). Used by
# sweep_drafting() to derive a parallel curve from a chain's.
PARALLEL_FIRST_RATIO = 63 / 71                    # 0.887
PARALLEL_REST_RATIO = (38 / 63) / (49 / 71)       # 0.874


# --- node profiles ---------------------------------------------------------------------------

@dataclass
class Interconnect:
    latency_us: float             # α: fixed cost of one all-reduce (µs)
    bandwidth_gbps: float         # BW: effective all-reduce bandwidth, GB/s (1e9 bytes/s)
    allreduces_per_forward: int   # N_ar: tensor-parallel all-reduces per verifier forward
    hidden_size: int              # H: an all-reduce message is tokens·H·B bytes
    bytes_per_elem: int           # B: bytes per activation element (2 = bf16)
    allreduce_us: dict[int, float] | None = None  # measured: message bytes -> µs of one
                                  # all-reduce on the profile's GPUs; used instead of α/β
                                  # when present (allreduce_curve_us)


@dataclass
class NodeProfile:
    name: str
    description: str              # what node, model, and how the numbers were obtained
    sources: list[str]            # spec sheets, model cards, measurements behind the numbers
    gpus: int                     # n: tensor-parallel degree of the verifier (1 = no comm)
    interconnect: Interconnect
    verify_ms: dict[int, float]   # tokens verified -> compute-only ms of one verifier forward
    draft_step_ms: float          # one chain drafter forward (one token), compute only
    draft_collectives: int = 0    # C: collectives per drafter forward (a drafter run tensor-
                                  # parallel over the GPUs: DRAFT_COLLECTIVES_TP; one GPU: 0).
                                  # Old profiles' `draft_allreduces` is read as this
    draft_parallel_ms: dict[int, float] | None = None  # query tokens k -> compute-only ms of
                                  # one drafter forward of k tokens after a cached context (a
                                  # parallel round); None: modelled flat at draft_step_ms
    simulated: bool = False       # True: interconnect borrowed from another node (a simulation)
    draft_layer: str = "llama"    # the drafter decoder layer the draft_* fields above price
    draft_layers: dict[str, dict] | None = None  # other layer shapes ("mla": one DeepSeek MLA
                                  # layer, vLLM's Eagle3DeepseekV3ForCausalLM): their own
                                  # draft_step_ms, draft_collectives, draft_parallel_ms
    _xs: list = field(default_factory=list, init=False, repr=False, compare=False)
    _ys: list = field(default_factory=list, init=False, repr=False, compare=False)
    _pxs: list = field(default_factory=list, init=False, repr=False, compare=False)
    _pys: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        self._xs = sorted(self.verify_ms)
        self._ys = [self.verify_ms[x] for x in self._xs]
        self._pxs = sorted(self.draft_parallel_ms or {})
        self._pys = [self.draft_parallel_ms[x] for x in self._pxs]


def _check(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


def _number(d: dict, key: str, where: str, kind=float, minimum: float = 0.0):
    _check(key in d, where, f"missing field '{key}'")
    v = d[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= minimum
    if kind is int:
        ok = ok and float(v).is_integer()
    _check(ok, where, f"field '{key}' must be {'an integer' if kind is int else 'a number'} "
                      f">= {minimum}, got {v!r}")
    return kind(v)


def _curve(c, where: str) -> dict[int, float] | None:
    """allreduce_us: None, or a mapping of >= 2 message sizes (bytes, integers >= 1) to µs."""
    if c is None:
        return None
    _check(isinstance(c, dict) and len(c) >= 2, where,
           "must be a mapping of at least 2 message sizes (bytes) to microseconds")
    out = {}
    for k, v in c.items():
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, where,
               f"message sizes must be integers (bytes) >= 1, got {k!r}")
        out[k] = _number(c, k, where, float, 1e-12)
    return dict(sorted(out.items()))


def _ms_table(t, where: str, what: str) -> dict[int, float]:
    """A non-empty mapping of token counts (integers >= 1) to ms (numbers > 0)."""
    _check(isinstance(t, dict) and t, where, f"field '{what}' must be a non-empty mapping "
                                             f"tokens -> ms")
    out = {}
    for k in t:
        _check(isinstance(k, int) and not isinstance(k, bool) and k >= 1, where,
               f"{what}: tokens must be integers >= 1, got {k!r}")
        out[k] = _number(t, k, f"{where}: {what}", float, 1e-12)
    return dict(sorted(out.items()))


def _draft_collectives(d: dict, where: str) -> int:
    """draft_collectives, or an old profile's draft_allreduces (the same count under its first
    name); 0 when neither is given; both must agree."""
    new = _number(d, "draft_collectives", where, int) if "draft_collectives" in d else None
    old = _number(d, "draft_allreduces", where, int) if "draft_allreduces" in d else None
    _check(new is None or old is None or new == old, where,
           f"draft_collectives ({new}) and its old name draft_allreduces ({old}) disagree")
    return new if new is not None else (old or 0)


def profile_from_dict(d: dict, where: str = "profile") -> NodeProfile:
    """A parsed YAML mapping -> NodeProfile, or ValueError naming `where` and the field."""
    _check(isinstance(d, dict), where, "a profile must be a YAML mapping")
    known = {f.name for f in dataclasses.fields(NodeProfile) if f.init} | {"draft_allreduces"}
    unknown = sorted(set(d) - known)
    _check(not unknown, where, f"unknown field(s) {unknown} (known: {sorted(known)})")
    _check("name" in d, where, "missing field 'name'")
    gpus = _number(d, "gpus", where, int, 1)
    _check("interconnect" in d, where, "missing field 'interconnect'")
    ic, w = d["interconnect"], f"{where}: interconnect"
    _check(isinstance(ic, dict), where, "field 'interconnect' must be a mapping")
    ic_known = {f.name for f in dataclasses.fields(Interconnect)}
    _check(not set(ic) - ic_known, w, f"unknown field(s) {sorted(set(ic) - ic_known)}")
    inter = Interconnect(
        latency_us=_number(ic, "latency_us", w),
        bandwidth_gbps=_number(ic, "bandwidth_gbps", w, float, 1e-9),
        allreduces_per_forward=_number(ic, "allreduces_per_forward", w, int),
        hidden_size=_number(ic, "hidden_size", w, int, 1),
        bytes_per_elem=_number(ic, "bytes_per_elem", w, int, 1),
        allreduce_us=_curve(ic.get("allreduce_us"), f"{w}: allreduce_us"))
    _check("verify_ms" in d, where, "missing field 'verify_ms'")
    verify_ms = _ms_table(d["verify_ms"], where, "verify_ms")
    par = d.get("draft_parallel_ms")
    sources = d.get("sources", [])
    _check(isinstance(sources, list) and all(isinstance(s, str) for s in sources), where,
           "field 'sources' must be a list of strings")
    return NodeProfile(
        name=str(d["name"]), description=str(d.get("description", "")), sources=sources,
        gpus=gpus, interconnect=inter, verify_ms=verify_ms,
        draft_step_ms=_number(d, "draft_step_ms", where, float, 1e-12),
        draft_collectives=_draft_collectives(d, where),
        draft_parallel_ms=None if par is None else _ms_table(par, where, "draft_parallel_ms"),
        simulated=bool(d.get("simulated", False)),
        draft_layer=str(d.get("draft_layer", "llama")), draft_layers=_draft_layers(d, where))


def _draft_layers(d: dict, where: str) -> dict[str, dict] | None:
    """A profile's `draft_layers`: {shape: {draft_step_ms, draft_collectives[,
    draft_parallel_ms]}}, each checked as the top-level fields are."""
    raw = d.get("draft_layers")
    if raw is None:
        return None
    _check(isinstance(raw, dict), where, "field 'draft_layers' must be a mapping")
    out = {}
    for shape, e in raw.items():
        w = f"{where}: draft_layers.{shape}"
        _check(isinstance(e, dict), w, "must be a mapping")
        par = e.get("draft_parallel_ms")
        out[str(shape)] = {
            "draft_step_ms": _number(e, "draft_step_ms", w, float, 1e-12),
            "draft_collectives": _number(e, "draft_collectives", w, int),
            "draft_parallel_ms": None if par is None else _ms_table(par, w, "draft_parallel_ms")}
    return out


def with_draft_layer(p: NodeProfile, layer: str | None) -> NodeProfile:
    """`p` pricing a drafter whose decoder layer is `layer` ("llama", "mla"; None: as is): an
    MLA layer reads other weights than a Llama one (q/kv LoRA projections, replicated across
    the tensor-parallel GPUs where the engines do not split them), so its forward costs
    differently; its collectives are counted in the profile too. Refuses a shape the profile
    does not price."""
    if layer is None or layer == p.draft_layer:
        return p
    entry = (p.draft_layers or {}).get(layer)
    if entry is None:
        raise ValueError(f"profile {p.name}: prices drafter layer {p.draft_layer!r} and "
                         f"{sorted(p.draft_layers or {})}, not {layer!r}: add draft_layers."
                         f"{layer} (draft_step_ms, draft_collectives) to it")
    others = {p.draft_layer: {"draft_step_ms": p.draft_step_ms,
                              "draft_collectives": p.draft_collectives,
                              "draft_parallel_ms": p.draft_parallel_ms},
              **{k: v for k, v in p.draft_layers.items() if k != layer}}
    return dataclasses.replace(p, draft_layer=layer, draft_layers=others, **entry)


def profile_path(name_or_path: str) -> str:
    """A path as is; a bare name -> the packaged eagle3_ray/plan/profiles/<name>.yaml."""
    if os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return name_or_path
    return os.path.join(PROFILE_DIR, f"{name_or_path}.yaml")


def packaged_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml"))


def load_profile(name_or_path: str) -> NodeProfile:
    import yaml
    path = profile_path(name_or_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"profile not found: {path} (packaged: {packaged_profiles()})")
    with open(path) as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    return profile_from_dict(d, path)


def profile_to_dict(p: NodeProfile) -> dict:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}
    d["interconnect"] = dataclasses.asdict(p.interconnect)
    if p.interconnect.allreduce_us is None:
        del d["interconnect"]["allreduce_us"]                 # α/β profiles stay as they were
    else:
        d["interconnect"]["allreduce_us"] = {int(k): float(v) for k, v in
                                             sorted(p.interconnect.allreduce_us.items())}
    d["verify_ms"] = {int(k): float(v) for k, v in sorted(p.verify_ms.items())}
    if p.draft_parallel_ms is None:
        del d["draft_parallel_ms"]                              # not measured: modelled flat
    else:
        d["draft_parallel_ms"] = {int(k): float(v) for k, v in sorted(p.draft_parallel_ms.items())}
    return d


def save_profile(profile: NodeProfile, path: str) -> None:
    import yaml
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(profile_to_dict(profile), f, sort_keys=False)


def with_interconnect(measured: NodeProfile, node: NodeProfile) -> NodeProfile:
    """`measured`'s compute times with `node`'s GPUs and interconnect, labelled a simulation:
    what this machine's verifier would cost if every forward also paid `node`'s all-reduces."""
    return dataclasses.replace(
        measured, name=f"{measured.name}+{node.name}-interconnect", simulated=True,
        gpus=node.gpus, interconnect=dataclasses.replace(node.interconnect),
        description=f"SIMULATION: compute of {measured.name}, interconnect of {node.name}",
        sources=measured.sources + [f"interconnect: {node.name}"] + node.sources)


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


def message_bytes(profile: NodeProfile, tokens: int) -> int:
    """Bytes of one all-reduce of a verifier forward over `tokens` tokens: tokens·H·B."""
    return tokens * profile.interconnect.hidden_size * profile.interconnect.bytes_per_elem


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


def draft_round_s(profile: NodeProfile, k: int, drafting: str = "chain") -> float:
    """A round's drafting at depth k: D_chain(k) = k·t_draft, or D_par(k) = t_par(k) +
    C·AR(k·H·B) (one forward of k tokens, its collectives once); 0 at depth 0."""
    if drafting == "chain":
        return k * draft_s(profile)
    if drafting != "parallel":
        raise ValueError(f"drafting must be one of {DRAFTING}, got {drafting!r}")
    return 0.0 if k == 0 else draft_parallel_compute_s(profile, k) + draft_comm_s(profile, k)


def draft_round_comm_s(profile: NodeProfile, k: int, drafting: str = "chain") -> float:
    """The collectives' part of draft_round_s: k·C·AR(H·B) (chain) or C·AR(k·H·B)."""
    if k == 0:
        return 0.0
    return k * draft_comm_s(profile, 1) if drafting == "chain" else draft_comm_s(profile, k)


def round_s(profile: NodeProfile, k: int, drafting: str = "chain") -> float:
    """One speculation round at depth k: its drafting + a verify of k+1 tokens."""
    return draft_round_s(profile, k, drafting) + verify_s(profile, k + 1)


def _ls_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def extend_acceptance(cond_acc: list[float], depth: int, window: int = EXTRAPOLATION_WINDOW,
                      decay: float = EXTRAPOLATION_DECAY) -> tuple[list[float], list[bool]]:
    """Conditional acceptance for positions 0..depth-1 -> (a, extrapolated flags).

    Positions past the m known ones get a_j = base · decay^(j − m + 1), base = min(last known,
    mean of the last `window` known): never above the last measured value and falling further
    the farther out it goes (a drafter degrades past the depth it was trained and measured at).
    """
    m = len(cond_acc)
    if depth <= m:
        return list(cond_acc[:depth]), [False] * depth
    if m == 0:
        raise ValueError("no measured acceptance to extrapolate from")
    if not 0 < decay < 1:
        raise ValueError(f"decay must be in (0, 1), got {decay}")
    last = cond_acc[-window:]
    base = min(cond_acc[-1], sum(last) / len(last))
    extra = [base * decay ** (j - m + 1) for j in range(m, depth)]
    return list(cond_acc) + extra, [False] * m + [True] * (depth - m)


def best_depth(cond_acc: list[float], profile: NodeProfile, max_depth: int | None = None,
               drafting: str = "chain") -> int:
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
        rate = tau / round_s(profile, k, drafting)
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
    are priced (a parallel drafter's round is one forward, draft_round_s)."""

    def __init__(self, profile: NodeProfile, prior: list[float], max_depth: int,
                 prior_rounds: float = 8.0, drafting: str = "chain"):
        if not prior:
            raise ValueError("DynamicDepth needs a prior acceptance for at least position 0")
        if drafting not in DRAFTING:
            raise ValueError(f"drafting must be one of {DRAFTING}, got {drafting!r}")
        self.drafting = drafting
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
        d = best_depth(self.cond_acc(), self.profile, self.max_depth, self.drafting)
        self.depths.append(d)
        return d


def plan(cond_acc: list[float], profile: NodeProfile, max_depth: int = 32,
         known_depth: int | None = None, train_costs: dict[int, float] | None = None,
         drafting: str = "chain") -> dict:
    """Per depth 0..max_depth: E[τ], round time (draft and its collectives / verify compute /
    comm), tokens/s, speedup, extrapolated; the best depth, the ttt_steps to train for it, the
    training cost of each ttt_steps choice (train_costs: ttt_steps -> seconds per step, from
    `bench train`), and a plain-words reason. `known_depth`: how many leading entries of
    cond_acc are measured (default: all); the rest is extrapolated. `drafting`: how the rounds
    draft ("chain" or "parallel", draft_round_s), and so what cond_acc is the acceptance of."""
    if drafting not in DRAFTING:
        raise ValueError(f"drafting must be one of {DRAFTING}, got {drafting!r}")
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
        r = round_s(profile, k, drafting)
        forwards = k if drafting == "chain" else min(k, 1)     # drafter forwards per round
        rows.append({"depth": k, "accept_len": taus[k], "round_ms": r * 1e3,
                     "draft_ms": draft_round_s(profile, k, drafting) * 1e3,
                     "draft_comm_ms": draft_round_comm_s(profile, k, drafting) * 1e3,
                     "draft_collectives": forwards * profile.draft_collectives,
                     "verify_compute_ms": compute_s(profile, k + 1) * 1e3,
                     "comm_ms": comm_s(profile, k + 1) * 1e3,
                     "tokens_per_s": taus[k] / r, "speedup": taus[k] * r0 / r,
                     "extrapolated": k > known})
    best = best_depth(acc, profile, max_depth, drafting)
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
    if drafting == "parallel" and not profile.draft_parallel_ms:
        result["warnings"].append(
            f"{profile.name} has no draft_parallel_ms: a k-token drafter forward is modelled "
            f"flat at draft_step_ms ({profile.draft_step_ms:g} ms); `eagle3-ray profile` "
            f"measures it")
    elif drafting == "parallel" and max_depth > max(profile.draft_parallel_ms):
        result["warnings"].append(
            f"draft_parallel_ms is measured up to {max(profile.draft_parallel_ms)} tokens; "
            f"deeper parallel forwards are extrapolated linearly")
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


def allreduce_model(profile: NodeProfile) -> str:
    """How the profile prices one all-reduce, in words."""
    ic = profile.interconnect
    if profile.gpus <= 1 or not ic.allreduces_per_forward:
        return "none (one device)"
    if ic.allreduce_us:
        pts = ", ".join(f"{_kb(b)}: {us:g} us" for b, us in sorted(ic.allreduce_us.items()))
        return f"measured curve ({pts}; log-log between points)"
    return f"alpha/beta ({ic.latency_us:g} us + bytes at {ic.bandwidth_gbps:g} GB/s)"


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:g} KB" if nbytes >= 1024 else f"{nbytes:g} B"


def why(result: dict, profile: NodeProfile) -> str:
    """A plain-words reason for the best depth: where a round's time goes at depth 0 and at the
    best depth, and what one more draft position would buy."""
    rows, b = result["depths"], result["best_depth"]
    r0, rb = rows[0], rows[b]
    ic = profile.interconnect
    one = (f"{_allreduce_s(profile, 1) * 1e6:.0f} us each for {_kb(message_bytes(profile, 1))} "
           f"(measured curve)" if ic.allreduce_us else f"{ic.latency_us:g} us latency")
    lines = [f"{profile.name}{' (SIMULATED interconnect)' if profile.simulated else ''}: "
             f"a depth-0 round costs {r0['round_ms']:.2f} ms, {r0['comm_ms'] / r0['round_ms']:.0%} "
             f"of it communication ({ic.allreduces_per_forward} all-reduces x "
             f"{one} on {profile.gpus} GPUs)."]
    if b and rb["draft_collectives"]:
        how = (f"one forward of {b} tokens" if result.get("drafting") == "parallel" else
               f"{b} drafter forward{'s' if b > 1 else ''}")
        lines.append(f"Drafting ({result.get('drafting', 'chain')}, {how}) pays "
                     f"{rb['draft_collectives']} collectives ({rb['draft_comm_ms']:.2f} ms of its "
                     f"{rb['draft_ms']:.2f} ms) at the best depth: the drafter runs "
                     f"tensor-parallel, {profile.draft_collectives} per forward.")
    if b == 0:
        r1 = rows[1]
        lines.append(f"Depth 1 would cost {r1['round_ms']:.2f} ms for {r1['accept_len']:.2f} "
                     f"tokens: worse than plain decoding.")
        return " ".join(lines)
    lines.append(
        f"At the best depth {b} a round costs {rb['round_ms']:.2f} ms (draft "
        f"{rb['draft_ms']:.2f}, verify compute {rb['verify_compute_ms']:.2f}, communication "
        f"{rb['comm_ms']:.2f} = {rb['comm_ms'] / rb['round_ms']:.0%}) and yields "
        f"{rb['accept_len']:.2f} tokens: {rb['tokens_per_s']:.0f} tokens/s, "
        f"x{rb['speedup']:.2f} over plain decoding.")
    lines.append("The fixed cost per round (latency, weights read once) is shared by more "
                 "tokens the deeper the round; it stops paying where one more position adds "
                 "less than the round's rate.")
    if b + 1 < len(rows):
        nxt = rows[b + 1]
        lines.append(f"Depth {b + 1} would add {nxt['round_ms'] - rb['round_ms']:.2f} ms "
                     f"({(nxt['round_ms'] - rb['round_ms']) / rb['round_ms']:.0%}) for "
                     f"{nxt['accept_len'] - rb['accept_len']:.3f} expected tokens "
                     f"({(nxt['accept_len'] - rb['accept_len']) / rb['accept_len']:.0%}).")
    return " ".join(lines)


def compare_text(a: dict, b: dict) -> str:
    """Why two nodes choose different depths, from their two plan() results."""
    ra0, rb0 = a["depths"][0], b["depths"][0]
    return (f"{a['profile']} serves depth {a['best_depth']} (x{a['best']['speedup']:.2f}), "
            f"{b['profile']} depth {b['best_depth']} (x{b['best']['speedup']:.2f}). A depth-0 "
            f"round is {ra0['comm_ms'] / ra0['round_ms']:.0%} communication on {a['profile']} "
            f"({ra0['comm_ms']:.2f} of {ra0['round_ms']:.2f} ms) vs "
            f"{rb0['comm_ms'] / rb0['round_ms']:.0%} on {b['profile']} "
            f"({rb0['comm_ms']:.2f} of {rb0['round_ms']:.2f} ms), and one more verified token "
            f"adds {a['depths'][1]['comm_ms'] - ra0['comm_ms']:.2f} vs "
            f"{b['depths'][1]['comm_ms'] - rb0['comm_ms']:.2f} ms of communication: the larger "
            f"the fixed cost per round, the more tokens per round are worth drafting; the more "
            f"each token adds, the fewer.")


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


def format_sweep(result: dict) -> str:
    """The sweep as a Markdown table: acceptance | per profile best depth, speedup."""
    names = result["profiles"]
    head = "| a (every position) | " + " | ".join(
        f"best depth, {n} | speedup" for n in names) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names))]
    for row in result["rows"]:
        cells = [f"{row['acceptance']:g}"]
        for n in names:
            cells += [str(row[n]["best_depth"]), f"x{row[n]['speedup']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- chain or parallel drafting ----------------------------------------------------------------

def kind_summary(result: dict) -> dict:
    """The best row of a plan() result, the fields a drafting choice is argued from."""
    b = result["best"]
    return {"drafting": result["drafting"], "best_depth": result["best_depth"],
            "speedup": b["speedup"], "tokens_per_s": b["tokens_per_s"],
            "accept_len": b["accept_len"], "round_ms": b["round_ms"], "draft_ms": b["draft_ms"],
            "draft_comm_ms": b["draft_comm_ms"], "draft_collectives": b["draft_collectives"]}


def choose_drafting(profile: NodeProfile, acceptance: dict[str, tuple[list[float], int, str]],
                    max_depth: int = 32, train_costs: dict[int, float] | None = None) -> dict:
    """Chain or parallel drafting, and the depth, on `profile`.

    acceptance: kind -> (cond_acc, known depth, source), for the kinds whose acceptance was
    measured (a chain drafter's, a parallel drafter's, or both). Each given kind is planned
    (plan(), its own acceptance and draft_round_s) and the one with the higher tokens/s at its
    best depth is chosen (a tie: the chain). With one kind only, the other kind's plan at the
    same acceptance is added as a what-if: what its drafting would cost, not a choice (a
    parallel drafter does not reach a chain's acceptance, nor the reverse).
    -> {"choice", "plans": {kind: plan()}, "kinds": {kind: summary}, "what_if": {kind: plan()}
    (one kind given), "attribution" (both given: _attribution), "why"}."""
    unknown = sorted(set(acceptance) - set(DRAFTING))
    if not acceptance or unknown:
        raise ValueError(f"acceptance must be given for some of {DRAFTING}, got "
                         f"{sorted(acceptance)}")
    plans = {kind: plan(cond, profile, max_depth, known, train_costs, drafting=kind)
             for kind, (cond, known, _) in acceptance.items()}
    for kind, (_, _, source) in acceptance.items():
        plans[kind]["acceptance"]["source"] = source
    kinds = {kind: dict(kind_summary(r), source=acceptance[kind][2]) for kind, r in plans.items()}
    choice = max(plans, key=lambda k: (plans[k]["best"]["tokens_per_s"], k == "chain"))
    out = {"choice": choice, "plans": plans, "kinds": kinds, "what_if": {}, "attribution": None}
    if len(plans) == 2:
        out["attribution"] = _attribution(profile, acceptance, choice,
                                          next(k for k in plans if k != choice), max_depth)
    else:
        other = next(k for k in DRAFTING if k != choice)
        cond, known, _ = acceptance[choice]
        w = plan(cond, profile, max_depth, known, train_costs, drafting=other)
        w["acceptance"]["source"] = (f"WHAT-IF: {choice}'s acceptance ({acceptance[choice][2]}) "
                                     f"priced as {other} drafting")
        out["what_if"][other] = w
    out["why"] = why_drafting(out)
    return out


def _attribution(profile: NodeProfile, acceptance: dict, win: str, lose: str,
                 max_depth: int) -> dict:
    """What decided between the kinds: each kind's best tokens/s with the acceptance of one and
    the drafting (cost) of the other. acceptance_gain = the winner's acceptance drafted the
    loser's way, cost_gain = the loser's acceptance drafted the winner's way, both over the
    loser's own; the larger one dominated ('tie': neither moves it, e.g. depth 0 on both)."""
    def rate(acc_kind: str, cost_kind: str) -> float:
        cond, known, _ = acceptance[acc_kind]
        return plan(cond, profile, max_depth, known, drafting=cost_kind)["best"]["tokens_per_s"]
    base = rate(lose, lose)
    acc_gain, cost_gain = rate(win, lose) / base, rate(lose, win) / base
    if rate(win, win) <= base * (1 + 1e-9):
        dom = "tie"
    else:
        dom = "acceptance" if acc_gain >= cost_gain else "cost"
    return {"dominated": dom, "acceptance_gain": acc_gain, "cost_gain": cost_gain}


def _drafting_text(k: dict) -> str:
    forwards = (f"{k['best_depth']} forward{'s' if k['best_depth'] > 1 else ''}"
                if k["drafting"] == "chain" else
                f"1 forward of {k['best_depth']} tokens") if k["best_depth"] else "no drafting"
    return (f"{k['drafting']}: drafting {k['draft_ms']:.2f} ms ({forwards}, "
            f"{k['draft_collectives']} collectives = {k['draft_comm_ms']:.2f} ms)")


def why_drafting(choice: dict) -> str:
    """The reason for choose_drafting()'s choice, in plain words: each kind's best depth and
    speedup, and whether acceptance or drafting cost decided (_attribution)."""
    kinds, win = choice["kinds"], choice["kinds"][choice["choice"]]
    head = (f"{win['drafting']} at depth {win['best_depth']} (x{win['speedup']:.2f}, "
            f"E[tau] {win['accept_len']:.2f} in {win['round_ms']:.2f} ms)")
    if len(kinds) == 1:
        other, w = next(iter(choice["what_if"].items()))
        ws = kind_summary(w)
        return (f"Only {win['drafting']} acceptance given: {head}; {_drafting_text(win)}. "
                f"WHAT-IF, not a choice: the same acceptance drafted {other} would serve depth "
                f"{ws['best_depth']} (x{ws['speedup']:.2f}; {_drafting_text(ws)}); a "
                f"{other} drafter's own acceptance would differ (a parallel drafter's is lower: "
                f"it does not see its own earlier drafts). Give both to choose.")
    lose = next(k for n, k in kinds.items() if n != win["drafting"])
    att = choice["attribution"]
    if att["dominated"] == "tie":
        because = "a tie: the same tokens/s either way (a tie goes to the chain)"
    else:
        because = (f"{att['dominated']} dominated: the {win['drafting']} drafter's acceptance "
                   f"drafted as a {lose['drafting']} would give x{att['acceptance_gain']:.2f} "
                   f"the {lose['drafting']}'s tokens/s, {win['drafting']} drafting at the "
                   f"{lose['drafting']}'s acceptance x{att['cost_gain']:.2f}")
    return (f"{head} beats {lose['drafting']} at depth {lose['best_depth']} "
            f"(x{lose['speedup']:.2f}, E[tau] {lose['accept_len']:.2f} in "
            f"{lose['round_ms']:.2f} ms): {because}. {_drafting_text(win)}; "
            f"{_drafting_text(lose)}.")


def parallel_from_chain(cond_acc: list[float], first: float = PARALLEL_FIRST_RATIO,
                        rest: float = PARALLEL_REST_RATIO) -> list[float]:
    """A parallel drafter's conditional acceptance derived from a chain's: position 0 x first,
    every later position x rest (defaults: the P0/P1 ratios of PARALLEL_*_RATIO)."""
    return [min(1.0, a * (first if j == 0 else rest)) for j, a in enumerate(cond_acc)]


def sweep_drafting(levels: list[float], profiles: list[NodeProfile], max_depth: int = 32,
                   first: float = PARALLEL_FIRST_RATIO, rest: float = PARALLEL_REST_RATIO) -> dict:
    """Chain against parallel drafting over a family of acceptance curves: for each level a,
    the chain's conditional acceptance is a at every position, the parallel drafter's is
    parallel_from_chain() of it; on each profile, once with its draft_collectives and once
    with 0 (a drafter whose collectives were free). Per row: each kind's best depth and
    speedup, which kind choose_drafting() picks and what decided it, and the parallel kind at
    the chain's own acceptance (the cost difference alone)."""
    if not levels or not all(0.0 <= a <= 1.0 for a in levels):
        raise ValueError(f"--sweep-kinds levels must lie in [0, 1], got {levels}")
    if not (0 < first <= 1.5 and 0 < rest <= 1.5):
        raise ValueError(f"parallel acceptance ratios must be in (0, 1.5], got {first}, {rest}")
    rows = []
    for p in profiles:
        for c in sorted({p.draft_collectives, 0}, reverse=True):
            q = dataclasses.replace(p, draft_collectives=c)
            for a in levels:
                chain = [a] * max_depth
                par = parallel_from_chain(chain, first, rest)
                ch = choose_drafting(q, {"chain": (chain, max_depth, f"a = {a:g}"),
                                         "parallel": (par, max_depth, "derived")}, max_depth)
                same = kind_summary(plan(chain, q, max_depth, drafting="parallel"))
                rows.append({"profile": p.name, "acceptance": a, "draft_collectives": c,
                             "chain": ch["kinds"]["chain"], "parallel": ch["kinds"]["parallel"],
                             "pick": ch["choice"],
                             "dominated": ch["attribution"]["dominated"],
                             "acceptance_gain": ch["attribution"]["acceptance_gain"],
                             "cost_gain": ch["attribution"]["cost_gain"],
                             "parallel_at_chain_acceptance": same})
    return {"kind": "sweep_drafting", "max_depth": max_depth,
            "profiles": [p.name for p in profiles],
            "parallel_acceptance": {
                "first_ratio": first, "rest_ratio": rest,
                "rule": "parallel a_0 = first x chain a_0; a_j = rest x chain a_j for j >= 1",
                "source": "vLLM PR #32628, HumanEval, k = 8: P-EAGLE P0 63%, P1 38% against "
                          "EAGLE-3 71%, 49% (the defaults)"},
            "allreduce_model": {p.name: allreduce_model(p) for p in profiles},
            "draft_step_ms": {p.name: p.draft_step_ms for p in profiles},
            "draft_parallel_ms": {p.name: p.draft_parallel_ms for p in profiles},
            "rows": rows}


def format_sweep_drafting(result: dict) -> str:
    """sweep_drafting() as Markdown: one table per profile."""
    out = []
    for name in result["profiles"]:
        out += [f"{name} ({result['allreduce_model'][name]}):", "",
                "| a (chain) | draft collectives / forward | chain: best depth | speedup | "
                "parallel: best depth | speedup | plan picks | decided by (acceptance alone, "
                "drafting alone) | parallel at the chain's acceptance: depth | speedup |",
                "|" + "---|" * 10]
        for r in (r for r in result["rows"] if r["profile"] == name):
            ch, pa, same = r["chain"], r["parallel"], r["parallel_at_chain_acceptance"]
            out.append(f"| {r['acceptance']:g} | {r['draft_collectives']} | {ch['best_depth']} | "
                       f"x{ch['speedup']:.2f} | {pa['best_depth']} | x{pa['speedup']:.2f} | "
                       f"{r['pick']} | {r['dominated']} (x{r['acceptance_gain']:.2f}, "
                       f"x{r['cost_gain']:.2f}) | {same['best_depth']} | "
                       f"x{same['speedup']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip()


def drafting_of(source: str) -> str | None:
    """How the drafter behind an acceptance source drafts: a drafter or training run dir says
    so in config.json's eagle3_ray.draft_config, field `drafting`; one written before the
    field existed is a chain. None for any other source (a JSON, a URL, a list): the flag it
    was given with decides."""
    if not os.path.isdir(source):
        return None
    for d in (source, os.path.join(source, "drafter")):
        try:
            j = json.load(open(os.path.join(d, "config.json")))
        except (OSError, json.JSONDecodeError):
            continue
        dc = (j.get("eagle3_ray") or {}).get("draft_config") if isinstance(j, dict) else None
        if isinstance(dc, dict):
            return dc.get("drafting", "chain")
    return "chain"


# --- acceptance sources ----------------------------------------------------------------------

def cond_from_counts(drafted: list[float], accepted: list[float]) -> list[float]:
    """Per-position counts (rounds that drafted / accepted position k) -> a_k = p_k / p_{k−1},
    p_k = accepted_k / drafted_k (rounds of any depth that drafted k). Stops at the first
    position no round drafted."""
    cond, prev = [], 1.0
    for d, a in zip(drafted, accepted):
        if d <= 0:
            break
        p = a / d
        cond.append(min(1.0, p / prev) if prev > 0 else 0.0)
        prev = p
    return cond


def _cond_from_accept_lengths(taus: dict[int, float]) -> list[float]:
    """E[τ] measured at a few depths -> a_0..a_{D−1}: between consecutive measured depths
    d1 < d2, one constant a with p_{d1−1}·(a + a² + … + a^(d2−d1)) = τ(d2) − τ(d1)."""
    cond, p_prev, d1, t1 = [], 1.0, 0, 1.0
    for d2 in sorted(taus):
        n, target = d2 - d1, taus[d2] - t1
        if n <= 0:
            continue
        if p_prev <= 0 or target <= 0:
            a = 0.0
        elif target >= p_prev * n:
            a = 1.0
        else:
            lo, hi = 0.0, 1.0
            for _ in range(60):                         # bisection: the sum grows with a
                mid = (lo + hi) / 2
                if p_prev * sum(mid ** i for i in range(1, n + 1)) < target:
                    lo = mid
                else:
                    hi = mid
            a = (lo + hi) / 2
        cond += [a] * n
        p_prev *= a ** n
        d1, t1 = d2, max(t1, taus[d2])
    return cond


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text (a server's /metrics) -> {'name{labels}': value}. Lives here, with its
    reader, so serve/app.py imports it from the planner and not the other way round."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _from_metrics_text(text: str, where: str) -> tuple[list[float], int, str]:
    m = parse_metrics(text)
    pat = re.compile(r'eagle3_ray_(drafted|accepted)_at_position_total\{position="(\d+)"\}')
    counts: dict[str, dict[int, float]] = {"drafted": {}, "accepted": {}}
    for key, v in m.items():
        hit = pat.fullmatch(key)
        if hit:
            counts[hit[1]][int(hit[2])] = v
    if not counts["drafted"]:
        raise ValueError(f"{where}: no eagle3_ray_drafted_at_position_total samples (no "
                         f"speculative rounds served yet, or not an eagle3-ray server)")
    n = max(counts["drafted"]) + 1
    cond = cond_from_counts([counts["drafted"].get(k, 0) for k in range(n)],
                             [counts["accepted"].get(k, 0) for k in range(n)])
    rounds = counts["drafted"].get(0, 0)
    return cond, len(cond), f"{where}: served per-position acceptance ({rounds:.0f} rounds)"


def _from_run_dir(path: str) -> tuple[list[float], int, str]:
    def cond_of(m: dict, prefix: str) -> list[float]:
        out, k = [], 0
        while f"{prefix}cond_acc_{k}" in m:
            out.append(float(m[f"{prefix}cond_acc_{k}"]))
            k += 1
        return out

    history = []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        history.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{metrics}: line {i} is not JSON: {e}") from None
    for m in reversed(history):
        if "eval/cond_acc_0" in m:
            cond = cond_of(m, "eval/")
            return cond, len(cond), f"{metrics}: held-out eval at step {m.get('step')}"
    for meta in (os.path.join(path, "drafter", "meta.json"), os.path.join(path, "meta.json")):
        if os.path.isfile(meta):
            final = json.load(open(meta)).get("final_metrics") or {}
            for prefix in ("eval/", "train/"):
                cond = cond_of(final, prefix)
                if cond:
                    return cond, len(cond), f"{meta}: final_metrics ({prefix.rstrip('/')})"
    for m in reversed(history):
        if "train/cond_acc_0" in m:
            cond = cond_of(m, "train/")
            return cond, len(cond), (f"{metrics}: TRAINING metrics at step {m.get('step')} "
                                     f"(no held-out eval: optimistic)")
    raise ValueError(f"{path}: no cond_acc_k in metrics.jsonl or drafter/meta.json "
                     f"(not a training run or drafter dir?)")


def _from_json(path: str, ttt_steps: int | None,
               drafting: str = "chain") -> tuple[list[float], int, str]:
    try:
        r = json.load(open(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    kind = r.get("bench") if isinstance(r, dict) else None
    if kind == "quality":
        runs = r["runs"]
        key = str(ttt_steps) if ttt_steps is not None else max(runs, key=int)
        if key not in runs:
            raise ValueError(f"{path}: no run with ttt_steps={ttt_steps} "
                             f"(have {sorted(runs, key=int)})")
        cond = [float(a) for a in runs[key]["cond_acc"]]
        return cond, len(cond), (f"{path}: bench quality, drafter ttt_steps={key}, held-out "
                                 f"positions 0..{len(cond) - 1}")
    if kind == "serve" and drafting == "parallel":     # bench serve --parallel-drafter's arms
        cond = ((r.get("planner") or {}).get("parallel") or {}).get("cond_acc")
        if not cond:
            raise ValueError(f"{path}: a bench serve run without parallel arms "
                             "(--parallel-drafter): no parallel drafter's acceptance in it")
        return [float(a) for a in cond], len(cond), (
            f"{path}: bench serve, per-position acceptance of its parallel{{d}} arms")
    if kind == "serve" and (r.get("planner") or {}).get("cond_acc"):
        cond = [float(a) for a in r["planner"]["cond_acc"]]
        return cond, len(cond), (f"{path}: bench serve, per-position acceptance counted over "
                                 f"all its fixed-depth runs")
    if kind == "serve":
        runs = sorted((x for x in r["runs"].values() if isinstance(x["depth"], int)),
                      key=lambda x: x["depth"])
        counted = [x for x in runs if x.get("accepted_per_position") and x.get("rounds")]
        if counted:
            x = counted[-1]
            accepted = x["accepted_per_position"]
            drafted = x.get("drafted_per_position") or [x["rounds"]] * len(accepted)
            cond = cond_from_counts(drafted, accepted)
            return cond, len(cond), (f"{path}: bench serve, per-position accepted counts of the "
                                     f"depth-{x['depth']} run ({x['rounds']} rounds)")
        taus = {x["depth"]: float(x["acceptance_length"]) for x in runs if x["depth"] > 0}
        if not taus:
            raise ValueError(f"{path}: bench serve result has no depth > 0")
        cond = _cond_from_accept_lengths(taus)
        return cond, len(cond), (f"{path}: bench serve, acceptance length at depths "
                                 f"{sorted(taus)} (piecewise-constant fit between them)")
    if kind == "train":
        raise ValueError(f"{path}: a bench train result holds step times, not acceptance "
                         f"(pass it as --bench-train)")
    raise ValueError(f"{path}: not a bench quality or bench serve result (\"bench\": {kind!r})")


def acceptance_from(source: str, ttt_steps: int | None = None,
                    drafting: str = "chain") -> tuple[list[float], int, str]:
    """-> (conditional acceptance per position, known depth, description) from
      a training run dir or drafter dir     latest eval/cond_acc_k of metrics.jsonl, else
                                            drafter/meta.json final_metrics
      a bench quality JSON                  the run with `ttt_steps` (default: the deepest)
      a bench serve JSON                    per-position counts if present, else a fit to the
                                            acceptance length at each depth (drafting
                                            "parallel": its --parallel-drafter arms' counts)
      http(s)://host:port[/metrics]         a running eagle3-ray server's Prometheus counters
      "0.8,0.75,0.7"                        a literal list."""
    literal = re.fullmatch(r"\s*[0-9.eE+-]+(\s*,\s*[0-9.eE+-]+)*\s*,?\s*", source)
    if literal and not os.path.exists(source):
        try:
            cond = [float(x) for x in source.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"acceptance list {source!r}: not numbers") from None
        return cond, len(cond), "given list"
    if source.startswith(("http://", "https://")):
        import requests
        url = source if source.rstrip("/").endswith("/metrics") else source.rstrip("/") + "/metrics"
        try:
            resp = requests.get(url, timeout=10)
            resp.raise_for_status()
        except requests.RequestException as e:
            raise ValueError(f"{url}: could not read metrics: {e}") from None
        return _from_metrics_text(resp.text, url)
    if os.path.isdir(source):
        return _from_run_dir(source)
    if os.path.isfile(source):
        return _from_json(source, ttt_steps, drafting)
    raise FileNotFoundError(f"acceptance source not found: {source} (a training run dir, a "
                            f"bench quality/serve JSON, an http(s) URL of a server, or a list "
                            f"like 0.8,0.7)")


def train_costs_from(path: str) -> dict[int, float]:
    """A `bench train` JSON -> {ttt_steps: seconds per optimizer step}."""
    try:
        r = json.load(open(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(r, dict) or r.get("bench") != "train":
        raise ValueError(f"{path}: not a bench train result (expected \"bench\": \"train\")")
    return {int(x["ttt_steps"]): float(x["step_s"]) for x in r["results"]}


# --- output ----------------------------------------------------------------------------------

def format_table(result: dict, compare: dict | None = None) -> str:
    head = (f"{'depth':>5} {'E[tau]':>7} {'round ms':>9} {'draft ms':>8} {'comm %':>6} "
            f"{'tok/s':>8} {'speedup':>7}")
    if compare:
        head += f" | {'tok/s':>8} {'speedup':>7}   ({compare['profile']})"
    lines = [f"plan for {result['profile']}, {result.get('drafting', 'chain')} drafting  "
             f"(* best, ~ extrapolated acceptance; comm %: the verify's and the drafter's "
             f"collectives)", head]
    for i, r in enumerate(result["depths"]):
        mark = ("*" if i == result["best_depth"] else " ") + ("~" if r["extrapolated"] else " ")
        comm = (r["comm_ms"] + r.get("draft_comm_ms", 0.0)) / r["round_ms"]
        line = (f"{r['depth']:>5} {r['accept_len']:>7.2f} {r['round_ms']:>9.2f} "
                f"{r['draft_ms']:>8.2f} {comm:>6.0%} {r['tokens_per_s']:>8.1f} "
                f"{r['speedup']:>7.2f}{mark}")
        if compare:
            c = compare["depths"][i]
            cm = "*" if i == compare["best_depth"] else " "
            line += f" | {c['tokens_per_s']:>8.1f} {c['speedup']:>7.2f}{cm}"
        lines.append(line)
    return "\n".join(lines)


def plot_plan(result: dict, path: str, compare: dict | None = None,
              other_kind: dict | None = None) -> None:
    """Speedup vs depth (best marked, extrapolated acceptance shaded; a second profile dashed,
    the other drafting kind dotted) and the round-time breakdown of the first profile."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    known = result["acceptance"]["known_depth"]
    for res, style, color in ((result, "-", "#37a"), (compare, "--", "#a52"),
                              (other_kind, ":", "#6a3")):
        if not res:
            continue
        ds = [r["depth"] for r in res["depths"]]
        label = (f"{res['profile']}{' (simulated)' if res.get('simulated') else ''}, "
                 f"{res.get('drafting', 'chain')}")
        if res is other_kind and "WHAT-IF" in str(res["acceptance"].get("source", "")):
            label += " (what-if: same acceptance)"
        a1.plot(ds, [r["speedup"] for r in res["depths"]], style, color=color, marker="o", ms=3,
                label=label)
        b = res["best"]
        a1.plot([b["depth"]], [b["speedup"]], "*", color=color, ms=14,
                label=f"best depth {b['depth']}: x{b['speedup']:.2f}")
    max_d = result["max_depth"]
    if known < max_d:
        a1.axvspan(known + 0.5, max_d + 0.5, color="#ccc", alpha=0.4,
                   label=f"acceptance extrapolated (> depth {known})")
    a1.axhline(1.0, color="gray", lw=0.8)
    a1.set_xlabel("speculation depth"), a1.set_ylabel("predicted speedup over depth 0")
    a1.set_title("predicted speedup")
    rows = result["depths"]
    ds = [r["depth"] for r in rows]
    a2.stackplot(ds, [r["draft_ms"] - r["draft_comm_ms"] for r in rows],
                 [r["draft_comm_ms"] for r in rows], [r["verify_compute_ms"] for r in rows],
                 [r["comm_ms"] for r in rows],
                 labels=["drafter compute", "drafter collectives", "verify compute",
                         "verify communication"],
                 colors=["#9c6", "#cc6", "#69c", "#e96"], alpha=0.85)
    if compare:
        a2.plot(ds, [r["round_ms"] for r in compare["depths"]], "--", color="#a52",
                label=f"round total, {compare['profile']}")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("ms per round")
    a2.set_title(f"round time, {result['profile']}, {result.get('drafting', 'chain')}")
    for a in (a1, a2):
        a.grid(alpha=0.3), a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- measuring this machine ------------------------------------------------------------------

# Verify sizes whose all-reduce `profile` times: depths 0, 1, 2, 4, 8, 16, 32.
CURVE_TOKENS = (1, 2, 3, 5, 9, 17, 33)


def _allreduce_worker(rank: int, world: int, sizes: list[int], port: int, out: str,
                      backend: str, iters: int) -> None:
    import time
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    dtype = torch.bfloat16 if cuda else torch.float32            # gloo: fp32 sums
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype,
                       device="cuda" if cuda else "cpu")          # [bytes / itemsize]
        for _ in range(max(5, iters // 10)):                      # warm-up
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        res[nbytes] = (time.perf_counter() - t0) / iters * 1e6    # µs per all-reduce
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def measure_allreduce_curve(procs: int, sizes, backend: str = "nccl",
                            iters: int = 200) -> dict[int, float]:
    """{message bytes: µs of one all-reduce} across `procs` spawned processes: NCCL with one
    GPU each (bf16), or gloo between CPU processes (fp32; how the tests run this code)."""
    import socket
    import tempfile
    import torch.multiprocessing as mp
    sizes = sorted({int(b) for b in sizes})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "allreduce.json")
        mp.spawn(_allreduce_worker, args=(procs, sizes, port, out, backend, iters),
                 nprocs=procs, join=True)
        return {int(k): round(v, 3) for k, v in json.load(open(out)).items()}


def fit_alpha_beta(curve: dict[int, float], gpus: int) -> tuple[float, float]:
    """(α µs, BW GB/s) of t = α + 2(n−1)/n · bytes / BW fitted to a curve by least squares:
    the fallback a profile keeps next to its curve. A curve that does not grow with the
    message (noise) gets α = its smallest time and BW as if its largest time were transfer.
    Both to 4 significant digits (a slow, noisy link's BW is far below 0.001 GB/s)."""
    c = 2 * (gpus - 1) / gpus
    xs, ys = [c * b for b in curve], list(curve.values())                 # bytes, µs
    slope = _ls_slope(xs, ys)                                              # µs/B
    if slope <= 0:
        alpha, bw = min(ys), max(xs) / (max(ys) * 1e-6) / 1e9
    else:
        alpha = max(0.0, sum(ys) / len(ys) - slope * sum(xs) / len(xs))
        bw = 1e6 / slope / 1e9
    return float(f"{alpha:.4g}"), float(f"{bw:.4g}")


def add_allreduce_curve(profile: NodeProfile, procs: int, allreduces_per_forward: int,
                        backend: str = "nccl", iters: int = 200) -> NodeProfile:
    """`profile` on `procs` devices: its all-reduce curve measured at the message sizes of
    verifies of CURVE_TOKENS tokens (tokens·H·B bytes), α/β fitted to it as the fallback, and
    `allreduces_per_forward` all-reduces per verifier forward."""
    sizes = [message_bytes(profile, t) for t in CURVE_TOKENS]
    curve = measure_allreduce_curve(procs, sizes, backend, iters)
    alpha, bw = fit_alpha_beta(curve, procs)
    return dataclasses.replace(
        profile, gpus=procs, interconnect=dataclasses.replace(
            profile.interconnect, latency_us=alpha, bandwidth_gbps=bw,
            allreduces_per_forward=allreduces_per_forward, allreduce_us=curve))


def monotone_curve(verify_ms: dict[int, float]) -> dict[int, float]:
    """The least-squares non-decreasing fit of a measured verify curve (isotonic regression,
    pool adjacent violators): verifying more tokens never costs less, so a point below an
    earlier one is noise, and it is averaged with its neighbours instead of making the deeper
    depths look free. A curve that already rises is returned as it is; steps (a kernel switch
    between 2 and 3 rows) are kept, which a fitted line or hinge would smooth away (measured:
    docs/benchmarks.md, "Verify cost")."""
    blocks: list[list[float]] = []                       # [sum, count] of pooled points
    for k in sorted(verify_ms):
        blocks.append([verify_ms[k], 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    ys = [total / n for total, n in blocks for _ in range(n)]
    return dict(zip(sorted(verify_ms), ys))


def single_device_profile(name: str, verify_ms: dict[int, float], draft_ms: float, config,
                          dtype=None, description: str = "",
                          draft_parallel_ms: dict[int, float] | None = None) -> NodeProfile:
    """Measured times of one device (no interconnect, no drafter collectives) -> a NodeProfile,
    its verify curve and k-token drafter forward times made non-decreasing (monotone_curve)."""
    import time
    import torch
    itemsize = dtype.itemsize if dtype is not None else 2
    return NodeProfile(
        name=name, description=description or f"measured: {name}",
        sources=[f"measured {time.strftime('%Y-%m-%d')} with torch {torch.__version__}"],
        gpus=1, interconnect=Interconnect(latency_us=0.0, bandwidth_gbps=1.0,
                                          allreduces_per_forward=0,
                                          hidden_size=config.hidden_size, bytes_per_elem=itemsize),
        verify_ms={k: round(v, 4) for k, v in monotone_curve(verify_ms).items()},
        draft_step_ms=round(draft_ms, 4),
        draft_parallel_ms=({k: round(v, 4) for k, v in monotone_curve(draft_parallel_ms).items()}
                           if draft_parallel_ms else None))
