"""The `eagle3-ray` command: extract, train, export, demo, bench, profile, plan.

    eagle3-ray demo                                   # the embedded default end to end
    eagle3-ray extract --inputs embedded:sharegpt --limit 16 --max-length 256 --output /tmp/hs
    eagle3-ray train --dataset /tmp/hs --output /tmp/tr --ttt-steps 4 --max-steps 20
    eagle3-ray export --drafter /tmp/tr/drafter --format vllm --output /tmp/tr/vllm
    eagle3-ray serve --drafter /tmp/tr/drafter --depth 4   # OpenAI API on Ray Serve, prints URL
    eagle3-ray bench extract --samples 32             # pipeline vs plain forward loop, JSON+PNG
    eagle3-ray bench extract --engines --samples 32   # the same pipeline on vLLM vs transformers
    eagle3-ray bench regen --samples 32 --max-new-tokens 128   # batched generation vs HF loops
    eagle3-ray bench storage --samples 48 --steps 10  # bf16 vs fp8 hidden states: bytes, accuracy
    eagle3-ray bench load --drafter DIR --engines builtin --concurrency 1 2 --prompts 4  # users
    eagle3-ray profile --max-tokens 9 --out /tmp/cpu.yaml  # measure this machine -> node profile
    eagle3-ray plan --acceptance runs/bench/quality.json --profile pcie-8x-rtx-pro-6000-kimi-k2.5
    eagle3-ray plan --sweep 0.6 0.8 0.9 --profile pcie-8x-rtx-pro-6000-kimi-k2.5 \\
        --compare pcie-8x-rtx-pro-6000-kimi-k2.5-allreduce-curve   # best depth: alpha/beta vs curve
    eagle3-ray plan --sweep-kinds 0.5 0.9 --profile pcie-8x-rtx-pro-6000-kimi-k2.5  # chain/parallel
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier
from eagle3_ray.launch import init_ray, run_main
# the bench subcommands live with the benches; jobs/bench.py and tests import them from here
from eagle3_ray.bench.cli import add_bench_args, cmd_bench, parse_fields  # noqa: F401


def add_extract_args(p: argparse.ArgumentParser) -> None:
    """Flags of ExtractConfig (shared with jobs/extract.py)."""
    p.add_argument("--output", required=True, help="dataset directory: local path or URI")
    p.add_argument("--verifier", default=verifier.EMBEDDED_VERIFIER,
                   help="transformers dir, .gguf file, or embedded:smollm2")
    p.add_argument("--node-resource", help="custom resource pinning replicas (e.g. extract_node)")
    add_pipeline_args(p)
    p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The extraction pipeline's flags, shared by `extract` and `train --online`."""
    p.add_argument("--inputs", nargs="+", default=[data.EMBEDDED_SHAREGPT],
                   help="conversation files/dirs/URIs (.json, .jsonl, .parquet) or embedded:sharegpt")
    p.add_argument("--layer-ids", type=int, nargs=3,
                   help="aux layers, as the input of layer i (vLLM convention): 3 distinct "
                        "ids >= 1, sorted ascending")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--limit", type=int, help="first N usable conversations")
    p.add_argument("--skip", type=int, default=0,
                   help="start after the first N usable conversations (with --limit: a slice)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="who holds the verifier: hf (transformers) or vllm (its own environment, "
                        "scripts/setup_vllm.sh; tensor-parallel over --gpus-per-replica)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--gpus-per-replica", type=int, default=0)
    p.add_argument("--cpus-per-replica", type=float,
                   help="Ray CPUs per CPU-only verifier replica (default 1; on a local Ray, "
                        "what fits this machine)")
    p.add_argument("--max-gpu-memory", help='per-GPU cap when sharding, e.g. "70GiB"')
    p.add_argument("--token-budget", type=int, default=0,
                   help="padded tokens per forward (default 0: 16384 on GPUs, 2048 on CPU)")
    p.add_argument("--batch-rows", type=int, default=64, help="samples per batch / Parquet part")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden-storage", choices=["bf16", "fp8_e4m3"], default="bf16",
                   help="stored hidden states: bf16 (8·H B/token) or fp8_e4m3 (4·H+16: e4m3 "
                        "with a float32 scale per token and slot; docs/extract.md)")
    p.add_argument("--regenerate", action="store_true", help="verifier rewrites assistant turns")
    p.add_argument("--regen-max-new-tokens", type=int, default=512)
    p.add_argument("--regen-temperature", type=float, default=0.0)
    p.add_argument("--regen-top-p", type=float, default=1.0)
    p.add_argument("--regen-seed", type=int, default=0)
    p.add_argument("--regen-batch", type=int, default=64, help="rows per generation forward")
    p.add_argument("--regen-token-budget", type=int, default=65536,
                   help="KV-cache tokens per generation batch: rows x (prompt + new tokens)")


