"""The drafter checkpoint: a self-describing directory, and its export for SGLang/vLLM/speculators.

A checkpoint directory holds three files, written atomically (temp dir + rename, so a crash
never leaves a directory that looks complete):

    model.safetensors  fc, midlayer.*, norm, lm_head (draft vocab), d2t int64 [Vd], t2d bool [V],
                       mask_hidden [3H] for a parallel drafter, fc_norm.{0,1,2} with EAGLE-3.1's
                       fc_norm; a block drafter: fc, hidden_norm, layers.{i}.*, norm, lm_head,
                       d2t, t2d (block.py); no embed_tokens: the verifier's embedding is frozen
                       and engines share it
    config.json        SGLang/vLLM "LlamaForCausalLMEagle3" layout, or for an MLA layer
                       "Eagle3DeepseekV3ForCausalLM" (engine_config: the top-level aux ids in
                       vLLM's convention, eagle_config's in SGLang's; fc_norm / norm_output),
                       a block drafter vLLM's "DFlashDraftModel" (block_config), plus our full
                       DraftConfig under "eagle3_ray"
    meta.json          ttt_steps, dataset manifest hash, metrics, tool version, created time,
                       sizes + sha256 of the two files above, whatever the caller passed

`export(src, out, fmt)` writes exactly what each engine loads (model.safetensors + config.json),
in the verifier's dtype (SGLang takes the draft's dtype from its config; a float32 config runs
as float16 under --dtype auto, against a bf16 verifier). What each engine expects (read in
their sources; no code taken):
  - vLLM vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights):
    renames "midlayer." -> "layers.0.", "d2t" -> draft_id_to_target_id (a parameter only when
    the draft vocab is smaller than the verifier's: a full-vocab export carries no d2t/t2d),
    skips "t2d", and skips embed_tokens when the checkpoint has none
    (vllm/v1/worker/gpu/spec_decode/eagle/utils.py then shares the target's embedding).
    Registry maps architecture "LlamaForCausalLMEagle3" to Eagle3LlamaForCausalLM.
    Residual: `norm_before_residual` read from the config, default False there. Aux layers:
    vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (get_eagle3_aux_layers_from_config)
    reads the *top-level* `eagle_aux_hidden_state_layer_ids` of the draft config, used as-is:
    vllm/model_executor/models/llama.py captures `hidden_states + residual` *before* layer idx,
    i.e. the input of that layer. A parallel (P-EAGLE) drafter: load_weights copies
    "mask_hidden" [3H] into a buffer when speculative_config has "parallel_drafting": true
    (and refuses the checkpoint without it); vllm/v1/spec_decode/llm_base_proposer.py reads
    the config's top-level mask_token_id and feeds each mask slot fc(mask_hidden).
  - vLLM's `dflash` method, a block (DFlash) drafter (drafting "block"): registry
    "DFlashDraftModel" -> models/qwen3_dflash.py DFlashQwen3ForCausalLM (EAGLEConfig keeps an
    architecture that starts with "DFlash"); a Qwen3 config of the drafter's shapes
    (num_hidden_layers = block_layers, head_dim, rope_theta / rope_scaling, rms_norm_eps,
    hidden_act silu only: Qwen2MLP), fc's input = target_hidden_size x the aux layers.
    load_weights: "t2d" skipped, "d2t" -> draft_id_to_target_id (a parameter only for a
    reduced draft vocab, as in llama_eagle3), every other name but lm_head's prefixed "model.",
    q/k/v_proj stacked into qkv_proj and gate/up_proj into gate_up_proj; embed_tokens and
    mask_embedding dropped when absent (the target's embedding is shared,
    llm_base_proposer._maybe_share_embeddings; our lm_head is kept: has_own_lm_head). The
    context: combine_hidden_states = fc(aux), then precompute_and_store_context_kv applies
    hidden_norm, each layer's k/v_proj, k_norm and RoPE into that layer's KV cache; queries are
    the bonus token + num_speculative_tokens mask_token_id slots (dflash_config.mask_token_id)
    at the positions after the context (v1/spec_decode/dflash.py, _copy_and_expand_dflash_inputs,
    which vLLM's CPU build runs through its C++ override, platforms/cpu.py), non-causal unless
    is_causal / dflash_config.causal / sliding layer_types say otherwise. Aux layers
    (eagle3_utils.py get_eagle3_aux_layers_from_config): a top-level
    eagle_aux_hidden_state_layer_ids is used as-is if present, else dflash_config
    .target_layer_ids + 1 ("DFlash's aux layer id semantics": the output of layer j); we write
    only the latter (dflash_layer_ids). SGLang's DFLASH (python/sglang/srt/models/dflash.py
    DFlashDraftModel) reads the same names but has no lm_head / d2t (it drafts through the
    target's lm_head, and its load_weights skips unknown names), so a block drafter has no
    SGLang export; speculators has no DFlash format either (refuse_block_export).
  - vLLM vllm/model_executor/models/deepseek_eagle3.py (the MLA layer, DraftConfig.layer "mla";
    registry: Eagle3DeepseekV2ForCausalLM and ...V3... are the same class): builds the layer from
    a DeepseekV2/V3 config (model_type deepseek_v2, see _layer_config: q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, rope_theta/rope_scaling -> rope_parameters, rms_norm_eps,
    intermediate_size for its always-dense MLP); load_weights as llama_eagle3's (t2d skipped,
    d2t -> draft_id_to_target_id only for a reduced vocab, "model." prefix), then
    "midlayer." -> "layers.0.", q_a_proj + kv_a_proj_with_mqa stacked into fused_qkv_a_proj
    (so q-LoRA is required: without it there is no fused_qkv_a_proj), gate/up into
    gate_up_proj. The config states n_routed_experts 0 / first_k_dense_replace 1 (the layer is
    dense anyway; transformers' DeepseekV3Config refuses None there).
    EAGLE-3.1 (both vLLM files): `fc_norm` true -> fc_norm.{i} RMSNorms [target_hidden_size]
    on each aux chunk before fc (combine_hidden_states, mask_hidden's too); `norm_output` true
    -> the next draft step gets norm(h + residual) instead of h + residual.
  - SGLang python/sglang/srt/models/kimi_k25_eagle3.py (Eagle3DeepseekV2ForCausalLM): the MLA
    layer with the same names (midlayer.*, fc_norm.{i}; q_a_proj/kv_a_proj_with_mqa fused on
    load), fc_norm / norm_output, q_lora_rank required; SGLang's llama_eagle3.py reads neither
    toggle and skips unknown weights, so a Llama-layer 3.1 drafter has no SGLang export.
  - SGLang python/sglang/srt/model_executor/model_runner.py reads
    `eagle_config["eagle_aux_hidden_state_layer_ids"]` (nested only), and
    python/sglang/srt/models/llama.py (set_eagle3_layers_to_capture) captures at
    `val + 1` for each configured id ("for the ith layer, it takes the output of the (i-1)th
    layer"), capturing before layer i like vLLM. So SGLang id = vLLM id - 1. One config that
    both read as trained carries both keys: top level vLLM ids, eagle_config SGLang ids (some
    vLLM versions fall back to eagle_config when the top-level key is missing: never missing).
    Both capture in one ascending pass over the layers, so ids are ascending (check_layer_ids).
    python/sglang/srt/models/llama_eagle3.py: weights `fc`, `midlayer.*`, `norm` (loaded under
    model.), `lm_head`; d2t -> hot_token_id = d2t + arange; t2d skipped; residual is the
    un-normed hidden (norm_before_residual False); embed shared via set_embed.
  - speculators (github:vllm-project/speculators) src/speculators/models/eagle3/config.py,
    src/speculators/config.py, src/speculators/convert/eagle/eagle3_converter.py: config.json
    with speculators_model_type "eagle3", transformer_layer_config (a LlamaConfig dict, its
    vocab_size = target V), draft_vocab_size, norm_before_residual, target_hidden_size,
    eagle_aux_hidden_state_layer_ids, speculators_config {algorithm, proposal_methods
    [{proposal_type "greedy", speculative_tokens, ...}], default_proposal_method, verifier
    {name_or_path, architectures}}; weights renamed "midlayer." -> "layers.0."; d2t/t2d
    present only when draft_vocab_size != vocab_size (src/speculators/model.py _init_vocab).
    vLLM's reader vllm/transformers_utils/configs/speculators/algos.py (update_eagle3) uses
    those ids as-is (vLLM convention) and defaults norm_before_residual to *True*, so we
    always write it explicitly, and passes fc_norm / norm_output on (an MLA layer: refused,
    its model_type map is llama/qwen3 only); base.py requires speculators_config.proposal_methods[0]
    .speculative_tokens and .verifier.name_or_path. speculators' own loader
    (src/speculators/models/eagle3/core.py, model.py load_verifier_weights) reads the verifier's
    config and embedding from name_or_path, so that is the materialized verifier directory.

    python -c "from eagle3_ray.train import checkpoint as c; \
c.export('runs/train/drafter', 'runs/sglang', 'sglang')"
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3_ray import __version__
from eagle3_ray.data import schema
from eagle3_ray.engine import hf as verifier
from eagle3_ray.train import draft, kinds, mla
from eagle3_ray.train.draft import DraftConfig
from eagle3_ray.train.vocab import check_mapping

WEIGHTS, CONFIG, META = "model.safetensors", "config.json", "meta.json"
FILES = (WEIGHTS, CONFIG, META)
FORMAT, FORMAT_VERSION = "eagle3_ray.drafter", 1
EXPORT_FORMATS = ("sglang", "vllm", "speculators")
# Our decoder layer keeps the *un-normed* fused hidden state as the residual, as SGLang's
# llama_eagle3.py and SpecForge do. vLLM's speculators reader defaults this flag to True,
# so every exported config states it.
NORM_BEFORE_RESIDUAL = False
# Keys a drafter state dict may carry that no engine loads, dropped on save: the frozen
# verifier embedding (engines share the target's) and RoPE caches derived from rope_theta
# (vLLM's llama_eagle3 load_weights has no parameter for them and would fail on the name).
_DROPPED_NAMES = ("embed_tokens.weight",)
_DROPPED_PARTS = ("rotary_emb.",)


def _dropped(name: str) -> bool:
    return name in _DROPPED_NAMES or any(p in name for p in _DROPPED_PARTS)
SGLANG_LAYER_ID_CONVENTION = ("sglang: config id j captures the output of decoder layer j "
                              "(= vLLM id j+1)")
DFLASH_LAYER_ID_CONVENTION = ("dflash: dflash_config.target_layer_ids j is the output of decoder "
                              "layer j (= vLLM id j+1; vLLM adds 1)")
BLOCK_ARCHITECTURE = "DFlashDraftModel"    # z-lab's; vLLM's registry -> DFlashQwen3ForCausalLM


# --- names, shapes, config --------------------------------------------------------------------

def _attention_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """midlayer.self_attn.* weight shapes: Llama q/k/v/o, or MLA (mla.py; vLLM's names)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    a = "midlayer.self_attn."
    if cfg.layer == "mla":
        qk, r = cfg.qk_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q = {a + "q_a_proj.weight": (cfg.q_lora_rank, 2 * h),
                 a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                 a + "q_b_proj.weight": (nh * qk, cfg.q_lora_rank)}
        else:
            q = {a + "q_proj.weight": (nh * qk, 2 * h)}
        return {**q,
                a + "kv_a_proj_with_mqa.weight": (r + cfg.qk_rope_head_dim, 2 * h),
                a + "kv_a_layernorm.weight": (r,),
                a + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
                a + "o_proj.weight": (h, nh * cfg.v_head_dim)}
    q, kv = nh * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {a + "q_proj.weight": (q, 2 * h), a + "k_proj.weight": (kv, 2 * h),
            a + "v_proj.weight": (kv, 2 * h), a + "o_proj.weight": (h, q)}


def _block_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """A block (DFlash) drafter's tensors but the vocabulary ones: block.BlockDrafter's names,
    which are vLLM's DFlashQwen3Model's (its loader prefixes "model.")."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,)}
    for j in range(cfg.block_layers):
        p = f"layers.{j}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of a drafter checkpoint -> (shape, required dtype or None for any float)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    vocab = {"norm.weight": ((h,), None),
             "lm_head.weight": ((cfg.draft_vocab_size, h), None),
             "d2t": ((cfg.draft_vocab_size,), torch.int64),
             "t2d": ((cfg.vocab_size,), torch.bool)}
    if cfg.drafting == "block":
        return {**{k: (shape, None) for k, shape in _block_shapes(cfg).items()}, **vocab}
    parallel = {"mask_hidden": ((3 * h,), None)} if cfg.parallel else {}   # P-EAGLE, vLLM's name
    fc_norm = {f"fc_norm.{j}.weight": ((h,), None) for j in range(3)} if cfg.fc_norm else {}
    return {**parallel, **fc_norm,
        "fc.weight": ((h, 3 * h), None),
        **{k: (shape, None) for k, shape in _attention_shapes(cfg).items()},
        "midlayer.mlp.gate_proj.weight": ((i, h), None),
        "midlayer.mlp.up_proj.weight": ((i, h), None),
        "midlayer.mlp.down_proj.weight": ((h, i), None),
        "midlayer.input_layernorm.weight": ((h,), None),
        "midlayer.hidden_norm.weight": ((h,), None),
        "midlayer.post_attention_layernorm.weight": ((h,), None),
        **vocab,
    }


def check_state_dict(state: dict[str, torch.Tensor], cfg: DraftConfig, where: str) -> None:
    """Raise ValueError naming `where` and every missing / unexpected / misshaped tensor."""
    want = expected_shapes(cfg)
    problems = [f"missing {k}" for k in want if k not in state]
    problems += [f"unexpected {k}" for k in state if k not in want]
    for k, (shape, dtype) in want.items():
        t = state.get(k)
        if t is None:
            continue
        if tuple(t.shape) != shape:
            problems.append(f"{k} has shape {list(t.shape)}, expected {list(shape)}")
        if dtype is not None and t.dtype != dtype:
            problems.append(f"{k} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.is_floating_point():
            problems.append(f"{k} has dtype {t.dtype}, expected a float type")
    if problems:
        raise ValueError(f"{where}: not a drafter for this config: " + "; ".join(problems))
    check_mapping(state["d2t"], state["t2d"], where)


def _dtype_name(state: dict[str, torch.Tensor]) -> str:
    return str(state["fc.weight"].dtype).removeprefix("torch.")


# The MLA drafter's architecture per engine: vLLM registers both names for deepseek_eagle3.py's
# Eagle3DeepseekV2ForCausalLM; SGLang's kimi_k25_eagle3.py registers only the V2 name.
MLA_ARCHITECTURES = {"vllm": "Eagle3DeepseekV3ForCausalLM", "sglang": "Eagle3DeepseekV2ForCausalLM"}


def _layer_config(cfg: DraftConfig, fmt: str | None) -> dict:
    """The decoder layer's part of config.json: LlamaForCausalLMEagle3's, or for an MLA layer
    a DeepseekV2 config that vLLM's deepseek_eagle3.py / SGLang's kimi_k25_eagle3.py build the
    layer from (q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v_head_dim, interleaved rope); its
    MLP is dense in both whatever the MoE keys say, which state it anyway (no routed experts,
    first_k_dense_replace 1: every one of its 1 layers dense)."""
    common = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads}
    if cfg.layer != "mla":
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **common,
                "head_dim": cfg.head_dim}
    # model_type deepseek_v2, not _v3: vLLM's SpeculativeConfig.hf_config_override turns any
    # draft config of model_type deepseek_v3 (or _v32, glm_moe_dsa) into a deepseek_mtp one,
    # architectures ["DeepSeekMTPModel"] whatever they were ("Model architectures
    # ['Eagle3DeepSeekMTPModel'] are not supported"; vllm/config/speculative.py, 0.32). The
    # DeepseekV2 config carries the same MLA keys, and both engines build the same layer.
    return {"architectures": [MLA_ARCHITECTURES.get(fmt, MLA_ARCHITECTURES["vllm"])],
            "model_type": "deepseek_v2", **common,
            **{k: getattr(cfg, k) for k in mla.MLA_KEYS},
            "rope_interleave": True, "first_k_dense_replace": 1, "n_routed_experts": 0}


def engine_config(cfg: DraftConfig, torch_dtype: str, fmt: str | None = None) -> dict:
    """config.json body in the SGLang/vLLM LlamaForCausalLMEagle3 layout (an MLA layer: the
    Eagle3DeepseekV3ForCausalLM one, _layer_config; fmt "sglang" names SGLang's architecture).
    One config both engines read as trained: the top-level ids are vLLM's (the input of layer
    i), eagle_config's are SGLang's (the output of layer j = i - 1). fc_norm / norm_output:
    EAGLE-3.1's toggles as vLLM (llama_eagle3.py, deepseek_eagle3.py) and SGLang's MLA drafter
    read them."""
    if cfg.drafting == "block":
        return block_config(cfg, torch_dtype)
    ids = verifier.check_layer_ids(cfg.aux_layer_ids, where="DraftConfig.aux_layer_ids")
    return {
        **_layer_config(cfg, fmt),
        "num_hidden_layers": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "hidden_act": cfg.hidden_act,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "norm_before_residual": NORM_BEFORE_RESIDUAL,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        # vLLM reads the top-level ids (eagle3_utils.py); SGLang reads eagle_config's only.
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(ids),
                         "use_aux_hidden_state": True},
        # P-EAGLE: vLLM reads mask_token_id (llm_base_proposer._init_parallel_drafting_params)
        # when the user's speculative_config says "parallel_drafting": true; the second key
        # says so to our serve/bench code, which sets it (serve/vllm.py)
        **({"mask_token_id": cfg.mask_token_id, "parallel_drafting": True}
           if cfg.parallel else {}),
    }


def dflash_layer_ids(vllm_ids: list[int]) -> list[int]:
    """vLLM-convention aux ids (input of layer i) -> DFlash's target_layer_ids (the output of
    layer j = i - 1): vLLM captures the input of j + 1 for each (eagle3_utils.py,
    get_eagle3_aux_layers_from_config, "Add 1 to convert DFlash's aux layer id semantics")."""
    return [i - 1 for i in verifier.check_layer_ids(vllm_ids)]


def block_config(cfg: DraftConfig, torch_dtype: str) -> dict:
    """config.json body of a block drafter in the layout vLLM's `dflash` method loads (module
    docstring): a Qwen3 config of the drafter's own shapes, architectures DFlashDraftModel
    (registry: qwen3_dflash.DFlashQwen3ForCausalLM), and dflash_config. Block size: DFlash's
    convention, the query slots of a round INCLUDING the bonus token (z-lab's "block_size":
    16 is served with num_speculative_tokens 15), so it is DraftConfig.block_size + 1; vLLM
    itself takes the drafts per round from num_speculative_tokens only. Aux ids: only
    dflash_config.target_layer_ids (dflash_layer_ids, = vLLM ids - 1); no top-level
    eagle_aux_hidden_state_layer_ids, which vLLM would read first and as-is."""
    ids = verifier.check_layer_ids(cfg.aux_layer_ids, where="DraftConfig.aux_layer_ids")
    slots = cfg.block_size + 1
    return {
        "architectures": [BLOCK_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.block_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "block_size": slots,
        # causal False: every layer attends over the whole block (vLLM qwen3_dflash.py
        # _dflash_layer_causal reads this override first; non-causal is also its default)
        "dflash_config": {"mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": dflash_layer_ids(ids),
                          "block_size": slots, "causal": False},
    }


def _ours(cfg: DraftConfig, **extra) -> dict:
    """Our block inside config.json: the full DraftConfig and the layer-id convention."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "layer_id_convention": schema.LAYER_ID_CONVENTION, "draft_config": cfg.to_dict(),
            **extra}


