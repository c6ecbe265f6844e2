"""The vLLM engine option of serving (serve/vllm.py).

Unit tests (no vLLM needed): a real drafter checkpoint is exported to vLLM's layout and turned
into ray.serve.llm LLMConfig arguments, validated by Ray's own pydantic models: in the project's
environment (.venv, no vLLM) the public `ray.serve.llm.LLMConfig` does not import (Ray 2.60's
builder imports vLLM's OpenAI protocol models), but it is `pass` over
ray.llm._internal.serve.core.configs.llm_config.LLMConfig, which does; the Serve application
configs go through ServeDeploySchema; the /metrics rendering runs on captured Ray exposition
text.
The real run (the app served by vLLM's CPU build, its faults): test_served_vllm.py.
"""
import importlib.util
import json
import os
import sys
import types

import numpy as np
import pytest
import torch

from eagle3_ray.engine import vllm as engine_vllm
from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER
from eagle3_ray.serve import vllm as serve_vllm
from eagle3_ray.train import checkpoint, vocab
from eagle3_ray.train.draft import DraftConfig

AUX = [2, 4, 5]                           # (2, L//2, L-3) for L = 8, vLLM convention

try:
    from eagle3_ray.serve.app import ServeConfig
except Exception:                         # serve/app.py absent or broken: a stand-in
    ServeConfig = None

DEFAULTS = dict(verifier="", drafter=None, model_name="eagle3-ray", depth=4, max_depth=16,
                engine="vllm", gpus_per_replica=0, cpus_per_replica=1.0, node_resource=None,
                num_replicas=1, autoscaling=None, max_ongoing_requests=4, max_queued_requests=16,
                request_timeout_s=300.0, api_key=None, max_model_len=None,
                dynamic_depth=False, profile=None, simulate_interconnect=None, torch_threads=0,
                dtype=None, eager=None)


def make_cfg(**kw):
    fields = dict(DEFAULTS, **kw)
    if ServeConfig is not None:
        return ServeConfig(**fields)
    return types.SimpleNamespace(**fields)


@pytest.fixture
def engine_python(monkeypatch):
    """The engine environment's python as this one (the configs only name it)."""
    monkeypatch.setenv("EAGLE3_RAY_VLLM_PYTHON", sys.executable)
    return sys.executable


def validated_llm_config(kwargs: dict):
    """LLMConfig(**kwargs) with Ray's real validation, or a skip saying why it cannot run."""
    try:
        from ray.serve.llm import LLMConfig
    except ImportError:                   # expected without vLLM: use the class it subclasses
        try:
            from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
        except ImportError as e:
            pytest.skip(f"neither ray.serve.llm.LLMConfig nor its base imports here: {e}")
    return LLMConfig(**kwargs)


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory):
    from transformers import LlamaConfig
    d = tmp_path_factory.mktemp("verifier")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=2048,
                tie_word_embeddings=False).save_pretrained(d)
    return str(d)


def save_tiny_drafter(directory: str, verifier: str, seed: int = 0, draft_vocab: int = 40) -> str:
    from transformers import AutoConfig
    cfg = DraftConfig.from_verifier_config(AutoConfig.from_pretrained(verifier),
                                           draft_vocab_size=draft_vocab, aux_layer_ids=AUX)
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g).to(torch.bfloat16)
             for k, (shape, dt) in checkpoint.expected_shapes(cfg).items() if dt is None}
    counts = np.random.default_rng(seed).integers(0, 50, cfg.vocab_size)
    state["d2t"], state["t2d"] = vocab.build_mapping(counts, cfg.draft_vocab_size)
    return checkpoint.save_drafter(directory, state, cfg, {"ttt_steps": 8})


@pytest.fixture
def drafter_dir(tmp_path, verifier_dir):
    return save_tiny_drafter(str(tmp_path / "drafter"), verifier_dir)


