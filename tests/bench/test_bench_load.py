"""bench load for real but tiny: the builtin engine's app (the tiny random verifier, an untrained
drafter, depth 0 and 2 chosen per request) on the session Ray cluster, driven by vLLM's own
`vllm bench serve` from vLLM's environment at concurrency 1 and 2, 4 prompts of 8 tokens. The
vLLM engine's app is left out here: it takes ~2 min to start (tests/serve/test_served_vllm.py
serves it). Skipped with the reason where .venv-vllm (scripts/setup_vllm.sh) is absent: the
client lives there. ~40 s on 2 cores, most of it the app's start and the client's imports."""
import json
import os

import pytest

from eagle3_ray.bench import load
from conftest import free_port, missing_engine_env

QUESTIONS = ["Tell me about rivers.", "What is the capital of France?", "Count to five.",
             "Write a poem about the sea."]




def untrained_drafter(spec: str, out: str) -> str:
    from eagle3_ray.train import checkpoint, kinds
    drafter, _ = kinds.untrained_drafter(spec, draft_vocab_size=2000)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    checkpoint.save_drafter(out, state, drafter.config, {"ttt_steps": 2, "verifier": spec})
    return out


def test_bench_load_on_the_builtin_app(ray_cluster, tiny_verifier, tmp_path):
    why = missing_engine_env()
    if why:
        pytest.skip(why)
    drafter = untrained_drafter(tiny_verifier, str(tmp_path / "drafter"))
    out = tmp_path / "bench"
    r = load.bench_load(drafter_dir=drafter, depths=(2,), engines=("builtin",), concurrency=(2,),
                        max_tokens=8, port=free_port(), out_dir=str(out),
                        verifier=tiny_verifier, texts=QUESTIONS)
    saved = json.loads((out / "load.json").read_text())
    assert saved["bench"] == "load" and saved["concurrency"] == [1, 2]     # 1 added: alone
    assert saved["prompts"] == 4 and saved["host"] == r["host"] and "avx2" in saved["cpu"]
    assert set(saved["runs"]) == {"builtin"} and set(saved["runs"]["builtin"]) == {
        "depth0", "depth2"}
    for arm, depth in (("depth0", 0), ("depth2", 2)):
        a = saved["runs"]["builtin"][arm]
        assert a["depth"] == depth and len(a["outputs_alone"]) == 4
        assert [row["concurrency"] for row in a["levels"]] == [1, 2]
        for row in a["levels"]:
            assert row["errors"] == 0 and row["completed"] == 4, row["error_messages"]
            assert row["output_throughput"] > 0 and row["request_throughput"] > 0
            for m in ("ttft", "itl", "tpot"):
                assert 0 < row[f"p50_{m}_ms"] <= row[f"p99_{m}_ms"]
            assert row["mismatches_vs_alone"] == 0        # greedy: the same under load
    eq = saved["equality"]["builtin"]
    assert eq["mismatches_under_load"] == 0 and eq["requests_compared"] == 2 * 4
    assert eq["mismatches_vs_depth0_alone"] == {"depth2": 0}
    cmd = saved["commands"]["builtin-depth2-c2"]
    assert cmd.startswith("vllm bench serve --backend openai --base-url http://")
    assert "--max-concurrency 2" in cmd and "speculation_depth" in cmd
    assert os.path.getsize(out / "load.png") > 0
    assert (out / "load" / "builtin-depth0-c1.json").is_file()


def test_arms_and_equality_accounting():
    assert load.load_arms([3], None) == {"depth0": {"depth": 0}, "depth3": {"depth": 3}}
    assert list(load.load_arms([3, 0, 1], None)) == ["depth0", "depth1", "depth3"]
    sched = [[1, 2, 4], [3, 16, 0]]
    assert load.load_arms([3], sched)["schedule"] == {"depth": 4, "schedule": sched}
    # the schedule against the best fixed arm at each level (depth 0 counts as fixed)
    lv = lambda *tps: {"levels": [{"concurrency": c, "output_throughput": t}
                                  for c, t in zip((1, 8), tps)]}
    arms = {"depth0": lv(10.0, 80.0), "depth2": lv(14.0, 60.0), "schedule": lv(13.3, 72.0)}
    got = load.schedule_vs_best(arms)
    assert [(r["concurrency"], r["best"]) for r in got] == [(1, "depth2"), (8, "depth0")]
    assert [round(r["ratio"], 3) for r in got] == [0.95, 0.9]
    assert load.mismatches(["a", "b", "c"], ["a", "x", "c"]) == [1]
    assert load.mismatches(["a", "b"], ["a"]) == [1]                   # a failed request
    raw = {"completed": 3, "failed": 1, "num_prompts": 4, "output_throughput": 10.0,
           "p50_ttft_ms": 5.0, "p99_ttft_ms": 9.0, "errors": ["", "Traceback...\nBoom: 503"]}
    row = load.level_row(raw, 4)
    assert (row["errors"], row["p50_ttft_ms"], row["error_messages"]) == (1, 5.0, ["Boom: 503"])
    argv = load.client_argv("http://h:1", "/tok", "/d.jsonl", 4, 8, 2, "/r", "n",
                            {"speculation_depth": 0})
    assert argv[argv.index("--max-concurrency") + 1] == "2"
    assert argv[argv.index("--temperature") + 1] == "0"
    assert json.loads(argv[argv.index("--extra-body") + 1]) == {"speculation_depth": 0}
