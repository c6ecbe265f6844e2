"""The drafter (eagle3_ray/train/draft.py): checkpoint names, RoPE, and building it from a verifier
by reading only its embedding, final norm and lm_head."""
import json
import os

import pytest
import torch

from eagle3_ray.train import draft

V, H = 96, 32
EXPORT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def save_llama(path, tied: bool, max_shard_size=None):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                      max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return model


def mapping(vd: int):
    target_ids = torch.arange(0, V, V // vd)[:vd]                              # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(vd), t2d, target_ids


@pytest.fixture
def record_reads(monkeypatch):
    """Wrap draft.safe_open: which files were opened and which tensors read."""
    seen = {"files": [], "tensors": []}
    real = draft.safe_open

    class Recording:
        def __init__(self, path, framework, **kw):
            self.f = real(path, framework=framework, **kw)
            seen["files"].append(os.path.basename(path))

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            seen["tensors"].append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(draft, "safe_open", Recording)
    return seen


@pytest.mark.parametrize("tied,shard", [(False, None), (True, None), (False, "40KB")])
def test_build_reads_only_embed_norm_head(tmp_path, record_reads, tied, shard):
    from transformers import AutoConfig
    model = save_llama(tmp_path, tied, shard)
    if shard:
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
        shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(set(shards.values())) > 2
    c = draft.DraftConfig.from_verifier_config(AutoConfig.from_pretrained(tmp_path), 24, [1, 2, 3])
    d2t, t2d, target_ids = mapping(24)
    drafter, teacher = draft.build_drafter(str(tmp_path), c, d2t, t2d)

    wanted = {draft.EMBED, draft.FINAL_NORM} | (set() if tied else {draft.LM_HEAD})
    assert sorted(record_reads["tensors"]) == sorted(wanted)                  # nothing else read
    if shard:  # only the shards holding those tensors were opened
        assert set(record_reads["files"]) == {shards[n] for n in wanted}

    embed = model.model.embed_tokens.weight.detach()
    head = embed if tied else model.lm_head.weight.detach()
    norm = model.model.norm.weight.detach()
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert not drafter.embed_tokens.weight.requires_grad
    assert torch.equal(drafter.norm.weight.detach(), norm)
    assert torch.equal(drafter.lm_head.weight.detach(), head[target_ids])
    assert torch.equal(teacher.norm_weight, norm)
    assert torch.equal(teacher.head_draft, head[target_ids])
    assert torch.equal(teacher.head_rest, head[~t2d])
    assert torch.equal(drafter.d2t, d2t) and torch.equal(drafter.t2d, t2d)
    # the checkpoint layout: exactly the SGLang/vLLM names (+ the frozen verifier embedding)
    sd = drafter.state_dict()
    assert set(sd) == EXPORT_KEYS | {"embed_tokens.weight"}
    assert teacher.state_dict() == {}
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    hd = c.head_dim
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * hd, 2 * H)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (2 * hd, 2 * H)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (H, 4 * hd)
    assert shapes["lm_head.weight"] == (24, H) and shapes["t2d"] == (V,)
    assert sd["d2t"].dtype == torch.long and sd["t2d"].dtype == torch.bool
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable == EXPORT_KEYS - {"d2t", "t2d"}

    # teacher_check=False (a dataset with target_ids): no rows outside the draft vocab are held;
    # the distribution is the same, and asking for the check is a clear error
    _, lean = draft.build_drafter(str(tmp_path), c, d2t, t2d, teacher_check=False)
    assert lean.head_rest is None and torch.equal(lean.head_draft, teacher.head_draft)
    x = torch.randn(5, H)
    assert torch.equal(lean(x, check=False)[0], teacher(x, check=False)[0])
    with pytest.raises(ValueError, match="needs target_ids"):
        lean(x)


def test_build_rejects_inconsistent_mapping(tmp_path):
    from transformers import AutoConfig
    save_llama(tmp_path, tied=True)
    c = draft.DraftConfig.from_verifier_config(AutoConfig.from_pretrained(tmp_path), 24)
    d2t, t2d, _ = mapping(24)
    t2d = t2d.clone()
    t2d[1] = True
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        draft.build_drafter(str(tmp_path), c, d2t, t2d)


def test_read_verifier_tensors_errors_name_the_dir(tmp_path):
    save_llama(tmp_path, tied=True)
    with pytest.raises(KeyError, match="lm_head.weight"):
        draft.read_verifier_tensors(str(tmp_path), [draft.LM_HEAD])
    assert draft.read_verifier_tensors(str(tmp_path), [draft.LM_HEAD], missing_ok=True) == {}


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_rope_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=V, max_position_embeddings=256,
                      rope_parameters=rope)
    c = draft.DraftConfig.from_verifier_config(cfg, 16)
    assert (c.rope_scaling is None) == (rope["rope_type"] == "default")
    ours = draft.rope_inv_freq(c)
    if rope["rope_type"] != "default":
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, None)
        assert torch.allclose(ours, ref)
    # cos/sin and the rotation convention against transformers' Llama
    pos = torch.arange(20)[None] * 7
    x = torch.randn(1, 4, 20, 16)
    cos_ref, sin_ref = LlamaRotaryEmbedding(cfg)(x, pos)
    q_ref, _ = apply_rotary_pos_emb(x, x, cos_ref, sin_ref)
    m = draft.Eagle3Drafter(c)
    cos, sin = m.rope(pos, x.dtype)
    assert torch.allclose(cos[:, 0], cos_ref, atol=1e-5)
    assert torch.allclose(x * cos + draft.rotate_half(x) * sin, q_ref, atol=1e-5)
    # positions past the cached table (256 at first) grow it; bf16 reads the same table
    far = pos + 3000
    cos_far, sin_far = m.rope(far, torch.bfloat16)
    cos_ref, sin_ref = LlamaRotaryEmbedding(cfg)(x, far)
    assert m._rope_table[0].shape[0] > 3000 and cos_far.dtype == torch.bfloat16
    assert torch.allclose(cos_far[:, 0].float(), cos_ref, atol=1e-2)
    assert torch.allclose(sin_far[:, 0].float(), sin_ref, atol=1e-2)
    assert torch.equal(m.rope(pos, x.dtype)[0], cos)            # the grown table, same values
    direct = draft.rope_cos_sin(c, far)[0]                      # what a GPU computes per call
    assert torch.allclose(m.rope(far, torch.float32)[0][:, 0], direct, atol=1e-6)