def test_real_export_to_llm_config(drafter_dir, verifier_dir, engine_python):
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, model_name="kimi-eagle3", depth=12,
                   gpus_per_replica=4, cpus_per_replica=2, node_resource="pcie_node",
                   num_replicas=5, autoscaling=autoscaling, max_ongoing_requests=8,
                   max_queued_requests=32, max_model_len=4096)

    out = serve_vllm.ensure_vllm_export(cfg)
    assert out == serve_vllm.vllm_export_dir(cfg) == os.path.join(drafter_dir, "export-vllm")
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"]
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    checkpoint.read_drafter_config(drafter_dir)          # the checkpoint itself is untouched

    kw = serve_vllm.llm_config(cfg, out)
    assert kw["model_loading_config"] == {"model_id": "kimi-eagle3", "model_source": verifier_dir}
    eng = kw["engine_kwargs"]
    assert eng["speculative_config"] == {"method": "eagle3", "model": out,
                                         "num_speculative_tokens": cfg.depth}
    assert eng["tensor_parallel_size"] == 4 and eng["max_model_len"] == 4096
    assert eng["dtype"] == "bfloat16" and eng["enforce_eager"] is False   # GPUs: bf16, graphs
    assert "kv_cache_memory_bytes" not in eng                             # vLLM sizes it
    pg = kw["placement_group_config"]
    assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 4
    assert all(b["GPU"] == 1 and "CPU" not in b for b in pg["bundles"])
    assert pg["bundles"][0]["pcie_node"] > 0                       # pinned to the PCIe node
    assert not any("pcie_node" in b for b in pg["bundles"][1:])    # STRICT_PACK keeps the rest
    dep = kw["deployment_config"]
    assert dep["max_ongoing_requests"] == 8 and dep["max_queued_requests"] == 32
    assert dep["autoscaling_config"] == autoscaling and "num_replicas" not in dep
    assert dep["ray_actor_options"] == {"num_cpus": 2} and dep["max_constructor_retry_count"] == 3
    assert kw["runtime_env"]["py_executable"] == engine_python     # the engine environment
    assert "OMP_NUM_THREADS" not in kw["runtime_env"]["env_vars"]  # GPUs: no CPU threads set
    assert kw["log_engine_metrics"] is True

    llm = validated_llm_config(kw)                # Ray's own pydantic validation
    assert llm.model_id == "kimi-eagle3" and llm.max_request_context_length == 4096
    assert llm.engine_kwargs["speculative_config"]["method"] == "eagle3"
    assert llm.accelerator_config.kind == "gpu"   # inferred from the GPU bundles
    assert llm.deployment_config["max_queued_requests"] == 32
    from ray.llm._internal.common.placement import PlacementGroupConfig   # what vLLM's config runs
    assert PlacementGroupConfig(**llm.placement_group_config).bundles[0].model_extra == \
        {"pcie_node": NODE_RESOURCE_SLIVER}


def test_cpu_replica_asks_cpus_only(verifier_dir, engine_python):
    """No GPUs: one CPU bundle with the replica's CPUs (the actor asks none besides), vLLM's
    CPU settings from engine.vllm, and Ray's CPU backend chosen from the bundles."""
    cfg = make_cfg(verifier=verifier_dir, depth=0, cpus_per_replica=1.5, node_resource="cpu_node",
                   num_replicas=2, dtype="fp32", eager=True)
    kw = serve_vllm.llm_config(cfg, None)
    assert kw["placement_group_config"] == {"bundles": [{"CPU": 1.5, "cpu_node": 0.001}],
                                            "strategy": "STRICT_PACK"}
    assert kw["deployment_config"]["ray_actor_options"] == {"num_cpus": 0}
    eng = kw["engine_kwargs"]
    assert eng["dtype"] == "float32" and eng["enforce_eager"] is True
    assert eng["tensor_parallel_size"] == 1
    assert eng["kv_cache_memory_bytes"] == engine_vllm.kv_cache_bytes(2)   # shared by 2 replicas
    env = kw["runtime_env"]["env_vars"]
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"      # AsyncLLM's engine core process
    host = make_cfg(verifier=verifier_dir, depth=0, torch_threads=3)
    assert serve_vllm.llm_config(host, None)["engine_kwargs"]["dtype"] == \
        engine_vllm.engine_dtype(None)                        # the host's: bf16 only if native
    assert serve_vllm.llm_config(host, None)["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "3"
    llm = validated_llm_config(kw)
    assert llm.accelerator_config.kind == "cpu"   # no GPU key: Ray Serve LLM's CPU backend


def test_serve_apps_run_in_the_engine_environment(drafter_dir, verifier_dir, engine_python):
    """`deploy`'s two declarative apps, checked by Serve's own schema: both built and run by the
    engine python, the OpenAI one from Ray's own builder with plain-data args."""
    from ray.serve.schema import ServeDeploySchema
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, model_name="m", depth=3)
    apps = serve_vllm.app_configs(cfg, "x")
    assert os.path.isdir(serve_vllm.vllm_export_dir(cfg))          # exported by the driver
    schema = ServeDeploySchema.model_validate({"applications": apps})
    llm_app, metrics_app = schema.applications
    assert (llm_app.name, llm_app.route_prefix, llm_app.import_path) == \
        ("x", "/", "ray.serve.llm:build_openai_app")
    assert (metrics_app.name, metrics_app.route_prefix, metrics_app.import_path) == \
        ("x-metrics", "/metrics", "eagle3_ray.serve.vllm:metrics_app")
    assert llm_app.runtime_env == metrics_app.runtime_env == {"py_executable": engine_python}
    args = json.loads(json.dumps(llm_app.args))                   # plain data
    assert args["ingress_deployment_config"] == {"ray_actor_options": {"num_cpus": 0}}
    assert args["ingress_cls_config"]["ingress_cls"] == serve_vllm.INGRESS_CLS
    (llm,) = args["llm_configs"]
    assert llm["engine_kwargs"]["speculative_config"]["model"] == serve_vllm.vllm_export_dir(cfg)
    assert metrics_app.args == {"model_name": "m", "depth": 3, "scheduled": False}
    try:                                          # Ray's own args model, where it imports
        from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs
    except ImportError:
        return
    assert LLMServingArgs.model_validate(args).llm_configs[0].model_id == "m"


