"""Which engine is right on the DeepSeek-V3 shape (issue 57), settled against a direct
computation of one layer, and Kimi-K2.5's vision-language wrapper through extraction and
training.

- The direct computation: the test verifier's layer 0 (MLA with q-LoRA, interleaved RoPE on the
  64 rotary dims, softmax scale qk_head_dim^-1/2, dense MLP) from its safetensors in fp64 with
  plain tensor ops. transformers' states equal it to fp32 rounding.
- vLLM's CPU rotary kernel on the views vLLM's MLA hands it rotates the wrong elements (why
  engine/vllm.py turns that custom op off on CPU for DeepSeek verifiers: CPU_MLA_COMPILATION);
  this test fails once vLLM fixes the kernel, to say the setting can go. test_extract_vllm.py
  checks the two engines' datasets equal with the setting.
- The Kimi wrapper (model_type kimi_k25, text model under text_config, weights under
  language_model.) extracts with the HF engine to the plain DeepSeek's dataset and trains.
"""
import json
import math
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_conversations
from eagle3_ray.engine import hf


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_interleaved(x, theta):
    """x [S, heads, d]: pairs (x0, x1), (x2, x3), ... rotated by position * theta^(-2i/d)."""
    s, d = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)       # [d/2]
    ang = torch.arange(s, dtype=torch.float64)[:, None, None] * inv            # [S, 1, d/2]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()
    return out


def direct_layer0(directory: str, ids: torch.Tensor) -> torch.Tensor:
    """The output of decoder layer 0 (= vLLM id 1, the input of layer 1) [S, H], in fp64."""
    w = {k: v.double() for k, v in load_file(os.path.join(directory, "model.safetensors")).items()}
    c = json.load(open(os.path.join(directory, "config.json")))
    eps, nh = c["rms_norm_eps"], c["num_attention_heads"]
    dn, dr, dv, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    p, s = "model.layers.0.", len(ids)
    x = w["model.embed_tokens.weight"][ids]                                     # [S, H]
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    a = p + "self_attn."
    q = _rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps)
    q = (q @ w[a + "q_b_proj.weight"].T).view(s, nh, dn + dr)                   # [S, nh, dn+dr]
    latent = h @ w[a + "kv_a_proj_with_mqa.weight"].T                            # [S, r+dr]
    kv = _rms(latent[:, :r], w[a + "kv_a_layernorm.weight"], eps) @ w[a + "kv_b_proj.weight"].T
    kv = kv.view(s, nh, dn + dv)                                                 # [S, nh, dn+dv]
    theta = c["rope_parameters"]["rope_theta"]
    q = torch.cat([q[..., :dn], _rope_interleaved(q[..., dn:], theta)], -1)
    k_rot = _rope_interleaved(latent[:, None, r:], theta).expand(s, nh, dr)      # shared by heads
    k = torch.cat([kv[..., :dn], k_rot], -1)                                     # [S, nh, dn+dr]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dn + dr)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., dn:]).reshape(s, nh * dv)
    x = x + o @ w[a + "o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    m = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
         * (m @ w[p + "mlp.up_proj.weight"].T))
    return x + m @ w[p + "mlp.down_proj.weight"].T


