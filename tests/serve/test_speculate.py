"""The speculative decoder (speculate.py): lossless greedy, exact sampling, stops, text stream.
Pure PyTorch on tiny random Llamas and, where parametrized over the verifier families, on the
DeepSeek-V3-shaped verifier (MLA + MoE, engine/toy.py; tests/conftest.py deepseek_verifier);
no Ray."""
import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_ray.plan import planner
from eagle3_ray.serve import speculate
from eagle3_ray.train.block import BlockDrafter, BlockKV
from eagle3_ray.train.draft import DraftConfig, Eagle3Drafter
from eagle3_ray.serve.speculate import SamplingParams, Speculator

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_pair(vocab: int, layers: int = 4, hidden: int = 64, draft_vocab: int | None = None,
              head_scale: float = 30.0, seed: int = 0, drafting: str = "chain", **draft_kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    vd = draft_vocab or vocab
    c = DraftConfig.from_verifier_config(cfg, vd, [1, layers // 2, layers - 1],  # ids >= 1
                                         drafting=drafting, **draft_kw)
    drafter = (BlockDrafter if drafting == "block" else Eagle3Drafter)(c).eval()
    drafter.t2d[:vd] = True  # draft ids = the first vd target ids (d2t = 0)
    return model, drafter


FAMILIES = ["llama", "deepseek"]     # DESIGN.md "Verifier families"


def family_pair(family: str, request, dtype=torch.float32, draft_vocab: int | None = 300):
    """(verifier, untrained drafter) of a verifier family: tiny_pair's 4-layer Llama (vocab 500),
    or the DeepSeek-V3-shaped deepseek_verifier (8 layers: MLA, a dense layer, then MoE;
    SmolLM2's vocab), loaded as serving loads it (in bf16 its router stays fp32). The drafter
    drafts the first `draft_vocab` token ids (None: all of them, as an oracle needs)."""
    if family == "llama":
        model, drafter = tiny_pair(vocab=500, draft_vocab=draft_vocab)
        return model.to(dtype), drafter
    from eagle3_ray.train import kinds
    spec = request.getfixturevalue("deepseek_verifier")
    model = speculate.verifier_lib.load_verifier(spec, dtype=dtype)
    return model, kinds.untrained_drafter(spec, draft_vocab)[0].eval()


def spy_verifies(spec: Speculator) -> list:
    """From now on every verify of `spec` appends (its cache length, [its tokens]) to the list
    returned."""
    seen, verify = [], spec._verify

    def spy(ids, cache, **kw):
        seen.append((cache.get_seq_length(), list(ids)))
        return verify(ids, cache, **kw)
    spec._verify = spy
    return seen


def run(spec: Speculator, prompt, sp: SamplingParams, depth, lookup=None, branches=1):
    out, rounds = [], []
    for r in spec.generate(prompt, sp, depth, branches, lookup=lookup):
        out += r.tokens
        rounds.append(r)
    return out, rounds


def full_aux(spec: Speculator, seq: list[int]) -> torch.Tensor:
    """The verifier's aux states of the whole sequence `seq` in one forward: [1, S, 3H]."""
    with torch.no_grad(), speculate.verifier_lib.capture_hidden_states(
            spec.model, spec.layer_ids) as got:
        spec.model(torch.tensor([seq]))
    return torch.cat([got["aux0"], got["aux1"], got["aux2"]], dim=-1)


def check_one_forward_kind(spec: Speculator, prompt: list[int], sp: SamplingParams, base,
                           deep: int) -> None:
    """A parallel or block drafter's rounds beyond fixed depths: a per-round depth (up to
    `deep`) and the lookup fallback keep greedy output `base`; trees are refused."""
    depths = iter([0, 3, 0, deep, 1] + [2] * 40)
    out, rounds = run(spec, prompt, sp, lambda h: next(depths))
    assert out == base and [r.drafted for r in rounds[1:6]] == [0, 3, 0, deep, 1]
    echo = prompt + base + prompt                      # the lookup fallback finds n-grams here
    out, rounds = run(spec, echo, sp, 4, lookup=LOOKUP_ALWAYS)
    assert out == run(spec, echo, sp, 0)[0] and any(r.lookup for r in rounds)
    with pytest.raises(ValueError, match="chain drafter"):
        run(spec, prompt, sp, 2, branches=2)


@pytest.mark.parametrize("family,prompts,depths", [("llama", 6, (1, 2, 4, 8, 16)),
                                                    ("deepseek", 2, (1, 4, 16))], ids=FAMILIES)
def test_greedy_equals_plain_decoding_at_every_depth(family, prompts, depths, request):
    """Greedy output at every depth, with a per-round depth and with the lookup fallback, is
    the verifier's own greedy decoding (transformers' generate), for both verifier families
    (the fp32 defaults: SDPA / tree_attention, few-row linears timed on this host)."""
    model, drafter = family_pair(family, request)
    spec = Speculator(model, drafter)
    g = torch.Generator().manual_seed(0)
    for i in range(prompts):
        prompt = torch.randint(0, 500, (3 + 4 * i,), generator=g).tolist()
        sp = SamplingParams(max_tokens=24)
        base, rounds0 = run(spec, prompt, sp, 0)
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                             min_new_tokens=24)[0, len(prompt):].tolist()
        assert base == ref                       # depth 0 is the verifier's own greedy decoding
        assert len(rounds0) == 24 and all(r.drafted == 0 for r in rounds0)
        for depth in depths:
            out, rounds = run(spec, prompt, sp, depth)
            assert out == base, (i, depth)
            assert all(r.drafted == depth for r in rounds[1:])
            assert all(0 <= r.accepted <= r.drafted for r in rounds)
            assert all(len(r.tokens) <= r.accepted + 1 for r in rounds)
        # dynamic depth (a per-round policy): same output, depths within bounds
        flat = planner.single_device_profile("flat", {1: 10.0, 17: 11.0}, 0.1, model.config)
        policy = planner.DynamicDepth(flat, [0.6, 0.5], max_depth=8)
        out, rounds = run(spec, prompt, sp, policy)
        assert out == base and [r.drafted for r in rounds[1:]] == policy.depths[:len(rounds) - 1]
        assert policy.depths[0] > 1 and all(0 <= d <= 8 for d in policy.depths)
    echo = prompt + base + prompt                      # the lookup fallback finds n-grams here
    out, rounds = run(spec, echo, sp, 4, lookup=LOOKUP_ALWAYS)
    assert out == run(spec, echo, sp, 0)[0] and any(r.lookup for r in rounds)


class OracleDrafter(Eagle3Drafter):
    """A test double with the drafter's interface that always proposes the verifier's own greedy
    next token (read from a precomputed continuation): its output state carries the position,
    and `logits` puts all mass on the token the verifier will pick there."""

    def __init__(self, c: DraftConfig, sequence: list[int]):
        super().__init__(c)
        self.t2d[:] = True
        self.sequence = sequence

    def forward(self, token_ids, hidden, positions, attend=None):
        attend(*self.qkv(token_ids, self.fuse(hidden) if hidden.shape[-1] != self.config.hidden_size
                         else hidden, positions))  # keep the KV cache bookkeeping real
        out = torch.zeros(*token_ids.shape, self.config.hidden_size)
        out[..., 0] = positions.float()
        return out

    def logits(self, hidden):
        pos = int(hidden[..., 0].flatten()[-1])
        out = torch.full(hidden.shape[:-1] + (self.config.draft_vocab_size,), -1e4)
        out[..., self.sequence[pos + 2]] = 0.0   # state at position t predicts token t + 2
        return out


def test_drafter_that_matches_the_verifier_gets_every_draft_accepted():
    model, drafter = tiny_pair(vocab=500)
    prompt = list(range(10, 20))
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                         min_new_tokens=60)[0].tolist()
    oracle = OracleDrafter(drafter.config, ref).eval()
    spec = Speculator(model, oracle)
    for depth in (1, 4, 8):
        out, rounds = run(spec, prompt, SamplingParams(max_tokens=40), depth)
        assert out == ref[len(prompt):len(prompt) + 40]
        full = [r for r in rounds[1:] if r.finish_reason is None]
        assert full and all(r.accepted == depth and len(r.tokens) == depth + 1 for r in full)
        assert len(rounds) == 1 + math.ceil(39 / (depth + 1))