def _engine_json(cfg: DraftConfig, torch_dtype: str, **extra) -> dict:
    """engine_config + our block, saying which convention each of the two id keys uses."""
    convention = ({"dflash_layer_id_convention": DFLASH_LAYER_ID_CONVENTION}
                  if cfg.drafting == "block" else
                  {"eagle_config_layer_id_convention": SGLANG_LAYER_ID_CONVENTION})
    return dict(engine_config(cfg, torch_dtype, extra.get("export")),
                eagle3_ray=_ours(cfg, **convention, **extra))


def manifest_hash(manifest: dict) -> str:
    """Stable 16-hex hash of a dataset manifest's facts and file list (name, rows, tokens,
    bytes); ignores creation time, run summary and extraction config."""
    if "facts" not in manifest or "files" not in manifest:
        raise ValueError("manifest_hash: the manifest needs 'facts' and 'files'")
    files = sorted([f.get("name"), f.get("rows"), f.get("tokens"), f.get("bytes")]
                   for f in manifest["files"])
    body = json.dumps({"facts": manifest["facts"], "files": files}, sort_keys=True, default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


# --- atomic directory writes -----------------------------------------------------------------

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _publish(tmp: str, directory: str) -> None:
    """Move the finished temp dir to `directory`, replacing an old one only once the new one
    is complete; a crash at any point leaves `directory` either absent, old, or new."""
    old = None
    if os.path.lexists(directory):
        old = f"{directory}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _write_dir(directory: str, tensors: dict[str, torch.Tensor], config: dict,
               meta: dict | None) -> None:
    """Write model.safetensors + config.json (+ meta.json) into a temp dir next to
    `directory`, fsync them, then rename it into place."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        _write_json(os.path.join(tmp, CONFIG), config)
        written = [WEIGHTS, CONFIG]
        if meta is not None:
            meta = dict(meta, files={n: {"bytes": os.path.getsize(os.path.join(tmp, n)),
                                         "sha256": _sha256(os.path.join(tmp, n))}
                                     for n in written})
            _write_json(os.path.join(tmp, META), meta)
            written.append(META)
        for n in written:
            _fsync(os.path.join(tmp, n))
        _publish(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- save / load ------------------------------------------------------------------------------

def save_drafter(directory: str, state_dict: dict[str, torch.Tensor], config: DraftConfig,
                 meta: dict | None = None) -> str:
    """Write a drafter checkpoint directory atomically; returns its absolute path.

    `state_dict` holds the SGLang/vLLM names (see expected_shapes) plus d2t/t2d;
    embed_tokens.weight and rotary_emb.* buffers are dropped, any other name is an error.
    `meta` (ttt_steps, dataset_manifest_hash, metrics, ...) is stored in meta.json with the
    tool version and creation time."""
    state = {k: v for k, v in state_dict.items() if not _dropped(k)}
    check_state_dict(state, config, f"save_drafter({directory})")
    verifier.check_layer_ids(config.aux_layer_ids,
                             where=f"save_drafter({directory}): DraftConfig.aux_layer_ids")
    cfg_json = _engine_json(config, _dtype_name(state))
    meta = dict(meta or {})
    meta.setdefault("tool_version", __version__)
    meta.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    meta["format"], meta["format_version"] = FORMAT, FORMAT_VERSION
    _write_dir(directory, state, cfg_json, meta)
    return os.path.abspath(directory)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def _draft_config(block: dict, path: str) -> DraftConfig:
    names = {f.name for f in dataclasses.fields(DraftConfig)}
    d = block.get("draft_config")
    if not isinstance(d, dict):
        raise ValueError(f"{path}: no eagle3_ray.draft_config; not an eagle3_ray drafter "
                         "checkpoint (exported engine directories cannot be loaded back)")
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{path}: unknown DraftConfig fields {unknown} (written by a newer "
                         "eagle3_ray?)")
    try:
        return DraftConfig(**d)
    except TypeError as e:
        raise ValueError(f"{path}: bad draft_config ({e})") from None


def read_drafter_config(directory: str) -> tuple[DraftConfig, dict]:
    """(DraftConfig, meta) of a checkpoint written by save_drafter, weights unread; checks the
    files are complete. Errors name the missing or malformed file."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: no such drafter checkpoint directory")
    for name in FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: missing; {directory} is not a complete "
                                    "eagle3_ray drafter checkpoint")
    meta_path, cfg_path = os.path.join(directory, META), os.path.join(directory, CONFIG)
    meta = _read_json(meta_path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta['format_version']} is newer than "
                         f"this eagle3_ray understands ({FORMAT_VERSION})")
    for name, info in (meta.get("files") or {}).items():
        size = os.path.getsize(os.path.join(directory, name))
        if size != info.get("bytes"):
            raise ValueError(f"{os.path.join(directory, name)}: {size} bytes, meta.json says "
                             f"{info.get('bytes')}; the file is truncated or was replaced")
    return _draft_config(_read_json(cfg_path).get("eagle3_ray") or {}, cfg_path), meta


