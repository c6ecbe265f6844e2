"""What a run keeps: the train state a Ray checkpoint holds (weights, AdamW, step, epoch, the
sample ids consumed this epoch) and its save/load, the report every worker makes (a Ray
barrier; rank 0 attaches the checkpoint), the metrics log (metrics.jsonl/.csv, rewritten whole,
so a resume rewinds it) and the final drafter directory with its accuracy plot (rank 0).

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
import tempfile
from dataclasses import asdict

import pyarrow as pa
import torch

from eagle3_ray.data import schema
from eagle3_ray.train import checkpoint, draft, ttt
from eagle3_ray.train.config import VERIFIER_FIELDS, TrainConfig


def unwrap(model):
    return getattr(model, "module", model)


def full_state(model, opts=None, everywhere: bool = False) -> tuple[dict, dict]:
    """Whole (unsharded) model and optimizer state dicts (one dict for all of `opts`, a list of
    optimizers), keyed by parameter name, DDP or FSDP alike; a collective: every worker calls
    it. Only rank 0 gets them unless `everywhere`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, get_state_dict)
    if not dist.is_initialized():                  # a plain module, one process
        return model.state_dict(), get_optimizer_state_dict(model, opts) if opts else {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    if opts is None:
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, opts, options=options)


def save_train_state(d: str, weights: dict, opt_state: dict, state: dict) -> None:
    """Whole state dicts (full_state) -> a checkpoint directory."""
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()
               if k != "embed_tokens.weight"},  # frozen, the verifier's: rebuilt on load
              os.path.join(d, "model.safetensors"))
    torch.save(opt_state, os.path.join(d, "optimizer.pt"))
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump(state, f)


RESUME_FIXED = ("layer", "fc_norm", "norm_output", "drafting")   # DraftConfig fields a resume keeps


def load_train_state(d: str, model, opts) -> dict:
    """A checkpoint directory -> the model (DDP or FSDP: each worker takes its shard) and
    optimizers; returns the loop state."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    with open(os.path.join(d, "state.json")) as f:
        state = json.load(f)
    c = unwrap(model).config   # a shape no weight shows (norm_output) is checked here
    changed = {k: [v, getattr(c, k)] for k, v in (state.get("draft_shape") or {}).items()
               if v != getattr(c, k)}
    if changed:
        raise ValueError(f"{d}: the drafter changed since this run began ({{field: [then, now]}}: "
                         f"{changed}); resume with the settings the run started with")
    weights = load_file(os.path.join(d, "model.safetensors"))
    checkpoint.check_names(unwrap(model), weights, d)
    set_state_dict(model, opts, model_state_dict=weights,
                   optim_state_dict=torch.load(os.path.join(d, "optimizer.pt"), weights_only=True),
                   options=StateDictOptions(full_state_dict=True, strict=False))
    return state


def checkpoint_name(state: dict) -> str:
    """step_<step>; a second checkpoint of the same step (the end of an epoch whose last step
    was checkpointed already) gets its own name: Ray Train deletes old ones by path."""
    name = f"step_{state['step']:07d}"
    if (state.get("last_checkpoint") or [None])[0] == state["step"]:
        name += f"-epoch{state['epoch']}"
    state["last_checkpoint"] = [state["step"], state["epoch"]]
    return name


def report(cfg, rank, state, metrics, model, opts, with_checkpoint: bool):
    """ray.train.report on every worker (a barrier); rank 0 attaches the checkpoint."""
    import ray.train
    if rank == 0:
        write_metrics(cfg.output, state["history"])
    weights, opt_state = full_state(model, opts) if with_checkpoint else ({}, {})
    if with_checkpoint and rank == 0:
        name = checkpoint_name(state)
        with tempfile.TemporaryDirectory() as d:
            save_train_state(d, weights, opt_state, state)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d),
                             checkpoint_dir_name=name)
    else:
        ray.train.report(metrics)


def result_state(result) -> dict:
    """The loop state (step, epoch, history, ...) of a fit's last checkpoint."""
    with result.checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        return json.load(f)


def write_metrics(output: str, history: list[dict]) -> None:
    """metrics.jsonl and metrics.csv in the run dir, rewritten whole (works on URIs too)."""
    fs, root = schema.resolve_fs(output)
    schema.write_bytes_atomic(fs, f"{root}/metrics.jsonl",
                              "".join(json.dumps(m) + "\n" for m in history).encode())
    keys = sorted({k for m in history for k in m}, key=lambda k: (k.count("_"), k))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["step"] + [k for k in keys if k != "step"])
    w.writeheader()
    w.writerows(history)
    schema.write_bytes_atomic(fs, f"{root}/metrics.csv", buf.getvalue().encode())


def plot_metrics(history: list[dict], path: str) -> None:
    """Per-position accuracy and estimated acceptance length vs depth (last eval, else train)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    m = next((h for h in reversed(history) if "eval/acc_0" in h), history[-1] if history else None)
    if m is None:
        return
    prefix = "eval/" if "eval/acc_0" in m else "train/"
    steps = sum(1 for _ in itertools.takewhile(lambda i: f"{prefix}acc_{i}" in m,
                                                itertools.count()))   # eval: the probe too
    acc = [m[f"{prefix}acc_{i}"] for i in range(steps)]
    cond = [m[f"{prefix}cond_acc_{i}"] for i in range(steps)]
    tau = ttt.accept_lengths(cond)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot(range(steps), acc, "o-", label="accuracy")
    a1.plot(range(steps), cond, "s--", label="conditional accuracy")
    a1.set_xlabel("draft position k"), a1.set_ylim(0, 1), a1.legend(), a1.grid(alpha=.3)
    a1.set_title(f"{prefix.rstrip('/')} per-position accuracy, step {m['step']}")
    a2.plot(range(steps + 1), tau, "o-")
    a2.set_xlabel("speculation depth"), a2.set_ylabel("E[accepted + 1]"), a2.grid(alpha=.3)
    a2.set_title("estimated acceptance length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(cfg: TrainConfig, setup: dict, weights: dict, state: dict) -> None:
    """The final drafter directory + accuracy/acceptance plot (rank 0)."""
    final = next((m for m in reversed(state["history"]) if "eval/accept_len" in m),
                 state["history"][-1] if state["history"] else {})
    meta = {"ttt_steps": cfg.ttt_steps, "step_weight_decay": cfg.step_weight_decay,
            "deep_fraction": cfg.deep_fraction, "drafting": cfg.drafting,
            "steps": state["step"], "dataset": cfg.dataset,
            "dataset_manifest_hash": setup["manifest_hash"],
            "verifier": cfg.verifier,
            "verifier_facts": {k: setup["manifest"]["facts"].get(k) for k in VERIFIER_FIELDS},
            "final_metrics": final, "train_config": asdict(cfg)}
    state_dict = {k: v.detach().cpu() for k, v in weights.items()}
    dcfg = draft.DraftConfig(**setup["draft_config"])
    fs, root = schema.resolve_fs(cfg.output)
    local = isinstance(fs, pa.fs.LocalFileSystem)
    with tempfile.TemporaryDirectory() as d:  # a remote run dir: write here, then upload
        out = os.path.join(root if local else d, "drafter")
        checkpoint.save_drafter(out, state_dict, dcfg, meta)  # atomic, replaces an older one
        plot_metrics(state["history"], os.path.join(out, "accuracy.png"))
        if not local:
            fs.create_dir(f"{root}/drafter", recursive=True)
            pa.fs.copy_files(out, f"{root}/drafter", source_filesystem=pa.fs.LocalFileSystem(),
                             destination_filesystem=fs)
