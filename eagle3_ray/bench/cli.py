"""`eagle3-ray bench <name>`: one subcommand per benchmark, each with only its own flags (the
shared ones, --out and, where Ray runs, --address, come from `_common`). Each writes
<out>/<name>.json + .png. jobs/bench.py takes the same arguments.

    eagle3-ray bench extract --samples 32 --max-length 256 --repeats 1
    eagle3-ray bench regen --samples 8 --max-new-tokens 32 --batch 8 --out /tmp/bench
    eagle3-ray bench load --drafter DIR --depth 3 --engines builtin --concurrency 1 2 \\
        --prompts 4 --max-tokens 16 --out /tmp/bench                       # ~2 min on 2 cores
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from eagle3_ray.launch import init_ray


def _common(p: argparse.ArgumentParser, ray: bool = False) -> None:
    """The flags every bench takes: --out; --address where it starts or joins a Ray cluster."""
    p.add_argument("--out", default="runs/bench", help="directory of <bench>.json + .png")
    if ray:
        p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")


def _samples(p: argparse.ArgumentParser, default: int, what: str) -> None:
    p.add_argument("--samples", type=int, default=default, help=f"{what} (default {default})")


def _served(p: argparse.ArgumentParser) -> None:
    """Held-out decoding of each trained drafter (quality, recipe, sweep, online)."""
    p.add_argument("--served-prompts", type=int, default=16,
                   help="held-out prompts decoded per drafter")
    p.add_argument("--served-tokens", type=int, default=96, help="tokens decoded per prompt")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The `bench` subcommands and their flags (shared with jobs/bench.py): `a.what` names the
    bench, `a.bench_run` runs it."""
    sub = p.add_subparsers(dest="what", required=True, metavar="BENCH")

    b = sub.add_parser("extract", help="the Ray Data extraction pipeline against a plain "
                                       "forward loop (--engines: vLLM against transformers)")
    _samples(b, 128, "conversations")
    b.add_argument("--max-length", type=int, default=512)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--engines", action="store_true", help="the pipeline with the verifier in "
                   "vLLM against transformers, tokens/s side by side")
    b.add_argument("--dtype", choices=["bf16", "fp32"], help="--engines: both engines' dtype "
                   "(default: bf16 where the CPU has native bf16, else fp32)")
    _common(b, ray=True)
    b.set_defaults(bench_run=_run_extract)

    b = sub.add_parser("train", help="step time and memory of the TTT unroll per depth")
    b.add_argument("--with-parallel", action="store_true", help="also time a parallel "
                   "(P-EAGLE) drafter at each ttt_steps >= 2, beside the chain")
    b.add_argument("--with-block", action="store_true", help="also time a block (DFlash, "
                   "2 layers) drafter whose block holds ttt_steps drafts, beside the chain")
    _common(b)
    b.set_defaults(bench_run=_run_train)

    for name, text in (("quality", "drafters of several ttt_steps compared by served acceptance"),
                       ("recipe", "training recipes of one ttt_steps compared the same way")):
        b = sub.add_parser(name, help=text)
        _samples(b, 1200, "conversations")
        b.add_argument("--regen-samples", type=int, help="conversations of the regenerated "
                       "dataset (default --samples; regeneration costs ~30x a plain extraction "
                       "on CPU)")
        b.add_argument("--max-length", type=int, default=512)
        b.add_argument("--minutes", type=float, default=10.0, help="training minutes per drafter")
        b.add_argument("--steps", type=int, default=0,
                       help="optimizer steps per drafter instead of --minutes")
        b.add_argument("--fresh", action="store_true", help="retrain every drafter")
        b.add_argument("--ttt", type=int, nargs="+", default=[1, 4, 8],
                       help="ttt_steps of each drafter (recipe: the first)")
        b.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                       help="TrainConfig fields for every drafter, e.g. lr=1e-3 init=random "
                            "data=regen (data: orig|regen)")
        _served(b)
        _common(b, ray=True)
        b.set_defaults(bench_run=_run_quality)

    b = sub.add_parser("sweep", help="TrainConfig variants trained side by side for the same "
                                     "minutes")
    b.add_argument("--dataset", required=True, help="hidden-state dataset (e.g. "
                   "runs/bench/data/orig, what bench quality extracts)")
    b.add_argument("--arm", nargs="+", action="append", required=True,
                   metavar="NAME [FIELD=VALUE]", help="one arm, a name and its TrainConfig "
                   "fields (repeat the flag); dataset=DIR trains that arm on its own dataset")
    b.add_argument("--minutes", type=float, default=10.0, help="training minutes per arm")
    b.add_argument("--parallel", type=int, default=2, help="arms trained side by side, one "
                   "core each")
    b.add_argument("--served", action="store_true", help="keep each arm's drafter and measure "
                   "its served acceptance (--served-prompts x --served-tokens)")
    _served(b)
    b.add_argument("--eval-depth", type=int, default=4,
                   help="positions of the teacher-forced held-out evaluation")
    b.add_argument("--snapshots", type=float, nargs="+", default=[], metavar="MINUTES",
                   help="also keep each arm's drafter as it was after these training minutes "
                        "(<out>/sweep/<arm>/drafter-<M>min), for a curve")
    _common(b)
    b.set_defaults(bench_run=_run_sweep)

    b = sub.add_parser("serve", help="the server's decoder at each depth beside transformers' "
                                     "own generate and prompt lookup")
    b.add_argument("--drafter", help="drafter dir (default: bench quality's best)")
    _samples(b, 8, "held-out prompts")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    b.add_argument("--depths", type=int, nargs="+", help="fixed depths to run, 0 included "
                   "(default: 0 1 2 3 4 6 8 12 16)")
    b.add_argument("--gpus", type=int, default=0, help="GPUs for the verifier (0: CPU)")
    b.add_argument("--simulate", metavar="PROFILE", help="also sleep this node profile's "
                   "all-reduce time in every verify (a SIMULATED interconnect)")
    b.add_argument("--no-dynamic", action="store_true", help="skip the dynamic-depth run")
    b.add_argument("--no-peers", action="store_true", help="skip the transformers arms "
                   "(plain generate, prompt lookup)")
    b.add_argument("--prompt-lookup-tokens", type=int, nargs="+", default=[10, 3], metavar="K",
                   help="prompt_lookup_num_tokens of each prompt-lookup arm (default 10 3)")
    b.add_argument("--branches", type=int, nargs="*", default=[], metavar="K",
                   help="tree arms with K chains forked at the first draft, at those of depths "
                        "2-4 run (default: none)")
    b.add_argument("--lookup-depths", type=int, nargs="*", default=[3, 4, 8], metavar="D",
                   help="arms at depth D with the server's lookup fallback, and one with "
                        "dynamic depth (default 3 4 8; none: no lookup arms)")
    b.add_argument("--lookup-branches", type=int, nargs="*", default=[], metavar="D",
                   help="arms at depth D with the lookup's match verified beside the drafter's "
                        "chain (a tree), and with each --branches K (default: none)")
    b.add_argument("--parallel-drafter", help="a parallel (P-EAGLE) drafter dir: arms "
                   "parallel{d} at each depth, in the same interleaved run")
    b.add_argument("--block-drafter", help="a block (DFlash) drafter dir: arms block{d} at each "
                   "depth up to its block size, in the same interleaved run")
    _common(b)
    b.set_defaults(bench_run=_run_serve)

    b = sub.add_parser("engines", help="the builtin decoder against vLLM, same drafter, "
                                       "acceptance per position side by side")
    b.add_argument("--drafter", required=True, help="the drafter dir")
    _samples(b, 12, "held-out prompts")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt")
    b.add_argument("--depths", type=int, nargs="+", help="depths besides 0 (default: 3 8)")
    b.add_argument("--dtype", choices=["bf16", "fp32"], help="both engines' dtype (default: "
                   "bf16 where the CPU has native bf16, else fp32)")
    b.add_argument("--gpus", type=int, default=0, help="1 = both engines on one GPU (default: "
                   "where torch sees CUDA)")
    _common(b, ray=True)
    b.set_defaults(bench_run=_run_engines)

    b = sub.add_parser("regen", help="batched generation against one prompt at a time")
    _samples(b, 32, "held-out prompts")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    b.add_argument("--batch", type=int, default=32, help="rows per batched forward")
    b.add_argument("--name", default="regen", help="output name (<out>/<name>.json)")
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    _common(b)
    b.set_defaults(bench_run=_run_regen)

    b = sub.add_parser("storage", help="bf16 against fp8 hidden states: bytes/token, drafter "
                                       "accuracy")
    _samples(b, 600, "conversations")
    b.add_argument("--max-length", type=int, default=512)
    b.add_argument("--steps", type=int, default=150, help="training steps per drafter")
    b.add_argument("--fresh", action="store_true", help="retrain every drafter")
    b.add_argument("--noise-arm", choices=("auto", "always", "never"), default="auto",
                   help="a second bf16 drafter (seed 1) measuring seed-to-seed noise (auto: "
                        "when fp8 and bf16 differ by > 0.01 in held-out acc 0)")
    _common(b, ray=True)
    b.set_defaults(bench_run=_run_storage)

    b = sub.add_parser("online", help="offline against online (and online --cache) training: "
                                      "wall, bytes, accuracy")
    _samples(b, 160, "conversations")
    b.add_argument("--max-length", type=int, default=512)
    b.add_argument("--steps", type=int, default=0, help="training steps per run (0: one epoch)")
    _served(b)
    _common(b, ray=True)
    b.set_defaults(bench_run=_run_online)

    _add_load(sub)