# Ray's Prometheus text as its metrics agent exports vLLM's Ray metrics (shape of a real scrape).
RAY_TEXT = """# HELP ray_vllm_spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE ray_vllm_spec_decode_num_drafts_total counter
ray_vllm_spec_decode_num_drafts_total{Component="core_worker",ReplicaId="r1",engine="0",model_name="m",otel_scope_name="x"} 10.0
ray_vllm_spec_decode_num_drafts_total{Component="core_worker",ReplicaId="r2",engine="0",model_name="other"} 99.0
# TYPE ray_vllm_spec_decode_num_draft_tokens_total counter
ray_vllm_spec_decode_num_draft_tokens_total{ReplicaId="r1",engine="0",model_name="m"} 30.0
# TYPE ray_vllm_spec_decode_num_accepted_tokens_total counter
ray_vllm_spec_decode_num_accepted_tokens_total{ReplicaId="r1",engine="0",model_name="m"} 15.0
# TYPE ray_vllm_spec_decode_num_accepted_tokens_per_pos_total counter
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="r1",engine="0",model_name="m",position="0"} 8.0
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="r1",engine="0",model_name="m",position="1"} 5.0
ray_vllm_spec_decode_num_accepted_tokens_per_pos_total{ReplicaId="r1",engine="0",model_name="m",position="2"} 2.0
# TYPE ray_node_cpu_count gauge
ray_node_cpu_count{ip="1.2.3.4"} 2.0
"""


def test_metrics_text_renames_vllm_series_and_sums_per_position():
    from eagle3_ray.plan import planner
    second = RAY_TEXT.replace('"r1"', '"r3"')                     # a second node's replica
    text = serve_vllm.vllm_metrics_text([RAY_TEXT, second, ""], "m", 3)
    m = planner.parse_metrics(text)
    assert m['vllm:spec_decode_num_drafts_total{Component="core_worker",ReplicaId="r1",'
             'engine="0",model_name="m"}'] == 10                 # vLLM's name, otel labels gone
    assert not any(k.startswith(("ray_", "vllm:node")) for k in m)          # Ray's own: out
    assert text.count("# TYPE vllm:spec_decode_num_drafts_total counter") == 1
    assert m["eagle3_ray_rounds_total"] == 20 and m["eagle3_ray_accepted_tokens_total"] == 30
    assert m["eagle3_ray_drafted_tokens_total"] == 60
    assert m["eagle3_ray_acceptance_length"] == pytest.approx((30 + 20) / 20)
    assert [m[f'eagle3_ray_drafted_at_position_total{{position="{k}"}}'] for k in range(3)] == \
        [20, 20, 20]
    assert [m[f'eagle3_ray_accepted_at_position_total{{position="{k}"}}'] for k in range(3)] == \
        [16, 10, 4]
    cond, known, _ = planner._from_metrics_text(text, "test")     # what `plan` reads
    assert known == 3 and cond == pytest.approx([16 / 20, 10 / 16, 4 / 10])
    assert "eagle3_ray_drafted_at_position_total" not in serve_vllm.vllm_metrics_text([], "m", 3)
    # under a depth schedule: the same while every round drafted 3 (60 = 3 x 20 tokens) ...
    assert planner.parse_metrics(serve_vllm.vllm_metrics_text(
        [RAY_TEXT, second], "m", 3, scheduled=True)) == m
    # ... but once some rounds drafted fewer (24 tokens in 10 rounds), positions past 0 are
    # not known (vLLM does not count drafts per position): not claimed
    fewer = RAY_TEXT.replace('model_name="m"} 30.0', 'model_name="m"} 24.0')
    m = planner.parse_metrics(serve_vllm.vllm_metrics_text([fewer], "m", 3, scheduled=True))
    assert m['eagle3_ray_drafted_at_position_total{position="0"}'] == 10
    assert 'eagle3_ray_drafted_at_position_total{position="1"}' not in m
    assert planner._from_metrics_text(serve_vllm.vllm_metrics_text(
        [fewer], "m", 3, scheduled=True), "test")[1] == 1                # one position known


