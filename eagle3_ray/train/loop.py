"""The Ray Train worker: train_loop_per_worker runs on every worker. It builds the drafter
(kinds.build) and wraps it (DDP, or FSDP2), resumes from Ray's latest checkpoint, then runs
epochs over its data shard (feed.py): one optimizer step per batch (train_step: the lr and
depth schedules of config.py, the kind's loss from kinds.loss, AdamW, clipping), the metrics
all-reduced and reported every `log_every` steps, the held-out eval every `eval_every`, a
checkpoint every `checkpoint_every` (state.py); rank 0 writes the drafter at the end.

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass, field

import torch

from eagle3_ray.data import schema
from eagle3_ray.train import checkpoint, draft, kinds, ttt, vocab
from eagle3_ray.train.config import (TrainConfig, autocast, autocast_dtype, depth_at,
                                     loss_settings, lr_at)
from eagle3_ray.train.feed import (ParquetShard, all_agree, all_dry, all_gather_ids, collate,
                                   data_shard, next_unseen, publish_skip, report_online)
from eagle3_ray.train.state import (RESUME_FIXED, finish, full_state, load_train_state, report,
                                    unwrap, write_metrics)

# The held-out eval unrolls this many steps past ttt_steps and reports them (eval/cond_acc_k
# for k = ttt_steps..): what the drafter does one position deeper than it was trained, measured
# instead of guessed, is the prior serve's dynamic depth starts from (planner.acceptance_from).
# They stay out of eval/loss. A ttt-1 drafter: position 1 held out at ~0.1 where position 0 is
# ~0.45 (docs/benchmarks.md), against 0.9 x position 0 extrapolated.
EVAL_PROBE_STEPS = 1


class MetricSums:
    """ttt.py's additive per-position sums (+ loss, batches, tokens), all-reduced across workers
    before reporting so ratios are never means of means."""

    def __init__(self, steps: int):
        self.steps = steps
        self.reset()

    def reset(self):
        self.t = torch.zeros(len(ttt.COUNT_KEYS) * self.steps + 3, dtype=torch.float64)

    def add(self, m: dict, loss: float, tokens: int):
        """m: one ttt_loss's metrics; a shallower unroll (depth curriculum) adds to its steps."""
        k = self.steps
        for i, key in enumerate(ttt.COUNT_KEYS):
            n = len(m[key])
            self.t[i * k:i * k + n] += torch.tensor(m[key], dtype=torch.float64)
        self.t[-3:] += torch.tensor([loss, 1.0, tokens], dtype=torch.float64)

    def reduce(self, device) -> torch.Tensor:
        """The sums over all workers, on the CPU. The all-reduce runs on `device`: NCCL has no
        CPU tensors (gloo takes both)."""
        t = self.t.to(device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        return t.cpu()

    def summarize(self, t: torch.Tensor, prefix: str) -> dict:
        k = self.steps
        m = ttt.summarize({key: t[i * k:(i + 1) * k].tolist()
                           for i, key in enumerate(ttt.COUNT_KEYS)})
        out = {f"{prefix}loss": float(t[-3] / max(1.0, float(t[-2]))),
               f"{prefix}accept_len": m["accept_len"]}
        for i in range(k):
            out[f"{prefix}acc_{i}"] = m["acc_k"][i]
            out[f"{prefix}cond_acc_{i}"] = m["cond_acc_k"][i]
            out[f"{prefix}p_{i}"] = m["p_k"][i]
            out[f"{prefix}loss_{i}"] = m["loss_k"][i]
            out[f"{prefix}in_vocab_{i}"] = m["in_vocab_k"][i]  # targets the drafter can propose
            out[f"{prefix}count_{i}"] = m["count"][i]   # positions with a target at step i
        return out


def make_optimizers(cfg: TrainConfig, model) -> list[torch.optim.Optimizer]:
    """[AdamW] over `model`'s trainable parameters (a list: the loop, full_state and the
    checkpoints take a list of optimizers)."""
    return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                              weight_decay=cfg.weight_decay, betas=(0.9, 0.95))]


