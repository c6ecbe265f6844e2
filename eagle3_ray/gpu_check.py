"""The check anyone with a GPU runs first: the package's GPU paths in a few minutes, one JSON.

    scripts/gpu_check.sh                                   # = python -m eagle3_ray.gpu_check
    python -m eagle3_ray.gpu_check --out /tmp/gc.json --work /tmp/gc   # no CUDA: the CPU path
    scripts/gpu_check.sh --quick               # CUDA: the same steps at QUICK sizes (~2.5 min)

With CUDA and the n GPUs present, each step is the `eagle3-ray` command a user would type
(printed, then run in this process, so the Ray-backed steps share one local Ray):
  1. extract      bf16 hidden states of 300 embedded ShareGPT conversations with the embedded
                  verifier (SmolLM2-135M), n replicas of one GPU each
  2. train        a short bf16 run (ttt_steps 4) over n GPU workers with DDP, then with FSDP
  3. bench serve  the DDP drafter, greedy, at depths 0-16 on one GPU: tokens/s, acceptance
                  length, outputs identical to depth 0's, the planner's prediction; and 2 or 3
                  chains verified as one tree at depths 2-4 (serve --branches)
  4. profile      verify/draft times of this machine; with n > 1 the NCCL all-reduce curve
  5. quality      (--quality-minutes M) 3,000 conversations extracted, the default ttt-8 recipe
                  trained for M minutes, served on 20 held-out prompts: served acceptance
  6. vLLM         where scripts/setup_vllm.sh built the engine environment (.venv-vllm; the
                  CUDA build where nvidia-smi works): step 1 again with `--engine vllm`
                  (extract_vllm: tokens/s beside step 1's), and the DDP drafter served by
                  vLLM and by the builtin decoder, both on one GPU, at depths 0, 3 and 8
                  (--quick: 0, 2, 4) on step 3's prompts (bench_engines_vllm: `bench
                  engines`; per engine tau, tokens/s and outputs identical to depth 0 per
                  depth, and the prompts the two engines decode alike); then depth by load:
                  `profile --engine vllm` times vLLM's rounds over batch x depth
                  (profile_vllm), and `bench load` serves depth 0, fixed depths and the
                  schedule `--depth auto` plans from it (load_vllm: the schedule against the
                  best fixed depth at each concurrency, under vllm bench serve)
  7. Kimi's shape (with vLLM): `eagle3-ray toy deepseek` writes a small DeepSeek-V3-shaped
                  verifier (MLA + MoE), step 1 extracts with it through vLLM, a Llama-layer
                  drafter trains on it (the shape vLLM's CPU build cannot serve on an MLA
                  target: the suite serves the MLA layer there) and `bench engines` serves it
                  in both engines (bench_engines_deepseek)
Without CUDA it says so, runs the same steps at tiny sizes on the CPU (2 gloo workers,
depths 0-2; the vLLM steps are printed, not run: CPU_SKIPPED) plus the all-reduce curve with
gloo between 2 processes (the code path of the NCCL one), and exits 0 when they pass (1 when a
step fails). Writes --out (runs/gpu_check.json): the machine, and per step its command,
status, wall time and figures; the step outputs stay under --work (runs/gpu_check/).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

# Step sizes: (CUDA, CPU). The CPU path checks that the same commands run, not their speed.
SIZES = {
    "samples": (300, 8), "max_length": (512, 96), "ttt_steps": (4, 2), "max_steps": (40, 2),
    "depths": ((0, 1, 2, 3, 4, 6, 8, 12, 16), (0, 1, 2)), "prompts": (8, 1),
    "max_tokens": (64, 6), "profile_tokens": (17, 3), "profile_reps": (5, 1),
    "branches": ((2, 3), (2,)), "lookup_depths": ((4, 8), (2,)),
    "engine_depths": ((3, 8), (2,)),
    "round_depths": ((0, 1, 2, 3, 4), (0, 1)), "load_batches": ((1, 4, 16, 64), (1, 2)),
    "load_depths": ((2, 4), (1,)), "load_prompts": (64, 4),
}
# Steps the CPU path lists but does not run: why (printed, and in the JSON as "skipped").
CPU_SKIPPED = {"bench_engines_vllm": (
    "skipped on the CPU path: 48 s for 1 prompt x 6 tokens on 2 cores (2026-12-07), 27 s of it "
    "starting vLLM's CPU engines; run the command above to check it here"),
    "extract_vllm": (
    "skipped on the CPU path: the suite extracts through vLLM's CPU build and compares it with "
    "the HF engine (tests/extract/test_extract_vllm.py); run the command above to check it here"),
    **{n: "skipped on the CPU path: the suite runs the DeepSeek-shaped verifier through vLLM's "
          "CPU build (tests/extract/test_extract_vllm.py); run the command above to check it here"
       for n in ("toy_deepseek", "extract_vllm_deepseek", "train_deepseek",
                 "bench_engines_deepseek")},
    **{n: "skipped on the CPU path: the suite times vLLM's CPU rounds "
          "(tests/serve/test_profile_vllm.py) and serves a planned schedule "
          "(tests/serve/test_served_vllm.py); run the command above to check it here"
       for n in ("profile_vllm", "load_vllm")}}
# --quality-minutes M: a drafter trained for M minutes at the recipe's depth, then served on
# held-out prompts (what acceptance more training buys). (CUDA, CPU) sizes as above.
QUALITY = {"samples": (3000, 8), "max_length": (1024, 96), "ttt_steps": (8, 2),
           "depths": ((0, 2, 4, 8), (0, 2)), "prompts": (20, 1), "max_tokens": (64, 6),
           "lookup_depths": ((4, 8), (2,))}
# --quick: the CUDA sizes for a few minutes of GPU time (2026-12-04 on one H200: 147 s in all,
# of which Ray and model start-up is most).
QUICK = {"samples": 64, "max_length": 256, "max_steps": 10, "depths": (0, 2, 4, 8), "prompts": 2,
         "max_tokens": 32, "profile_tokens": 9, "profile_reps": 2, "branches": (2,),
         "lookup_depths": (4,), "engine_depths": (2, 4), "round_depths": (0, 2, 4),
         "load_batches": (1, 8, 32), "load_depths": (2, 4), "load_prompts": 32}


def step_dir(work: str, name: str) -> str:
    """Where a step writes: hs/ (extract), bench/ (bench_serve), else its name with dashes."""
    return os.path.join(work, {"extract": "hs", "bench_serve": "bench"}.get(
        name, name.replace("_", "-")))


def _extract(cuda: bool, gpus: int, out: str, samples: int, max_length: int) -> list[str]:
    """`eagle3-ray extract` of the embedded default: bf16 on every GPU, or the CPU's rows."""
    argv = ["extract", "--inputs", "embedded:sharegpt", "--output", out, "--limit", str(samples),
            "--max-length", str(max_length)]
    return argv + (["--dtype", "bfloat16", "--replicas", str(gpus), "--gpus-per-replica", "1"]
                   if cuda else ["--batch-rows", "8"])


