"""bench engines' accounting, without vLLM: per-position acceptance and its standard errors,
the engine comparison and its 2-SE flag, the teacher-forced figures from meta.json, the JSON
summary and plot, the CLI flags; and the vLLM arms' settings (CPU, and one shared GPU, which is
absent here: only the arguments are built) and their parallel-drafting speculative_config."""
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


def test_vllm_arms_share_one_gpu_with_cuda_defaults(monkeypatch):
    """The arms' engine arguments and Ray options, built without a GPU or vLLM: on CUDA each of
    the 3 arms (depth 0 and two depths, alive together) asks a third of one GPU and a third of
    VLLM_GPU_SHARE of its memory, bf16, CUDA graphs; on the CPU the sizing is engine.vllm's."""
    import sys
    monkeypatch.setenv("EAGLE3_RAY_VLLM_PYTHON", sys.executable)   # the engine env, as named
    kw, opts = engines.vllm_setup(3, 1, "bfloat16", 1024, threads=2)
    assert (kw["dtype"], kw["enforce_eager"], kw["tensor_parallel_size"]) == ("bfloat16", False, 1)
    assert kw["gpu_memory_utilization"] == round(engines.VLLM_GPU_SHARE / 3, 3)
    assert "kv_cache_memory_bytes" not in kw and kw["max_model_len"] == 1024
    assert opts["num_gpus"] == pytest.approx(1 / 3) and opts["num_cpus"] == 0
    assert "OMP_NUM_THREADS" not in opts["runtime_env"]["env_vars"]
    kw, opts = engines.vllm_setup(3, 0, "float32", 1024, threads=2)
    assert "num_gpus" not in opts and "gpu_memory_utilization" not in kw
    assert kw["kv_cache_memory_bytes"] > 0 and kw["dtype"] == "float32"
    assert opts["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    assert engines.cuda_gpus(0) == 0 and engines.cuda_gpus(1) == 1
    with pytest.raises(ValueError, match="one GPU"):
        engines.cuda_gpus(2)


def test_arms_ask_vllm_for_parallel_drafting_of_a_parallel_export(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"parallel_drafting": True,
                                                      "mask_token_id": 7}))
    specs = engines.arm_specs(str(tmp_path), (0, 2, 4))
    assert specs[0] is None
    assert specs[4] == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 4,
                        "parallel_drafting": True}
