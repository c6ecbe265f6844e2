"""Drafters served for real by vLLM's CPU build (.venv-vllm) and by the builtin decoder, through
`bench engines` end to end (Ray actors in the engine environment), fp32, accepted counts equal
between the engines and greedy output unchanged:
- a parallel (P-EAGLE) drafter on the Llama: vLLM drafts in parallel from our export
  (mask_hidden, mask_token_id) exactly as the builtin decoder does;
- an MLA-layer drafter with EAGLE-3.1's fc_norm / norm_output on the DeepSeek-V3-shaped verifier
  (Kimi's shape): vLLM loads our Eagle3DeepseekV3ForCausalLM export and drafts what the builtin
  decoder drafts. (A Llama-layer drafter cannot run there on vLLM's CPU build: refused by name.)"""
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
