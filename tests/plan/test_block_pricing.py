"""Block (DFlash) drafting in the planner: one forward of k+1 query tokens through n_layers
layers, its 2 + 2·n_layers collectives at TP, the profile fields that time it, the three-way
choice and what decided it, and `plan --block-acceptance`."""
import json

import pytest
import yaml

from eagle3_ray.plan import acceptance, cost, profiles
from eagle3_ray.train import ttt

PCIE = "pcie-8x-rtx-pro-6000-kimi-k2.5"


def tp8(**kw) -> profiles.NodeProfile:
    """8 GPUs, 6 all-reduces a verify at α = 20 µs, 35 GB/s, H = 700, B = 2: one all-reduce of
    t tokens = 20 µs + 2·7/8 · t·1400 B / 35 GB/s = (20 + 0.07 t) µs. Verify compute
    5 + 0.5 (t − 1) ms, chain step 0.5 ms, 4 collectives a one-layer forward, a k-token
    one-layer forward 0.5 + 0.05 (k − 1) ms."""
    return profiles.NodeProfile(**{
        "name": "tp8", "description": "hand-made", "sources": ["hand"], "gpus": 8,
        "interconnect": profiles.Interconnect(20.0, 35.0, 6, 700, 2),
        "verify_ms": {1: 5.0, 9: 9.0}, "draft_step_ms": 0.5, "draft_collectives": 4,
        "draft_parallel_ms": {1: 0.5, 9: 0.9}, **kw})


def ar_ms(t: int) -> float:
    return (20.0 + 0.07 * t) / 1e3


# --- the price of a block round ------------------------------------------------------------------

def test_block_collectives_are_two_plus_two_per_layer():
    assert profiles.draft_collectives_tp(1) == profiles.DRAFT_COLLECTIVES_TP == 4
    assert cost.block_collectives(tp8(), 1) == profiles.DRAFT_COLLECTIVES_TP
    for n in (1, 2, 3, 5):
        assert cost.block_collectives(tp8(), n) == profiles.draft_collectives_tp(n) == 2 + 2 * n
    assert cost.block_collectives(tp8(draft_collectives=0), 3) == 0     # a drafter on one GPU


def test_block_round_is_the_formula_on_a_hand_made_profile():
    """D_block(4) with 2 layers: t_block = 2 x t_par(5) = 2 x 0.7 = 1.4 ms, 6 collectives of
    5 tokens = 6 x 20.35 µs; T_round = D + compute(5) 7 ms + 6 verify all-reduces of 5 tokens."""
    p = tp8()
    d = 1.4 + 6 * ar_ms(5)                                                    # ms
    assert cost.draft_block_compute_s(p, 4, 2) * 1e3 == pytest.approx(1.4)
    assert cost.draft_round_s(p, 4, "block", 2) * 1e3 == pytest.approx(1.5221)
    assert cost.draft_round_s(p, 4, "block", 2) * 1e3 == pytest.approx(d)
    assert cost.draft_round_comm_s(p, 4, "block", 2) * 1e3 == pytest.approx(0.1221)
    assert cost.round_s(p, 4, "block", 2) * 1e3 == pytest.approx(d + 7.0 + 6 * ar_ms(5))
    assert cost.round_s(p, 4, "block", 2) * 1e3 == pytest.approx(8.6442)
    assert cost.draft_round_s(p, 4, "block", 3) * 1e3 == pytest.approx(2.1 + 8 * ar_ms(5))
    assert cost.draft_round_s(p, 0, "block") == cost.draft_round_comm_s(p, 0, "block") == 0.0
    # measured draft_block_ms (keyed by query tokens k+1), scaled by layers over its own count
    m = tp8(draft_block_ms={1: 0.8, 9: 1.6}, draft_block_layers=2)
    assert cost.draft_block_compute_s(m, 4, 2) * 1e3 == pytest.approx(1.2)
    assert cost.draft_round_s(m, 4, "block", 4) * 1e3 == pytest.approx(2.4 + 10 * ar_ms(5))
    flat = tp8(draft_parallel_ms=None)                   # no table at all: n x draft_step_ms
    assert cost.draft_round_s(flat, 7, "block", 2) * 1e3 == pytest.approx(1.0 + 6 * ar_ms(8))
    # the plan's rows and its notes on how the forward was priced
    r = cost.plan([0.8] * 8, p, 8, drafting="block", block_layers=2)
    row = r["depths"][4]
    assert row["draft_ms"] == pytest.approx(1.5221) and row["round_ms"] == pytest.approx(8.6442)
    assert row["draft_comm_ms"] == pytest.approx(0.1221) and row["draft_collectives"] == 6
    assert r["depths"][0]["draft_collectives"] == 0
    assert r["block"] == {"layers": 2, "collectives_per_forward": 6,
                          "query_tokens": "depth + 1 (the bonus token and depth mask slots)",
                          "forward_ms": "modelled: 2 layers x draft_parallel_ms at k+1 tokens"}
    assert any("no draft_block_ms" in w and "2 x draft_parallel_ms" in w for w in r["warnings"])
    assert "6 per forward" in r["why"] and "one forward of" in r["why"]
    assert any("draft_step_ms (0.5 ms), flat" in w for w in cost.plan(
        [0.8] * 4, flat, 4, drafting="block")["warnings"])
    measured = cost.plan([0.8] * 8, m, 12, drafting="block", block_layers=4)
    assert measured["block"]["forward_ms"].startswith("draft_block_ms (measured, 2 layers")
    assert any("scaled from it x4/2" in w for w in measured["warnings"])
    assert any("extrapolated linearly" in w for w in measured["warnings"])   # 9 < 12 + 1 tokens
    with pytest.raises(ValueError, match="block_layers"):
        cost.plan([0.8], p, 4, drafting="block", block_layers=0)


