"""What a training worker reads: the train/eval split (by sample-id hash), its share of an
on-disk dataset (ParquetShard) or of the online pipeline (data_shard), Arrow rows -> tensors
(collate), and the collectives that keep the workers in step over the data: skip what this
epoch already consumed, stop together when a shard runs dry or the time is up.

    eagle3-ray train --dataset runs/demo/data --output /tmp/train --ttt-steps 4 --max-steps 20
"""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_ray.data import schema
from eagle3_ray.train.config import TrainConfig

def is_eval(sample_id: str, fraction: float) -> bool:
    return zlib.crc32(sample_id.encode()) % 10_000 < fraction * 10_000


def split_rows(batch: pa.Table, fraction: float, want_eval: bool) -> pa.Table:
    """Keep the eval (or train) rows of an Arrow batch, without touching the hidden states."""
    mask = [is_eval(s, fraction) == want_eval for s in batch.column("sample_id").to_pylist()]
    return batch.filter(pa.array(mask, pa.bool_()))


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


def data_shard(setup: dict, cfg: TrainConfig, split: str, rank: int, world: int):
    """This worker's "train" or "eval" data: its ParquetShard of an on-disk dataset, else (online)
    its shard of the Ray Data pipeline."""
    if setup.get("read_parquet"):
        return ParquetShard([f["uri"] for f in setup["manifest"]["files"]],
                            cfg.eval_fraction, split == "eval", rank, world)
    import ray.train
    return ray.train.get_dataset_shard(split)


def next_unseen(it, seen: set):
    """Next batch of the shard, minus samples already consumed this epoch (resume)."""
    for batch in it:
        if seen:
            keep = [i for i, s in enumerate(batch.column("sample_id").to_pylist()) if s not in seen]
            batch = batch.take(pa.array(keep, pa.int64()))
        if batch.num_rows:
            return batch
    return None


def publish_skip(cfg: TrainConfig, setup: dict, rank: int, epoch: int, seen: set) -> None:
    """Online: before an epoch's pipeline starts, rank 0 writes the ids its read tasks must drop
    (online.read_conversations); every worker waits for it. Without a cache that is what this
    epoch already consumed. With a cache (first epoch), cache parts holding any sample not
    consumed are deleted and the ids of the parts kept are skipped: the rest is extracted
    again, so the cache ends complete and without duplicates, and the trainer drops the
    re-extracted samples it has already seen (next_unseen)."""
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


def report_online(setup: dict, wait: dict) -> None:
    """Online: this worker's consumed samples, tokens and data wait since the last call -> the
    run's StatsActor (the throughput balance, online.balance)."""
    if setup.get("stats_actor") and wait["samples"]:
        import ray
        from eagle3_ray.extract.pipeline import STATS_NAMESPACE
        ray.get_actor(setup["stats_actor"], namespace=STATS_NAMESPACE).add.remote(
            "train", samples=wait["samples"], tokens=wait["tokens"], wait_s=wait["s"],
            seconds=time.monotonic() - wait["since"])
    wait.update(s=0.0, tokens=0, samples=0, since=time.monotonic())


def all_dry(it, seen: set, device) -> bool:
    """Whether every worker's shard is used up (pulls one more batch, not trained on). An
    online cache is finished only by a whole first epoch: a run whose last step takes the
    epoch's last batch must say so."""
    t = torch.tensor([0.0 if next_unseen(it, seen) is None else 1.0], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t[0]) == 0


def all_agree(have_batch: bool, train_s: float, budget_s: float, device):
    """-> (all workers have a batch and time left, some worker ran out of time, the slowest
    worker's training time). Every worker then uses that one clock for the lr and the TTT depth,
    so DDP replicas never step with different learning rates."""
    t = torch.tensor([0.0 if have_batch else 1.0, train_s], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    out_of_time = float(t[1]) >= budget_s
    return float(t[0]) == 0 and not out_of_time, out_of_time, float(t[1])


def all_gather_ids(ids: list[str], world: int) -> list[str]:
    if world == 1:
        return ids
    out = [None] * world
    torch.distributed.all_gather_object(out, ids)
    return [s for part in out for s in part]
