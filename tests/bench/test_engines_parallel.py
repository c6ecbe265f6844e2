"""Drafters served for real by vLLM's CPU build (.venv-vllm) and by the builtin decoder, through
`bench engines` end to end (Ray actors in the engine environment), fp32, accepted counts equal
between the engines and greedy output unchanged:
- a parallel (P-EAGLE) drafter on the Llama: vLLM drafts in parallel from our export
  (mask_hidden, mask_token_id) exactly as the builtin decoder does;
- a block (DFlash) drafter on the Llama: vLLM's `dflash` method loads our export
  (DFlashDraftModel) and drafts each block as the builtin decoder does. The aux layers vLLM
  feeds it are checked with vLLM's own reader (dflash_config.target_layer_ids + 1 = the
  inputs trained on): on this random verifier the accepted counts alone do not tell (its
  greedy text loops, and a drafter fed the inputs of the next layers drafts the same);
- an MLA-layer drafter with EAGLE-3.1's fc_norm / norm_output on the DeepSeek-V3-shaped verifier
  (Kimi's shape): vLLM loads our Eagle3DeepseekV3ForCausalLM export and drafts what the builtin
  decoder drafts. (A Llama-layer drafter cannot run there on vLLM's CPU build: refused by name.)"""
import subprocess

import pytest
import torch

from eagle3_ray.bench import engines
from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier, vllm as engine_vllm

DEPTH = 3


def _served_alike(r: dict, depth: int) -> tuple[list, list]:
    """Both engines' per-position counts at `depth`, after checking outputs: identical between
    the engines and to depth 0."""
    assert r["compare"][str(depth)]["identical_prompts"] == 2        # both engines, token for token
    for e in engines.ENGINES:
        assert r["runs"][e][str(depth)]["identical_to_depth0"] == 2, e
    b = r["runs"]["builtin"][str(depth)]["positions"]
    v = r["runs"]["vllm"][str(depth)]["positions"]
    assert [p["accepted"] for p in b] == [p["accepted"] for p in v]  # fp32: the same drafts
    assert [p["drafted"] for p in b] == [p["drafted"] for p in v]
    return b, v


def _trained(spec: str, out: str, prompts, train_tiny_drafter, **kw) -> str:
    """train_tiny_drafter on one thread (it is small), skipped without the vLLM environment."""
    try:
        engine_vllm.engine_python()
    except RuntimeError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_tiny_drafter(spec, out, prompts, steps=60, depth=DEPTH, new_tokens=24, **kw)
    finally:
        torch.set_num_threads(threads)


def test_vllm_drafts_a_parallel_drafter_as_the_builtin_decoder_does(ray_cluster, vllm_verifier,
                                                                    tmp_path, train_tiny_drafter):
    prompts = data.heldout_prompts(verifier.load_tokenizer(vllm_verifier), 2)
    d = _trained(vllm_verifier, str(tmp_path / "drafter"), prompts, train_tiny_drafter,
                 drafting="parallel")
    r = engines.bench_engines(d, prompts=2, max_tokens=16, depths=(DEPTH,), dtype="fp32",
                              spec=vllm_verifier, threads=1, out_dir=str(tmp_path / "bench"))
    assert r["vllm"][str(DEPTH)]["speculative_config"]["parallel_drafting"] is True
    b, _ = _served_alike(r, DEPTH)
    assert b[1]["accepted"] > 0          # a mask slot's draft accepted: parallel drafting works


# vLLM's view of a dflash export, by its own code: the model class its registry loads, the
# verifier layers whose inputs it captures (eagle3_utils.py), whether the block is non-causal
VLLM_DFLASH_VIEW = """
import json, sys
from types import SimpleNamespace
from transformers import AutoConfig
from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
from vllm.model_executor.models.registry import _VLLM_MODELS
from vllm.transformers_utils.configs.eagle import EAGLEConfig
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
cfg = EAGLEConfig(AutoConfig.from_pretrained(sys.argv[1]), method="dflash", model_type="eagle")
spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=cfg))
print(json.dumps({"model": [list(_VLLM_MODELS[a]) for a in cfg.architectures],
                  "aux": list(get_eagle3_aux_layers_from_config(spec)),
                  "non_causal": dflash_has_any_non_causal(cfg)}))
"""


def test_vllm_drafts_a_block_drafter_as_the_builtin_decoder_does(ray_cluster, vllm_verifier,
                                                                 tmp_path, train_tiny_drafter):
    import json
    from eagle3_ray.train import checkpoint
    prompts = data.heldout_prompts(verifier.load_tokenizer(vllm_verifier), 2)
    d = _trained(vllm_verifier, str(tmp_path / "drafter"), prompts, train_tiny_drafter,
                 drafting="block", block_size=DEPTH, block_layers=2)
    r = engines.bench_engines(d, prompts=2, max_tokens=16, depths=(DEPTH,), dtype="fp32",
                              spec=vllm_verifier, threads=1, out_dir=str(tmp_path / "bench"))
    spec = r["vllm"][str(DEPTH)]["speculative_config"]
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == DEPTH
    config = json.load(open(f"{spec['model']}/config.json"))
    assert config["architectures"] == ["DFlashDraftModel"]
    assert "eagle_aux_hidden_state_layer_ids" not in config        # vLLM would read it first
    b, _ = _served_alike(r, DEPTH)
    assert b[0]["accepted"] > 0 and b[1]["accepted"] > 0    # slots 1 and 2 of a block accepted
    out = subprocess.run([engine_vllm.engine_python(), "-c", VLLM_DFLASH_VIEW, spec["model"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    view = json.loads(out.stdout.strip().splitlines()[-1])
    assert view == {"model": [["qwen3_dflash", "DFlashQwen3ForCausalLM"]], "non_causal": True,
                    "aux": checkpoint.load_drafter(d)[1].aux_layer_ids}   # inputs as trained


def test_vllm_serves_an_mla_drafter_on_the_deepseek_verifier(ray_cluster, deepseek_verifier,
                                                            tmp_path, train_tiny_drafter):
    import json
    from eagle3_ray.serve.vllm import check_cpu_drafter_layer
    from eagle3_ray.train import checkpoint
    prompts = data.heldout_prompts(verifier.load_tokenizer(deepseek_verifier), 2)
    d = _trained(deepseek_verifier, str(tmp_path / "drafter"), prompts, train_tiny_drafter,
                 layer="mla", fc_norm=True, norm_output=True)
    r = engines.bench_engines(d, prompts=2, max_tokens=16, depths=(DEPTH,), dtype="fp32",
                              spec=deepseek_verifier, threads=1, out_dir=str(tmp_path / "bench"))
    export = r["vllm"][str(DEPTH)]["speculative_config"]["model"]
    config = json.load(open(f"{export}/config.json"))
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert config["fc_norm"] is True and config["norm_output"] is True
    b, _ = _served_alike(r, DEPTH)
    assert b[0]["accepted"] > 0          # the MLA drafter's drafts get accepted in both engines
    # the other shape on this target: refused before vLLM starts, naming cause and remedy
    llama = checkpoint.export(train_tiny_drafter(deepseek_verifier, str(tmp_path / "llama"),
                                                 prompts, steps=1, depth=1, new_tokens=4),
                              str(tmp_path / "llama-vllm"), "vllm")
    with pytest.raises(ValueError, match="No common block size.*--draft-layer mla"):
        check_cpu_drafter_layer(deepseek_verifier, llama)
    check_cpu_drafter_layer(deepseek_verifier, llama, gpus=1)          # GPUs run either
