"""bench serve: the decoder the server runs (speculate.Speculator: the same code, minus HTTP), on
the embedded verifier with a trained drafter, at each depth on the same held-out prompts. Depths
are interleaved per prompt (in a rotating order) so machine noise hits them alike. The peers
(transformers' plain greedy generate and its prompt-lookup speculation, the choices a user has
without training) are arms of the same interleaved run (hf_generate; --no-peers skips).

    eagle3-ray bench serve --drafter runs/bench/quality/ttt4/drafter --samples 4 --max-tokens 32
    eagle3-ray bench serve --drafter DIR --samples 2 --max-tokens 16 --depths 0 2 \\
        --prompt-lookup-tokens 10 3
"""
from __future__ import annotations

import json
import os
import time

import torch

from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier
from eagle3_ray.bench.stages import save_result

SERVE_DEPTHS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


def best_quality_drafter(out_dir: str = "runs/bench", depth: int = 8) -> str:
    """The drafter of `bench quality` with the highest served acceptance length at `depth`."""
    path = os.path.join(out_dir, "quality.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no bench quality result; pass --drafter")
    q = json.load(open(path))
    arm = max(q["runs"], key=lambda k: q["runs"][k]["served"]["tau_by_depth"][depth])
    return os.path.join(out_dir, "quality", arm, "drafter")


SERVE_BRANCHES = ()      # tree arms (--branches K): K chains forked at the first draft
                         # (Speculator branches); none by default: on a 2-core CPU they lose
                         # (docs/benchmarks.md#bench-serve)
SERVE_TREE_DEPTHS = (2, 3, 4)   # the fixed depths (of those run) that get tree arms
SERVE_PROMPT_LOOKUP = (10, 3)   # transformers' docs suggest ~10 tokens; 3 ~ a shallow depth
SERVE_LOOKUP_DEPTHS = (3, 4, 8)  # arms "lookup{d}": depth d with the server's lookup fallback
SERVE_LOOKUP_BRANCHES = ()       # arms "branch-lookup{d}": depth d, the lookup's match verified
                                 # beside the drafter's chain (a tree; none by default)


class _ChunkClock:
    """A transformers streamer: when and how many token ids each put() of generate() carries
    (the first put is the prompt, then one per verifier forward)."""

    def __init__(self):
        self.times: list[float] = []
        self.sizes: list[int] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def hf_generate(model, prompt: list[int], max_tokens: int, eos_ids, prompt_lookup: int = 0):
    """transformers' own greedy `model.generate` on one prompt (prompt_lookup > 0: with its
    prompt-lookup speculation of that many tokens, `prompt_lookup_num_tokens`), stopping at
    `eos_ids` after at most `max_tokens` -> {tokens (EOS left out, as speculate.Speculator
    does), wall_s, prefill_s (until the first token), rounds (verifier forwards after the
    prefill), drafted, accepted (prompt-lookup tokens proposed / accepted)}. Counted with a
    streamer (tokens per forward) and a forward pre-hook (tokens fed per forward)."""
    clock, fed = _ChunkClock(), []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: fed.append((kw.get("input_ids") if "input_ids" in kw else args[0])
                                       .shape[1]), with_kwargs=True)
    eos = list(eos_ids)
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    x = torch.tensor([prompt], device=model.device)                       # [1, P]
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos or None,
                                 pad_token_id=eos[0] if eos else None, streamer=clock,
                                 **extra)                                  # [1, P + n]
        wall = time.perf_counter() - t0
    finally:
        hook.remove()
    out = seq[0, len(prompt):].tolist()
    out = out[:next((i for i, t in enumerate(out) if t in eos), len(out))]
    chunks = clock.sizes[1:]                      # tokens emitted per forward (prefill first)
    return {"tokens": out, "wall_s": wall, "prefill_s": clock.times[1] - t0,
            "rounds": len(chunks) - 1, "drafted": sum(n - 1 for n in fed[1:]),
            "accepted": sum(n - 1 for n in chunks[1:])}


