"""Drafter training on real Ray Train (gloo, 2 CPU workers) over a tiny verifier's dataset:
loss falls, a killed worker resumes from the last checkpoint, reruns resume (into the next
epoch too), mismatches refused."""
import csv
import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from conftest import make_conversations
from eagle3_ray import cli
from eagle3_ray.data import schema
from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
from eagle3_ray.train.config import TrainConfig
from eagle3_ray.train.feed import ParquetShard, is_eval
from eagle3_ray.train.trainer import run_train


@pytest.fixture(scope="module")
def dataset(ray_cluster, tiny_verifier, tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    (d / "convs.json").write_text(json.dumps(make_conversations(48)))
    run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[str(d / "convs.json")],
                              output=str(d / "hs"), max_length=96, batch_rows=16))
    return str(d / "hs")


def config(tiny_verifier, dataset, output, **kw):
    # full draft vocab: a random verifier's argmax is spread over all 49k tokens
    kw = {"ttt_steps": 3, "draft_vocab_size": 49152, "batch_size": 4, "max_steps": 8,
          "lr": 3e-3, "warmup_steps": 2, "log_every": 1, "eval_every": 0, "checkpoint_every": 4,
          "eval_fraction": 0.15, "num_workers": 2, "cpus_per_worker": 0.5, **kw}
    return TrainConfig(dataset=dataset, output=str(output), verifier=tiny_verifier, **kw)


