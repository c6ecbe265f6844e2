"""bench engines' accounting, without vLLM: per-position acceptance and its standard errors,
the engine comparison and its 2-SE flag, the teacher-forced figures from meta.json, the JSON
summary and plot, and the CLI flags."""
import argparse
import math

import pytest

from eagle3_ray.bench import engines


def test_positions_are_a_chain_with_binomial_errors():
    pos = engines.positions([10, 10, 10], [6, 3, 0], 3)
    assert [p["p"] for p in pos] == [0.6, 0.3, 0.0]
    assert [p["cond"] for p in pos] == [0.6, 0.5, 0.0]
    assert [p["cond_n"] for p in pos] == [10, 6, 3]
    assert pos[0]["p_se"] == pytest.approx(math.sqrt(0.6 * 0.4 / 10))
    assert pos[2]["p_se"] == 0.0
    assert engines.positions([0], [0], 1)[0]["p"] is None          # nothing drafted


def test_compare_flags_only_differences_beyond_two_standard_errors():
    a = engines.positions([400, 400], [200, 100], 2)
    near = engines.positions([400, 400], [210, 105], 2)            # within noise
    far = engines.positions([400, 400], [300, 100], 2)             # p0 0.50 vs 0.75
    assert not any(r["p_flag"] or r["cond_flag"] for r in engines.compare_positions(a, near))
    got = engines.compare_positions(a, far)
    assert got[0]["p_flag"] and got[0]["p_diff"] == pytest.approx(-0.25)
    assert got[1]["cond_flag"] and not got[1]["p_flag"]            # 0.50 vs 0.33 given 1 took


def _totals(outputs, depth, drafted_at, accepted_at, wall):
    s = engines._totals(max(1, depth))
    s.update(tokens=sum(map(len, outputs)), wall_s=wall, prefill_s=0.1 * len(outputs),
             outputs=outputs, drafted_at=drafted_at, accepted_at=accepted_at)
    s["rounds"] = drafted_at[0] if depth else sum(len(o) - 1 for o in outputs)
    s["drafted"] = s["rounds"] * depth
    s["accepted"] = sum(accepted_at[:depth])
    return s


def test_summary_compares_engines_and_depth0(tmp_path):
    """Rows per engine and depth (tau, speedup over that engine's depth 0, identical prompts),
    the engines side by side per depth, the teacher-forced figures; JSON, table and plot."""
    out0, out1 = [[1, 2, 3, 4], [5, 6, 7]], [[1, 2, 3, 4], [5, 6, 9]]
    runs = {"builtin": {0: _totals(out0, 0, [0, 0], [0, 0], 2.0),
                        2: _totals(out0, 2, [4, 4], [2, 1], 1.0)},
            "vllm": {0: _totals(out0, 0, [0, 0], [0, 0], 1.0),
                     2: _totals(out1, 2, [4, 4], [2, 1], 0.5)}}
    r = engines.summarize(runs, (0, 2), prompts=2)
    b2, v2 = r["runs"]["builtin"]["2"], r["runs"]["vllm"]["2"]
    assert b2["tokens_per_round"] == pytest.approx((3 + 4) / 4)
    assert b2["speedup"] == pytest.approx(2.0) and v2["speedup"] == pytest.approx(2.0)
    assert b2["identical_to_depth0"] == 2 and v2["identical_to_depth0"] == 1
    assert r["runs"]["builtin"]["0"]["tokens_per_round"] == 1.0
    c = r["compare"]["2"]
    assert c["identical_prompts"] == 1 and c["first_divergence"] == {"1": 2}
    assert c["flagged_positions"] == []
    meta = {"ttt_steps": 2, "final_metrics": {"eval/cond_acc_0": 0.5, "eval/p_0": 0.5,
                                              "eval/cond_acc_1": 0.4, "eval/p_1": 0.2,
                                              "eval/accept_len": 1.7}}
    tf = engines.teacher_forced(meta)
    assert tf["p"] == [0.5, 0.2] and tf["tau_by_depth"] == pytest.approx([1, 1.5, 1.7])
    result = {"drafter": "d", "drafter_ttt_steps": 2, "prompts": 2, "max_tokens": 4,
              "dtype": "float32", "host": ["avx2"], "depths": [2], "teacher_forced": tf, **r}
    engines.print_engines(result)
    engines.plot_engines(result, str(tmp_path / "engines.png"))
    assert (tmp_path / "engines.png").stat().st_size > 0


def test_cli_takes_bench_engines():
    from eagle3_ray.cli import add_bench_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    a = p.parse_args(["engines", "--drafter", "D", "--samples", "4", "--depths", "3",
                      "--dtype", "fp32"])
    assert (a.what, a.drafter, a.samples, a.depths, a.dtype) == ("engines", "D", 4, [3], "fp32")