def bench_serve(drafter_dir: str | None = None, depths=SERVE_DEPTHS, prompts: int = 8,
                max_tokens: int = 64, out_dir: str = "runs/bench",
                spec: str = verifier.EMBEDDED_VERIFIER, threads: int = 0,
                simulate: str | None = None, dynamic: bool = True, peers: bool = True,
                prompt_lookup=SERVE_PROMPT_LOOKUP, num_gpus: int = 0,
                branches=SERVE_BRANCHES, lookup_depths=SERVE_LOOKUP_DEPTHS,
                lookup_branches=SERVE_LOOKUP_BRANCHES,
                parallel_drafter: str | None = None, block_drafter: str | None = None) -> dict:
    """Greedy tokens/s and acceptance length per depth, speedup over depth 0, whether every
    depth's output equals depth 0's, and the planner's prediction for each depth next to the
    measurement: this machine's verify/draft times are measured first (profile.
    measure_speculator), acceptance per position is counted over the runs. simulate: a node
    profile whose all-reduce time every verify also sleeps (a SIMULATION of that node's
    interconnect). dynamic: also a run with per-request dynamic depth (planner.DynamicDepth).
    branches: tree arms "tree{k}x{d}" for each k > 1 here and each depth d of SERVE_TREE_DEPTHS
    run: k chains of d drafts forked at the first, verified in one forward (Speculator
    branches); measured only, no planner prediction.
    lookup_depths: arms "lookup{d}" (depth d) and, with dynamic, "dynamic-lookup": the same
    decoder with the server's lookup fallback (speculate.LookupParams(); serve's default);
    measured only, no planner prediction.
    lookup_branches: arms "branch-lookup{d}" (depth d) and, for each k of `branches`,
    "tree{k}x{d}+lookup", and with dynamic "dynamic-branch-lookup": the lookup's match
    verified as one more chain of the tree (speculate.LookupParams(branch=True)); measured
    only.
    peers: also transformers' own greedy `generate` and its prompt-lookup speculation with each
    k in `prompt_lookup` (hf_generate), on a second, unpatched copy of the verifier, as arms of
    the same interleaved run -> result["peers"] (not simulated: no interconnect sleep).
    num_gpus: the verifier's GPUs (0: CPU; the GPU check runs this on one GPU).
    parallel_drafter: a parallel (P-EAGLE) drafter's dir: arms "parallel{d}" for each fixed
    depth d > 0, the same verifier drafting with it (one drafter forward per round), in the
    same interleaved run; its teacher-forced acceptance goes beside the served one.
    block_drafter: a block (DFlash) drafter's dir: arms "block{d}" the same way (one forward of
    d + 1 slots per round, at most its block size).
    Writes <out_dir>/serve.json + serve.png (serve-sim-<profile>.* when simulating)."""
    import functools
    from eagle3_ray.plan import planner
    from eagle3_ray.serve import speculate
    from eagle3_ray.serve.profile import (measure_draft_parallel, measure_speculator,
                                          with_round_forward)
    from eagle3_ray.train.checkpoint import load_trained_drafter
    if threads:
        torch.set_num_threads(threads)
    depths = tuple(sorted(set(depths)))
    if depths[0] != 0 or len(depths) < 2:
        raise ValueError(f"depths {list(depths)}: need 0 (the baseline) and at least one > 0")
    if peers and any(int(k) <= 0 for k in prompt_lookup):
        raise ValueError(f"prompt lookup tokens {list(prompt_lookup)}: each must be > 0")
    drafter_dir = drafter_dir or best_quality_drafter(out_dir)
    tok, model = verifier.load_tokenizer(spec), verifier.load_verifier(spec, num_gpus=num_gpus)
    drafter, _, meta = load_trained_drafter(drafter_dir, spec)
    dec = speculate.Speculator(model, drafter.eval())    # patches `model` (batch invariance)
    # the one-forward kinds: kind -> (its decoder, its meta, {arm name: depth})
    others = {kind: _other_drafter(dec, d, kind, spec, depths, load_trained_drafter)
              for kind, d in (("parallel", parallel_drafter), ("block", block_drafter)) if d}
    kind_arms = {name: (kind, depth) for kind, (_, _, arms) in others.items()
                 for name, depth in arms.items()}        # arm name -> (kind, depth)
    decoders = {name: others[kind][0] for name, (kind, _) in kind_arms.items()}
    max_depth = max(depths)
    # the peers run on their own copy: transformers as a user has it (its default attention)
    hf = verifier.load_verifier(spec, dtype=model.dtype, num_gpus=num_gpus) if peers else None
    peer_ks = {"generate": 0} if peers else {}
    peer_ks.update({f"prompt_lookup_{k}": int(k) for k in (prompt_lookup if peers else ())})
    node = planner.load_profile(simulate) if simulate else None
    before = measure_speculator(dec, max_depth + 1, reps=7)
    kinds_ms = {kind: [measure_draft_parallel(o[0].drafter, sorted(o[2].values()), reps=7)]
                for kind, o in others.items()}           # a round's one forward, by depth
    profile = _measured_profile(model, node, before)      # what dynamic depth plans with
    if node:
        dec.simulated_comm = functools.partial(planner.comm_s, node)
    prior = planner.acceptance_from(drafter_dir)[0]
    sp = speculate.SamplingParams(max_tokens=max_tokens, eos_ids=verifier.eos_ids(model, tok))
    ps = data.heldout_prompts(tok, prompts)
    plans, trees, lookups, refused = _serve_arms(dec, depths, dynamic, branches, lookup_depths,
                                                 lookup_branches)
    plans.update({name: (d, 1, None) for name, (_, d) in kind_arms.items()})
    runs, peer_runs, calib = _interleave(
        dec, hf, ps, sp, plans, peer_ks,
        functools.partial(planner.DynamicDepth, profile, prior, max_depth), decoders)
    # the machine drifts over minutes (shared, turbo): predict with times measured before and
    # after the runs, averaged
    after = measure_speculator(dec, max_depth + 1, reps=7)
    for kind, o in others.items():
        kinds_ms[kind].append(measure_draft_parallel(o[0].drafter, sorted(o[2].values()), reps=7))
    result = {"bench": "serve", "verifier": spec, "drafter": drafter_dir,
              "drafter_ttt_steps": meta.get("ttt_steps"), "prompts": len(ps),
              "max_tokens": max_tokens, "torch_threads": torch.get_num_threads(),
              "dtype": str(model.dtype).replace("torch.", ""),
              "few_row_kernels": {str(k): v for k, v in dec.few_row_kernels.items()},
              "exact": dec.exact, "refused_arms": refused, "simulated_interconnect": simulate}
    if others:
        result["teacher_forced"] = {"chain": prior}
    for kind, path in (("parallel", parallel_drafter), ("block", block_drafter)):
        if path:
            result.update({f"{kind}_drafter": path,
                           f"{kind}_drafter_ttt_steps": others[kind][1].get("ttt_steps")})
            result["teacher_forced"][kind] = planner.acceptance_from(path)[0]
    measured = _measured_profile(model, node, before, after)
    for kind, ms in kinds_ms.items():  # each kind's round forward, before and after, averaged
        measured = with_round_forward(measured, others[kind][0].drafter,
                                      {k: sum(m[k] for m in ms) / len(ms) for k in ms[0]})
    result.update(_serve_summary(runs, depths, trees, lookups, len(ps), calib, simulate,
                                 measured, after[0][1] / before[0][1] - 1, kind_arms))
    _compare_arms(result, trees, lookups, dynamic, kind_arms)
    if peers:
        result["peers"] = _peer_rows(peer_runs, peer_ks, result["runs"][str(depths[0])],
                                     runs[depths[0]]["outputs"], len(ps))
        result["peers_note"] = _peers_note(hf.config._attn_implementation, simulate)
    save_result(out_dir, f"serve-sim-{node.name}" if node else "serve", result, _plot_serve)
    _print_serve(result)
    return result


