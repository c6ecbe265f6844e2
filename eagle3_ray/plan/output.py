"""What a plan says and writes: the plain-words reasons (why a depth, why a drafter kind, why
two nodes differ), the tables printed on stdout (a plan, a --sweep, a --sweep-kinds), the
speedup / round-time plot, and the files `eagle3-ray plan` writes to its --out dir. Everything
here reads plan results (cost.plan, cost.choose_drafting, the sweeps, load.depth_schedule) and
a profile's fields; nothing here prices a round.

    eagle3-ray plan --acceptance 0.8,0.75,0.7 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --out /tmp/plan                          # CPU, a second: plan.json, plan.png, a table
"""
from __future__ import annotations

import json
import os

from eagle3_ray.plan.profiles import NodeProfile, message_bytes


def kind_summary(result: dict) -> dict:
    """The best row of a plan() result, the fields a drafting choice is argued from (accept_len:
    E[τ], the tokens a round yields at the best depth)."""
    b = result["best"]
    return {"drafting": result["drafting"], "best_depth": result["best_depth"],
            "speedup": b["speedup"], "tokens_per_s": b["tokens_per_s"],
            "accept_len": b["accept_len"], "round_ms": b["round_ms"], "draft_ms": b["draft_ms"],
            "draft_comm_ms": b["draft_comm_ms"], "draft_collectives": b["draft_collectives"]}


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


def _forwards(drafting: str, depth: int, block: dict | None) -> str:
    """A round's drafter forwards at `depth`, in words."""
    if drafting == "parallel":
        return f"one forward of {depth} tokens"
    if drafting == "block":
        return f"one forward of {depth + 1} tokens through {block['layers']} layers"
    return f"{depth} drafter forward{'s' if depth > 1 else ''}"


def why(result: dict, profile: NodeProfile) -> str:
    """A plain-words reason for the best depth: where a round's time goes at depth 0 and at the
    best depth, and what one more draft position would buy."""
    rows, b = result["depths"], result["best_depth"]
    r0, rb = rows[0], rows[b]
    ic = profile.interconnect
    # one all-reduce of one token: a depth-0 round verifies one token with N_ar of them
    ar_us = r0["comm_ms"] * 1e3 / ic.allreduces_per_forward if ic.allreduces_per_forward else 0.0
    one = (f"{ar_us:.0f} us each for {_kb(message_bytes(profile, 1))} (measured curve)"
           if ic.allreduce_us else f"{ic.latency_us:g} us latency")
    lines = [f"{profile.name}{' (SIMULATED interconnect)' if profile.simulated else ''}: "
             f"a depth-0 round costs {r0['round_ms']:.2f} ms, {r0['comm_ms'] / r0['round_ms']:.0%} "
             f"of it communication ({ic.allreduces_per_forward} all-reduces x "
             f"{one} on {profile.gpus} GPUs)."]
    if b and rb["draft_collectives"]:
        kind, block = result.get("drafting", "chain"), result.get("block")
        per = block["collectives_per_forward"] if block else profile.draft_collectives
        lines.append(f"Drafting ({kind}, {_forwards(kind, b, block)}) pays "
                     f"{rb['draft_collectives']} collectives ({rb['draft_comm_ms']:.2f} ms of its "
                     f"{rb['draft_ms']:.2f} ms) at the best depth: the drafter runs "
                     f"tensor-parallel, {per} per forward.")
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



def _ranges_text(schedule: list[list[int]]) -> str:
    return ", ".join(f"{a}-{b}: {k}" if a != b else f"{a}: {k}" for a, b, k in schedule)


def format_schedule(result: dict) -> str:
    """A load.depth_schedule() result: the ranges (vLLM's num_speculative_tokens_per_batch_size)
    and tokens/s at a few batch sizes with the schedule's depth and with none."""
    lines = [f"depth by batch size on {result['profile']}, {result['drafting']} drafting "
             f"(vLLM num_speculative_tokens_per_batch_size; batch: depth):",
             f"  {_ranges_text(result['schedule'])}",
             f"  num_speculative_tokens {result['num_speculative_tokens']}"
             + ("" if result["batch_surface"] else " (batch 1 only: no verify_batch_ms)")
             + (f"; priced on {result['round_engine']}'s own rounds (depth 0: without a "
                f"drafter)" if result.get("round_engine") else ""),
             f"  {'batch':>5} {'depth':>5} {'E[tau]':>6} {'round ms':>9} {'tok/s':>9} "
             f"{'depth 0':>9} {'gain':>6}"]
    for r in result["rows"]:
        lines.append(f"  {r['batch']:>5} {r['depth']:>5} {r['accept_len']:>6.2f} "
                     f"{r['round_ms']:>9.2f} {r['tokens_per_s']:>9.1f} "
                     f"{r['tokens_per_s_depth0']:>9.1f} {r['gain']:>6.2f}")
    return "\n".join(lines)


