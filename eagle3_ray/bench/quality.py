"""Drafter quality as it is served, and the benches that compare training recipes by it.

served_acceptance: greedy decoding of held-out prompts (ShareGPT conversations that no bench
    trains on) with the real decoder (speculate.Speculator) at depth 16 -> drafted / accepted
    counts per position, conditional acceptance, tau(d) for d = 1..16 and the measured tokens
    per verify round. This is what an engine would accept; the teacher-forced figures of
    training (ttt.py, train.evaluate_drafter) are estimates on the training distribution.
    It refuses a drafter whose training data holds those prompts (check_unseen).
compare: train one drafter per arm (TrainConfig overrides + which dataset) for one equal budget
    (minutes or steps), then report for each: its teacher-forced curve against training
    minutes, held-out teacher-forced metrics at 16 positions, and served acceptance.
    Presets: `bench quality` (ttt_steps 1 / 4 / 8 with the default recipe) and `bench recipe`
    ({random, verifier init} x {original, regenerated responses} at ttt_steps 4).

Datasets come from the embedded ShareGPT: the first N usable conversations, as they are
("orig") or with the verifier's own answers ("regen", extract --regenerate); both resume.

    eagle3-ray bench recipe --samples 48 --steps 20 --served-prompts 2   # a quick CPU run
"""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from eagle3_ray.data import conversations as data, schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import ttt

SERVED_DEPTH = 16


def served_acceptance(drafter_dir: str, prompts: int = 16, max_tokens: int = 96,
                      depth: int = SERVED_DEPTH, spec: str | None = None) -> dict:
    """Greedy speculative decoding of `prompts` held-out prompts at `depth` with the server's
    decoder. -> counts per position, cond_acc (a_k = P(k accepted | 0..k-1 accepted)),
    tau_by_depth[d] = 1 + sum_{i<d} prod_{j<=i} a_j for d = 0..depth, and the measured
    acceptance length (tokens per verify round at `depth`)."""
    from eagle3_ray.plan import planner
    from eagle3_ray.serve import speculate
    from eagle3_ray.train.checkpoint import load_trained_drafter
    drafter, _, meta = load_trained_drafter(drafter_dir, spec)
    check_unseen(drafter_dir, meta)
    spec = spec or meta["verifier"]
    tok, model = verifier.load_tokenizer(spec), verifier.load_verifier(spec)
    dec = speculate.Speculator(model, drafter.eval())
    sp = speculate.SamplingParams(max_tokens=max_tokens, eos_ids=verifier.eos_ids(model, tok))
    drafted, accepted = [0] * depth, [0] * depth
    rounds = tokens = 0
    t0 = time.perf_counter()
    for prompt in data.heldout_prompts(tok, prompts):
        for r in list(dec.generate(prompt, sp, depth))[1:]:      # the first is the prefill
            rounds += 1
            tokens += len(r.tokens)
            for k in range(r.drafted):
                drafted[k] += 1
                accepted[k] += k < r.accepted
    cond = planner.cond_from_counts(drafted, accepted)
    cond += [0.0] * (depth - len(cond))
    return {"prompts": prompts, "max_tokens": max_tokens, "depth": depth, "rounds": rounds,
            "tokens": tokens, "wall_s": time.perf_counter() - t0,
            "drafted_per_position": drafted, "accepted_per_position": accepted,
            "acceptance_per_position": [a / max(1, d) for a, d in zip(accepted, drafted)],
            "cond_acc": cond, "tau_by_depth": ttt.accept_lengths(cond),
            "acceptance_length": (sum(accepted) + rounds) / max(1, rounds)}


def training_slices(meta: dict) -> list[tuple[str, list, int, int | None]]:
    """(where, inputs, first, count) of each conversation source a drafter's meta.json names
    and this machine still has: the datasets it trained on (their manifests' ExtractConfig) and,
    for online training, the run's online/source.json. count None: to the end."""
    out, dataset = [], str(meta.get("dataset") or "")
    offline = dataset and not dataset.startswith("online:")       # online: source.json below
    for uri in schema.dataset_uris(dataset) if offline else []:
        try:
            cfg = schema.read_manifest(uri).get("config") or {}
        except (OSError, ValueError):           # moved, or not on this machine: nothing to check
            continue
        out.append((schema.manifest_path(uri), cfg.get("inputs") or [],
                    cfg.get("sample_offset") or 0, cfg.get("sample_limit")))
    from eagle3_ray.train.online import read_source
    run_dir = (meta.get("train_config") or {}).get("output") or ""
    source, src = read_source(run_dir) if run_dir else ("", None)
    if src is not None:
        out.append((source, src.get("inputs") or [], src.get("skip") or 0, src.get("limit")))
    return out