def _other_drafter(dec, path: str, kind: str, spec: str, depths, load):
    """bench serve's drafter of a one-forward kind -> (a decoder of dec's verifier drafting
    with it, its meta, {arm name "<kind>{d}": depth d} for the depths > 0 it can draft)."""
    drafter, _, meta = load(path, spec)
    if drafter.config.drafting != kind:
        raise ValueError(f"{path}: drafting {drafter.config.drafting!r}, not a {kind} drafter "
                         f"(train one with --drafting {kind})")
    top = drafter.config.block_size if kind == "block" else max(depths)
    return dec.with_drafter(drafter.eval()), meta, {f"{kind}{d}": d for d in depths
                                                    if 0 < d <= top}


def _measured_profile(model, node, *timings):
    """profile.measure_speculator's (verify ms by tokens, draft ms) timings, averaged -> this
    machine's profile (+ the simulated node's interconnect)."""
    from eagle3_ray.plan import planner
    verify_ms = {k: sum(t[0][k] for t in timings) / len(timings) for k in timings[0][0]}
    p = planner.single_device_profile("this machine", verify_ms,
                                      sum(t[1] for t in timings) / len(timings),
                                      model.config, model.dtype)
    return planner.with_interconnect(p, node) if node else p


def _serve_arms(dec, depths, dynamic: bool, branches, lookup_depths, lookup_branches):
    """Our arms -> ({name: (depth, branches, lookup) of Speculator.generate; depth
    "dynamic": a planner.DynamicDepth}, the tree arms {name: (k, depth, lookup)}, the lookup
    arms {name: depth}, the tree arms left out as this host cannot run them exactly, and why)."""
    from eagle3_ray.serve import speculate
    branch = speculate.LookupParams(branch=True)
    trees = {f"tree{k}x{d}": (int(k), d, None) for k in branches if int(k) > 1
             for d in depths if d in SERVE_TREE_DEPTHS}           # name: (k, depth, lookup)
    for d in (int(d) for d in lookup_branches if int(d) > 0):
        trees[f"branch-lookup{d}"] = (1, d, branch)
        trees.update({f"tree{k}x{d}+lookup": (int(k), d, branch) for k in branches if int(k) > 1})
    if lookup_branches and dynamic:
        trees["dynamic-branch-lookup"] = (1, "dynamic", branch)
    refused = {}                          # arms this host cannot run exactly, and why
    if trees and not dec.exact["tree"]:
        refused = {"arms": sorted(trees), "why": dec.inexact_reason("tree")}
        print(f"[bench serve] tree arms {refused['arms']} left out: {refused['why']}")
        trees = {}
    if not dec.exact["chain"]:            # measured all the same: identical_to_depth0 tells
        print(f"[bench serve] warning: {dec.inexact_reason('chain')}")
    lookups = {f"lookup{d}": int(d) for d in lookup_depths if int(d) > 0}
    if lookups and dynamic:
        lookups["dynamic-lookup"] = "dynamic"
    plans = {d: (d, 1, None) for d in depths}
    if dynamic:
        plans["dynamic"] = ("dynamic", 1, None)
    plans.update({name: (d, k, lookup) for name, (k, d, lookup) in trees.items()})
    look = speculate.LookupParams()                       # serve's default fallback
    plans.update({name: (d, 1, look) for name, d in lookups.items()})
    return plans, trees, lookups, refused