def load_drafter(directory: str) -> tuple[dict[str, torch.Tensor], DraftConfig, dict]:
    """Read a checkpoint written by save_drafter -> (state_dict, DraftConfig, meta)."""
    cfg, meta = read_drafter_config(directory)
    w_path = os.path.join(directory, WEIGHTS)
    try:
        state = load_file(w_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{w_path}: not a readable safetensors file ({e})") from None
    check_state_dict(state, cfg, w_path)
    return state, cfg, meta


def check_drafter(directory: str, vcfg, verifier_name: str = "the verifier") -> dict:
    """Refuse a drafter that does not fit a verifier (its transformers config `vcfg`): hidden
    size, vocab, aux layer ids, the verifier config hash it was trained on. Reads only the
    drafter's config/meta JSON. Returns its meta. (Both servers, serve/app.py and serve/vllm.py,
    call it from here: neither imports the other for it.)"""
    c, meta = read_drafter_config(directory)
    text = verifier.text_config(vcfg)              # shapes: the text model's
    problems = []
    if c.hidden_size != text.hidden_size:
        problems.append(f"hidden_size {c.hidden_size} != verifier {text.hidden_size}")
    if c.vocab_size != text.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} != verifier {text.vocab_size}")
    try:
        verifier.check_layer_ids(c.aux_layer_ids, text.num_hidden_layers)
    except ValueError as e:
        problems.append(str(e))
    want = (meta.get("verifier_facts") or {}).get("verifier_config_hash")
    if want and want != verifier.config_hash(vcfg):
        problems.append(f"trained on verifier config {want}, this verifier's is "
                        f"{verifier.config_hash(vcfg)}")
    if problems:
        raise ValueError(f"drafter {directory} does not match verifier {verifier_name}: "
                         + "; ".join(problems))
    return meta