def commands(cuda: bool, gpus: int, work: str, quick: bool = False,
             quality_minutes: float = 0.0) -> list[tuple[str, list[str], str | None]]:
    """(step name, eagle3-ray argv, the step it needs) for this machine."""
    def size(key):
        if cuda and quick and key in QUICK:
            return QUICK[key]
        return SIZES[key][0 if cuda else 1]

    hs, drafter = step_dir(work, "extract"), os.path.join(step_dir(work, "train_ddp"), "drafter")
    extract = _extract(cuda, gpus, hs, size("samples"), size("max_length"))
    train = ["train", "--dataset", hs, "--ttt-steps", str(size("ttt_steps")),
             "--max-steps", str(size("max_steps")), "--warmup-steps", "2", "--log-every", "1",
             "--eval-every", "0", "--checkpoint-every", str(size("max_steps")),
             "--max-seq-len", str(size("max_length"))]
    train += (["--use-gpu", "--num-workers", str(gpus), "--precision", "bf16"] if cuda
              else ["--num-workers", "2", "--cpus-per-worker", "0.5", "--draft-vocab-size",
                    "4096", "--eval-fraction", "0.25"])
    bench = ["bench", "serve", "--drafter", drafter, "--samples", str(size("prompts")),
             "--max-tokens", str(size("max_tokens")), "--no-peers",
             "--depths", *map(str, size("depths")), "--out", step_dir(work, "bench_serve"),
             "--branches", *map(str, size("branches")),
             "--lookup-depths", *map(str, size("lookup_depths"))]
    bench += ["--gpus", "1"] if cuda else ["--no-dynamic"]
    profile = ["profile", "--drafter", drafter, "--out", os.path.join(work, "profile.yaml"),
               "--max-tokens", str(size("profile_tokens")), "--reps", str(size("profile_reps"))]
    profile += [] if cuda else ["--context", "32"]
    steps = [("extract", extract, None),
             ("train_ddp", train + ["--output", step_dir(work, "train_ddp"),
                                    "--parallel", "ddp"], "extract"),
             ("train_fsdp", train + ["--output", step_dir(work, "train_fsdp"),
                                     "--parallel", "fsdp"], "extract"),
             ("bench_serve", bench, "train_ddp"),
             ("profile", profile, "train_ddp")]
    if vllm_available():
        steps.append(("extract_vllm", _extract(cuda, gpus, step_dir(work, "extract_vllm"),
                                               size("samples"), size("max_length"))
                      + ["--engine", "vllm"], None))
        steps.append(("bench_engines_vllm", _bench_engines(cuda, drafter, work, size),
                      "train_ddp"))
        steps += _load_steps(cuda, drafter, work, size)
        # Kimi-K2.5's shape in small (MLA + MoE, engine/toy.py) through vLLM's DeepSeek paths
        toy = os.path.join(work, "deepseek-verifier")
        steps.append(("toy_deepseek", ["toy", "deepseek", toy], None))
        steps.append(("extract_vllm_deepseek",
                      _extract(cuda, min(gpus, 1), step_dir(work, "extract_vllm_deepseek"),
                               size("samples"), size("max_length"))
                      + ["--engine", "vllm", "--verifier", toy], "toy_deepseek"))
        ds_train = step_dir(work, "train_deepseek")
        steps.append(("train_deepseek", [
            "train", "--dataset", step_dir(work, "extract_vllm_deepseek"), "--output", ds_train,
            "--ttt-steps", str(size("ttt_steps")), "--max-steps", str(size("max_steps")),
            "--warmup-steps", "2", "--eval-every", "0", "--draft-vocab-size", "4096",
            "--checkpoint-every", str(size("max_steps")), "--num-workers", "1"]
            + (["--use-gpu"] if cuda else ["--cpus-per-worker", "0.5"]), "extract_vllm_deepseek"))
        steps.append(("bench_engines_deepseek",
                      _bench_engines(cuda, os.path.join(ds_train, "drafter"), work, size,
                                     "bench_engines_deepseek"), "train_deepseek"))
    return steps + (quality_commands(cuda, gpus, work, quality_minutes) if quality_minutes else [])