def test_block_profile_fields_round_trip_and_go_together(tmp_path):
    p = tp8(draft_block_ms={1: 0.8, 17: 1.6}, draft_block_layers=2,
            draft_layers={"mla": {"draft_step_ms": 0.6, "draft_collectives": 4,
                                  "draft_parallel_ms": None}})
    path = tmp_path / "p.yaml"
    profiles.save_profile(p, str(path))
    assert profiles.load_profile(str(path)) == p
    d = yaml.safe_load(open(path))
    assert d["draft_block_ms"] == {1: 0.8, 17: 1.6} and d["draft_block_layers"] == 2
    profiles.save_profile(tp8(), str(path))                   # modelled: no such keys written
    assert "draft_block_ms" not in yaml.safe_load(open(path))
    del d["draft_block_layers"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match="bad.yaml: draft_block_ms and draft_block_layers"):
        profiles.load_profile(str(tmp_path / "bad.yaml"))
    # another layer shape has no block table of its own: modelled from its forward, and back
    mla = profiles.with_draft_layer(p, "mla")
    assert mla.draft_block_ms is None and mla.draft_block_layers is None
    assert profiles.with_draft_layer(mla, "llama") == p


# --- choosing among three kinds ------------------------------------------------------------------

def test_three_kinds_acceptance_decides():
    """A block drafter far ahead in acceptance wins all three and says acceptance decided: at
    its best depth it yields more tokens a round than the runner-up."""
    c = cost.choose_drafting(tp8(), {"chain": ([0.6] * 8, 8, "c"), "parallel": ([0.5] * 8, 8, "p"),
                                     "block": ([0.9] * 8, 8, "b")}, 8)
    assert c["choice"] == "block" and c["ranking"][0] == "block" and len(c["ranking"]) == 3
    assert c["decided_by"] == "acceptance" and "ACCEPTANCE decided" in c["why"]
    win, run = c["kinds"]["block"], c["kinds"][c["runner_up"]]
    assert win["accept_len"] > run["accept_len"]
    for k in cost.DRAFTING:                        # each kind: best depth, speedup, tokens/round
        s = c["kinds"][k]
        assert s["best_depth"] == c["plans"][k]["best_depth"] and s["speedup"] >= 1
        assert s["accept_len"] == c["plans"][k]["best"]["accept_len"]
        assert f"{k} at depth {s['best_depth']}" in c["why"]
    assert not c["what_if"]