def extract_config(a: argparse.Namespace):
    """The parsed flags -> ExtractConfig (`train --online`: no --output, the training
    --verifier, --replica-node-resource)."""
    from eagle3_ray.extract.pipeline import ExtractConfig
    online = getattr(a, "online", False)
    return ExtractConfig(
        inputs=a.inputs, output="" if online else a.output,
        verifier=a.verifier, engine=a.engine, layer_ids=a.layer_ids,
        max_length=a.max_length, sample_limit=a.limit, sample_offset=a.skip,
        replicas=a.replicas,
        gpus_per_replica=a.gpus_per_replica, max_gpu_memory=a.max_gpu_memory,
        cpus_per_replica=a.cpus_per_replica,
        node_resource=a.replica_node_resource if online else a.node_resource,
        token_budget=a.token_budget, batch_rows=a.batch_rows, dtype=a.dtype,
        hidden_storage=a.hidden_storage,
        regenerate=a.regenerate, regen_max_new_tokens=a.regen_max_new_tokens,
        regen_temperature=a.regen_temperature, regen_top_p=a.regen_top_p, regen_seed=a.regen_seed,
        regen_batch=a.regen_batch, regen_token_budget=a.regen_token_budget)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags of TrainConfig (shared with jobs/train.py); defaults are TrainConfig's."""
    from eagle3_ray.train.config import TrainConfig
    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    p.add_argument("--dataset", help="hidden-state dataset dir/URI (extract output), or several "
                   "joined by commas, read as one (e.g. original,regenerated); or --online")
    p.add_argument("--output", required=True, help="run dir: checkpoints, metrics, drafter/")
    p.add_argument("--verifier", default=d["verifier"], help="default: the one the dataset's "
                   "manifest names (--online: the embedded default)")
    p.add_argument("--ttt-steps", type=int, default=d["ttt_steps"], help="TTT unroll depth (1-32)")
    p.add_argument("--step-weight-decay", type=float, default=d["step_weight_decay"])
    p.add_argument("--ttt-ramp", type=float, default=d["ttt_ramp"],
                   help="depth curriculum: grow the unroll 1 -> ttt_steps over this share of training")
    p.add_argument("--deep-fraction", type=float, default=d["deep_fraction"],
                   help="run the TTT steps past 0 on this random share of positions (cheaper)")
    p.add_argument("--cod-ratio", type=float, default=d["cod_ratio"],
                   help="COD sampling: each deep step keeps this share of the step before's "
                        "positions (P-EAGLE: 0.7; 1 = off)")
    p.add_argument("--cod-min", type=float, default=d["cod_min"],
                   help="COD floor: a deep step's share never drops below this (P-EAGLE: 0.2)")
    p.add_argument("--drafting", choices=("chain", "parallel", "block"), default=d["drafting"],
                   help="chain: EAGLE-3 (one drafter forward per draft); parallel: P-EAGLE "
                        "(all drafts of a round from one forward, via mask slots); block: "
                        "DFlash (a block of --ttt-steps drafts from one forward of "
                        "--block-layers layers, each conditioned on the aux states)")
    p.add_argument("--mask-token-id", type=int, default=d["mask_token_id"],
                   help="parallel, block: the mask slots' token id (default: vocab size - 1)")
    p.add_argument("--block-layers", type=int, default=d["block_layers"],
                   help="block: the block drafter's decoder layers")
    p.add_argument("--draft-layer", choices=("llama", "mla"), default=d["draft_layer"],
                   help="the drafter's decoder layer: llama, or mla (DeepSeek MLA, vLLM's "
                        "Eagle3DeepseekV3ForCausalLM; MLA dims from a DeepSeek/Kimi verifier)")
    p.add_argument("--fc-norm", action="store_true", default=d["fc_norm"],
                   help="EAGLE-3.1: an RMSNorm on each aux state before fc")
    p.add_argument("--norm-output", action="store_true", default=d["norm_output"],
                   help="EAGLE-3.1: feed each draft step the previous step's post-norm state")
    p.add_argument("--draft-vocab-size", type=int, default=d["draft_vocab_size"])
    p.add_argument("--targets", choices=("soft", "hard"), default=d["targets"],
                   help="loss target: the teacher's distribution or its argmax")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default=d["recompute"],
                   help="recompute attention + logits in backward (auto: on GPUs only)")
    p.add_argument("--init", choices=("verifier", "random"), default=d["init"],
                   help="start fc + the decoder layer from the verifier or from noise")
    p.add_argument("--max-steps", type=int, default=d["max_steps"])
    p.add_argument("--max-epochs", type=int, default=d["max_epochs"])
    p.add_argument("--max-minutes", type=float, default=d["max_minutes"],
                   help="wall-clock budget of the training loop (0: none)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="samples per worker per step")
    p.add_argument("--max-seq-len", type=int, default=d["max_seq_len"])
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"])
    p.add_argument("--eval-fraction", type=float, default=d["eval_fraction"])
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--log-every", type=int, default=d["log_every"])
    p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"])
    p.add_argument("--num-workers", type=int, default=d["num_workers"])
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default=d["parallel"],
                   help="fsdp: shard weights, gradients and optimizer state over the workers")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default=d["precision"],
                   help="bf16 autocast (auto: on GPUs and bf16-capable CPUs)")
    p.add_argument("--cpus-per-worker", type=float, default=d["cpus_per_worker"],
                   help="Ray CPUs per CPU training worker (default 1; on a local Ray, what fits "
                        "this machine)")
    p.add_argument("--node-resource", help="custom resource pinning workers (e.g. train_node)")
    p.add_argument("--max-failures", type=int, default=d["max_failures"])
    p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")
    o = p.add_argument_group("online training (--online: hidden states streamed from verifier "
                             "replicas, no dataset on disk; docs/train.md)")
    o.add_argument("--online", action="store_true",
                   help="extract while training: takes the extraction flags below, not --dataset")
    o.add_argument("--cache", help="also write the first epoch as an offline dataset here; "
                                   "later epochs read it instead of running the verifier")
    o.add_argument("--replica-node-resource",
                   help="custom resource pinning verifier replicas (e.g. extract_node)")
    o.add_argument("--vocab-samples", type=int, default=50_000,
                   help="conversations whose assistant tokens pick the draft vocabulary")
    o.add_argument("--eval-samples", type=int, default=512,
                   help="held-out conversations extracted once for evaluation")
    add_pipeline_args(o)