def test_plain_decoding_and_small_replicas(verifier_dir, engine_python):
    cfg = make_cfg(verifier=verifier_dir, depth=0, gpus_per_replica=0.5, num_replicas=3)
    kw = serve_vllm.llm_config(cfg, None)
    assert "speculative_config" not in kw["engine_kwargs"]
    assert "max_model_len" not in kw["engine_kwargs"]
    assert kw["engine_kwargs"]["tensor_parallel_size"] == 1
    assert kw["placement_group_config"]["bundles"] == [{"GPU": 0.5}]   # no node resource asked
    assert kw["deployment_config"]["num_replicas"] == 3
    assert "autoscaling_config" not in kw["deployment_config"]
    validated_llm_config(kw)
    # a drafter given but depth 0: still no speculation
    assert "speculative_config" not in serve_vllm.llm_config(cfg, "/some/export")["engine_kwargs"]


def write_export_config(directory, **fields) -> str:
    """An export directory holding only a config.json (what the P-EAGLE check reads)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLMEagle3"], **fields}, f)
    return str(directory)


def test_a_parallel_drafter_export_asks_vllm_for_parallel_drafting(tmp_path, verifier_dir,
                                                                   engine_python):
    """A P-EAGLE export's config.json carries parallel_drafting and mask_token_id: vLLM drafts
    in parallel only when speculative_config asks too, so ours does; a plain export does not."""
    plain = write_export_config(tmp_path / "plain")
    parallel = write_export_config(tmp_path / "parallel", parallel_drafting=True,
                                   mask_token_id=99)
    assert not serve_vllm.drafts_in_parallel(plain)
    assert serve_vllm.drafts_in_parallel(parallel)
    assert serve_vllm.eagle3_speculative_config(parallel, 4) == {
        "method": "eagle3", "model": parallel, "num_speculative_tokens": 4,
        "parallel_drafting": True}
    assert "parallel_drafting" not in serve_vllm.eagle3_speculative_config(plain, 4)
    cfg = make_cfg(verifier=verifier_dir, depth=6)
    spec = serve_vllm.llm_config(cfg, parallel)["engine_kwargs"]["speculative_config"]
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 6
    off = write_export_config(tmp_path / "off", parallel_drafting=False, mask_token_id=1)
    assert not serve_vllm.drafts_in_parallel(off)
    with pytest.raises(ValueError, match="mask_token_id"):
        serve_vllm.drafts_in_parallel(write_export_config(tmp_path / "bad",
                                                          parallel_drafting=True))


def test_a_block_drafter_export_asks_vllm_for_dflash(tmp_path, verifier_dir, engine_python):
    """A block (DFlash) export (architectures DFlashDraftModel, checkpoint.block_config) is
    served with vLLM's method "dflash" at the serve depth; vLLM then drafts in parallel by
    itself, so no parallel_drafting key. Without dflash_config's mask token: refused."""
    block = write_export_config(tmp_path / "block", architectures=["DFlashDraftModel"],
                                dflash_config={"mask_token_id": 99, "target_layer_ids": [1]})
    assert serve_vllm.drafts_in_blocks(block)
    assert not serve_vllm.drafts_in_blocks(write_export_config(tmp_path / "plain"))
    assert serve_vllm.eagle3_speculative_config(block, 4) == {
        "method": "dflash", "model": block, "num_speculative_tokens": 4}
    cfg = make_cfg(verifier=verifier_dir, depth=6)
    spec = serve_vllm.llm_config(cfg, block)["engine_kwargs"]["speculative_config"]
    assert spec == {"method": "dflash", "model": block, "num_speculative_tokens": 6}
    with pytest.raises(ValueError, match="mask_token_id"):
        serve_vllm.drafts_in_blocks(write_export_config(tmp_path / "bad",
                                                        architectures=["DFlashDraftModel"]))


