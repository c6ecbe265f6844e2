"""bench train: step time and memory of the TTT unroll per depth, for a chain, a parallel
(P-EAGLE) and a block (DFlash) drafter side by side, each configuration in a fresh process
(tiny shapes)."""
import json
import os

from eagle3_ray.bench import stages


def test_bench_train_sets_parallel_and_block_beside_chain(tmp_path):
    r = stages.bench_train(out_dir=str(tmp_path), ttt_steps=(1, 3), hidden=32, seq=48,
                           draft_vocab=64, heads=4, kv_heads=2, head_dim=8, intermediate=64,
                           vocab=128, steps=1, warmup=1, deep_fraction=1.0, parallel=True,
                           block=True)
    assert [x["ttt_steps"] for x in r["results"]] == [1, 3]
    assert [(x["ttt_steps"], x["drafting"]) for x in r["parallel_results"]] == [(3, "parallel")]
    assert r["parallel_deep_results"] == [] and r["parallel_deep_time_ratio_vs_chain"] == {}
    assert [(x["ttt_steps"], x["drafting"]) for x in r["block_results"]] == [(3, "block")]
    for key in ("parallel_time_ratio_vs_chain", "parallel_memory_ratio_vs_chain",
                "block_time_ratio_vs_chain", "block_memory_ratio_vs_chain"):
        assert set(r[key]) == {3} and r[key][3] > 0, key
    for x in r["results"] + r["parallel_results"] + r["block_results"]:
        assert x["step_s"] > 0 and x["valid_positions_step0"] > 0
    saved = json.load(open(os.path.join(tmp_path, "train.json")))
    assert saved["parallel_results"][0]["drafting"] == "parallel"
    assert os.path.getsize(os.path.join(tmp_path, "train.png")) > 0