def train_config(a: argparse.Namespace):
    """The parsed flags -> TrainConfig (every flag but --address is a field)."""
    from eagle3_ray.train.config import TrainConfig
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(a).items() if k in names})


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of ServeConfig (shared with jobs/serve.py)."""
    p.add_argument("--verifier", help="default: the one the drafter's meta.json names, else "
                   f"{verifier.EMBEDDED_VERIFIER}")
    p.add_argument("--drafter", help="trained drafter dir (<train output>/drafter); none = depth 0")
    p.add_argument("--model-name", default="eagle3-ray", help="the OpenAI model id")
    p.add_argument("--depth", type=depth_arg, default=4, help="default speculation depth, or "
                   "'auto': planned from the drafter's acceptance and --profile (engine vllm: "
                   "a depth per batch-size range, num_speculative_tokens_per_batch_size; "
                   "builtin: --dynamic-depth)")
    p.add_argument("--max-depth", type=int, default=16, help="bound of per-request depth")
    p.add_argument("--dynamic-depth", action="store_true", help="requests without "
                   "speculation_depth get each round's depth from their acceptance (planner)")
    p.add_argument("--branches", type=int, default=1, help="greedy requests: chains forked at "
                   "the first draft, verified together as one tree (1: a plain chain)")
    p.add_argument("--no-lookup", dest="lookup", action="store_false", help="turn off the lookup "
                   "fallback (a doubted first draft gives way to the continuation of an n-gram "
                   "seen earlier in the request)")
    p.add_argument("--lookup-branch", action="store_true", help="greedy requests verify the "
                   "lookup's match beside the drafter's chain (one tree forward) instead of in "
                   "its place: pays where more verified tokens cost little (AMX CPUs, GPUs)")
    p.add_argument("--profile", help="node profile for --dynamic-depth (default: measured at "
                   "start)")
    p.add_argument("--simulate-interconnect", metavar="PROFILE", help="SIMULATION: add this node "
                   "profile's all-reduce time to every verify")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin")
    p.add_argument("--gpus-per-replica", type=float, default=0)
    p.add_argument("--cpus-per-replica", type=float,
                   help="Ray CPUs per replica (default 1; on a local Ray, what fits this machine)")
    p.add_argument("--node-resource", help="custom resource pinning replicas (e.g. pcie_node)")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--autoscaling", help='JSON Serve autoscaling_config, e.g. '
                   '\'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}\'')
    p.add_argument("--max-ongoing-requests", type=int, default=4)
    p.add_argument("--max-queued-requests", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--api-key", default=os.environ.get("EAGLE3_RAY_API_KEY"),
                   help="require 'Authorization: Bearer <key>' (default $EAGLE3_RAY_API_KEY)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), help="engine vllm: the "
                   "verifier's dtype (default: bf16 on GPUs and CPUs with native bf16, else fp32)")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, help="engine vllm: no "
                   "torch.compile / CUDA graphs (default: eager on CPU hosts with < 8 cores)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", help="Ray address (default: $RAY_ADDRESS, else a local Ray)")


def depth_arg(text: str):
    """--depth: an integer >= 0 or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depth: an integer or 'auto', got {text!r}") from None


def serve_depth(a: argparse.Namespace) -> tuple[int, bool, list | None]:
    """--depth -> (depth, dynamic_depth, depth_schedule). 'auto' plans from the drafter's
    measured per-position acceptance (what the builtin's dynamic depth starts from,
    serve.app.depth_planning): on engine vllm, with --profile's verify surface, a depth per
    batch-size range (plan.load.depth_schedule; depth = its largest k, 0 if none pays); on the
    builtin engine, which does not batch, dynamic depth per round (each request's depth from
    its own acceptance and the profile, measured at start without --profile)."""
    if a.depth != "auto":
        return (a.depth if a.drafter else 0), a.dynamic_depth, None
    if not a.drafter:
        raise ValueError("--depth auto plans from a drafter's acceptance: give --drafter")
    if a.engine != "vllm":
        return min(4, a.max_depth), True, None
    if not a.profile:
        raise ValueError("--engine vllm --depth auto needs --profile (a packaged node profile or "
                         "the YAML `eagle3-ray profile --out FILE` measures): the schedule is "
                         "priced on its verify surface over batch sizes")
    from eagle3_ray.plan import load
    depth, schedule, _ = load.planned_schedule(a.drafter, a.profile, a.max_depth, log="[serve]")
    return depth, False, schedule