def test_clear_errors(verifier_dir, drafter_dir, engine_python):
    with pytest.raises(ValueError, match="builtin engine"):
        serve_vllm.llm_config(make_cfg(verifier=verifier_dir, dynamic_depth=True), None)
    with pytest.raises(ValueError, match="whole GPUs"):
        serve_vllm.llm_config(make_cfg(verifier=verifier_dir, gpus_per_replica=2.5), None)
    with pytest.raises(ValueError, match="Hugging Face id or a transformers"):
        serve_vllm.llm_config(make_cfg(verifier="embedded:smollm2"), None)
    with pytest.raises(ValueError, match="needs a drafter"):
        serve_vllm.build_vllm_app(make_cfg(verifier=verifier_dir, depth=4))
    with pytest.raises(ValueError, match="needs a drafter"):
        serve_vllm.app_configs(make_cfg(verifier=verifier_dir, depth=4))
    with pytest.raises(ValueError, match="no drafter"):
        serve_vllm.vllm_export_dir(make_cfg(verifier=verifier_dir))


def test_the_ingress_gets_the_key_as_a_digest_and_the_served_depth(verifier_dir, drafter_dir,
                                                                   engine_python):
    """The API key reaches our ingress class (vllm_ingress.Eagle3Ingress, named in
    LLMServingArgs.ingress_cls_config) as its sha256 only: the Serve app config is readable."""
    from eagle3_ray.serve import validate
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, model_name="m", depth=3,
                   api_key="sk-secret")
    (app, _) = serve_vllm.app_configs(cfg, "x")
    ingress = app["args"]["ingress_cls_config"]
    assert ingress["ingress_cls"] == "eagle3_ray.serve.vllm_ingress:Eagle3Ingress"
    kw = ingress["ingress_extra_kwargs"]
    assert kw["api_key_sha256"] == validate.key_digest("sk-secret")
    assert kw["model_name"] == "m" and kw["depth"] == 3 and kw["max_request_bytes"] > 0
    assert "sk-secret" not in json.dumps(app)
    plain = serve_vllm.serving_args(make_cfg(verifier=verifier_dir, depth=0), None)
    assert plain["ingress_cls_config"]["ingress_extra_kwargs"]["api_key_sha256"] is None
    assert plain["ingress_cls_config"]["ingress_extra_kwargs"]["depth"] == 0
    with pytest.raises(validate.ApiError, match="API key"):
        validate.check_api_key("Bearer sk-wrong", kw["api_key_sha256"])
    validate.check_api_key("Bearer sk-secret", kw["api_key_sha256"])


def test_full_vocab_drafter_exports_without_d2t(verifier_dir, tmp_path):
    """vLLM has no d2t parameter for a drafter whose draft vocab is the whole vocabulary and
    refuses one at load: the export leaves d2t and t2d out there."""
    from safetensors import safe_open
    full = save_tiny_drafter(str(tmp_path / "full"), verifier_dir, draft_vocab=100)
    out = serve_vllm.ensure_vllm_export(make_cfg(verifier=verifier_dir, drafter=full))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()


def test_cli_flags_reach_the_config():
    from eagle3_ray import cli
    a = cli.parser().parse_args(["serve", "--engine", "vllm", "--dtype", "fp32", "--no-eager"])
    cfg = cli.serve_config(a)
    assert (cfg.engine, cfg.dtype, cfg.eager) == ("vllm", "fp32", False)
    cfg = cli.serve_config(cli.parser().parse_args(["serve", "--eager"]))
    assert (cfg.dtype, cfg.eager) == (None, True)
    assert cli.serve_config(cli.parser().parse_args(["serve"])).eager is None   # host decides


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_build_without_vllm_says_what_to_install(drafter_dir, verifier_dir):
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, depth=4)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM.*py_executable.*setup_vllm\.sh.*builtin"):
        serve_vllm.build_vllm_app(cfg)
    assert not os.path.exists(serve_vllm.vllm_export_dir(cfg))   # failed before any work


def test_no_engine_environment_says_how_to_make_one(drafter_dir, verifier_dir, monkeypatch):
    monkeypatch.setenv("EAGLE3_RAY_VLLM_PYTHON", os.path.join(str(verifier_dir), "no-python"))
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, depth=4)
    with pytest.raises(FileNotFoundError, match="EAGLE3_RAY_VLLM_PYTHON"):
        serve_vllm.app_configs(cfg)
    assert not os.path.exists(serve_vllm.vllm_export_dir(cfg))   # failed before any work