def mapping_from_d2t(d2t: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t_t = torch.tensor(d2t, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab.draft_to_target(d2t_t)] = True
    return d2t_t, t2d


def build_for_training(cfg: TrainConfig, setup: dict, teacher_check: bool):
    """The drafter and teacher a run starts from (before any checkpoint is loaded): the
    draft config and vocab of `setup`, and cfg.init; the model is the drafting kind's
    (kinds.build)."""
    dcfg = draft.DraftConfig(**setup["draft_config"])
    d2t, t2d = mapping_from_d2t(setup["d2t"], dcfg.vocab_size)
    return kinds.build(cfg.verifier, dcfg, d2t, t2d, teacher_check=teacher_check, init=cfg.init)


def fsdp_shard(drafter, device):
    """FSDP2: each worker keeps 1/world of the drafter's parameters, gradients and AdamW state.
    `logits` is called outside forward by the TTT loss, so it unshards the weights as forward
    does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    fully_shard(drafter, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    register_fsdp_forward_method(drafter, "logits")
    return drafter


def train_step(cfg: TrainConfig, model, opts, params, teacher, batch: dict, step: int,
               train_s: float, device, amp_dtype) -> tuple[torch.Tensor, dict, float]:
    """One optimizer step on `batch` at (step, train_s) of the schedule: lr and TTT depth,
    the drafting kind's loss (kinds.loss), backward, clipping, the optimizers
    (make_optimizers). -> (loss, its metrics, lr). The loop around it (data, metrics,
    checkpoints) is train_loop_per_worker's; sweep.py reuses the step."""
    lr = lr_at(cfg, step, train_s)
    for g in (g for opt in opts for g in opt.param_groups):
        g["lr"] = lr
    with autocast(device, amp_dtype):
        loss, m = kinds.loss(model, teacher, batch, depth_at(cfg, step, train_s),
                             **loss_settings(cfg))
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    for opt in opts:
        opt.step()
    return loss, m, lr


def evaluate(model, teacher, cfg, hidden, device, sums: MetricSums, shard) -> dict:
    """Per-position metrics on this worker's eval shard, all-reduced: positions 0..ttt_steps
    (EVAL_PROBE_STEPS past the trained depth, measured, not in eval/loss)."""
    sums.reset()
    inner = unwrap(model)
    inner.eval()
    with torch.no_grad(), autocast(device, autocast_dtype(cfg.precision, cfg.use_gpu)):
        for batch in shard.iter_batches(
                batch_size=cfg.batch_size, batch_format="pyarrow"):
            b = {k: v.to(device) for k, v in collate(batch, hidden, cfg.max_seq_len).items()}
            loss, m = kinds.loss(inner, teacher, b, cfg.ttt_steps + EVAL_PROBE_STEPS,
                                 **loss_settings(cfg), evaluating=True, loss_steps=cfg.ttt_steps)
            sums.add(m, float(loss), int(b["attention_mask"].sum()))
    inner.train()
    return sums.summarize(sums.reduce(device), "eval/")


# --- the worker function ----------------------------------------------------------------------

@dataclass
class Worker:
    """One training worker's fixed parts (start_worker)."""
    cfg: TrainConfig
    setup: dict                      # the driver's make_setup: manifest, draft config, vocab
    rank: int
    world: int
    device: torch.device
    amp_dtype: torch.dtype | None    # autocast dtype (autocast_dtype); None: fp32
    dcfg: draft.DraftConfig
    model: torch.nn.Module           # the trained drafter: DDP- or FSDP-wrapped
    plain: torch.nn.Module           # evaluated: `model` (DDP), or its unsharded twin (FSDP)
    teacher: torch.nn.Module
    opts: list                       # make_optimizers
    params: list                     # model's trainable parameters (gradient clipping)
    sums: MetricSums                 # train metrics since the last report
    eval_sums: MetricSums            # EVAL_PROBE_STEPS deeper
    eval_shard: object = None        # feed.data_shard(..., "eval", ...)


@dataclass
class Clock:
    """The loop's time between steps and reports."""
    budget_s: float                  # training seconds (max_minutes), else inf
    last_report: float               # time.perf_counter() of the last report (tokens/s)
    step_start: float = field(default_factory=time.monotonic)   # where this step's time began
    out_of_time: bool = False        # some worker's training time reached budget_s
    # online: data wait, samples and tokens since the last report, and when that was
    wait: dict = field(default_factory=lambda: {"s": 0.0, "tokens": 0, "samples": 0,
                                                "since": time.monotonic()})


def start_worker(loop: dict) -> Worker:
    """This worker's threads, seed and device; the drafter (DDP, or FSDP with an unsharded twin
    for eval and export), its teacher and optimizers."""
    import ray.train
    import ray.train.torch

    cfg, setup = TrainConfig(**loop["cfg"]), loop["setup"]
    ctx = ray.train.get_context()
    if not cfg.use_gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, ctx.get_local_world_size())))
    torch.manual_seed(cfg.seed)
    dcfg = draft.DraftConfig(**setup["draft_config"])
    stored = schema.stores_target_ids(setup["manifest"])  # then no lm_head rows outside Vd
    drafter, teacher = build_for_training(cfg, setup, teacher_check=not stored)
    device = ray.train.torch.get_device()
    amp_dtype = autocast_dtype(cfg.precision, cfg.use_gpu)
    teacher = teacher.to(device, amp_dtype or torch.float32)  # the teacher's matmuls in bf16 too
    if cfg.parallel == "fsdp":
        plain = copy.deepcopy(drafter).to(device)    # unsharded twin: eval and export
        model = fsdp_shard(drafter.to(device), device)
    else:
        model = plain = ray.train.torch.prepare_model(drafter, parallel_strategy="ddp")
    return Worker(cfg=cfg, setup=setup, rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                  device=device, amp_dtype=amp_dtype, dcfg=dcfg, model=model, plain=plain,
                  teacher=teacher, opts=make_optimizers(cfg, model),
                  params=[p for p in model.parameters() if p.requires_grad],
                  sums=MetricSums(cfg.ttt_steps),
                  eval_sums=MetricSums(cfg.ttt_steps + EVAL_PROBE_STEPS))