def _bench_engines(cuda: bool, drafter: str, work: str, size,
                   name: str = "bench_engines_vllm") -> list[str]:
    """`eagle3-ray bench engines`: the drafter served by vLLM and by the builtin decoder, on one
    GPU with CUDA (bench engines picks it where torch sees CUDA; --gpus 1 says so)."""
    argv = ["bench", "engines", "--drafter", drafter, "--samples", str(size("prompts")),
            "--max-tokens", str(size("max_tokens")), "--depths", *map(str, size("engine_depths")),
            "--out", step_dir(work, name)]
    return argv + (["--gpus", "1"] if cuda else [])


def _load_steps(cuda: bool, drafter: str, work: str, size) -> list:
    """Depth by load on vLLM: `profile --engine vllm` times vLLM's rounds over batch x depth,
    then `bench load` serves depth 0, fixed depths and the schedule `--depth auto` plans from
    that profile, under vllm bench serve (load_vllm: the schedule against the best fixed depth
    at each concurrency)."""
    prof = os.path.join(work, "profile-vllm.yaml")
    batches = [str(b) for b in size("load_batches")]
    profile = ["profile", "--engine", "vllm", "--drafter", drafter, "--out", prof,
               "--round-depths", *map(str, size("round_depths")), "--batch-sizes", *batches,
               "--max-tokens", str(size("profile_tokens")), "--reps", str(size("profile_reps"))]
    load = ["bench", "load", "--engines", "vllm", "--drafter", drafter,
            "--depth", *map(str, size("load_depths")), "--schedule", "auto", "--profile", prof,
            "--concurrency", *batches, "--prompts", str(size("load_prompts")),
            "--max-tokens", str(size("max_tokens")), "--out", step_dir(work, "load_vllm")]
    return [("profile_vllm", profile + (["--dtype", "bf16"] if cuda else []), "train_ddp"),
            ("load_vllm", load + (["--gpus-per-replica", "1", "--dtype", "bf16"] if cuda
                                  else []), "profile_vllm")]


