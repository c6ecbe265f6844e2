"""The builtin speculative decoder on a DeepSeek-V3-shaped verifier (MLA + MoE: engine/toy.py,
tests/conftest.py deepseek_verifier): its kernels for MLA's shapes, the MoE made batch
invariant (kernels.PerTokenMoE), and a drafter trained on the verifier getting its drafts
accepted while greedy output stays the verifier's, bit for bit. The tests shared with the Llama
family (greedy at every depth, batch invariance in bf16 / fp32, trees) are parametrized over
both families in tests/serve/test_speculate.py. Pure PyTorch, no Ray."""
import pytest
import torch
from transformers import DynamicCache

from eagle3_ray.engine import hf as verifier_lib
from eagle3_ray.serve import kernels
from eagle3_ray.serve.speculate import LookupParams, SamplingParams, Speculator
from tests.serve.test_speculate import run

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["What is Ray?", "Count to five.", "Write some code", "What is the capital of France?"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_per_token_forward_is_a_one_token_forward(deepseek_verifier, dtype):
    """make_batch_invariant routes every MoE block (found by structure: a `gate` and `experts`)
    a token at a time: a 9-token forward gives bit for bit what 9 one-token forwards of the
    block's own code give (router F.linear in fp32, experts' 3-D weights), while a prefill
    stays batched (the block's own forward over all rows). Every MLA projection is a
    batch-invariant FewRowLinear; the router and the experts are not nn.Linear and stay as
    they are (the router fp32 in a bf16 verifier, as transformers loads it)."""
    model = verifier_lib.load_verifier(deepseek_verifier, dtype=dtype)
    kernels.make_batch_invariant(model)
    layers = verifier_lib.decoder_layers(model)
    blocks = kernels.moe_blocks(model)
    assert blocks == [layer.mlp for layer in layers[1:]]                # layer 0 is dense
    for layer in layers:
        attn = layer.self_attn
        for proj in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj,
                     attn.o_proj):
            assert isinstance(proj.forward, kernels.FewRowLinear) and proj.forward.batch_invariant
    block = blocks[0]
    assert isinstance(block.forward, kernels.PerTokenMoE)
    assert block.gate.weight.dtype == torch.float32 and block.experts.gate_up_proj.dim() == 3
    kernels.make_batch_invariant(model)                  # again (a second Speculator): no-op
    assert block.forward.block is block and len(model.get_decoder()._forward_pre_hooks) == 1
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0),
                    dtype=dtype)                                        # [1, 9, H]
    own, state = type(block).forward, block.forward.state
    with torch.inference_mode():
        cache = DynamicCache()
        model(torch.tensor([[5, 6, 7]]), cache=cache)                   # a prefill: batched
        assert state["prefill"] and torch.equal(block(x), own(block, x))
        model(torch.tensor([[8, 9]]), cache=cache)                      # a verify: per token
        assert not state["prefill"]
        one = torch.cat([own(block, x[:, i:i + 1]) for i in range(9)], 1)  # [1, 9, H]
        assert torch.equal(block(x), one)
        assert torch.equal(block(x[:, 3:4]), one[:, 3:4])               # a decode step