def check_unseen(drafter_dir: str, meta: dict) -> None:
    """Refuse to score a drafter on the held-out prompts when its training data holds them:
    usable embedded ShareGPT conversations data.HELDOUT_FIRST..HELDOUT_END-1 (`extract --limit
    8000` by hand would take them in). Sources this machine no longer has are not checked."""
    for where, inputs, first, count in training_slices(meta):
        end = first + count if count is not None else float("inf")
        if data.EMBEDDED_SHAREGPT in inputs and first < data.HELDOUT_END \
                and end > data.HELDOUT_FIRST:
            last = "the end" if count is None else f"{end - 1:,}"
            raise ValueError(
                f"{drafter_dir}: trained on {where}: usable embedded ShareGPT conversations "
                f"{first:,} to {last}, which hold the held-out prompts served acceptance decodes "
                f"(conversations {data.HELDOUT_FIRST:,} to {data.HELDOUT_END - 1:,}); its figures "
                f"would not be on unseen prompts. Train on `extract --limit "
                f"{data.HELDOUT_FIRST}` and/or `--skip {data.HELDOUT_END}` data.")


def dataset(root: str, kind: str, conversations: int, max_length: int,
            regen_max_new_tokens: int = 256) -> tuple[str, dict]:
    """<root>/<kind>: the first `conversations` embedded ShareGPT conversations, extracted as
    they are (kind="orig") or with the verifier's greedy answers (kind="regen"). Past the
    first data.HELDOUT_FIRST the rest come from data.HELDOUT_END on (<root>/<kind>-from<END>),
    so the held-out prompts stay out of training; the path is then both, joined by a comma
    (read as one dataset). Resumes. -> (path, its manifest: schema.read_datasets)."""
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    if kind not in ("orig", "regen"):
        raise ValueError(f"data must be orig or regen, got {kind!r}")
    first = min(conversations, data.HELDOUT_FIRST)
    slices = [(kind, 0, first)]
    if conversations > first:
        slices.append((f"{kind}-from{data.HELDOUT_END}", data.HELDOUT_END,
                       conversations - first))
    paths = []
    for name, offset, n in slices:
        paths.append(os.path.join(root, name))
        run_extract(ExtractConfig(
            output=paths[-1], sample_limit=n, sample_offset=offset, max_length=max_length,
            batch_rows=64 if kind == "regen" else 32,     # larger generation batches
            regenerate=kind == "regen", regen_max_new_tokens=regen_max_new_tokens))
    path = ",".join(paths)
    return path, schema.read_datasets(path)


def _curve(run_dir: str) -> list[dict]:
    """The teacher-forced eval points of a training run against its training minutes."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "eval/acc_0" in m:
                out.append({"step": m["step"], "minutes": m["train_s"] / 60,
                            "acc_0": m["eval/acc_0"], "accept_len": m["eval/accept_len"]})
    return out


def train_arm(name: str, data_dir: str, run_dir: str, overrides: dict, minutes: float,
              steps: int, max_length: int, eval_every: int, served: dict) -> dict:
    """Train (or resume) one arm's drafter, then evaluate it teacher-forced and served."""
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import evaluate_drafter, run_train
    cfg = dict(dataset=data_dir, output=run_dir, max_steps=steps or 1_000_000,
               max_minutes=minutes if not steps else 0, max_seq_len=max_length,
               eval_every=eval_every, log_every=25, checkpoint_every=200, eval_fraction=0.05,
               num_workers=2, cpus_per_worker=0.5)
    cfg.update(overrides)
    t0 = time.perf_counter()
    run_train(TrainConfig(**cfg))
    train_s = time.perf_counter() - t0
    drafter = os.path.join(run_dir, "drafter")
    meta = json.load(open(os.path.join(drafter, "meta.json")))
    ev = evaluate_drafter(drafter, data_dir, SERVED_DEPTH, eval_fraction=0.05,
                          max_seq_len=max_length)
    cond = [ev[f"cond_acc_{i}"] for i in range(SERVED_DEPTH)]
    s = served_acceptance(drafter, **served)
    row = {"arm": name, **overrides, "steps": meta["steps"], "train_wall_s": train_s,
           "train_loop_s": meta["final_metrics"].get("train_s"),
           "teacher_forced": {"acc": [ev[f"acc_{i}"] for i in range(SERVED_DEPTH)],
                              "cond_acc": cond, "in_vocab": ev["in_vocab_0"],
                              "tau_by_depth": ttt.accept_lengths(cond)},
           "served": s, "curve": _curve(run_dir)}
    tf, sv = row["teacher_forced"], row["served"]
    print(f"[bench] {name}: {meta['steps']} steps in {train_s:.0f}s; teacher-forced acc0 "
          f"{tf['acc'][0]:.3f}, tau(8) {tf['tau_by_depth'][8]:.2f}; served acc0 "
          f"{sv['cond_acc'][0]:.3f}, cond 1-7 {[round(a, 2) for a in sv['cond_acc'][1:8]]}, "
          f"tau(8) {sv['tau_by_depth'][8]:.2f}, tau(16) {sv['tau_by_depth'][16]:.2f}", flush=True)
    return row


