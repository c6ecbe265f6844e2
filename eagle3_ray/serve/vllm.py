"""The production engine of the serving stage: the verifier + our EAGLE-3 drafter on vLLM, behind
ray.serve.llm's OpenAI-compatible app (`engine="vllm"` in serve.ServeConfig).

What it does:
  1. exports the trained drafter once into the layout vLLM loads ("LlamaForCausalLMEagle3":
     model.safetensors + config.json), in <drafter>/export-vllm, redone when the drafter changes;
  2. turns the serve config into the keyword arguments of `ray.serve.llm.LLMConfig`
     (`llm_config`, a plain dict, testable without vLLM);
  3. builds the Serve application with `ray.serve.llm.build_openai_app` (`build_vllm_app`).
     vLLM is imported only here, only when this engine is chosen; without it a RuntimeError says
     what to install. The builtin engine needs nothing extra.

Mapping (Ray 2.60, read in ray/llm/_internal/serve/..., no code taken):
  - cfg.verifier -> model_loading_config.model_source (HF id, local dir or s3:// / gs:// URI);
    cfg.model_name -> model_loading_config.model_id (the OpenAI "model" clients send).
  - engine_kwargs go to vLLM as-is (engines/vllm/vllm_models.py, VLLMEngineConfig
    .from_llm_config splits them over vLLM's AsyncEngineArgs / FrontendArgs and rejects any
    other key): tensor_parallel_size, max_model_len, speculative_config.
  - placement_group_config {"bundles": [...], "strategy": ...} (LLMConfig field, validated by
    ray/llm/_internal/common/placement.py PlacementGroupConfig; BundleConfig allows extra keys
    for custom resources): one {"GPU": 1} bundle per tensor-parallel worker; the first one also
    asks for a sliver (0.001) of cfg.node_resource. STRICT_PACK puts every bundle on that one
    node, so the whole replica lands on the PCIe node and TP all-reduces never cross nodes.
    LLMServer.get_deployment_options (core/server/llm_server.py) adds the replica actor's own
    resources (deployment_config.ray_actor_options: num_cpus) to the first bundle and hands
    the bundles to Serve; Serve refuses placement_group_bundles in deployment_config itself.
  - deployment_config: max_ongoing_requests, max_queued_requests (overflow -> 503),
    autoscaling_config or num_replicas, ray_actor_options.num_cpus = cfg.cpus_per_replica.
  - cfg.request_timeout_s is a proxy setting (serve.start http_options), set by serve.start.

The drafter directory must be readable at the same path on the GPU node (shared storage), as
the verifier must: vLLM loads both there.

API key: not supported with this engine. Ray 2.60's OpenAI ingress
(ray/llm/_internal/serve/core/ingress/ingress.py, OpenAiIngress) has no authentication, and
vLLM's own `api_key` frontend argument only guards vLLM's own FastAPI app, which Ray uses only on
its opt-in direct-streaming path (RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1; not tried here).
Rather than serve without the check the user asked for, `llm_config` refuses cfg.api_key (note:
ServeConfig reads EAGLE3_RAY_API_KEY by default): put an authenticating gateway in front, or
use the builtin engine, which checks the key itself.

CPU-sized command (vLLM not needed; prints what would be deployed):

    python -c "from eagle3_ray.serve.app import ServeConfig; from eagle3_ray.serve import vllm; \
cfg = ServeConfig(verifier='meta-llama/Llama-3.1-8B-Instruct', drafter='runs/demo/train/drafter', \
engine='vllm', depth=4, gpus_per_replica=4, node_resource='pcie_node', api_key=None); \
print(vllm.llm_config(cfg, vllm.ensure_vllm_export(cfg)))"
"""
from __future__ import annotations

import importlib.util
import json
import os

from eagle3_ray.train import checkpoint
from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER  # 0.001: pins, never limits

EXPORT_SUBDIR = "export-vllm"             # <drafter>/export-vllm
SOURCE_FILE = "eagle3_ray_source.json"    # in the export: sizes + sha256 of the drafter it came from


# --- the drafter in vLLM's layout ---------------------------------------------------------------

def vllm_export_dir(cfg) -> str:
    """Where the drafter's vLLM export lives: <drafter>/export-vllm (absolute)."""
    if not cfg.drafter:
        raise ValueError("no drafter (cfg.drafter) to export for vLLM")
    return os.path.join(os.path.abspath(cfg.drafter), EXPORT_SUBDIR)


def _drafter_files(drafter: str) -> dict:
    """{file: {bytes, sha256}} of the drafter checkpoint, from its meta.json (also checks the
    checkpoint is complete; reads no weights)."""
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

def refuse_api_key(cfg) -> None:
    """No API key check exists in ray.serve.llm's OpenAI app (module docstring): refuse one."""
    if cfg.api_key:
        raise ValueError(
            "api_key is set (cfg.api_key or EAGLE3_RAY_API_KEY), but ray.serve.llm's OpenAI app "
            "(Ray 2.60) checks no API key: refusing to serve without it. Put an authenticating "
            "gateway in front and unset the key, or use --engine builtin")
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