# --- export -----------------------------------------------------------------------------------

EXPORT_DTYPES = ("bfloat16", "float16", "float32")
# Both engines build the drafter's MLP from their Llama MLP, which refuses any other activation
# (vllm/model_executor/models/llama.py and python/sglang/srt/models/llama.py, LlamaMLP).
ENGINE_ACTIVATION = "silu"


def sglang_layer_ids(vllm_ids: list[int]) -> list[int]:
    """vLLM-convention aux ids (input of layer i) -> SGLang config ids (i - 1): SGLang adds 1
    to each configured id (python/sglang/srt/models/llama.py, set_eagle3_layers_to_capture)."""
    return [i - 1 for i in verifier.check_layer_ids(vllm_ids)]


def _verifier_dir(spec: str | None, why: str) -> str:
    """The verifier's transformers directory (a GGUF verifier is materialized), absolute."""
    if not spec:
        raise ValueError(f"export: {why}, and meta.json names no verifier: pass --verifier-path")
    try:
        return os.path.abspath(verifier.materialize(spec))
    except FileNotFoundError as e:
        raise ValueError(f"export: {why}, but the verifier {spec!r} is not here ({e}); pass "
                         "--verifier-path") from None


def verifier_dtype(directory: str) -> str:
    """The dtype a verifier's config.json names ("dtype", or "torch_dtype" before transformers
    5); float32 when it names none, as transformers and the engines read such a config."""
    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    return str(c.get("dtype") or c.get("torch_dtype") or "float32").removeprefix("torch.")