def resume(w: Worker) -> dict:
    """The loop state: a fresh one, or Ray Train's latest checkpoint's (loaded into the model and
    optimizers); rank 0 rewinds the metrics log to it."""
    import ray.train
    state = {"step": 0, "epoch": 0, "seen": [], "history": [], "train_s": 0.0}
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = load_train_state(d, w.model, w.opts)
        if w.rank == 0:
            print(f"[train] resumed at step {state['step']} (epoch {state['epoch']}, "
                  f"{len(state['seen'])} samples of it done)")
    state["draft_shape"] = {k: getattr(w.dcfg, k) for k in RESUME_FIXED}   # load_train_state
    # samples that reached the loop this epoch (repeats counted), and one record per epoch
    state.setdefault("consumed", 0), state.setdefault("epochs", [])
    if w.rank == 0:
        write_metrics(w.cfg.output, state["history"])  # rewind the log to the checkpoint
    return state


def train_loop_per_worker(loop: dict) -> None:
    """The Ray Train worker function (runs on every worker): epochs until max_steps, max_epochs
    or max_minutes, then a final eval and checkpoint, and the drafter directory (rank 0)."""
    w = start_worker(loop)
    cfg = w.cfg
    state = resume(w)
    t_last, seen = time.perf_counter(), set(state["seen"])
    shard = data_shard(w.setup, cfg, "train", w.rank, w.world)
    w.eval_shard = data_shard(w.setup, cfg, "eval", w.rank, w.world)
    clock = Clock(60 * cfg.max_minutes if cfg.max_minutes else math.inf, t_last)
    while (state["step"] < cfg.max_steps and state["epoch"] < cfg.max_epochs
           and not clock.out_of_time):
        steps_before = state["step"]
        if not run_epoch(w, state, seen, shard, clock):
            break
        end_epoch(cfg, state, seen, steps_before)
    last = state["history"][-1] if state["history"] else {}
    report_online(w.setup, clock.wait)
    if (last.get("step") != state["step"] or "eval/loss" not in last
            or last.get("epoch") != state["epoch"]):  # final: eval + checkpoint (epoch ends too)
        _report_now(w, state, seen, clock, lr_at(cfg, state["step"], state["train_s"]),
                    with_eval=True, with_checkpoint=True)
    weights = full_state(w.model)[0]                 # collective under FSDP
    if w.rank == 0:
        finish(cfg, w.setup, weights, state)


def run_epoch(w: Worker, state: dict, seen: set, shard, clock: Clock) -> bool:
    """The steps of one epoch (a resumed one: on the samples its checkpoint had not seen) ->
    True when every worker's shard ran dry (the epoch is over), False when max_steps or the
    time budget ends the run first. An online cache is finished only by a whole first epoch,
    so there a run whose last step took the epoch's last batch ends the epoch too."""
    cfg = w.cfg
    if w.setup.get("skip_file"):  # online: the pipeline drops what this epoch already saw
        publish_skip(cfg, w.setup, w.rank, state["epoch"], seen)
    if isinstance(shard, ParquetShard):
        shard.set_epoch(cfg.seed, state["epoch"])
    it = iter(shard.iter_batches(batch_size=cfg.batch_size, batch_format="pyarrow",
                                 prefetch_batches=2))
    while state["step"] < cfg.max_steps:
        t_wait = time.monotonic()
        batch = next_unseen(it, seen)
        clock.wait["s"] += time.monotonic() - t_wait
        # every worker agrees to go on, or all stop: a dry shard ends the epoch for all
        go, clock.out_of_time, state["train_s"] = all_agree(batch is not None, state["train_s"],
                                                            clock.budget_s, w.device)
        if not go:
            return not clock.out_of_time
        train_batch(w, state, seen, batch, clock)
    # max_steps reached, mid-epoch or on its last batch
    return bool(w.setup.get("cache") and state["epoch"] == 0 and all_dry(it, seen, w.device))


