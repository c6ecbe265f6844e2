"""Depth by load: the speculation depth for each batch size, as vLLM's
`speculative_config.num_speculative_tokens_per_batch_size` schedule.

A round of B sequences at depth k drafts k tokens for each and verifies them in ONE verifier
forward of B sequences with k+1 tokens each. With p_i the unconditional acceptance of position
i (cost.py's notation, E[τ](k) = 1 + Σ_{i<k} p_i per sequence):
    V(B, t)          the profile's verify surface: compute-only ms of a forward of B sequences
                     with t tokens each (verify_batch_ms; batch 1 is its own batch-1 row, else
                     verify_ms), linear between the batch sizes, continued past the largest
    comm(B, t)       N_ar · AR(B·t·H·bytes): the all-reduces carry every sequence's tokens
    D_chain(B, k)    k · (t_step + t_par(B) − t_par(1) + C·AR(B·H·bytes)): each of the k draft
                     steps is one drafter forward of B tokens (t_par: draft_parallel_ms)
    D_par(B, k)      t_par(B·k) + C·AR(B·k·H·bytes)              (one forward of B·k tokens)
    D_block(B, k)    t_block(B·(k+1)) + C_block·AR(B·(k+1)·H·bytes)
    T(B, k)          D(B, k) + V(B, k+1) + comm(B, k+1)
    tokens/s(B, k)   B · E[τ](k) / T(B, k)
The depth for batch B is the k with the highest tokens/s (ties: the shallower), 0 where no depth
beats plain decoding. At batch 1 this is cost.best_depth, unless the surface has a batch-1 row
of its own (a measured one: the batched forward's kernels, which a batching engine runs at
batch 1 too, against the single-stream decoder's verify_ms). As B grows, a forward stops being
bound by reading the weights once (which k+1 tokens per sequence share for free) and the
all-reduces grow with B·(k+1) tokens: the spare compute that paid for the drafts at batch 1 is
gone, and the best depth falls, to 0 on a PCIe node at large batch. Consecutive batch sizes
with the same depth make one (from, to, k) range; the first starts at 1, as vLLM requires
(vllm/v1/spec_decode/dynamic/utils.py), and vLLM carries the last k past the last range.
A profile without a surface is priced at batch 1 only: its schedule serves batch 1's depth at
every batch size, and says so.

    eagle3-ray plan --acceptance 0.8,0.75,0.7,0.65,0.6 \\
        --profile pcie-8x-rtx-pro-6000-kimi-k2.5 --out /tmp/plan     # CPU, a second
"""
from __future__ import annotations

from eagle3_ray.plan import cost
from eagle3_ray.plan.acceptance import extend_acceptance
from eagle3_ray.plan.profiles import NodeProfile, message_bytes
from eagle3_ray.train import ttt

MAX_BATCH = 256                 # vLLM's default max_num_seqs on GPUs: the schedule's reach
SHOWN_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # rows printed by plan


def has_surface(profile: NodeProfile) -> bool:
    return bool(profile.verify_batch_ms)