def check_loadable_verifier(directory: str) -> str:
    """speculators' Eagle3DraftModel.from_pretrained reads `verifier.name_or_path` as a local
    directory (else a model-hub id): its config.json (AutoConfig) and the embedding / lm_head
    from model.safetensors or the shards of model.safetensors.index.json
    (src/speculators/utils/loading.py, load_model_layers). Refuse a path that lacks them."""
    files = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    if "config.json" not in files or not {WEIGHTS, WEIGHTS + ".index.json"} & files:
        raise ValueError(f"export: verifier path {directory} has no config.json + "
                         f"{WEIGHTS}(.index.json): speculators could not load it; pass "
                         "--verifier-path with the verifier's transformers directory")
    return directory


def _speculators_config(cfg: DraftConfig, dtype: str, verifier_path: str,
                        speculative_tokens: int) -> dict:
    layer = {
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "torch_dtype": dtype,
    }
    with open(os.path.join(verifier_path, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": NORM_BEFORE_RESIDUAL,
        "norm_before_fc": False, "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output,
        "target_hidden_size": cfg.hidden_size,
        # vLLM's speculators reader (algos.py, update_eagle3) and speculators read this one
        # list, as vLLM ids; no engine reads an eagle_config here.
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_path, "architectures": architectures},
        },
        "eagle3_ray": _ours(cfg, export="speculators"),
    }


