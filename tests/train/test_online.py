"""Online training on real Ray Data + Ray Train (tiny verifier, 1 CPU worker): hidden states go
from the extractor actors to the trainer through the object store. The loss falls, nothing is
written without --cache, --cache writes the first epoch as an offline dataset that the later
epochs read, a killed training worker and a killed verifier actor each leave every sample
consumed exactly once per epoch, a rerun resumes, and mismatches are refused up front."""
import glob
import json
import os
from dataclasses import replace

import pyarrow as pa
import pytest

from conftest import make_conversations
from eagle3_ray.data import conversations as data, schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import online
from eagle3_ray.extract.pipeline import ExtractConfig, dataset_facts
from eagle3_ray.train.config import TrainConfig
from eagle3_ray.train.feed import is_eval

EVAL_FRACTION = 0.15


@pytest.fixture(scope="module")
def conv_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("online") / "convs.json"
    p.write_text(json.dumps(make_conversations(40)))
    return str(p)


@pytest.fixture(scope="module")
def split_ids(conv_file):
    ids = [sid for sid, _ in data.iter_samples([conv_file])]
    train = {s for s in ids if not is_eval(s, EVAL_FRACTION)}
    return train, set(ids) - train


def ecfg(tiny_verifier, conv_file, **kw):
    return ExtractConfig(verifier=tiny_verifier, inputs=[conv_file], max_length=96,
                         batch_rows=8, cpus_per_replica=0.5, **kw)


def tcfg(tiny_verifier, out, **kw):
    # full draft vocab: a random verifier's argmax is spread over all 49k tokens
    kw = {"ttt_steps": 2, "draft_vocab_size": 49152, "batch_size": 4, "max_steps": 100,
          "lr": 3e-3, "warmup_steps": 2, "log_every": 1, "eval_every": 0, "checkpoint_every": 3,
          "eval_fraction": EVAL_FRACTION, "num_workers": 1, "cpus_per_worker": 0.5, **kw}
    return TrainConfig(dataset="", output=str(out), verifier=tiny_verifier, **kw)