def format_sweep_schedules(result: dict) -> str:
    """load.sweep_schedules() as Markdown: per acceptance level, each profile's schedule."""
    names = result["profiles"]
    lines = ["| a (every position) | " + " | ".join(f"schedule (batch: depth), {n}"
                                                   for n in names) + " |",
             "|" + "---|" * (1 + len(names))]
    for row in result["rows"]:
        lines.append(f"| {row['acceptance']:g} | " + " | ".join(
            _ranges_text(row[n]["schedule"]) for n in names) + " |")
    return "\n".join(lines)


# --- which kind --------------------------------------------------------------------------------

def _drafting_text(k: dict) -> str:
    d = k["best_depth"]
    forwards = ("no drafting" if not d else
                f"{d} forward{'s' if d > 1 else ''}" if k["drafting"] == "chain" else
                f"1 forward of {d} tokens" if k["drafting"] == "parallel" else
                f"1 forward of {d + 1} tokens")
    return (f"{k['drafting']}: drafting {k['draft_ms']:.2f} ms ({forwards}, "
            f"{k['draft_collectives']} collectives = {k['draft_comm_ms']:.2f} ms)")


def _at_best(k: dict) -> str:
    return (f"{k['drafting']} at depth {k['best_depth']} (x{k['speedup']:.2f}, E[tau] "
            f"{k['accept_len']:.2f} in {k['round_ms']:.2f} ms)")


# what a what-if's kind's own drafter would do differently, said with the what-if
OWN_ACCEPTANCE = {"parallel": "a parallel drafter's is lower: it does not see its own earlier "
                              "drafts",
                  "chain": "a parallel drafter's is lower: it does not see its own earlier "
                           "drafts",
                  "block": "a block drafter's is higher: several layers, the verifier's states "
                           "in each, no feeding on its own guesses"}


def decided_text(decided: str, win: dict, run: dict) -> str:
    """choose_drafting's decided_by in words: what the winner's best depth has over the
    runner-up's."""
    if decided == "tie":
        return "a tie: the same tokens/s either way (a tie goes to the chain, then parallel)"
    if decided == "acceptance":
        return (f"ACCEPTANCE decided: {win['drafting']} yields more tokens a round at its best "
                f"depth (E[tau] {win['accept_len']:.2f} against {run['accept_len']:.2f}; rounds "
                f"{win['round_ms']:.2f} against {run['round_ms']:.2f} ms)")
    return (f"COST decided: {win['drafting']} yields no more tokens a round (E[tau] "
            f"{win['accept_len']:.2f} against {run['accept_len']:.2f}) but its round costs "
            f"{win['round_ms']:.2f} ms against {run['round_ms']:.2f}")


def why_drafting(choice: dict) -> str:
    """The reason for choose_drafting()'s choice, in plain words: each kind's best depth, speedup
    and tokens per round, whether acceptance or cost decided against the runner-up
    (decided_by), and what swapping their curves says (_attribution)."""
    kinds, win = choice["kinds"], choice["kinds"][choice["choice"]]
    head = _at_best(win)
    if len(kinds) == 1:
        other, w = next(iter(choice["what_if"].items()))
        ws = kind_summary(w)
        return (f"Only {win['drafting']} acceptance given: {head}; {_drafting_text(win)}. "
                f"WHAT-IF, not a choice: the same acceptance drafted {other} would serve depth "
                f"{ws['best_depth']} (x{ws['speedup']:.2f}; {_drafting_text(ws)}); a "
                f"{other} drafter's own acceptance would differ ({OWN_ACCEPTANCE[other]}). "
                f"Give both to choose.")
    run = kinds[choice["runner_up"]]
    rest = [kinds[k] for k in choice["ranking"][1:]]
    att = choice["attribution"]
    because = decided_text(choice["decided_by"], win, run)
    if att["dominated"] != "tie":
        lose = run["drafting"]
        because += (f"; swapping the two curves, {att['dominated']} dominated: the "
                    f"{win['drafting']} drafter's acceptance drafted as a {lose} would give "
                    f"x{att['acceptance_gain']:.2f} the {lose}'s tokens/s, {win['drafting']} "
                    f"drafting at the {lose}'s acceptance x{att['cost_gain']:.2f}")
    return (f"{head} beats " + " and ".join(_at_best(k) for k in rest) + f": {because}. "
            + "; ".join(_drafting_text(k) for k in [win] + rest) + ".")