def _speculators_weights(state: dict[str, torch.Tensor], cfg: DraftConfig) -> dict:
    out = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
           for k, v in state.items()}
    if cfg.draft_vocab_size == cfg.vocab_size:   # speculators registers no d2t/t2d then
        out.pop("d2t"), out.pop("t2d")
    return out


def export(src_dir: str, out_dir: str, format: str, verifier_path: str | None = None,
           speculative_tokens: int | None = None, dtype: str | None = None) -> str:
    """Write `out_dir` with what `format` ("sglang", "vllm", "speculators") loads for an
    EAGLE-3 drafter: model.safetensors + config.json, its float tensors and torch_dtype in
    `dtype` (default: the verifier's, as its config.json names it; training keeps fp32).
    `verifier_path` (default meta.json's "verifier"; a directory, .gguf or embedded:smollm2,
    materialized) gives that dtype and, for "speculators", speculators_config.verifier
    .name_or_path, which must load (check_loadable_verifier). `speculative_tokens` (default
    meta.json's "serving_depth", else "ttt_steps", else 3) fills speculators_config.
    Refuses a drafter whose activation is not silu (no engine loads one). Returns out_dir."""
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export format {format!r}: choose one of {EXPORT_FORMATS}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(f"export --dtype {dtype!r}: choose one of {EXPORT_DTYPES}")
    state, cfg, meta = load_drafter(src_dir)
    verifier.check_layer_ids(cfg.aux_layer_ids, where=f"{src_dir}: DraftConfig.aux_layer_ids")
    if cfg.hidden_act != ENGINE_ACTIVATION:
        raise ValueError(f"{src_dir}: hidden_act {cfg.hidden_act!r}; SGLang's and vLLM's Llama "
                         f"MLP (the EAGLE-3 drafter's) support only {ENGINE_ACTIVATION!r}, so no "
                         "engine would load this export (eagle3-ray serve runs it)")
    if cfg.parallel and format != "vllm":
        raise ValueError(f"{src_dir}: a parallel (P-EAGLE) drafter exports for vLLM only "
                         f"(format 'vllm'); {format!r} has no parallel drafting we can target "
                         "(SGLang: PR #27498 not merged)")
    refuse_block_export(cfg, format, src_dir)
    refuse_layer_export(cfg, format, src_dir)
    spec = verifier_path or meta.get("verifier")
    vdir = None
    if format == "speculators":
        vdir = check_loadable_verifier(_verifier_dir(spec, "speculators needs the verifier's "
                                                           "path (speculators_config.verifier)"))
    if dtype is None:
        dtype = verifier_dtype(vdir or _verifier_dir(spec, "the export dtype is the "
                                                           "verifier's (or pass --dtype)"))
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"export: verifier dtype {dtype!r} is none of {EXPORT_DTYPES}; "
                             "pass --dtype")
    to = getattr(torch, dtype)
    state = {k: v.to(to) if v.is_floating_point() else v for k, v in state.items()}
    if format in ("sglang", "vllm"):
        tensors, config = state, _engine_json(cfg, dtype, export=format)
        if format == "vllm" and cfg.draft_vocab_size == cfg.vocab_size:
            # vLLM's Eagle3LlamaForCausalLM registers draft_id_to_target_id only for a reduced
            # draft vocab, and refuses the tensor otherwise ("no module or parameter named")
            tensors = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    else:
        k = speculative_tokens or meta.get("serving_depth") or meta.get("ttt_steps") or 3
        tensors = _speculators_weights(state, cfg)
        config = _speculators_config(cfg, dtype, vdir, k)
    _write_dir(out_dir, tensors, config, None)
    return os.path.abspath(out_dir)


