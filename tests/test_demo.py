"""The main job, `eagle3-ray demo`, end to end on the embedded default at tiny sizes: real Ray
Data extraction, Ray Train, a Ray Serve replica and HTTP requests; the report it writes."""
import json

import pytest


@pytest.fixture
def serve_after(ray_cluster):
    """Serve's HTTP proxy keeps the first app's port for the whole cluster: shut Serve down
    after the demo so the next test's app can bind its own."""
    yield ray_cluster
    from ray import serve as ray_serve
    ray_serve.shutdown()


@pytest.mark.slow
def test_demo_runs_the_four_stages_and_reports(serve_after, tmp_path, capsys):
    from eagle3_ray.demo import DemoConfig, run_demo
    run_dir = tmp_path / "demo"
    cfg = DemoConfig(run_dir=str(run_dir), samples=8, max_length=96, ttt_steps=2,
                     train_steps=3, train_minutes=2, prompts=1, max_tokens=8)
    r = run_demo(cfg)
    assert r["depth"] == 2 and r["ttt_steps"] == 2 and r["train_steps"] == 3   # the step budget
    assert r["identical_outputs"]                       # greedy: every arm = depth 0
    for arm in ("depth_0", "depth_2", "depth_dynamic"):
        assert r[arm]["tokens"] > 0 and r[arm]["tokens_per_s"] > 0, arm
        assert 0 <= r[arm]["lookup_rounds"], arm         # the server's lookup fallback
    assert r["depth_0"]["lookup_rounds"] == 0 and r["depth_0"]["mean_depth"] == 0
    assert r["depth_2"]["mean_depth"] == 2 and r["depth_2"]["acceptance_length"] >= 1
    assert len(r["acceptance_by_position"]) == 2
    assert all(0 <= a <= 1 for a in r["acceptance_by_position"])
    assert json.load(open(run_dir / "report.json"))["speedup"] == r["speedup"]
    assert (run_dir / "report.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "[demo] rounds drafted by the lookup fallback: 0 0, 2 " in out
    assert "greedy outputs identical: True" in out
    import torch
    from eagle3_ray.engine import hf as verifier
    from eagle3_ray.serve import kernels                      # fp32: the kernels the replica timed
    fp32 = verifier.default_dtype("cpu") == torch.float32
    assert set(r["few_row_kernels"]) == ({str(n) for n in kernels.TUNED_ROWS} if fp32 else set())


def test_replica_kernels_read_back_from_metrics():
    from eagle3_ray.demo import replica_kernels
    from eagle3_ray.plan.planner import parse_metrics
    from eagle3_ray.serve.app import Metrics
    m = parse_metrics(Metrics({1: "linear", 2: "rows", 4: "onednn"}).render())
    assert replica_kernels(m) == {"1": "linear", "2": "rows", "4": "onednn"}
    assert replica_kernels(parse_metrics(Metrics().render())) == {}


def test_the_demo_sizes_itself_to_the_host():
    """plan_for_host on probe readings: the hosts the defaults were measured on (this AMD EPYC
    in bf16, and capped at AVX2 in fp32) keep 400 conversations and 12 prompts; one as slow as
    issue 48's real AVX2-only EPYC gets fewer, so that extraction fits its share of the minutes
    and training what is left; flags given, and --minutes 0, are not scaled."""
    from eagle3_ray import demo
    bf16 = {"dtype": "bfloat16", "forward_tokens_per_s": 930, "decode_tokens_per_s": 28.6}
    emulated = {"dtype": "float32", "forward_tokens_per_s": 510, "decode_tokens_per_s": 18.2}
    slow = {"dtype": "float32", "forward_tokens_per_s": 182, "decode_tokens_per_s": 7.0}
    for probe in (bf16, emulated):
        cfg, plan = demo.plan_for_host(demo.DemoConfig(), probe)
        assert (cfg.samples, cfg.prompts, plan["scaled"]) == (400, 12, [])
    cfg, plan = demo.plan_for_host(demo.DemoConfig(), slow)
    assert demo.MIN_SAMPLES <= cfg.samples < 400 and demo.MIN_PROMPTS <= cfg.prompts < 12
    assert plan["scaled"] == ["samples", "prompts"]
    budget = cfg.minutes * 60
    assert plan["expected_extract_s"] <= demo.EXTRACT_SHARE * budget
    assert plan["expected_serve_s"] - demo.SERVE_START_S <= demo.SERVE_SHARE * budget
    left = demo.train_budget_minutes(cfg, plan, elapsed_s=plan["expected_extract_s"])
    assert 2 <= left < cfg.train_minutes
    total = plan["expected_extract_s"] + 60 * left + demo.TRAIN_START_S + plan["expected_serve_s"]
    assert abs(total - budget) < 1                           # the three stages fill the minutes
    assert demo.train_budget_minutes(cfg, plan, elapsed_s=budget) == 2   # overrun: the floor
    given = demo.DemoConfig(samples=400, prompts=12)
    assert demo.plan_for_host(given, slow)[0] == given
    off = demo.plan_for_host(demo.DemoConfig(minutes=0), slow)[0]
    assert (off.samples, off.prompts) == (400, 12)
    assert demo.train_budget_minutes(off, plan, elapsed_s=0) == off.train_minutes
