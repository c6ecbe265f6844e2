"""The lookup fallback of the speculative decoder (speculate.NgramLookup, LookupParams): what it
proposes, that greedy output stays the verifier's, and that it takes over the rounds the drafter
doubts where the request repeats itself. Tiny random Llamas, no Ray (sampling exactness with
the fallback: tests/serve/test_speculate.py)."""
import pytest
import torch

from eagle3_ray.serve.speculate import LookupParams, NgramLookup, SamplingParams, Speculator
from tests.serve.test_speculate import run, tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ngram_lookup_proposes_what_followed_the_latest_longest_match():
    ids = [5, 6, 7, 8, 1, 6, 7, 9, 2, 5, 6, 7]
    lk = NgramLookup(ids, min_n=2, max_n=4)
    # the suffix 3-gram (5, 6, 7) occurred once before, followed by 8 1 6 ...; the 2-gram
    # (6, 7) more recently (followed by 9), but the longest match wins
    assert lk.propose(3) == [8, 1, 6]
    lk.extend([3])                                   # suffix (.., 7, 3): never seen
    assert lk.propose(4) == []
    lk2 = NgramLookup([1, 2, 3, 9, 2, 3], min_n=2, max_n=4)
    assert lk2.propose(2) == [9, 2]                   # (2, 3) -> followed by 9 the first time
    assert NgramLookup([4, 1, 4], min_n=2).propose(3) == []       # a 1-gram match is not enough
    assert NgramLookup([4, 1, 4], min_n=1).propose(3) == [1, 4]   # ... unless min_n = 1
    built = NgramLookup([], min_n=1, max_n=3)
    for t in ids:                                     # extending token by token = all at once
        built.extend([t])
    assert built.after == NgramLookup(ids, min_n=1, max_n=3).after
    with pytest.raises(ValueError, match="min_n"):
        LookupParams(min_n=3, max_n=2)


def test_lookup_fallback_keeps_greedy_output_and_takes_over_repeated_text():
    """A tiny random Llama's greedy output falls into a loop (period 4 on this prompt): once the
    loop repeats, the lookup proposes exactly what the verifier says next, and an untrained
    drafter (never that sure) gives way to it. Output = plain decoding throughout."""
    model, drafter = tiny_pair(vocab=500, draft_vocab=300)
    spec = Speculator(model, drafter)
    prompt = list(range(40, 52))
    sp = SamplingParams(max_tokens=24)
    base, _ = run(spec, prompt, sp, 0)
    tail = base[-12:]                                  # the loop the lookup should catch
    assert any(tail[p:] == tail[:-p] for p in range(1, 7)), base
    for depth in (2, 6):
        off, rounds_off = run(spec, prompt, sp, depth)
        on, rounds_on = run(spec, prompt, sp, depth, lookup=LookupParams())
        assert off == base and on == base, depth
        assert not any(r.lookup for r in rounds_off)
        looked = [r for r in rounds_on if r.lookup]
        assert looked and all(r.draft_probs == () and 0 < r.drafted <= depth for r in looked)
        assert all(r.draft_probs for r in rounds_on[1:] if not r.lookup and r.drafted)
        # inside the loop every lookup draft is the verifier's own next token
        assert sum(r.accepted == r.drafted for r in looked) >= 2
        assert sum(r.accepted for r in rounds_on) > 2 * sum(r.accepted for r in rounds_off)
        assert len(rounds_on) < len(rounds_off)           # fewer verifier forwards
    # below = 0: the drafter is never doubted, the rounds are exactly the drafter's
    never, rounds = run(spec, prompt, sp, 4, lookup=LookupParams(below=0.0))
    assert never == base and not any(r.lookup for r in rounds)
    assert [r.tokens for r in rounds] == [r.tokens for r in run(spec, prompt, sp, 4)[1]]


def test_lookup_branch_is_verified_beside_the_drafters_chains():
    """LookupParams(branch=True), and any tree: the lookup's match is one more chain of the tree
    verify, not a replacement. Greedy output stays plain decoding's; in the loop the lookup's
    chain wins its rounds (Round.lookup) while the drafter still drafts every round; sampling
    refuses a tree."""
    model, drafter = tiny_pair(vocab=500, draft_vocab=300)
    spec = Speculator(model, drafter)
    prompt = list(range(40, 52))
    sp = SamplingParams(max_tokens=24)
    base, _ = run(spec, prompt, sp, 0)
    _, rounds_off = run(spec, prompt, sp, 4)
    for branches in (1, 2):
        out, rounds = run(spec, prompt, sp, 4, branches=branches,
                          lookup=LookupParams(branch=True))
        assert out == base, branches
        won = [r for r in rounds if r.lookup]
        assert len(won) >= 2 and all(r.branches == branches + 1 for r in won)
        assert sum(r.accepted for r in won) >= 2 * len(won)   # copied spans, not single hits
        assert len(rounds) < len(rounds_off)
    # a tree with the plain fallback parameters takes the lookup as a branch too
    out, rounds = run(spec, prompt, sp, 4, branches=2, lookup=LookupParams())
    assert out == base and any(r.lookup and r.branches == 3 for r in rounds)
    with pytest.raises(ValueError, match="greedy"):
        run(spec, prompt, SamplingParams(max_tokens=4, temperature=0.7), 4,
            lookup=LookupParams(branch=True))