def refuse_block_export(cfg: DraftConfig, format: str, where: str) -> None:
    """A block (DFlash) drafter exports for vLLM only; refuse the others by name and reason."""
    if cfg.drafting != "block" or format == "vllm":
        return
    if format == "sglang":
        raise ValueError(f"{where}: a block (DFlash) drafter has no SGLang export: SGLang's "
                         "DFlashDraftModel (python/sglang/srt/models/dflash.py) has no lm_head "
                         "and no d2t, it drafts through the target's lm_head and skips unknown "
                         "weights silently, so our trained lm_head (draft vocabulary) would be "
                         "dropped and SGLang would run another model; export --format vllm")
    raise ValueError(f"{where}: a block (DFlash) drafter has no {format} export: speculators "
                     "has no DFlash / block format (its models are EAGLE-3 chains); export "
                     "--format vllm")


def refuse_layer_export(cfg: DraftConfig, format: str, where: str) -> None:
    """Refuse, by name and reason, a layer shape / EAGLE-3.1 toggle `format`'s loader lacks."""
    if cfg.layer == "mla" and format == "speculators":
        raise ValueError(f"{where}: an MLA drafter has no speculators export: speculators' "
                         "Eagle3 models are Llama/Qwen3 layers and vLLM's speculators reader "
                         "(transformers_utils/configs/speculators/algos.py) maps model_type "
                         "llama/qwen3 only; export --format vllm (Eagle3DeepseekV3ForCausalLM)")
    if cfg.layer == "mla" and not cfg.q_lora_rank and format in ("vllm", "sglang"):
        raise ValueError(f"{where}: an MLA drafter without q-LoRA (q_lora_rank None) does not "
                         f"load in {format}: vLLM's deepseek_eagle3.py maps kv_a_proj_with_mqa "
                         "into fused_qkv_a_proj, which exists only with q-LoRA, and SGLang's "
                         "kimi_k25_eagle3.py refuses it; train with a q_lora_rank")
    if cfg.layer != "mla" and format == "sglang" and (cfg.fc_norm or cfg.norm_output):
        raise ValueError(f"{where}: fc_norm / norm_output (EAGLE-3.1) with a Llama layer have "
                         "no SGLang export: SGLang's llama_eagle3.py (LlamaForCausalLMEagle3) "
                         "reads neither and skips fc_norm.* weights silently, so it would run "
                         "another model; export --format vllm")