def _interleave(dec, hf, ps: list[list[int]], sp, plans: dict, peer_ks: dict, dynamic_depth,
                decoders: dict | None = None):
    """Every arm on every prompt, in an order rotating per prompt; the first prompt once more
    before, as a warm-up, not counted -> (our arms' totals, the peers' totals, (the drafter's
    chain probability of drafts 1..k, all k accepted?) of every draft with one). decoders:
    arms decoded by another drafter (their drafts stay out of the calibration)."""
    decoders = decoders or {}
    width = max(p[0] for p in plans.values() if p[0] != "dynamic")    # positions
    runs = {d: {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "accepted": 0,
                "drafted": 0, "verify_s": 0.0, "draft_s": 0.0, "outputs": [], "lookup_rounds": 0,
                "drafted_at": [0] * width, "accepted_at": [0] * width} for d in plans}
    peer_runs = {a: {"tokens": 0, "wall_s": 0.0, "prefill_s": 0.0, "rounds": 0, "drafted": 0,
                     "accepted": 0, "outputs": []} for a in peer_ks}
    names, calib = list(plans) + list(peer_ks), []        # every arm, interleaved per prompt
    for i, prompt in enumerate([ps[0]] + ps):            # the first prompt once more as warm-up
        order = names[i % len(names):] + names[:i % len(names)]
        for d in order:
            if d in peer_ks:
                got = hf_generate(hf, prompt, sp.max_tokens, sp.eos_ids, peer_ks[d])
                if i > 0:
                    s = peer_runs[d]
                    for key in ("wall_s", "prefill_s", "rounds", "drafted", "accepted"):
                        s[key] += got[key]
                    s["tokens"] += len(got["tokens"])
                    s["outputs"].append(got["tokens"])
                continue
            depth, branches, lookup = plans[d]
            depth = dynamic_depth() if depth == "dynamic" else depth
            t0, out, rounds = time.perf_counter(), [], []
            for r in decoders.get(d, dec).generate(prompt, sp, depth, branches=branches,
                                                   lookup=lookup):
                out += r.tokens
                rounds.append(r)
            wall = time.perf_counter() - t0
            if i > 0:
                _add_run(runs[d], out, rounds, wall, [] if d in decoders else calib)
        print(f"[bench] serve: prompt {i}/{len(ps)} done", flush=True)
    return runs, peer_runs, calib


def _add_run(s: dict, out: list[int], rounds: list, wall: float, calib: list) -> None:
    """Add one prompt's run of an arm (its output, speculate.Rounds, wall time) to its totals."""
    s["tokens"] += len(out)
    s["wall_s"] += wall
    s["prefill_s"] += rounds[0].verify_s
    s["rounds"] += len(rounds) - 1                 # verify rounds after the prefill
    s["outputs"].append(out)
    for r in rounds[1:]:
        s["accepted"] += r.accepted
        s["drafted"] += r.drafted
        s["verify_s"] += r.verify_s
        s["draft_s"] += r.draft_s
        s["lookup_rounds"] += r.lookup
        chain = 1.0
        for k in range(r.drafted):
            s["drafted_at"][k] += 1
            s["accepted_at"][k] += k < r.accepted
            if r.draft_probs:                      # trees, lookups: no chain prob
                chain *= r.draft_probs[k]
                calib.append((chain, k < r.accepted))


