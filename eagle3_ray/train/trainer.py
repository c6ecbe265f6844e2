"""Stage 2: train the EAGLE-3 drafter with deep TTT unrolls on Ray Train.

    driver: read the dataset manifest, refuse it if it does not match the verifier, build the
            draft vocabulary (token counts over loss-masked tokens), hold out an eval split
    TorchTrainer workers (DDP over gloo/NCCL): read their equal share of the Parquet parts
            (ParquetShard; online: the Ray Data pipeline's get_dataset_shard), TTT unroll
            (ttt.py), AdamW + warmup/cosine, grad clipping, bf16 autocast
            (GPU, bf16 CPUs); report metrics every `log_every` steps, evaluate every
            `eval_every` (held out, one position past ttt_steps), checkpoint every
            `checkpoint_every`
    rank 0 at the end: a self-describing drafter directory (checkpoint.py), metrics CSV/JSON, PNG

Resume = run the same command again (same --output): Ray Train V2 hands the latest checkpoint
to the workers (model, optimizers, step, training time, epoch and the sample ids consumed in
the current epoch, so the data position is exact). A failed worker is restarted from the last
checkpoint (FailureConfig); steps after it are redone, and the metrics log is rewound to it, so
every step appears exactly once.

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import csv
import io
import itertools
import json
import math
import os
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_ray.data import schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import checkpoint, draft, ttt, vocab

# Dataset facts a drafter's verifier must share (a different max_length or regeneration is fine).
VERIFIER_FIELDS = ("verifier_config_hash", "hidden_size", "vocab_size", "layer_id_convention",
                   "tokenizer_hash")
# The held-out eval unrolls this many steps past ttt_steps and reports them (eval/cond_acc_k
# for k = ttt_steps..): what the drafter does one position deeper than it was trained, measured
# instead of guessed, is the prior serve's dynamic depth starts from (planner.acceptance_from).
# They stay out of eval/loss. A ttt-1 drafter: position 1 held out at ~0.1 where position 0 is
# ~0.45 (docs/benchmarks.md), against 0.9 x position 0 extrapolated.
EVAL_PROBE_STEPS = 1


@dataclass
class TrainConfig:
    dataset: str                          # hidden-state dataset dir/URI (eagle3-ray extract);
                                          # several joined by commas are read as one
    output: str = "runs/train"            # run dir: Ray checkpoints, metrics, final drafter/
    verifier: str | None = None           # the dataset's verifier; None: the one its manifest
                                          # names (online: the embedded default)
    ttt_steps: int = 8                    # TTT unroll depth: train for the depth you serve
    step_weight_decay: float = 0.8        # loss weight of step k: decay**k
    ttt_ramp: float = 0.5                 # depth curriculum: the unroll grows from 1 step to
                                          # ttt_steps over this share of the training (0 = off)
    deep_fraction: float = 0.25           # share of positions that run the TTT steps past 0
                                          # (random each batch; <1 makes deep steps cheaper)
    cod_ratio: float = 1.0                # COD sampling: step k >= 1 runs on deep_fraction *
                                          # cod_ratio**(k-1) of the positions (1 = the same
                                          # share at every deep step; P-EAGLE uses 0.7)
    cod_min: float = 0.0                  # ... but never fewer than this share (P-EAGLE: 0.2)
    drafting: str = "chain"               # chain: EAGLE-3, k drafts from k drafter forwards;
                                          # parallel: P-EAGLE, k drafts from one forward (mask
                                          # slots; ttt_steps = the depths trained)
    mask_token_id: int | None = None      # parallel: the mask slots' token (default V - 1)
    draft_layer: str = "llama"            # the drafter's decoder layer: llama | mla (DeepSeek
                                          # MLA, vLLM's Eagle3DeepseekV3ForCausalLM; its dims
                                          # the verifier's if DeepSeek-shaped, train/mla.py)
    fc_norm: bool = False                 # EAGLE-3.1: an RMSNorm per aux state before fc
    norm_output: bool = False             # EAGLE-3.1: draft steps fed the post-final-norm state
    draft_vocab_size: int = 4096          # reduced draft vocab (<= verifier vocab). The lm_head
                                          # dominates a 1-layer drafter's step: on the embedded
                                          # default 4096 (counted over the verifier's argmax)
                                          # trains ~1.2x the tokens/s of 8192 and covers ~92% of
                                          # held-out targets (8192: ~97%), and won at equal
                                          # minutes (docs/benchmarks.md#drafter-recipe-bench-recipe);
                                          # for a 128k+ vocab verifier use 32000, as SpecForge does
    targets: str = "hard"                 # loss target: hard = the verifier's argmax (what
                                          # greedy acceptance checks; no teacher matmul when the
                                          # dataset stores target_ids), soft = the teacher's
                                          # distribution over the draft vocab (ttt.ttt_loss)
    recompute: str = "auto"               # recompute the attention core and lm_head chunks in
                                          # backward (memory) or keep them (compute): on, off,
                                          # auto = on for GPUs, off on CPUs (short on compute)
    init: str = "verifier"                # verifier: fc passes the highest aux state through and
                                          # the midlayer starts as that verifier layer
                                          # (draft.init_from_verifier); random: noise
    max_steps: int = 200                  # optimizer steps in total (across resumes)
    max_epochs: int = 1000                # stop after this many passes even if steps remain
    max_minutes: float = 0                # wall-clock budget of the training loop; 0 = none
    batch_size: int = 4                   # samples per worker per step (one core: 2 loses,
                                          # 4, 8 and 16 level at equal minutes)
    max_seq_len: int = 2048               # truncate samples longer than this
    lr: float = 2e-3                      # best of 1e-3..5e-3 at equal minutes (flat 2e-3..3e-3)
    min_lr_ratio: float = 0.1             # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    eval_fraction: float = 0.05           # held-out share of samples (by sample_id hash)
    eval_every: int = 50                  # steps; 0 = only at the end
    log_every: int = 10                   # steps between reported metrics (a Ray barrier)
    checkpoint_every: int = 50            # steps
    num_workers: int = 2
    use_gpu: bool = False
    parallel: str = "ddp"                 # ddp | fsdp (FSDP2: parameters, gradients and AdamW
                                          # state sharded over the workers)
    precision: str = "auto"               # bf16 | fp32 | auto: bf16 autocast on GPU and on CPUs
                                          # with native bf16 matmul (AVX512-BF16/AMX), else fp32
    cpus_per_worker: float | None = None  # Ray CPUs per CPU worker; None: 1, or what fits a
                                          # local Ray's machine (launch.fit_cpus)
    node_resource: str | None = None      # custom resource of the node type to train on
                                          # (e.g. train_node, cluster/); a sliver per worker
    max_failures: int = 3                 # worker-group restarts (FailureConfig)
    seed: int = 0
    # tests only: "die_once:<step>:<marker>" kills rank 1 once, when it reaches <step>.
    fault_injection: str = field(default_factory=lambda: os.environ.get("EAGLE3_RAY_FAULT", ""))


def autocast_dtype(precision: str, use_gpu: bool) -> torch.dtype | None:
    """bf16 (autocast, fp32 master weights) or None (plain fp32). "auto" takes bf16 on a GPU and
    on a CPU with native bf16 matmul, where it measured ~3x faster per TTT step than fp32."""
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    if precision == "auto":
        precision = "bf16" if use_gpu or verifier.native_bf16() else "fp32"
    return torch.bfloat16 if precision == "bf16" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def is_eval(sample_id: str, fraction: float) -> bool:
    return zlib.crc32(sample_id.encode()) % 10_000 < fraction * 10_000


def _split(batch: pa.Table, fraction: float, want_eval: bool) -> pa.Table:
    """Keep the eval (or train) rows of an Arrow batch, without touching the hidden states."""
    mask = [is_eval(s, fraction) == want_eval for s in batch.column("sample_id").to_pylist()]
    return batch.filter(pa.array(mask, pa.bool_()))


def progress(cfg: TrainConfig, step: int, train_s: float) -> float:
    """Share of the training done, 0..1: the larger of the step and the wall-clock fractions, so
    a time-budgeted run (max_minutes) also anneals and finishes its depth ramp."""
    p = step / max(1, cfg.max_steps)
    if cfg.max_minutes:
        p = max(p, train_s / (60 * cfg.max_minutes))
    return min(1.0, p)


def lr_at(cfg: TrainConfig, step: int, train_s: float) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio (over `progress`)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    p = min(1.0, max(p, progress(cfg, 0, train_s)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def depth_at(cfg: TrainConfig, step: int, train_s: float) -> int:
    """TTT unroll depth of this step. Depth curriculum: over the first `ttt_ramp` share of the
    training the depth grows linearly from 1 to ttt_steps, so the cheap shallow steps teach
    position 0 (which every deeper position builds on) before the deep ones are paid for.
    A parallel drafter starts at 2: its mask state is trained from the first step on (and
    DDP expects a gradient for every parameter)."""
    if cfg.ttt_ramp <= 0:
        return cfg.ttt_steps
    frac = progress(cfg, step, train_s) / cfg.ttt_ramp
    least = 2 if cfg.drafting == "parallel" else 1
    return max(least, min(cfg.ttt_steps, 1 + int(frac * cfg.ttt_steps)))


# --- driver-side preparation ------------------------------------------------------------------

def check_config(cfg: TrainConfig) -> None:
    """Refuse out-of-range settings before anything starts."""
    if not 1 <= cfg.ttt_steps <= 32:
        raise ValueError(f"ttt_steps must be in 1..32, got {cfg.ttt_steps}")
    if cfg.drafting == "parallel" and cfg.ttt_steps < 2:
        raise ValueError("a parallel drafter needs ttt_steps >= 2 (step 1 on is its mask slots)")
    for name in ("max_steps", "batch_size", "draft_vocab_size", "log_every", "checkpoint_every",
                 "num_workers", "max_seq_len"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    for name, allowed in (("targets", ttt.TARGETS), ("recompute", ("auto", "on", "off"))):
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    if cfg.init not in draft.INIT_MODES:
        raise ValueError(f"init must be one of {draft.INIT_MODES}, got {cfg.init!r}")
    if cfg.parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel must be ddp or fsdp, got {cfg.parallel!r}")
    if not 0 < cfg.deep_fraction <= 1:
        raise ValueError(f"deep_fraction must be in (0, 1], got {cfg.deep_fraction}")
    if not 0 < cfg.cod_ratio <= 1 or not 0 <= cfg.cod_min <= 1:
        raise ValueError(f"need 0 < cod_ratio <= 1 and 0 <= cod_min <= 1, got {cfg.cod_ratio}, "
                         f"{cfg.cod_min}")
    if cfg.drafting not in draft.DRAFTING:
        raise ValueError(f"drafting must be one of {draft.DRAFTING}, got {cfg.drafting!r}")
    if cfg.draft_layer not in draft.LAYERS:
        raise ValueError(f"draft_layer must be one of {draft.LAYERS}, got {cfg.draft_layer!r}")
    if cfg.draft_layer == "mla" and cfg.drafting == "parallel":
        raise ValueError("--draft-layer mla with --drafting parallel: no engine runs a parallel "
                         "MLA drafter (vLLM's deepseek_eagle3.py has no mask_hidden / parallel "
                         "drafting); train a chain MLA drafter or a parallel Llama one")
    if not 0 <= cfg.eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")


def prepare(cfg: TrainConfig) -> dict:
    """Check the dataset against the verifier (default: the one its manifest names), build
    (or reuse) the draft vocabulary."""
    check_config(cfg)
    if not cfg.verifier:
        cfg = replace(cfg, verifier=dataset_verifier(cfg.dataset))
    config, tok = verifier.load_config(cfg.verifier), verifier.load_tokenizer(cfg.verifier)

    def check(uri, manifest):
        expected = verifier.verifier_facts(cfg.verifier, config, tok,
                                           manifest["facts"]["aux_layer_ids"])
        schema.check_compatible(manifest, expected, where=schema.manifest_path(uri),
                                fields=VERIFIER_FIELDS)
    manifest = schema.read_datasets(cfg.dataset, check)
    column = vocab_column(schema.stores_target_ids(manifest))
    uris = schema.dataset_uris(cfg.dataset)
    return make_setup(cfg, manifest, lambda: sum(
        vocab.count_tokens(u, verifier.text_config(config).vocab_size, column) for u in uris), column)


def vocab_column(has_target_ids: bool) -> str:
    """The dataset column the draft vocabulary is counted over: target_ids, the verifier's
    argmax on loss-masked positions (what a greedy verifier asks the drafter to propose), when
    the dataset stores them (offline), else input_ids, the response tokens (online, as
    SpecForge)."""
    return "target_ids" if has_target_ids else "input_ids"


def recompute(cfg: TrainConfig) -> bool:
    """TrainConfig.recompute -> whether ttt_loss checkpoints its attention core and logits."""
    return cfg.recompute == "on" or (cfg.recompute == "auto" and cfg.use_gpu)


def make_setup(cfg: TrainConfig, manifest: dict, count_tokens,
               counted: str = "input_ids") -> dict:
    """What every worker needs: the dataset facts, the draft config and the draft vocabulary
    (built from count_tokens() -> int64 [V] counts of the `counted` column on the first run,
    read back from the run dir on a resume)."""
    config = verifier.load_config(cfg.verifier)
    vocab_size = verifier.text_config(config).vocab_size
    fs, root = schema.resolve_fs(cfg.output)
    fs.create_dir(root, recursive=True)
    vocab_path = f"{root}/vocab.json"
    if fs.get_file_info(vocab_path).type == pa.fs.FileType.File:  # resume: same mapping
        with fs.open_input_stream(vocab_path) as f:
            saved = json.loads(f.read())
        if saved["draft_vocab_size"] != min(cfg.draft_vocab_size, vocab_size):
            raise ValueError(f"{vocab_path}: run was started with draft_vocab_size "
                             f"{saved['draft_vocab_size']}; use a new --output to change it")
        d2t = np.asarray(saved["d2t"], dtype=np.int64)
    else:
        counts = count_tokens()
        d2t, t2d = vocab.build_mapping(counts, min(cfg.draft_vocab_size, vocab_size))
        schema.write_bytes_atomic(fs, vocab_path, json.dumps(
            {"draft_vocab_size": len(d2t), "d2t": d2t.tolist(), "counted": counted,
             "coverage": vocab.coverage(counts, t2d)}).encode())
    dcfg = draft.DraftConfig.from_verifier_config(config, len(d2t),
                                                  manifest["facts"]["aux_layer_ids"],
                                                  drafting=cfg.drafting,
                                                  mask_token_id=cfg.mask_token_id,
                                                  layer=cfg.draft_layer, fc_norm=cfg.fc_norm,
                                                  norm_output=cfg.norm_output)
    return {"manifest": manifest, "draft_config": dcfg.to_dict(), "d2t": d2t.tolist(),
            "manifest_hash": checkpoint.manifest_hash(manifest)}


def build_for_training(cfg: TrainConfig, setup: dict, teacher_check: bool):
    """The drafter and teacher a run starts from (before any checkpoint is loaded): the
    draft config and vocab of `setup`, and cfg.init."""
    dcfg = draft.DraftConfig(**setup["draft_config"])
    d2t, t2d = mapping_from_d2t(setup["d2t"], dcfg.vocab_size)
    drafter, teacher = draft.build_drafter(cfg.verifier, dcfg, d2t, t2d,
                                           teacher_check=teacher_check, init=cfg.init)
    return drafter, teacher


def mapping_from_d2t(d2t: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t_t = torch.tensor(d2t, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab.draft_to_target(d2t_t)] = True
    return d2t_t, t2d


# --- worker side ----------------------------------------------------------------------------

def collate(batch: pa.Table, hidden: int, max_len: int) -> dict[str, torch.Tensor]:
    """Arrow rows -> right-padded tensors; hidden states stay bf16 until the model casts."""
    greedy = "target_ids" in batch.column_names                   # format 2 datasets
    rows = batch.select(["input_ids", "loss_mask", "num_tokens"] + ["target_ids"] * greedy
                        + schema.hidden_columns(batch.column_names)).to_pylist()  # fp8: +scales
    n = min(max_len, max(r["num_tokens"] for r in rows))
    b = len(rows)
    out = {"input_ids": torch.zeros(b, n, dtype=torch.long),              # [B, S]
           "loss_mask": torch.zeros(b, n, dtype=torch.long),              # [B, S]
           "attention_mask": torch.zeros(b, n, dtype=torch.long),         # [B, S]
           "aux_hidden_states": torch.zeros(b, n, 3 * hidden, dtype=torch.bfloat16),  # [B,S,3H]
           "last_hidden_states": torch.zeros(b, n, hidden, dtype=torch.bfloat16)}     # [B,S,H]
    if greedy:
        out["target_ids"] = torch.zeros(b, n, dtype=torch.long)                             # [B, S]
    for i, r in enumerate(rows):
        t = schema.decode_row(r, hidden)
        s = min(n, r["num_tokens"])
        out["input_ids"][i, :s] = t["input_ids"][:s]
        out["loss_mask"][i, :s] = t["loss_mask"][:s].long()
        out["attention_mask"][i, :s] = 1
        out["aux_hidden_states"][i, :s] = t["aux_hidden_states"][:s].reshape(s, 3 * hidden)
        out["last_hidden_states"][i, :s] = t["last_hidden_states"][:s]
        if greedy:
            out["target_ids"][i, :s] = t["target_ids"][:s]
    return out


class ParquetShard:
    """One worker's share of an on-disk dataset's train (or eval) split, read straight from the
    Parquet parts: offline training's data path, with the `iter_batches` of a Ray Data shard.
    The split's rows, in manifest order, are cut into `world` contiguous runs of equal length
    (train: the last < world rows are left out, as Ray Data's equal streaming_split does), so a
    worker decompresses only its own parts; the next part is read while this one is trained on.

    Why not Ray Data here: while the trainers hold it back, the streaming executor of
    streaming_split has no task to wait on and its scheduling loop spins (Ray 2.60,
    StreamingExecutor._scheduling_loop_step): ~65% of a core in its SplitCoordinator, a third of
    a 2-core host that the workers need (docs/benchmarks.md#bench-train). Online training keeps
    Ray Data: there the pipeline (tokenize, verifier replicas) is the point.

    set_epoch(seed, epoch) shuffles the worker's parts and the rows inside each part, the same
    for a given (seed, epoch) (so a resumed epoch reads in the order it began with), as
    torch's DistributedSampler.set_epoch or Ray Data's randomize_block_order plus a local
    shuffle do; rows never cross workers, so each worker still reads only its own parts."""

    def __init__(self, parts: list[str], eval_fraction: float, want_eval: bool, rank: int,
                 world: int):
        """parts: the full location of each part file (the "uri" of schema.read_datasets's
        files), of one dataset or of several."""
        self.shuffle = None                                # (seed, epoch); None: manifest order
        self.paths = schema.part_paths(parts)              # (filesystem, path) per part
        rows = [(i, j) for i, (fs, path) in enumerate(self.paths)
                for j, sid in enumerate(schema.read_column(fs, path, "sample_id"))
                if is_eval(sid, eval_fraction) == want_eval]               # (part, row)
        if want_eval:  # every row once, in near-equal runs
            self.rows = rows[rank * len(rows) // world:(rank + 1) * len(rows) // world]
        else:          # equal runs: the workers step in lockstep
            n = len(rows) // world
            self.rows = rows[rank * n:(rank + 1) * n]

    def set_epoch(self, seed: int, epoch: int) -> None:
        self.shuffle = (seed, epoch)

    def _read(self, part: int, rows: list[int]) -> pa.Table:
        fs, path = self.paths[part]
        with fs.open_input_file(path) as f:
            return pq.read_table(f).take(pa.array(rows, pa.int64()))

    def iter_batches(self, batch_size: int, batch_format: str = "pyarrow", **_):
        """Arrow tables of `batch_size` rows (the last may be shorter)."""
        assert batch_format == "pyarrow", batch_format
        parts = [(part, [j for _, j in g]) for part, g in
                 itertools.groupby(self.rows, key=lambda r: r[0])]
        if self.shuffle is not None:                      # parts, then rows within a part
            rng = np.random.default_rng(self.shuffle)
            parts = [(part, [rows[i] for i in rng.permutation(len(rows))])
                     for part, rows in (parts[i] for i in rng.permutation(len(parts)))]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:   # pyarrow drops the GIL
            ahead = pool.submit(self._read, *parts[0]) if parts else None
            held = None
            for k in range(len(parts)):
                table, ahead = ahead.result(), (pool.submit(self._read, *parts[k + 1])
                                                if k + 1 < len(parts) else None)
                held = table if held is None else pa.concat_tables([held, table])
                while held.num_rows >= batch_size:
                    yield held.slice(0, batch_size)
                    held = held.slice(batch_size)
            if held is not None and held.num_rows:
                yield held


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


def train_loop_per_worker(loop: dict) -> None:
    """The Ray Train worker function (runs on every worker)."""
    import ray.train
    import ray.train.torch

    cfg, setup = TrainConfig(**loop["cfg"]), loop["setup"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
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
    params = [p for p in model.parameters() if p.requires_grad]
    opts = make_optimizers(cfg, model)

    state = {"step": 0, "epoch": 0, "seen": [], "history": [], "train_s": 0.0}
    ckpt = ray.train.get_checkpoint()
    if ckpt:
        with ckpt.as_directory() as d:
            state = load_train_state(d, model, opts)
        if rank == 0:
            print(f"[train] resumed at step {state['step']} (epoch {state['epoch']}, "
                  f"{len(state['seen'])} samples of it done)")
    state["draft_shape"] = {k: getattr(dcfg, k) for k in RESUME_FIXED}   # load_train_state
    # samples that reached the loop this epoch (repeats counted), and one record per epoch
    state.setdefault("consumed", 0), state.setdefault("epochs", [])
    if rank == 0:
        write_metrics(cfg.output, state["history"])  # rewind the log to the checkpoint

    hidden = dcfg.hidden_size
    sums, eval_sums = MetricSums(cfg.ttt_steps), MetricSums(cfg.ttt_steps + EVAL_PROBE_STEPS)
    t_last, seen = time.perf_counter(), set(state["seen"])
    shard = data_shard(setup, cfg, "train", rank, world)
    eval_shard = data_shard(setup, cfg, "eval", rank, world)
    budget_s = 60 * cfg.max_minutes if cfg.max_minutes else math.inf
    out_of_time, t_step = False, time.monotonic()
    # online: data wait, samples and tokens since the last report, and when that was
    wait = {"s": 0.0, "tokens": 0, "samples": 0, "since": time.monotonic()}
    while state["step"] < cfg.max_steps and state["epoch"] < cfg.max_epochs and not out_of_time:
        if setup.get("skip_file"):  # online: the pipeline drops what this epoch already saw
            _publish_skip(cfg, setup, rank, state["epoch"], seen)
        if isinstance(shard, ParquetShard):
            shard.set_epoch(cfg.seed, state["epoch"])
        it = iter(shard.iter_batches(batch_size=cfg.batch_size, batch_format="pyarrow",
                                     prefetch_batches=2))
        steps_before = state["step"]
        while state["step"] < cfg.max_steps:
            t_wait = time.monotonic()
            batch = _next_unseen(it, seen)
            wait["s"] += time.monotonic() - t_wait
            # every worker agrees to go on, or all stop: a dry shard ends the epoch for all
            go, out_of_time, state["train_s"] = _all_agree(batch is not None, state["train_s"],
                                                           budget_s, device)
            if not go:
                break
            ids = batch.column("sample_id").to_pylist()
            wait["samples"] += len(ids)
            b = {k: v.to(device) for k, v in collate(batch, hidden, cfg.max_seq_len).items()}
            _maybe_die(cfg, rank, state["step"] + 1)
            loss, m, lr = train_step(cfg, model, opts, params, teacher, b, state["step"],
                                     state["train_s"], device, amp_dtype)
            state["step"] += 1
            now = time.monotonic()
            state["train_s"] += now - t_step  # training time (data wait included, evals not)
            t_step = now
            gathered = _all_gather_ids(ids, world)
            seen.update(gathered)
            state["consumed"] += len(gathered)
            sums.add(m, float(loss.detach()), int(b["attention_mask"].sum()))
            wait["tokens"] += int(b["attention_mask"].sum())
            step = state["step"]
            if step < cfg.max_steps and (step % cfg.log_every == 0
                                         or step % cfg.checkpoint_every == 0):
                with_eval = bool(cfg.eval_every) and step % cfg.eval_every == 0
                _report_online(setup, wait)
                t_last = _report_now(cfg, rank, state, seen, sums, t_last, lr, model, plain,
                                     opts, teacher, hidden, device, eval_sums, eval_shard,
                                     with_eval, with_checkpoint=step % cfg.checkpoint_every == 0)
                t_step = time.monotonic()
        else:  # max_steps reached, mid-epoch or on its last batch
            if not (setup.get("cache") and state["epoch"] == 0 and _all_dry(it, seen, device)):
                break
        if out_of_time:
            break
        # A resumed epoch skips the samples its checkpoint saw; the rows the workers get after a
        # restart may differ, so one can run dry at once: that ends the epoch, it is no error.
        # (Its unseen rest then waits for the next epoch.)
        if state["step"] == steps_before and not seen:
            raise ValueError(f"{cfg.dataset}: no training samples reached the workers "
                             "(empty dataset or eval_fraction too large)")
        state["epochs"].append({"epoch": state["epoch"], "samples": state["consumed"],
                                "unique": len(seen)})  # samples == unique: none repeated
        state["epoch"] += 1
        state["consumed"] = 0
        seen.clear()
    last = state["history"][-1] if state["history"] else {}
    _report_online(setup, wait)
    if (last.get("step") != state["step"] or "eval/loss" not in last
            or last.get("epoch") != state["epoch"]):  # final: eval + checkpoint (epoch ends too)
        _report_now(cfg, rank, state, seen, sums, t_last, lr_at(cfg, state["step"], state["train_s"]),
                    model, plain, opts, teacher, hidden, device, eval_sums, eval_shard,
                    with_eval=True, with_checkpoint=True)
    weights = full_state(model)[0]                 # collective under FSDP
    if rank == 0:
        finish(cfg, setup, weights, state)


def make_optimizers(cfg: TrainConfig, model) -> list[torch.optim.Optimizer]:
    """[AdamW] over `model`'s trainable parameters (a list: the loop, full_state and the
    checkpoints take a list of optimizers)."""
    return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                              weight_decay=cfg.weight_decay, betas=(0.9, 0.95))]


def train_step(cfg: TrainConfig, model, opts, params, teacher, batch: dict, step: int,
               train_s: float, device, amp_dtype) -> tuple[torch.Tensor, dict, float]:
    """One optimizer step on `batch` at (step, train_s) of the schedule: lr and TTT depth,
    the TTT loss, backward, clipping, the optimizers (make_optimizers). -> (loss, ttt metrics,
    lr). The loop around it (data, metrics, checkpoints) is train_loop_per_worker's; sweep.py
    reuses the step."""
    lr = lr_at(cfg, step, train_s)
    for g in (g for opt in opts for g in opt.param_groups):
        g["lr"] = lr
    ckpt = recompute(cfg)
    with autocast(device, amp_dtype):
        loss, m = ttt.ttt_loss(model, teacher, batch, depth_at(cfg, step, train_s),
                               cfg.step_weight_decay, deep_fraction=cfg.deep_fraction,
                               targets=cfg.targets, checkpoint_attention=ckpt,
                               checkpoint_logits=ckpt, cod_ratio=cfg.cod_ratio,
                               cod_min=cfg.cod_min)
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    for opt in opts:
        opt.step()
    return loss, m, lr


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


def _report_now(cfg, rank, state, seen, sums, t_last, lr, model, plain, opts, teacher, hidden,
                device, eval_sums, eval_shard, with_eval: bool, with_checkpoint: bool) -> float:
    """All-reduce the metrics since the last report, maybe evaluate, report (+ checkpoint)."""
    t = sums.reduce(device)
    metrics = {"step": state["step"], "epoch": state["epoch"], "lr": lr,
               "train_s": state["train_s"],
               "tokens_per_s": float(t[-1]) / max(1e-9, time.perf_counter() - t_last),
               **(sums.summarize(t, "train/") if t[-2] > 0 else {})}
    sums.reset()
    if with_eval:
        if plain is not model:                     # FSDP: evaluate an unsharded copy
            checkpoint.load_weights(plain, full_state(model, everywhere=True)[0],
                                    "the sharded drafter")
        metrics.update(evaluate(plain, teacher, cfg, hidden, device, eval_sums, eval_shard))
    if state["history"] and state["history"][-1]["step"] == state["step"]:
        state["history"][-1].update(metrics)  # the final report completes this step's entry
    else:
        state["history"].append(metrics)
    state["seen"] = sorted(seen)
    report(cfg, rank, state, state["history"][-1], model, opts, with_checkpoint=with_checkpoint)
    return time.perf_counter()


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
            loss, m = ttt.ttt_loss(inner, teacher, b, cfg.ttt_steps + EVAL_PROBE_STEPS,
                                   cfg.step_weight_decay, targets=cfg.targets,
                                   loss_steps=cfg.ttt_steps)
            sums.add(m, float(loss), int(b["attention_mask"].sum()))
    inner.train()
    return sums.summarize(sums.reduce(device), "eval/")


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


def checkpoint_name(state: dict) -> str:
    """step_<step>; a second checkpoint of the same step (the end of an epoch whose last step
    was checkpointed already) gets its own name: Ray Train deletes old ones by path."""
    name = f"step_{state['step']:07d}"
    if (state.get("last_checkpoint") or [None])[0] == state["step"]:
        name += f"-epoch{state['epoch']}"
    state["last_checkpoint"] = [state["step"], state["epoch"]]
    return name


def save_train_state(d: str, weights: dict, opt_state: dict, state: dict) -> None:
    """Whole state dicts (full_state) -> a checkpoint directory."""
    from safetensors.torch import save_file
    save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()
               if k != "embed_tokens.weight"},  # frozen, the verifier's: rebuilt on load
              os.path.join(d, "model.safetensors"))
    torch.save(opt_state, os.path.join(d, "optimizer.pt"))
    with open(os.path.join(d, "state.json"), "w") as f:
        json.dump(state, f)


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


RESUME_FIXED = ("layer", "fc_norm", "norm_output", "drafting")   # DraftConfig fields a resume keeps


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


def unwrap(model):
    return getattr(model, "module", model)


def data_shard(setup: dict, cfg: TrainConfig, split: str, rank: int, world: int):
    """This worker's "train" or "eval" data: its ParquetShard of an on-disk dataset, else (online)
    its shard of the Ray Data pipeline."""
    if setup.get("read_parquet"):
        return ParquetShard([f["uri"] for f in setup["manifest"]["files"]],
                            cfg.eval_fraction, split == "eval", rank, world)
    import ray.train
    return ray.train.get_dataset_shard(split)


def _next_unseen(it, seen: set):
    """Next batch of the shard, minus samples already consumed this epoch (resume)."""
    for batch in it:
        if seen:
            keep = [i for i, s in enumerate(batch.column("sample_id").to_pylist()) if s not in seen]
            batch = batch.take(pa.array(keep, pa.int64()))
        if batch.num_rows:
            return batch
    return None


def _publish_skip(cfg: TrainConfig, setup: dict, rank: int, epoch: int, seen: set) -> None:
    """Online: before an epoch's pipeline starts, rank 0 writes the ids its read tasks must drop
    (online.read_conversations); every worker waits for it. Without a cache that is what this
    epoch already consumed. With a cache (first epoch), cache parts holding any sample not
    consumed are deleted and the ids of the parts kept are skipped: the rest is extracted
    again, so the cache ends complete and without duplicates, and the trainer drops the
    re-extracted samples it has already seen (_next_unseen)."""
    if rank == 0:
        skip = seen
        if setup.get("cache") and epoch == 0:
            skip = set()
            fs, root = schema.resolve_fs(setup["cache"])
            schema.remove_temp_files(fs, root)
            for path in schema.list_parts(fs, root):
                ids = schema.read_column(fs, path, "sample_id")
                if all(s in seen or is_eval(s, cfg.eval_fraction) for s in ids):
                    skip.update(s for s in ids if s in seen)
                else:
                    fs.delete_file(path)
        fs, path = schema.resolve_fs(setup["skip_file"])
        fs.create_dir(os.path.dirname(path), recursive=True)
        schema.write_bytes_atomic(fs, path, json.dumps({"epoch": epoch,
                                                        "skip": sorted(skip)}).encode())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _report_online(setup: dict, wait: dict) -> None:
    """Online: this worker's consumed samples, tokens and data wait since the last call -> the
    run's StatsActor (the throughput balance, online.balance)."""
    if setup.get("stats_actor") and wait["samples"]:
        import ray
        from eagle3_ray.extract.pipeline import STATS_NAMESPACE
        ray.get_actor(setup["stats_actor"], namespace=STATS_NAMESPACE).add.remote(
            "train", samples=wait["samples"], tokens=wait["tokens"], wait_s=wait["s"],
            seconds=time.monotonic() - wait["since"])
    wait.update(s=0.0, tokens=0, samples=0, since=time.monotonic())


def _all_dry(it, seen: set, device) -> bool:
    """Whether every worker's shard is used up (pulls one more batch, not trained on). An
    online cache is finished only by a whole first epoch: a run whose last step takes the
    epoch's last batch must say so."""
    t = torch.tensor([0.0 if _next_unseen(it, seen) is None else 1.0], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t[0]) == 0


def _all_agree(have_batch: bool, train_s: float, budget_s: float, device):
    """-> (all workers have a batch and time left, some worker ran out of time, the slowest
    worker's training time). Every worker then uses that one clock for the lr and the TTT depth,
    so DDP replicas never step with different learning rates."""
    t = torch.tensor([0.0 if have_batch else 1.0, train_s], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    out_of_time = float(t[1]) >= budget_s
    return float(t[0]) == 0 and not out_of_time, out_of_time, float(t[1])


def _all_gather_ids(ids: list[str], world: int) -> list[str]:
    if world == 1:
        return ids
    out = [None] * world
    torch.distributed.all_gather_object(out, ids)
    return [s for part in out for s in part]


def _maybe_die(cfg: TrainConfig, rank: int, step: int) -> None:
    kind, _, arg = cfg.fault_injection.partition(":")
    if kind == "die_once" and rank == min(1, cfg.num_workers - 1):
        at, _, marker = arg.partition(":")
        if step == int(at) and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)


# --- offline evaluation ----------------------------------------------------------------------

@torch.no_grad()
def evaluate_drafter(drafter_dir: str, dataset: str, depth: int, eval_fraction: float = 0.05,
                     spec: str | None = None, batch_size: int = 4, max_seq_len: int = 2048,
                     precision: str = "auto") -> dict:
    """Held-out per-position metrics of a trained drafter unrolled `depth` steps (deeper than
    it was trained is allowed: that is how extrapolation is measured). One process, no Ray."""
    import pyarrow.parquet as pq
    manifest = schema.read_datasets(dataset)
    stored = schema.stores_target_ids(manifest)
    drafter, teacher, _ = checkpoint.load_trained_drafter(drafter_dir, spec,
                                                              teacher_check=not stored)
    amp_dtype = autocast_dtype(precision, False)
    teacher = teacher.to(amp_dtype or torch.float32)
    hidden = drafter.config.hidden_size
    sums = MetricSums(depth)
    for fs, path in schema.part_paths([f["uri"] for f in manifest["files"]]):
        with fs.open_input_file(path) as f:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=64):
                t = _split(pa.Table.from_batches([rb]), eval_fraction, True)
                for i in range(0, t.num_rows, batch_size):
                    b = collate(t.slice(i, batch_size), hidden, max_seq_len)
                    with autocast(torch.device("cpu"), amp_dtype):
                        loss, m = ttt.ttt_loss(drafter, teacher, b, depth, 1.0)
                    sums.add(m, float(loss), int(b["attention_mask"].sum()))
    return sums.summarize(sums.t, "")