@pytest.mark.parametrize("family,dtype,gemm_path", [
    ("llama", torch.bfloat16, "onednn"), ("llama", torch.bfloat16, "aten"),
    ("llama", torch.float32, "onednn"), ("deepseek", torch.bfloat16, "onednn"),
    ("deepseek", torch.bfloat16, "aten"), ("deepseek", torch.float32, "onednn")],
    indirect=["gemm_path"], ids=lambda v: str(v).removeprefix("torch."))
def test_verify_is_batch_invariant_so_greedy_stays_exact(family, dtype, gemm_path, request):
    """In bf16 a k-token forward rounds differently from k one-token forwards (GEMV vs GEMM,
    fused attention over a masked block); the Speculator makes a bf16 verifier batch invariant
    (kernels.make_batch_invariant: one matmul kernel for every row count, attention masked
    after the matmuls or a token at a time, an MoE block's tokens routed one at a time), so
    greedy stays token-for-token exact: for both verifier families (DeepSeek-V3's MLA: value
    heads narrower than query heads, one query head per KV head; its MoE), bf16 on both GEMM
    paths, and fp32 made batch invariant (the strict check on a host without bf16 kernels;
    fp32's GEMM path is the same either way)."""
    from transformers import DynamicCache
    from eagle3_ray.serve import kernels
    model, drafter = family_pair(family, request, dtype, draft_vocab=None)
    spec = Speculator(model, drafter, batch_invariant=True)       # bf16's default
    assert spec.exact == {"chain": True, "tree": True}            # bit for bit, start-up check
    assert model.config._attn_implementation == kernels.INVARIANT_ATTENTION
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m.forward, kernels.FewRowLinear) and m.forward.batch_invariant
               for m in linears)
    moe = kernels.moe_blocks(model)
    assert len(moe) == (7 if family == "deepseek" else 0)         # layers 1-7 (0 is dense)
    assert all(isinstance(b.forward, kernels.PerTokenMoE) for b in moe)
    prompt = list(range(10, 30))
    nxt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
    with torch.no_grad():
        for context in (prompt[:3], prompt):         # MLA's latents past 32 rows in the second
            cache = DynamicCache()
            model(torch.tensor([context]), cache=cache)
            steps = torch.cat([model(nxt[:, i:i + 1], cache=cache).logits for i in range(17)], 1)
            for k in (2, 5, 17):                                         # [1, k, V]
                cache.crop(-(cache.get_seq_length() - len(context)))
                assert torch.equal(model(nxt[:, :k], cache=cache).logits, steps[:, :k]), k
    if dtype in kernels._packable_dtypes():                # this CPU: oneDNN packed
        assert all(m.forward.packed is not None for m in linears)
    sp = SamplingParams(max_tokens=40)
    base, _ = run(spec, prompt, sp, 0)
    for depth in (1, 3, 8) if family == "llama" else (3,):     # deepseek: ~2 s a depth here
        assert run(spec, prompt, sp, depth)[0] == base, depth
    oracle = Speculator(model, OracleDrafter(drafter.config, prompt + base + [0] * 40).eval())
    out, rounds = run(oracle, prompt, sp, 8)
    assert out == base
    assert all(r.accepted == 8 for r in rounds[1:] if r.finish_reason is None)