def compare(name: str, arms: dict[str, dict], conversations: int = 1200, max_length: int = 512,
            minutes: float = 10.0, steps: int = 0, out_dir: str = "runs/bench",
            fresh: bool = False, eval_every: int = 100, served_prompts: int = 16,
            served_tokens: int = 96, regen_conversations: int | None = None) -> dict:
    """One drafter per arm ({arm: TrainConfig overrides, plus "data": orig|regen}), each for
    `steps` optimizer steps if > 0, else `minutes` of training. The regenerated dataset takes
    the first `regen_conversations` (default: `conversations`): on CPU regeneration costs ~30x
    a plain extraction per conversation. Finished runs are reused unless fresh. Writes
    <out_dir>/<name>.json + .png."""
    root = os.path.join(out_dir, name)
    data_root = os.path.join(out_dir, "data")        # shared by every comparison
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    datasets = {}
    for arm in arms.values():
        d = arm.get("data", "orig")
        if d not in datasets:
            t1 = time.perf_counter()
            n = regen_conversations or conversations if d == "regen" else conversations
            path, manifest = dataset(data_root, d, n, max_length)
            datasets[d] = {"path": path, "extract_s": time.perf_counter() - t1,
                           "conversations": n,
                           **{k: manifest["summary"][k] for k in ("samples", "tokens",
                                                                  "loss_tokens", "skipped")}}
    served = {"prompts": served_prompts, "max_tokens": served_tokens}
    runs = {}
    for arm_name, arm in arms.items():
        overrides = {k: v for k, v in arm.items() if k != "data"}
        d = arm.get("data", "orig")
        runs[arm_name] = {"data": d, **train_arm(
            arm_name, datasets[d]["path"], os.path.join(root, arm_name), overrides, minutes,
            steps, max_length, eval_every, served)}
    result = {"bench": name, "conversations": conversations, "max_length": max_length,
              "budget": {"steps": steps} if steps else {"minutes": minutes},
              "datasets": datasets, "host": host_flags(), "torch_threads": torch.get_num_threads(),
              "total_s": time.perf_counter() - t0, "runs": runs,
              "note": "teacher_forced: held-out split of the arm's own dataset, unrolled 16 "
                      "positions (positions past ttt_steps are extrapolation; a target outside "
                      "the draft vocab counts as a rejection). served: greedy decoding of "
                      f"{served_prompts} held-out ShareGPT prompts x {served_tokens} tokens "
                      f"with the real decoder at depth {SERVED_DEPTH}; tau_by_depth[d] = 1 + "
                      "sum_{i<d} prod_{j<=i} cond_acc_j. curve: teacher-forced held-out eval "
                      "during training against training minutes."}
    from eagle3_ray.bench.stages import save_result
    save_result(out_dir, name, result, plot_compare)
    print(f"[bench] {name} -> {out_dir}/{name}.json, {out_dir}/{name}.png")
    return result


def host_flags() -> list[str]:
    """bench.host_flags: the CPU flags that decide the fast paths here and the variables that
    cap them, as a short label."""
    from eagle3_ray.bench import stages as bench
    return bench.host_flags()


def quality_arms(ttt_list=(1, 4, 8), **recipe) -> dict[str, dict]:
    """bench quality: the same recipe at each ttt_steps."""
    return {f"ttt{k}": {**recipe, "ttt_steps": k} for k in ttt_list}


def recipe_arms(ttt_steps: int = 4, **recipe) -> dict[str, dict]:
    """bench recipe: {random, verifier init} x {original, regenerated responses}."""
    return {f"{init}-{data}": {**recipe, "ttt_steps": ttt_steps, "init": init, "data": data}
            for data in ("orig", "regen") for init in ("random", "verifier")}


def plot_compare(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for i, (name, r) in enumerate(result["runs"].items()):
        color = f"C{i}"
        tau_s, tau_t = r["served"]["tau_by_depth"], r["teacher_forced"]["tau_by_depth"]
        a1.plot(range(len(r["served"]["cond_acc"])), r["served"]["cond_acc"], "o-", ms=3,
                color=color, label=f"{name} served")
        a1.plot(range(len(r["teacher_forced"]["cond_acc"])), r["teacher_forced"]["cond_acc"],
                "--", color=color, alpha=0.6)
        a2.plot(range(len(tau_s)), tau_s, "o-", ms=3, color=color,
                label=f"{name} ({r['steps']} steps)")
        a2.plot(range(len(tau_t)), tau_t, "--", color=color, alpha=0.6)
        c = r["curve"]
        a3.plot([p["minutes"] for p in c], [p["acc_0"] for p in c], "o-", ms=3, color=color,
                label=name)
    a1.set_xlabel("draft position k"), a1.set_ylabel("conditional acceptance"), a1.set_ylim(0, 1)
    a1.set_title("served (solid) vs teacher-forced (dashed)")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("tokens per round (tau)")
    a2.set_title("acceptance length: served (solid), teacher-forced (dashed)")
    a3.set_xlabel("training minutes"), a3.set_ylabel("held-out acc, position 0 (teacher-forced)")
    a3.set_ylim(0, 1)
    budget = result["budget"]
    a3.set_title(f"{result['bench']}: {budget}, host {' '.join(result['host'])}", fontsize=8)
    for a in (a1, a2, a3):
        a.grid(alpha=.3), a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