def logged_steps(output):
    with open(os.path.join(output, "metrics.csv")) as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_loss_falls_and_drafter_is_exported(ray_cluster, tiny_verifier, dataset, tmp_path):
    out = tmp_path / "run"
    run_train(config(tiny_verifier, dataset, out, max_steps=30, checkpoint_every=30,
                     eval_every=30))
    hist = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [h["step"] for h in hist] == list(range(1, 31))
    first = sum(h["train/loss"] for h in hist[:3]) / 3
    last = sum(h["train/loss"] for h in hist[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert hist[-1]["train/acc_0"] > hist[0]["train/acc_0"]
    assert {"eval/loss", "eval/accept_len", "eval/acc_2", "eval/cond_acc_2"} <= set(hist[-1])
    # the held-out eval measures one position past the trained depth; training does not
    assert "eval/cond_acc_3" in hist[-1] and "eval/cond_acc_4" not in hist[-1]
    assert "train/acc_2" in hist[-1] and "train/acc_3" not in hist[-1]
    assert 1.0 <= hist[-1]["eval/accept_len"] <= 4.0

    drafter = out / "drafter"
    meta = json.loads((drafter / "meta.json").read_text())
    assert meta["ttt_steps"] == 3 and meta["steps"] == 30
    assert meta["verifier_facts"]["hidden_size"] == 64
    assert meta["final_metrics"]["eval/accept_len"] == hist[-1]["eval/accept_len"]
    assert (drafter / "accuracy.png").stat().st_size > 1000
    weights = load_file(drafter / "model.safetensors")
    assert weights["lm_head.weight"].shape == (49152, 64) and weights["d2t"].shape == (49152,)

    # export through the CLI (in this process; tests/test_cli.py runs it as a command), then
    # read back: identical weights
    for fmt in ("vllm", "sglang", "speculators"):
        assert cli.main(["export", "--drafter", str(drafter), "--format", fmt,
                         "--output", str(tmp_path / fmt)]) == 0
        exported = {}
        for f in os.listdir(tmp_path / fmt):
            if f.endswith(".safetensors"):  # speculators names the layer layers.0
                exported.update({k.replace("layers.0.", "midlayer."): v
                                 for k, v in load_file(tmp_path / fmt / f).items()})
        for name, t in weights.items():
            if fmt in ("speculators", "vllm") and name in ("d2t", "t2d"):
                assert name not in exported  # both omit the mapping when Vd == V
                continue
            assert exported[name].equal(t), (fmt, name)


def test_killed_worker_resumes_and_a_rerun_continues_into_the_next_epoch(
        ray_cluster, tiny_verifier, dataset, tmp_path):
    """Rank 1 dies at step 4 (checkpoint at 3): the group restarts from step 3 and finishes the
    epoch, its last checkpoint taken after the epoch's last batch (every sample of it seen).
    The same command with more steps resumes from there into the next epoch. (A restarted
    worker group can also get rows that were all seen; that once failed as "no training
    samples reached the workers".)"""
    manifest = schema.read_manifest(dataset)
    rows = ParquetShard([f"{dataset}/{f['name']}" for f in manifest["files"]], 0.15, False, 0,
                        2).rows
    per_epoch = -(-len(rows) // 4)                 # batches of 4 on each of the 2 workers
    assert per_epoch >= 5                          # the death at step 4 falls inside epoch 0
    out, marker = tmp_path / "run", tmp_path / "died"
    result = run_train(config(tiny_verifier, dataset, out, max_steps=per_epoch,
                              checkpoint_every=3, fault_injection=f"die_once:4:{marker}"))
    assert marker.exists()  # rank 1 really died at step 4, after the step-3 checkpoint
    assert logged_steps(out) == list(range(1, per_epoch + 1))  # step 4 redone, logged once
    assert result.metrics["step"] == per_epoch
    assert result.checkpoint.path.endswith(f"step_{per_epoch:07d}")

    run_train(config(tiny_verifier, dataset, out, max_steps=per_epoch + 2, checkpoint_every=3))
    hist = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [h["step"] for h in hist] == list(range(1, per_epoch + 3))
    assert hist[per_epoch - 1]["epoch"] == 0 and hist[-1]["epoch"] == 1
    assert json.loads((out / "drafter" / "meta.json").read_text())["steps"] == per_epoch + 2


def test_fsdp_trains_checkpoints_whole_weights_and_resumes(ray_cluster, tiny_verifier, dataset,
                                                           tmp_path):
    """parallel="fsdp": FSDP2 over gloo, each of the 2 workers holding half of the drafter's
    weights, gradients and AdamW state. The loss falls, eval runs on an unsharded copy, the
    checkpoint and the exported drafter hold whole tensors, and a rerun resumes. The steps past
    0 run on half the positions (deep_fraction; eval on all of them)."""
    out = tmp_path / "run"
    run_train(config(tiny_verifier, dataset, out, parallel="fsdp", max_steps=16,
                     checkpoint_every=8, eval_every=16, deep_fraction=0.5))
    hist = [json.loads(line) for line in open(out / "metrics.jsonl")]
    first = sum(h["train/loss"] for h in hist[:3]) / 3
    last = sum(h["train/loss"] for h in hist[-3:]) / 3
    assert last < 0.9 * first, (first, last)
    assert "eval/acc_0" in hist[-1]
    # the deep step trained on about half the positions step 0 did
    assert hist[-1]["train/count_1"] < 0.8 * hist[-1]["train/count_0"]
    assert json.loads((out / "drafter" / "meta.json").read_text())["deep_fraction"] == 0.5
    weights = load_file(out / "drafter" / "model.safetensors")
    assert weights["lm_head.weight"].shape == (49152, 64)
    assert weights["midlayer.mlp.down_proj.weight"].shape == (64, 128)
    run_train(config(tiny_verifier, dataset, out, parallel="fsdp", max_steps=20,
                     checkpoint_every=8))
    assert logged_steps(out) == list(range(1, 21))
    with pytest.raises(ValueError, match="parallel must be ddp or fsdp"):
        run_train(config(tiny_verifier, dataset, tmp_path / "x", parallel="zero3"))
    with pytest.raises(ValueError, match="deep_fraction must be in"):
        run_train(config(tiny_verifier, dataset, tmp_path / "x", deep_fraction=1.5))


def test_mismatched_dataset_is_refused_before_training(ray_cluster, tiny_verifier, dataset,
                                                       tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["facts"]["hidden_size"] = 4096
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(schema.DatasetMismatch, match=r"manifest.json.*hidden_size.*4096"):
        run_train(config(tiny_verifier, str(bad), tmp_path / "run"))
    assert not (tmp_path / "run" / "ray").exists()
    with pytest.raises(schema.DatasetMismatch, match=rf"{bad}/manifest.json.*hidden_size"):
        run_train(config(tiny_verifier, f"{dataset},{bad}", tmp_path / "run"))  # the 2nd one


def test_several_datasets_are_read_as_one(tiny_verifier, dataset, tmp_path):
    """`--dataset A,B` (e.g. original and regenerated answers): both manifests checked,
    every part of both in the shards, each read from its own location."""
    from eagle3_ray.train import trainer as train
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    both = f"{dataset},{other}"
    one, union = schema.read_manifest(dataset), schema.read_datasets(both)
    assert len(union["files"]) == 2 * len(one["files"])
    assert union["summary"]["samples"] == 2 * one["summary"]["samples"]
    assert union["summary"]["skipped"] == {k: 2 * v for k, v in one["summary"]["skipped"].items()}
    assert {f["uri"].rsplit("/", 2)[-2] for f in union["files"]} == {"hs", "other"}
    setup = train.prepare(config(tiny_verifier, both, tmp_path / "run"))
    assert setup["manifest"]["files"] == union["files"]
    rows = lambda files: len(ParquetShard([f["uri"] for f in files], 0.15, False, 0, 1).rows)
    assert rows(union["files"]) == 2 * rows(schema.read_datasets(dataset)["files"]) > 0


def test_parquet_shards_split_the_dataset_equally_and_exactly(dataset):
    """Offline workers read their own share of the parts: train shards are equal, disjoint runs
    of the train split (fewer than `world` rows left out), eval shards cover the eval split once,
    the batches hold every row of a shard in order, across part boundaries, and set_epoch
    reorders a shard's rows per epoch, reproducibly."""
    names = [f["name"] for f in schema.read_manifest(dataset)["files"]]
    fs, root = schema.resolve_fs(dataset)
    ids = [s for n in names for s in schema.read_column(fs, f"{root}/{n}", "sample_id")]
    assert len(names) > 1
    train = [s for s in ids if not is_eval(s, 0.15)]
    evals = [s for s in ids if is_eval(s, 0.15)]

    def shard_ids(want_eval, rank, world, batch=3, epoch=None):
        shard = ParquetShard([f"{root}/{n}" for n in names], 0.15, want_eval, rank, world)
        if epoch is not None:
            shard.set_epoch(7, epoch)
        batches = list(shard.iter_batches(batch_size=batch))
        assert all(b.num_rows == batch for b in batches[:-1]) and "aux_hidden_states" in \
            batches[0].column_names
        return [s for b in batches for s in b.column("sample_id").to_pylist()]

    for world in (1, 2, 3):
        shards = [shard_ids(False, r, world) for r in range(world)]
        assert len({len(x) for x in shards}) == 1 and len(train) - world < sum(map(len, shards))
        assert sum(shards, []) == train[:sum(map(len, shards))]  # disjoint, in order
        assert sum((shard_ids(True, r, world) for r in range(world)), []) == evals
        # set_epoch shuffles each worker's own rows: the same rows, another order per epoch,
        # the same order again for the same epoch (a resumed epoch)
        for r in range(world):
            e0, e1 = shard_ids(False, r, world, epoch=0), shard_ids(False, r, world, epoch=1)
            assert sorted(e0) == sorted(e1) == sorted(shards[r])
            assert e0 != shards[r] and e0 != e1 and e0 == shard_ids(False, r, world, epoch=0)


def test_depth_curriculum_lr_schedule_and_precision():
    """Pure helpers of the loop: the TTT depth ramp, the lr schedule on the shared clock, the
    precision choice, and metric sums from a shallower unroll."""
    import torch
    from eagle3_ray.train import ttt
    from eagle3_ray.train.config import autocast_dtype, depth_at, lr_at
    from eagle3_ray.train.loop import MetricSums
    cfg = TrainConfig(dataset="x", ttt_steps=8, ttt_ramp=0.5, max_steps=100, warmup_steps=10,
                      lr=1e-3, min_lr_ratio=0.1)
    depths = [depth_at(cfg, s, 0.0) for s in range(100)]
    assert depths[0] == 1 and depths == sorted(depths) and depths.index(8) == 44
    assert set(depths) == set(range(1, 9))
    assert depth_at(TrainConfig(dataset="x", ttt_steps=8, ttt_ramp=0), 0, 0.0) == 8  # no ramp
    timed = TrainConfig(dataset="x", ttt_steps=8, ttt_ramp=0.5, max_minutes=10, max_steps=10**6)
    assert depth_at(timed, 5, 150.0) == 5       # 25% of the time budget = half the ramp
    assert lr_at(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert lr_at(cfg, 100, 0.0) == pytest.approx(1e-4)   # cosine down to lr * 0.1
    assert lr_at(timed, 50, 300.0) == pytest.approx(lr_at(
        TrainConfig(dataset="x", max_steps=10**6, max_minutes=10), 50, 300.0))
    assert autocast_dtype("fp32", True) is None
    assert autocast_dtype("bf16", False) is torch.bfloat16
    assert autocast_dtype("auto", True) is torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        autocast_dtype("fp16", False)
    sums = MetricSums(3)
    m = {k: [2.0] for k in ttt.COUNT_KEYS}             # a depth-1 batch
    sums.add(m, 1.0, 10)
    s = sums.summarize(sums.t, "")
    assert s["acc_0"] == 1.0 and s["acc_2"] == 0.0
    # reduce() moves the sums to the worker's device for the all-reduce (NCCL takes no CPU
    # tensors; only the GPU check exercises that) and hands them back on the CPU.
    assert torch.equal(sums.reduce(torch.device("cpu")), sums.t)


def test_vocab_source_and_recompute_choices():
    """The draft vocab is counted over the verifier's argmax when the dataset has it, else over
    the response tokens; recompute follows the device, and bad values are refused before
    anything starts."""
    from eagle3_ray.train import trainer as train
    from eagle3_ray.train.config import check_config, recompute
    auto = TrainConfig(dataset="x")
    assert train.vocab_column(True) == "target_ids"
    assert train.vocab_column(False) == "input_ids"                # online, format 1
    assert not recompute(auto) and recompute(TrainConfig(dataset="x", use_gpu=True))
    assert recompute(TrainConfig(dataset="x", recompute="on"))
    for bad in ({"targets": "kl"}, {"recompute": "yes"}, {"draft_layer": "gqa"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            check_config(TrainConfig(dataset="x", **bad))
    with pytest.raises(ValueError, match="no engine runs a parallel MLA drafter"):
        check_config(TrainConfig(dataset="x", draft_layer="mla", drafting="parallel"))


def test_adamw_state_round_trips_through_a_checkpoint(tmp_path):
    """AdamW over every trained tensor; the train state dict holds its state, and loading it
    into a fresh optimizer restores it exactly (a one-process gloo group, as the Ray Train
    workers have). A drafter of other shapes is refused, naming the tensor."""
    import torch
    import torch.distributed as dist
    from eagle3_ray.train.draft import DraftConfig, Eagle3Drafter
    from eagle3_ray.train.loop import make_optimizers
    from eagle3_ray.train.state import (RESUME_FIXED, full_state, load_train_state,
                                        save_train_state)
    c = DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=48, vocab_size=64, draft_vocab_size=16)
    cfg = TrainConfig(dataset="x")

    def fresh():
        torch.manual_seed(0)
        m = Eagle3Drafter(c)
        return m, make_optimizers(cfg, m)
    model, opts = fresh()
    (adamw,) = opts
    assert isinstance(adamw, torch.optim.AdamW)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert [p for g in adamw.param_groups for p in g["params"]] == trained
    x = torch.randn(2, 5, 3 * 32)
    ids = torch.randint(0, 64, (2, 5))
    for _ in range(2):
        loss = model.logits(model(ids, x, torch.arange(5)[None].expand(2, 5))).square().mean()
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        weights, opt_state = full_state(model, opts)
        save_train_state(str(tmp_path), weights, opt_state, {"step": 2})
        model2, opts2 = fresh()
        assert load_train_state(str(tmp_path), model2, opts2) == {"step": 2}
        # a resume with other shapes (here one more KV group) names the tensor
        wide = Eagle3Drafter(DraftConfig(**{**c.to_dict(), "num_key_value_heads": 3,
                                            "num_attention_heads": 6}))
        with pytest.raises(ValueError, match=r"k_proj.weight is \(16, 64\) there and \(24, 64\)"):
            load_train_state(str(tmp_path), wide, make_optimizers(cfg, wide))
        # another layer shape (--draft-layer mla, --fc-norm) is refused by its tensor names; a
        # toggle no tensor shows (--norm-output) by the run's recorded draft shape
        shape = {k: getattr(c, k) for k in RESUME_FIXED}
        save_train_state(str(tmp_path), weights, opt_state, {"step": 2, "draft_shape": shape})
        for change, match in [({"layer": "mla", "q_lora_rank": 8, "kv_lora_rank": 8,
                                "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4},
                               "layer"), ({"fc_norm": True}, "fc_norm"),
                              ({"norm_output": True}, "norm_output")]:
            other = Eagle3Drafter(DraftConfig(**{**c.to_dict(), **change}))
            with pytest.raises(ValueError, match=match):
                load_train_state(str(tmp_path), other, make_optimizers(cfg, other))
        assert load_train_state(str(tmp_path), model2, opts2)["draft_shape"] == shape
    finally:
        dist.destroy_process_group()
    for o, o2 in zip(opts, opts2):
        for p, p2 in zip((p for g in o.param_groups for p in g["params"]),
                         (p for g in o2.param_groups for p in g["params"])):
            torch.testing.assert_close(p2, p)
            assert o.state[p] and o.state[p].keys() == o2.state[p2].keys()
            for key, v in o.state[p].items():
                torch.testing.assert_close(o2.state[p2][key], v)


def test_sweep_trains_each_arm_in_its_own_process_and_evaluates_held_out(tiny_verifier, dataset,
                                                                        tmp_path):
    """bench sweep: two TrainConfig variants side by side for the same minutes, each in a
    fresh one-thread process, evaluated on the held-out split; JSON + PNG written. served:
    each arm's drafter is kept and decodes a held-out prompt through the real decoder. An arm
    may train on its own dataset. snapshots: the drafter as it was after that many minutes is
    kept beside it (none for a time past the arm's budget)."""
    from eagle3_ray.bench import sweep
    from eagle3_ray.plan import planner
    from eagle3_ray.train import checkpoint
    own = tmp_path / "own_data"
    shutil.copytree(dataset, own)
    base = {"verifier": tiny_verifier, "draft_vocab_size": 49152, "eval_fraction": 0.15,
            "max_seq_len": 96, "ttt_steps": 2, "warmup_steps": 2}
    arms = {"soft": {**base, "targets": "soft"},
            "hard": {**base, "max_minutes": 0.1,                            # its own budget
                     "dataset": f"{dataset},{own}"}}                        # and data (two)
    r = sweep.run(dataset, arms, minutes=0.05, eval_depth=2, out_dir=str(tmp_path),
                  served_prompts=1, served_tokens=4, snapshots=[0.02, 5])
    for name, run in r["runs"].items():
        assert run["steps"] >= 1 and run["tokens_per_s"] > 0, name
        assert run["eval_positions"] > 0 and len(run["acc"]) == 2, name
        assert 0 <= run["acc"][0] <= run["in_vocab"] <= 1, name
        assert run["group"] == 0                                    # both ran side by side
        assert run["drafter"] == str(tmp_path / "sweep" / name / "drafter")
        _, _, meta = checkpoint.load_drafter(run["drafter"])
        assert meta["steps"] == run["steps"] and meta["verifier"] == tiny_verifier
        # self-describing as a train drafter: the prior of serve's dynamic depth reads it
        cond, known, where = planner.acceptance_from(run["drafter"])
        assert cond == run["cond_acc"] and known == 2 and "final_metrics (eval)" in where
        assert meta["dataset"] == run["dataset"] == (f"{dataset},{own}" if name == "hard"
                                                     else dataset)
        _, _, snap = checkpoint.load_drafter(str(tmp_path / "sweep" / name / "drafter-0.02min"))
        assert 1 <= snap["steps"] <= meta["steps"] and snap["train_s"] >= 0.02 * 60, name
        assert not (tmp_path / "sweep" / name / "drafter-5min").exists()
        served = run["served"]
        assert served["rounds"] > 0 and served["tokens"] > 0 and len(served["cond_acc"]) == 16
    assert r["runs"]["soft"]["config"]["max_minutes"] == 0.05
    assert r["runs"]["hard"]["config"]["max_minutes"] == 0.1
    assert r["runs"]["hard"]["train_s"] >= 0.1 * 60 > r["runs"]["soft"]["train_s"]
    assert r["runs"]["soft"]["counted"] == r["runs"]["hard"]["counted"] == "target_ids"
    assert r["runs"]["hard"]["config"]["targets"] == "hard"
    assert (tmp_path / "sweep.json").is_file() and (tmp_path / "sweep.png").is_file()