def _add_load(sub) -> None:
    from eagle3_ray.bench import load
    b = sub.add_parser("load", help="concurrent users on a served app of each engine, measured "
                                    "by vLLM's `vllm bench serve`")
    b.add_argument("--drafter", help="drafter dir (default: bench quality's best)")
    b.add_argument("--verifier", help="the verifier (default: the embedded SmolLM2-135M)")
    b.add_argument("--depth", type=int, nargs="+", default=[load.LOAD_DEPTH], metavar="D",
                   help=f"the fixed depth arms, beside depth 0 (default {load.LOAD_DEPTH})")
    b.add_argument("--schedule", help="a depth-by-load arm: vLLM's "
                   "num_speculative_tokens_per_batch_size, [[batch_from, batch_to, k], ...] as "
                   "JSON or a JSON file (a plan result with a \"schedule\" key works too), or "
                   "'auto': what `serve --engine vllm --depth auto --profile P` serves")
    b.add_argument("--profile", help="--schedule auto: the node profile it is planned on")
    b.add_argument("--engines", nargs="+", choices=load.ENGINES, default=list(load.ENGINES))
    b.add_argument("--concurrency", type=int, nargs="+", default=list(load.LOAD_CONCURRENCY),
                   help="vllm bench serve --max-concurrency levels (default 1 2 4 8 16)")
    b.add_argument("--prompts", type=int, default=16,
                   help="held-out prompts per level (vllm bench serve --num-prompts)")
    b.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt")
    b.add_argument("--max-prompt-tokens", type=int, default=128,
                   help="held-out prompts of at most this many templated tokens")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="vLLM's dtype "
                   "(fp32: its outputs under load must equal alone); the builtin engine loads "
                   "its default (fp32 where the CPU has no native bf16, as here)")
    b.add_argument("--ignore-eos", action="store_true", help="vllm bench serve --ignore-eos "
                   "(vLLM honours it; the builtin engine stops at EOS all the same)")
    b.add_argument("--port", type=int, default=8000, help="the apps' HTTP port")
    b.add_argument("--gpus-per-replica", type=float, default=0, help="each app's replica "
                   "(0: CPU)")
    _common(b, ray=True)
    b.set_defaults(bench_run=_run_load)