def verify_batch_compute_s(profile: NodeProfile, batch: int, tokens: int) -> float:
    """V(B, t): one verifier forward of `batch` sequences with `tokens` tokens each, compute
    only. Each batch row (verify_batch_ms; batch 1: its own row, else verify_ms, i.e.
    cost.compute_s) is interpolated at `tokens`, and the rows linearly in the batch size between
    the two around it, continued from the last two past the largest (never below the largest
    row's time). A profile without a surface refuses batches > 1."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if batch == 1 and 1 not in (profile.verify_batch_ms or {}):
        return cost.compute_s(profile, tokens)
    if not has_surface(profile):
        raise ValueError(f"profile {profile.name}: no verify_batch_ms, priced at batch 1 only")
    rows = profile._rows
    return _across_batches(list(rows), lambda b: cost._interp(*rows[b], tokens), batch) / 1e3


def _across_batches(bs: list[int], at, batch: int) -> float:
    """at(b) known at the sorted batch sizes `bs` -> its value at `batch`: linear between the
    two around it, continued from the last two past the largest (never below the largest's),
    the smallest's below the smallest."""
    if batch in bs or len(bs) == 1 or batch < bs[0]:
        return at(batch if batch in bs else bs[0])
    hi = next((i for i, b in enumerate(bs) if b > batch), len(bs) - 1)
    b0, b1 = bs[hi - 1], bs[hi]
    y0, y1 = at(b0), at(b1)
    y = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
    return max(y, y1 if batch > b1 else 0.0)


def has_engine_rounds(profile: NodeProfile) -> bool:
    """Whether the profile has the serving engine's own rounds (`profile --engine vllm`)."""
    return bool(profile.round_batch_ms)


def engine_round_s(profile: NodeProfile, batch: int, k: int | None) -> float:
    """A decode round of `batch` sequences at depth k as the serving engine measured it
    (round_batch_ms; k None: plain_batch_ms, the engine without a drafter)."""
    row = profile.plain_batch_ms if k is None else profile.round_batch_ms.get(k)
    if row is None:
        raise ValueError(f"profile {profile.name}: depth {k} is not in round_batch_ms "
                         f"(measured: {sorted(profile.round_batch_ms)})")
    return _across_batches(sorted(row), row.__getitem__, batch) / 1e3


def draft_batch_s(profile: NodeProfile, batch: int, k: int, drafting: str = "chain",
                  block_layers: int = cost.BLOCK_LAYERS) -> float:
    """D(B, k): a round's drafting for `batch` sequences at depth k (module docstring); equal to
    cost.draft_round_s at batch 1."""
    cost._check_kind(drafting, block_layers)
    if k == 0:
        return 0.0
    ar = cost._allreduce_s
    if drafting == "chain":
        step = profile.draft_step_ms / 1e3 + (cost.draft_parallel_compute_s(profile, batch)
                                             - cost.draft_parallel_compute_s(profile, 1))
        return k * (step + profile.draft_collectives * ar(profile, batch))
    if drafting == "parallel":
        return (cost.draft_parallel_compute_s(profile, batch * k)
                + profile.draft_collectives * ar(profile, batch * k))
    slots = batch * (k + 1)
    return (cost.draft_block_compute_s(profile, slots - 1, block_layers)
            + cost.block_collectives(profile, block_layers) * ar(profile, slots))


def round_batch_s(profile: NodeProfile, batch: int, k: int, drafting: str = "chain",
                  block_layers: int = cost.BLOCK_LAYERS) -> float:
    """T(B, k): one round of `batch` sequences at depth k: the serving engine's own where the
    profile has them (engine_round_s), else drafting + a verify of B·(k+1) tokens (compute
    from the surface, all-reduces of all of them)."""
    if has_engine_rounds(profile):
        return engine_round_s(profile, batch, k)
    return (draft_batch_s(profile, batch, k, drafting, block_layers)
            + verify_batch_compute_s(profile, batch, k + 1)
            + cost.comm_s(profile, batch * (k + 1)))


def _best(taus: list[float], profile: NodeProfile, batch: int, depths: list[int],
          drafting: str, block_layers: int) -> tuple[int, dict[int, float]]:
    """(best k, {k: tokens/s}) at `batch` sequences over the candidate `depths` (0 first)."""
    rates = {k: batch * taus[k] / round_batch_s(profile, batch, k, drafting, block_layers)
             for k in depths}
    best = depths[0]
    for k in depths[1:]:
        if rates[k] > rates[best] * (1 + 1e-9):
            best = k
    return best, rates


def ranges(depths: list[int]) -> list[list[int]]:
    """Depth per batch size (depths[i] for batch i + 1) -> [[from, to, k], ...], inclusive,
    consecutive batch sizes of one depth merged; the first range starts at 1."""
    out: list[list[int]] = []
    for i, k in enumerate(depths, start=1):
        if out and out[-1][2] == k:
            out[-1][1] = i
        else:
            out.append([i, i, k])
    return out


def depth_schedule(cond_acc: list[float], profile: NodeProfile, max_depth: int | None = None,
                   max_batch: int = MAX_BATCH, drafting: str = "chain",
                   block_layers: int = cost.BLOCK_LAYERS,
                   known_depth: int | None = None) -> dict:
    """The best depth at every batch size 1..max_batch on `profile` for a drafter of
    conditional acceptance `cond_acc` (positions past it, or past known_depth, extrapolated:
    extend_acceptance) -> {"schedule": [[from, to, k], ...] (vLLM's
    num_speculative_tokens_per_batch_size), "num_speculative_tokens": the largest k (vLLM's
    maximum; 0: no speculation at any batch size), "rows": tokens/s at a few batch sizes with
    and without speculation, "batch_surface": whether the profile has one, "warnings"}."""
    max_depth = len(cond_acc) if max_depth is None else max_depth
    if not 1 <= max_depth <= 64:
        raise ValueError(f"max_depth must be in 1..64, got {max_depth}")
    if not 1 <= max_batch <= 4096:
        raise ValueError(f"max_batch must be in 1..4096, got {max_batch}")
    known = len(cond_acc) if known_depth is None else min(known_depth, len(cond_acc))
    if known == 0:
        raise ValueError("no measured acceptance (cond_acc is empty)")
    acc = extend_acceptance(list(cond_acc[:known]), max_depth)[0][:max_depth]
    taus = ttt.accept_lengths(acc)                       # E[τ](k), k = 0..max_depth
    rounds = has_engine_rounds(profile)
    surface = rounds or has_surface(profile)
    warnings = []
    reach = max_batch if surface else 1
    candidates = ([k for k in profile.round_batch_ms if k <= max_depth] if rounds
                  else list(range(max_depth + 1)))
    depths, gains, shown = [], [], []
    for b in range(1, reach + 1):
        k, rates = _best(taus, profile, b, candidates, drafting, block_layers)
        depths.append(k)
        # depth 0 is plain decoding: with engine rounds, the engine without a drafter (a
        # schedule's 0 still runs the drafter's upkeep forward: rates[0])
        plain = b / engine_round_s(profile, b, None) if rounds else rates[0]
        gains.append(rates[k] / plain)
        if b in SHOWN_BATCHES or b == reach or (surface and b in (
                profile.plain_batch_ms if rounds else profile.verify_batch_ms)):
            shown.append({"batch": b, "depth": k, "tokens_per_s": rates[k],
                          "tokens_per_s_depth0": plain, "gain": gains[-1],
                          "round_ms": round_batch_s(profile, b, k, drafting, block_layers) * 1e3,
                          "accept_len": taus[k]})
    if rounds:
        warnings += _engine_round_warnings(profile, len(taus) - 1, gains, candidates,
                                           max_batch)
    elif not surface:
        depths += [depths[0]] * (max_batch - 1)
        warnings.append(f"{profile.name} has no verify_batch_ms (the verify surface over batch "
                        f"size): priced at batch 1 only, so its depth {depths[0]} is served at "
                        f"every batch size; `eagle3-ray profile --batch-sizes ...` measures one")
    if surface and not rounds:
        top = max(profile.verify_batch_ms)
        if max_batch > top:
            warnings.append(f"verify_batch_ms is measured up to batch {top}: batches "
                            f"{top + 1}..{max_batch} are extrapolated linearly from the last "
                            f"two batch rows")
        deepest = max(depths) + 1
        short = [b for b, row in profile.verify_batch_ms.items() if max(row) < deepest]
        if short:
            warnings.append(f"verify_batch_ms rows {short} stop below {deepest} tokens per "
                            f"sequence (depth {deepest - 1}): extrapolated linearly")
    curve = profile.interconnect.allreduce_us
    biggest = message_bytes(profile, reach * (max(depths) + 1))
    if curve and profile.gpus > 1 and biggest > max(curve):
        warnings.append(f"the all-reduce curve is measured up to {max(curve)} bytes; a batch's "
                        f"verify sends up to {biggest}: "
                        f"extrapolated log-log, which overprices large messages (use alpha/beta "
                        f"or measure larger sizes)")
    sched = ranges(depths)
    return {"kind": "depth_schedule", "profile": profile.name, "drafting": drafting,
            "max_depth": max_depth, "max_batch": max_batch, "batch_surface": surface,
            "round_engine": (profile.round_engine or "the serving engine") if rounds else None,
            "schedule": sched, "num_speculative_tokens": max(depths),
            "acceptance": {"cond_acc": acc, "known_depth": known},
            "rows": shown, "warnings": warnings}


def _engine_round_warnings(profile: NodeProfile, max_depth: int, gains: list[float],
                           candidates: list[int], max_batch: int) -> list[str]:
    """What a schedule priced on the engine's own rounds cannot do: depths beyond the measured
    ones, batches beyond the largest measured, and the batch sizes where the engine without a
    drafter is faster than the schedule (gains[b - 1] < 1: its 0 still pays the drafter's
    upkeep)."""
    out = []
    top = max(profile.plain_batch_ms)
    if max_batch > top:
        out.append(f"round_batch_ms is measured up to batch {top}: batches {top + 1}..{max_batch} "
                   f"are extrapolated linearly from the last two")
    if 0 not in candidates:
        out.append("round_batch_ms has no depth 0 (the drafter loaded, drafting none): the "
                   "schedule cannot turn speculation down to 0")
    if max(candidates) < max_depth:
        out.append(f"depths above {max(candidates)} are not in round_batch_ms: not considered")
    lose = [(b, g) for b, g in enumerate(gains, start=1) if g < 1 - 1e-9]
    if lose:
        worst = min(lose, key=lambda x: x[1])
        out.append(f"at {len(lose)} batch sizes ({lose[0][0]}..{lose[-1][0]}) the engine without "
                   f"a drafter is faster than the schedule (x{worst[1]:.2f} at batch {worst[0]}): "
                   f"vLLM's k = 0 still runs the drafter's first forward every step; serve "
                   f"depth 0 if the load stays there")
    return out


def vllm_schedule(result: dict) -> tuple[int, list[list[int]] | None]:
    """A depth_schedule() result -> (num_speculative_tokens, num_speculative_tokens_per_batch_size)
    for vLLM: (0, None) when no batch size speculates; the schedule as is otherwise (vLLM clamps
    each k to num_speculative_tokens, the largest)."""
    k = int(result["num_speculative_tokens"])
    return (0, None) if k == 0 else (k, [list(map(int, r)) for r in result["schedule"]])


def planned_schedule(drafter: str, profile: str, max_depth: int = 16, log: str = "[plan]"
                     ) -> tuple[int, list[list[int]] | None, dict]:
    """What `serve --engine vllm --depth auto --profile P` serves: the drafter's measured
    per-position acceptance (its metadata's held-out figures; 0.5 per position without them)
    priced on the profile -> (num_speculative_tokens, its schedule or None, the depth_schedule
    result). Prints the choice and the warnings, prefixed with `log`."""
    from eagle3_ray.plan import acceptance
    from eagle3_ray.plan.profiles import load_profile
    kind = acceptance.drafting_of(drafter) or "chain"
    try:
        cond, known, _ = acceptance.acceptance_from(drafter, None, kind)
    except ValueError:
        cond, known = [0.5], 1
        print(f"{log} warning: {drafter}: no held-out acceptance in its metadata; the "
              f"schedule is planned from 0.5 per position")
    r = depth_schedule(cond, load_profile(profile), max_depth, MAX_BATCH, kind, known_depth=known)
    depth, schedule = vllm_schedule(r)
    print(f"{log} depth auto on {r['profile']}: num_speculative_tokens {depth}, "
          f"num_speculative_tokens_per_batch_size {schedule}")
    for w in r["warnings"]:
        print(f"{log} warning: schedule: {w}")
    return depth, schedule, r


def sweep_schedules(levels: list[float], profiles: list[NodeProfile], max_depth: int = 32,
                    max_batch: int = MAX_BATCH) -> dict:
    """depth_schedule for each constant conditional acceptance level on each profile (the
    schedule column of `plan --sweep`)."""
    rows = [{"acceptance": a, **{p.name: depth_schedule([a] * max_depth, p, max_depth, max_batch)
                                 for p in profiles}} for a in levels]
    return {"kind": "sweep_schedules", "profiles": [p.name for p in profiles],
            "max_batch": max_batch, "rows": rows}