def vllm_available() -> bool:
    """Whether the vLLM engine environment exists (scripts/setup_vllm.sh)."""
    from eagle3_ray.engine import vllm as vllm_engine
    try:
        vllm_engine.engine_python()
        return True
    except (RuntimeError, FileNotFoundError):
        return False


def quality_commands(cuda: bool, gpus: int, work: str, minutes: float) -> list:
    """Extract the first 3,000 embedded conversations, train the default recipe (ttt 8; batch
    16 on GPUs) for `minutes`, serve it on 20 held-out prompts: served acceptance per
    position."""
    def size(key):
        return QUALITY[key][0 if cuda else 1]

    hs, run = step_dir(work, "quality_extract"), step_dir(work, "quality_train")
    extract = _extract(cuda, gpus, hs, size("samples"), size("max_length"))
    train = ["train", "--dataset", hs, "--output", run, "--ttt-steps", str(size("ttt_steps")),
             "--max-minutes", str(minutes), "--max-steps", str(10**7),
             "--max-seq-len", str(size("max_length"))]
    # CUDA: batch 16 (the CPU recipe's 4 leaves a GPU step launch-bound, 81 ms on an H200)
    train += (["--use-gpu", "--num-workers", str(gpus), "--precision", "bf16", "--batch-size",
               "16"] if cuda
              else ["--num-workers", "1", "--draft-vocab-size", "4096", "--eval-fraction", "0.25"])
    serve = ["bench", "serve", "--drafter", os.path.join(run, "drafter"), "--no-peers",
             "--samples", str(size("prompts")), "--max-tokens", str(size("max_tokens")),
             "--depths", *map(str, size("depths")), "--out", step_dir(work, "quality_serve"),
             "--lookup-depths", *map(str, size("lookup_depths")), "--no-dynamic"]
    serve += ["--gpus", "1"] if cuda else []
    return [("quality_extract", extract, None), ("quality_train", train, "quality_extract"),
            ("quality_serve", serve, "quality_train")]


def machine() -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {"host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda,
            "gpus": torch.cuda.device_count() if cuda else 0,
            "gpu_names": [torch.cuda.get_device_name(i)
                          for i in range(torch.cuda.device_count())] if cuda else [],
            "cpus": os.cpu_count()}