def test_bf16_attention_rows_do_not_depend_on_the_keys_or_tokens_carried():
    """kernels.batch_invariant_attention in bf16 with SmolLM2's heads (9 query, 3 KV, 64 dims):
    each token of a q-token verify computes bit for bit what a one-token forward over exactly
    the keys it sees does, for every cache length 2..140 and q up to 17. On an AMX CPU the
    probabilities @ values matmul rounded differently when the number of keys was not a
    multiple of 32 (6 of ~600 shapes; greedy demo outputs then diverged): keys are padded."""
    from eagle3_ray.serve import kernels
    torch.manual_seed(0)
    bad = []
    with torch.no_grad():
        for kv in range(2, 141):
            for q in (2, 3, 5, 9, 17):
                if q >= kv:
                    continue
                query = torch.randn(1, 9, q, 64).bfloat16()
                key, value = torch.randn(2, 1, 3, kv, 64).bfloat16()
                joint = kernels.batch_invariant_attention(None, query, key, value, None)[0]
                for i in range(q):
                    seen = kv - q + i + 1
                    one = kernels.batch_invariant_attention(
                        None, query[:, :, i:i + 1], key[:, :, :seen].contiguous(),
                        value[:, :, :seen].contiguous(), None)[0]
                    if not torch.equal(one[0, 0], joint[0, i]):
                        bad.append((kv, q, i))
    assert not bad, bad[:10]


def test_bf16_tree_paths_attend_as_their_chains(gemm_path):
    """kernels._tree_attention in bf16 with SmolLM2's heads: every path of a tree verify
    computes bit for bit what batch_invariant_attention does for that path verified as a chain,
    for every cache length 2..140, on both GEMM paths. On an AMX CPU the gathered keys must be
    padded to 32-key blocks for that (without: 11 of 220 SmolLM2 tree paths differed from their
    chains). Without oneDNN's bf16 (an AVX2-only CPU) each path attends a token at a time; the
    shorter paths once attended to their padding there too (issue 48: [0, 4, 5] and [0, 6]
    differed at every cache length)."""
    from eagle3_ray.serve import kernels
    torch.manual_seed(0)
    paths, bad = [[0, 1, 2, 3], [0, 4, 5], [0, 6]], []
    with torch.no_grad():
        for cached in range(2, 141):
            query = torch.randn(1, 9, 7, 64).bfloat16()
            key, value = torch.randn(2, 1, 3, cached + 7, 64).bfloat16()
            tree = kernels.tree_layout(paths, cached)
            out = kernels._tree_attention(None, query, key, value, None, tree)[0]  # [1, 7, 9, 64]
            for p in paths:
                seen = list(range(cached)) + [cached + i for i in p]
                chain = kernels.batch_invariant_attention(
                    None, query[:, :, p], key[:, :, seen], value[:, :, seen], None)[0]
                if not torch.equal(out[0, p], chain[0]):
                    bad.append((cached, p))
    assert not bad, bad[:10]


