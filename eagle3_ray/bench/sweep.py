"""Recipe sweep: TrainConfig variants trained side by side for equal minutes, no Ray.

Each arm is a fresh process with one torch thread that builds the drafter as `train` does
(draft vocab, init), runs the same step (loop.train_step: kinds.loss, AdamW, the lr and depth
schedules of config.py) on the dataset's train split through ParquetShard, for `minutes` of
training, then evaluates teacher-forced on the held-out split (the verifier's argmax as the
target, `eval_depth` positions). Arms run `parallel` at a time, one core each, so the arms of a
group see the same host load and are compared as ratios; one process and one thread per arm
also keeps Ray and DDP out of what is measured. `--served` keeps each arm's drafter
(<out>/<name>/<arm>/drafter) and measures its served acceptance in the arm's process: the real
decoder, greedy, on held-out prompts (quality.served_acceptance). `--snapshots M ...` also keeps
each arm's drafter as it was after M training minutes (<out>/<name>/<arm>/drafter-<M>min), for a
curve evaluated afterwards without taking time from the arms.

    eagle3-ray bench sweep --dataset runs/bench/data/orig --minutes 2 \
        --arm previous targets=soft draft_vocab_size=8192 --arm default \
        --served --served-prompts 2 --served-tokens 32
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

import torch

from eagle3_ray.data import schema
from eagle3_ray.train import draft, kinds, trainer as train, ttt
from eagle3_ray.train.config import TrainConfig, autocast, autocast_dtype
from eagle3_ray.train.feed import ParquetShard, collate
from eagle3_ray.train.loop import MetricSums, build_for_training, make_optimizers, train_step


def train_arm(dataset: str, overrides: dict, minutes: float, eval_depth: int = 4,
              drafter_dir: str = "", served_prompts: int = 0, served_tokens: int = 64,
              snapshots: list[float] = ()) -> dict:
    """One arm in this process: train for `minutes` (or the arm's own max_minutes), evaluate
    held-out -> metrics. drafter_dir: save the drafter there, and as it was after each of
    `snapshots` training minutes beside it (drafter-<M>min); served_prompts > 0: also decode
    that many held-out prompts with it (quality.served_acceptance; needs drafter_dir)."""
    minutes = float(overrides.get("max_minutes", minutes))    # e.g. a 2x-budget arm
    with tempfile.TemporaryDirectory() as run_dir:     # prepare() writes vocab.json there
        cfg = replace(TrainConfig(dataset=dataset, output=run_dir),
                      **{**overrides, "max_minutes": minutes}, max_steps=10**9)
        setup = train.prepare(cfg)                     # the checks and draft vocab of `train`
    cfg = replace(cfg, output="")                      # nothing is written for an arm
    torch.manual_seed(cfg.seed)
    manifest, dcfg = setup["manifest"], draft.DraftConfig(**setup["draft_config"])
    column = train.vocab_column(schema.stores_target_ids(manifest))
    drafter, teacher = build_for_training(cfg, setup, teacher_check=False)
    parts = [f["uri"] for f in manifest["files"]]
    shard = ParquetShard(parts, cfg.eval_fraction, False, 0, 1)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opts = make_optimizers(cfg, drafter)
    amp = autocast_dtype(cfg.precision, False)
    teacher = teacher.to(amp or torch.float32)
    step = tokens = epoch = 0
    t0, train_s = time.monotonic(), 0.0
    pending = sorted(m for m in snapshots if m < minutes) if drafter_dir else []

    def save(directory: str, **extra) -> str:
        from eagle3_ray.train import checkpoint
        state = {k: v.detach() for k, v in drafter.state_dict().items()}
        meta = {"ttt_steps": cfg.ttt_steps, "steps": step, "dataset": dataset,
                "verifier": cfg.verifier, "train_config": asdict(cfg), "train_s": train_s,
                **extra}
        return checkpoint.save_drafter(directory, state, dcfg, meta)

    while train_s < 60 * minutes:
        shard.set_epoch(cfg.seed, epoch)
        for batch in shard.iter_batches(cfg.batch_size):
            b = collate(batch, dcfg.hidden_size, cfg.max_seq_len)
            train_step(cfg, drafter, opts, params, teacher, b, step, train_s,
                       torch.device("cpu"), amp)
            step, tokens = step + 1, tokens + int(b["attention_mask"].sum())
            train_s = time.monotonic() - t0
            if pending and train_s >= 60 * pending[0]:    # saving is left out of the clock
                save(os.path.join(os.path.dirname(drafter_dir), f"drafter-{pending.pop(0):g}min"))
                t0 = time.monotonic() - train_s
            if train_s >= 60 * minutes:
                break
        epoch += 1
    drafter.eval()
    sums = MetricSums(eval_depth)
    with torch.no_grad(), autocast(torch.device("cpu"), amp):
        for batch in ParquetShard(parts, cfg.eval_fraction, True, 0, 1).iter_batches(4):
            b = collate(batch, dcfg.hidden_size, cfg.max_seq_len)
            loss, m = kinds.loss(drafter, teacher, b, eval_depth, step_weight_decay=1.0,
                                 targets="hard", evaluating=True)
            sums.add(m, float(loss), int(b["attention_mask"].sum()))
    ev = sums.summarize(sums.t, "eval/")       # the keys of train's final_metrics
    cond = [ev[f"eval/cond_acc_{i}"] for i in range(eval_depth)]
    out = {"overrides": overrides, "steps": step, "epochs": epoch, "train_s": train_s,
           "tokens_per_s": tokens / max(train_s, 1e-9), "counted": column,
           "acc": [ev[f"eval/acc_{i}"] for i in range(eval_depth)], "cond_acc": cond,
           "in_vocab": ev["eval/in_vocab_0"], "tau_by_depth": ttt.accept_lengths(cond),
           "eval_positions": ev["eval/count_0"], "config": asdict(cfg)}
    if drafter_dir:   # final_metrics as train writes them: serve's dynamic depth starts from them
        out["drafter"] = save(drafter_dir, sweep_metrics=out,
                              final_metrics={"step": step, "train_s": train_s, **ev})
    if served_prompts:
        from eagle3_ray.bench import quality
        out["served"] = quality.served_acceptance(drafter_dir, served_prompts, served_tokens)
    return out


def _spawn(dataset: str, name: str, overrides: dict, minutes: float, eval_depth: int,
           drafter_dir: str, served: tuple[int, int], snapshots: list[float]):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eagle3_ray.bench.sweep", "--worker", dataset,
           json.dumps(overrides), str(minutes), str(eval_depth), drafter_dir, str(served[0]),
           str(served[1]),
           json.dumps(list(snapshots))]
    return name, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)


def run(dataset: str, arms: dict[str, dict], minutes: float = 10.0, parallel: int = 2,
        eval_depth: int = 4, out_dir: str = "runs/bench", name: str = "sweep",
        served_prompts: int = 0, served_tokens: int = 64, snapshots: list[float] = ()) -> dict:
    """Every arm ({name: TrainConfig overrides}) for `minutes` (an arm's max_minutes override
    sets its own budget and lr schedule), `parallel` at a time (one core each).
    served_prompts > 0: each arm's drafter is kept (<out_dir>/<name>/<arm>/drafter) and
    decodes that many held-out prompts × served_tokens through the real decoder, in the arm's
    own process (served acceptance), and with `snapshots` (minutes) also as it was at each
    (<out_dir>/<name>/<arm>/drafter-<M>min). An arm may set its own `dataset=DIR` (e.g. original
    against regenerated answers); its teacher-forced figures are then on that dataset's
    held-out split. Writes <out_dir>/<name>.json + .png."""
    from eagle3_ray.bench import stages as bench
    data_of = {n: schema.absolute(o.get("dataset", dataset)) for n, o in arms.items()}
    items, runs = list(arms.items()), {}
    served = (served_prompts, served_tokens)
    keep = lambda arm: (os.path.join(out_dir, name, arm, "drafter")
                        if served_prompts or snapshots else "")
    for i in range(0, len(items), parallel):
        group = [_spawn(data_of[n], n, {k: v for k, v in o.items() if k != "dataset"},
                        minutes, eval_depth, keep(n), served, snapshots)
                 for n, o in items[i:i + parallel]]
        for arm, proc in group:
            out, err = proc.communicate()
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise RuntimeError(f"sweep arm {arm!r} failed:\n{err[-3000:]}")
            runs[arm] = {"group": i // parallel, "dataset": data_of[arm],
                         **json.loads(line[-1][len("RESULT "):])}
            r = runs[arm]
            print(f"[sweep] {arm}: {r['steps']} steps, {r['tokens_per_s']:.0f} tok/s, held-out "
                  f"acc0 {r['acc'][0]:.3f}, tau({eval_depth}) {r['tau_by_depth'][-1]:.2f}, "
                  f"in vocab {r['in_vocab']:.3f}" + (
                      f"; served acc0 {r['served']['acceptance_per_position'][0]:.3f}, "
                      f"tau(8) {r['served']['tau_by_depth'][8]:.2f}" if "served" in r else ""),
                  flush=True)
    result = {"bench": name, "dataset": schema.absolute(dataset), "minutes": minutes,
              "parallel": parallel, "threads_per_arm": 1, "host": bench.host_flags(), "runs": runs,
              "note": "teacher-forced: held-out split of the dataset, target = the verifier's "
                      "argmax (a target outside the draft vocab counts as a miss); served: the "
                      "real decoder, greedy, held-out prompts (quality.served_acceptance); arms "
                      "of one group ran side by side, one core each"}
    bench.save_result(out_dir, name, result, plot)
    print(f"[sweep] -> {out_dir}/{name}.json, {out_dir}/{name}.png")
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["runs"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
    a1.barh(names, [r["acc"][0] for r in result["runs"].values()], color="#37a")
    a1.set_xlabel("held-out position-0 accuracy (teacher-forced)")
    a2.barh(names, [r["tokens_per_s"] for r in result["runs"].values()], color="#a52")
    a2.set_xlabel("training tokens/s (one core)")
    a1.set_title(f"{result['minutes']} min per arm, host {' '.join(result['host'])}", fontsize=8)
    for a in (a1, a2):
        a.grid(alpha=.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    torch.set_num_threads(1)
    res = train_arm(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                    sys.argv[6], int(sys.argv[7]), int(sys.argv[8]), json.loads(sys.argv[9]))
    print("RESULT " + json.dumps(res), flush=True)