def figures(name: str, work: str) -> dict:
    """What a step's outputs say, for the JSON."""
    out = step_dir(work, name)
    if name == "toy_deepseek":
        return {}
    if name in ("extract", "quality_extract", "extract_vllm", "extract_vllm_deepseek"):
        m = json.load(open(os.path.join(out, "manifest.json")))
        s, run = m["summary"], m["summary"]["this_run"]
        # wall_s includes Ray's and the actors' start-up (most of a short run's time, 2026-12-04
        # on an H200); actor_batch_s: the time inside the actors' batches, summed over actors
        return {"samples": s["samples"], "tokens": s["tokens"], "dtype": m["facts"]["dtype"],
                "wall_s": run.get("wall_s"), "tokens_per_s": run.get("tokens_per_s"),
                "actor_init_s": run.get("actor_init_s"), "actor_batch_s": run.get("actor_batch_s"),
                "tokens_per_actor_s": run["tokens"] / max(run.get("actor_batch_s") or 0, 1e-9),
                "skipped": s["skipped"]}
    if name == "quality_serve":
        return served_figures(os.path.join(out, "serve.json"))
    if name in ("bench_engines_vllm", "bench_engines_deepseek"):
        return engines_figures(os.path.join(out, "engines.json"))
    if name in ("train_ddp", "train_fsdp", "quality_train", "train_deepseek"):
        hist = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
        last, meta = hist[-1], json.load(open(os.path.join(out, "drafter", "meta.json")))
        tc = meta.get("train_config", {})
        return {"steps": last["step"], "train_s": last.get("train_s"),
                "first_loss": hist[0].get("train/loss"), "last_loss": last.get("train/loss"),
                "tokens_per_s": last.get("tokens_per_s"),
                "eval_accept_len": last.get("eval/accept_len"),
                **{k: tc.get(k) for k in ("parallel", "precision", "num_workers", "use_gpu")}}
    if name == "bench_serve":
        r = json.load(open(os.path.join(out, "serve.json")))
        return {"dtype": r["dtype"], "all_identical": r["all_identical"],
                "best_depth": r["best_depth"], "best_speedup": r["best_speedup"],
                "planner_chosen_depth": r["planner"]["chosen_depth"],
                "best_tree": r.get("best_tree"), "best_tree_speedup": r.get("best_tree_speedup"),
                "best_lookup": r.get("best_lookup"),
                "best_lookup_speedup": r.get("best_lookup_speedup"),
                "by_depth": {d: {k: x[k] for k in ("tokens_per_s", "decode_tokens_per_s",
                                                   "acceptance_length", "identical_to_depth0")}
                             for d, x in r["runs"].items()}}
    if name == "profile_vllm":
        from eagle3_ray.plan import profiles
        p = profiles.load_profile(os.path.join(work, "profile-vllm.yaml"))
        return {"engine": p.round_engine, "plain_batch_ms": p.plain_batch_ms,
                "round_batch_ms": p.round_batch_ms}
    if name == "load_vllm":
        r = json.load(open(os.path.join(out, "load.json")))
        return {"schedule": r["schedule"], "schedule_vs_best": r.get("schedule_vs_best"),
                "errors": sum(x["errors"] for a in r["runs"].get("vllm", {}).values()
                              for x in a["levels"]), "equality": r.get("equality")}
    if name == "profile":
        from eagle3_ray.plan import planner
        p = planner.load_profile(os.path.join(work, "profile.yaml"))
        return {"gpus": p.gpus, "verify_ms": p.verify_ms, "draft_step_ms": p.draft_step_ms,
                "allreduce": planner.allreduce_model(p),
                "allreduce_us": p.interconnect.allreduce_us}
    return {}


def served_figures(path: str) -> dict:
    """bench serve's run at its deepest depth: served acceptance per position, conditional
    acceptance (a_k), acceptance length; tokens/s against depth 0 at every depth."""
    from eagle3_ray.plan import planner
    r = json.load(open(path))
    deep = r["runs"][str(max(int(d) for d in r["runs"] if d.isdigit()))]
    drafted, accepted = deep["drafted_per_position"], deep["accepted_per_position"]
    return {"depth": deep["depth"], "prompts": r["prompts"], "rounds": deep["rounds"],
            "served_acc": [round(a / max(1, d), 4) for a, d in zip(accepted, drafted)],
            "served_cond_acc": [round(c, 4) for c in planner.cond_from_counts(drafted, accepted)],
            "acceptance_length": deep["acceptance_length"],
            "speedup_by_depth": {d: x["speedup"] for d, x in r["runs"].items()},
            "all_identical": r["all_identical"]}


def engines_figures(path: str) -> dict:
    """bench engines' figures per engine: tau (tokens per verify round), tokens/s and outputs
    identical to its depth 0 (prompts), by depth; per depth, the prompts both engines decoded
    alike and the positions whose acceptance differs by > 2 SE."""
    r = json.load(open(path))
    keys = {"tau": "tokens_per_round", "tokens_per_s": "tokens_per_s",
            "identical_to_depth0": "identical_to_depth0"}
    return {"dtype": r["dtype"], "device": r.get("device"), "prompts": r["prompts"],
            "max_tokens": r["max_tokens"], "vllm_startup_s": r["vllm_startup_s"],
            **{e: {k: {d: x[key] for d, x in rows.items()} for k, key in keys.items()}
               for e, rows in r["runs"].items()},
            "engines_identical": {d: c["identical_prompts"] for d, c in r["compare"].items()},
            "flagged_positions": {d: c["flagged_positions"] for d, c in r["compare"].items()}}