def serve_config(a: argparse.Namespace):
    import json
    from eagle3_ray.serve.app import ServeConfig
    spec = a.verifier
    if not spec and a.drafter:
        from eagle3_ray.train.checkpoint import read_drafter_config
        spec = read_drafter_config(a.drafter)[1].get("verifier")
    depth, dynamic, schedule = serve_depth(a)
    return ServeConfig(
        verifier=spec or verifier.EMBEDDED_VERIFIER, drafter=a.drafter, model_name=a.model_name,
        depth=depth, depth_schedule=schedule, max_depth=a.max_depth, engine=a.engine,
        dynamic_depth=dynamic, branches=a.branches,
        lookup=a.lookup, lookup_branch=a.lookup_branch, profile=a.profile,
        simulate_interconnect=a.simulate_interconnect,
        gpus_per_replica=a.gpus_per_replica, cpus_per_replica=a.cpus_per_replica,
        node_resource=a.node_resource, num_replicas=a.num_replicas,
        autoscaling=json.loads(a.autoscaling) if a.autoscaling else None,
        max_ongoing_requests=a.max_ongoing_requests, max_queued_requests=a.max_queued_requests,
        request_timeout_s=a.request_timeout_s, api_key=a.api_key, max_model_len=a.max_model_len,
        dtype=a.dtype, eager=a.eager, host=a.host, port=a.port)


def cmd_serve(a):
    from eagle3_ray.serve.app import run_serve
    run_serve(serve_config(a), a.address)


def cmd_train(a):
    """Offline (--dataset) or online (--online: extraction flags instead of a dataset)."""
    if bool(a.dataset) == bool(a.online):
        raise ValueError("train needs exactly one of --dataset DIR and --online")
    if a.online:
        from eagle3_ray.train.online import run_online
        run_online(train_config(a), extract_config(a), a.address, cache=a.cache,
                   vocab_samples=a.vocab_samples, eval_samples=a.eval_samples)
        return
    from eagle3_ray.train.trainer import run_train
    run_train(train_config(a), a.address)


def cmd_export(a):
    from eagle3_ray.train import checkpoint
    checkpoint.export(a.drafter, a.output, a.format, verifier_path=a.verifier_path,
                      dtype=a.dtype)
    print(f"[export] {a.format}: {a.output}")


def cmd_extract(a):
    from eagle3_ray.extract.pipeline import run_extract
    run_extract(extract_config(a), a.address)


def cmd_demo(a):
    from eagle3_ray.demo import DemoConfig, run_demo
    run_demo(DemoConfig(run_dir=a.run_dir, minutes=a.minutes, samples=a.samples,
                        max_length=a.max_length,
                        regenerate=a.regenerate, regen_max_new_tokens=a.regen_max_new_tokens,
                        ttt_steps=a.ttt_steps, train_steps=a.train_steps,
                        train_minutes=a.train_minutes, depth=a.depth,
                        prompts=a.prompts, max_tokens=a.max_tokens, fresh=a.fresh,
                        address=a.address))


def cmd_profile(a):
    from eagle3_ray.plan import output, profiles
    from eagle3_ray.serve import profile
    prof = profile.measure_profile(a.verifier, a.drafter, max_tokens=a.max_tokens,
                                   context=a.context, reps=a.reps, name=a.name,
                                   parallel_ks=a.parallel_k,
                                   draft_collectives=a.draft_collectives,
                                   batch_sizes=a.batch_sizes, batch_tokens=a.batch_tokens)
    profiles.save_profile(prof, a.out)
    ms = prof.verify_ms
    print(f"[profile] verify {ms[1]:.2f} ms (1 token) .. {ms[max(ms)]:.2f} ms ({max(ms)} tokens), "
          f"draft step {prof.draft_step_ms:.2f} ms, {prof.gpus} GPU(s) -> {a.out}")
    if prof.draft_parallel_ms:
        print("[profile] drafter forward of k tokens: " + ", ".join(
            f"k={k} {v:.2f} ms" for k, v in prof.draft_parallel_ms.items())
            + f"; {prof.draft_collectives} collectives per drafter forward")
    if prof.interconnect.allreduce_us:
        print(f"[profile] all-reduce {output.allreduce_model(prof)}")
    for b, row in (prof.verify_batch_ms or {}).items():
        print(f"[profile] verify of batch {b}: " + ", ".join(
            f"{t} tokens each {v:.2f} ms" for t, v in row.items()))
    if a.engine == "vllm":
        prof = profile_vllm_rounds(a, prof)
        profiles.save_profile(prof, a.out)
        print(f"[profile] {prof.round_engine}: rounds of batch B at depth k (ms) -> {a.out}")
        for b, ms in prof.plain_batch_ms.items():
            print(f"[profile]   B={b}: plain {ms:.1f}, " + ", ".join(
                f"k={k} {row[b]:.1f}" for k, row in prof.round_batch_ms.items()))