def speculative_config(cfg, drafter_dir: str | None) -> dict | None:
    """vLLM's speculative_config for our EAGLE-3 drafter, None without drafter or at depth 0.

    Key names from vLLM's SpeculativeConfig (vllm/config/speculative.py in
    github:vllm-project/vllm): `method` ("eagle3" is one of its EagleModelTypes), `model` (the
    draft model / eagle head dir), `num_speculative_tokens` (> 0). `draft_tensor_parallel_size`
    (1 or the target's TP) is left unset: vLLM then picks it."""
    if cfg.depth < 0:
        raise ValueError(f"depth {cfg.depth}: must be >= 0")
    if not drafter_dir or cfg.depth == 0:
        return None
    return {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": int(cfg.depth)}


def placement_group_config(cfg) -> dict:
    """One bundle per tensor-parallel worker, all on one node; the first also carries a sliver
    of the custom node resource (and, added by Ray, the replica actor's CPUs)."""
    bundles = [{"GPU": _gpu_per_worker(cfg)} for _ in range(tensor_parallel_size(cfg))]
    if cfg.node_resource:
        bundles[0][cfg.node_resource] = NODE_RESOURCE_SLIVER
    return {"bundles": bundles, "strategy": "STRICT_PACK"}


def deployment_config(cfg) -> dict:
    """Ray Serve options of the LLM deployment (ray.serve.llm passes them to @serve.deployment)."""
    d = {"max_ongoing_requests": cfg.max_ongoing_requests,
         "max_queued_requests": cfg.max_queued_requests,
         "ray_actor_options": {"num_cpus": cfg.cpus_per_replica}}
    if cfg.autoscaling:
        d["autoscaling_config"] = dict(cfg.autoscaling)
    else:
        d["num_replicas"] = cfg.num_replicas
    return d


def llm_config(cfg, drafter_dir: str | None) -> dict:
    """Keyword arguments of ray.serve.llm.LLMConfig for `cfg`, serving the vLLM export
    `drafter_dir` (None: plain decoding). Refuses cfg.api_key (see the module docstring)."""
    refuse_api_key(cfg)
    engine_kwargs = {"tensor_parallel_size": tensor_parallel_size(cfg)}
    if cfg.max_model_len:
        engine_kwargs["max_model_len"] = int(cfg.max_model_len)
    spec = speculative_config(cfg, drafter_dir)
    if spec:
        engine_kwargs["speculative_config"] = spec
    return {
        "model_loading_config": {"model_id": cfg.model_name, "model_source": verifier_source(cfg)},
        "engine_kwargs": engine_kwargs,
        "placement_group_config": placement_group_config(cfg),
        "deployment_config": deployment_config(cfg),
    }


# --- the application ----------------------------------------------------------------------------

def _check_drafter_fits(cfg) -> None:
    """Refuse a drafter that does not fit a local verifier now, not in a GPU replica."""
    if not os.path.isfile(os.path.join(cfg.verifier, "config.json")):
        return                            # an HF id or URI: vLLM checks it when it loads
    from eagle3_ray.engine import hf as verifier_lib
    checkpoint.check_drafter(cfg.drafter, verifier_lib.load_config(cfg.verifier), cfg.verifier)


def _require_vllm() -> None:
    hint = ('engine "vllm" needs vLLM: pip install "ray[llm]" (or vllm) on every node that '
            'runs a replica; the builtin engine (--engine builtin) needs nothing extra')
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"vLLM is not installed: {hint}")


def build_vllm_app(cfg):
    """The Serve application: ray.serve.llm's OpenAI app (/v1/chat/completions, /v1/completions,
    /v1/models) over one vLLM deployment with the EAGLE-3 drafter."""
    refuse_api_key(cfg)
    if cfg.depth and not cfg.drafter:
        raise ValueError(f"depth {cfg.depth} needs a drafter (--drafter), or use depth 0")
    _require_vllm()                       # before any work: fail fast on a machine without it
    drafter_dir = None
    if cfg.drafter and cfg.depth:
        _check_drafter_fits(cfg)
        drafter_dir = ensure_vllm_export(cfg)
    kwargs = llm_config(cfg, drafter_dir)
    try:
        from ray.serve.llm import LLMConfig, build_openai_app
    except ImportError as e:
        raise RuntimeError(f"ray.serve.llm does not import ({e}): engine \"vllm\" needs vLLM "
                           '(pip install "ray[llm]"); the builtin engine needs nothing extra') from e
    # build_openai_app(llm_serving_args: dict), a dict of LLMServingArgs (ray/serve/llm/__init__.py)
    return build_openai_app({"llm_configs": [LLMConfig(**kwargs)]})
