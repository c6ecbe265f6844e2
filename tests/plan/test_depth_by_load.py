"""Depth by load (issue 59): the verify surface over batch x tokens in a profile, the
per-batch-size schedule's arithmetic (plan/load.py), the Kimi roofline the packaged surfaces come
from, `plan` printing the schedule, and `serve --engine vllm --depth auto` putting it into
vLLM's speculative_config."""
import json
import types

import pytest
import yaml

from eagle3_ray import cli
from eagle3_ray.plan import cost, load, profiles, roofline
from eagle3_ray.serve import vllm as serve_vllm

DECAYING = [0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45]


def node(surface=None, **kw) -> profiles.NodeProfile:
    """1 GPU, verify 10 + 2t ms at batch 1, draft step 1 ms; `surface` as verify_batch_ms."""
    d = dict(name="hand", description="test", sources=["hand"], gpus=1,
             interconnect=profiles.Interconnect(0.0, 1.0, 0, 1000, 2),
             verify_ms={1: 12.0, 2: 14.0, 4: 18.0}, draft_step_ms=1.0,
             verify_batch_ms=surface)
    d.update(kw)
    return profiles.NodeProfile(**d)


# a batch of B sequences costs B x the batch-1 forward per extra token: steep, compute-bound
STEEP = {b: {1: 10.0 + 2 * b, 2: 10.0 + 4 * b, 4: 10.0 + 8 * b} for b in (2, 8, 64)}


def test_surface_interpolates_between_batches_and_extrapolates_past_the_last():
    p = node(STEEP)
    assert load.verify_batch_compute_s(p, 1, 2) == pytest.approx(cost.compute_s(p, 2))
    assert load.verify_batch_compute_s(p, 8, 2) == pytest.approx(42e-3)
    assert load.verify_batch_compute_s(p, 5, 1) == pytest.approx((14 + 26) / 2 * 1e-3)  # 2..8
    assert load.verify_batch_compute_s(p, 8, 3) == pytest.approx((42 + 74) / 2 * 1e-3)  # tokens
    assert load.verify_batch_compute_s(p, 128, 1) == pytest.approx(266e-3)   # past 64: linear
    with pytest.raises(ValueError, match="batch 1 only"):
        load.verify_batch_compute_s(node(), 2, 1)


def test_round_at_batch_one_is_the_single_stream_round():
    p = node(STEEP, draft_parallel_ms={1: 0.5, 16: 0.8})
    for k in range(5):
        for kind in ("chain", "parallel", "block"):
            assert load.round_batch_s(p, 1, k, kind) == pytest.approx(cost.round_s(p, k, kind))
    # batch 8, depth 2, chain: 2 steps of t_step + t_par(8) - t_par(1), + V(8, 3)
    step = 1.0 + (0.5 + 0.3 * 7 / 15) - 0.5
    assert load.round_batch_s(p, 8, 2) * 1e3 == pytest.approx(2 * step + 58.0)


def test_steep_surface_speculates_at_batch_one_and_not_at_large_batch():
    r = load.depth_schedule(DECAYING, node(STEEP), max_batch=64)
    assert r["schedule"][0][:2] == [1, 1] and r["schedule"][0][2] > 0
    assert r["schedule"][-1] == [r["schedule"][-1][0], 64, 0]
    assert r["num_speculative_tokens"] == max(k for _, _, k in r["schedule"])
    assert r["schedule"][0][2] == cost.best_depth(DECAYING, node(STEEP), len(DECAYING))
    ends = [(a, b) for a, b, _ in r["schedule"]]               # contiguous, inclusive, from 1
    assert ends[0][0] == 1 and all(b + 1 == a2 for (_, b), (a2, _) in zip(ends, ends[1:]))
    big = next(row for row in r["rows"] if row["batch"] == 64)
    assert big["depth"] == 0 and big["gain"] == 1.0
    assert load.vllm_schedule(r) == (r["num_speculative_tokens"], r["schedule"])


def test_flat_surface_keeps_speculating_and_no_surface_serves_batch_one_everywhere():
    flat = {b: {1: 12.0, 2: 14.0, 4: 18.0} for b in (2, 64)}   # batching is free
    r = load.depth_schedule(DECAYING, node(flat), max_batch=32)
    assert all(k > 0 for _, _, k in r["schedule"])
    old = load.depth_schedule(DECAYING, node(), max_batch=32)
    assert not old["batch_surface"] and len(old["schedule"]) == 1
    assert old["schedule"][0] == [1, 32, cost.best_depth(DECAYING, node(), len(DECAYING))]
    assert any("batch 1 only" in w for w in old["warnings"])


def test_nothing_pays_gives_an_empty_vllm_schedule():
    r = load.depth_schedule([0.05] * 4, node(STEEP), max_batch=16)
    assert r["schedule"] == [[1, 16, 0]] and load.vllm_schedule(r) == (0, None)