# --- tables and plots ----------------------------------------------------------------------------

def format_table(result: dict, compare: dict | None = None) -> str:
    head = (f"{'depth':>5} {'E[tau]':>7} {'round ms':>9} {'draft ms':>8} {'comm %':>6} "
            f"{'tok/s':>8} {'speedup':>7}")
    if compare:
        head += f" | {'tok/s':>8} {'speedup':>7}   ({compare['profile']})"
    layers = f" ({result['block']['layers']} layers)" if result.get("block") else ""
    lines = [f"plan for {result['profile']}, {result.get('drafting', 'chain')} drafting{layers}  "
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
              other_kind: dict | list[dict] | None = None) -> None:
    """Speedup vs depth (best marked, extrapolated acceptance shaded; a second profile dashed,
    the other drafting kinds dotted and dash-dotted) and the round-time breakdown of the first
    profile. other_kind: one plan or a list of them (other kinds, or what-ifs)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    known = result["acceptance"]["known_depth"]
    others = other_kind if isinstance(other_kind, list) else [other_kind]
    styles = [(result, "-", "#37a"), (compare, "--", "#a52")] + [
        (o, style, color) for o, (style, color) in zip(others, ((":", "#6a3"), ("-.", "#96c")))]
    for res, style, color in styles:
        if not res:
            continue
        ds = [r["depth"] for r in res["depths"]]
        label = (f"{res['profile']}{' (simulated)' if res.get('simulated') else ''}, "
                 f"{res.get('drafting', 'chain')}")
        if any(res is o for o in others) and "WHAT-IF" in str(res["acceptance"].get("source", "")):
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



def format_sweep_drafting(result: dict) -> str:
    """sweep_drafting() as Markdown: one table per profile."""
    out = []
    for name in result["profiles"]:
        out += [f"{name} ({result['allreduce_model'][name]}):", "",
                "| a (chain) | draft collectives / forward | block's | chain: best depth | "
                "speedup | parallel: best depth | speedup | block: best depth | speedup | "
                "plan picks | "
                "decided by (against the runner-up) | swapping curves (acceptance alone, "
                "drafting alone) | parallel at the chain's acceptance: depth | speedup | "
                "block at the chain's acceptance: depth | speedup |",
                "|" + "---|" * 16]
        for r in (r for r in result["rows"] if r["profile"] == name):
            ch, pa, bl = r["chain"], r["parallel"], r["block"]
            ps, bs = r["parallel_at_chain_acceptance"], r["block_at_chain_acceptance"]
            out.append(f"| {r['acceptance']:g} | {r['draft_collectives']} | "
                       f"{r['block_collectives']} | {ch['best_depth']} | "
                       f"x{ch['speedup']:.2f} | {pa['best_depth']} | x{pa['speedup']:.2f} | "
                       f"{bl['best_depth']} | x{bl['speedup']:.2f} | {r['pick']} | "
                       f"{r['decided_by']} ({r['runner_up']}) | {r['dominated']} "
                       f"(x{r['acceptance_gain']:.2f}, x{r['cost_gain']:.2f}) | "
                       f"{ps['best_depth']} | x{ps['speedup']:.2f} | {bs['best_depth']} | "
                       f"x{bs['speedup']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip()


# --- the --out dir -------------------------------------------------------------------------------

def write_json(out_dir: str, name: str, result: dict) -> str:
    """<out_dir>/<name> (made if missing) holding `result` -> its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def write_plan(out_dir: str, result: dict, compare: dict | None = None,
               others: list[dict] | None = None) -> tuple[str, str]:
    """`eagle3-ray plan`'s files: <out_dir>/plan.json (the chosen kind's plan with its
    drafting choice, comparison and other kinds) and plan.png (plot_plan) -> their paths."""
    path = write_json(out_dir, "plan.json", result)
    png = os.path.join(out_dir, "plan.png")
    plot_plan(result, png, compare, others or None)
    return path, png