def history(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def final_state(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return json.load(open(os.path.join(d, "state.json")))


def throughput(out) -> dict:
    return json.load(open(os.path.join(out, online.THROUGHPUT_FILE)))


def test_online_trains_resumes_and_survives_a_dead_verifier_actor(
        ray_cluster, tiny_verifier, conv_file, split_ids, tmp_path):
    """Two epochs. An extractor actor dies mid-batch (Ray Data restarts it and retries the
    batch); the run stops 4 steps into epoch 1, and the same call with more steps resumes:
    the pipeline drops the 16 samples epoch 1 already trained on before the verifier."""
    train_ids, eval_ids = split_ids
    n, per_epoch = len(train_ids), -(-len(train_ids) // 4)
    out, marker = tmp_path / "run", tmp_path / "died"
    e = ecfg(tiny_verifier, conv_file, fault_injection=f"die_once:{marker}")
    online.run_online(tcfg(tiny_verifier, out, max_epochs=2, max_steps=per_epoch + 4), e)
    assert marker.exists()  # an extractor actor died (os._exit) in the middle of a batch
    first = throughput(out)
    assert first["eval_extract_samples"] == len(eval_ids)  # the eval split, once per run
    assert n + 16 <= first["extract_samples"] <= 2 * n  # + what was in flight at the stop

    result = online.run_online(tcfg(tiny_verifier, out, max_epochs=2), e)
    skip = json.loads((out / online.SKIP_FILE).read_text())
    assert skip["epoch"] == 1 and len(skip["skip"]) == 16 and set(skip["skip"]) <= train_ids
    assert throughput(out)["extract_samples"] == n - 16  # the rest of epoch 1, once
    # each sample of the train split exactly once in each epoch
    assert final_state(result)["epochs"] == [{"epoch": 0, "samples": n, "unique": n},
                                             {"epoch": 1, "samples": n, "unique": n}]
    hist = history(out)
    assert [h["step"] for h in hist] == list(range(1, 2 * per_epoch + 1))
    first_loss = sum(h["train/loss"] for h in hist[:3]) / 3
    last_loss = sum(h["train/loss"] for h in hist[-3:]) / 3
    assert last_loss < 0.8 * first_loss, (first_loss, last_loss)
    assert "eval/acc_0" in hist[-1] and (out / "drafter" / "model.safetensors").exists()
    # nothing of the hidden states on disk: no Parquet anywhere under the run or the tmp dir
    assert glob.glob(str(tmp_path / "**" / "*.parquet"), recursive=True) == []
    assert 0 <= throughput(out)["train_wait_frac"] <= 1


def test_cache_survives_a_dead_worker_and_serves_later_epochs(ray_cluster, tiny_verifier,
                                                              conv_file, split_ids, tmp_path):
    """--cache: rank 0 dies at step 5 of epoch 0 (checkpoint at 3). The restart deletes the
    cache parts holding samples it has not trained on and extracts them again, so the first
    epoch still ends as a complete offline dataset without duplicates; epoch 1 reads it.
    The drafter here is a block (DFlash) one: online training takes any drafting kind, and its
    loss falls too."""
    train_ids, eval_ids = split_ids
    n = len(train_ids)
    out, cache, marker = tmp_path / "run", tmp_path / "cache", tmp_path / "died"
    result = online.run_online(tcfg(tiny_verifier, out, max_epochs=2, drafting="block",
                                    block_layers=1, fault_injection=f"die_once:5:{marker}"),
                               ecfg(tiny_verifier, conv_file), cache=str(cache))
    assert marker.exists()
    m = schema.read_manifest(str(cache))  # a finished offline dataset
    assert m["summary"]["online_epoch_complete"] is True
    fs, root = schema.resolve_fs(str(cache))
    ids = [s for p in schema.list_parts(fs, root) for s in schema.read_column(fs, p, "sample_id")]
    assert sorted(ids) == sorted(train_ids | eval_ids) and m["summary"]["samples"] == len(ids)
    skip = json.loads((out / online.SKIP_FILE).read_text())  # written by the restarted rank 0
    assert skip["epoch"] == 0 and len(skip["skip"]) <= 12 and set(skip["skip"]) <= train_ids
    # the verifier ran in the first epoch only (a restart re-extracts what was in flight)
    assert n <= throughput(out)["extract_samples"] < 2 * n
    assert final_state(result)["epochs"] == [{"epoch": e, "samples": n, "unique": n}
                                             for e in range(2)]
    hist = history(out)
    steps = [h["step"] for h in hist]
    assert steps == list(range(1, steps[-1] + 1))  # steps 4-5 redone, logged once
    first_loss = sum(h["train/loss"] for h in hist[:3]) / 3
    last_loss = sum(h["train/loss"] for h in hist[-3:]) / 3
    assert last_loss < 0.8 * first_loss, (first_loss, last_loss)
    meta = json.loads((out / "drafter" / "meta.json").read_text())
    assert meta["drafting"] == "block" and "eval/acc_2" in hist[-1]  # ttt 2 + the probe
    # the Parquet files are the cache's only
    assert {os.path.dirname(p) for p in glob.glob(str(tmp_path / "**" / "*.parquet"),
                                                  recursive=True)} == {str(cache)}


def test_the_read_stage_takes_a_slice_like_extract(conv_file):
    """`--skip N --limit M`: the same usable conversations online as offline (data.iter_samples),
    read by the online pipeline's read UDF directly (no Ray needed for one file group)."""
    ids = [sid for sid, _ in data.iter_samples([conv_file])]
    blocks = online.read_conversations(pa.table({"files": [[conv_file]]}), limit=5,
                                       batch_rows=3, eval_fraction=EVAL_FRACTION,
                                       want_eval=None, skip_file=None, max_samples=None,
                                       stats_actor=None, offset=10)
    assert [s for b in blocks for s in b["sample_id"]] == ids[10:15]


def test_mismatches_are_refused_before_starting(ray_cluster, tiny_verifier, conv_file, tmp_path):
    e = ecfg(tiny_verifier, conv_file)
    facts = dataset_facts(e, verifier.load_config(tiny_verifier),
                          verifier.load_tokenizer(tiny_verifier))
    out = tmp_path / "run"
    # a run dir remembers its hidden states: other layer ids are refused, naming the field
    online.check_source(str(out), facts, e)
    with pytest.raises(ValueError, match=r"source.json.*--skip 0"):      # another slice
        online.check_source(str(out), facts, ecfg(tiny_verifier, conv_file, sample_offset=3))
    with pytest.raises(schema.DatasetMismatch, match=r"source.json.*aux_layer_ids"):
        online.run_online(tcfg(tiny_verifier, out),
                          ecfg(tiny_verifier, conv_file, layer_ids=[1, 2, 3]))
    # a cache holding another verifier's hidden states is refused too
    cache = tmp_path / "cache"
    cache.mkdir()
    schema.write_part(*schema.resolve_fs(str(cache)), schema.SCHEMA.empty_table(),
                      {**facts, "hidden_size": 4096})
    with pytest.raises(schema.DatasetMismatch, match=r"part-.*hidden_size"):
        online.run_online(tcfg(tiny_verifier, tmp_path / "run2"), e, cache=str(cache))
    # and so are out-of-range settings and a plan the cluster cannot hold at once
    with pytest.raises(ValueError, match="ttt_steps"):
        online.run_online(tcfg(tiny_verifier, tmp_path / "run3", ttt_steps=0), e)
    with pytest.raises(ValueError, match="CPUs at once"):
        online.run_online(tcfg(tiny_verifier, tmp_path / "run4", num_workers=2,
                               cpus_per_worker=1), e)


def test_default_cpus_fit_a_local_ray_and_flags_win(ray_cluster, monkeypatch):
    """On a Ray that init_ray started itself (this machine is the cluster; here the test
    cluster's 2 CPUs, marked as such), CPUs per worker and replica left to their defaults
    share what the machine has; given flags stand; on a cluster they are 1 each (the autoscaler
    brings CPUs). Default `train --online --num-workers 1` on 2 cores asked for 2.25 before."""
    from eagle3_ray import launch
    from eagle3_ray.extract import pipeline as extract
    from eagle3_ray.serve import app as serve
    from eagle3_ray.train import trainer as train
    t = TrainConfig(dataset="", output="x", num_workers=1)
    e = ExtractConfig()
    assert (t.cpus_per_worker, e.cpus_per_replica) == (None, None)       # the defaults: open
    cluster_t, cluster_e = online.fit_cpus(t, e)
    assert (cluster_t.cpus_per_worker, cluster_e.cpus_per_replica) == (1.0, 1.0)
    monkeypatch.setattr(launch, "_LOCAL_RAY", True)
    local_t, local_e = online.fit_cpus(t, e)
    assert local_t.cpus_per_worker == local_e.cpus_per_replica == 0.87  # (2 - 0.25 read) / 2
    online.check_resources(local_t, local_e)                             # fits: no error
    with pytest.raises(ValueError, match="online training needs 2.25 CPUs"):
        online.check_resources(cluster_t, cluster_e)
    given_t, given_e = online.fit_cpus(t, ExtractConfig(cpus_per_replica=1.5))
    assert (given_t.cpus_per_worker, given_e.cpus_per_replica) == (0.25, 1.5)   # flag wins
    assert extract.fit_cpus(ExtractConfig(replicas=4)).cpus_per_replica == 0.5
    assert train.fit_cpus(replace(t, num_workers=2)).cpus_per_worker == 1.0
    assert train.fit_cpus(replace(t, num_workers=4)).cpus_per_worker == 0.5
    assert serve.fit_cpus(serve.ServeConfig(num_replicas=3)).cpus_per_replica == 0.66
    assert serve.fit_cpus(serve.ServeConfig(cpus_per_replica=2)).cpus_per_replica == 2
