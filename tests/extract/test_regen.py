"""Batched regeneration (regen.BatchGenerator) on a tiny random fp32 Llama, and `extract
--regenerate` on records the old code aborted on."""
import collections
import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import CONVERSATIONS
from eagle3_ray.data import conversations as data, schema
from eagle3_ray.extract import regen

PROMPTS = [[5, 9, 17], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41], [7] * 20,
           [1, 2, 3, 4, 5], [60 + i for i in range(11)]]   # 12 and 11 share a padded prefill


@pytest.fixture(scope="module")
def tiny_llama():
    """Random 2-layer Llama, H=64, GQA (4 heads, 2 KV heads), vocab 128, no EOS in its config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked, but not degenerate, next-token distributions
    return model


def one_at_a_time(model, prompts, max_new):
    """transformers' greedy generate, one prompt per call (no padding)."""
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                           pad_token_id=0, temperature=None, top_p=None,
                           top_k=None)[0, len(p):].tolist() for p in prompts]


def test_greedy_batch_equals_one_at_a_time(tiny_llama, one_thread):
    ref = one_at_a_time(tiny_llama, PROMPTS, 10)
    assert len({tuple(r) for r in ref}) == len(ref)  # distinct answers: a real comparison
    gen = regen.BatchGenerator(tiny_llama, pad_id=0, eos_ids=[])
    assert gen.fast
    assert gen.generate(PROMPTS, 10) == ref            # one left-padded batch of 6
    # per-row limits; three rows finish after 2 tokens, the batch shrinks to the live rows
    got = gen.generate(PROMPTS, [2, 10, 2, 2, 7, 1])
    assert got == [ref[0][:2], ref[1], ref[2][:2], ref[3][:2], ref[4][:7], ref[5][:1]]
    # several batches (max_batch 2), and the transformers fallback, agree too
    small = regen.BatchGenerator(tiny_llama, 0, [], regen.GenerateConfig(max_batch=2))
    assert small.generate(PROMPTS, 10) == ref and small.stats.batches == 3
    assert regen.BatchGenerator(tiny_llama, 0, [], fast=False).generate(PROMPTS, 10) == ref
    assert gen.stats.new_tokens == 60 + 24 and gen.stats.prompts == 12


def test_eos_stops_its_row_only(tiny_llama, one_thread):
    ref = one_at_a_time(tiny_llama, PROMPTS, 10)
    eos = ref[1][3]                                    # row 1's 4th token ends its answer
    got = regen.BatchGenerator(tiny_llama, 0, [eos]).generate(PROMPTS, 10)
    for r, g in zip(ref, got):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert g == r[:cut]
    assert got[1] == ref[1][:4] and max(len(g) for g in got) == 10


def test_sampling_reproducible_per_row_seed(tiny_llama, one_thread):
    cfg = regen.GenerateConfig(temperature=1.0, top_p=0.9)
    gen = regen.BatchGenerator(tiny_llama, 0, [], cfg)
    seeds = [11, 12, 13, 14, 15, 16]
    a = gen.generate(PROMPTS, 12, seeds)
    assert gen.generate(PROMPTS, 12, seeds) == a                      # same seeds, same output
    assert gen.generate([PROMPTS[3]], 12, [14]) == [a[3]]             # not batch dependent
    assert gen.generate(PROMPTS, 12, [s + 100 for s in seeds]) != a   # the seed matters
    assert a != one_at_a_time(tiny_llama, PROMPTS, 12)                # it really samples
    # a nucleus holding only the top token is greedy decoding
    nucleus = regen.BatchGenerator(tiny_llama, 0, [], regen.GenerateConfig(temperature=1.0,
                                                                           top_p=1e-6))
    assert nucleus.generate(PROMPTS, 6, seeds) == one_at_a_time(tiny_llama, PROMPTS, 6)


def test_length_batches_respect_budget():
    lengths, new = [10, 300, 50, 40, 290, 45], [20] * 6
    groups = regen.length_batches(lengths, new, token_budget=700, max_batch=3)
    assert groups == [[1, 4], [2, 5, 3], [0]]          # longest first, rows x (S + new) <= 700
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert regen.length_batches([500], [100], 100, 4) == [[0]]  # a lone row may exceed it


def test_fast_path_steps():
    """The fast path's pure steps: prefill runs (runs of prompts sorted longest first, as
    extraction packs its forwards), left padding, the decode bias, un-sorting."""
    runs = regen.pack_by_token_budget
    assert runs([100, 95, 91, 89, 50, 50], 400) == [[0, 1, 2], [3], [4, 5]]   # padding <= 10%
    assert runs([100] * 5, 250) == [[0, 1], [2, 3], [4]]                     # token cap
    ids, mask = regen.left_pad([[1, 2], [3]], pad_id=9)
    assert ids.tolist() == [[1, 2], [9, 3]] and mask.tolist() == [[1, 1], [0, 1]]
    neg = torch.finfo(torch.float32).min                # prompts end at column 2, 2 new columns
    assert regen.decode_bias(torch.tensor([2, 1]), 2, 4).tolist() == [[0, 0, neg, neg],
                                                                      [neg, 0, neg, neg]]
    assert regen.unsort_rows(torch.tensor([[5, -1], [6, 7]]), [1, 0]) == [[6, 7], [5]]
    assert regen.pick_next(torch.tensor([[0.0, 2.0, 1.0]]), None, 0.0, 1.0).tolist() == [1]


