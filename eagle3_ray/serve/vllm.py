"""The production engine of the serving stage: the verifier + our EAGLE-3 drafter on vLLM, behind
ray.serve.llm's OpenAI-compatible app (`engine="vllm"` in serve.ServeConfig).

What it does:
  1. exports the trained drafter once into the layout vLLM loads ("LlamaForCausalLMEagle3":
     model.safetensors + config.json), in <drafter>/export-vllm, redone when the drafter changes;
  2. turns the serve config into the arguments of `ray.serve.llm.build_openai_app`
     (`llm_config`, `serving_args`: plain dicts, testable without vLLM);
  3. deploys them (`deploy`, what `eagle3-ray serve --engine vllm` runs) as two Serve
     applications: the OpenAI app at "/" and, at "/metrics", vLLM's engine counters
     (spec-decode drafts, accepted tokens per position, ...) as Prometheus text (`metrics_app`).

Where vLLM runs — the engine environment (engine/vllm.py): vLLM lives in its own virtualenv
(.venv-vllm), with a transformers older than the project's, and `ray.serve.llm` only imports
where vLLM does (Ray 2.60's builder imports vLLM's OpenAI protocol models). The driver, in the
project's environment, imports neither. `deploy` hands Serve a *declarative* application config
(a ServeApplicationSchema, what `serve deploy config.yaml` sends): import_path
"ray.serve.llm:build_openai_app", args = `serving_args(cfg)`, and runtime_env = {py_executable:
the engine python}. Serve's controller then imports and builds the app in a task running that
python, and every deployment the build creates — the OpenAI ingress (which imports vLLM's
protocol types) and the LLMServer replicas holding the engines — inherits the app's runtime_env
(Serve passes the build task's runtime_env on as the deployments' default). The LLMConfig's own
`runtime_env` (engine.vllm.runtime_env: env_vars for OpenMP threads, Intel OpenMP) is merged
into the replicas'. So one mechanism, Ray's own, covers all three places vLLM is imported
(the build, the ingress, the replicas), the driver stays vLLM-free, and the config is plain
data: the same dict works in a Serve YAML (docs/serve.md#vllm-engine). Everything project-side
(the export, the drafter check) happens in the driver first. (Alternatives not taken: building
the Application in the driver needs ray.serve.llm there; a builder task in the engine env that
calls serve.run would work too, but Serve's declarative path is the documented one and also
sets the build task's and every deployment's runtime_env in one place.)
`build_vllm_app(cfg)` builds the same app in-process, for a Serve config whose import_path is
eagle3_ray.serve.app:app_builder and whose runtime_env runs the engine python.

Mapping (Ray 2.60, read in ray/llm/_internal/serve/..., no code taken):
  - cfg.verifier -> model_loading_config.model_source (HF id, local dir or s3:// / gs:// URI);
    cfg.model_name -> model_loading_config.model_id (the OpenAI "model" clients send).
  - engine_kwargs go to vLLM as-is (engines/vllm/vllm_models.py, VLLMEngineConfig
    .from_llm_config splits them over vLLM's AsyncEngineArgs / FrontendArgs and rejects any
    other key): engine.vllm.engine_kwargs (dtype: cfg.dtype, else bf16 on GPUs and CPUs with
    native bf16, fp32 on others; enforce_eager: cfg.eager, else eager on CPU hosts with < 8
    cores; on CPU kv_cache_memory_bytes), tensor_parallel_size, max_model_len,
    speculative_config (eagle3; with "parallel_drafting": true where the export's config.json
    says the drafter is a parallel, P-EAGLE, one: vLLM drafts in parallel only when asked;
    method "dflash" for a block, DFlash, drafter: eagle3_speculative_config).
  - placement_group_config {"bundles": [...], "strategy": "STRICT_PACK"} (LLMConfig field,
    validated by ray/llm/_internal/common/placement.py PlacementGroupConfig; BundleConfig allows
    extra keys for custom resources). GPUs: one {"GPU": 1} bundle per tensor-parallel worker.
    No GPUs: one {"CPU": cpus_per_replica} bundle (a bundle without a GPU key makes Ray Serve
    LLM pick its CPU backend: vLLM's CPU engine, multiprocessing executor, the engine core a
    subprocess of the replica), and the replica actor itself asks no CPU, so the replica holds
    cpus_per_replica in all. The first bundle also asks for a sliver (0.001) of
    cfg.node_resource; STRICT_PACK puts every bundle on that one node, so the whole replica
    lands on the PCIe node and TP all-reduces never cross nodes. LLMServer
    .get_deployment_options (core/server/llm_server.py) adds the replica actor's own resources
    (deployment_config.ray_actor_options) to the first bundle and hands the bundles to Serve;
    Serve refuses placement_group_bundles in deployment_config itself.
  - deployment_config: max_ongoing_requests, max_queued_requests (overflow -> 503),
    autoscaling_config or num_replicas, ray_actor_options.num_cpus (GPUs: cfg.cpus_per_replica),
    max_constructor_retry_count 3 (an engine that cannot start fails the deploy after 3 tries,
    not Serve's 20).
  - log_engine_metrics (default on in Ray): vLLM's stat loggers are Ray metrics
    (vllm/v1/metrics/ray_wrappers.py, names sanitized to `vllm_...`), which Ray's metrics agent
    on each node exports on its Prometheus port (ray.nodes() MetricsExportPort) as
    `ray_vllm_...`, some seconds after they change (Ray's metrics report interval). The
    "/metrics" app reads those ports on every alive node and serves the vLLM series under
    vLLM's names (`vllm:spec_decode_num_drafts_total`, ...`_num_accepted_tokens_per_pos_total
    {position="k"}`), plus eagle3_ray_drafted/accepted_at_position_total summed over replicas
    (what `eagle3-ray plan --acceptance <url>` reads from the builtin engine too).
  - cfg.request_timeout_s is a proxy setting (serve.start http_options), set by serve.start.

The drafter directory must be readable at the same path on the serving node (shared storage),
as the verifier must: vLLM loads both there. dtype and eager are decided on the driver's host
(engine.vllm), so on a CPU cluster give --dtype / --eager for the serving nodes' CPUs.

The same API as the builtin app (serve/validate.py, serve/vllm_ingress.py): Ray 2.60's OpenAI
ingress has no authentication, no /health and passes unknown roles and fields to vLLM, and
vLLM's own `api_key` frontend argument guards only vLLM's own FastAPI app (used by Ray only on
its opt-in direct-streaming path). So `serving_args` names our subclass of Ray's OpenAiIngress
in LLMServingArgs.ingress_cls_config (Ray Serve LLM's documented seam for a custom ingress):
cfg.api_key (--api-key / EAGLE3_RAY_API_KEY) enforced on every route of the app but /health,
401 with the builtin's body (the Serve config carries its sha256, not the key); GET /health
(200 once the engine replica passes its health check); the builtin's checks of roles, content
types, sampling fields and the body size; `speculation_depth` may only name the served depth.
/metrics is a separate app and needs no key, as on the builtin app.

CPU-sized command (2 cores, ~1 min to start; needs .venv-vllm from scripts/setup_vllm.sh and a
drafter, e.g. `eagle3-ray demo`'s; the verifier is the embedded SmolLM2-135M as a transformers
dir):

    .venv/bin/eagle3-ray serve --engine vllm --verifier \
        "$(.venv/bin/python -m eagle3_ray.engine.hf --materialize)" \
        --drafter runs/demo/train/drafter --depth 3 --api-key sk-x
    curl -s localhost:8000/health
    curl -s localhost:8000/v1/chat/completions -H 'Authorization: Bearer sk-x' -d \
        '{"model": "eagle3-ray", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'
    curl -s localhost:8000/metrics | grep spec_decode
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import sys
import time
import urllib.request

from eagle3_ray.engine import vllm as engine_vllm
from eagle3_ray.serve import validate

EXPORT_SUBDIR = "export-vllm"             # <drafter>/export-vllm
SOURCE_FILE = "eagle3_ray_source.json"    # in the export: sizes + sha256 of the drafter it came from
OPENAI_BUILDER = "ray.serve.llm:build_openai_app"
METRICS_BUILDER = "eagle3_ray.serve.vllm:metrics_app"
INGRESS_CLS = "eagle3_ray.serve.vllm_ingress:Eagle3Ingress"  # imported in the engine env only
METRICS_ROUTE = "/metrics"
DEPLOY_TIMEOUT_S = 1800.0                 # a Kimi-sized verifier loads for many minutes
CONSTRUCTOR_RETRIES = 3                   # Serve's default 20 restarts a broken engine for hours
HEALTH_CHECK_PERIOD_S = 2.0               # Serve's default 10: a dead engine core served errors ~30 s


# --- the drafter in vLLM's layout ---------------------------------------------------------------

def vllm_export_dir(cfg) -> str:
    """Where the drafter's vLLM export lives: <drafter>/export-vllm (absolute)."""
    if not cfg.drafter:
        raise ValueError("no drafter (cfg.drafter) to export for vLLM")
    return os.path.join(os.path.abspath(cfg.drafter), EXPORT_SUBDIR)


