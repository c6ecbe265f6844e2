"""scripts/gpu_check.sh: on a CUDA machine the GPU paths (checked here as the commands and
configs it would run), without CUDA the CPU path of the same steps, run for real."""
import json
import os
import subprocess
import sys

import pytest

from eagle3_ray import cli, gpu_check
from eagle3_ray.plan import planner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parsed(argv, monkeypatch):
    """What `eagle3-ray <argv>` would run: the parsed flags, nothing run."""
    got = {}
    monkeypatch.setattr(cli, "run_main", lambda fn, a: got.update(fn=fn, a=a) or 0)
    assert cli.main(argv) == 0
    return got["fn"], got["a"]


def test_the_cuda_path_runs_bf16_on_every_gpu(monkeypatch, tmp_path):
    """No GPU here: commands(cuda=True, 4 GPUs) are only built and parsed, nothing runs; the
    vLLM environment is taken as built (vllm_available mocked)."""
    monkeypatch.setattr(gpu_check, "vllm_available", lambda: True)
    steps = {n: (argv, needs) for n, argv, needs in gpu_check.commands(True, 4, str(tmp_path))}
    assert list(steps) == ["extract", "train_ddp", "train_fsdp", "bench_serve", "profile",
                           "extract_vllm", "bench_engines_vllm", "profile_vllm", "load_vllm",
                           "toy_deepseek", "extract_vllm_deepseek", "train_deepseek",
                           "bench_engines_deepseek"]
    fn, a = parsed(steps["profile_vllm"][0], monkeypatch)       # depth by load on vLLM
    assert fn is cli.cmd_profile and (a.engine, a.round_depths, a.batch_sizes, a.dtype) == (
        "vllm", [0, 1, 2, 3, 4], [1, 4, 16, 64], "bf16")
    fn, a = parsed(steps["load_vllm"][0], monkeypatch)
    assert (a.what, a.engines, a.schedule, a.profile, a.depth, a.concurrency) == (
        "load", ["vllm"], "auto", str(tmp_path / "profile-vllm.yaml"), [2, 4], [1, 4, 16, 64])
    assert a.gpus_per_replica == 1 and steps["load_vllm"][1] == "profile_vllm"
    e = cli.extract_config(parsed(steps["extract_vllm_deepseek"][0], monkeypatch)[1])
    assert (e.engine, e.verifier, steps["extract_vllm_deepseek"][1]) == (
        "vllm", str(tmp_path / "deepseek-verifier"), "toy_deepseek")
    t = cli.train_config(parsed(steps["train_deepseek"][0], monkeypatch)[1])   # a Llama layer
    assert (t.dataset, t.draft_layer, t.num_workers, t.use_gpu) == (
        str(tmp_path / "extract-vllm-deepseek"), "llama", 1, True)
    fn, a = parsed(steps["bench_engines_deepseek"][0], monkeypatch)
    assert a.drafter == str(tmp_path / "train-deepseek" / "drafter") and a.gpus == 1
    e = cli.extract_config(parsed(steps["extract_vllm"][0], monkeypatch)[1])
    assert (e.engine, e.replicas, e.gpus_per_replica, e.sample_limit) == ("vllm", 4, 1, 300)
    fn, a = parsed(steps["bench_engines_vllm"][0], monkeypatch)   # vLLM vs builtin, one GPU
    assert fn is cli.cmd_bench and a.what == "engines" and steps["bench_engines_vllm"][1] == \
        "train_ddp"
    assert (a.samples, a.max_tokens, a.depths, a.gpus) == (8, 64, [3, 8], 1)
    assert a.drafter == str(tmp_path / "train-ddp" / "drafter")
    assert a.out == str(tmp_path / "bench-engines-vllm")
    fn, a = parsed(steps["extract"][0], monkeypatch)
    e = cli.extract_config(a)
    assert fn is cli.cmd_extract and e.inputs == ["embedded:sharegpt"]
    assert e.verifier == "embedded:smollm2" and e.sample_limit == 300
    assert (e.dtype, e.replicas, e.gpus_per_replica) == ("bfloat16", 4, 1)
    for name, parallel in (("train_ddp", "ddp"), ("train_fsdp", "fsdp")):
        fn, a = parsed(steps[name][0], monkeypatch)
        t = cli.train_config(a)
        assert fn is cli.cmd_train and steps[name][1] == "extract"
        assert (t.use_gpu, t.num_workers, t.parallel, t.precision) == (True, 4, parallel, "bf16")
    fn, a = parsed(steps["bench_serve"][0], monkeypatch)
    assert fn is cli.cmd_bench and a.what == "serve" and a.gpus == 1
    assert a.depths == [0, 1, 2, 3, 4, 6, 8, 12, 16] and a.branches == [2, 3]
    assert a.lookup_depths == [4, 8]
    assert a.drafter == str(tmp_path / "train-ddp" / "drafter")
    fn, a = parsed(steps["profile"][0], monkeypatch)
    assert fn is cli.cmd_profile and a.drafter == str(tmp_path / "train-ddp" / "drafter")
    quick = {n: argv for n, argv, _ in gpu_check.commands(True, 4, str(tmp_path), quick=True)}
    assert cli.extract_config(parsed(quick["extract"], monkeypatch)[1]).sample_limit == 64
    sliced = cli.extract_config(parsed(quick["extract"] + ["--skip", "5500"], monkeypatch)[1])
    assert (sliced.sample_offset, sliced.sample_limit) == (5500, 64)
    assert cli.train_config(parsed(quick["train_ddp"], monkeypatch)[1]).max_steps == 10
    assert parsed(quick["bench_serve"], monkeypatch)[1].depths == [0, 2, 4, 8]
    assert parsed(quick["bench_serve"], monkeypatch)[1].lookup_depths == [4]
    a = parsed(quick["bench_engines_vllm"], monkeypatch)[1]
    assert (a.samples, a.max_tokens, a.depths, a.gpus) == (2, 32, [2, 4], 1)
    long = {n: argv for n, argv, _ in gpu_check.commands(True, 1, str(tmp_path),
                                                          quality_minutes=4)}
    t = cli.train_config(parsed(long["quality_train"], monkeypatch)[1])
    assert (t.max_minutes, t.ttt_steps, t.use_gpu, t.max_seq_len, t.batch_size) == (
        4.0, 8, True, 1024, 16)
    assert cli.extract_config(parsed(long["quality_extract"], monkeypatch)[1]).sample_limit == 3000
    assert parsed(long["quality_serve"], monkeypatch)[1].depths == [0, 2, 4, 8]
    cpu = gpu_check.commands(False, 0, str(tmp_path))
    assert cpu == gpu_check.commands(False, 0, str(tmp_path), quick=True)   # CUDA sizes only
    a = parsed(dict((n, argv) for n, argv, _ in cpu)["bench_engines_vllm"], monkeypatch)[1]
    assert (a.samples, a.max_tokens, a.depths, a.gpus) == (1, 6, [2], 0)   # CPU: tiny
    monkeypatch.setattr(gpu_check, "vllm_available", lambda: False)      # no .venv-vllm
    assert not {"extract_vllm", "bench_engines_vllm"} & {
        n for n, _, _ in gpu_check.commands(True, 4, str(tmp_path))}