def end_epoch(cfg: TrainConfig, state: dict, seen: set, steps_before: int) -> None:
    """Close an epoch in the loop state: its record (samples == unique: none repeated), the
    next epoch's counters."""
    # A resumed epoch skips the samples its checkpoint saw; the rows the workers get after a
    # restart may differ, so one can run dry at once: that ends the epoch, it is no error.
    # (Its unseen rest then waits for the next epoch.)
    if state["step"] == steps_before and not seen:
        raise ValueError(f"{cfg.dataset}: no training samples reached the workers "
                         "(empty dataset or eval_fraction too large)")
    state["epochs"].append({"epoch": state["epoch"], "samples": state["consumed"],
                            "unique": len(seen)})
    state["epoch"] += 1
    state["consumed"] = 0
    seen.clear()


def train_batch(w: Worker, state: dict, seen: set, batch, clock: Clock) -> None:
    """One step on every worker's batch (train_step), what it consumed (sample ids, tokens,
    time) and, when due, a report (+ eval, + checkpoint)."""
    cfg = w.cfg
    ids = batch.column("sample_id").to_pylist()
    clock.wait["samples"] += len(ids)
    b = {k: v.to(w.device) for k, v in collate(batch, w.dcfg.hidden_size, cfg.max_seq_len).items()}
    _maybe_die(cfg, w.rank, state["step"] + 1)
    loss, m, lr = train_step(cfg, w.model, w.opts, w.params, w.teacher, b, state["step"],
                             state["train_s"], w.device, w.amp_dtype)
    state["step"] += 1
    now = time.monotonic()
    state["train_s"] += now - clock.step_start  # training time (data wait included, evals not)
    clock.step_start = now
    gathered = all_gather_ids(ids, w.world)
    seen.update(gathered)
    state["consumed"] += len(gathered)
    tokens = int(b["attention_mask"].sum())
    w.sums.add(m, float(loss.detach()), tokens)
    clock.wait["tokens"] += tokens
    step = state["step"]
    if step < cfg.max_steps and (step % cfg.log_every == 0 or step % cfg.checkpoint_every == 0):
        with_eval = bool(cfg.eval_every) and step % cfg.eval_every == 0
        report_online(w.setup, clock.wait)
        _report_now(w, state, seen, clock, lr, with_eval,
                    with_checkpoint=step % cfg.checkpoint_every == 0)
        clock.step_start = time.monotonic()


def _report_now(w: Worker, state: dict, seen: set, clock: Clock, lr: float, with_eval: bool,
                with_checkpoint: bool) -> None:
    """All-reduce the metrics since the last report, maybe evaluate, report (+ checkpoint)."""
    t = w.sums.reduce(w.device)
    metrics = {"step": state["step"], "epoch": state["epoch"], "lr": lr,
               "train_s": state["train_s"],
               "tokens_per_s": float(t[-1]) / max(1e-9, time.perf_counter() - clock.last_report),
               **(w.sums.summarize(t, "train/") if t[-2] > 0 else {})}
    w.sums.reset()
    if with_eval:
        if w.plain is not w.model:                 # FSDP: evaluate an unsharded copy
            checkpoint.load_weights(w.plain, full_state(w.model, everywhere=True)[0],
                                    "the sharded drafter")
        metrics.update(evaluate(w.plain, w.teacher, w.cfg, w.dcfg.hidden_size, w.device,
                                w.eval_sums, w.eval_shard))
    if state["history"] and state["history"][-1]["step"] == state["step"]:
        state["history"][-1].update(metrics)  # the final report completes this step's entry
    else:
        state["history"].append(metrics)
    state["seen"] = sorted(seen)
    report(w.cfg, w.rank, state, state["history"][-1], w.model, w.opts,
           with_checkpoint=with_checkpoint)
    clock.last_report = time.perf_counter()


def _maybe_die(cfg: TrainConfig, rank: int, step: int) -> None:
    kind, _, arg = cfg.fault_injection.partition(":")
    if kind == "die_once" and rank == min(1, cfg.num_workers - 1):
        at, _, marker = arg.partition(":")
        if step == int(at) and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
