"""bench serve's peer arms (transformers' plain greedy generate and its prompt-lookup speculation)
on the tiny random verifier in fp32, with an untrained drafter saved as a real checkpoint."""
import json
import os

import pytest

from eagle3_ray.bench import serving as bench_serve
from eagle3_ray.data import conversations as data
from eagle3_ray.engine import hf as verifier
from eagle3_ray.serve import kernels, speculate
from eagle3_ray.train import checkpoint, kinds


@pytest.fixture
def fp32(monkeypatch):
    """load_verifier's default dtype: fp32 (no batch-invariance patch, exact greedy equality)."""
    monkeypatch.setenv("EAGLE3_RAY_NATIVE_BF16", "0")


def save_untrained(spec: str, out: str, drafting: str = "chain", cond: float = 0.5,
                   **config) -> str:
    drafter, _ = kinds.untrained_drafter(spec, draft_vocab_size=2000, drafting=drafting,
                                         **config)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    final = {f"eval/cond_acc_{k}": cond for k in range(4)}   # the dynamic-depth prior
    checkpoint.save_drafter(out, state, drafter.config,
                            {"ttt_steps": 2, "verifier": spec, "final_metrics": final})
    return out


@pytest.fixture
def drafter_dir(tiny_verifier, tmp_path):
    return save_untrained(tiny_verifier, str(tmp_path / "drafter"))


def test_hf_generate_matches_speculator_depth0(fp32, tiny_verifier, tiny_tokenizer, one_thread):
    model = verifier.load_verifier(tiny_verifier)
    # transformers' default swaps in hub kernels (a network fetch on CUDA; it failed the first
    # GPU check offline): the verifier must load without them.
    assert model.use_kernels is False
    eos = verifier.eos_ids(model, tiny_tokenizer)
    prompt = data.prompt_ids(tiny_tokenizer, [{"role": "user", "content": "Tell me about rivers"}])
    sp = speculate.SamplingParams(max_tokens=12, eos_ids=eos)
    ours = [t for r in speculate.Speculator(model).generate(prompt, sp) for t in r.tokens]
    plain = bench_serve.hf_generate(model, prompt, 12, eos)
    assert plain["tokens"] == ours and len(ours) > 0
    assert plain["rounds"] == len(ours) - 1 and plain["drafted"] == plain["accepted"] == 0
    assert 0 < plain["prefill_s"] < plain["wall_s"]
    # prompt lookup: same greedy output; the tiny random model repeats itself (and the prompt
    # holds an earlier output), so lookup proposes n-grams, gets some accepted, saves forwards
    echo = prompt + ours + prompt
    ref = bench_serve.hf_generate(model, echo, 12, eos)
    got = bench_serve.hf_generate(model, echo, 12, eos, prompt_lookup=5)
    assert got["tokens"] == ref["tokens"]
    assert got["drafted"] >= got["accepted"] > 0 and got["rounds"] < ref["rounds"]


def test_bench_serve_peer_arms(fp32, tiny_verifier, drafter_dir, tmp_path, capsys, one_thread):
    out = str(tmp_path / "bench")
    r = bench_serve.bench_serve(drafter_dir, depths=(0, 2), prompts=2, max_tokens=8, out_dir=out,
                                spec=tiny_verifier, dynamic=False, prompt_lookup=(4,))
    assert r["dtype"] == "float32" and r["all_identical"]
    assert set(r["few_row_kernels"]) == {str(n) for n in kernels.TUNED_ROWS}      # what depth 0 ran on
    peers = r["peers"]
    assert set(peers) == {"generate", "prompt_lookup_4"}
    for p in peers.values():
        assert p["tokens"] > 0 and p["tokens_per_s"] > 0 and p["decode_tokens_per_s"] > 0
        assert p["speedup"] > 0 and p["prompts"] == 2
    g = peers["generate"]
    assert g["identical_prompts"] == 2 and g["identical_to_depth0"]
    assert g["tokens"] == r["runs"]["0"]["tokens"] and g["acceptance_length"] == 1.0
    pl = peers["prompt_lookup_4"]
    assert pl["prompt_lookup_num_tokens"] == 4 and 0 <= pl["acceptance_rate"] <= 1
    saved = json.load(open(os.path.join(out, "serve.json")))
    assert set(saved["peers"]) == set(peers) and "peers_note" in saved
    assert os.path.getsize(os.path.join(out, "serve.png")) > 0
    printed = capsys.readouterr().out
    assert "[bench] serve peer generate:" in printed and "identical 2/2" in printed
    r = bench_serve.bench_serve(drafter_dir, depths=(0, 1, 3), prompts=1, max_tokens=6, out_dir=out,
                                spec=tiny_verifier, dynamic=True, peers=False, branches=(2,),
                                lookup_depths=(4,), lookup_branches=(3,))
    assert "peers" not in r and r["all_identical"]      # the dynamic, tree and lookup arms
    for name in ("lookup4", "dynamic-lookup"):          # lookup arms past the deepest fixed one
        row = r["runs"][name]
        assert row["identical_to_depth0"] and "predicted_tokens_per_s" not in row
        assert 0 <= row["lookup_rounds"] <= row["rounds"]
    assert r["runs"]["lookup4"]["lookup_depth"] == 4 and r["best_lookup"] in r["runs"]
    tree = r["runs"]["tree2x3"]                         # depth 3 only: 1 is no tree depth
    assert set(k for k in r["runs"] if k.startswith("tree")) == {"tree2x3", "tree2x3+lookup"}
    assert tree["branches"] == 2 and tree["tree_depth"] == 3 and tree["mean_depth"] == 3
    assert "predicted_tokens_per_s" not in tree and "lookup_branch" not in tree
    for name, k in (("branch-lookup3", 1), ("tree2x3+lookup", 2)):   # the lookup's match beside
        row = r["runs"][name]
        assert row["branches"] == k and row["tree_depth"] == 3 and row["lookup_branch"]
        assert row["identical_to_depth0"] and 0 <= row["lookup_rounds"] <= row["rounds"]
    dyn = r["runs"]["dynamic-branch-lookup"]
    assert dyn["lookup_branch"] and dyn["identical_to_depth0"] and 0 <= dyn["mean_depth"] <= 3
    assert r["best_tree"] in ("tree2x3", "tree2x3+lookup", "branch-lookup3", "dynamic-branch-lookup")
    assert os.path.getsize(os.path.join(out, "serve.png")) > 0


