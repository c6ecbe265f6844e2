"""Drafter checkpoint: save/load round trip, atomicity, clear errors, engine exports, and each
export read back by the engines' own rules (names, shapes, aux ids, d2t) to the same step 0."""
import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_ray.data import schema
from eagle3_ray.train import checkpoint, vocab
from eagle3_ray.train.draft import DraftConfig

AUX = [2, 4, 5]          # vLLM convention -> SGLang [1, 3, 4]


def tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=100, draft_vocab_size=40, aux_layer_ids=AUX,
                rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    base.update(kw)
    return DraftConfig(**base)


def random_state(cfg: DraftConfig, seed: int = 0, dtype=torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g).to(dtype)
             for k, (shape, dt) in checkpoint.expected_shapes(cfg).items() if dt is None}
    counts = np.random.default_rng(seed).integers(0, 50, cfg.vocab_size)
    state["d2t"], state["t2d"] = vocab.build_mapping(counts, cfg.draft_vocab_size)
    state["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)   # dropped
    state["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(cfg.head_dim // 2)  # dropped
    return state


META = {"ttt_steps": 12, "dataset_manifest_hash": "abc123", "metrics": {"acc_0": 0.7}}


def fake_verifier(directory, dtype: str | None = "bfloat16", weights: bool = True) -> str:
    """What export reads of a verifier: config.json (+ model.safetensors, which speculators
    loads the embedding from)."""
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "num_hidden_layers": 8, "vocab_size": 100}
    if dtype:
        config["dtype"] = dtype
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    if weights:
        save_file({"model.embed_tokens.weight": torch.zeros(100, 32)},
                  os.path.join(directory, "model.safetensors"))
    return str(directory)


def engine_inputs(config: dict) -> dict:
    """Which verifier layers' *inputs* each engine feeds the fc, in fc order, by its own rules:
    - vLLM: vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
      (get_eagle3_aux_layers_from_config) takes the top-level eagle_aux_hidden_state_layer_ids
      (versions that lack it fall back to eagle_config's: vllm/v1/worker/gpu_model_runner.py);
      vllm/model_executor/models/llama.py appends `hidden_states + residual` before layer idx
      when `idx in self.aux_hidden_state_layers`, walking the layers in order: ascending.
    - SGLang: python/sglang/srt/model_executor/model_runner.py reads only
      eagle_config["eagle_aux_hidden_state_layer_ids"]; python/sglang/srt/models/llama.py
      set_eagle3_layers_to_capture sets layers_to_capture = [val + 1 ...] and LlamaModel.forward
      appends `hidden_states + residual` before layer i `if i in self.layers_to_capture`, in
      layer order: ascending. (SpecForge captures through the same SGLang call.)"""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    vllm = top or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    out = {"vllm": sorted(vllm)}
    if "eagle_config" in config:
        sglang = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        out["sglang"] = sorted(j + 1 for j in sglang)
    return out


@pytest.fixture
def saved(tmp_path):
    cfg, state = tiny_config(), random_state(tiny_config())
    meta = dict(META, verifier=fake_verifier(tmp_path / "verifier"))
    d = checkpoint.save_drafter(str(tmp_path / "drafter"), state, cfg, meta)
    return d, state, cfg


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_round_trip(saved):
    d, state, cfg = saved
    assert sorted(os.listdir(d)) == ["config.json", "meta.json", "model.safetensors"]
    loaded, cfg2, meta = checkpoint.load_drafter(d)
    expected = {k: v for k, v in state.items() if k in checkpoint.expected_shapes(cfg)}
    assert_same(loaded, expected)
    assert cfg2 == cfg
    for k, v in META.items():
        assert meta[k] == v
    assert meta["tool_version"] and meta["created"] and meta["files"]["model.safetensors"]["sha256"]
    config = json.load(open(os.path.join(d, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle3_ray"]["layer_id_convention"] == schema.LAYER_ID_CONVENTION
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX                  # vLLM reads this
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang this
    assert engine_inputs(config) == {"vllm": AUX, "sglang": AUX}  # the same tensors, as trained
    assert config["torch_dtype"] == "bfloat16"


def test_overwrite_and_save_rejects_bad_state(tmp_path, saved):
    d, state, cfg = saved
    state2 = random_state(cfg, seed=1, dtype=torch.float32)
    checkpoint.save_drafter(d, state2, cfg, {"ttt_steps": 3})
    loaded, _, meta = checkpoint.load_drafter(d)
    assert torch.equal(loaded["fc.weight"], state2["fc.weight"]) and meta["ttt_steps"] == 3
    assert not [n for n in os.listdir(os.path.dirname(d)) if n.startswith(".")]  # no leftovers

    bad = dict(state2)
    bad["lm_head.weight"] = torch.zeros(41, 32)
    bad["rotary.inv_freq"] = torch.zeros(4)
    with pytest.raises(ValueError) as err:
        checkpoint.save_drafter(str(tmp_path / "bad"), bad, cfg)
    assert "unexpected rotary.inv_freq" in str(err.value)
    assert "lm_head.weight has shape [41, 32], expected [40, 32]" in str(err.value)
    bad = dict(state2)
    del bad["t2d"]
    with pytest.raises(ValueError, match="missing t2d"):
        checkpoint.save_drafter(str(tmp_path / "bad"), bad, cfg)
    bad = dict(state2, d2t=state2["d2t"] + 1)
    with pytest.raises(ValueError, match="disagree"):
        checkpoint.save_drafter(str(tmp_path / "bad"), bad, cfg)
    assert not os.path.exists(tmp_path / "bad")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "meta.json"])
def test_missing_file_named(saved, name):
    d, _, _ = saved
    os.remove(os.path.join(d, name))
    with pytest.raises(FileNotFoundError, match=name):
        checkpoint.load_drafter(d)


def test_malformed_files_named(saved, tmp_path):
    d, _, _ = saved
    with pytest.raises(FileNotFoundError, match="no such"):
        checkpoint.load_drafter(str(tmp_path / "nope"))
    w = os.path.join(d, "model.safetensors")
    data = open(w, "rb").read()
    open(w, "wb").write(data[: len(data) // 2])                  # truncated weights
    with pytest.raises(ValueError, match="model.safetensors.*truncated"):
        checkpoint.load_drafter(d)
    open(w, "wb").write(b"\x00" * len(data))                     # same size, garbage
    with pytest.raises(ValueError, match="model.safetensors.*safetensors"):
        checkpoint.load_drafter(d)
    open(w, "wb").write(data)
    c = os.path.join(d, "config.json")
    size = os.path.getsize(c)
    open(c, "w").write("{not json".ljust(size))                 # same size, not JSON
    with pytest.raises(ValueError, match="config.json.*JSON"):
        checkpoint.load_drafter(d)
    open(c, "w").write("{not json")                             # another size
    with pytest.raises(ValueError, match="config.json.*truncated"):
        checkpoint.load_drafter(d)


def test_crash_leaves_no_complete_looking_checkpoint(tmp_path, saved, monkeypatch):
    d, state, cfg = saved
    real = checkpoint._write_json

    def crash_on_meta(path, obj):
        if path.endswith("meta.json"):
            raise KeyboardInterrupt("simulated crash")
        real(path, obj)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda *a, **k: None)  # a kill cleans nothing
    monkeypatch.setattr(checkpoint, "_write_json", crash_on_meta)
    new = str(tmp_path / "new")
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_drafter(new, state, cfg, META)
    assert not os.path.exists(new)
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert leftovers                                          # the half-written temp dir ...
    with pytest.raises(FileNotFoundError, match="meta.json"):  # ... is not a checkpoint
        checkpoint.load_drafter(str(tmp_path / leftovers[0]))
    with pytest.raises(FileNotFoundError):
        checkpoint.load_drafter(new)

    with pytest.raises(KeyboardInterrupt):                    # crash while overwriting
        checkpoint.save_drafter(d, random_state(cfg, seed=5), cfg, META)
    loaded, _, _ = checkpoint.load_drafter(d)                 # the old one is intact
    assert torch.equal(loaded["fc.weight"], state["fc.weight"])


def _export(saved, tmp_path, fmt, **kw):
    d, state, cfg = saved
    out = checkpoint.export(d, str(tmp_path / fmt), fmt, **kw)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    weights = load_file(os.path.join(out, "model.safetensors"))
    config = json.load(open(os.path.join(out, "config.json")))
    expected = {k: v for k, v in state.items() if k in checkpoint.expected_shapes(cfg)}
    return weights, config, expected, cfg


def _check_llama_eagle3_config(config, cfg):
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == 100 and config["draft_vocab_size"] == 40
    assert config["target_hidden_size"] == 32 and config["hidden_size"] == 32
    assert config["head_dim"] == 8 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    assert config["rope_theta"] == 50000.0 and config["rope_scaling"]["rope_type"] == "llama3"
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    # One config both engines read as trained: top level vLLM ids, eagle_config SGLang ids.
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]   # i - 1
    assert engine_inputs(config) == {"vllm": AUX, "sglang": AUX}
    assert config["torch_dtype"] == "bfloat16"                  # the (fake) verifier's dtype


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_export_llama_eagle3(saved, tmp_path, fmt):
    weights, config, expected, cfg = _export(saved, tmp_path, fmt)
    assert_same(weights, expected)
    assert "embed_tokens.weight" not in weights
    _check_llama_eagle3_config(config, cfg)
    assert config["eagle3_ray"]["export"] == fmt


def test_export_speculators(saved, tmp_path):
    weights, config, expected, cfg = _export(saved, tmp_path, "speculators")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in expected.items()}
    assert_same(weights, renamed)
    assert "layers.0.self_attn.q_proj.weight" in weights and "d2t" in weights
    assert config["speculators_model_type"] == "eagle3"
    tl = config["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["vocab_size"] == 100 and tl["hidden_size"] == 32
    assert tl["num_hidden_layers"] == 1 and tl["head_dim"] == 8
    assert tl["torch_dtype"] == "bfloat16"
    assert config["draft_vocab_size"] == 40 and config["target_hidden_size"] == 32
    # vllm/transformers_utils/configs/speculators/algos.py (update_eagle3) passes these ids on
    # as-is: vLLM ids, as trained.
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX
    assert engine_inputs(config) == {"vllm": AUX}
    assert config["norm_before_residual"] is False
    sc = config["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 12,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}
    # speculators reads the verifier's config + embedding from name_or_path: the verifier's
    # directory, absolute (src/speculators/utils/loading.py load_model_layers, _resolve_file).
    verifier_dir = str(tmp_path / "verifier")
    assert sc["verifier"] == {"name_or_path": verifier_dir, "architectures": ["LlamaForCausalLM"]}
    other = fake_verifier(tmp_path / "other")
    _, config, _, _ = _export(saved, tmp_path, "speculators", verifier_path=other,
                              speculative_tokens=4)
    assert config["speculators_config"]["verifier"]["name_or_path"] == other
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


def test_speculators_verifier_must_load(saved, tmp_path):
    """A name_or_path speculators cannot load (the spec string a run used, a directory without
    weights) is refused and nothing is written."""
    d, state, cfg = saved
    out = str(tmp_path / "spec")
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"                 # no such directory here
    with pytest.raises(ValueError, match=f"{hub_id}.*--verifier-path"):
        checkpoint.export(d, out, "speculators", verifier_path=hub_id)
    config_only = fake_verifier(tmp_path / "config_only", weights=False)
    with pytest.raises(ValueError, match="config_only.*speculators could not load"):
        checkpoint.export(d, out, "speculators", verifier_path=config_only)
    plain = checkpoint.save_drafter(str(tmp_path / "plain"), state, cfg, {"ttt_steps": 3})
    with pytest.raises(ValueError, match="names no verifier.*--verifier-path"):
        checkpoint.export(plain, out, "speculators")
    assert not os.path.exists(out)


def test_export_dtype_is_the_verifiers(tmp_path):
    """Training keeps fp32 masters; the export is in the verifier's dtype (SGLang takes the
    draft's dtype from its config.json, python/sglang/srt/configs/model_config.py
    _get_and_verify_dtype: float32 or none -> float16 under "auto"), --dtype overrides, and
    torch_dtype always names the tensors' dtype."""
    cfg = tiny_config()
    state = random_state(cfg, dtype=torch.float32)
    meta = {"verifier": fake_verifier(tmp_path / "v_bf16", dtype="bfloat16")}
    d = checkpoint.save_drafter(str(tmp_path / "fp32"), state, cfg, meta)
    assert json.load(open(os.path.join(d, "config.json")))["torch_dtype"] == "float32"

    def exported(fmt, **kw):
        out = checkpoint.export(d, str(tmp_path / "out"), fmt, **kw)
        w = load_file(os.path.join(out, "model.safetensors"))
        c = json.load(open(os.path.join(out, "config.json")))
        named = c.get("torch_dtype") or c["transformer_layer_config"]["torch_dtype"]
        return {w[k].dtype for k in w if w[k].is_floating_point()}, named, w

    for fmt in checkpoint.EXPORT_FORMATS:
        dtypes, named, w = exported(fmt)
        assert dtypes == {torch.bfloat16} and named == "bfloat16", fmt
        assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    torch.testing.assert_close(w["fc.weight"].float(), state["fc.weight"], rtol=1e-2, atol=1e-2)
    assert exported("sglang", dtype="float16")[:2] == ({torch.float16}, "float16")
    no_dtype = fake_verifier(tmp_path / "v_none", dtype=None)     # transformers reads float32
    assert exported("vllm", verifier_path=no_dtype)[:2] == ({torch.float32}, "float32")
    with pytest.raises(ValueError, match="--dtype"):
        checkpoint.export(d, str(tmp_path / "x"), "vllm", dtype="int8")
    plain = checkpoint.save_drafter(str(tmp_path / "plain"), state, cfg, {})
    with pytest.raises(ValueError, match="names no verifier.*--verifier-path"):
        checkpoint.export(plain, str(tmp_path / "x"), "sglang")
    assert checkpoint.export(plain, str(tmp_path / "x"), "sglang", dtype="bfloat16")  # none needed


def test_export_refuses_an_activation_the_engines_refuse(tmp_path):
    """vllm/model_executor/models/llama.py and python/sglang/srt/models/llama.py: LlamaMLP
    raises 'Unsupported activation' for anything but silu; the engines' llama_eagle3.py build
    the drafter's MLP from it."""
    cfg = tiny_config(hidden_act="gelu")
    d = checkpoint.save_drafter(str(tmp_path / "gelu"), random_state(cfg), cfg,
                                {"verifier": fake_verifier(tmp_path / "v")})
    for fmt in checkpoint.EXPORT_FORMATS:
        with pytest.raises(ValueError, match="hidden_act 'gelu'.*silu"):
            checkpoint.export(d, str(tmp_path / fmt), fmt)
        assert not os.path.exists(tmp_path / fmt)


def _rewrite_layer_ids(directory: str, ids: list[int]) -> None:
    """An old checkpoint written before the rule: same-size config.json with other ids."""
    path = os.path.join(directory, "config.json")
    config = json.load(open(path))
    config["eagle3_ray"]["draft_config"]["aux_layer_ids"] = ids
    size = os.path.getsize(path)
    checkpoint._write_json(path, config)
    assert os.path.getsize(path) == size


def test_layer_ids_ascending_and_at_least_one(saved, tmp_path):
    """Ids < 1: vLLM's capture adds the residual, which does not exist before layer 0
    (vllm/model_executor/models/llama.py); SGLang's id would be -1. Unsorted: both engines
    concatenate in ascending layer order (engine_inputs), so the fc would see permuted blocks."""
    d, state, cfg = saved
    for ids, why in (([0, 3, 5], ">= 1"), ([5, 2, 4], r"ascending \(\[2, 4, 5\]\)"),
                     ([2, 2, 5], "3 distinct")):
        bad = tiny_config(aux_layer_ids=ids)
        with pytest.raises(ValueError, match=re.escape(f"aux_layer_ids {ids}") + ".*" + why):
            checkpoint.save_drafter(str(tmp_path / "bad"), random_state(bad), bad, META)
        assert not os.path.exists(tmp_path / "bad")
    for ids, why in (([5, 2, 4], "ascending"), ([0, 4, 5], ">= 1")):
        _rewrite_layer_ids(d, ids)
        for fmt in checkpoint.EXPORT_FORMATS:
            with pytest.raises(ValueError, match=re.escape(f"aux_layer_ids {ids}") + ".*" + why):
                checkpoint.export(d, str(tmp_path / fmt), fmt)
            assert not os.path.exists(tmp_path / fmt)


def test_export_full_vocab_and_errors(tmp_path, saved):
    cfg = tiny_config(draft_vocab_size=100)
    d = checkpoint.save_drafter(str(tmp_path / "full"), random_state(cfg), cfg,
                                {"verifier": fake_verifier(tmp_path / "v")})
    w = load_file(os.path.join(checkpoint.export(d, str(tmp_path / "s"), "speculators"),
                               "model.safetensors"))
    assert "d2t" not in w and "t2d" not in w                  # identity: speculators omits them
    w = load_file(os.path.join(checkpoint.export(d, str(tmp_path / "v"), "vllm"),
                               "model.safetensors"))
    assert "d2t" not in w and "t2d" not in w                  # vLLM registers none either
    with pytest.raises(ValueError, match="export format"):
        checkpoint.export(saved[0], str(tmp_path / "x"), "onnx")
    with pytest.raises(FileNotFoundError, match="meta.json"):
        checkpoint.load_drafter(str(tmp_path / "v"))          # an export is not a checkpoint


def test_manifest_hash():
    m = {"format": schema.FORMAT, "created": "t0", "summary": {"samples": 3},
         "facts": {"verifier": "x", "hidden_size": 64, "aux_layer_ids": [2, 4, 5]},
         "files": [{"name": "part-b.parquet", "rows": 2, "tokens": 20, "bytes": 100},
                   {"name": "part-a.parquet", "rows": 1, "tokens": 9, "bytes": 50}]}
    h = checkpoint.manifest_hash(m)
    assert len(h) == 16
    same = dict(m, created="t1", summary={}, files=list(reversed(m["files"])),
                facts=dict(reversed(list(m["facts"].items()))))
    assert checkpoint.manifest_hash(same) == h
    assert checkpoint.manifest_hash(dict(m, facts=dict(m["facts"], hidden_size=65))) != h
    assert checkpoint.manifest_hash(dict(m, files=m["files"][:1])) != h
    with pytest.raises(ValueError, match="facts"):
        checkpoint.manifest_hash({"files": []})


# --- round trip: every export read back by its engine's rules, step 0 as the engine runs it ---
# An independent reader, written from the engines' sources (no project code): which config keys
# it reads, the parameters it builds (names, shapes), what its load_weights does with each
# stored name, which verifier tensor each aux id selects, and the step-0 forward and d2t.
#   vllm/model_executor/models/llama_eagle3.py  Eagle3LlamaForCausalLM.load_weights: skips t2d,
#     d2t -> draft_id_to_target_id, "midlayer." -> "layers.0."; compute_logits scatters the
#     draft logits to targets = arange(Vd) + d2t, -inf elsewhere. LlamaDecoderLayer (layer 0):
#     residual = hidden (norm_before_residual False), cat([input_layernorm(embeds),
#     hidden_norm(hidden)]) -> qkv (2H in), attention, post_attention_layernorm(h, residual)
#     (fused add), MLP; LlamaModel: norm(h, residual); combine_hidden_states: fc (3 x
#     target_hidden_size in). The embedding is the target's (not in the checkpoint).
#   python/sglang/srt/models/llama_eagle3.py  the same layer math; load_weights: d2t ->
#     hot_token_id = d2t + arange, t2d skipped, other names loaded as-is or under "model."
#     (an unknown name is silently skipped, so the reader demands every parameter).
#   vllm/transformers_utils/configs/speculators/algos.py (update_eagle3): a speculators config
#     becomes the same Eagle3 config (transformer_layer_config + draft_vocab_size,
#     target_hidden_size, norm_before_residual default True, eagle_aux_hidden_state_layer_ids);
#     speculators' loader takes the embedding from speculators_config.verifier.name_or_path.

def read_export(directory: str, engine: str) -> dict:
    """An export directory as `engine` ("vllm" or "sglang") loads it -> {"cfg": the config
    values the engine uses, "params": {engine parameter name: tensor}, "targets": target id of
    each draft id, "aux_inputs": the verifier layers whose inputs feed the fc, in fc order,
    "embed_from": the directory the token embedding comes from}. Fails on a missing, unknown
    or misshaped parameter."""
    config = json.load(open(os.path.join(directory, "config.json")))
    stored = load_file(os.path.join(directory, "model.safetensors"))
    if "speculators_model_type" in config:                     # vLLM's speculators reader
        assert engine == "vllm" and config["speculators_model_type"] == "eagle3"
        cfg = dict(config["transformer_layer_config"],
                   draft_vocab_size=config["draft_vocab_size"],
                   target_hidden_size=config["target_hidden_size"],
                   norm_before_residual=config.get("norm_before_residual", True),
                   eagle_aux_hidden_state_layer_ids=config["eagle_aux_hidden_state_layer_ids"])
        embed_from = config["speculators_config"]["verifier"]["name_or_path"]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        cfg, embed_from = config, None
    aux_inputs = engine_inputs(cfg)[engine]
    assert cfg["norm_before_residual"] is False and not cfg["tie_word_embeddings"]
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter = cfg.get("head_dim") or h // nh, cfg["intermediate_size"]
    vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    layer = "midlayer." if engine == "sglang" else "layers.0."
    want = {"fc.weight": (h, 3 * cfg.get("target_hidden_size", h)), "norm.weight": (h,),
            "lm_head.weight": (vd, h),
            **{layer + k: s for k, s in {
                "self_attn.q_proj.weight": (nh * hd, 2 * h),
                "self_attn.k_proj.weight": (nkv * hd, 2 * h),
                "self_attn.v_proj.weight": (nkv * hd, 2 * h),
                "self_attn.o_proj.weight": (h, nh * hd),
                "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
                "mlp.down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
                "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,)}.items()}}
    params, d2t = {}, torch.zeros(vd, dtype=torch.int64)       # no d2t: the identity
    for name, t in stored.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            d2t = t
            continue
        params[name.replace("midlayer.", layer).replace("layers.0.", layer)] = t
    assert set(params) == set(want), (set(params) ^ set(want))
    for k, shape in want.items():
        assert tuple(params[k].shape) == shape, (k, tuple(params[k].shape), shape)
    assert d2t.dtype == torch.int64 and d2t.shape == (vd,)
    return {"cfg": cfg, "params": params, "layer": layer, "aux_inputs": aux_inputs,
            "targets": torch.arange(vd) + d2t, "embed_from": embed_from}


def engine_step0(r: dict, embed: torch.Tensor, aux: torch.Tensor,
                 tokens: torch.Tensor) -> torch.Tensor:
    """Step 0 as llama_eagle3.py computes it, in float64: aux [S, 3H] (the captured states,
    ascending layers), tokens [S] (the next token at each position) -> logits over the target
    vocabulary [S, V] (-inf outside the draft vocabulary, as vLLM's compute_logits)."""
    c, w = r["cfg"], {k: v.double() for k, v in r["params"].items()}
    p, eps, s = r["layer"], c["rms_norm_eps"], tokens.shape[0]
    nh, nkv, h = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    hd = c.get("head_dim") or h // nh
    assert c.get("rope_scaling") is None and c["hidden_act"] == "silu"

    def norm(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x):                                                # x [heads, S, hd], neox style
        inv = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(s, dtype=torch.float64)[:, None] * inv         # [S, hd/2]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    hidden = aux.double() @ w["fc.weight"].T                              # [S, H]
    residual = hidden
    x = torch.cat([norm(embed[tokens].double(), p + "input_layernorm.weight"),
                   norm(hidden, p + "hidden_norm.weight")], -1)            # [S, 2H]
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(s, nh, hd).transpose(0, 1))
    k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(s, nkv, hd).transpose(0, 1))
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(s, nkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(1, 2) / hd ** 0.5                            # [nh, S, S]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(s, nh * hd)   # [S, nh*hd]
    residual = attn @ w[p + "self_attn.o_proj.weight"].T + residual       # fused add + norm
    m = norm(residual, p + "post_attention_layernorm.weight")
    m = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
         * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    draft = norm(m + residual, "norm.weight") @ w["lm_head.weight"].T     # [S, Vd]
    full = torch.full((s, c["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, r["targets"]] = draft                                          # [S, V]
    return full


@pytest.fixture(scope="module")
def trained_like(tiny_verifier, tmp_path_factory):
    """A drafter for the tiny verifier with weights far from their init (so every aux block
    and every tensor matters) and a draft vocabulary whose d2t offsets are not zero, saved as
    training saves it; the verifier's inputs of every layer on one random sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from eagle3_ray.train import draft
    vcfg = AutoConfig.from_pretrained(tiny_verifier)
    dcfg = draft.DraftConfig.from_verifier_config(vcfg, 3000, [2, 4, 5])
    counts = np.random.default_rng(1).integers(0, 1000, vcfg.vocab_size)
    d2t, t2d = vocab.build_mapping(counts, dcfg.draft_vocab_size)
    assert int(d2t.abs().max()) > 1000
    torch.manual_seed(0)
    drafter, _ = draft.build_drafter(tiny_verifier, dcfg, d2t, t2d)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith(("fc.", "midlayer.")):
                p.copy_(torch.randn_like(p) * (0.15 if p.dim() == 2 else 1.0)
                        + (1.0 if p.dim() == 1 else 0.0))
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    root = tmp_path_factory.mktemp("roundtrip")
    d = checkpoint.save_drafter(str(root / "drafter"), state, dcfg,
                                {"verifier": tiny_verifier, "ttt_steps": 4})
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    ids = torch.randint(0, vcfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == vcfg.num_hidden_layers + 1     # hs[i] = the input of decoder layer i
    return {"dir": d, "root": root, "model": model, "ids": ids, "inputs": hs[:-1]}


def project_step0(d: str, spec: str, model, ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The project's own path: the drafter as serving loads it, the aux states as extraction
    captures them (verifier.forward_hidden's hooks), step 0 -> draft logits [S-1, Vd]."""
    from eagle3_ray.engine import hf as verifier
    from eagle3_ray.train.checkpoint import load_trained_drafter
    drafter = load_trained_drafter(d, spec)[0]
    aux, _, _ = verifier.forward_hidden(model, ids, torch.ones_like(ids),
                                        drafter.config.aux_layer_ids)    # [1, S, 3, H]
    aux = aux.reshape(1, ids.shape[1], -1)[:, :-1]                       # [1, S-1, 3H]
    with torch.no_grad():
        out = drafter(ids[:, 1:], aux, torch.arange(ids.shape[1] - 1)[None])
        return drafter.logits(out)[0], drafter                          # [S-1, Vd]


@pytest.mark.parametrize("fmt", checkpoint.EXPORT_FORMATS)
def test_exports_round_trip_through_the_engines_readers(trained_like, tiny_verifier, fmt):
    """Each export, read by each engine that loads that format (names, shapes, aux ids ->
    verifier tensors, d2t the engine's way), computes at step 0 what the project's drafter
    computes on the same hidden states: the same logits, the same target token."""
    t = trained_like
    out = checkpoint.export(t["dir"], str(t["root"] / fmt), fmt)
    ours, drafter = project_step0(t["dir"], tiny_verifier, t["model"], t["ids"])
    tokens = t["ids"][0, 1:]                                    # step 0: the next token at t
    engines = ["vllm"] if fmt == "speculators" else ["vllm", "sglang"]
    for engine in engines:
        r = read_export(out, engine)
        assert r["aux_inputs"] == drafter.config.aux_layer_ids, engine   # the trained layers
        aux = torch.cat([t["inputs"][i][0, :-1] for i in r["aux_inputs"]], -1)   # [S-1, 3H]
        embed_dir = r["embed_from"] or tiny_verifier            # shared with the target
        embed = load_file(os.path.join(embed_dir, "model.safetensors"))[
            "model.embed_tokens.weight"]
        full = engine_step0(r, embed, aux, tokens)                          # [S-1, V]
        torch.testing.assert_close(full[:, r["targets"]], ours.double(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{fmt} read by {engine}: {m}")
        assert torch.equal(full.argmax(-1), drafter.draft_to_target(ours.argmax(-1))), engine
        assert torch.isinf(full).sum() == full.shape[0] * (full.shape[1] - len(r["targets"]))

    # the comparison sees an aux layer off by one (what SGLang did with the old configs)
    r = read_export(out, "vllm")
    late = torch.cat([t["inputs"][i + 1][0, :-1] for i in r["aux_inputs"]], -1)
    wrong = engine_step0(r, embed, late, tokens)[:, r["targets"]]
    assert not torch.allclose(wrong, ours.double(), rtol=1e-2, atol=1e-2)


def test_parallel_drafter_round_trip_and_vllm_export(tmp_path):
    """A parallel (P-EAGLE) drafter saves its mask_hidden [3H] and mask token, and exports for
    vLLM by vLLM's reading rules (llama_eagle3.py load_weights: mask_hidden, required when
    parallel drafting is on; llm_base_proposer: the config's top-level mask_token_id). Other
    formats have no parallel drafting to target and are refused by name."""
    cfg = tiny_config(drafting="parallel", mask_token_id=7)
    state = random_state(cfg)
    assert state["mask_hidden"].shape == (96,)
    meta = dict(META, verifier=fake_verifier(tmp_path / "verifier"))
    d = checkpoint.save_drafter(str(tmp_path / "drafter"), state, cfg, meta)
    loaded, cfg2, _ = checkpoint.load_drafter(d)
    assert cfg2 == cfg and cfg2.parallel and torch.equal(loaded["mask_hidden"], state["mask_hidden"])
    weights, config, expected, _ = _export((d, state, cfg), tmp_path, "vllm")
    assert_same(weights, expected)
    assert config["mask_token_id"] == 7 and config["parallel_drafting"] is True
    _check_llama_eagle3_config(config, cfg)
    bad = {k: v for k, v in state.items() if k != "mask_hidden"}
    with pytest.raises(ValueError, match="missing mask_hidden"):
        checkpoint.save_drafter(str(tmp_path / "bad"), bad, cfg, meta)
    for fmt in ("sglang", "speculators"):
        with pytest.raises(ValueError, match="parallel .P-EAGLE. drafter exports for vLLM only"):
            checkpoint.export(d, str(tmp_path / fmt), fmt)
    # a chain checkpoint (no drafting field: older ones) loads as a chain and exports no keys
    chain = tiny_config()
    assert chain.drafting == "chain" and "mask_hidden" not in checkpoint.expected_shapes(chain)
    with pytest.raises(ValueError, match="drafting"):
        tiny_config(drafting="tree")
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(drafting="parallel", mask_token_id=100)


# --- the MLA layer and EAGLE-3.1's toggles (train/mla.py) ----------------------------------------

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
MLA = dict(layer="mla", q_lora_rank=12, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6,
           v_head_dim=10, rope_scaling=YARN)
MLA_ATTN = {"q_a_proj": (12, 64), "q_a_layernorm": (12,), "q_b_proj": (4 * 14, 12),
            "kv_a_proj_with_mqa": (24 + 6, 64), "kv_a_layernorm": (24,),
            "kv_b_proj": (4 * 18, 24), "o_proj": (32, 4 * 10)}


def read_vllm_mla_export(directory: str) -> dict:
    """An MLA export as vLLM's deepseek_eagle3.py loads it (Eagle3DeepseekV2ForCausalLM
    .load_weights: t2d skipped, d2t -> draft_id_to_target_id, other names but lm_head under
    "model."; DeepseekV2Eagle3Model's mapper: "midlayer." -> "layers.0.", q_a_proj (shard 0) and
    kv_a_proj_with_mqa (shard 1) stacked into fused_qkv_a_proj, gate/up into gate_up_proj) ->
    {"cfg", "params": {vLLM parameter name: tensor}, "targets"}. Fails on a name vLLM has no
    parameter for, or a parameter left unloaded."""
    config = json.load(open(os.path.join(directory, "config.json")))
    stored = load_file(os.path.join(directory, "model.safetensors"))
    assert config["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v2" and config["num_hidden_layers"] == 1
    c = config
    h, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    a, inter = "model.layers.0.self_attn.", c["intermediate_size"]
    want = {"model.fc.weight": (h, 3 * c["target_hidden_size"]), "model.norm.weight": (h,),
            "lm_head.weight": (c["draft_vocab_size"], h),
            "model.layers.0.input_layernorm.weight": (h,),
            "model.layers.0.hidden_norm.weight": (h,),
            "model.layers.0.post_attention_layernorm.weight": (h,),
            a + "fused_qkv_a_proj.weight": (c["q_lora_rank"] + c["kv_lora_rank"]
                                            + c["qk_rope_head_dim"], 2 * h),
            a + "q_a_layernorm.weight": (c["q_lora_rank"],),
            a + "q_b_proj.weight": (nh * qk, c["q_lora_rank"]),
            a + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
            a + "kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]),
                                     c["kv_lora_rank"]),
            a + "o_proj.weight": (h, nh * c["v_head_dim"]),
            "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, h),
            "model.layers.0.mlp.down_proj.weight": (h, inter)}
    if c.get("fc_norm"):
        want.update({f"model.fc_norm.{i}.weight": (h,) for i in range(3)})
    shards: dict[str, dict] = {}
    d2t = torch.zeros(c["draft_vocab_size"], dtype=torch.int64)
    for name, t in stored.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            d2t = t
            continue
        name = name if "lm_head" in name else "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for old, (new, shard) in {".q_a_proj": (".fused_qkv_a_proj", 0),
                                  ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1),
                                  ".gate_proj": (".gate_up_proj", 0),
                                  ".up_proj": (".gate_up_proj", 1)}.items():
            if old in name:
                shards.setdefault(name.replace(old, new), {})[shard] = t
                break
        else:
            shards.setdefault(name, {})[None] = t
    params = {k: v[None] if None in v else torch.cat([v[0], v[1]]) for k, v in shards.items()}
    assert set(params) == set(want), set(params) ^ set(want)
    for k, shape in want.items():
        assert tuple(params[k].shape) == shape, (k, tuple(params[k].shape), shape)
    return {"cfg": c, "params": params, "targets": torch.arange(len(d2t)) + d2t}


def vllm_mla_step0(r: dict, embed: torch.Tensor, aux: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
    """Step 0 as vLLM's deepseek_eagle3.py + DeepseekV2MLAAttention compute it, float64, from
    their facts: fc_norm per aux chunk, fc; residual = hidden (norm after residual); the 2H input
    into fused_qkv_a_proj; q_b(q_a_layernorm(q_a)), kv_b(kv_a_layernorm(latent)); RoPE on the
    rope parts, GPT-J style (is_neox_style=False: pairs stay interleaved), DeepSeek YaRN
    frequencies and cos/sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim);
    softmax scale Dqk^-0.5 * mscale(factor, mscale_all_dim)^2; causal; o_proj; fused add +
    post_attention_layernorm; SiLU MLP; norm; lm_head; compute_logits' scatter."""
    import math
    c, w = r["cfg"], {k: v.double() for k, v in r["params"].items()}
    eps, s, nh = c["rms_norm_eps"], tokens.shape[0], c["num_attention_heads"]
    nope, rope, dv, lr = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], \
        c["kv_lora_rank"]
    a, L = "model.layers.0.self_attn.", "model.layers.0."

    def norm(x, name):
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    aux = aux.double()
    if c.get("fc_norm"):
        aux = torch.cat([norm(x, f"model.fc_norm.{i}.weight")
                         for i, x in enumerate(aux.chunk(3, -1))], -1)
    hidden = aux @ w["model.fc.weight"].T                                   # [S, H]
    x = torch.cat([norm(embed[tokens].double(), L + "input_layernorm.weight"),
                   norm(hidden, L + "hidden_norm.weight")], -1)              # [S, 2H]
    qa, kva = (x @ w[a + "fused_qkv_a_proj.weight"].T).split([c["q_lora_rank"], lr + rope], -1)
    q = (norm(qa, a + "q_a_layernorm.weight") @ w[a + "q_b_proj.weight"].T).view(s, nh, -1)
    latent, k_pe = kva.split([lr, rope], -1)
    kv = (norm(latent, a + "kv_a_layernorm.weight") @ w[a + "kv_b_proj.weight"].T).view(s, nh, -1)
    k_nope, v = kv.split([nope, dv], -1)
    sc = c["rope_scaling"] or {}
    base = c["rope_theta"]
    inv = 1.0 / base ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    scale = (nope + rope) ** -0.5
    cs_scale = 1.0
    if sc.get("rope_type") == "yarn":
        f, old = sc["factor"], sc["original_max_position_embeddings"]

        def dim(rot):
            return rope * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = max(math.floor(dim(sc["beta_fast"])), 0), min(math.ceil(dim(sc["beta_slow"])),
                                                                rope - 1)
        ramp = ((torch.arange(rope // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        inv = inv / f * ramp + inv * (1 - ramp)

        def ms(m):
            return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0
        cs_scale = ms(sc["mscale"]) / ms(sc["mscale_all_dim"])
        scale *= ms(sc["mscale_all_dim"]) ** 2
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv               # [S, rope/2]
    cos, sin = ang.cos() * cs_scale, ang.sin() * cs_scale

    def gptj(t):                          # [.., S, rope] -> pairs (2i, 2i+1) rotated in place
        t0, t1 = t[..., 0::2], t[..., 1::2]
        return torch.stack([t0 * cos - t1 * sin, t1 * cos + t0 * sin], -1).flatten(-2)
    q_nope, q_pe = q.split([nope, rope], -1)
    qh = torch.cat([q_nope.transpose(0, 1), gptj(q_pe.transpose(0, 1))], -1)  # [nh, S, Dqk]
    kh = torch.cat([k_nope.transpose(0, 1), gptj(k_pe)[None].expand(nh, s, rope)], -1)
    scores = (qh @ kh.transpose(1, 2)) * scale                               # [nh, S, S]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(s, nh * dv)
    residual = attn @ w[a + "o_proj.weight"].T + hidden
    m = norm(residual, L + "post_attention_layernorm.weight")
    gate, up = (m @ w[L + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
    m = (torch.nn.functional.silu(gate) * up) @ w[L + "mlp.down_proj.weight"].T
    draft = norm(m + residual, "model.norm.weight") @ w["lm_head.weight"].T    # [S, Vd]
    full = torch.full((s, c["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, r["targets"]] = draft
    return full


def test_mla_drafter_exports_what_vllm_deepseek_eagle3_loads(tmp_path):
    """An MLA drafter with EAGLE-3.1's toggles: save/load round trip under its own names
    (midlayer.self_attn.q_a_proj ..., fc_norm.{0,1,2}); the vLLM export is an
    Eagle3DeepseekV3ForCausalLM config (MLA dims, interleaved rope, YaRN, fc_norm/norm_output,
    dense) whose weights vLLM's loader maps onto exactly its parameters, and which computes
    step 0 as the project's drafter does; SGLang's export names its Eagle3DeepseekV2ForCausalLM."""
    from eagle3_ray.train.draft import Eagle3Drafter
    cfg = tiny_config(**MLA, fc_norm=True, norm_output=True)
    state = random_state(cfg)
    with torch.no_grad():                         # tame magnitudes: softmax not saturated
        for k, v in state.items():
            if v.is_floating_point() and v.dim() == 2:
                state[k] = (v.float() * 0.2).to(v.dtype)
    shapes = checkpoint.expected_shapes(cfg)
    for name, shape in MLA_ATTN.items():
        assert shapes["midlayer.self_attn." + name + ".weight"][0] == shape
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(shapes)
    assert "midlayer.self_attn.q_proj.weight" not in shapes
    meta = dict(META, verifier=fake_verifier(tmp_path / "verifier"))
    d = checkpoint.save_drafter(str(tmp_path / "drafter"), state, cfg, meta)
    loaded, cfg2, _ = checkpoint.load_drafter(d)
    assert cfg2 == cfg and cfg2.num_key_value_heads == 4
    assert_same(loaded, {k: v for k, v in state.items() if k in shapes})

    weights, config, expected, _ = _export((d, state, cfg), tmp_path, "vllm")
    assert_same(weights, expected)
    for key, value in {"q_lora_rank": 12, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
                       "qk_rope_head_dim": 6, "v_head_dim": 10, "rope_interleave": True,
                       "fc_norm": True, "norm_output": True, "rope_scaling": YARN,
                       "first_k_dense_replace": 1, "n_routed_experts": 0,
                       "num_key_value_heads": 4, "intermediate_size": 64,
                       "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": AUX,
                       "target_hidden_size": 32, "draft_vocab_size": 40}.items():
        assert config[key] == value, key
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    r = read_vllm_mla_export(str(tmp_path / "vllm"))
    torch.manual_seed(0)
    embed = torch.randn(100, 32).to(torch.bfloat16)
    aux = torch.randn(9, 96).to(torch.bfloat16)
    tokens = torch.randint(0, 100, (9,))
    full = vllm_mla_step0(r, embed, aux, tokens)                              # [S, V]
    drafter = Eagle3Drafter(cfg).double()
    drafter.load_state_dict({**{k: v.double() if v.is_floating_point() else v
                                for k, v in loaded.items()},
                             "embed_tokens.weight": embed.double()})
    with torch.no_grad():
        ours = drafter.logits(drafter(tokens[None], aux[None].double(),
                                      torch.arange(9)[None]))[0]              # [S, Vd]
    torch.testing.assert_close(full[:, r["targets"]], ours, rtol=1e-5, atol=1e-6)  # fp32 RoPE

    weights, config, _, _ = _export((d, state, cfg), tmp_path, "sglang")
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]   # kimi_k25_eagle3.py
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in weights and config["fc_norm"]


def test_layer_shapes_an_engine_cannot_load_are_refused_by_name(tmp_path):
    """speculators has no MLA layer; vLLM/SGLang load MLA with q-LoRA only; SGLang's Llama
    drafter reads no EAGLE-3.1 toggle. speculators carries fc_norm/norm_output (vLLM's reader
    passes them on to Eagle3LlamaForCausalLM, which loads fc_norm.{i})."""
    meta = dict(META, verifier=fake_verifier(tmp_path / "verifier"))

    def saved_as(name, **kw):
        cfg = tiny_config(**kw)
        return checkpoint.save_drafter(str(tmp_path / name), random_state(cfg), cfg, meta)
    mla = saved_as("mla", **MLA)
    with pytest.raises(ValueError, match="MLA drafter has no speculators export"):
        checkpoint.export(mla, str(tmp_path / "x"), "speculators")
    no_lora = saved_as("no_lora", **dict(MLA, q_lora_rank=None))
    assert "midlayer.self_attn.q_proj.weight" in checkpoint.load_drafter(no_lora)[0]
    for fmt in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="without q-LoRA"):
            checkpoint.export(no_lora, str(tmp_path / "x"), fmt)
    llama31 = saved_as("llama31", fc_norm=True, norm_output=True)
    with pytest.raises(ValueError, match="no SGLang export"):
        checkpoint.export(llama31, str(tmp_path / "x"), "sglang")
    out = checkpoint.export(llama31, str(tmp_path / "vllm31"), "vllm")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert "fc_norm.2.weight" in load_file(os.path.join(out, "model.safetensors"))
    out = checkpoint.export(llama31, str(tmp_path / "spec31"), "speculators")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert "fc_norm.0.weight" in load_file(os.path.join(out, "model.safetensors"))


# --- the block (DFlash) drafter (train/block.py) ---------------------------------------------

BLOCK = dict(drafting="block", block_size=3, block_layers=2)


def vllm_dflash_params(config: dict, target_vocab: int) -> dict[str, set]:
    """The parameters vLLM's DFlashQwen3ForCausalLM registers for an export's config.json ->
    {name: the checkpoint shards it takes}, by vllm/model_executor/models/qwen3_dflash.py
    (0.32): model.{fc, hidden_norm, norm}; per layer input_layernorm, post_attention_layernorm,
    self_attn.{qkv_proj (q, k, v stacked), o_proj, q_norm, k_norm}, mlp.{gate_up_proj (gate,
    up stacked), down_proj}; lm_head; draft_id_to_target_id only when draft_vocab_size differs
    from the target's vocab. model.embed_tokens (shared from the target) and
    model.mask_embedding are dropped by its loader when the checkpoint has none."""
    p = {f"model.{n}.weight": {None} for n in ("fc", "hidden_norm", "norm")}
    p["lm_head.weight"] = {None}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        p.update({layer + n + ".weight": {None} for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.down_proj")})
        p[layer + "self_attn.qkv_proj.weight"] = {"q", "k", "v"}
        p[layer + "mlp.gate_up_proj.weight"] = {0, 1}
    if config["draft_vocab_size"] != target_vocab:
        p["draft_id_to_target_id"] = {None}
    return p


def vllm_dflash_name(name: str) -> tuple[str, object] | None:
    """A checkpoint tensor -> (vLLM parameter, shard) by DFlashQwen3ForCausalLM.load_weights:
    "t2d" skipped (None), "d2t" -> draft_id_to_target_id, every other name but lm_head's
    prefixed "model."; then DFlashQwen3Model.hf_to_vllm_mapper's stacking (.q_proj/.k_proj/
    .v_proj -> .qkv_proj shards q/k/v, .gate_proj/.up_proj -> .gate_up_proj shards 0/1)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    for old, (new, shard) in {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
                              ".v_proj": (".qkv_proj", "v"), ".gate_proj": (".gate_up_proj", 0),
                              ".up_proj": (".gate_up_proj", 1)}.items():
        if old in name:
            return name.replace(old, new), shard
    return name, None


def vllm_dflash_layers(config: dict) -> list[int]:
    """The verifier layers whose INPUTS vLLM feeds a dflash drafter's fc, in order
    (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config:
    the top-level eagle_aux_hidden_state_layer_ids as-is if present, else
    dflash_config.target_layer_ids + 1; llama.py captures the input of each such layer)."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    return list(top) if top else [j + 1 for j in config["dflash_config"]["target_layer_ids"]]


def test_block_drafter_round_trip(tmp_path, tiny_verifier):
    """A block drafter saves the names and shapes of block.BlockDrafter, loads back bit-exact,
    and load_trained_drafter rebuilds a BlockDrafter holding those weights."""
    from transformers import AutoConfig
    from eagle3_ray.train import block, draft
    from eagle3_ray.train.checkpoint import load_trained_drafter
    vcfg = AutoConfig.from_pretrained(tiny_verifier)
    cfg = draft.DraftConfig.from_verifier_config(vcfg, 300, AUX, **BLOCK)
    counts = np.random.default_rng(0).integers(0, 1000, vcfg.vocab_size)
    torch.manual_seed(0)
    drafter, _ = draft.build_drafter(tiny_verifier, cfg, *vocab.build_mapping(counts, 300),
                                     cls=block.BlockDrafter)
    state = drafter.state_dict()
    want = checkpoint.expected_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in state.items() if k != "embed_tokens.weight"} == \
        {k: shape for k, (shape, _) in want.items()}
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    d = checkpoint.save_drafter(str(tmp_path / "drafter"), state, cfg,
                                dict(META, verifier=tiny_verifier))
    loaded, cfg2, _ = checkpoint.load_drafter(d)
    assert cfg2 == cfg and cfg2.drafting == "block"
    assert_same(loaded, {k: v for k, v in state.items() if k != "embed_tokens.weight"})
    config = json.load(open(os.path.join(d, "config.json")))
    assert config["architectures"] == ["DFlashDraftModel"]    # self-describing: the engine layout
    rebuilt = load_trained_drafter(d)[0]
    assert type(rebuilt) is block.BlockDrafter and not rebuilt.training
    assert_same(rebuilt.state_dict(), state)                  # embedding: the verifier's again
    bad = {k: v for k, v in state.items() if k != "layers.1.self_attn.k_norm.weight"}
    with pytest.raises(ValueError, match="missing layers.1.self_attn.k_norm.weight"):
        checkpoint.save_drafter(str(tmp_path / "bad"), bad, cfg)


@pytest.mark.parametrize("draft_vocab", [40, 100])
def test_block_drafter_vllm_export_is_what_vllm_dflash_loads(tmp_path, draft_vocab):
    """export --format vllm of a block drafter: a DFlashDraftModel config (Qwen3 shapes,
    dflash_config) whose aux layers vLLM derives as the ones trained, and tensors that map one
    to one onto DFlashQwen3ForCausalLM's parameters (every stacked shard present). A full-vocab
    drafter ships no d2t (vLLM registers no draft_id_to_target_id then). SGLang and speculators
    are refused by name."""
    cfg = tiny_config(draft_vocab_size=draft_vocab, mask_token_id=7, **BLOCK)
    state = random_state(cfg)
    del state["midlayer.self_attn.rotary_emb.inv_freq"]
    meta = dict(META, verifier=fake_verifier(tmp_path / "verifier"))
    d = checkpoint.save_drafter(str(tmp_path / "drafter"), state, cfg, meta)
    weights, config, expected, _ = _export((d, state, cfg), tmp_path, "vllm")
    if draft_vocab == 100:
        expected = {k: v for k, v in expected.items() if k not in ("d2t", "t2d")}
    assert_same(weights, expected)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    shapes = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu", "vocab_size": 100,
              "draft_vocab_size": draft_vocab, "target_hidden_size": 32, "rope_theta": 50000.0,
              "rope_scaling": cfg.rope_scaling,
              "max_position_embeddings": cfg.max_position_embeddings,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False, "block_size": 4}
    assert {k: config[k] for k in shapes} == shapes
    # DFlash's block: the bonus slot + block_size masks; ids: the output of layer j (vLLM + 1)
    assert config["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3, 4],
                                       "block_size": 4, "causal": False}
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    assert vllm_dflash_layers(config) == AUX                     # the inputs trained on
    ours = config["eagle3_ray"]
    assert ours["export"] == "vllm" and ours["draft_config"] == cfg.to_dict()
    assert ours["dflash_layer_id_convention"] == checkpoint.DFLASH_LAYER_ID_CONVENTION
    params = vllm_dflash_params(config, target_vocab=100)
    got: dict[str, set] = {}
    for name in weights:
        mapped = vllm_dflash_name(name)
        if mapped is not None:
            assert mapped[0] in params, f"{name} -> {mapped[0]}: no such vLLM parameter"
            assert mapped[1] not in got.setdefault(mapped[0], set()), f"{name} loaded twice"
            got[mapped[0]].add(mapped[1])
    assert got == params                                         # every parameter, every shard
    for fmt, why in (("sglang", "no SGLang export.*no lm_head"),
                     ("speculators", "no speculators export.*no DFlash")):
        with pytest.raises(ValueError, match=why):
            checkpoint.export(d, str(tmp_path / fmt), fmt)
