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
    bs = list(rows)

    def at(b: int) -> float:
        return cost._interp(*rows[b], tokens)
    if batch in rows:
        return at(batch) / 1e3
    hi = next((i for i, b in enumerate(bs) if b > batch), len(bs) - 1)
    b0, b1 = bs[hi - 1], bs[hi]
    y0, y1 = at(b0), at(b1)
    y = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
    return max(y, y1 if batch > b1 else 0.0) / 1e3


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
    """T(B, k): one round of `batch` sequences at depth k: drafting + a verify of B·(k+1)
    tokens (compute from the surface, all-reduces of all of them)."""
    return (draft_batch_s(profile, batch, k, drafting, block_layers)
            + verify_batch_compute_s(profile, batch, k + 1)
            + cost.comm_s(profile, batch * (k + 1)))


def _best(taus: list[float], profile: NodeProfile, batch: int, max_depth: int, drafting: str,
          block_layers: int) -> tuple[int, list[float]]:
    """(best k, tokens/s per k) at `batch` sequences."""
    rates = [batch * taus[k] / round_batch_s(profile, batch, k, drafting, block_layers)
             for k in range(max_depth + 1)]
    best = 0
    for k in range(1, max_depth + 1):
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
    surface = has_surface(profile)
    warnings = []
    reach = max_batch if surface else 1
    depths, shown = [], []
    for b in range(1, reach + 1):
        k, rates = _best(taus, profile, b, max_depth, drafting, block_layers)
        depths.append(k)
        if b in SHOWN_BATCHES or b == reach or (surface and b in profile.verify_batch_ms):
            shown.append({"batch": b, "depth": k, "tokens_per_s": rates[k],
                          "tokens_per_s_depth0": rates[0], "gain": rates[k] / rates[0],
                          "round_ms": round_batch_s(profile, b, k, drafting, block_layers) * 1e3,
                          "accept_len": taus[k]})
    if not surface:
        depths += [depths[0]] * (max_batch - 1)
        warnings.append(f"{profile.name} has no verify_batch_ms (the verify surface over batch "
                        f"size): priced at batch 1 only, so its depth {depths[0]} is served at "
                        f"every batch size; `eagle3-ray profile --batch-sizes ...` measures one")
    else:
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
            "schedule": sched, "num_speculative_tokens": max(depths),
            "acceptance": {"cond_acc": acc, "known_depth": known},
            "rows": shown, "warnings": warnings}


def vllm_schedule(result: dict) -> tuple[int, list[list[int]] | None]:
    """A depth_schedule() result -> (num_speculative_tokens, num_speculative_tokens_per_batch_size)
    for vLLM: (0, None) when no batch size speculates; the schedule as is otherwise (vLLM clamps
    each k to num_speculative_tokens, the largest)."""
    k = int(result["num_speculative_tokens"])
    return (0, None) if k == 0 else (k, [list(map(int, r)) for r in result["schedule"]])


def sweep_schedules(levels: list[float], profiles: list[NodeProfile], max_depth: int = 32,
                    max_batch: int = MAX_BATCH) -> dict:
    """depth_schedule for each constant conditional acceptance level on each profile (the
    schedule column of `plan --sweep`)."""
    rows = [{"acceptance": a, **{p.name: depth_schedule([a] * max_depth, p, max_depth, max_batch)
                                 for p in profiles}} for a in levels]
    return {"kind": "sweep_schedules", "profiles": [p.name for p in profiles],
            "max_batch": max_batch, "rows": rows}