def gloo_allreduce_curve() -> dict:
    """The NCCL curve's code path with gloo between 2 CPU processes (no CUDA here)."""
    from eagle3_ray.plan import planner
    base = planner.NodeProfile(
        name="cpu", description="", sources=[], gpus=1,
        interconnect=planner.Interconnect(0.0, 1.0, 0, 576, 2), verify_ms={1: 1.0},
        draft_step_ms=1.0)
    p = planner.add_allreduce_curve(base, procs=2, allreduces_per_forward=62, backend="gloo",
                                    iters=20)
    return {"backend": "gloo, 2 CPU processes", "allreduce_us": p.interconnect.allreduce_us,
            "alpha_us": p.interconnect.latency_us, "bandwidth_gbps": p.interconnect.bandwidth_gbps}


def run_check(out: str = "runs/gpu_check.json", work: str = "runs/gpu_check",
              quick: bool = False, quality_minutes: float = 0.0) -> int:
    """Run the steps (CUDA or the CPU path), write `out`; 0 if every step passed."""
    import shutil
    from eagle3_ray import cli
    info = machine()
    cuda, gpus = info["cuda"], info["gpus"]
    if cuda:
        print(f"[gpu_check] CUDA: {gpus} x {info['gpu_names'][0]}", flush=True)
    else:
        why = ("this torch is a CPU build" if info["cuda_version"] is None
               else "torch sees no GPU")
        print(f"[gpu_check] no CUDA on this machine ({why}, torch {info['torch']}): running the "
              "CPU path of the same steps at tiny sizes (the figures say nothing about GPU "
              "speed)", flush=True)
    work = os.path.abspath(work)
    shutil.rmtree(work, ignore_errors=True)          # a fresh run: no resumed extraction/training
    os.makedirs(work)
    result = {"check": "gpu_check", "mode": "cuda" if cuda else "cpu", "quick": quick and cuda,
              "machine": info, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "steps": {}}
    t_all = time.perf_counter()
    for name, argv, needs in commands(cuda, gpus, work, quick, quality_minutes):
        step = result["steps"][name] = {"command": "eagle3-ray " + " ".join(argv)}
        if needs and not result["steps"][needs]["ok"]:
            step.update(ok=False, skipped=f"{needs} failed")
            continue
        print(f"[gpu_check] {name}: {step['command']}", flush=True)
        if not cuda and name in CPU_SKIPPED:
            step.update(ok=True, skipped=CPU_SKIPPED[name])
            print(f"[gpu_check] {name}: {CPU_SKIPPED[name]}", flush=True)
            continue
        t0 = time.perf_counter()
        rc = cli.main(argv)
        step.update(ok=rc == 0, rc=rc, wall_s=round(time.perf_counter() - t0, 2))
        if rc == 0:
            step["figures"] = figures(name, work)
        print(f"[gpu_check] {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in "
              f"{step['wall_s']:.0f} s", flush=True)
    if not cuda:
        t0 = time.perf_counter()
        try:
            step = {"ok": True, "figures": gloo_allreduce_curve()}
        except Exception as e:                        # noqa: BLE001  (recorded, not raised)
            step = {"ok": False, "error": repr(e)}
        step["wall_s"] = round(time.perf_counter() - t0, 2)
        result["steps"]["allreduce_gloo"] = step
    result["wall_s"] = round(time.perf_counter() - t_all, 2)
    result["ok"] = all(s["ok"] for s in result["steps"].values())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    failed = [n for n, s in result["steps"].items() if not s["ok"]]
    print(f"[gpu_check] {'all steps passed' if not failed else f'FAILED: {failed}'} in "
          f"{result['wall_s']:.0f} s ({result['mode']} path) -> {out}", flush=True)
    return 0 if not failed else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu_check.json", help="the JSON to write")
    p.add_argument("--work", default="runs/gpu_check", help="step outputs (emptied first)")
    p.add_argument("--quick", action="store_true",
                   help="smaller CUDA sizes (QUICK): the same steps in a few minutes")
    p.add_argument("--quality-minutes", type=float, default=0.0, metavar="M",
                   help="then train the default ttt-8 recipe on 3,000 conversations for M "
                        "minutes and measure its served acceptance (QUALITY)")
    a = p.parse_args(argv)
    return run_check(a.out, a.work, a.quick, a.quality_minutes)


if __name__ == "__main__":
    sys.exit(main())