def test_fp32_speculator_times_its_few_row_kernels():
    """An fp32 verifier's 1- and 2-row linears run on the kernel that timed fastest here
    (kernels.tune_few_row_kernels), the drafter's take the same; greedy output unchanged."""
    from eagle3_ray.serve import kernels
    model, drafter = tiny_pair(vocab=500)
    spec = Speculator(model, drafter)
    assert set(spec.few_row_kernels) == set(kernels.TUNED_ROWS)
    assert set(spec.few_row_kernels.values()) <= set(kernels.FEW_ROW_KERNELS)
    packed = {r for r, k in spec.few_row_kernels.items() if k == "mkl_packed"}
    for m in list(model.modules()) + list(drafter.modules()):
        if isinstance(m, torch.nn.Linear):
            assert m.forward.few == spec.few_row_kernels
            assert set(m.forward.mkl_packed) <= packed         # the others' packs were dropped
    prompt, sp = list(range(10, 30)), SamplingParams(max_tokens=20)
    base, _ = run(spec, prompt, sp, 0)
    for kernels in ({1: "mkl", 2: "mkl", 3: "rows"}, {1: "onednn", 2: "linear", 3: "mkl"},
                    {1: "mkl_packed", 2: "mkl_packed", 4: "mkl_packed"}):
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.forward.few = kernels
        assert run(spec, prompt, sp, 0)[0] == base and run(spec, prompt, sp, 3)[0] == base