def test_bench_serve_flags():
    import argparse
    from eagle3_ray.cli import add_bench_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    a = p.parse_args(["serve", "--depths", "0", "2", "--no-peers", "--prompt-lookup-tokens", "5"])
    assert a.depths == [0, 2] and a.no_peers and a.prompt_lookup_tokens == [5]
    a = p.parse_args(["serve"])
    assert a.depths is None and not a.no_peers and a.prompt_lookup_tokens == [10, 3]
    assert a.branches == [] and p.parse_args(["serve", "--branches", "2", "3"]).branches == [2, 3]
    assert a.lookup_branches == [] and p.parse_args(
        ["serve", "--lookup-branches", "4"]).lookup_branches == [4]
    with pytest.raises(ValueError, match="need 0"):
        bench_serve.bench_serve("unused", depths=(1, 2))


def test_bench_serve_leaves_out_tree_arms_its_host_cannot_run_exactly(
        fp32, tiny_verifier, drafter_dir, tmp_path, capsys, one_thread, make_inexact):
    """Where the start-up check finds a tree verify inexact (a MOCK of such kernels: none here),
    bench serve runs the chain arms (dynamic ones included) and records the tree arms it left
    out and why."""
    make_inexact("tree")
    r = bench_serve.bench_serve(drafter_dir, depths=(0, 3), prompts=1, max_tokens=6,
                                out_dir=str(tmp_path / "bench"), spec=tiny_verifier, dynamic=True,
                                peers=False, branches=(2,), lookup_depths=(), lookup_branches=(3,))
    assert r["exact"] == {"chain": True, "tree": False} and r["all_identical"]
    assert set(r["runs"]) == {"0", "3", "dynamic"}
    assert "vs_best_fixed" in r["runs"]["dynamic"]
    left_out = ["branch-lookup3", "dynamic-branch-lookup", "tree2x3", "tree2x3+lookup"]
    assert r["refused_arms"]["arms"] == left_out
    assert "use chains" in r["refused_arms"]["why"]
    assert f"tree arms {left_out} left out" in capsys.readouterr().out


def test_bench_serve_parallel_and_block_drafter_arms(fp32, tiny_verifier, drafter_dir, tmp_path,
                                                     one_thread):
    """--parallel-drafter / --block-drafter: arms parallel{d} / block{d} decode with those
    drafters on the same verifier in the same interleaved run, exactly (output = depth 0's), one
    drafter forward a round (a block drafter up to its block size: no block4 for a block of 2);
    each kind gets its own served acceptance and planner prediction (the block's priced with
    its measured forward, draft_block_ms by query slots), the teacher-forced acceptance of all
    three beside; a chain drafter is refused."""
    par = save_untrained(tiny_verifier, str(tmp_path / "parallel"), "parallel", cond=0.3)
    blk = save_untrained(tiny_verifier, str(tmp_path / "block"), "block", cond=0.4,
                         block_size=2, block_layers=2)
    out = str(tmp_path / "bench")
    r = bench_serve.bench_serve(drafter_dir, depths=(0, 2, 4), prompts=1, max_tokens=8,
                                out_dir=out, spec=tiny_verifier, dynamic=False, peers=False,
                                lookup_depths=(), parallel_drafter=par, block_drafter=blk)
    assert r["all_identical"] and r["parallel_drafter"] == par and r["block_drafter"] == blk
    assert "block4" not in r["runs"]
    for kind, d in (("parallel", 2), ("parallel", 4), ("block", 2)):
        row = r["runs"][f"{kind}{d}"]
        assert row[f"{kind}_depth"] == d and row["mean_depth"] == d and row["rounds"] > 0
        assert row["drafting"] == kind
        assert row["drafted_per_position"][:d] == [row["rounds"]] * d
        assert row["predicted_tokens_per_s"] > 0 and "predicted_error" in row
    plan = r["planner"]["parallel"]
    assert len(plan["cond_acc"]) == 4 and plan["why"] and plan["max_abs_error"] >= 0
    assert len(r["planner"]["block"]["cond_acc"]) == 2
    assert sorted(r["planner"]["profile"]["draft_block_ms"]) == [3]       # 2 drafts: 3 slots
    assert r["best_parallel"] in ("parallel2", "parallel4") and "parallel_note" in r
    assert r["best_block"] == "block2" and "block_note" in r
    assert r["teacher_forced"] == {"chain": [0.5] * 4, "parallel": [0.3] * 4,
                                   "block": [0.4] * 4}
    assert os.path.getsize(os.path.join(out, "serve.png")) > 0
    with pytest.raises(ValueError, match="not a parallel drafter"):
        bench_serve.bench_serve(drafter_dir, depths=(0, 2), prompts=1, max_tokens=4, out_dir=out,
                                spec=tiny_verifier, dynamic=False, peers=False,
                                parallel_drafter=drafter_dir)
