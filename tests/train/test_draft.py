"""The drafter (eagle3_ray/train/draft.py): checkpoint names, RoPE, and building it from a verifier
by reading only its embedding, final norm and lm_head."""
import json
import math
import os

import pytest
import torch

from eagle3_ray.train import draft, mla

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


# --- the MLA layer option (train/mla.py) ------------------------------------------------------

def mla_config(**kw):
    base = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                intermediate_size=48, vocab_size=V, draft_vocab_size=24, layer="mla",
                q_lora_rank=12, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
                v_head_dim=10)
    return draft.DraftConfig(**{**base, **kw})


@pytest.mark.parametrize("q_lora", [12, None])
def test_mla_attention_is_transformers_deepseek_v3_attention(q_lora):
    """The MLA drafter's qkv -> causal attention -> o_proj equals transformers' DeepseekV3Attention
    (rope_interleave: vLLM's is_neox_style=False pairs) with the same weights on the same 2H input
    (concat(input_layernorm(embed), hidden_norm(hidden))); Dv != Dqk, scale Dqk^-0.5."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    torch.manual_seed(0)
    c = mla_config(q_lora_rank=q_lora)
    m = draft.Eagle3Drafter(c).double()
    with torch.no_grad():
        for p in m.midlayer.parameters():
            p.add_(torch.randn_like(p) * 0.1)        # norms too: every weight must matter
    ref_cfg = DeepseekV3Config(hidden_size=2 * H, num_attention_heads=2, num_key_value_heads=2,
                               q_lora_rank=q_lora, kv_lora_rank=20, qk_nope_head_dim=8,
                               qk_rope_head_dim=6, v_head_dim=10, rms_norm_eps=c.rms_norm_eps,
                               rope_interleave=True, attention_bias=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ref_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(ref_cfg, 0).double()
    ours = dict(m.midlayer.self_attn.named_parameters())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "o_proj.weight":              # [2H, nh*Dv]: ours is the first H rows
                p.zero_()[:H] = ours[name]
            else:
                p.copy_(ours[name])
    b, s = 2, 7
    ids, hidden = torch.randint(0, V, (b, s)), torch.randn(b, s, H, dtype=torch.float64)
    pos = (torch.arange(s)[None] + torch.tensor([[0], [5]]))                 # [B, S]
    q, k, v = m.qkv(ids, hidden, pos)
    assert q.shape == k.shape == (b, 2, s, 14) and v.shape == (b, 2, s, 10)
    got = m.midlayer.self_attn.o_proj(draft.causal_attention(q, k, v))      # [B, S, H]
    layer = m.midlayer
    x = torch.cat([layer.input_layernorm(m.embed_tokens(ids).double()),
                   layer.hidden_norm(hidden)], -1)                           # [B, S, 2H]
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    cos_sin = DeepseekV3RotaryEmbedding(ref_cfg)(x, pos)
    want, _ = ref(x, cos_sin, mask)                                          # [B, S, 2H]
    torch.testing.assert_close(got, want[..., :H], rtol=1e-5, atol=1e-6)   # fp32 RoPE angles
    assert not want[..., H:].any()


def test_mla_yarn_scale_and_refusals():
    """YaRN (DeepSeek's): softmax scale Dqk^-0.5 * mscale(factor, mscale_all_dim)^2, folded
    into q; transformers' DeepseekV3 YaRN frequencies. Unsupported shapes are refused by name."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    c = mla_config(rope_scaling=yarn)
    ref_cfg = DeepseekV3Config(hidden_size=2 * H, qk_rope_head_dim=6, qk_nope_head_dim=8,
                               rope_parameters={**yarn, "rope_theta": 10000.0},
                               max_position_embeddings=2048)
    ref_inv, _ = ROPE_INIT_FUNCTIONS["yarn"](ref_cfg, None)
    torch.testing.assert_close(mla.rope_inv_freq(c), ref_inv.float())
    m = draft.Eagle3Drafter(c).double()
    plain = draft.Eagle3Drafter(mla_config()).double()
    plain.load_state_dict(m.state_dict())
    ids, hidden, pos = torch.randint(0, V, (1, 4)), torch.randn(1, 4, H).double(), \
        torch.arange(4)[None]
    mscale = 0.1 * math.log(32.0) + 1.0
    q_yarn, q_plain = m.qkv(ids, hidden, pos)[0], plain.qkv(ids, hidden, pos)[0]
    nope = c.qk_nope_head_dim     # the nope part has no rope: only the scale differs there
    torch.testing.assert_close(q_yarn[..., :nope], q_plain[..., :nope] * mscale ** 2)
    with pytest.raises(ValueError, match="longrope"):
        mla_config(rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="parallel"):
        mla_config(drafting="parallel")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_config(kv_lora_rank=None)
    # the Llama layer has no DeepSeek YaRN: refused when the config is made (the driver, before
    # any worker starts), pointing at the layer that has it
    with pytest.raises(ValueError, match="yarn.*--draft-layer mla"):
        draft.DraftConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=H // 2, intermediate_size=2 * H, vocab_size=V,
                          draft_vocab_size=V, rope_scaling=yarn)


