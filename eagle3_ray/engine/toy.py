"""Small random verifiers built in code, for tests and the GPU check: the two verifier families
every stage handles (DESIGN.md "Verifier families"), each with SmolLM2's tokenizer and chat
template (read from the embedded GGUF, nothing fetched).

  llama(dir)      a dense Llama (GQA attention), the embedded default's shape
  deepseek(dir)   Kimi-K2.5's text model in small (DeepSeek-V3): MLA with vLLM's CPU MLA head
                  size 576 (kv_lora_rank 512 + qk_rope_head_dim 64), q-LoRA, a dense first
                  layer, then MoE layers of 8 routed experts in 2 groups + 1 shared expert with
                  sigmoid scores and grouped `noaux_tc` routing (a random e_score_correction_bias)
  kimi(dir)       Kimi-K2.5's vision-language wrapper (`model_type: kimi_k25`) around a
                  deepseek(): the text model under `text_config`, its weights under
                  `language_model.`, a stand-in vision tower beside them

Both families get a confident teacher (lm_head scaled up): peaked next-token distributions, so
an argmax is never a near tie that two engines' roundings could flip.

    python -m eagle3_ray.engine.toy deepseek /tmp/ds     # writes the verifier, prints its facts
"""
from __future__ import annotations

import argparse
import json
import os

import torch

LM_HEAD_SCALE = 30.0     # peaked teacher distributions (no argmax near ties)


def _tokenizer():
    from eagle3_ray.engine import hf
    return hf.load_tokenizer(hf.EMBEDDED_VERIFIER)


def _save(model, tok, d: str) -> str:
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def llama(d, hidden_size: int = 64, heads: int = 4, layers: int = 8, seed: int = 0) -> str:
    """A random Llama (GQA: heads/2 KV heads) in directory d."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = _tokenizer()
    cfg = LlamaConfig(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, vocab_size=len(tok),
                      max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return _save(LlamaForCausalLM(cfg), tok, d)


def deepseek_config(vocab_size: int, hidden_size: int = 128, layers: int = 8, **tok_ids):
    """A small DeepSeek-V3 config with every part of Kimi-K2.5's text model that changes code
    paths (the real one: hidden 7168, 61 layers, 64 heads, q_lora_rank 1536, 384 experts in 8
    groups, 8 per token, first layer dense). rope_interleave is transformers' default (True):
    DeepSeek's rotary pairs are interleaved, as in vLLM's DeepSeek (is_neox_style=False)."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64,       # 512 + 64: vLLM's CPU MLA
        qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        num_mtp_layers=0, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **tok_ids)


def deepseek(d, hidden_size: int = 128, layers: int = 8, seed: int = 0) -> str:
    """A random DeepSeek-V3-shaped verifier in directory d (saved by transformers as it saves
    any DeepSeek-V3: without the `topk_method` / `scoring_func` keys that vLLM needs, which
    engine/vllm.py supplies). The router's e_score_correction_bias is random, as a trained
    model's is (zeros would leave the bias path untested)."""
    from transformers import DeepseekV3ForCausalLM
    tok = _tokenizer()
    cfg = deepseek_config(len(tok), hidden_size, layers, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0.0, 0.5)       # routing scores spread out: no ties
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return _save(model, tok, d)


KIMI_PREFIX = "language_model."


def kimi(d, text_dir: str | None = None, **deepseek_kw) -> str:
    """Kimi-K2.5's wrapper around a deepseek() text model (made in d/text unless `text_dir`):
    config.json `model_type: kimi_k25`, `architectures: [KimiK25ForConditionalGeneration]`,
    the text config under `text_config`, a vision config beside it; weights as Kimi-K2.5 names
    them (`language_model.model.layers...`, `language_model.lm_head.weight`, `vision_tower...`,
    `mm_projector...`). engine/hf.py loads its text model only."""
    from safetensors.torch import load_file, save_file
    text_dir = text_dir or deepseek(os.path.join(d, "text"), **deepseek_kw)
    with open(os.path.join(text_dir, "config.json")) as f:
        text = json.load(f)
    hidden = text["hidden_size"]
    weights = {KIMI_PREFIX + k: v for k, v in load_file(
        os.path.join(text_dir, "model.safetensors")).items()}
    weights.update({"vision_tower.patch_embed.proj.weight": torch.randn(32, 3, 14, 14) * 0.02,
                    "mm_projector.proj.0.weight": torch.randn(hidden, 32) * 0.02})
    os.makedirs(d, exist_ok=True)
    save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": text,
              "vision_config": {"model_type": "moonvit", "hidden_size": 32, "patch_size": 14},
              "dtype": text.get("dtype", "float32"),
              "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id"),
              "pad_token_id": text.get("pad_token_id")}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _tokenizer().save_pretrained(d)
    return str(d)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=("llama", "deepseek", "kimi"))
    p.add_argument("directory")
    a = p.parse_args(argv)
    out = {"llama": llama, "deepseek": deepseek, "kimi": kimi}[a.family](a.directory)
    from eagle3_ray.engine import hf
    cfg = hf.load_config(out)
    print(json.dumps(hf.verifier_facts(out, cfg, hf.load_tokenizer(out),
                                       hf.default_aux_layer_ids(hf.text_config(cfg)
                                                                .num_hidden_layers)), indent=2))


if __name__ == "__main__":
    main()