def test_fp32_verifier_attention_matches_transformers_sdpa():
    """kernels.tree_attention (an fp32 verifier's attention: SDPA reading the grouped KV heads
    in place) gives transformers' SDPA logits, for a prefill, a decode step and a chain verify."""
    from transformers import DynamicCache
    from eagle3_ray.serve import kernels
    model, _ = tiny_pair(vocab=300)                                   # 4 query heads, 2 KV heads
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for impl in ("sdpa", "ours"):
        if impl == "ours":
            kernels.allow_trees(model)
        cache, logits = DynamicCache(), []
        with torch.inference_mode():
            for a, b in ((0, 30), (30, 31), (31, 36), (36, 40)):       # prefill, 1, 5, 4 tokens
                logits.append(model(input_ids=ids[:, a:b], past_key_values=cache,
                                    use_cache=True).logits)
        out[impl] = torch.cat(logits, 1)
    torch.testing.assert_close(out["ours"], out["sdpa"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_linear_kernels(dtype):
    """kernels.FewRowLinear: the layer's own output (up to rounding), rows independent of the
    row count when batch invariant, a fresh packed copy after the weights change, and plain
    F.linear (with gradients) when gradients are on."""
    from eagle3_ray.serve import kernels
    torch.manual_seed(0)
    layer = torch.nn.Linear(288, 240, bias=True).to(dtype)            # > kernels._SMALL_WEIGHT
    x = torch.randn(1, 17, 288, dtype=dtype)
    fast, inv = kernels.FewRowLinear(layer), kernels.FewRowLinear(layer, batch_invariant=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        pairs = [inv(x[:, i:i + 2]) for i in range(0, 16, 2)] + [inv(x[:, 15:17])[:, 1:]]
        two = torch.cat(pairs, 1)                                       # [1, 17, 240], 2 rows each
        for rows in (1, 2, 3, 5, 17):
            torch.testing.assert_close(fast(x[:, :rows]).float(), ref[:, :rows], **tol)
            assert torch.equal(inv(x[:, :rows]), two[:, :rows]), rows
        assert torch.equal(inv(x[:, 4:5]), two[:, 4:5])                  # a row alone
        # past 32 rows, on SmolLM2's shape (AMX: its blocking changed at 33 there)
        big = kernels.FewRowLinear(torch.nn.Linear(576, 576, bias=False).to(dtype), True)
        x40 = torch.randn(1, 40, 576, dtype=dtype)
        assert torch.equal(big(x40), torch.cat([big(x40[:, i:i + 1]) for i in range(40)], 1))
        if dtype == torch.float32:                  # each kernel tune_few_row_kernels picks from
            for kernel in kernels.FEW_ROW_KERNELS:
                fast.few = {1: kernel, 2: kernel, 3: kernel, 8: kernel}   # 4-8 rows: 8's kernel
                for rows in (1, 2, 3, 5, 8, 17):
                    torch.testing.assert_close(fast(x[:, :rows]).float(), ref[:, :rows], **tol)
            if kernels._mkl_packable():            # MKL packed for 1, 2, 3 and 8 rows (5: padded)
                assert set(fast.mkl_packed) == {1, 2, 3, 8}
            fast.few = {2: "mkl_packed"}
        layer.weight.mul_(2.0)                                          # weights change
        ref2 = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(fast(x[:, :5]).float(), ref2[:, :5], **tol)
        torch.testing.assert_close(fast(x[:, :2]).float(), ref2[:, :2], **tol)   # a fresh pack
    y = inv(x[:, :3].clone().requires_grad_())                          # gradients on
    y.sum().backward()
    assert layer.weight.grad is not None


def exact_marginals(model, prompt, temperature, top_p, steps):
    """The verifier's own sampling distribution of the tokens at steps 1..steps, enumerated."""
    vocab = model.config.vocab_size
    marg = [torch.zeros(vocab, dtype=torch.float64) for _ in range(steps)]
    frontier = [(prompt, 1.0)]
    for k in range(steps):
        nxt = []
        for seq, w in frontier:
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1]
            p = speculate.probs(logits, temperature, top_p).double()
            marg[k] += w * p
            nxt += [(seq + [t], w * float(p[t])) for t in range(vocab) if p[t] > 1e-9]
        frontier = nxt
    return marg


def chi2(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    keep = expected_p * n >= 5  # pool the rare cells into one
    e = torch.cat([expected_p[keep] * n, (expected_p[~keep] * n).sum().view(1)])
    o = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    e, o = e[e > 0], o[e > 0]
    return float(((o - e) ** 2 / e).sum())


LOOKUP_ALWAYS = speculate.LookupParams(min_n=1, max_n=2, below=1.01)   # whenever it matches


@pytest.mark.parametrize("top_p,lookup,drafting", [
    (1.0, None, "chain"), (0.8, None, "chain"), (1.0, LOOKUP_ALWAYS, "chain"),
    (1.0, None, "parallel"), (1.0, None, "block")])
def test_sampling_matches_the_verifier_distribution(top_p, lookup, drafting):
    """Rejection sampling keeps the verifier's distribution: the tokens at steps 1-3 over many
    seeds fit the exact marginals (enumerated from the verifier) under a chi-square test, while
    the drafter's own proposals (what an accept-everything bug would emit) clearly do not.
    Also with the lookup fallback (its drafts verified as one-hot proposals)."""
    vocab, n, steps, temp = 12, 800, 3, 1.0
    # 4 layers: the smallest verifier with 3 distinct aux ids >= 1 (verifier.check_layer_ids);
    # seed 3: a drafter far enough from this verifier for the power check below
    model, drafter = tiny_pair(vocab=vocab, layers=4, hidden=32, head_scale=12.0, seed=3,
                               drafting=drafting)
    spec = Speculator(model, drafter)
    prompt = [1, 5, 7]
    exact = exact_marginals(model, prompt, temp, top_p, steps)
    counts = [torch.zeros(vocab, dtype=torch.float64) for _ in range(steps)]
    drafted = accepted = looked = 0
    for seed in range(n):
        out, rounds = run(spec, prompt, SamplingParams(max_tokens=steps, temperature=temp,
                                                       top_p=top_p, seed=seed), 3, lookup)
        for k, t in enumerate(out):
            counts[k][t] += 1
        drafted += sum(r.drafted for r in rounds)
        accepted += sum(r.accepted for r in rounds)
        looked += sum(r.lookup for r in rounds)
    assert 0.1 < accepted / drafted < 0.95          # both branches (accept, resample) exercised
    assert (looked > n / 4) == (lookup is not None)  # the lookup's drafts were verified
    critical = 45.3  # chi-square, df <= 20, p = 0.001 (fixed seeds: deterministic)
    for k in range(steps):
        assert chi2(counts[k], exact[k]) < critical, k
    # power: the drafter's first proposal is a distribution far from the verifier's
    q = torch.zeros(vocab, dtype=torch.float64)
    for seed in range(300):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            logits, aux = spec._verify(prompt, __import__("transformers").DynamicCache())
            x = speculate.pick(logits[-1], SamplingParams(temperature=temp, top_p=top_p), gen)
            (tok,), _, _, _ = spec._draft_chain(prompt[1:] + [x], aux, spec._draft_cache(), 1,
                                                SamplingParams(temperature=temp, top_p=top_p),
                                                gen)
        q[tok] += 1
    assert chi2(q, exact[1]) > 3 * critical


def test_seed_reproducible_and_stops():
    model, drafter = tiny_pair(vocab=500)
    spec = Speculator(model, drafter)
    sp = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    a, _ = run(spec, [3, 4, 5], sp, 4)
    b, _ = run(spec, [3, 4, 5], sp, 4)
    assert a == b and len(a) == 20
    greedy, _ = run(spec, [3, 4, 5], SamplingParams(max_tokens=20), 4)
    eos = greedy[6]
    first = greedy.index(eos)
    out, rounds = run(spec, [3, 4, 5], SamplingParams(max_tokens=20, eos_ids=(eos,)), 4)
    assert out == greedy[:first] and rounds[-1].finish_reason == "stop"
    out, rounds = run(spec, [3, 4, 5], SamplingParams(max_tokens=5), 8)
    assert out == greedy[:5] and rounds[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        run(spec, [3], SamplingParams(max_tokens=0), 0)
    with pytest.raises(ValueError, match="drafter"):
        run(Speculator(model), [3], SamplingParams(), 2)


def test_dynamic_depth_callable_keeps_output():
    model, drafter = tiny_pair(vocab=500)
    spec = Speculator(model, drafter)
    base, _ = run(spec, [9, 8, 7], SamplingParams(max_tokens=30), 0)
    depths = iter([0, 3, 0, 0, 5, 1] + [2] * 40)
    out, rounds = run(spec, [9, 8, 7], SamplingParams(max_tokens=30), lambda h: next(depths))
    assert out == base
    assert [r.drafted for r in rounds[1:7]] == [0, 3, 0, 0, 5, 1]


def test_text_stream_stop_strings_and_partial_holdback(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("Hello world. STOP here", add_special_tokens=False)
    s = speculate.TextStream(tok, stop=["STOP"])
    text = "".join(s.push([i]) for i in ids)
    assert s.stopped and text == "Hello world. "
    s = speculate.TextStream(tok, stop=["xyz"])
    text = "".join(s.push([i]) for i in ids) + s.push([], final=True)
    assert not s.stopped and text == "Hello world. STOP here"


def test_cached_drafts_equal_the_drafters_full_sequence_predictions():
    """Each round's first draft (KV-cached drafter, absorbing only the new tokens) equals the
    drafter's prediction from one causal pass over the whole final sequence with the
    verifier's aux states — what training's step 0 computes."""
    model, drafter = tiny_pair(vocab=500, draft_vocab=300, seed=3)
    spec = Speculator(model, drafter)
    seen = spy_verifies(spec)                          # (verifier cache length n, [x, d1, ..])
    prompt = list(range(30, 45))
    out, _ = run(spec, prompt, SamplingParams(max_tokens=30), 1)
    seq = prompt + out
    aux = full_aux(spec, seq)                               # [1, S, 3H]
    with torch.no_grad():
        hidden = drafter(torch.tensor([seq[1:] + [0]]), aux, torch.arange(len(seq))[None])
        pred = drafter.draft_to_target(drafter.logits(hidden)[0].argmax(-1))  # t -> token t+2
    rounds = seen[1:]                                  # after the prefill
    assert len(rounds) >= 10
    for n, ids in rounds:                              # x at position n, d1 predicts n + 1
        assert ids[1] == int(pred[n - 1]), (n, ids)


class SecondChoiceOracle(OracleDrafter):
    """An oracle whose first draft of each round (the step fed the verifier's aux states) ranks
    a wrong token first and the verifier's second; later steps rank the verifier's token first.
    A chain then never gets a draft accepted; two branches get every draft accepted."""

    def forward(self, token_ids, hidden, positions, attend=None):
        out = super().forward(token_ids, hidden, positions, attend)
        out[..., 1] = float(hidden.shape[-1] != self.config.hidden_size)  # fed aux: a 1st draft
        return out

    def logits(self, hidden):
        out = super().logits(hidden)
        first = hidden[..., 1] > 0                                         # [..]
        right = out.argmax(-1)                                             # [..]
        wrong = (right + 1) % out.shape[-1]
        out[first] = out[first].scatter(-1, wrong[first][:, None], 1.0)    # above the right one
        return out


# fp32 runs the same kernels on both GEMM paths: the slower family runs it once
@pytest.mark.parametrize("family,dtype,gemm_path", [
    (f, d, g) for f in FAMILIES for d in (torch.float32, torch.bfloat16)
    for g in ("onednn", "aten") if (f, d, g) != ("deepseek", torch.float32, "aten")],
    indirect=["gemm_path"], ids=lambda v: str(v).removeprefix("torch."))
def test_branches_verify_a_tree_in_one_forward_and_stay_exact(family, dtype, gemm_path, request):
    """branches > 1: the chains forked at the first draft are verified in one forward whose
    every path computes what that chain alone would (bit for bit in bf16), the longest accepted
    chain wins and the KV cache keeps only its tokens, so greedy output stays the verifier's.
    Asserted where the Speculator's start-up check finds trees exact on this host's kernels
    (both GEMM paths, every host seen so far); where it does not, that trees are refused.
    Both verifier families (DeepSeek-V3: MLA's cached latents reordered by keep_cache, its MoE)."""
    from transformers import DynamicCache
    model, drafter = family_pair(family, request, dtype)
    spec = Speculator(model, drafter)
    if not spec.exact["tree"]:
        with pytest.raises(ValueError, match="tree verify .* use chains"):
            run(spec, list(range(10, 30)), SamplingParams(max_tokens=8), 3, branches=2)
        return
    context, chains = list(range(10, 30)), [[5, 6, 7], [8, 9], [11, 12, 13, 14]]
    ids, paths = [3], []
    for c in chains:
        paths.append([0] + list(range(len(ids), len(ids) + len(c))))
        ids += c
    with torch.inference_mode():
        cache = DynamicCache()
        spec._verify(context, cache)
        tree, tree_aux = spec._verify(ids, cache, tree_paths=paths)       # [1+9, V]
        for path in paths:
            cache.crop(len(context) - cache.get_seq_length())
            chain, chain_aux = spec._verify([ids[i] for i in path], cache)
            if dtype == torch.bfloat16:                                    # batch invariant
                assert torch.equal(tree[path], chain) and torch.equal(tree_aux[:, path], chain_aux)
            else:
                torch.testing.assert_close(tree[path], chain, rtol=1e-4, atol=1e-4)
        if dtype == torch.bfloat16:         # other cache lengths (AMX: keys in 32-key blocks)
            for n in (7, 33, 61):
                longer = list(range(40, 40 + n))
                cache = DynamicCache()
                spec._verify(longer, cache)
                tree = spec._verify(ids, cache, tree_paths=paths)[0]
                for path in paths:
                    cache.crop(n - cache.get_seq_length())
                    assert torch.equal(tree[path], spec._verify([ids[i] for i in path], cache)[0])
            cache = DynamicCache()
            spec._verify(context, cache)
        # the cache keeps x and the winning path's accepted drafts, in order
        cache.crop(len(context) - cache.get_seq_length())
        spec._verify(ids, cache, tree_paths=paths)
        keep = [0, 4, 5]                                                   # x, chains[1] (8, 9)
        speculate.keep_cache(cache, len(context), keep)
        assert cache.get_seq_length() == len(context) + 3
        nxt = spec._verify([20], cache)[0]
        cache.crop(len(context) - cache.get_seq_length())
        want = spec._verify([3, 8, 9, 20], cache)[0][-1:]
        torch.testing.assert_close(nxt, want, rtol=1e-4, atol=1e-4)

    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=24)
    shapes = [(b, d) for b in (2, 4) for d in (1, 3, 6)] if family == "llama" else [(2, 3),
                                                                                   (4, 6)]
    for i in range(3 if family == "llama" else 1):
        prompt = torch.randint(0, 500, (4 + 5 * i,), generator=g).tolist()
        base, _ = run(spec, prompt, sp, 0)
        for branches, depth in shapes:
            out, rounds = [], []
            for r in spec.generate(prompt, sp, depth, branches=branches):
                out += r.tokens
                rounds.append(r)
            assert out == base, (i, branches, depth)
            assert all(r.drafted == depth and r.branches == branches and
                       0 <= r.accepted <= depth for r in rounds[1:])
    # a drafter right only in second place: a chain never gets a draft in, two branches do
    prompt, sp = list(range(10, 20)), SamplingParams(max_tokens=40)
    base, _ = run(spec, prompt, sp, 0)                                     # the verifier's own
    every = dataclasses.replace(drafter.config, draft_vocab_size=drafter.config.vocab_size)
    spec = spec.with_drafter(SecondChoiceOracle(every, prompt + base + [0] * 20).eval())
    chain, rounds = run(spec, prompt, sp, 4)
    assert chain == base
    assert all(r.accepted == 0 for r in rounds[1:])
    out, rounds = [], []
    for r in spec.generate(prompt, sp, 4, branches=2):
        out += r.tokens
        rounds.append(r)
    assert out == chain
    assert all(r.accepted == 4 for r in rounds[1:] if r.finish_reason is None)
    assert len(rounds) == 1 + math.ceil(39 / 5)
    with pytest.raises(ValueError, match="greedy"):
        next(spec.generate(prompt, SamplingParams(temperature=0.7), 4, branches=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_start_up_check_finds_inexact_kernels_and_trees_are_refused(dtype, make_inexact):
    """Speculator.check_exact verifies random tokens at start-up, on this host's kernels: a
    tree against its chains and a chain against decoding. With kernels that round a tree verify
    differently (a MOCK: none here), trees are refused with the reason and what to use instead,
    the lookup branch too, while chains stay exact; with a multi-token verify that rounds
    differently, the check says so."""
    model, drafter = tiny_pair(vocab=500)
    model = model.to(dtype)
    prompt, sp = list(range(10, 30)), SamplingParams(max_tokens=16)
    assert Speculator(model, drafter).exact == {"chain": True, "tree": True}
    base, _ = run(Speculator(model, drafter), prompt, sp, 0)
    make_inexact("tree")
    spec = Speculator(model, drafter)
    assert spec.exact == {"chain": True, "tree": False}
    for branches, lookup in ((2, None), (1, speculate.LookupParams(branch=True))):
        with pytest.raises(ValueError, match="a tree verify .* does not compute what its paths "
                                             "verified as chains do .* use chains"):
            run(spec, prompt, sp, 3, branches=branches, lookup=lookup)
    assert run(spec, prompt, sp, 3)[0] == base
    make_inexact("chain")
    spec = Speculator(model, drafter)
    assert spec.exact["chain"] is False
    assert "serve at depth 0" in spec.inexact_reason("chain")


def test_parallel_drafter_drafts_a_round_in_one_forward_and_stays_exact():
    """A parallel (P-EAGLE) drafter: every round's D drafts come from ONE drafter forward (the
    round's new tokens plus D-1 mask slots), equal to one causal pass of the drafter over the
    whole final sequence with the mask slots after the round's position; greedy output equals
    plain decoding at every depth, with a per-round depth too; trees are refused."""
    model, drafter = tiny_pair(vocab=500, draft_vocab=300, seed=5, drafting="parallel")
    spec = Speculator(model, drafter)
    calls, seen, forward = [], spy_verifies(spec), drafter.forward
    drafter.forward = lambda *a, **kw: calls.append(kw.get("masked", 0)) or forward(*a, **kw)
    prompt = list(range(30, 45))
    sp = SamplingParams(max_tokens=30)
    base, _ = run(spec, prompt, sp, 0)
    for depth in (1, 2, 4, 8, 16):
        calls.clear()
        seen.clear()
        out, rounds = run(spec, prompt, sp, depth)
        assert out == base, depth
        assert calls == [depth - 1] * (len(rounds) - 1)     # one forward per drafted round
        seq = prompt + out
        aux = full_aux(spec, seq)                           # [1, S, 3H]
        for n, ids in seen[1:]:                             # x = seq[n] at position n
            with torch.no_grad():
                h = forward(torch.tensor([seq[1:n + 1]]), aux[:, :n],
                            torch.arange(n + depth - 1)[None], masked=depth - 1)
                want = drafter.draft_to_target(drafter.logits(h[0, -depth:]).argmax(-1))
            assert ids[1:] == want.tolist(), (depth, n)
    check_one_forward_kind(spec, prompt, sp, base, 5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_block_drafter_drafts_a_round_in_one_forward_and_stays_exact(block_size):
    """A block (DFlash) drafter: every drafted round is ONE drafter forward of [x, D masks]
    whose drafts equal the drafter run afresh on the round's whole context (its cache of
    context keys is what a from-scratch forward computes); greedy output equals plain decoding
    at depths up to the block size, with a per-round depth and with the lookup fallback; trees
    are refused."""
    model, drafter = tiny_pair(vocab=500, draft_vocab=300, seed=5, drafting="block",
                               block_size=block_size, block_layers=2)
    spec = Speculator(model, drafter)
    calls, seen, forward = [], spy_verifies(spec), drafter.forward
    drafter.forward = lambda *a, **kw: calls.append(a[0].shape[1]) or forward(*a, **kw)
    prompt = list(range(30, 45))
    sp = SamplingParams(max_tokens=24)
    base, _ = run(spec, prompt, sp, 0)
    for depth in sorted({1, block_size // 2, block_size}):
        calls.clear()
        seen.clear()
        out, rounds = run(spec, prompt, sp, depth)
        assert out == base, depth
        assert calls == [depth + 1] * (len(rounds) - 1)     # one forward of x + D masks a round
        seq = prompt + out
        aux = full_aux(spec, seq)                           # [1, S, 3H]
        for n, ids in seen[1:]:                             # x = seq[n] at position n
            slots = torch.tensor([[seq[n]] + [drafter.config.mask_token_id] * depth])
            with torch.no_grad():
                h = forward(slots, torch.arange(n, n + depth + 1)[None], BlockKV(2),
                            aux=aux[:, :n], aux_positions=torch.arange(n)[None])
                want = drafter.draft_to_target(drafter.logits(h[0, 1:]).argmax(-1))
            assert ids[1:] == want.tolist(), (depth, n)
    check_one_forward_kind(spec, prompt, sp, base, block_size)


@pytest.mark.parametrize("draft_kw", [{"layer": "mla"},
                                      {"layer": "mla", "fc_norm": True, "norm_output": True},
                                      {"fc_norm": True, "norm_output": True}],
                         ids=["mla", "mla-3.1", "llama-3.1"])
def test_mla_and_eagle31_drafters_chain_as_computed_directly_and_stay_exact(draft_kw):
    """An MLA drafter (mla.DEFAULT_DIMS on a Llama verifier: Dqk 192, Dv 128, a key per head)
    and EAGLE-3.1's toggles in the builtin decoder: each round's drafts are the chain computed
    directly (qkv/finish with plain causal attention over the whole sequence, step i+1 fed step
    i's output state, norm(state) with norm_output), and greedy output is the verifier's."""
    from eagle3_ray.train.draft import causal_attention
    model, drafter = tiny_pair(vocab=500, draft_vocab=300, seed=6, **draft_kw)
    with torch.no_grad():                  # weights far from the init, the norms included
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.05))
    spec = Speculator(model, drafter)
    seen = spy_verifies(spec)
    prompt = list(range(30, 42))
    sp = SamplingParams(max_tokens=16)
    base, _ = run(spec, prompt, sp, 0)
    for depth in (1, 4):
        seen.clear()
        out, _ = run(spec, prompt, sp, depth)
        assert out == base, depth
        seq = prompt + out
        aux = full_aux(spec, seq)                           # [1, S, 3H]
        for n, ids in seen[1:]:                     # x = seq[n] at position n
            hidden, tokens, want = drafter.fuse(aux[:, :n]), seq[1:n + 1], []
            with torch.no_grad():
                for _ in range(depth):
                    pos = torch.arange(len(tokens))[None]
                    q, k, v = drafter.qkv(torch.tensor([tokens]), hidden, pos)
                    h = drafter.finish(hidden, causal_attention(q, k, v))[:, -1:]  # [1, 1, H]
                    want.append(int(drafter.draft_to_target(drafter.logits(h)[0, 0].argmax())))
                    tokens = tokens + [want[-1]]
                    fed = drafter.norm(h) if drafter.config.norm_output else h
                    hidden = torch.cat([hidden, fed], 1)                           # [1, s+1, H]
            assert ids[1:] == want, (depth, n)
    if spec.exact["tree"]:                          # branches feed their states the same way
        assert run(spec, prompt, sp, 3, branches=2)[0] == base