def test_three_kinds_cost_decides_and_a_tie_goes_to_the_chain():
    """One draft position: a chain step of 2 ms against a block forward of 0.21 ms. The block
    drafter accepts less (0.85 against 0.9) yet wins on its cheaper round: cost decided."""
    p = tp8(draft_step_ms=2.0, draft_block_ms={1: 0.2, 9: 0.3}, draft_block_layers=2)
    c = cost.choose_drafting(p, {"chain": ([0.9], 1, "c"), "block": ([0.85], 1, "b")}, 1)
    assert c["choice"] == "block" and c["runner_up"] == "chain"
    assert c["kinds"]["block"]["best_depth"] == c["kinds"]["chain"]["best_depth"] == 1
    assert c["kinds"]["block"]["accept_len"] < c["kinds"]["chain"]["accept_len"]
    assert c["kinds"]["block"]["round_ms"] < c["kinds"]["chain"]["round_ms"]
    assert c["decided_by"] == "cost" and "COST decided" in c["why"]
    assert c["attribution"]["dominated"] == "cost"
    tie = cost.choose_drafting(p, {"block": ([0.01], 1, "b"), "chain": ([0.01], 1, "c")}, 1)
    assert tie["choice"] == "chain" and tie["decided_by"] == "tie" and "a tie" in tie["why"]
    # one kind: priced alone, the chain as a labelled what-if
    alone = cost.choose_drafting(p, {"block": ([0.85], 1, "b")}, 1)
    assert set(alone["what_if"]) == {"chain"} and alone["decided_by"] is None
    assert "WHAT-IF, not a choice" in alone["why"]


def test_block_depth_is_bounded_by_its_block_and_dynamic_depth_prices_it():
    c = cost.choose_drafting(tp8(), {"block": ([0.95] * 32, 32, "b")}, 32, block_size=4)
    assert c["plans"]["block"]["max_depth"] == 4 and c["kinds"]["block"]["best_depth"] <= 4
    assert c["what_if"]["chain"]["max_depth"] == 32
    dear = tp8(draft_step_ms=3.0)                    # a chain step dear, a block forward not
    chain = cost.DynamicDepth(dear, [0.7], max_depth=16)([])
    block = cost.DynamicDepth(dear, [0.7], max_depth=16, drafting="block", block_layers=2)([])
    assert block > chain >= 0
    with pytest.raises(ValueError, match="block_layers"):
        cost.DynamicDepth(dear, [0.7], 8, drafting="block", block_layers=0)


def test_block_curve_derived_from_a_chain_matches_the_stated_anchor():
    """The ASSUMED ratios: a chain at a = 0.8 everywhere (E[τ](16) = 4.89) becomes a block
    drafter with E[τ](16) = 6.4, DFlash's reported acceptance length at block 16."""
    assert ttt.accept_lengths([0.8] * 16)[16] == pytest.approx(4.89, abs=0.01)
    assert ttt.accept_lengths(acceptance.block_from_chain([0.8] * 16))[16] == pytest.approx(
        6.4, abs=0.02)
    assert acceptance.block_from_chain([0.95, 0.95]) == [0.95, 1.0]         # capped at 1


# --- acceptance sources and the command -----------------------------------------------------------

def test_a_bench_serve_json_gives_the_block_kind_its_own_arms(tmp_path):
    path = tmp_path / "serve.json"
    for where in ("planner", "acceptance"):        # bench serve's section, either place
        path.write_text(json.dumps({"bench": "serve", "runs": {}, "planner": {
            "cond_acc": [0.4, 0.3]}} | {where: {"cond_acc": [0.4, 0.3],
                                                "block": {"cond_acc": [0.7, 0.6, 0.5]}}}))
        cond, known, desc = acceptance.acceptance_from(str(path), drafting="block")
        assert cond == [0.7, 0.6, 0.5] and known == 3 and "block{d} arms" in desc
        assert acceptance.acceptance_from(str(path))[0] == [0.4, 0.3]
    path.write_text(json.dumps({"bench": "serve", "runs": {}, "planner": {"cond_acc": [0.4]}}))
    with pytest.raises(ValueError, match="without block arms"):
        acceptance.acceptance_from(str(path), drafting="block")