def test_bench_engines_figures_per_engine_and_depth(tmp_path):
    """What the JSON keeps of bench engines' engines.json (the step runs on CUDA only)."""
    from eagle3_ray.bench import engines

    def totals(outputs, depth, accepted_at, wall):
        t = engines._totals(2)
        t.update(tokens=sum(map(len, outputs)), wall_s=wall, outputs=outputs,
                 rounds=4, drafted=4 * depth, accepted=sum(accepted_at[:depth]),
                 drafted_at=[4, 4] if depth else [0, 0], accepted_at=accepted_at)
        return t
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]]
    runs = {"builtin": {0: totals(same, 0, [0, 0], 2.0), 2: totals(same, 2, [3, 2], 1.0)},
            "vllm": {0: totals(same, 0, [0, 0], 1.0), 2: totals(other, 2, [2, 1], 0.5)}}
    out = tmp_path / "bench-engines-vllm"
    out.mkdir()
    (out / "engines.json").write_text(json.dumps(
        {"dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3", "prompts": 2, "max_tokens": 3,
         "vllm_startup_s": 40.0, **engines.summarize(runs, (0, 2), prompts=2)}))
    f = gpu_check.figures("bench_engines_vllm", str(tmp_path))
    assert f["builtin"]["tau"] == {"0": 1.0, "2": (5 + 4) / 4}
    assert f["vllm"]["tokens_per_s"] == {"0": 6.0, "2": 12.0}
    assert f["builtin"]["identical_to_depth0"] == {"0": 2, "2": 2}
    assert f["vllm"]["identical_to_depth0"] == {"0": 2, "2": 1}
    assert f["engines_identical"] == {"0": 2, "2": 1} and f["flagged_positions"]["2"] == []
    assert (f["device"], f["dtype"], f["prompts"]) == ("NVIDIA H100 80GB HBM3", "bfloat16", 2)


