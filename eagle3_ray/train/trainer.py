"""Stage 2: train the EAGLE-3 drafter with deep TTT unrolls on Ray Train (the driver).

    driver: read the dataset manifest, refuse it if it does not match the verifier, build the
            draft vocabulary (token counts over loss-masked tokens), hold out an eval split
    TorchTrainer workers (DDP over gloo/NCCL; loop.py): read their equal share of the Parquet
            parts (feed.ParquetShard; online: the Ray Data pipeline's get_dataset_shard), the
            drafting kind's loss (kinds.py: the TTT unroll of ttt.py), AdamW + warmup/cosine,
            grad clipping, bf16 autocast (GPU, bf16 CPUs; config.py); report metrics every
            `log_every` steps, evaluate every `eval_every` (held out, one position past
            ttt_steps), checkpoint every `checkpoint_every` (state.py)
    rank 0 at the end: a self-describing drafter directory (checkpoint.py), metrics CSV/JSON, PNG

Resume = run the same command again (same --output): Ray Train V2 hands the latest checkpoint
to the workers (model, optimizers, step, training time, epoch and the sample ids consumed in
the current epoch, so the data position is exact). A failed worker is restarted from the last
checkpoint (FailureConfig); steps after it are redone, and the metrics log is rewound to it, so
every step appears exactly once.

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import numpy as np
import pyarrow as pa
import torch

from eagle3_ray.data import schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import checkpoint, draft, kinds, vocab
from eagle3_ray.train.config import (VERIFIER_FIELDS, TrainConfig, autocast, autocast_dtype,
                                     check_config)
from eagle3_ray.train.feed import collate, split_rows
from eagle3_ray.train.loop import MetricSums, train_loop_per_worker


# --- driver-side preparation ------------------------------------------------------------------

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
                                                  norm_output=cfg.norm_output,
                                                  block_size=cfg.ttt_steps,
                                                  block_layers=cfg.block_layers)
    return {"manifest": manifest, "draft_config": dcfg.to_dict(), "d2t": d2t.tolist(),
            "manifest_hash": checkpoint.manifest_hash(manifest)}


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
                t = split_rows(pa.Table.from_batches([rb]), eval_fraction, True)
                for i in range(0, t.num_rows, batch_size):
                    b = collate(t.slice(i, batch_size), hidden, max_seq_len)
                    with autocast(torch.device("cpu"), amp_dtype):
                        loss, m = kinds.loss(drafter, teacher, b, depth, step_weight_decay=1.0,
                                             evaluating=True)
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