def profile_vllm_rounds(a, prof):
    """`profile --engine vllm`: vLLM's own rounds over batch size x depth
    (serve.profile_vllm) added to `prof`, measured as `serve --engine vllm` would run the
    engine; the arms' raw records beside the YAML (<out>.rounds.json)."""
    import dataclasses
    import json
    import torch
    from eagle3_ray.engine import hf
    from eagle3_ray.serve import profile_vllm, vllm as serve_vllm
    from eagle3_ray.serve.app import ServeConfig
    if not a.drafter:
        raise ValueError("profile --engine vllm needs --drafter (the drafter it serves)")
    cfg = ServeConfig(verifier=hf.materialize(a.verifier), drafter=a.drafter, engine="vllm",
                      dtype=a.dtype, cpus_per_replica=a.cpus_per_replica,
                      gpus_per_replica=1 if torch.cuda.is_available() else 0,
                      max_model_len=a.max_model_len, api_key=None)
    got = profile_vllm.measure_rounds(cfg, a.round_depths, a.batch_sizes or [1],
                                      a.round_tokens, reps=a.reps,
                                      synthetic=a.synthetic_acceptance)
    with open(a.out + ".rounds.json", "w") as f:
        json.dump(got, f, indent=1)
    where = (torch.cuda.get_device_name(0) if cfg.gpus_per_replica else
             f"{serve_vllm.engine_threads(cfg)} CPU thread(s)")
    what = f"{got['engine']} ({a.dtype or 'its default dtype'}, {where})"
    return dataclasses.replace(
        prof, round_batch_ms=got["round_batch_ms"], plain_batch_ms=got["plain_batch_ms"],
        round_engine=what, description=prof.description + f"; round_batch_ms / plain_batch_ms: "
        f"decode rounds of {what} as `serve --engine vllm --cpus-per-replica "
        f"{a.cpus_per_replica}` runs it, drafter {a.drafter}, timed between engine steps "
        f"(serve/profile_vllm.py)")


# plan's acceptance flags: (argparse dest, the kind a non-dir source is taken as, the flag)
PLAN_KIND_FLAGS = (("acceptance", "chain", "--acceptance"),
                   ("parallel_acceptance", "parallel", "--parallel-acceptance"),
                   ("block_acceptance", "block", "--block-acceptance"))


def plan_acceptances(a) -> dict:
    """--acceptance / --parallel-acceptance / --block-acceptance -> {kind: (cond_acc, known,
    description)}. A drafter or run dir says its own kind (draft_config.drafting; older ones
    are chains); any other source is the kind of the flag that gave it."""
    from eagle3_ray.plan import acceptance
    out, given = {}, {}
    for dest, flag_kind, flag in PLAN_KIND_FLAGS:
        src = getattr(a, dest)
        if not src:
            continue
        kind = acceptance.drafting_of(src) or flag_kind
        if flag != "--acceptance" and kind != flag_kind:
            other = next(f for _, k, f in PLAN_KIND_FLAGS if k == kind)
            raise ValueError(f"{flag} {src}: a {kind} drafter (its draft_config says "
                             f"drafting={kind!r}); pass it as {other}")
        if kind in out:
            raise ValueError(f"two {kind} acceptance sources ({given[kind]} and {flag} {src}): "
                             f"give at most one drafter of each kind")
        out[kind], given[kind] = acceptance.acceptance_from(src, a.ttt, kind), f"{flag} {src}"
    return out


def plan_block(a) -> tuple[int, int]:
    """The block drafter's (layers, block size): --block-layers, else what the block drafter
    dir's draft_config says (block_layers), else cost.BLOCK_LAYERS; its block_size, else
    cost.BLOCK_SIZE. A --block-layers that contradicts the dir is refused."""
    from eagle3_ray.plan import acceptance, cost
    src = next((getattr(a, dest, None) for dest, _, _ in PLAN_KIND_FLAGS
                if getattr(a, dest, None) and acceptance.drafting_of(getattr(a, dest)) == "block"),
               None)
    layers = acceptance.draft_config_int(src, "block_layers") if src else None
    size = acceptance.draft_config_int(src, "block_size") if src else None
    if a.block_layers is not None and a.block_layers < 1:
        raise ValueError(f"--block-layers must be >= 1, got {a.block_layers}")
    if a.block_layers is not None and layers is not None and a.block_layers != layers:
        raise ValueError(f"--block-layers {a.block_layers}: the block drafter {src} has "
                         f"{layers} layers (its draft_config)")
    return a.block_layers or layers or cost.BLOCK_LAYERS, size or cost.BLOCK_SIZE


def cmd_toy(a):
    from eagle3_ray.engine import toy
    toy.main([a.family, a.directory])