def block_drafter(path, cond: list[float], layers: int = 3, size: int = 4) -> str:
    """A block drafter dir as the planner reads it: its draft_config and held-out acceptance."""
    path.mkdir(parents=True)
    dc = {"drafting": "block", "block_layers": layers, "block_size": size}
    (path / "config.json").write_text(json.dumps({"eagle3_ray": {"draft_config": dc}}))
    (path / "meta.json").write_text(json.dumps({"final_metrics": {
        f"eval/cond_acc_{i}": a for i, a in enumerate(cond)}}))
    return str(path)


def test_plan_cli_block_acceptance(tmp_path, capsys):
    from eagle3_ray import cli
    out = tmp_path / "plan"
    rc = cli.main(["plan", "--block-acceptance", "0.8,0.7,0.6,0.5", "--profile", PCIE,
                   "--max-depth", "8", "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "plan.json"))
    assert (out / "plan.png").stat().st_size > 10_000
    assert r["drafting"] == "block" and r["drafting_choice"]["choice"] == "block"
    assert r["block"]["layers"] == 2 and r["block"]["collectives_per_forward"] == 6
    assert r["block"]["forward_ms"].startswith("modelled")
    assert r["best_depth"] == cost.best_depth([0.8, 0.7, 0.6, 0.5], profiles.load_profile(PCIE),
                                              8, "block", 2)
    assert set(r["drafting_choice"]["what_if"]) == {"chain"}
    assert r["other_kind"]["drafting"] == "chain" and "WHAT-IF" in r["other_kind"][
        "acceptance"]["source"]
    assert "block drafter: 2 layers, 6 collectives" in capsys.readouterr().out
    # three kinds, the block drafter's dir saying its layers (3) and block size (4)
    blk = block_drafter(tmp_path / "blk", [0.9, 0.85, 0.8, 0.8])
    rc = cli.main(["plan", "--acceptance", "0.7,0.6,0.5", "--parallel-acceptance", "0.6,0.5",
                   "--block-acceptance", blk, "--profile", PCIE, "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "plan.json"))
    dc = r["drafting_choice"]
    assert r["drafting"] == dc["choice"] == "block" and dc["decided_by"] == "acceptance"
    assert sorted(dc["ranking"]) == sorted(cost.DRAFTING) and dc["runner_up"] == dc["ranking"][1]
    assert r["block"]["layers"] == 3 and r["block"]["collectives_per_forward"] == 8
    assert r["max_depth"] == 4 and len(r["depths"]) == 5              # at most its block size
    assert r["other_kind"]["drafting"] == dc["ranking"][1]
    assert list(r["further_kinds"]) == [dc["ranking"][2]]
    assert "ACCEPTANCE decided" in capsys.readouterr().out
    # a block drafter passed as the parallel one, or with other layers than it has: refused
    rc = cli.main(["plan", "--parallel-acceptance", blk, "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "pass it as --block-acceptance" in capsys.readouterr().err
    rc = cli.main(["plan", "--block-acceptance", blk, "--block-layers", "2", "--profile", PCIE,
                   "--out", str(out)])
    assert rc == 2 and "has 3 layers" in capsys.readouterr().err


def test_sweep_kinds_block_layers_and_ratios(tmp_path):
    """--block-layers and --block-ratios reach the sweep: more layers, dearer block rounds."""
    pcie = profiles.load_profile(PCIE)
    two = cost.sweep_drafting([0.8], [pcie], 16)
    four = cost.sweep_drafting([0.8], [pcie], 16, block_layers=4)
    assert four["rows"][0]["block_collectives"] == 10 and two["rows"][0]["block_collectives"] == 6
    assert four["rows"][0]["block"]["round_ms"] > two["rows"][0]["block"]["round_ms"] or \
        four["rows"][0]["block"]["best_depth"] < two["rows"][0]["block"]["best_depth"]
    assert two["block_acceptance"]["rest_ratio"] == acceptance.BLOCK_REST_RATIO
    low = cost.sweep_drafting([0.8], [pcie], 16, block_first=0.5,
                              block_rest=0.5)
    assert low["rows"][0]["pick"] != "block"
    with pytest.raises(ValueError, match="block acceptance ratios"):
        cost.sweep_drafting([0.8], [pcie], 16, block_rest=2.0)