def _served_cond(arms: list[dict], positions: int) -> list[float]:
    """Conditional acceptance per position, counted over these arms' rounds."""
    from eagle3_ray.plan import planner
    return planner.cond_from_counts(
        [sum(s["drafted_at"][k] for s in arms) for k in range(positions)],
        [sum(s["accepted_at"][k] for s in arms) for k in range(positions)])


def _serve_summary(runs: dict, depths, trees: dict, lookups: dict, prompts: int, calib: list,
                   simulate: str | None, profile, drift: float, kind_arms: dict) -> dict:
    """serve.json from "runs" to "note": each arm's row, and the planner's prediction from the
    acceptance counted here and `profile` against the fixed depths' measurements."""
    from eagle3_ray.plan import planner
    max_depth = max(depths)
    # acceptance per position over all fixed-depth runs (greedy: it does not depend on depth)
    cond = _served_cond([runs[d] for d in depths], max_depth)
    pred = planner.plan(cond, profile, max_depth=max_depth)
    preds, conds = {"chain": pred}, {}
    for kind in sorted({k for k, _ in kind_arms.values()}):   # each one-forward kind's own
        arms = [name for name, (k, _) in kind_arms.items() if k == kind]  # acceptance, rounds
        conds[kind] = _served_cond([runs[name] for name in arms], max(
            kind_arms[name][1] for name in arms))
        preds[kind] = planner.plan(conds[kind], profile, max_depth=len(conds[kind]),
                                   drafting=kind, block_layers=profile.draft_block_layers or 2)
    rows = {str(d): _arm_row(d, s, runs[depths[0]], prompts, trees, lookups, preds, kind_arms)
            for d, s in runs.items()}
    measured = sorted(depths, key=lambda d: -rows[str(d)]["decode_tokens_per_s"])
    chosen = max(depths, key=lambda d: pred["depths"][d]["tokens_per_s"])   # among those run
    best = rows[str(measured[0])]
    return {"runs": rows, "best_depth": best["depth"], "best_speedup": best["speedup"],
            "all_identical": all(r["identical_to_depth0"] for r in rows.values()),
            "calibration": calibration(calib),
            "planner": {"chosen_depth": chosen, "two_fastest_measured": measured[:2],
                        "chosen_among_two_fastest": chosen in measured[:2],
                        "max_abs_error": max(abs(rows[str(d)]["predicted_error"])
                                             for d in depths),
                        "cond_acc": cond, "profile": planner.profile_to_dict(profile),
                        "verify_1_token_drift": drift,
                        "why": pred["why"],
                        **{kind: {"cond_acc": conds[kind], "why": preds[kind]["why"],
                                  "max_abs_error": max(abs(rows[n]["predicted_error"])
                                                       for n, (k, _) in kind_arms.items()
                                                       if k == kind)} for kind in conds}},
            "note": "greedy; one process, the server's decoder (speculate.Speculator) without "
                    "HTTP; depths interleaved per prompt; speedup = tokens/s over depth 0's "
                    "in the same run; acceptance_length = tokens per verify round; "
                    "decode_tokens_per_s leaves out each prompt's prefill (what the planner "
                    "predicts); prediction = planner.plan(acceptance counted here, this "
                    "machine's verify/draft times measured before and after the runs"
                    + (f" + the SIMULATED interconnect of {simulate})" if simulate else ")")}