def test_regen_start_rule():
    sys_, u, a = ({"role": r, "content": r[0]} for r in ("system", "user", "assistant"))
    from eagle3_ray.extract.pipeline import regen_start
    assert regen_start([a, u, a]) == [u, a]
    assert regen_start([sys_, a, a, u, a, u, a]) == [sys_, u, a, u, a]
    with pytest.raises(data.SkipRecord, match="no_user_turn"):
        regen_start([sys_, a])


def test_extract_regenerates_conversations_that_open_with_the_assistant(
        ray_cluster, tiny_verifier, tiny_tokenizer, tmp_path):
    """Ray Data path: a conversation opening with an assistant turn is regenerated from its first
    user turn (the old code aborted the job on it); one without a user turn is a counted skip."""
    from eagle3_ray.extract.pipeline import ExtractConfig, run_extract
    records = [
        {"conversations": [{"from": "gpt", "value": "Welcome! OPENING-TURN"},
                           {"from": "human", "value": "Count to three."},
                           {"from": "gpt", "value": "1 2 3"}]},
        {"conversations": [{"from": "system", "value": "You are terse."},
                           {"from": "gpt", "value": "OPENING-TURN"},
                           {"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "hi"}]},
        {"conversations": [{"from": "system", "value": "Be kind."},
                           {"from": "gpt", "value": "Nobody asked me."}]},     # no user turn
        CONVERSATIONS[1],
    ]
    convs = tmp_path / "c.json"
    convs.write_text(json.dumps(records))
    out = tmp_path / "ds"
    m = run_extract(ExtractConfig(verifier=tiny_verifier, inputs=[str(convs)], output=str(out),
                                  max_length=128, batch_rows=8, token_budget=300,
                                  dtype="float32", regenerate=True, regen_max_new_tokens=5))
    assert m["summary"]["samples"] == 3
    assert m["summary"]["skipped"] == {"no_user_turn": 1}
    assert 3 <= m["summary"]["this_run"]["regen_tokens"] <= 3 * 5
    fs, root = schema.resolve_fs(str(out))
    rows = [r for p in schema.list_parts(fs, root) for r in pq.read_table(p).to_pylist()]
    texts = {int(r["sample_id"].split(":")[1]): tiny_tokenizer.decode(r["input_ids"])
             for r in rows}
    assert sorted(texts) == [0, 1, 3]
    assert all("OPENING-TURN" not in t for t in texts.values())
    assert "Count to three." in texts[0] and "You are terse." in texts[1]
    for r in rows:  # one regenerated answer each, up to 5 tokens, and only it is trained on
        assert 0 < sum(r["loss_mask"]) <= 6


def test_a_failing_record_is_a_counted_skip(tiny_verifier, tmp_path):
    """In-process (no Ray): unreadable records and a failing generation skip only themselves."""
    from eagle3_ray.extract.pipeline import ExtractConfig, VerifierExtractor
    cfg = ExtractConfig(verifier=tiny_verifier, output=str(tmp_path / "o"), max_length=128,
                        dtype="float32", regenerate=True, regen_max_new_tokens=3)
    ex = VerifierExtractor(cfg, {})
    good = json.dumps(data.normalize(CONVERSATIONS[1]))
    rows = [{"sample_id": "ok", "messages_json": good},
            {"sample_id": "bad-json", "messages_json": "{not json"},
            {"sample_id": "bad-content", "messages_json": json.dumps(
                [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}])},
            {"sample_id": "bomb", "messages_json": json.dumps(
                [{"role": "user", "content": "BOMB"}, {"role": "assistant", "content": "x"}])}]
    skipped = collections.Counter()

    class Bomb:  # fails any batch holding the "BOMB" prompt, like a per-record error would
        def __init__(self, inner, bomb):
            self.inner, self.bomb = inner, bomb

        def generate(self, prompts, *args):
            if any(self.bomb in ex.tok.decode(p) for p in prompts):
                raise RuntimeError("boom")
            return self.inner.generate(prompts, *args)

    ex._generate([[1, 2]], [1], [0], ["warmup"], skipped)  # builds ex.generator
    ex.generator = Bomb(ex.generator, "BOMB")
    out = ex._regenerate(rows, skipped)
    assert [r["sample_id"] for r in out] == ["ok"]
    assert skipped == {"regen_failed": 3}