def _drafter_files(drafter: str) -> dict:
    """{file: {bytes, sha256}} of the drafter checkpoint, from its meta.json (also checks the
    checkpoint is complete; reads no weights)."""
    from eagle3_ray.train import checkpoint
    _, meta = checkpoint.read_drafter_config(drafter)
    return meta.get("files") or {}


def _read_source(out: str) -> dict | None:
    try:
        with open(os.path.join(out, SOURCE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ensure_vllm_export(cfg) -> str:
    """The vLLM export of cfg.drafter, written (checkpoint.export(..., "vllm")) when missing or
    made from other drafter weights than the ones now in cfg.drafter. Returns its path."""
    from eagle3_ray.train import checkpoint
    out = vllm_export_dir(cfg)
    source = {"files": _drafter_files(cfg.drafter)}
    if _read_source(out) == source and os.path.isfile(os.path.join(out, checkpoint.CONFIG)):
        return out
    # The verifier's dtype when it is local; else any: vLLM runs the draft in the target's dtype
    # (vllm/config/speculative.py builds the draft ModelConfig with the target's dtype).
    local = os.path.isfile(os.path.join(cfg.verifier, "config.json"))
    checkpoint.export(cfg.drafter, out, "vllm", verifier_path=cfg.verifier if local else None,
                      dtype=None if local else "bfloat16")
    # Written after the (atomic) export: a crash in between leaves no marker -> re-export.
    with open(os.path.join(out, SOURCE_FILE), "w") as f:
        json.dump(source, f, indent=2)
    return out


# --- LLMConfig ----------------------------------------------------------------------------------

def refuse_builtin_only(cfg) -> None:
    """Refuse the builtin engine's features vLLM does not have (its fixed depth)."""
    if cfg.dynamic_depth or cfg.simulate_interconnect:
        raise ValueError("dynamic_depth and simulate_interconnect are features of the builtin "
                         "engine; vLLM serves the fixed depth (num_speculative_tokens)")


def tensor_parallel_size(cfg) -> int:
    """vLLM tensor_parallel_size: the replica's GPUs (a fraction below 1 -> 1 worker)."""
    gpus = float(cfg.gpus_per_replica or 0)
    if gpus > 1 and gpus != int(gpus):
        raise ValueError(f"gpus_per_replica {gpus}: vLLM shards over whole GPUs; give an integer "
                         "(or a fraction below 1 to share one GPU)")
    return int(gpus) or 1


def _gpu_per_worker(cfg) -> float:
    gpus = float(cfg.gpus_per_replica or 0)
    return 1.0 if gpus >= 1 else gpus     # 0 < gpus < 1: one worker on a share of a GPU


def _replica_cpus(cfg) -> float:
    return float(cfg.cpus_per_replica if cfg.cpus_per_replica is not None else 1)


def engine_threads(cfg) -> int:
    """OpenMP threads of a CPU engine: cfg.torch_threads, else its Ray CPUs (at least 1)."""
    return int(cfg.torch_threads or max(1, round(_replica_cpus(cfg))))


def _max_replicas(cfg) -> int:
    return int(cfg.autoscaling.get("max_replicas", 1) if cfg.autoscaling else cfg.num_replicas)


def verifier_source(cfg) -> str:
    """model_source for vLLM: a local path made absolute (replicas run elsewhere); HF ids and
    URIs as given. Our "embedded:" verifiers are GGUF test models vLLM is not meant for."""
    v = cfg.verifier
    if v.startswith("embedded:"):
        raise ValueError(f"verifier {v!r}: engine vllm needs a Hugging Face id or a transformers "
                         "directory (--verifier); the embedded test model is for engine builtin")
    if "://" not in v and os.path.exists(v):
        return os.path.abspath(v)
    return v


def drafts_in_parallel(export_dir: str) -> bool:
    """Whether the vLLM export in `export_dir` is a parallel (P-EAGLE) drafter: its config.json
    says "parallel_drafting": true, and then must name the "mask_token_id" that fills the slots
    drafted in parallel (vLLM reads it from the draft config; the export's `mask_hidden` weight
    is the matching hidden state)."""
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("parallel_drafting") is not True:
        return False
    if not isinstance(config.get("mask_token_id"), int):
        raise ValueError(f"{export_dir}/config.json: parallel_drafting without an integer "
                         "mask_token_id, which vLLM needs to draft in parallel")
    return True


def drafts_in_blocks(export_dir: str) -> bool:
    """Whether the vLLM export in `export_dir` is a block (DFlash) drafter: its config.json
    names architecture DFlashDraftModel (checkpoint.block_config), which vLLM runs with method
    "dflash" only, and then must carry dflash_config's integer mask_token_id."""
    from eagle3_ray.train.checkpoint import BLOCK_ARCHITECTURE
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
    if BLOCK_ARCHITECTURE not in (config.get("architectures") or []):
        return False
    if not isinstance((config.get("dflash_config") or {}).get("mask_token_id"), int):
        raise ValueError(f"{export_dir}/config.json: a {BLOCK_ARCHITECTURE} without an integer "
                         "dflash_config.mask_token_id, which vLLM's dflash method feeds the "
                         "block's draft slots")
    return True


def check_cpu_drafter_layer(model_dir: str, export_dir: str, gpus: float = 0) -> None:
    """Refuse, before vLLM starts, a Llama-layer drafter for an MLA (DeepSeek / Kimi) verifier on
    vLLM's CPU build: its CPU MLA backend takes KV blocks of 16 tokens only, its CPU attention
    backend (the Llama layer's) multiples of 32, and one engine needs one block size for both
    ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])", vLLM 0.32).
    An MLA-layer drafter shares the target's backend; GPUs run either."""
    from eagle3_ray.engine import vllm as engine
    if gpus or not os.path.isdir(model_dir) or not engine.is_deepseek(model_dir):
        return
    from eagle3_ray.train.checkpoint import BLOCK_ARCHITECTURE
    with open(os.path.join(export_dir, "config.json")) as f:
        arch = (json.load(f).get("architectures") or [""])[0]
    if arch == BLOCK_ARCHITECTURE:   # qwen3_dflash.py: vLLM's Attention, the CPU_ATTN backend
        raise ValueError(f"{export_dir}: a block (DFlash) drafter for the MLA verifier "
                         f"{model_dir} on vLLM's CPU build: its layers use vLLM's CPU attention "
                         "backend (KV blocks in multiples of 32) and the verifier's CPU MLA "
                         "backend takes blocks of 16 only, so vLLM cannot start (\"No common "
                         "block size\"). Serve on GPUs (--gpus-per-replica), or use the builtin "
                         "engine")
    if arch == "LlamaForCausalLMEagle3":
        raise ValueError(f"{export_dir}: a Llama-layer drafter for the MLA verifier {model_dir} "
                         "on vLLM's CPU build: its CPU MLA backend (the verifier's) takes KV "
                         "blocks of 16 only and its CPU attention backend (the drafter's) "
                         "multiples of 32, so vLLM cannot start (\"No common block size\"). "
                         "Train an MLA-layer drafter (train --draft-layer mla), or serve on GPUs "
                         "(--gpus-per-replica); the builtin engine serves either")


def eagle3_speculative_config(export_dir: str, depth: int,
                              schedule: list | None = None) -> dict:
    """vLLM's speculative_config for our drafter export at `depth` (> 0) draft tokens, or, with
    `schedule` ([[batch from, batch to, k], ...], inclusive, the first from 1, each k <= depth:
    plan/load.py's depth_schedule), at up to `depth` with the k of each batch-size range:
    `num_speculative_tokens_per_batch_size` (vllm/v1/spec_decode/dynamic/utils.py validates it,
    the scheduler looks the k up per step; vLLM drops it under data parallelism).

    Key names from vLLM's SpeculativeConfig (vllm/config/speculative.py in
    github:vllm-project/vllm): `method` ("eagle3" is one of its EagleModelTypes), `model` (the
    draft model / eagle head dir), `num_speculative_tokens` (> 0), `parallel_drafting` (all
    `depth` drafts in one drafter forward; off unless asked, so it is added where the export is
    a parallel drafter). `draft_tensor_parallel_size` (1 or the target's TP) is left unset: vLLM
    then picks it. A block (DFlash) drafter's export (drafts_in_blocks) gets method "dflash":
    vLLM (config/speculative.py) then drafts in parallel by itself, `depth` mask slots after
    the bonus token in one drafter forward (v1/spec_decode/dflash.py), as the builtin engine's
    round at that depth does."""
    if drafts_in_blocks(export_dir):
        spec = {"method": "dflash", "model": export_dir, "num_speculative_tokens": int(depth)}
    else:
        spec = {"method": "eagle3", "model": export_dir, "num_speculative_tokens": int(depth)}
        if drafts_in_parallel(export_dir):
            spec["parallel_drafting"] = True
    if schedule:
        rows = [[int(a), int(b), int(k)] for a, b, k in schedule]
        if max(k for _, _, k in rows) != int(depth):
            raise ValueError(f"schedule {rows}: its largest k must be num_speculative_tokens "
                             f"({depth})")
        spec["num_speculative_tokens_per_batch_size"] = rows
    return spec


def speculative_config(cfg, drafter_dir: str | None) -> dict | None:
    """vLLM's speculative_config for our EAGLE-3 drafter's export `drafter_dir`
    (eagle3_speculative_config), None without drafter or at depth 0. cfg.depth_schedule
    (`--depth auto`: the planner's depth per batch-size range, cfg.depth its largest k) goes in
    as num_speculative_tokens_per_batch_size; a schedule of 0 everywhere has cfg.depth 0: no
    speculation."""
    if cfg.depth < 0:
        raise ValueError(f"depth {cfg.depth}: must be >= 0")
    if not drafter_dir or cfg.depth == 0:
        return None
    return eagle3_speculative_config(drafter_dir, cfg.depth,
                                     getattr(cfg, "depth_schedule", None))


def placement_group_config(cfg) -> dict:
    """GPUs: one bundle per tensor-parallel worker; no GPUs: one CPU bundle with the replica's
    CPUs. All on one node; the first also carries a sliver of the custom node resource (and,
    added by Ray, the replica actor's own resources)."""
    from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER  # 0.001: pins, never limits
    if cfg.gpus_per_replica:
        bundles = [{"GPU": _gpu_per_worker(cfg)} for _ in range(tensor_parallel_size(cfg))]
    else:
        bundles = [{"CPU": _replica_cpus(cfg)}]
    if cfg.node_resource:
        bundles[0][cfg.node_resource] = NODE_RESOURCE_SLIVER
    return {"bundles": bundles, "strategy": "STRICT_PACK"}


def deployment_config(cfg) -> dict:
    """Ray Serve options of the LLM deployment (ray.serve.llm passes them to @serve.deployment).
    On CPU the replica's CPUs are in its placement bundle, so the actor itself asks none."""
    d = {"max_ongoing_requests": cfg.max_ongoing_requests,
         "max_queued_requests": cfg.max_queued_requests,
         "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
         # LLMServer.check_health raises once vLLM's engine core is dead; Serve replaces the
         # replica after 3 failed checks: every 2 s instead of 10 (tests/serve/test_served_vllm.py)
         "health_check_period_s": HEALTH_CHECK_PERIOD_S,
         "ray_actor_options": {"num_cpus": _replica_cpus(cfg) if cfg.gpus_per_replica else 0}}
    if cfg.autoscaling:
        d["autoscaling_config"] = dict(cfg.autoscaling)
    else:
        d["num_replicas"] = cfg.num_replicas
    return d


def engine_kwargs(cfg, drafter_dir: str | None) -> dict:
    """vLLM's engine arguments: engine.vllm.engine_kwargs (dtype, eager, CPU KV space, sized
    to this host) + tensor_parallel_size, max_model_len, speculative_config."""
    source = verifier_source(cfg)
    kw = engine_vllm.engine_kwargs(model=source if os.path.isdir(source) else None,
                                   dtype=getattr(cfg, "dtype", None),
                                   gpus=float(cfg.gpus_per_replica or 0),
                                   max_model_len=cfg.max_model_len,
                                   enforce_eager=getattr(cfg, "eager", None),
                                   replicas=_max_replicas(cfg))
    kw["tensor_parallel_size"] = tensor_parallel_size(cfg)
    spec = speculative_config(cfg, drafter_dir)
    if spec:
        kw["speculative_config"] = spec
    return kw


def llm_config(cfg, drafter_dir: str | None) -> dict:
    """Keyword arguments of ray.serve.llm.LLMConfig for `cfg`, serving the vLLM export
    `drafter_dir` (None: plain decoding)."""
    refuse_builtin_only(cfg)
    gpus = float(cfg.gpus_per_replica or 0)
    return {
        "model_loading_config": {"model_id": cfg.model_name, "model_source": verifier_source(cfg)},
        "engine_kwargs": engine_kwargs(cfg, drafter_dir),
        "placement_group_config": placement_group_config(cfg),
        "deployment_config": deployment_config(cfg),
        # the replica and its engine: the engine python, OpenMP threads (CPU), ...
        "runtime_env": engine_vllm.runtime_env(engine_threads(cfg), in_process=False, gpus=gpus),
        "log_engine_metrics": True,                     # -> Ray metrics -> the /metrics app
    }


def ingress_cls_config(cfg, drafter_dir: str | None) -> dict:
    """LLMServingArgs.ingress_cls_config: Ray's OpenAI ingress subclassed (vllm_ingress.py) with
    the API key (its sha256 only: the Serve config is readable), /health, the body bound and
    the builtin's request checks; `depth` is the one vLLM serves (0 without speculation)."""
    depth = int(cfg.depth) if drafter_dir else 0
    return {"ingress_cls": INGRESS_CLS, "ingress_extra_kwargs": {
        "model_name": cfg.model_name, "depth": depth,
        "api_key_sha256": validate.key_digest(cfg.api_key) if cfg.api_key else None,
        "max_request_bytes": int(getattr(cfg, "max_request_bytes",
                                         validate.DEFAULT_MAX_REQUEST_BYTES)),
        "max_model_len": cfg.max_model_len, "tokenizer": verifier_source(cfg)}}


def serving_args(cfg, drafter_dir: str | None) -> dict:
    """The argument of ray.serve.llm.build_openai_app (an LLMServingArgs dict): our one model,
    our ingress class (ingress_cls_config), and the OpenAI ingress asking no CPU (it only
    relays; Ray's own LLM router does the same), so a small CPU cluster keeps its CPUs for the
    engine."""
    return {"llm_configs": [llm_config(cfg, drafter_dir)],
            "ingress_cls_config": ingress_cls_config(cfg, drafter_dir),
            "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}


def prepare(cfg) -> str | None:
    """Driver-side checks and the drafter's export -> its path (None: plain decoding)."""
    refuse_builtin_only(cfg)
    if cfg.depth and not cfg.drafter:
        raise ValueError(f"depth {cfg.depth} needs a drafter (--drafter), or use depth 0")
    verifier_source(cfg)                  # refuses an embedded verifier before any work
    if not (cfg.drafter and cfg.depth):
        return None
    _check_drafter_fits(cfg)
    export = ensure_vllm_export(cfg)
    check_cpu_drafter_layer(verifier_source(cfg), export, float(cfg.gpus_per_replica or 0))
    return export


def app_configs(cfg, name: str = "eagle3") -> list[dict]:
    """The two Serve applications (ServeApplicationSchema dicts) of `cfg`: the OpenAI app at "/"
    and vLLM's metrics at /metrics, both run by the engine python (module docstring)."""
    engine_vllm.engine_python()           # no engine environment: say how to make one, now
    args = serving_args(cfg, prepare(cfg))
    python = args["llm_configs"][0]["runtime_env"]["py_executable"]
    return [
        {"name": name, "route_prefix": "/", "import_path": OPENAI_BUILDER, "args": args,
         "runtime_env": {"py_executable": python}},
        {"name": f"{name}-metrics", "route_prefix": METRICS_ROUTE, "import_path": METRICS_BUILDER,
         "args": {"model_name": cfg.model_name, "depth": int(cfg.depth if cfg.drafter else 0),
                  "scheduled": bool(cfg.drafter and getattr(cfg, "depth_schedule", None))},
         "runtime_env": {"py_executable": python}},
    ]


# --- deploying ----------------------------------------------------------------------------------

def deploy(cfg, name: str = "eagle3", timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Deploy `cfg` on the running Serve instance (serve.start first) as declarative apps, the
    way `serve run/deploy config.yaml` does (the controller client's deploy_apps), and wait
    until they run. Declarative apps of others on the cluster are kept; ours are replaced."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    ours = app_configs(cfg, name)
    client = _get_global_client()
    names = {a["name"] for a in ours}
    kept = [a["deployed_app_config"] for n, a in
            (client.get_serve_details().get("applications") or {}).items()
            if n not in names and a.get("source") == "declarative" and a.get("deployed_app_config")]
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": kept + ours}))
    wait_running(sorted(names), timeout_s)


def wait_running(names: list[str], timeout_s: float) -> None:
    """Until every app in `names` is RUNNING; raises with Serve's message if one fails."""
    from ray import serve
    t0, said = time.monotonic(), 0.0
    while True:
        apps = serve.status().applications
        states = {n: apps[n] if n in apps else None for n in names}
        if all(s is not None and s.status == "RUNNING" for s in states.values()):
            return
        for n, s in states.items():
            if s is not None and s.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                why = "; ".join(f"{d}: {v.message}" for d, v in s.deployments.items() if v.message)
                raise RuntimeError(f"Serve app {n!r} {s.status}: {s.message or why}")
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise TimeoutError(f"Serve apps {names} not running after {timeout_s:.0f}s: "
                               + ", ".join(f"{n} {s.status if s else 'NOT_STARTED'}"
                                           for n, s in states.items()))
        if waited - said >= 30:
            said = waited
            notes = [f"{d}: {v.message[:300]}" for s in states.values() if s is not None
                     for d, v in s.deployments.items() if v.message]
            print(f"[serve] waiting for the vLLM app ({waited:.0f}s): "
                  + ", ".join(f"{n} {s.status if s else 'NOT_STARTED'}" for n, s in states.items())
                  + "".join(f"\n  {x}" for x in notes), flush=True)
        time.sleep(1.0)


# --- /metrics: vLLM's engine counters -------------------------------------------------------------

_SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
RAY_PREFIX = "ray_vllm_"                  # vLLM's Ray metrics as Ray's agent exports them
DROP_LABELS = ("otel_scope_name", "otel_scope_schema_url", "otel_scope_version")


def vllm_metrics_text(texts: list[str], model_name: str | None, depth: int,
                      scheduled: bool = False) -> str:
    """Prometheus text of Ray's metrics endpoints -> vLLM's series under vLLM's own names
    (ray_vllm_x -> vllm:x, Ray's otel labels dropped), then eagle3_ray_* summaries of the
    spec-decode counters of `model_name` (the builtin engine's names: rounds, drafted and
    accepted tokens, per position, acceptance length), summed over replicas. At a fixed depth
    every round drafts every position; under a depth schedule (`scheduled`) vLLM does not count
    drafts per position, so positions past 0 are given only while the counters determine them
    (every round drafted `depth`: drafted tokens = depth x rounds)."""
    out, typed = [], set()
    drafts = draft_tokens = accepted = 0.0
    per_pos: dict[int, float] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# "):                        # "# HELP name ..." / "# TYPE name"
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[2].startswith(RAY_PREFIX):
                    name = "vllm:" + parts[2][len(RAY_PREFIX):]
                    if (parts[1], name) not in typed:
                        typed.add((parts[1], name))
                        out.append(" ".join([parts[0], parts[1], name] + parts[3:]))
                continue
            m = _SAMPLE.match(line)
            if not m or not m["name"].startswith(RAY_PREFIX):
                continue
            name = "vllm:" + m["name"][len(RAY_PREFIX):]
            labels = dict(_LABEL.findall(m["labels"] or ""))
            keep = ",".join(f'{k}="{v}"' for k, v in labels.items() if k not in DROP_LABELS)
            out.append(f"{name}{{{keep}}} {m['value']}")
            if model_name and labels.get("model_name") != model_name:
                continue
            value = float(m["value"])
            if name == "vllm:spec_decode_num_drafts_total":
                drafts += value
            elif name == "vllm:spec_decode_num_draft_tokens_total":
                draft_tokens += value
            elif name == "vllm:spec_decode_num_accepted_tokens_total":
                accepted += value
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                k = int(labels.get("position", -1))
                per_pos[k] = per_pos.get(k, 0.0) + value
    p = "eagle3_ray_"
    out += [f"# HELP {p}rounds_total verify rounds with drafts (vLLM's spec_decode_num_drafts)",
            f"# TYPE {p}rounds_total counter", f"{p}rounds_total {drafts:g}",
            f"# TYPE {p}drafted_tokens_total counter", f"{p}drafted_tokens_total {draft_tokens:g}",
            f"# TYPE {p}accepted_tokens_total counter", f"{p}accepted_tokens_total {accepted:g}",
            f"# HELP {p}acceptance_length mean tokens per verify round",
            f"# TYPE {p}acceptance_length gauge",
            f"{p}acceptance_length {(accepted + drafts) / max(1.0, drafts):.6f}"]
    if drafts:
        width = max([depth] + [k + 1 for k in per_pos])
        if scheduled and draft_tokens != depth * drafts:
            width = 1                                     # rounds of several depths: unknown
        out += [f"# TYPE {p}drafted_at_position_total counter"]
        out += [f'{p}drafted_at_position_total{{position="{k}"}} {drafts:g}' for k in range(width)]
        out += [f"# TYPE {p}accepted_at_position_total counter"]
        out += [f'{p}accepted_at_position_total{{position="{k}"}} {per_pos.get(k, 0.0):g}'
                for k in range(width)]
    return "\n".join(out) + "\n"


def _metrics_urls() -> list[str]:
    import ray
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")]


def _fetch(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode("utf-8", "replace")
    except OSError:
        return ""                         # a node going away: its series drop out


def metrics_app(args: dict):
    """Serve app builder (import path eagle3_ray.serve.vllm:metrics_app; args: model_name,
    depth, scheduled): GET -> `vllm_metrics_text` over every alive node's Ray metrics
    endpoint."""
    from ray import serve
    from starlette.responses import PlainTextResponse

    @serve.deployment(name="VllmMetrics", ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=16)
    class VllmMetrics:
        def __init__(self, model_name: str | None, depth: int, scheduled: bool):
            self.model_name, self.depth, self.scheduled = model_name, int(depth), scheduled

        async def __call__(self, request) -> PlainTextResponse:
            urls = await asyncio.to_thread(_metrics_urls)
            texts = await asyncio.gather(*(asyncio.to_thread(_fetch, u) for u in urls))
            return PlainTextResponse(vllm_metrics_text(list(texts), self.model_name, self.depth,
                                                       self.scheduled),
                                     media_type="text/plain; version=0.0.4")

    return VllmMetrics.bind(args.get("model_name"), int(args.get("depth") or 0),
                            bool(args.get("scheduled")))


# --- the application, built in-process ------------------------------------------------------------

def _check_drafter_fits(cfg) -> None:
    """Refuse a drafter that does not fit a local verifier now, not in a replica."""
    if not os.path.isfile(os.path.join(cfg.verifier, "config.json")):
        return                            # an HF id or URI: vLLM checks it when it loads
    from eagle3_ray.engine import hf as verifier_lib
    from eagle3_ray.train import checkpoint
    checkpoint.check_drafter(cfg.drafter, verifier_lib.load_config(cfg.verifier), cfg.verifier)


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            f"vLLM is not installed in this python ({sys.executable}): engine \"vllm\" builds "
            "ray.serve.llm's app only in vLLM's environment. `eagle3-ray serve --engine vllm` "
            "deploys it there itself (runtime_env py_executable); a Serve config needs "
            f"runtime_env: {{py_executable: <.venv-vllm/bin/python>}}. Set that environment up "
            "with `bash scripts/setup_vllm.sh` (vllm, or pip install \"ray[llm]\" on GPUs); the "
            "builtin engine (--engine builtin) needs nothing extra")


def build_vllm_app(cfg):
    """The OpenAI Serve application (/v1/chat/completions, /v1/completions, /v1/models) over
    one vLLM deployment with the EAGLE-3 drafter, built in this process: for a Serve config
    run by the engine python (`deploy` is the driver's way, and adds /metrics)."""
    refuse_builtin_only(cfg)
    if cfg.depth and not cfg.drafter:
        raise ValueError(f"depth {cfg.depth} needs a drafter (--drafter), or use depth 0")
    _require_vllm()                       # before any work: fail fast on a machine without it
    try:
        from ray.serve.llm import build_openai_app
    except ImportError as e:
        raise RuntimeError(f"ray.serve.llm does not import ({e}): engine \"vllm\" needs vLLM "
                           '(pip install "ray[llm]"); the builtin engine needs nothing extra') from e
    # build_openai_app(llm_serving_args: dict), a dict of LLMServingArgs (ray/serve/llm/__init__.py)
    return build_openai_app(serving_args(cfg, prepare(cfg)))