def _arm_row(d, s: dict, base: dict, prompts: int, trees: dict, lookups: dict,
             preds: dict, kind_arms: dict) -> dict:
    """serve.json "runs"[d]: arm d's totals against depth 0's (`base`), and at a fixed depth the
    planner's prediction (preds: planner.plan results by drafting kind)."""
    decode = (s["tokens"] - prompts) / (s["wall_s"] - s["prefill_s"])  # tokens after the first
    row = {"depth": d, "tokens": s["tokens"], "wall_s": s["wall_s"],
           "tokens_per_s": s["tokens"] / s["wall_s"],
           "speedup": (s["tokens"] / s["wall_s"]) / (base["tokens"] / base["wall_s"]),
           "decode_tokens_per_s": decode,
           "acceptance_length": (s["accepted"] + s["rounds"]) / max(1, s["rounds"]),
           "mean_depth": s["drafted"] / max(1, s["rounds"]), "rounds": s["rounds"],
           "verify_s_per_round": s["verify_s"] / max(1, s["rounds"]),
           "draft_s_per_round": s["draft_s"] / max(1, s["rounds"]),
           "drafted_per_position": s["drafted_at"], "accepted_per_position": s["accepted_at"],
           "identical_to_depth0": s["outputs"] == base["outputs"],
           "mismatched_prompts": [j for j, (a, b) in enumerate(zip(s["outputs"],
                                                                   base["outputs"])) if a != b]}
    if d in trees:
        row.update(branches=trees[d][0], tree_depth=trees[d][1])
        if trees[d][2]:
            row.update(lookup_branch=True, lookup_rounds=s["lookup_rounds"])
    elif d in lookups:
        row.update(lookup_rounds=s["lookup_rounds"], lookup_depth=lookups[d])
    elif d != "dynamic":
        kind, depth = kind_arms.get(d, ("chain", d))
        p = preds[kind]["depths"][depth]
        row.update(predicted_tokens_per_s=p["tokens_per_s"],
                   predicted_acceptance_length=p["accept_len"],
                   predicted_error=p["tokens_per_s"] / decode - 1)
        if kind != "chain":
            row.update({"drafting": kind, f"{kind}_depth": depth})
    return row


def _compare_arms(result: dict, trees: dict, lookups: dict, dynamic: bool,
                  kind_arms: dict) -> None:
    """The best tree and lookup arms and their notes; with the dynamic arms, each one's decode
    tokens/s over the best fixed depth's (trees, lookups: the arms that ran)."""
    from eagle3_ray.serve import speculate
    look, rows = speculate.LookupParams(), result["runs"]  # serve's default fallback
    notes = {"tree": "tree{k}x{d}: k greedy chains of d drafts forked at the first draft (the "
                     "drafter's top-k first tokens), verified in one forward; tau = tokens per "
                     "round, acceptance per position = the longest accepted chain's; "
                     "branch-lookup{d} / tree{k}x{d}+lookup: the lookup's match (if any) is one "
                     "more chain of that tree; lookup_rounds: rounds the lookup's chain won",
             "lookup": f"lookup{{d}} / dynamic-lookup: the decoder with the server's lookup "
                       f"fallback (a first draft with drafter probability < {look.below} gives "
                       f"way to the continuation of the latest earlier n-gram of "
                       f"{look.min_n}-{look.max_n} tokens ending the context); lookup_rounds: "
                       f"rounds that verified the lookup's drafts",
             "parallel": "parallel{d}: the parallel (P-EAGLE) drafter of --parallel-drafter at "
                         "depth d, its d drafts from one drafter forward per round (the depth "
                         "arms' drafter drafts a chain: d forwards)",
             "block": "block{d}: the block (DFlash) drafter of --block-drafter at depth d, its d "
                      "drafts from one forward of its layers over the bonus token and d mask "
                      "slots per round"}
    for kind in ("parallel", "block"):
        arms = [n for n, (k, _) in kind_arms.items() if k == kind]
        if arms:
            top = max(arms, key=lambda d: rows[d]["decode_tokens_per_s"])
            result.update({f"best_{kind}": top, f"best_{kind}_speedup": rows[top]["speedup"],
                           f"{kind}_note": notes[kind]})
    for kind, arms in (("tree", trees), ("lookup", lookups)):
        if arms:
            top = max(arms, key=lambda d: rows[d]["decode_tokens_per_s"])
            result.update({f"best_{kind}": top, f"best_{kind}_speedup": rows[top]["speedup"],
                           f"{kind}_note": notes[kind]})
    if dynamic:
        best = rows[str(result["best_depth"])]
        for name in ["dynamic"] + [n for n in (*lookups, *trees) if n.startswith("dynamic")]:
            rows[name]["vs_best_fixed"] = (rows[name]["decode_tokens_per_s"]
                                           / best["decode_tokens_per_s"])


def _peers_note(attention: str, simulate: str | None) -> str:
    """serve.json "peers_note"; attention: the peers' verifier's attention implementation."""
    return ("transformers' own model.generate (greedy, max_new_tokens = max_tokens, "
            "eos_token_id = the verifier's EOS ids) on a second, unmodified copy of the verifier "
            "(its default attention, " + attention + "), interleaved per "
            "prompt with the depth runs; prompt_lookup_K = prompt_lookup_num_tokens=K; "
            "speedup / decode_speedup: over depth 0 of this run; prefill_s: until generate's "
            "first token (includes generate's setup); identical_prompts: greedy output equal to "
            "depth 0's (in bf16 HF's attention may round differently from the batch-invariant "
            "path, so a mismatch is not a decoder error); acceptance_length: tokens per verifier "
            "forward after the prefill, acceptance_rate: accepted / proposed lookup tokens"
            + ("; no simulated interconnect sleep" if simulate else ""))