def plan_profile(a, name: str):
    """A node profile priced for the drafter layer `plan --draft-layer` names."""
    from eagle3_ray.plan import profiles
    return profiles.with_draft_layer(profiles.load_profile(name), a.draft_layer)


def cmd_plan(a):
    from eagle3_ray.plan import acceptance, cost, load, output
    measured = a.parallel_acceptance or a.block_acceptance
    if (a.sweep or a.sweep_kinds) and measured:
        raise ValueError("--parallel-acceptance and --block-acceptance plan a measured drafter; "
                         "--sweep and --sweep-kinds take acceptance levels instead")
    if a.sweep:
        return plan_sweep(a)
    if a.sweep_kinds:
        return plan_sweep_kinds(a)
    if not a.acceptance and not measured:
        raise ValueError("plan needs --acceptance, --parallel-acceptance and/or "
                         "--block-acceptance (or --sweep, --sweep-kinds)")
    sources = plan_acceptances(a)
    layers, size = plan_block(a)
    costs = acceptance.train_costs_from(a.bench_train) if a.bench_train else None
    profile = plan_profile(a, a.profile)
    chosen = cost.choose_drafting(profile, sources, a.max_depth, costs, layers, size)
    kind = chosen["choice"]
    result = chosen["plans"][kind]
    cond, known, desc = sources[kind]
    others = [chosen["plans"][k] for k in chosen["ranking"][1:]] + list(
        chosen["what_if"].values())                        # the other kinds, or the what-if
    result["drafting_choice"] = {
        "choice": kind, "why": chosen["why"], "kinds": chosen["kinds"],
        "ranking": chosen["ranking"], "runner_up": chosen["runner_up"],
        "decided_by": chosen["decided_by"],
        "what_if": {k: output.kind_summary(v) for k, v in chosen["what_if"].items()}}
    result["other_kind"] = others[0]
    if len(others) > 1:
        result["further_kinds"] = {r["drafting"]: r for r in others[1:]}
    result["draft_layer"] = profile.draft_layer
    other = None
    if a.compare:
        other = cost.plan(cond, plan_profile(a, a.compare), result["max_depth"], known, costs,
                          drafting=kind, block_layers=layers)
        result["compare"] = other
        result["comparison"] = output.compare_text(result, other)
    result["depth_schedule"] = load.depth_schedule(cond, profile, result["max_depth"],
                                                   a.max_batch, kind, layers, known)
    output.write_plan(a.out, result, other, others)
    for k, (_, kn, d) in sources.items():
        print(f"[plan] {k} acceptance: {d}; measured positions 0..{kn - 1}")
    if "block" in chosen["plans"] or "block" in chosen["what_if"]:
        b = {**chosen["plans"], **chosen["what_if"]}["block"]["block"]
        print(f"[plan] block drafter: {b['layers']} layers, {b['collectives_per_forward']} "
              f"collectives a forward of depth+1 tokens, at most {size} drafts a round; "
              f"forward time: {b['forward_ms']}")
    print(output.format_table(result, other))
    for r in [result] + ([other] if other else []):
        print(f"[plan] {r['profile']}: best depth {r['best_depth']} "
              f"(x{r['best']['speedup']:.2f}, {r['best']['tokens_per_s']:.1f} tok/s); "
              f"train with ttt_steps={r['ttt_steps']}"
              + (f" ({r['ttt_steps_relative_cost']:.2f}x the step time of ttt_steps="
                 f"{r['train_relative_to']})" if "ttt_steps_step_s" in r else ""))
        for w in r["warnings"]:
            print(f"[plan] warning: {w}")
    print(f"[plan] why: {result['why']}")
    print(f"[plan] drafting: {chosen['why']}")
    print(output.format_schedule(result["depth_schedule"]))
    for w in result["depth_schedule"]["warnings"]:
        print(f"[plan] warning: schedule: {w}")
    if other:
        print(f"[plan] {result['comparison']}")
    print(f"[plan] -> {a.out}/plan.json, {a.out}/plan.png")


def plan_sweep_kinds(a):
    """plan --sweep-kinds: chain, parallel and block drafting per acceptance level, with the
    drafters' collectives on and off, on --profile (and --compare)."""
    from eagle3_ray.plan import acceptance, cost, output
    profiles = [plan_profile(a, a.profile)]
    if a.compare:
        profiles.append(plan_profile(a, a.compare))
    first, rest = a.parallel_ratios or (acceptance.PARALLEL_FIRST_RATIO,
                                        acceptance.PARALLEL_REST_RATIO)
    bfirst, brest = a.block_ratios or (acceptance.BLOCK_FIRST_RATIO, acceptance.BLOCK_REST_RATIO)
    result = cost.sweep_drafting(a.sweep_kinds, profiles, a.max_depth, first, rest, bfirst,
                                 brest, *plan_block(a))
    output.write_json(a.out, "sweep_kinds.json", result)
    for kind in ("parallel", "block"):
        r = result[f"{kind}_acceptance"]
        print(f"[plan] {kind} acceptance: {r['rule']}, first = {r['first_ratio']:.3f}, "
              f"rest = {r['rest_ratio']:.3f} ({r['source']})")
    print(f"[plan] block drafter: {result['block_layers']} layers, at most "
          f"{result['block_size']} drafts a round")
    print(output.format_sweep_drafting(result))
    print(f"[plan] -> {a.out}/sweep_kinds.json")


