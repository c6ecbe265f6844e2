"""The vLLM engine option of serving (serve/vllm.py): a real drafter checkpoint is exported to
vLLM's layout and turned into ray.serve.llm LLMConfig arguments.

vLLM is not installed here (and cannot be), so nothing is deployed: the tests check the export
and the generated config. `ray.serve.llm` itself does not import without vLLM or SGLang in Ray
2.60 (its builder imports the OpenAI protocol models, which raise "Neither vLLM nor SGLang is
installed"), so the public `ray.serve.llm.LLMConfig` cannot be built here. Its class body is
`pass` over ray.llm._internal.serve.core.configs.llm_config.LLMConfig, which does import, so the
tests run the real pydantic validation through that base class, plus the PlacementGroupConfig
check vLLM's engine config applies to placement_group_config. Where even that fails to import,
that part is skipped with the reason.

The verifier here is only a config.json (tiny Llama): nothing loads its weights without vLLM.
"""
import importlib.util
import json
import os
import types

import numpy as np
import pytest
import torch

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
                dynamic_depth=False, profile=None, simulate_interconnect=None)


def make_cfg(**kw):
    fields = dict(DEFAULTS, **kw)
    if ServeConfig is not None:
        return ServeConfig(**fields)
    return types.SimpleNamespace(**fields)


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


def save_tiny_drafter(directory: str, verifier: str, seed: int = 0) -> str:
    from transformers import AutoConfig
    cfg = DraftConfig.from_verifier_config(AutoConfig.from_pretrained(verifier),
                                           draft_vocab_size=40, aux_layer_ids=AUX)
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g).to(torch.bfloat16)
             for k, (shape, dt) in checkpoint.expected_shapes(cfg).items() if dt is None}
    counts = np.random.default_rng(seed).integers(0, 50, cfg.vocab_size)
    state["d2t"], state["t2d"] = vocab.build_mapping(counts, cfg.draft_vocab_size)
    return checkpoint.save_drafter(directory, state, cfg, {"ttt_steps": 8})


@pytest.fixture
def drafter_dir(tmp_path, verifier_dir):
    return save_tiny_drafter(str(tmp_path / "drafter"), verifier_dir)


def test_real_export_to_llm_config(drafter_dir, verifier_dir):
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
    pg = kw["placement_group_config"]
    assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 4
    assert all(b["GPU"] == 1 for b in pg["bundles"])
    assert pg["bundles"][0]["pcie_node"] > 0                       # pinned to the PCIe node
    assert not any("pcie_node" in b for b in pg["bundles"][1:])    # STRICT_PACK keeps the rest
    dep = kw["deployment_config"]
    assert dep["max_ongoing_requests"] == 8 and dep["max_queued_requests"] == 32
    assert dep["autoscaling_config"] == autoscaling and "num_replicas" not in dep
    assert dep["ray_actor_options"] == {"num_cpus": 2}

    llm = validated_llm_config(kw)                # Ray's own pydantic validation
    assert llm.model_id == "kimi-eagle3" and llm.max_request_context_length == 4096
    assert llm.engine_kwargs["speculative_config"]["method"] == "eagle3"
    assert llm.accelerator_config.kind == "gpu"   # inferred from the GPU bundles
    assert llm.deployment_config["max_queued_requests"] == 32
    from ray.llm._internal.common.placement import PlacementGroupConfig   # what vLLM's config runs
    assert PlacementGroupConfig(**llm.placement_group_config).bundles[0].model_extra == \
        {"pcie_node": serve_vllm.NODE_RESOURCE_SLIVER}


def test_export_kept_until_the_drafter_changes(drafter_dir, verifier_dir):
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir)
    out = serve_vllm.ensure_vllm_export(cfg)
    weights = os.path.join(out, "model.safetensors")
    first = os.stat(weights).st_ino, os.stat(weights).st_mtime_ns
    assert serve_vllm.ensure_vllm_export(cfg) == out
    assert (os.stat(weights).st_ino, os.stat(weights).st_mtime_ns) == first   # not rewritten

    os.remove(os.path.join(out, serve_vllm.SOURCE_FILE))   # e.g. a crash right after export
    serve_vllm.ensure_vllm_export(cfg)
    assert os.path.isfile(os.path.join(out, serve_vllm.SOURCE_FILE))

    export_cfg = json.load(open(os.path.join(out, "config.json")))
    save_tiny_drafter(drafter_dir, verifier_dir, seed=1)   # retrained in place
    out2 = serve_vllm.ensure_vllm_export(cfg)
    assert out2 == out and json.load(open(os.path.join(out, "config.json"))) == export_cfg
    src = json.load(open(os.path.join(out, serve_vllm.SOURCE_FILE)))
    meta = json.load(open(os.path.join(drafter_dir, "meta.json")))
    assert src["files"] == meta["files"]                   # made from the new weights


def test_plain_decoding_and_small_replicas(verifier_dir):
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


def test_clear_errors(verifier_dir, drafter_dir):
    with pytest.raises(ValueError, match="api_key.*builtin"):
        serve_vllm.llm_config(make_cfg(verifier=verifier_dir, api_key="sk-x"), None)
    with pytest.raises(ValueError, match="builtin engine"):
        serve_vllm.llm_config(make_cfg(verifier=verifier_dir, dynamic_depth=True), None)
    with pytest.raises(ValueError, match="whole GPUs"):
        serve_vllm.llm_config(make_cfg(verifier=verifier_dir, gpus_per_replica=2.5), None)
    with pytest.raises(ValueError, match="Hugging Face id or a transformers"):
        serve_vllm.llm_config(make_cfg(verifier="embedded:smollm2"), None)
    with pytest.raises(ValueError, match="needs a drafter"):
        serve_vllm.build_vllm_app(make_cfg(verifier=verifier_dir, depth=4))
    with pytest.raises(ValueError, match="no drafter"):
        serve_vllm.vllm_export_dir(make_cfg(verifier=verifier_dir))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_build_without_vllm_says_what_to_install(drafter_dir, verifier_dir):
    cfg = make_cfg(verifier=verifier_dir, drafter=drafter_dir, depth=4)
    with pytest.raises(RuntimeError, match=r'(?s)vLLM.*pip install "ray\[llm\]".*builtin'):
        serve_vllm.build_vllm_app(cfg)
    assert not os.path.exists(serve_vllm.vllm_export_dir(cfg))   # failed before any work