def _print_serve(result: dict) -> None:
    """bench serve's summary on stdout: each arm, each peer, the planner, the calibration."""
    for r in result["runs"].values():
        extra = (f", predicted {r['predicted_tokens_per_s']:.1f} ({r['predicted_error']:+.0%})"
                 if "predicted_tokens_per_s" in r else f", mean depth {r['mean_depth']:.2f}")
        print(f"[bench] serve depth {r['depth']!s:>7}: {r['tokens_per_s']:.1f} tok/s, "
              f"x{r['speedup']:.2f}, tau {r['acceptance_length']:.2f}, decode "
              f"{r['decode_tokens_per_s']:.1f} tok/s{extra}, identical {r['identical_to_depth0']}")
    for a, r in result.get("peers", {}).items():
        extra = (f", tau {r['acceptance_length']:.2f}, lookup accepted "
                 f"{r['accepted']}/{r['drafted']}" if r["prompt_lookup_num_tokens"] else "")
        print(f"[bench] serve peer {a}: {r['tokens_per_s']:.1f} tok/s, x{r['speedup']:.2f}, "
              f"decode {r['decode_tokens_per_s']:.1f} tok/s (x{r['decode_speedup']:.2f}){extra}, "
              f"identical {r['identical_prompts']}/{r['prompts']}")
    p = result["planner"]
    print(f"[bench] planner chose depth {p['chosen_depth']}; fastest measured "
          f"{p['two_fastest_measured']}")
    print("[bench] served acceptance by the drafter's chain probability: " + ", ".join(
        f"[{c['chain_prob_from']:g},{c['chain_prob_to']:g}) {c['accepted_rate']:.2f} "
        f"({c['drafts']})" for c in result["calibration"] if c["drafts"]))


def calibration(pairs, edges=(0, .05, .1, .2, .3, .5, .7, .9, 1.0)) -> list[dict]:
    """(chain probability, all accepted) pairs of every drafted position -> per bin of the
    drafter's chain probability: how often the chain through that draft was accepted (a
    calibrated drafter has rate ~ mean_chain_prob)."""
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        got = [(c, hit) for c, hit in pairs if lo <= c < hi or (hi == edges[-1] and c == hi)]
        rows.append({"chain_prob_from": lo, "chain_prob_to": hi, "drafts": len(got),
                     "mean_chain_prob": sum(c for c, _ in got) / len(got) if got else None,
                     "accepted_rate": sum(h for _, h in got) / len(got) if got else None})
    return rows


def _peer_rows(peer_runs: dict, peer_ks: dict, depth0: dict, depth0_outputs: list,
               prompts: int) -> dict:
    """serve.json "peers": each transformers arm's totals against depth 0 of the same run."""
    rows = {}
    for a, s in peer_runs.items():
        tps = s["tokens"] / s["wall_s"]
        decode = (s["tokens"] - prompts) / (s["wall_s"] - s["prefill_s"])
        same = [x == y for x, y in zip(s["outputs"], depth0_outputs)]
        row = {"arm": a, "prompt_lookup_num_tokens": peer_ks[a], "tokens": s["tokens"],
               "wall_s": s["wall_s"], "prefill_s": s["prefill_s"], "tokens_per_s": tps,
               "decode_tokens_per_s": decode, "speedup": tps / depth0["tokens_per_s"],
               "decode_speedup": decode / depth0["decode_tokens_per_s"],
               "prompts": prompts, "identical_prompts": sum(same),
               "identical_to_depth0": all(same) and len(same) == prompts,
               "mismatched_prompts": [j for j, ok in enumerate(same) if not ok],
               "rounds": s["rounds"],
               "acceptance_length": (s["accepted"] + s["rounds"]) / max(1, s["rounds"])}
        if peer_ks[a]:
            row.update(drafted=s["drafted"], accepted=s["accepted"],
                       acceptance_rate=s["accepted"] / max(1, s["drafted"]),
                       mean_drafted=s["drafted"] / max(1, s["rounds"]))
        rows[a] = row
    return rows


def _arm_lines(a1, a2, rows: list[dict], x: str, style: str, color: str, label: str) -> None:
    """One kind of arm across its depths (row[x]): decode tokens/s on a1, tau on a2."""
    xs = [r[x] for r in rows]
    a1.plot(xs, [r["decode_tokens_per_s"] for r in rows], style, color=color,
            label=f"{label} (measured)")
    a2.plot(xs, [r["acceptance_length"] for r in rows], style, color=color, label=label)