# --- driver entry ---------------------------------------------------------------------------

def worker_resources(cfg: TrainConfig) -> dict:
    """Ray resources of one training worker (ScalingConfig.resources_per_worker)."""
    from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER
    out = {"GPU": 1} if cfg.use_gpu else {"CPU": cfg.cpus_per_worker}
    if cfg.node_resource:
        out[cfg.node_resource] = NODE_RESOURCE_SLIVER
    return out


def dataset_verifier(dataset: str) -> str:
    """The verifier a dataset's manifest names (facts.verifier; of the first, when several)."""
    uri = schema.dataset_uris(dataset)[0]
    spec = schema.read_manifest(uri)["facts"].get("verifier")
    if not spec:
        raise ValueError(f"{schema.manifest_path(uri)}: names no verifier; pass --verifier")
    return spec


def run_train(cfg: TrainConfig, address: str | None = None):
    """Check, then fit (or resume) on Ray Train. Returns the Ray Train Result."""
    from eagle3_ray.launch import init_ray

    cfg = replace(cfg, dataset=schema.absolute(cfg.dataset), output=schema.absolute(cfg.output))
    cfg = replace(cfg, verifier=verifier.absolute_spec(cfg.verifier or dataset_verifier(cfg.dataset)))
    setup = prepare(cfg)
    init_ray(address)
    return fit(fit_cpus(cfg), {**setup, "read_parquet": True}, {})