def cmd_bench(a: argparse.Namespace):
    """`eagle3-ray bench <name>`: run the named bench with its flags."""
    return a.bench_run(a)


# --- one runner per bench --------------------------------------------------------------------

def _run_extract(a):
    from eagle3_ray.bench import stages
    init_ray(a.address)
    if a.engines:        # the same pipeline on vLLM and on transformers
        stages.bench_extract_engines(samples=a.samples, max_length=a.max_length,
                                     out_dir=a.out, repeats=a.repeats, dtype=a.dtype)
    else:
        stages.bench_extract(samples=a.samples, max_length=a.max_length, out_dir=a.out,
                             repeats=a.repeats)


def _run_train(a):      # pure PyTorch, no Ray
    from eagle3_ray.bench import stages
    stages.bench_train(out_dir=a.out, parallel=a.with_parallel, block=a.with_block)


def _run_quality(a):
    from eagle3_ray.bench import quality
    init_ray(a.address)
    recipe = parse_fields(a.set)
    arms = (quality.quality_arms(a.ttt, **recipe) if a.what == "quality"
            else quality.recipe_arms(a.ttt[0], **recipe))
    quality.compare(a.what, arms, conversations=a.samples, max_length=a.max_length,
                    minutes=a.minutes, steps=a.steps, out_dir=a.out, fresh=a.fresh,
                    served_prompts=a.served_prompts, served_tokens=a.served_tokens,
                    regen_conversations=a.regen_samples)


def _run_sweep(a):      # TrainConfig variants side by side, one process each, no Ray
    from eagle3_ray.bench import sweep
    sweep.run(a.dataset, {arm[0]: parse_fields(arm[1:]) for arm in a.arm},
              minutes=a.minutes, parallel=a.parallel, out_dir=a.out,
              eval_depth=a.eval_depth, served_prompts=a.served_prompts if a.served else 0,
              served_tokens=a.served_tokens, snapshots=a.snapshots)