def check_names(model, state: dict, where: str) -> None:
    """Saved drafter weights name exactly the drafter's tensors, with the drafter's shapes,
    the frozen embedding (the verifier's, rebuilt on load) optional."""
    frozen = {"embed_tokens.weight"}
    mine = model.state_dict()
    missing, unexpected = sorted(set(mine) - frozen - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not fit the drafter "
                         f"(missing {missing}, unexpected {unexpected})")
    for name, t in state.items():
        if tuple(t.shape) != tuple(mine[name].shape):       # DTensor: the whole tensor's shape
            raise ValueError(f"{where}: {name} is {tuple(t.shape)} there and "
                             f"{tuple(mine[name].shape)} in this drafter (resume with the "
                             "settings the run started with)")


def load_weights(model, state: dict, where: str) -> None:
    """Load drafter weights saved without the frozen embedding into a plain module."""
    check_names(model, state, where)
    model.load_state_dict(state, strict=False)


def load_trained_drafter(drafter_dir: str, spec: str | None = None, teacher_check: bool = False):
    """A saved drafter directory -> (drafter, teacher, meta), embedding from the verifier
    (`spec`, default: the one it was trained with); see draft.build_drafter for teacher_check."""
    state, dcfg, meta = load_drafter(drafter_dir)
    drafter, teacher = kinds.build(spec or meta["verifier"], dcfg, state["d2t"], state["t2d"],
                                   teacher_check=teacher_check, init="random")
    load_weights(drafter, state, drafter_dir)
    return drafter.eval(), teacher, meta