def test_mla_dims_from_the_verifier(deepseek_verifier):
    """from_verifier_config(layer="mla") reads the DeepSeek verifier's MLA dims; a Llama layer
    on it takes head_dim = H / heads (its config's head_dim is qk_rope_head_dim); a Llama
    verifier gets mla.DEFAULT_DIMS."""
    from transformers import AutoConfig, LlamaConfig
    vcfg = AutoConfig.from_pretrained(deepseek_verifier)
    c = draft.DraftConfig.from_verifier_config(vcfg, 64, [2, 4, 5], layer="mla")
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim) == (64, 512, 64, 64, 64)
    assert c.num_key_value_heads == c.num_attention_heads == 2
    assert c.qk_head_dim == 128 and c.value_head_dim == 64
    llama_layer = draft.DraftConfig.from_verifier_config(vcfg, 64, [2, 4, 5])
    assert llama_layer.head_dim == 64 and llama_layer.kv_lora_rank is None
    lcfg = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=64, vocab_size=V)
    d = draft.DraftConfig.from_verifier_config(lcfg, 16, layer="mla")
    assert d.kv_lora_rank == 512 and d.qk_rope_head_dim == 64 and d.q_lora_rank == H


def test_fc_norm_norms_each_aux_state_and_norm_output_feeds_the_normed_state():
    """EAGLE-3.1: fc_norm = fc(cat(fc_norm.i(aux_i))); norm_output: a step handed the previous
    output h runs on norm(h) (vLLM's aux_output), so forward(h) == plain forward(norm(h))."""
    torch.manual_seed(0)
    for layer in ("llama", "mla"):
        kw = {} if layer == "mla" else dict(layer="llama", num_attention_heads=4)
        c = mla_config(fc_norm=True, norm_output=True, **kw)
        m = draft.Eagle3Drafter(c).double()
        with torch.no_grad():
            for j in range(3):
                m.fc_norm[j].weight.uniform_(0.5, 1.5)
            m.norm.weight.uniform_(0.5, 1.5)
        plain = draft.Eagle3Drafter(draft.DraftConfig(**{**c.to_dict(), "fc_norm": False,
                                                         "norm_output": False})).double()
        plain.load_state_dict(m.state_dict(), strict=False)
        aux = torch.randn(2, 5, 3 * H, dtype=torch.float64) * 3
        want = torch.cat([draft.rms_norm(x, n.weight, c.rms_norm_eps)
                          for x, n in zip(aux.chunk(3, -1), m.fc_norm)], -1)
        torch.testing.assert_close(m.fuse(aux), plain.fc(want))
        ids, pos = torch.randint(0, V, (2, 5)), torch.arange(5)[None].expand(2, 5)
        h = m(ids, aux, pos)
        torch.testing.assert_close(m(ids, h, pos + 1), plain(ids, m.norm(h), pos + 1))
        assert not torch.allclose(m(ids, h, pos + 1), plain(ids, h, pos + 1))


def test_mla_drafter_builds_and_starts_from_a_deepseek_verifier_layer(deepseek_verifier):
    """build_drafter(init="verifier") on a DeepSeek verifier with an MLA drafter copies the MLA
    attention of the layer (q_a/kv_a_proj_with_mqa into the 2H input's hidden half, the rest
    whole); that layer's MoE MLP has no dense counterpart and stays random."""
    from transformers import AutoConfig
    from safetensors.torch import load_file
    vcfg = AutoConfig.from_pretrained(deepseek_verifier)
    c = draft.DraftConfig.from_verifier_config(vcfg, 64, [2, 4, 5], layer="mla")
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[:64] = True
    with pytest.warns(UserWarning, match=r"layer 5: .*mlp.gate_proj.*start random"):  # MoE
        drafter, _ = draft.build_drafter(deepseek_verifier, c,
                                         torch.zeros(64, dtype=torch.long), t2d, init="verifier")
    w = load_file(os.path.join(deepseek_verifier, "model.safetensors"))
    a, h = drafter.midlayer.self_attn, c.hidden_size
    for name in ("q_a_proj", "kv_a_proj_with_mqa"):
        mine = getattr(a, name).weight
        assert torch.equal(mine[:, h:], w[f"model.layers.5.self_attn.{name}.weight"])
        assert not mine[:, :h].any()
    for name in ("q_b_proj", "kv_b_proj", "o_proj", "q_a_layernorm", "kv_a_layernorm"):
        assert torch.equal(getattr(a, name).weight, w[f"model.layers.5.self_attn.{name}.weight"])
    out = drafter(torch.randint(0, c.vocab_size, (1, 6)), torch.randn(1, 6, 3 * h),
                  torch.arange(6)[None])
    assert out.shape == (1, 6, h) and torch.isfinite(out).all()