def _run_serve(a):      # the server's decoder in-process, no Ray
    from eagle3_ray.bench.serving import bench_serve
    bench_serve(drafter_dir=a.drafter, prompts=a.samples, max_tokens=a.max_tokens,
                out_dir=a.out, simulate=a.simulate, dynamic=not a.no_dynamic,
                peers=not a.no_peers, prompt_lookup=tuple(a.prompt_lookup_tokens),
                num_gpus=a.gpus, branches=tuple(a.branches),
                lookup_depths=tuple(a.lookup_depths), lookup_branches=tuple(a.lookup_branches),
                parallel_drafter=a.parallel_drafter, block_drafter=a.block_drafter,
                **({"depths": tuple(a.depths)} if a.depths else {}))


def _run_engines(a):    # builtin decoder in-process, vLLM in Ray actors (its own env)
    from eagle3_ray.bench.engines import bench_engines
    bench_engines(a.drafter, prompts=a.samples, max_tokens=a.max_tokens, out_dir=a.out,
                  dtype=a.dtype, address=a.address, gpus=a.gpus or None,
                  **({"depths": tuple(a.depths)} if a.depths else {}))


def _run_regen(a):      # batched generation in-process, no Ray
    from eagle3_ray.bench import stages
    stages.bench_regen(prompts=a.samples, max_new_tokens=a.max_new_tokens, batch=a.batch,
                       out_dir=a.out, name=a.name, threads=a.threads)


def _run_storage(a):
    from eagle3_ray.bench import stages
    init_ray(a.address)
    stages.bench_storage(conversations=a.samples, max_length=a.max_length, steps=a.steps,
                         out_dir=a.out, fresh=a.fresh, noise=a.noise_arm)


def _run_online(a):
    from eagle3_ray.bench.online import bench_online
    init_ray(a.address)
    bench_online(samples=a.samples, max_length=a.max_length, steps=a.steps, out_dir=a.out,
                 served_prompts=a.served_prompts, served_tokens=a.served_tokens)


def _run_load(a):       # Ray Serve apps, driven by vLLM's benchmark client (its own env)
    from eagle3_ray.bench import load
    schedule = read_schedule(a.schedule) if a.schedule != "auto" else auto_schedule(a)
    load.bench_load(drafter_dir=a.drafter, depths=a.depth, schedule=schedule,
                    engines=tuple(a.engines), concurrency=tuple(a.concurrency),
                    prompts=a.prompts, max_tokens=a.max_tokens,
                    max_prompt_tokens=a.max_prompt_tokens, dtype=a.dtype,
                    ignore_eos=a.ignore_eos, port=a.port, out_dir=a.out, address=a.address,
                    gpus_per_replica=a.gpus_per_replica,
                    **({"verifier": a.verifier} if a.verifier else {}))


def auto_schedule(a) -> list[list[int]] | None:
    """--schedule auto: plan.load.planned_schedule of --drafter on --profile."""
    from eagle3_ray.plan import load as plan_load
    if not (a.drafter and a.profile):
        raise SystemExit("--schedule auto needs --drafter and --profile (a profile YAML, e.g. "
                         "`eagle3-ray profile --engine vllm` measures one)")
    return plan_load.planned_schedule(a.drafter, a.profile, log="[bench load]")[1]


def read_schedule(text: str | None) -> list[list[int]] | None:
    """--schedule: JSON text or a JSON file -> [[batch_from, batch_to, k], ...], or None. A dict
    with a "schedule" key (what the planner writes) gives that key's list."""
    if not text:
        return None
    where = "--schedule"
    if os.path.isfile(text):
        where = text
        with open(text) as f:
            text = f.read()
    try:
        got = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{where}: not JSON ({e}); give [[batch_from, batch_to, k], ...]")
    if isinstance(got, dict):
        got = got.get("schedule")
    ok = isinstance(got, list) and got and all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and x >= 0 for x in r)
        and 1 <= r[0] <= r[1] for r in got)
    if not ok:
        raise SystemExit(f"{where}: expected [[batch_from, batch_to, k], ...] of integers "
                         f"with 1 <= batch_from <= batch_to and k >= 0, got {got!r}")
    return got


def parse_fields(items: list[str]) -> dict:
    """["lr=1e-3", "init=random", "data=regen"] -> TrainConfig overrides, typed by the field's
    default ("data" names the dataset: orig or regen)."""
    from eagle3_ray.train.config import TrainConfig
    kinds = {"int": int, "float": float, "bool": bool}           # annotations are strings here
    types = {f.name: kinds.get(str(f.type), str)
             for f in dataclasses.fields(TrainConfig)} | {"data": str}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"{sorted(types)}")
        kind = types[key]
        out[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
    return out