def _attention_reference(query, key, value, scale, seen):
    """fp64 softmax(q k^T) v where query row i sees keys 0 .. seen[i]-1 -> [1, q, nh, Dv]."""
    s = (query.double() @ key.double().transpose(-1, -2)) * scale       # [1, nh, q, kv]
    hidden = torch.arange(key.shape[2])[None] >= torch.tensor(seen)[:, None]   # [q, kv]
    out = s.masked_fill(hidden, float("-inf")).softmax(-1) @ value.double()  # [1, nh, q, Dv]
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_kernels_take_mla_shapes(dtype, monkeypatch):
    """MLA hands attention queries and keys of 128 dims (64 without RoPE + 64 with) and values
    of 64, one KV head per query head, and its own scale: batch_invariant_attention's prefill,
    token-at-a-time and matmul paths, _tree_attention's two paths and tree_attention all
    return [1, q, heads, 64] equal to attention computed directly (fp64), and a verify's
    token-at-a-time rows are bit for bit a one-token forward's."""
    g = torch.Generator().manual_seed(0)
    nh, d, dv, kv, q, scale = 2, 128, 64, 40, 7, 0.1
    query = torch.randn(1, nh, q, d, generator=g).to(dtype)
    key, value = torch.randn(1, nh, kv, d, generator=g).to(dtype), \
        torch.randn(1, nh, kv, 2 * dv, generator=g).to(dtype)[..., :dv]   # a split's view
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)

    def check(out, seen, rows=slice(None)):
        want = _attention_reference(query[:, :, rows], key, value, scale, seen)
        assert out.shape == want.shape
        torch.testing.assert_close(out.double(), want, **tol)

    with torch.inference_mode():
        out = kernels.batch_invariant_attention(None, query, key[:, :, :q], value[:, :, :q],
                                                None, scale)[0]            # a prefill
        check(out, [i + 1 for i in range(q)])
        paths = [[0, 1, 2, 3], [0, 4, 5], [0, 6]]
        tree = kernels.tree_layout(paths, kv - q)
        for one_at_a_time in (True, False):                             # the matmul path too
            monkeypatch.setattr(kernels, "_one_token_at_a_time", lambda _: one_at_a_time)
            out = kernels.batch_invariant_attention(None, query, key, value, None, scale)[0]
            check(out, [kv - q + i + 1 for i in range(q)])
            if one_at_a_time:                                           # = one-token forwards
                for i in range(q):
                    step = kernels.batch_invariant_attention(
                        None, query[:, :, i:i + 1], key[:, :, :kv - q + i + 1],
                        value[:, :, :kv - q + i + 1], None, scale)[0]
                    assert torch.equal(out[:, i:i + 1], step), i
            out = kernels._tree_attention(None, query, key, value, scale, tree)[0]
            assert out.shape == (1, q, nh, dv)
            for p in paths:                    # each path attends to the cache and itself
                seen = list(range(kv - q)) + [kv - q + i for i in p]
                want = _attention_reference(query[:, :, p], key[:, :, seen], value[:, :, seen],
                                            scale, [kv - q + i + 1 for i in range(len(p))])
                torch.testing.assert_close(out[:, p].double(), want, **tol)
        monkeypatch.undo()
        out = kernels.tree_attention(None, query, key, value, None, scale, tree=tree)[0]
        assert out.shape == (1, q, nh, dv)                              # _tree_attention's
        mask = torch.arange(kv)[None] <= torch.arange(kv - q, kv)[:, None]   # [q, kv], causal
        out = kernels.tree_attention(None, query, key, value, mask[None, None], scale)[0]
        check(out, [kv - q + i + 1 for i in range(q)])


@pytest.fixture(scope="module")
def trained_deepseek(deepseek_verifier, train_tiny_drafter, tmp_path_factory):
    """(verifier dir, drafter dir, prompts): a chain drafter trained in-process (~7 s) on the
    DeepSeek verifier's own greedy continuations of chat prompts (its forward_hidden, MoE
    and all), so its drafts get accepted on them."""
    from eagle3_ray.data import conversations as data
    tok = verifier_lib.load_tokenizer(deepseek_verifier)
    prompts = [data.prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    out = str(tmp_path_factory.mktemp("deepseek_drafter") / "drafter")
    return deepseek_verifier, train_tiny_drafter(deepseek_verifier, out, prompts, depth=3), prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trained_drafter_on_deepseek_gets_drafts_accepted_and_stays_exact(trained_deepseek,
                                                                         dtype):
    """A trained drafter on the batch-invariant DeepSeek verifier (fp32: the strict check on
    this host; bf16: what AVX512-BF16 hosts serve): most drafts accepted, and greedy output is
    the verifier's own (transformers' generate, depth 0) at depths 1, 4 and 16, with a
    per-round depth, the lookup fallback and the lookup branch, and with trees."""
    from eagle3_ray.plan import planner
    from eagle3_ray.train.checkpoint import load_trained_drafter
    spec_dir, drafter_dir, prompts = trained_deepseek
    model = verifier_lib.load_verifier(spec_dir, dtype=dtype)
    spec = Speculator(model, load_trained_drafter(drafter_dir)[0], batch_invariant=True)
    assert spec.exact == {"chain": True, "tree": True}
    sp = SamplingParams(max_tokens=32)
    drafted = accepted = 0
    for prompt in prompts[:2] if dtype == torch.float32 else prompts[2:3]:
        base, _ = run(spec, prompt, sp, 0)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                 min_new_tokens=32)[0, len(prompt):].tolist()
        assert base == ref
        for depth in (1, 4, 16) if dtype == torch.float32 else (4,):
            out, rounds = run(spec, prompt, sp, depth)
            assert out == base, depth
            drafted += sum(r.drafted for r in rounds)
            accepted += sum(r.accepted for r in rounds)
        out, rounds = run(spec, prompt, sp, 4, branches=2)
        assert out == base and all(r.branches == 2 for r in rounds[1:])
        for lookup in (LookupParams(min_n=1, below=1.01), LookupParams(branch=True)):
            assert run(spec, prompt, sp, 4, lookup=lookup)[0] == base, lookup
        if dtype == torch.float32:
            flat = planner.single_device_profile("flat", {1: 10.0, 17: 11.0}, 0.1, model.config)
            policy = planner.DynamicDepth(flat, [0.9, 0.8], max_depth=8)
            out, rounds = run(spec, prompt, sp, policy)
            assert out == base
            assert [r.drafted for r in rounds[1:]] == policy.depths[:len(rounds) - 1]
    assert accepted > 0.5 * drafted, (accepted, drafted)