def test_layer_residual_is_the_hidden_input():
    """finish(): out = hidden + o_proj(attn) + mlp(post_norm(.)); with o_proj and down_proj zero
    the layer is the identity on the hidden (the embedding never enters the residual)."""
    c = draft.DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=48, vocab_size=V, draft_vocab_size=16)
    m = draft.Eagle3Drafter(c)
    with torch.no_grad():
        m.midlayer.self_attn.o_proj.weight.zero_()
        m.midlayer.mlp.down_proj.weight.zero_()
    aux = torch.randn(2, 5, 3 * H)
    out = m(torch.randint(0, V, (2, 5)), aux, torch.arange(5)[None].expand(2, 5))
    assert torch.allclose(out, m.fuse(aux))
    assert m.logits(out).shape == (2, 5, 16)


def test_verifier_init_starts_as_the_verifiers_own_layer(tmp_path):
    """init="verifier": fc passes the highest aux state through and the midlayer is that
    verifier layer, so step 0 on the verifier's aux states reproduces the verifier's own
    output of that layer (here the last layer: the input of the final norm)."""
    from transformers import AutoConfig
    from eagle3_ray.engine import hf as verifier
    model = save_llama(tmp_path, tied=False)
    c = draft.DraftConfig.from_verifier_config(AutoConfig.from_pretrained(tmp_path), 24, [1, 2, 3])
    d2t, t2d, _ = mapping(24)
    drafter, _ = draft.build_drafter(str(tmp_path), c, d2t, t2d, init="verifier")
    layer = model.model.layers[3]
    m = drafter.midlayer
    assert torch.equal(drafter.fc.weight, torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1))
    for x in "qkv":
        w = getattr(m.self_attn, f"{x}_proj").weight
        assert torch.equal(w[:, H:], getattr(layer.self_attn, f"{x}_proj").weight)
        assert not w[:, :H].any()                                   # the embedding half: zero
    assert torch.equal(m.hidden_norm.weight, layer.input_layernorm.weight)
    assert torch.equal(m.mlp.down_proj.weight, layer.mlp.down_proj.weight)

    ids = torch.randint(0, V, (1, 10))
    with torch.no_grad(), verifier.capture_hidden_states(model, [1, 2, 3]) as got:
        model(input_ids=ids)
    aux = torch.cat([got["aux0"], got["aux1"], got["aux2"]], -1)             # [1, S, 3H]
    out = drafter(ids, aux, torch.arange(10)[None])                           # [1, S, H]
    torch.testing.assert_close(out, got["last"], rtol=1e-5, atol=1e-5)

    rand, _ = draft.build_drafter(str(tmp_path), c, d2t, t2d, init="random")
    assert not torch.equal(rand.fc.weight, drafter.fc.weight)
    with pytest.raises(ValueError, match="init must be"):
        draft.build_drafter(str(tmp_path), c, d2t, t2d, init="zeros")


def test_mask_slots_are_the_mask_token_on_the_learned_mask_state():
    """forward(masked=m) appends m slots whose token is mask_token_id and whose hidden is
    fc(mask_hidden): the same as passing those inputs explicitly. A chain drafter has no
    mask state and refuses mask slots."""
    torch.manual_seed(0)
    c = draft.DraftConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=50, draft_vocab_size=50,
                          drafting="parallel")
    m = draft.Eagle3Drafter(c).double()
    assert c.mask_token_id == 49 and m.mask_hidden.shape == (96,)
    ids, aux = torch.randint(0, 50, (2, 5)), torch.randn(2, 5, 96, dtype=torch.float64)
    pos = torch.arange(8)[None].expand(2, 8)
    got = m(ids, aux, pos, masked=3)                                       # [2, 8, H]
    explicit = torch.cat([ids, torch.full((2, 3), 49)], 1)
    hidden = torch.cat([aux, m.mask_hidden.expand(2, 3, 96)], 1)
    assert torch.allclose(got, m(explicit, hidden, pos), atol=1e-12)
    assert torch.allclose(got[:, :5], m(ids, aux, pos[:, :5]), atol=1e-12)  # causal
    chain = draft.Eagle3Drafter(draft.DraftConfig(**{**c.to_dict(), "drafting": "chain",
                                                     "mask_token_id": None}))
    assert not hasattr(chain, "mask_hidden")
    with pytest.raises(ValueError, match="parallel drafter"):
        chain(ids, aux.float(), pos, masked=3)
