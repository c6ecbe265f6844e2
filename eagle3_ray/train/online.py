"""Online training: hidden states streamed from verifier actors into Ray Train, none on disk.

    conversation files -> read tasks, inside the pipeline: normalize, split train/eval by
                          sample-id hash, drop the ids the trainer already consumed this epoch
      -> Tokenize actors -> VerifierExtractor actors (extract/pipeline.py, emit="rows": the
         hidden-state rows go through Ray's object store; with --cache also written as offline
         Parquet parts)
      -> TorchTrainer workers: get_dataset_shard("train"), the same batches as offline (loop.py)

Each epoch re-runs the pipeline (Ray Train re-executes its dataset per epoch). With `--cache DIR`
the first epoch also writes DIR as an offline dataset (parts + manifest.json) and the epochs
after it read DIR instead of running the verifier. The held-out eval split is extracted once
per run into the object store. Backpressure between the two sides is Ray Data's streaming
executor; StatsActor counts both sides so a user can size replicas against workers.

Resume and faults: the trainer's checkpoint holds the sample ids consumed in the current epoch;
before each epoch's pipeline starts, rank 0 publishes the ids to skip (<output>/online/skip.json)
and the read tasks drop them before the verifier sees them. Ray Data restarts a dead extractor
actor and retries its batch; Ray Train restarts dead workers from the last checkpoint.

    eagle3-ray train --online --inputs embedded:sharegpt --limit 64 --max-length 256 \\
        --output /tmp/online --max-steps 20 --num-workers 1
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from dataclasses import replace
from typing import Iterator

import numpy as np
import pyarrow as pa

from eagle3_ray.data import conversations as data, schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.extract import pipeline as extract
from eagle3_ray.train import trainer as train, vocab
from eagle3_ray.train.config import TrainConfig, check_config
from eagle3_ray.train.feed import is_eval
from eagle3_ray.train.state import result_state

SOURCE_FILE = "online/source.json"      # in the run dir: the facts of the run's hidden states
SKIP_FILE = "online/skip.json"          # in the run dir: ids the read tasks drop this epoch
THROUGHPUT_FILE = "online/throughput.json"
READ_CPUS = 0.25                        # Ray CPUs of a read task (JSON parsing only)


# --- the pipeline -------------------------------------------------------------------------

def read_conversations(batch: pa.Table, limit: int | None, batch_rows: int,
                       eval_fraction: float, want_eval: bool | None, skip_file: str | None,
                       max_samples: int | None, stats_actor: str | None,
                       offset: int = 0) -> Iterator[dict]:
    """Ray Data generator UDF over rows of input-file groups -> blocks of `batch_rows`
    (sample_id, messages_json) rows: one split (want_eval; None = both), minus the ids listed in
    `skip_file`, at most `max_samples`. Files are read in order, so `limit` (first N usable
    conversations after `offset`) and `max_samples` pick the same samples on every run."""
    skip = set()
    if skip_file:
        fs, path = schema.resolve_fs(skip_file)
        if fs.get_file_info(path).type == pa.fs.FileType.File:
            with fs.open_input_stream(path) as f:
                skip = set(json.loads(f.read())["skip"])
    for files in batch.column("files").to_pylist():
        stats, ids, msgs, n = data.ReadStats(), [], [], 0
        for sid, messages in data.iter_samples(list(files), limit, stats, offset):
            if want_eval is not None and is_eval(sid, eval_fraction) != want_eval:
                continue
            n += 1
            if sid not in skip:
                ids.append(sid)
                msgs.append(json.dumps(messages))
            if len(ids) == batch_rows:
                yield {"sample_id": ids, "messages_json": msgs}
                ids, msgs = [], []
            if max_samples is not None and n >= max_samples:
                break
        if ids:
            yield {"sample_id": ids, "messages_json": msgs}
        if stats_actor:
            _stats(stats_actor).add.remote("read", samples=n, skipped=dict(stats.skipped))


def source(ecfg: extract.ExtractConfig, eval_fraction: float, want_eval: bool | None,
           skip_file: str | None = None, max_samples: int | None = None):
    """The read stage as a Ray Data dataset. One read task per input file; with a sample limit
    (or a cap) one task reads the files in order, so the first N are well defined."""
    import ray
    files = data.expand_inputs(ecfg.inputs)
    one = (ecfg.sample_limit is not None or ecfg.sample_offset or max_samples is not None
           or len(files) == 1)
    groups = [files] if one else [[f] for f in files]
    ds = ray.data.from_items([{"files": g} for g in groups], override_num_blocks=len(groups))
    return ds.map_batches(
        read_conversations, batch_size=1, batch_format="pyarrow", num_cpus=READ_CPUS,
        fn_kwargs=dict(limit=ecfg.sample_limit, batch_rows=ecfg.batch_rows,
                       eval_fraction=eval_fraction, want_eval=want_eval, skip_file=skip_file,
                       max_samples=max_samples, stats_actor=ecfg.stats_actor,
                       offset=ecfg.sample_offset))


def count_loss_tokens(ecfg: extract.ExtractConfig, vocab_size: int, max_samples: int) -> np.ndarray:
    """int64 [V] counts of the loss-masked tokens of the first `max_samples` conversations
    (read + Tokenize only, no verifier): what vocab.count_tokens gives offline. With
    --regenerate they count the original answers (regenerated ones don't exist yet)."""
    import ray

    def count(batch: pa.Table) -> dict:
        keep = batch.filter(pa.compute.equal(batch.column("skip_reason"), ""))
        return {"counts": [vocab._count_row_group(keep, vocab_size, "online vocabulary count")]}

    ds = extract.tokenize_stage(source(replace(ecfg, stats_actor=None), 0.0, None,
                                       max_samples=max_samples), ecfg)
    total = np.zeros(vocab_size, dtype=np.int64)
    for batch in ds.map_batches(count, batch_format="pyarrow", num_cpus=READ_CPUS).iter_batches(
            batch_size=None, batch_format="numpy"):
        total += np.asarray(list(batch["counts"]), dtype=np.int64).sum(axis=0)
    return total


# --- throughput balance ----------------------------------------------------------------------

def _stats(name: str):
    import ray
    return ray.get_actor(name, namespace=extract.STATS_NAMESPACE)


def _make_stats_actor(name: str):
    import ray

    @ray.remote(num_cpus=0)
    class StatsActor:
        """Counters of both sides of the online pipeline: read, extract, train."""

        def __init__(self):
            self.reset()

        def reset(self) -> None:
            self.c = collections.defaultdict(float)
            self.skipped = collections.Counter()
            self.first, self.last = float("inf"), 0.0  # span of the extract/train activity

        def add(self, kind: str, samples: int = 0, tokens: int = 0, seconds: float = 0.0,
                wait_s: float = 0.0, skipped: dict | None = None) -> None:
            for k, v in (("samples", samples), ("tokens", tokens), ("seconds", seconds),
                         ("wait_s", wait_s), ("batches", 1)):
                self.c[f"{kind}_{k}"] += v
            self.skipped.update(skipped or {})
            if kind in ("extract", "train"):
                now = time.time()
                self.first, self.last = min(self.first, now - seconds), now

        def snapshot(self) -> dict:
            return {**self.c, "wall_s": max(0.0, self.last - self.first),
                    "skipped": dict(self.skipped)}

    return StatsActor.options(name=name, namespace=extract.STATS_NAMESPACE,
                              get_if_exists=True).remote()


def balance(snap: dict, replicas: int, workers: int) -> dict:
    """Throughput-balance figures from a StatsActor snapshot over one fit (from the first
    extracted batch to the last trained one): tokens/s of each side and how long each waited
    for the other."""
    wall = max(snap["wall_s"], 1e-9)
    busy = snap.get("extract_seconds", 0.0) / (wall * replicas)
    return {
        "wall_s": wall,
        "extract_samples": int(snap.get("extract_samples", 0)),
        "extract_tokens": int(snap.get("extract_tokens", 0)),
        "extract_tokens_per_s": snap.get("extract_tokens", 0) / wall,
        "extract_tokens_per_s_busy": snap.get("extract_tokens", 0)
        / max(snap.get("extract_seconds", 0.0), 1e-9) / replicas,   # per replica, while busy
        "extract_busy": busy,                  # share of the replicas' time spent extracting
        "extract_idle_s": max(0.0, 1 - busy) * wall * replicas,  # waited on input or trainer
        "train_samples": int(snap.get("train_samples", 0)),
        "train_tokens_per_s": snap.get("train_tokens", 0) / wall,
        "train_wait_s": snap.get("train_wait_s", 0.0) / max(1, workers),  # per worker
        # share of the training loop's time spent waiting for a batch (all workers)
        "train_wait_frac": snap.get("train_wait_s", 0.0) / max(snap.get("train_seconds", 0.0), 1e-9),
        "skipped": snap.get("skipped", {}),
    }


# --- driver -------------------------------------------------------------------------------

def read_source(output: str) -> tuple[str, dict | None]:
    """The run dir's SOURCE_FILE -> (its path, its contents, or None before the first run)."""
    fs, root = schema.resolve_fs(output)
    path = f"{root}/{SOURCE_FILE}"
    if fs.get_file_info(path).type != pa.fs.FileType.File:
        return path, None
    with fs.open_input_stream(path) as f:
        return path, json.loads(f.read())


def check_source(output: str, facts: dict, ecfg: extract.ExtractConfig) -> None:
    """The run dir remembers the hidden states it was trained on; a rerun with another
    verifier, layer ids, max length or regeneration is refused before anything starts."""
    path, saved = read_source(output)
    if saved is not None:
        schema.check_compatible(saved, facts, where=path)
        if (saved.get("inputs") != ecfg.inputs or saved.get("limit") != ecfg.sample_limit
                or saved.get("skip", 0) != ecfg.sample_offset):
            raise ValueError(f"{path}: run was started on --inputs {saved.get('inputs')} "
                             f"--limit {saved.get('limit')} --skip {saved.get('skip', 0)}; "
                             f"use a new --output to change them")
        return
    fs, _ = schema.resolve_fs(output)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    schema.write_bytes_atomic(fs, path, json.dumps(
        {"facts": facts, "inputs": ecfg.inputs, "limit": ecfg.sample_limit,
         "skip": ecfg.sample_offset}, indent=2).encode())


def fit_cpus(tcfg: TrainConfig, ecfg: extract.ExtractConfig):
    """Both configs with the CPUs per training worker and per verifier replica decided: the
    flags given, else 1, or on a local Ray the machine shared between them (launch.fit_cpus)."""
    from eagle3_ray import launch
    fit = launch.fit_cpus(
        extract.pipeline_cpus(ecfg) + READ_CPUS,
        worker=(tcfg.cpus_per_worker, 0 if tcfg.use_gpu else tcfg.num_workers),
        replica=(ecfg.cpus_per_replica, 0 if extract.gpu_replicas(ecfg) else ecfg.replicas))
    return (replace(tcfg, cpus_per_worker=fit["worker"]),
            replace(ecfg, cpus_per_replica=fit["replica"]))


def check_resources(tcfg: TrainConfig, ecfg: extract.ExtractConfig) -> None:
    """Online runs verifier replicas and training workers at once: refuse a plan the cluster
    cannot hold (it would wait forever) with the numbers to change."""
    import ray
    if tcfg.node_resource or ecfg.node_resource:
        return  # separate node types: the autoscaler brings them
    have = ray.cluster_resources()
    if tcfg.use_gpu or ecfg.gpus_per_replica:
        need = tcfg.num_workers * tcfg.use_gpu + ecfg.replicas * ecfg.gpus_per_replica
        if need > have.get("GPU", 0):
            raise ValueError(f"online training needs {need} GPUs at once ({tcfg.num_workers} "
                             f"workers + {ecfg.replicas} replicas x {ecfg.gpus_per_replica}); "
                             f"the cluster has {have.get('GPU', 0):g}")
    cpus = (0 if tcfg.use_gpu else tcfg.num_workers * tcfg.cpus_per_worker) \
        + (0 if extract.gpu_replicas(ecfg) else ecfg.replicas * ecfg.cpus_per_replica) \
        + extract.pipeline_cpus(ecfg) + READ_CPUS
    if cpus > have.get("CPU", 0) + 1e-9:
        raise ValueError(
            f"online training needs {cpus:g} CPUs at once (training workers {tcfg.num_workers} x "
            f"{tcfg.cpus_per_worker:g}, verifier replicas {ecfg.replicas} x "
            f"{ecfg.cpus_per_replica:g}, tokenizer and read tasks); the cluster has "
            f"{have.get('CPU', 0):g}: lower --num-workers, --cpus-per-worker or "
            f"--cpus-per-replica")


def drop_eval_parts(cache: str, eval_fraction: float) -> None:
    """Delete the cache parts holding only eval-split samples (extraction writes the splits to
    separate parts)."""
    fs, root = schema.resolve_fs(cache)
    for path in schema.list_parts(fs, root):
        if all(is_eval(s, eval_fraction) for s in schema.read_column(fs, path, "sample_id")):
            fs.delete_file(path)


def cache_complete(cache: str) -> bool:
    """A cache directory whose first epoch finished: a manifest marked complete."""
    try:
        return bool(schema.read_manifest(cache).get("summary", {}).get("online_epoch_complete"))
    except FileNotFoundError:
        return False


def run_online(tcfg: TrainConfig, ecfg: extract.ExtractConfig,
               address: str | None = None, cache: str | None = None,
               vocab_samples: int = 50_000, eval_samples: int = 512):
    """Train a drafter on hidden states extracted as it trains. Rerun the same command to
    resume. Returns the last Ray Train Result."""
    import ray
    from eagle3_ray.launch import init_ray
    spec = tcfg.verifier or ecfg.verifier or verifier.EMBEDDED_VERIFIER
    data.expand_inputs(ecfg.inputs), verifier.resolve(spec)  # fail fast, before Ray
    tcfg = replace(tcfg, output=schema.absolute(tcfg.output), verifier=verifier.absolute_spec(spec))
    run_id = hashlib.sha1(tcfg.output.encode()).hexdigest()[:12]
    cache = schema.absolute(cache) if cache else None
    ecfg = replace(ecfg, verifier=tcfg.verifier, output=cache or "", emit="rows",
                   stats_actor=f"online-stats-{run_id}")
    ecfg = extract.with_engine_model(ecfg)   # --engine vllm: its environment, a transformers dir
    tcfg = replace(tcfg, dataset=cache or f"online:{','.join(ecfg.inputs)}")
    check_config(tcfg)
    tok, config = verifier.load_tokenizer(tcfg.verifier), verifier.load_config(tcfg.verifier)
    facts = extract.dataset_facts(ecfg, config, tok)
    check_source(tcfg.output, facts, ecfg)
    if cache:
        fs, root = schema.resolve_fs(cache)
        fs.create_dir(root, recursive=True)
        schema.remove_temp_files(fs, root)
        extract.existing_parts(fs, root, facts)  # refuses a cache of other hidden states
        if cache_complete(cache):  # epoch 0 is done: the rest is offline training on it
            print(f"[online] {cache} holds the first epoch: training from it")
            return train.run_train(tcfg, address)
    init_ray(address)
    tcfg, ecfg = fit_cpus(tcfg, ecfg)
    check_resources(tcfg, ecfg)
    stats = _make_stats_actor(ecfg.stats_actor)
    stats.reset.remote()  # a rerun in the same Ray session finds the actor of the last run
    fs, root = schema.resolve_fs(tcfg.output)
    skip_file = f"{tcfg.output}/{SKIP_FILE}"

    counts_fn = lambda: count_loss_tokens(ecfg, verifier.text_config(config).vocab_size, vocab_samples)  # noqa: E731
    setup = train.make_setup(tcfg, {"facts": facts, "files": [], "summary": {"target_ids": True}},
                             counts_fn)
    setup.update(skip_file=skip_file, cache=cache, stats_actor=ecfg.stats_actor)

    if cache:  # the eval split is extracted (and cached) again below: drop an older copy
        drop_eval_parts(cache, tcfg.eval_fraction)
    t0 = time.perf_counter()
    eval_ds = extract.extraction_stages(
        source(ecfg, tcfg.eval_fraction, True, max_samples=eval_samples), ecfg, facts).materialize()
    eval_s = time.perf_counter() - t0
    eval_snap = ray.get(stats.snapshot.remote())
    stats.reset.remote()  # the balance figures cover the training pipeline only
    train_ds = extract.extraction_stages(
        source(ecfg, tcfg.eval_fraction, False, skip_file=skip_file), ecfg, facts)
    fit_cfg = replace(tcfg, max_epochs=1) if cache else tcfg  # a cache serves epochs 1..
    result = train.fit(fit_cfg, setup, {"train": train_ds, "eval": eval_ds})
    figures = {**balance(ray.get(stats.snapshot.remote()), ecfg.replicas, tcfg.num_workers),
               "eval_extract_s": eval_s,
               "eval_extract_samples": int(eval_snap.get("extract_samples", 0)),
               "num_workers": tcfg.num_workers,
               "replicas": ecfg.replicas}
    schema.write_bytes_atomic(fs, f"{root}/{THROUGHPUT_FILE}",
                              json.dumps(figures, indent=2).encode())
    print_balance(figures)
    if not cache:
        return result
    state = result_state(result)
    if state["epoch"] < 1:
        print(f"[online] stopped inside the first epoch: {cache} has no manifest yet "
              "(rerun to go on)")
        return result
    read_stats = data.ReadStats(skipped=collections.Counter(figures["skipped"]) +
                                collections.Counter(eval_snap["skipped"]))
    manifest = extract.finalize(ecfg, facts, read_stats, {
        "samples": figures["extract_samples"] + figures["eval_extract_samples"],
        "tokens": figures["extract_tokens"],
        "wall_s": figures["wall_s"], "tokens_per_s": figures["extract_tokens_per_s"],
        "resumed_samples": 0, "skipped": {}}, extra_summary={"online_epoch_complete": True})
    extract.print_summary(cache, manifest)
    if state["step"] < tcfg.max_steps and tcfg.max_epochs > 1:
        return train.run_train(tcfg, address)  # epochs 1.. read the cache (resumes the checkpoint)
    return result


def print_balance(f: dict) -> None:
    print(f"[online] extraction {f['extract_tokens_per_s']:.0f} tokens/s over the run "
          f"({f['extract_tokens_per_s_busy']:.0f} per replica while busy, busy "
          f"{100 * f['extract_busy']:.0f}% of the time); training {f['train_tokens_per_s']:.0f} "
          f"tokens/s, waited on data {100 * f['train_wait_frac']:.0f}% of the time "
          f"({f['train_wait_s']:.1f}s per worker)")
    if f["train_wait_frac"] > 0.1:
        print("[online] the trainer waits on extraction: add verifier replicas "
              "(--replicas) or make each faster")
    elif f["extract_busy"] < 0.7:
        print("[online] extraction waits on the trainer: fewer replicas would do, or add workers")

