"""Acceptance sources: per-position conditional acceptance a_j of a drafter, from where it was
measured, and what the planner assumes past the measured positions.

acceptance_from() reads a training run or drafter dir (held-out eval/cond_acc_k), a `bench
quality` JSON, a `bench serve` JSON (per-position counts; a parallel or block drafter's arms
from their own section), a running server's /metrics, or a literal list; drafting_of() says
which kind of drafter (chain, parallel, block) a dir holds. extend_acceptance() extrapolates
conservatively past the measured positions. parallel_from_chain() and block_from_chain()
derive the other kinds' curves from a chain's for `plan --sweep-kinds` (their ratios and
where they come from are below).

    eagle3-ray plan --acceptance 0.8,0.75,0.7 --block-acceptance 0.8,0.8,0.78 \\
        --profile pcie-8x-rtx-pro-6000-kimi-k2.5 --out /tmp/plan       # CPU, a second
"""
from __future__ import annotations

import json
import os
import re

EXTRAPOLATION_WINDOW = 3      # known positions averaged for the extrapolation base
EXTRAPOLATION_DECAY = 0.9     # each extrapolated position: base · decay^(distance past known)
# A parallel drafter's acceptance relative to a chain's, from the per-position acceptance vLLM
# PR #32628 reports on HumanEval at k = 8 (P-EAGLE P0 63%, P1 38%; EAGLE-3 71%, 49%): position
# 0 x 63/71, each later position's conditional acceptance x (38/63) / (49/71). Used by
# sweep_drafting() to derive a parallel curve from a chain's.
PARALLEL_FIRST_RATIO = 63 / 71                    # 0.887
PARALLEL_REST_RATIO = (38 / 63) / (49 / 71)       # 0.874
# A block (DFlash) drafter's acceptance relative to a chain's. ASSUMPTIONS, not measurements:
# the DFlash paper (arXiv 2602.06036) reports acceptance lengths (≈ 6.4 at block 16, EAGLE-3's
# lower) but no per-position figures paired with a chain's were found to derive ratios from.
# Position 0 as a chain's (x1.0: both draft it from the verifier's states of the last
# accepted token); every later position's conditional acceptance x1.084, chosen so that a
# chain at a = 0.8 everywhere (E[τ](16) = 4.89) becomes a block drafter with E[τ](16) = 6.4:
# several layers that see the verifier's states in every layer, and drafts that do not feed
# on their own earlier guesses, hold their acceptance deeper. Measure a block drafter and
# pass it as --block-acceptance; `plan --block-ratios` changes these.
BLOCK_FIRST_RATIO = 1.0
BLOCK_REST_RATIO = 1.084


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


def parallel_from_chain(cond_acc: list[float], first: float = PARALLEL_FIRST_RATIO,
                        rest: float = PARALLEL_REST_RATIO) -> list[float]:
    """A parallel drafter's conditional acceptance derived from a chain's: position 0 x first,
    every later position x rest (defaults: the P0/P1 ratios of PARALLEL_*_RATIO)."""
    return [min(1.0, a * (first if j == 0 else rest)) for j, a in enumerate(cond_acc)]



def block_from_chain(cond_acc: list[float], first: float = BLOCK_FIRST_RATIO,
                     rest: float = BLOCK_REST_RATIO) -> list[float]:
    """A block drafter's conditional acceptance derived from a chain's: position 0 x first,
    every later position x rest, capped at 1 (defaults: the ASSUMED BLOCK_*_RATIO)."""
    return parallel_from_chain(cond_acc, first, rest)


def _draft_config(source: str) -> dict | None:
    """config.json's eagle3_ray.draft_config of a drafter dir or a run dir's drafter/, {} for
    a dir without one (a checkpoint from before it), None when `source` is not a dir."""
    if not os.path.isdir(source):
        return None
    for d in (source, os.path.join(source, "drafter")):
        try:
            j = json.load(open(os.path.join(d, "config.json")))
        except (OSError, json.JSONDecodeError):
            continue
        dc = (j.get("eagle3_ray") or {}).get("draft_config") if isinstance(j, dict) else None
        if isinstance(dc, dict):
            return dc
    return {}


def drafting_of(source: str) -> str | None:
    """How the drafter behind an acceptance source drafts ("chain", "parallel", "block"): a
    drafter or training run dir says so in config.json's eagle3_ray.draft_config, field
    `drafting`; one written before the field existed is a chain. None for any other source (a
    JSON, a URL, a list): the flag it was given with decides."""
    dc = _draft_config(source)
    return None if dc is None else dc.get("drafting", "chain")


def draft_config_int(source: str, name: str) -> int | None:
    """An integer >= 1 a drafter dir's draft_config states under `name` (a block drafter's
    "block_layers", "block_size"), None where it states none or `source` is not a dir."""
    n = (_draft_config(source) or {}).get(name)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


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
    if kind == "serve" and drafting in ("parallel", "block"):   # its own arms' section
        cond = _kind_section(r, drafting).get("cond_acc")
        if not cond:
            raise ValueError(f"{path}: a bench serve run without {drafting} arms "
                             f"(--{drafting}-drafter): no {drafting} drafter's acceptance in it")
        return [float(a) for a in cond], len(cond), (
            f"{path}: bench serve, per-position acceptance of its {drafting}{{d}} arms")
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


def _kind_section(r: dict, drafting: str) -> dict:
    """A bench serve result's section of one drafter kind's arms ("parallel{d}", "block{d}"):
    result["planner"][kind] (where bench serve writes the parallel one), else
    result["acceptance"][kind]; {} when neither is there."""
    for where in ("planner", "acceptance"):
        sec = (r.get(where) or {}).get(drafting)
        if isinstance(sec, dict):
            return sec
    return {}


def acceptance_from(source: str, ttt_steps: int | None = None,
                    drafting: str = "chain") -> tuple[list[float], int, str]:
    """-> (conditional acceptance per position, known depth, description) from
      a training run dir or drafter dir     latest eval/cond_acc_k of metrics.jsonl, else
                                            drafter/meta.json final_metrics
      a bench quality JSON                  the run with `ttt_steps` (default: the deepest)
      a bench serve JSON                    per-position counts if present, else a fit to the
                                            acceptance length at each depth (drafting
                                            "parallel" / "block": its parallel{d} /
                                            block{d} arms' counts, _kind_section)
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