def plan_sweep(a):
    """plan --sweep: best depth per constant acceptance level on --profile (and --compare)."""
    from eagle3_ray.plan import cost, load, output
    profiles = [plan_profile(a, a.profile)]
    if a.compare:
        profiles.append(plan_profile(a, a.compare))
    result = cost.sweep(a.sweep, profiles, a.max_depth)
    result["schedules"] = load.sweep_schedules(a.sweep, profiles, a.max_depth, a.max_batch)
    output.write_json(a.out, "sweep.json", result)
    for name, how in result["allreduce_model"].items():
        print(f"[plan] {name}: all-reduce {how}")
    print(output.format_sweep(result))
    print(f"\ndepth by batch size (vLLM num_speculative_tokens_per_batch_size), batches "
          f"1..{a.max_batch}:")
    print(output.format_sweep_schedules(result["schedules"]))
    for name, ws in result["warnings"].items():
        for w in ws:
            print(f"[plan] warning: {name}: {w}")
    print(f"[plan] -> {a.out}/sweep.json")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3-ray", description="Deep EAGLE-3 drafters on Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("extract", help="conversations -> hidden-state Parquet dataset")
    add_extract_args(e)
    e.set_defaults(fn=cmd_extract)

    d = sub.add_parser("demo", help="extract -> train -> serve -> report, embedded default")
    from eagle3_ray.demo import DemoConfig
    dd = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    d.add_argument("--run-dir", default=dd["run_dir"])
    d.add_argument("--minutes", type=float, default=dd["minutes"],
                   help="wall-clock target of the demo: a slow host extracts, trains and sends "
                        "less to fit it (0: no scaling)")
    d.add_argument("--samples", type=int, default=dd["samples"],
                   help="conversations to extract (default 400, fewer on a slow host)")
    d.add_argument("--max-length", type=int, default=dd["max_length"])
    d.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=dd["regenerate"],
                   help="train on the verifier's own greedy answers")
    d.add_argument("--regen-max-new-tokens", type=int, default=dd["regen_max_new_tokens"])
    d.add_argument("--ttt-steps", type=int, default=dd["ttt_steps"])
    d.add_argument("--train-steps", type=int, default=dd["train_steps"],
                   help="the drafter's optimizer steps (the same on every host)")
    d.add_argument("--train-minutes", type=float, default=dd["train_minutes"],
                   help="wall-clock cap on training")
    d.add_argument("--depth", type=int, default=dd["depth"], help="served depth (0: the ttt_steps)")
    d.add_argument("--prompts", type=int, default=dd["prompts"],
                   help="held-out prompts per depth (default 12, fewer on a slow host)")
    d.add_argument("--max-tokens", type=int, default=dd["max_tokens"])
    d.add_argument("--fresh", action="store_true", help="delete the run dir and start over")
    d.add_argument("--address")
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="train the drafter on Ray Train (reruns resume)")
    add_train_args(t)
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("serve", help="serve verifier + drafter: OpenAI API on Ray Serve")
    add_serve_args(v)
    v.set_defaults(fn=cmd_serve)

    x = sub.add_parser("export", help="write a trained drafter in an engine's format")
    x.add_argument("--drafter", required=True, help="a drafter dir (<train output>/drafter)")
    x.add_argument("--format", required=True, choices=["sglang", "vllm", "speculators"])
    x.add_argument("--output", required=True)
    x.add_argument("--verifier-path", help="the verifier (dir, .gguf, embedded:smollm2; default: "
                   "meta.json's): its dtype, and speculators' verifier.name_or_path")
    x.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="tensors + torch_dtype (default: the verifier's)")
    x.set_defaults(fn=cmd_export)

    b = sub.add_parser("bench", help="benchmarks (JSON + PNG)")
    add_bench_args(b)
    b.set_defaults(fn=cmd_bench)

    f = sub.add_parser("profile", help="measure this machine's verify/draft times -> node profile")
    f.add_argument("--verifier", default=verifier.EMBEDDED_VERIFIER)
    f.add_argument("--drafter", help="a trained drafter dir (default: an untrained one)")
    f.add_argument("--out", default="runs/profile.yaml", help="profile YAML to write")
    f.add_argument("--max-tokens", type=int, default=33, help="verify 1..N tokens")
    f.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    f.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    f.add_argument("--name", help="profile name (default: measured-<host>)")
    f.add_argument("--parallel-k", type=int, nargs="*", default=[1, 2, 4, 8, 16], metavar="K",
                   help="time a drafter forward of K query tokens (a parallel round) for each "
                        "K -> draft_parallel_ms (none given: not measured)")
    f.add_argument("--draft-collectives", type=int, metavar="C",
                   help="collectives per drafter forward (default: 0 on one device, "
                        "4 with several: the drafter at the verifier's tensor-parallel degree)")
    f.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8], metavar="B",
                   help="time a batched verify of B sequences for each B -> verify_batch_ms, "
                        "the surface plan's per-batch-size schedule prices (none: batch 1 only)")
    f.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 2, 3, 5], metavar="T",
                   help="tokens per sequence in those verifies (depth T-1)")
    f.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="vllm: also time vLLM's own decode rounds at each --batch-sizes B and "
                        "--round-depths k (and without a drafter) -> round_batch_ms, which "
                        "`plan` and `serve --engine vllm --depth auto` price the schedule with")
    f.add_argument("--round-depths", type=int, nargs="+", default=[0, 1, 2, 3], metavar="K",
                   help="--engine vllm: the depths timed (0: the drafter loaded, drafting none)")
    f.add_argument("--round-tokens", type=int, default=33,
                   help="--engine vllm: tokens each timed request generates")
    f.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="--engine vllm: the served replica's CPUs (its engine's threads)")
    f.add_argument("--dtype", choices=("bf16", "fp32", "fp16"),
                   help="--engine vllm: the served dtype (default: the engine's rule)")
    f.add_argument("--max-model-len", type=int, default=1024, help="--engine vllm")
    f.add_argument("--synthetic-acceptance", type=float, metavar="A",
                   help="--engine vllm on GPUs: vLLM's synthetic rejection sampler at "
                        "conditional acceptance A per position (any drafter of the shape)")
    f.set_defaults(fn=cmd_profile)

    n = sub.add_parser("plan", help="best speculation depth + ttt_steps for a node, chain, "
                                    "parallel or block drafting (JSON + PNG)")
    src = n.add_mutually_exclusive_group()
    src.add_argument("--acceptance",
                     help="training run dir, bench quality/serve JSON, http(s) URL of a server, "
                          "or a list like 0.8,0.75,0.7: a chain drafter's acceptance (a drafter "
                          "dir whose draft_config says drafting=parallel or block: that kind's)")
    src.add_argument("--sweep", type=float, nargs="+", metavar="A",
                     help="instead: best depth for each constant acceptance level A on "
                          "--profile (and --compare) -> a table + sweep.json")
    src.add_argument("--sweep-kinds", type=float, nargs="+", metavar="A",
                     help="instead: chain (a at every position) against parallel "
                          "(--parallel-ratios of it) and block drafting (--block-ratios of it) "
                          "for each level A, the drafters' collectives on and off -> a table + "
                          "sweep_kinds.json")
    n.add_argument("--parallel-acceptance",
                   help="a parallel (P-EAGLE) drafter's acceptance, the same forms as "
                        "--acceptance: plan chooses among the kinds given")
    n.add_argument("--block-acceptance",
                   help="a block (DFlash) drafter's acceptance, the same forms as --acceptance "
                        "(a bench serve JSON: its block{d} arms): plan chooses among the kinds "
                        "given")
    n.add_argument("--block-layers", type=int, metavar="N",
                   help="the block drafter's decoder layers: its forward and its 2 + 2N "
                        "collectives at TP (default: its draft_config's, else 2)")
    n.add_argument("--parallel-ratios", type=float, nargs=2, metavar=("FIRST", "REST"),
                   help="--sweep-kinds: parallel a_0 = FIRST x chain a_0, a_j = REST x chain "
                        "a_j (default 63/71, (38/63)/(49/71): vLLM PR #32628's P0/P1)")
    n.add_argument("--block-ratios", type=float, nargs=2, metavar=("FIRST", "REST"),
                   help="--sweep-kinds: block a_0 = FIRST x chain a_0, a_j = REST x chain a_j "
                        "(default 1.0 1.084: ASSUMED, see plan/acceptance.py)")
    n.add_argument("--profile", required=True, help="packaged profile name or YAML path")
    n.add_argument("--compare", help="a second profile, planned alongside")
    n.add_argument("--draft-layer", choices=("llama", "mla"), help="price this drafter decoder "
                   "layer (the profile's draft_layers; default: the one it prices at the top)")
    n.add_argument("--max-depth", type=int, default=32)
    n.add_argument("--max-batch", type=int, default=256, help="the per-batch-size depth schedule "
                   "(vLLM's num_speculative_tokens_per_batch_size) covers batches 1..N")
    n.add_argument("--bench-train", help="bench train JSON: step time per ttt_steps")
    n.add_argument("--ttt", type=int, help="bench quality JSON: the drafter with this ttt_steps")
    n.add_argument("--out", default="runs/plan")
    n.set_defaults(fn=cmd_plan)

    y = sub.add_parser("toy", help="write a small random verifier of a family (tests, GPU check)")
    y.add_argument("family", choices=("llama", "deepseek", "kimi"),
                   help="deepseek: Kimi-K2.5's text model in small (MLA + MoE); kimi: its "
                        "vision-language wrapper around one")
    y.add_argument("directory")
    y.set_defaults(fn=cmd_toy)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return run_main(a.fn, a)


if __name__ == "__main__":
    sys.exit(main())