@pytest.mark.slow
def test_without_cuda_the_cpu_path_runs_and_exits_0(tmp_path):
    out, work = tmp_path / "gpu_check.json", tmp_path / "work"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--out", str(out),
                        "--work", str(work)], cwd=tmp_path, env=env,
                       capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no CUDA on this machine" in r.stdout and "all steps passed" in r.stdout
    g = json.load(open(out))
    assert g["mode"] == "cpu" and g["ok"] and not g["machine"]["cuda"]
    s = g["steps"]
    vllm = ({"extract_vllm", "bench_engines_vllm", "profile_vllm", "load_vllm",
             "toy_deepseek", "extract_vllm_deepseek",
             "train_deepseek", "bench_engines_deepseek"}
            if gpu_check.vllm_available()
            else set())                                          # .venv-vllm built
    assert set(s) == {"extract", "train_ddp", "train_fsdp", "bench_serve", "profile",
                      "allreduce_gloo", *vllm}
    assert all(x["ok"] for x in s.values())
    assert all(s[n]["command"].startswith("eagle3-ray ") for n in s if n != "allreduce_gloo")
    f = {n: x["figures"] for n, x in s.items() if "skipped" not in x}
    assert f["extract"]["samples"] > 0 and f["extract"]["dtype"] == "bfloat16"
    if vllm:                                  # listed, not run on CPU: said why
        for n in ("extract_vllm", "bench_engines_vllm", "profile_vllm", "load_vllm"):
            assert s[n]["skipped"].startswith("skipped on the CPU path") and n not in f
            assert f"{n}: skipped on the CPU path" in r.stdout
        assert s["bench_engines_vllm"]["command"].startswith("eagle3-ray bench engines --drafter ")
        assert "--engine vllm" in s["extract_vllm"]["command"]
    e = f["extract"]                          # the actors' batch time is inside the wall time
    assert 0 < e["actor_batch_s"] < e["wall_s"] and e["tokens_per_actor_s"] > e["tokens_per_s"]
    for n, parallel in (("train_ddp", "ddp"), ("train_fsdp", "fsdp")):
        assert f[n]["steps"] == 2 and f[n]["parallel"] == parallel and f[n]["num_workers"] == 2
        assert f[n]["last_loss"] > 0
    assert sorted(f["bench_serve"]["by_depth"]) == ["0", "1", "2", "lookup2", "tree2x2"]
    assert f["bench_serve"]["all_identical"]                 # greedy: every depth = depth 0
    assert f["bench_serve"]["best_tree"] == "tree2x2"
    assert f["bench_serve"]["best_lookup"] == "lookup2"
    assert sorted(f["profile"]["verify_ms"]) == ["1", "2", "3"] and f["profile"]["gpus"] == 1
    assert len(f["allreduce_gloo"]["allreduce_us"]) == len(planner.CURVE_TOKENS)
    assert (work / "train-fsdp" / "drafter" / "model.safetensors").is_file()
    # the quality steps (--quality-minutes) are extract / train / bench serve again at other
    # sizes (their commands: test_the_cuda_path_runs_bf16_on_every_gpu); what they report of
    # their served run is served_figures, here on this run's bench serve
    q = gpu_check.served_figures(str(work / "bench" / "serve.json"))   # its deepest depth, 2
    assert q["depth"] == 2 and q["rounds"] > 0 and q["all_identical"]
    assert len(q["served_acc"]) == 2 and all(0 <= a <= 1 for a in q["served_acc"])
    assert sorted(q["speedup_by_depth"]) == ["0", "1", "2", "lookup2", "tree2x2"]
    assert q["acceptance_length"] >= 1