def _plot_serve(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = sorted((r for r in result["runs"].values() if isinstance(r["depth"], int)),
                  key=lambda r: r["depth"])
    trees = [r for r in result["runs"].values() if isinstance(r.get("tree_depth"), int)]
    ds = [r["depth"] for r in runs]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(ds, [r["decode_tokens_per_s"] for r in runs], "o-", color="#37a", label="measured")
    a1.plot(ds, [r["predicted_tokens_per_s"] for r in runs], "s--", color="#e83",
            label="predicted (planner)")
    for k, lb in sorted({(r["branches"], r.get("lookup_branch", False)) for r in trees}):
        pts = sorted((r["tree_depth"], r) for r in trees
                     if r["branches"] == k and r.get("lookup_branch", False) == lb)
        name = f"{k} branch{'es' if k > 1 else ''}" + (" + lookup" if lb else "")
        style = dict(color="#2a6" if lb else "#b22", marker="^", ls="-" if k > 1 else ":")
        a1.plot([d for d, _ in pts], [r["decode_tokens_per_s"] for _, r in pts], **style,
                label=f"{name} (tree, measured)")
        a2.plot([d for d, _ in pts], [r["acceptance_length"] for _, r in pts], **style,
                label=f"{name} (tree)")
    for kind, color in (("parallel", "#d6a"), ("block", "#e80")):
        key = f"{kind}_depth"
        arms = sorted((r for r in result["runs"].values() if key in r), key=lambda r: r[key])
        if arms:
            _arm_lines(a1, a2, arms, key, "D-", color, f"{kind} drafter")
            a1.plot([r[key] for r in arms], [r["predicted_tokens_per_s"] for r in arms],
                    "d:", color=color, label=f"{kind} drafter (predicted)")
    look = sorted((r for r in result["runs"].values() if isinstance(r.get("lookup_depth"), int)),
                  key=lambda r: r["lookup_depth"])
    if look:
        _arm_lines(a1, a2, look, "lookup_depth", "v-", "#63a", "with lookup fallback")
    dyn = result["runs"].get("dynamic")
    dyn_look = result["runs"].get("dynamic-lookup")
    if dyn_look:
        a1.axhline(dyn_look["decode_tokens_per_s"], color="#63a", ls=":",
                   label=f"dynamic depth + lookup (mean {dyn_look['mean_depth']:.1f})")
    if dyn:
        a1.axhline(dyn["decode_tokens_per_s"], color="#3a5", ls=":",
                   label=f"dynamic depth (mean {dyn['mean_depth']:.1f})")
    peers = list(result.get("peers", {}).values())      # transformers' arms: horizontal lines
    styles = [("#777", "-."), ("#a3c", "--"), ("#c39", ":"), ("#5aa", "-.")]
    for j, r in enumerate(peers):
        color, ls = styles[j % len(styles)]
        k = r["prompt_lookup_num_tokens"]
        label = f"HF prompt lookup k={k}" if k else "HF generate (no speculation)"
        a1.axhline(r["decode_tokens_per_s"], color=color, ls=ls, lw=1,
                   label=f"{label}, identical {r['identical_prompts']}/{r['prompts']}")
        if k:
            a2.axhline(r["acceptance_length"], color=color, ls=ls, lw=1, label=label)
    if peers:                                              # room above the lines for the legend
        top = max([r["decode_tokens_per_s"]
                   for r in peers + runs + trees + look + [x for x in (dyn, dyn_look) if x]]
                  + [r["predicted_tokens_per_s"] for r in runs])
        a1.set_ylim(0, top * 1.7)
    sim = result.get("simulated_interconnect")
    a1.set_xlabel("speculation depth"), a1.set_ylabel("decode tokens/s")
    a1.set_title(f"{'SIMULATED ' + sim if sim else 'this machine'}: planner chose depth "
                 f"{result['planner']['chosen_depth']}", fontsize=9)
    a2.plot(ds, [r["acceptance_length"] for r in runs], "o-", color="#a52", label="measured")
    a2.plot(ds, [r["predicted_acceptance_length"] for r in runs], "s--", color="#e83",
            label="from per-position acceptance")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("tokens per verify round")
    a2.set_title(f"drafter ttt_steps={result['drafter_ttt_steps']}; outputs identical: "
                 f"{result['all_identical']}", fontsize=9)
    for a in (a1, a2):
        a.set_xticks(ds), a.grid(alpha=0.3), a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