def test_ranges_merge_runs():
    assert load.ranges([3, 3, 2, 2, 2, 0]) == [[1, 2, 3], [3, 5, 2], [6, 6, 0]]


def test_profile_yaml_round_trip_and_refusals(tmp_path):
    p = node(STEEP)
    path = str(tmp_path / "p.yaml")
    profiles.save_profile(p, path)
    assert profiles.load_profile(path) == p
    d = yaml.safe_load(open(path))
    for bad, msg in (({0: {1: 1.0}}, "integers >= 1"), ({1: {1: 1.0}}, "above 1"),
                     ({2: {}}, "non-empty"), ({2: {1: -1.0}}, "must be a number")):
        with pytest.raises(ValueError, match=msg):
            profiles.profile_from_dict({**d, "verify_batch_ms": bad}, "x.yaml")
    d.pop("verify_batch_ms")
    assert profiles.profile_from_dict(d).verify_batch_ms is None            # old profiles


def test_packaged_surfaces_are_the_roofline():
    for name, n in (("pcie-8x-rtx-pro-6000-kimi-k2.5", roofline.PCIE),
                    ("pcie-8x-rtx-pro-6000-kimi-k2.5-allreduce-curve", roofline.PCIE),
                    ("nvlink-8x-h100-kimi-k2.5", roofline.NVLINK)):
        p, t = profiles.load_profile(name), roofline.tables(n)
        assert p.verify_batch_ms == t["verify_batch_ms"]
        assert p.verify_ms == pytest.approx(t["verify_ms"], abs=0.011)   # written before it


def test_public_kimi_figures_direction():
    """Fitted to the concurrency-1 gain, the PCIe profile's gain must fall by batch 128."""
    chk = roofline.check_public_figures()
    one, big = chk["rows"]
    assert one["model_gain"] == pytest.approx(one["public_gain"])
    assert big["model_gain"] < one["model_gain"] - 0.15
    assert 0.8 < big["model_tok_s_depth0"] / big["public_tok_s_depth0"] < 1.25


def test_plan_prints_and_writes_the_schedule(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", "--acceptance", ",".join(map(str, DECAYING)), "--max-depth", "8",
                     "--max-batch", "64", "--profile", "pcie-8x-rtx-pro-6000-kimi-k2.5",
                     "--out", str(out)]) in (0, None)
    text = capsys.readouterr().out
    assert "num_speculative_tokens_per_batch_size" in text
    sched = json.load(open(out / "plan.json"))["depth_schedule"]
    assert sched["schedule"][0][0] == 1 and sched["schedule"][-1][1] == 64
    assert sched["schedule"][0][2] == json.load(open(out / "plan.json"))["best_depth"]


def test_plan_sweep_has_schedules(tmp_path, capsys):
    assert cli.main(["plan", "--sweep", "0.5", "0.9", "--max-depth", "8", "--max-batch", "32",
                     "--profile", "nvlink-8x-h100-kimi-k2.5", "--out", str(tmp_path)]) in (0, None)
    assert "schedule (batch: depth)" in capsys.readouterr().out
    rows = json.load(open(tmp_path / "sweep.json"))["schedules"]["rows"]
    assert [r["acceptance"] for r in rows] == [0.5, 0.9]


def cfg(**kw):
    d = dict(depth=3, depth_schedule=None)
    d.update(kw)
    return types.SimpleNamespace(**d)


def test_vllm_speculative_config_carries_the_schedule(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    export = str(tmp_path)                                  # a chain drafter's export
    spec = serve_vllm.speculative_config(cfg(depth=4, depth_schedule=[[1, 8, 4], [9, 256, 0]]),
                                         export)
    assert spec["num_speculative_tokens"] == 4 and spec["method"] == "eagle3"
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 256, 0]]
    assert "num_speculative_tokens_per_batch_size" not in serve_vllm.speculative_config(
        cfg(), export)
    assert serve_vllm.speculative_config(cfg(depth=0, depth_schedule=[[1, 9, 0]]), export) is None
    with pytest.raises(ValueError, match="largest"):
        serve_vllm.speculative_config(cfg(depth=2, depth_schedule=[[1, 9, 3]]), export)


def serve_args(tmp_path, *extra):
    return cli.parser().parse_args(["serve", "--drafter", str(tmp_path), "--verifier",
                                    str(tmp_path), "--depth", "auto", *extra])


def test_serve_depth_auto_resolves_a_schedule(tmp_path, monkeypatch):
    from eagle3_ray.plan import acceptance
    monkeypatch.setattr(acceptance, "acceptance_from",
                        lambda src, *a, **k: (DECAYING, len(DECAYING), "test"))
    monkeypatch.setattr(acceptance, "drafting_of", lambda src: "chain")
    depth, dynamic, schedule = cli.serve_depth(serve_args(
        tmp_path, "--engine", "vllm", "--max-depth", "8", "--profile",
        "pcie-8x-rtx-pro-6000-kimi-k2.5"))
    assert depth == max(k for _, _, k in schedule) > 0 and not dynamic
    assert schedule[0][0] == 1 and schedule[-1][1] == load.MAX_BATCH
    with pytest.raises(ValueError, match="--profile"):
        cli.serve_depth(serve_args(tmp_path, "--engine", "vllm"))
    assert cli.serve_depth(serve_args(tmp_path)) == (4, True, None)        # builtin: per round
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["serve", "--depth", "deep"])