def test_transformers_computes_the_deepseek_layer_directly(deepseek_verifier):
    model = hf.load_verifier(deepseek_verifier, torch.float32)
    ids = torch.tensor(hf.load_tokenizer(deepseek_verifier)(
        "The capital of France is Paris, and of Italy Rome.")["input_ids"])
    aux, _, _ = hf.forward_hidden(model, ids[None], torch.ones(1, len(ids), dtype=torch.long),
                                  [1, 2, 3])
    ref = direct_layer0(deepseek_verifier, ids)
    err = ((aux[0, :, 0].double() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err < 1e-5, err                       # fp32 rounding; a RoPE or scale slip is > 1e-2


VLLM_ROPE_CHECK = """
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
torch.manual_seed(0)
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(64, max_position=256, is_neox_style=False, dtype=torch.float32,
                    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
pos, q, fused = torch.arange(6), torch.randn(6, 2, 128), torch.randn(6, 640)
want_q, want_k = rope.forward_native(pos, q[..., 64:].clone(), fused[:, None, 576:].clone())
q_view, k_view = q[..., 64:], fused[:, None, 576:]          # what vLLM's MLA passes
rope.forward_cpu(pos, q_view, k_view)                       # in place
print(torch.allclose(q_view, want_q, atol=1e-5), torch.allclose(k_view, want_k, atol=1e-5))
"""


def test_vllm_cpu_rotary_kernel_misreads_mla_views():
    from eagle3_ray.engine import vllm as engine
    try:
        python = engine.engine_python()
    except RuntimeError as e:  # pragma: no cover - only where setup_vllm.sh did not run
        pytest.skip(f"no vLLM environment: {e}")
    out = subprocess.run([python, "-c", VLLM_ROPE_CHECK], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # q False: the kernel still misreads the query view MLA passes ([tokens, heads, 64] of a
    # [tokens, heads, 128] tensor), so engine/vllm.py keeps its CPU setting. q True: vLLM fixed
    # it; CPU_MLA_COMPILATION can go.
    q_ok, k_ok = out.stdout.split()[-2:]
    assert q_ok == "False", out.stdout
    assert engine.engine_kwargs(model=None)["dtype"]         # (imports fine without a model)


def test_kimi_wrapper_extracts_as_its_text_model_and_trains(ray_cluster, kimi_verifier,
                                                           deepseek_verifier, tmp_path):
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    from eagle3_ray.train.config import TrainConfig
    from eagle3_ray.train.trainer import run_train
    convs = tmp_path / "convs.json"
    convs.write_text(json.dumps(make_conversations(8)))
    runs = {}
    for name, spec in (("kimi", kimi_verifier), ("deepseek", deepseek_verifier)):
        runs[name] = run_extract(ExtractConfig(verifier=spec, inputs=[str(convs)],
                                               output=str(tmp_path / name), max_length=96,
                                               batch_rows=8, dtype="float32"))
    facts, plain = runs["kimi"]["facts"], runs["deepseek"]["facts"]
    assert facts["verifier_model_type"] == "kimi_k25"
    assert facts["verifier_text_config"] == "kimi_k25.text_config (deepseek_v3)"
    assert plain["verifier_text_config"] is None
    for k in ("hidden_size", "vocab_size", "num_layers", "aux_layer_ids"):   # the text model's
        assert facts[k] == plain[k], k
    assert facts["hidden_size"] == 128 and facts["aux_layer_ids"] == [2, 4, 5]
    assert runs["kimi"]["summary"]["samples"] == runs["deepseek"]["summary"]["samples"] == 8
    run_train(TrainConfig(dataset=str(tmp_path / "kimi"), output=str(tmp_path / "run"),
                          ttt_steps=2, draft_vocab_size=512, batch_size=2, max_steps=6,
                          log_every=1, eval_every=0, checkpoint_every=6, num_workers=1,
                          cpus_per_worker=1))   # no --verifier: the dataset's manifest names it
    out = str(tmp_path / "run" / "drafter")
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["verifier"] == kimi_verifier
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


def test_every_vllm_path_gets_the_deepseek_settings(deepseek_verifier, kimi_verifier,
                                                    tiny_verifier):
    """Serving (Ray Serve LLM's engine_kwargs) takes the settings extraction and bench engines
    take: the routing keys the checkpoint lacks (nested for Kimi's wrapper), and on CPU only the
    native rotary. A Llama verifier gets neither."""
    from eagle3_ray.engine import vllm as engine
    from eagle3_ray.serve import vllm as serve_vllm
    from eagle3_ray.serve.app import ServeConfig
    cpu = serve_vllm.llm_config(ServeConfig(verifier=deepseek_verifier, engine="vllm", depth=0),
                                None)["engine_kwargs"]
    assert cpu["hf_overrides"] == engine.DEEPSEEK_ROUTING
    assert cpu["compilation_config"] == engine.CPU_MLA_COMPILATION
    gpu = serve_vllm.llm_config(ServeConfig(verifier=deepseek_verifier, engine="vllm", depth=0,
                                            gpus_per_replica=1), None)["engine_kwargs"]
    assert gpu["hf_overrides"] == engine.DEEPSEEK_ROUTING and "compilation_config" not in gpu
    assert engine.config_overrides(kimi_verifier) == {"text_config": engine.DEEPSEEK_ROUTING}
    assert engine.is_deepseek(kimi_verifier)
    config = json.load(open(os.path.join(deepseek_verifier, "config.json")))
    assert "topk_method" not in config           # as transformers 5 saves DeepSeek-V3
    llama = engine.engine_kwargs(model=tiny_verifier)
    assert "hf_overrides" not in llama and "compilation_config" not in llama