def fit_cpus(cfg: TrainConfig) -> TrainConfig:
    """cfg with its CPUs per worker decided (launch.fit_cpus)."""
    from eagle3_ray import launch
    fit = launch.fit_cpus(worker=(cfg.cpus_per_worker, 0 if cfg.use_gpu else cfg.num_workers))
    return replace(cfg, cpus_per_worker=fit["worker"])


TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def fit(cfg: TrainConfig, setup: dict, datasets: dict):
    """TorchTrainer.fit on the prepared setup and the "train"/"eval" datasets (Parquet offline,
    the extraction pipeline online); a rerun with the same output resumes."""
    import ray.train
    from ray.train.torch import TorchTrainer
    # Ray Train V2's controller takes one reported result per worker per poll, every 2 s by
    # default, and report() blocks while the previous one is waiting: reports more frequent
    # than that stall training (a 30-step test run at log_every 1: ~1.7 s wall per 0.4 s
    # step). Poll every 0.2 s unless the user chose otherwise (propagated to the controller).
    os.environ.setdefault(TRAIN_POLL_ENV, "0.2")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": asdict(cfg), "setup": setup},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
            resources_per_worker=worker_resources(cfg)),
        run_config=ray.train.RunConfig(
            name="ray", storage_path=cfg.output,  # absolute path or URI
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)),
        datasets=datasets,
    )
    result = trainer.fit()
    print(f"[train] done: {cfg.output}/drafter")
    return result


def result_state(result) -> dict:
    """The loop state (step, epoch, history, ...) of a fit's last checkpoint."""
    with result.checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
        return json.load(f)