def test_measure_verify_batch_on_the_tiny_verifier(tiny_verifier, one_thread):
    from eagle3_ray.engine import hf as verifier
    from eagle3_ray.serve import profile as measure
    model = verifier.load_verifier(tiny_verifier)
    s = measure.measure_verify_batch(model, (2, 4), (1, 3), context=16, reps=1, warmup=0)
    assert sorted(s) == [2, 4] and all(sorted(r) == [1, 3] and r[1] <= r[3] and r[1] > 0
                                       for r in s.values())
    with pytest.raises(ValueError, match=">= 2"):
        measure.measure_verify_batch(model, (1,), (1,))
    p = profiles.single_device_profile("t", {1: 1.0, 3: 2.0}, 0.5, model.config,
                                       verify_batch_ms=s)
    assert load.depth_schedule([0.9] * 3, p, max_batch=8)["batch_surface"]


def test_a_surface_with_its_own_batch_one_row_prices_batch_one_with_it():
    own = {1: {1: 30.0, 4: 36.0}, **STEEP}                  # the batched engine's batch 1
    p = node(own)
    assert load.verify_batch_compute_s(p, 1, 4) == pytest.approx(36e-3)
    assert load.verify_batch_compute_s(p, 2, 1) == pytest.approx(14e-3)    # its own row
    assert load.round_batch_s(p, 1, 0) == pytest.approx(30e-3)


# the serving engine's own rounds (profile --engine vllm): batch -> ms per depth, and without a
# drafter. Shaped as measured on 2 CPU cores: a round costs ~the same at batch 1 and 2, then
# grows with the batch and the depth; k = 0 pays the drafter's upkeep over plain decoding
PLAIN = {1: 40.0, 2: 42.0, 4: 50.0, 16: 100.0}
ROUNDS = {0: {1: 44.0, 2: 46.0, 4: 55.0, 16: 110.0},
          1: {1: 50.0, 2: 54.0, 4: 70.0, 16: 190.0},
          2: {1: 55.0, 2: 62.0, 4: 85.0, 16: 240.0}}


def test_engine_rounds_price_the_schedule_and_say_where_plain_wins(tmp_path):
    p = node(round_batch_ms=ROUNDS, plain_batch_ms=PLAIN, round_engine="vllm test")
    path = str(tmp_path / "p.yaml")
    profiles.save_profile(p, path)
    assert profiles.load_profile(path) == p
    assert load.round_batch_s(p, 3, 1) == pytest.approx(62e-3)          # between 2 and 4
    assert load.round_batch_s(p, 32, 2) == pytest.approx(0.24 + 16 * 155 / 12 * 1e-3)  # past 16
    assert load.engine_round_s(p, 8, None) == pytest.approx((50 + 4 * 50 / 12) * 1e-3)
    r = load.depth_schedule([0.7, 0.6], p, max_depth=4, max_batch=32)
    # E[tau] 1.7 at k 1, 2.12 at k 2. batch 1: k 2 2.12/55 ms = 38.5/s, k 1 34/s, plain 25/s;
    # batch 16: k 0 16/110 ms = 145/s beats k 1 (143/s), k 2 (141/s); but plain decoding,
    # without the drafter's upkeep, does 160/s there
    assert r["schedule"] == [[1, 9, 2], [10, 14, 1], [15, 32, 0]]
    assert r["num_speculative_tokens"] == 2 and r["round_engine"] == "vllm test"
    row1 = next(x for x in r["rows"] if x["batch"] == 1)
    assert row1["tokens_per_s_depth0"] == pytest.approx(1 / 0.040)      # plain: no drafter
    assert row1["gain"] == pytest.approx(2.12 / 0.055 / 25.0)
    assert any("without a drafter is faster" in w for w in r["warnings"])
    assert any("depths above 2" in w for w in r["warnings"])
    assert any("measured up to batch 16" in w for w in r["warnings"])


def test_engine_rounds_come_with_plain_and_the_same_batches():
    d = profiles.profile_to_dict(node(round_batch_ms=ROUNDS, plain_batch_ms=PLAIN))
    for bad, msg in (({"plain_batch_ms": None}, "come together"),
                     ({"round_batch_ms": {-1: PLAIN}}, "integers >= 0"),
                     ({"plain_batch_ms": {1: 40.0}}, "measure them together")):
        with pytest.raises(ValueError, match=msg):
            profiles.profile_from_dict({**d, **bad}, "x.yaml")
