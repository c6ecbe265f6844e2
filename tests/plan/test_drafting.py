"""Chain against parallel drafting in the planner: the drafter's collectives and its k-token
forward in the cost model, profiles old and new, choose_drafting, the `plan` flags, measuring a
k-token drafter forward, and the --sweep-kinds sweep."""
import dataclasses
import json

import pytest
import torch
import yaml

from eagle3_ray.plan import acceptance, cost, profiles

PCIE = "pcie-8x-rtx-pro-6000-kimi-k2.5"
PCIE_CURVE = PCIE + "-allreduce-curve"


def node(**kw) -> profiles.NodeProfile:
    """4 GPUs, 10 all-reduces a verify at α = 50 µs, 10 GB/s, H = 1000, B = 2: one all-reduce
    of t tokens = 50 µs + 2·3/4 · t·2000 B / 10 GB/s = (50 + 0.3 t) µs. Verify 9 + t ms, draft
    step 1 ms, 4 collectives a drafter forward, a k-token forward 1.0 ms at 1, 1.8 ms at 17."""
    d = dict(name="tp4", description="test", sources=["hand"], gpus=4,
             interconnect=profiles.Interconnect(50.0, 10.0, 10, 1000, 2),
             verify_ms={1: 10.0, 33: 42.0}, draft_step_ms=1.0, draft_collectives=4,
             draft_parallel_ms={1: 1.0, 17: 1.8})
    d.update(kw)
    return profiles.NodeProfile(**d)


def ar_us(t: int) -> float:
    return 50.0 + 0.3 * t


# --- the cost terms ---------------------------------------------------------------------------

def test_chain_pays_collectives_per_forward_parallel_once():
    p = node()
    for k in (1, 4, 16):
        # chain: k forwards, each 4 collectives of one token
        assert cost.draft_round_comm_s(p, k, "chain") == pytest.approx(k * 4 * ar_us(1) * 1e-6)
        assert cost.draft_round_s(p, k, "chain") == pytest.approx(k * (1e-3 + 4 * ar_us(1) * 1e-6))
        # parallel: one forward of k tokens, its 4 collectives once (messages of k tokens)
        assert cost.draft_round_comm_s(p, k, "parallel") == pytest.approx(4 * ar_us(k) * 1e-6)
        t_par = 1.0 + 0.8 * (k - 1) / 16                                  # ms, interpolated
        assert cost.draft_round_s(p, k, "parallel") == pytest.approx(
            t_par * 1e-3 + 4 * ar_us(k) * 1e-6)
    chain = [cost.draft_round_comm_s(p, k, "chain") for k in range(1, 17)]
    par = [cost.draft_round_comm_s(p, k, "parallel") for k in range(1, 17)]
    assert chain[15] == pytest.approx(16 * chain[0])                    # grows with k
    assert par[15] < 1.1 * par[0]                                       # only the message grows
    assert cost.draft_round_s(p, 0, "chain") == cost.draft_round_s(p, 0, "parallel") == 0.0
    assert cost.round_s(p, 3, "parallel") == pytest.approx(
        cost.draft_round_s(p, 3, "parallel") + cost.verify_s(p, 4))
    # a round's row in plan(): the drafter's collectives counted and split out
    r = cost.plan([0.8] * 8, p, 8, drafting="chain")["depths"][4]
    assert r["draft_collectives"] == 16 and r["draft_comm_ms"] == pytest.approx(16 * ar_us(1) / 1e3)
    r = cost.plan([0.8] * 8, p, 8, drafting="parallel")["depths"][4]
    assert r["draft_collectives"] == 4 and r["draft_comm_ms"] == pytest.approx(4 * ar_us(4) / 1e3)
    one_gpu = node(gpus=1)                                   # no interconnect: no collectives
    assert cost.draft_round_comm_s(one_gpu, 8, "chain") == cost.draft_round_comm_s(one_gpu, 8,
                                                                              "parallel") == 0
    with pytest.raises(ValueError, match="drafting must be one of"):
        cost.draft_round_s(p, 2, "tree")


def test_without_collectives_and_equal_draft_time_the_kinds_differ_only_by_acceptance():
    """Collectives off and a k-token forward costing what k chain steps cost: the same round at
    every depth, so one acceptance gives one plan, and two give plans apart only in E[τ]."""
    p = node(draft_collectives=0, draft_parallel_ms={k: 1.0 * k for k in range(1, 33)})
    for k in range(0, 17):
        assert cost.round_s(p, k, "parallel") == pytest.approx(cost.round_s(p, k, "chain"))
    acc = [0.9, 0.8, 0.7, 0.6]
    ch = cost.plan(acc, p, 8, drafting="chain")
    pa = cost.plan(acc, p, 8, drafting="parallel")
    for a, b in zip(ch["depths"], pa["depths"]):
        assert a["round_ms"] == pytest.approx(b["round_ms"])
        assert a["speedup"] == pytest.approx(b["speedup"])
    assert ch["best_depth"] == pa["best_depth"]
    lower = cost.plan([0.7, 0.6, 0.5, 0.4], p, 8, drafting="parallel")
    assert [r["round_ms"] for r in lower["depths"]] == pytest.approx(
        [r["round_ms"] for r in ch["depths"]])
    assert all(x["accept_len"] < y["accept_len"] for x, y in zip(lower["depths"][1:],
                                                                 ch["depths"][1:]))
    # with the collectives back on, the same acceptance is cheaper drafted in parallel
    q = dataclasses.replace(p, draft_collectives=4)
    assert all(cost.round_s(q, k, "parallel") < cost.round_s(q, k, "chain") for k in range(2, 17))


def test_parallel_forward_without_a_measured_table_is_modelled_flat_and_warned():
    p = node(draft_parallel_ms=None)
    assert cost.draft_parallel_compute_s(p, 1) == cost.draft_parallel_compute_s(p, 16) == 1e-3
    r = cost.plan([0.8] * 4, p, 8, drafting="parallel")
    assert any("modelled flat" in w for w in r["warnings"])
    assert not any("modelled flat" in w for w in cost.plan([0.8] * 4, node(), 8,
                                                        drafting="parallel")["warnings"])
    assert any("extrapolated linearly" in w for w in cost.plan([0.8] * 4, node(), 32,
                                                            drafting="parallel")["warnings"])


# --- profiles ---------------------------------------------------------------------------------

def test_old_profiles_with_draft_allreduces_still_load(tmp_path):
    p = node()
    path = tmp_path / "new.yaml"
    profiles.save_profile(p, str(path))
    d = yaml.safe_load(open(path))
    assert d["draft_collectives"] == 4 and "draft_allreduces" not in d
    assert d["draft_parallel_ms"] == {1: 1.0, 17: 1.8}
    assert profiles.load_profile(str(path)) == p
    # a file from before: draft_allreduces, no draft_collectives, no draft_parallel_ms
    old = dict(d)
    del old["draft_collectives"], old["draft_parallel_ms"]
    old["draft_allreduces"] = 3
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    q = profiles.load_profile(str(tmp_path / "old.yaml"))
    assert q.draft_collectives == 3 and q.draft_parallel_ms is None
    assert cost.draft_s(q) == pytest.approx(1e-3 + 3 * ar_us(1) * 1e-6)
    del old["draft_allreduces"]                                   # older still: neither
    (tmp_path / "older.yaml").write_text(yaml.safe_dump(old))
    assert profiles.load_profile(str(tmp_path / "older.yaml")).draft_collectives == 0
    # a packaged profile as it was written before this change loads and plans
    pk = yaml.safe_load(open(profiles.profile_path(PCIE)))
    del pk["draft_collectives"], pk["draft_parallel_ms"]
    pk["draft_allreduces"] = 0
    (tmp_path / "pk.yaml").write_text(yaml.safe_dump(pk))
    pk = profiles.load_profile(str(tmp_path / "pk.yaml"))
    assert cost.plan([0.8] * 4, pk, 8)["best_depth"] >= 1
    for bad, why in (({"draft_allreduces": 3, "draft_collectives": 4}, "disagree"),
                     ({"draft_parallel_ms": {"4": 1.0}}, "draft_parallel_ms: tokens must be"),
                     ({"draft_parallel_ms": {4: -1.0}}, "must be a number"),
                     ({"draft_parallel_ms": {}}, "non-empty mapping")):
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(d, **bad)))
        with pytest.raises(ValueError, match=why):
            profiles.load_profile(str(tmp_path / "bad.yaml"))


def test_packaged_pcie_profile_draft_terms():
    """The packaged PCIe profile: a TP-8 drafter (0.22 ms) with 4 collectives of 41.6 µs a
    forward (α/β at one token of H = 7168): a 16-deep chain pays 64 of them, a parallel
    round 4."""
    p = profiles.load_profile(PCIE)
    one = 40.0 + 1.75 * 14336 / 16e9 * 1e6                              # µs
    assert cost.draft_s(p) == pytest.approx(0.22e-3 + 4 * one * 1e-6)
    row = cost.plan([0.8] * 16, p, 16)["depths"][16]
    assert row["draft_collectives"] == 64
    assert row["draft_comm_ms"] == pytest.approx(64 * one / 1e3)
    prow = cost.plan([0.8] * 16, p, 16, drafting="parallel")["depths"][16]
    assert prow["draft_collectives"] == 4 and prow["draft_ms"] < 0.5 * row["draft_ms"]


# --- choosing the kind --------------------------------------------------------------------------

def test_choose_parallel_when_acceptance_equal_and_collectives_costly():
    """Same compute per draft (a k-token forward = k steps), 4 collectives of 500 µs a drafter
    forward: at equal acceptance only the collectives differ, and the parallel round pays them
    once; without collectives it is a tie, which the chain keeps."""
    slow = profiles.Interconnect(500.0, 10.0, 10, 1000, 2)
    p = node(interconnect=slow, draft_parallel_ms={k: 1.0 * k for k in range(1, 33)})
    acc = [0.8] * 16
    both = {"chain": (acc, 16, "chain list"), "parallel": (acc, 16, "parallel list")}
    c = cost.choose_drafting(p, both, 16)
    assert c["choice"] == "parallel"
    assert c["kinds"]["parallel"]["tokens_per_s"] > c["kinds"]["chain"]["tokens_per_s"]
    assert "cost dominated" in c["why"]
    assert c["attribution"]["acceptance_gain"] == pytest.approx(1.0)   # the same curve
    assert c["attribution"]["cost_gain"] > 1
    assert c["plans"]["parallel"]["acceptance"]["source"] == "parallel list"
    free = cost.choose_drafting(dataclasses.replace(p, draft_collectives=0), both, 16)
    assert free["choice"] == "chain" and "tie" in free["why"]


def test_choose_chain_when_its_acceptance_is_much_higher_and_collectives_free():
    p = node(draft_collectives=0)                            # parallel forward still cheaper
    c = cost.choose_drafting(p, {"chain": ([0.9] * 16, 16, "c"), "parallel": ([0.5] * 16, 16, "p")},
                          16)
    assert c["choice"] == "chain" and "acceptance dominated" in c["why"]
    ch, pa = c["kinds"]["chain"], c["kinds"]["parallel"]
    assert ch["accept_len"] > pa["accept_len"] and ch["round_ms"] > pa["round_ms"]
    # the same curves with costly collectives and a near-chain parallel acceptance flip it
    q = node(interconnect=profiles.Interconnect(500.0, 10.0, 10, 1000, 2))
    c = cost.choose_drafting(q, {"chain": ([0.9] * 16, 16, "c"),
                                 "parallel": ([0.88] * 16, 16, "p")},
                          16)
    assert c["choice"] == "parallel"


def test_one_kind_given_is_priced_alone_with_a_labelled_what_if():
    c = cost.choose_drafting(node(), {"parallel": ([0.7] * 8, 8, "p")}, 8)
    assert c["choice"] == "parallel" and set(c["plans"]) == {"parallel"}
    assert set(c["what_if"]) == {"chain"} and "WHAT-IF" in c["what_if"]["chain"]["acceptance"][
        "source"]
    assert "WHAT-IF, not a choice" in c["why"] and "Only parallel" in c["why"]
    with pytest.raises(ValueError, match="acceptance must be given"):
        cost.choose_drafting(node(), {"tree": ([0.7], 1, "x")})


# --- acceptance sources and the command -----------------------------------------------------------

def drafter_dir(path, drafting: str | None, cond: list[float]):
    """A drafter dir as the planner reads it: config.json's eagle3_ray.draft_config (drafting
    left out: a checkpoint from before the field) and meta.json's held-out acceptance."""
    path.mkdir(parents=True)
    dc = {"hidden_size": 64} | ({"drafting": drafting} if drafting else {})
    (path / "config.json").write_text(json.dumps({"eagle3_ray": {"draft_config": dc}}))
    (path / "meta.json").write_text(json.dumps({"final_metrics": {
        f"eval/cond_acc_{i}": a for i, a in enumerate(cond)}}))
    return str(path)


def test_drafting_of_reads_the_draft_config(tmp_path):
    par = drafter_dir(tmp_path / "par", "parallel", [0.6, 0.5])
    old = drafter_dir(tmp_path / "old", None, [0.7, 0.6])
    assert acceptance.drafting_of(par) == "parallel" and acceptance.drafting_of(old) == "chain"
    run = tmp_path / "run"
    run.mkdir()
    drafter_dir(run / "drafter", "parallel", [0.6])
    assert acceptance.drafting_of(str(run)) == "parallel"            # a run dir: its drafter
    assert acceptance.drafting_of("0.8,0.7") is None
    assert acceptance.drafting_of(str(tmp_path / "x.json")) is None


def test_plan_cli_chain_and_parallel(tmp_path, capsys):
    from eagle3_ray import cli
    par = drafter_dir(tmp_path / "par", "parallel", [0.55, 0.45, 0.4])
    chain = drafter_dir(tmp_path / "chain", None, [0.7, 0.6, 0.5])
    out = tmp_path / "plan"
    rc = cli.main(["plan", "--acceptance", chain, "--parallel-acceptance", par,
                   "--profile", PCIE, "--max-depth", "8", "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "plan.json"))
    dc = r["drafting_choice"]
    assert set(dc["kinds"]) == {"chain", "parallel"} and not dc["what_if"]
    assert dc["choice"] == r["drafting"] == "chain"                  # far higher acceptance
    assert r["other_kind"]["drafting"] == "parallel"
    assert r["best_depth"] == cost.best_depth([0.7, 0.6, 0.5], profiles.load_profile(PCIE), 8)
    printed = capsys.readouterr().out
    assert "drafting: chain at depth" in printed and "beats parallel" in printed
    # a parallel drafter dir given as --acceptance is priced as parallel, the chain a what-if
    rc = cli.main(["plan", "--acceptance", par, "--profile", PCIE, "--max-depth", "8",
                   "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "plan.json"))
    assert r["drafting"] == "parallel" and set(r["drafting_choice"]["what_if"]) == {"chain"}
    assert "WHAT-IF" in capsys.readouterr().out
    # a chain drafter passed as the parallel one, or two parallel ones: refused
    rc = cli.main(["plan", "--acceptance", "0.8", "--parallel-acceptance", chain,
                   "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "pass it as --acceptance" in capsys.readouterr().err
    rc = cli.main(["plan", "--acceptance", par, "--parallel-acceptance", "0.5",
                   "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "two parallel acceptance sources" in capsys.readouterr().err
    rc = cli.main(["plan", "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "--parallel-acceptance" in capsys.readouterr().err


# --- measuring a k-token drafter forward --------------------------------------------------------

def _recording(drafter):
    """Wrap drafter.forward to record (tokens given, mask slots, positions) per call."""
    calls, forward = [], drafter.forward

    def rec(token_ids, hidden, positions, attend=None, masked=0):
        calls.append((token_ids.shape[1], masked, positions.shape[1]))
        return forward(token_ids, hidden, positions, attend=attend, masked=masked) if masked \
            else forward(token_ids, hidden, positions, attend=attend)
    drafter.forward = rec
    return calls


def test_measure_draft_parallel_tiny_drafter(tiny_verifier, one_thread):
    from eagle3_ray.serve.profile import measure_draft_parallel
    from eagle3_ray.train import kinds
    drafter = kinds.untrained_drafter(tiny_verifier, 1000)[0].eval()
    calls = _recording(drafter)
    ms = measure_draft_parallel(drafter, ks=(16, 1, 4, 2, 8), context=16, reps=3)
    assert list(ms) == [1, 2, 4, 8, 16]
    assert all(v > 0 for v in ms.values())
    assert all(a <= b for a, b in zip(list(ms.values()), list(ms.values())[1:]))
    assert calls[0] == (16, 0, 16)                                     # the context, cached once
    assert sorted(set(calls[1:])) == [(k, 0, k) for k in (1, 2, 4, 8, 16)]   # k query tokens
    assert len(calls) == 1 + 4 * 5                                     # (warmup + reps) x ks
    with pytest.raises(ValueError, match=">= 1"):
        measure_draft_parallel(drafter, ks=(0, 2), context=4, reps=1)


def test_measure_draft_parallel_parallel_drafter_uses_mask_slots(tiny_verifier, one_thread):
    from eagle3_ray.serve.profile import measure_draft_parallel
    from eagle3_ray.train import draft, kinds
    if not hasattr(draft.DraftConfig, "parallel"):
        pytest.skip("this DraftConfig has no parallel drafting")
    base = kinds.untrained_drafter(tiny_verifier, 1000)[0]
    drafter = draft.Eagle3Drafter(dataclasses.replace(base.config, drafting="parallel")).eval()
    calls = _recording(drafter)
    ms = measure_draft_parallel(drafter, ks=(1, 4, 8), context=8, reps=2)
    assert list(ms) == [1, 4, 8] and all(v > 0 for v in ms.values())
    assert sorted(set(calls[1:])) == [(1, 0, 1), (1, 3, 4), (1, 7, 8)]   # 1 token + k-1 masks


def test_measure_profile_carries_the_k_token_forward(tiny_verifier, tmp_path, one_thread):
    from eagle3_ray.serve.profile import measure_profile
    p = measure_profile(tiny_verifier, max_tokens=2, context=16, reps=2, name="tiny",
                        parallel_ks=(1, 4, 16))
    assert sorted(p.draft_parallel_ms) == [1, 4, 16] and p.draft_collectives == 0
    path = str(tmp_path / "tiny.yaml")
    profiles.save_profile(p, path)
    q = profiles.load_profile(path)
    assert q == p and cost.draft_round_s(q, 4, "parallel") == pytest.approx(
        p.draft_parallel_ms[4] / 1e3)                                  # one device: no comm


# --- the sweep ----------------------------------------------------------------------------------

def test_parallel_from_chain_uses_the_reported_ratios():
    assert acceptance.PARALLEL_FIRST_RATIO == pytest.approx(0.8873, abs=1e-4)
    assert acceptance.PARALLEL_REST_RATIO == pytest.approx(0.8740, abs=1e-4)
    # EAGLE-3's reported 71%, 49% -> P-EAGLE's 63%, 38% (unconditional)
    cond = acceptance.parallel_from_chain([0.71, 0.49 / 0.71])
    assert cond[0] == pytest.approx(0.63) and cond[0] * cond[1] == pytest.approx(0.38)
    assert acceptance.parallel_from_chain([1.0, 1.0], 1.2, 1.2) == [1.0, 1.0]     # capped at 1


def test_sweep_kinds_json_shape_and_cli(tmp_path, capsys):
    from eagle3_ray import cli
    pcie = profiles.load_profile(PCIE)
    r = cost.sweep_drafting([0.5, 0.7, 0.9], [pcie], 32)
    assert r["kind"] == "sweep_drafting" and r["profiles"] == [PCIE]
    assert len(r["rows"]) == 6
    assert [(x["draft_collectives"], x["acceptance"]) for x in r["rows"]] == [
        (4, 0.5), (4, 0.7), (4, 0.9), (0, 0.5), (0, 0.7), (0, 0.9)]
    keys = {"best_depth", "speedup", "tokens_per_s", "accept_len", "round_ms", "draft_ms",
            "draft_comm_ms", "draft_collectives"}
    for x in r["rows"]:
        assert all(keys <= set(x[k]) for k in cost.DRAFTING)
        assert keys <= set(x["parallel_at_chain_acceptance"])
        assert keys <= set(x["block_at_chain_acceptance"])
        assert x["pick"] == max(cost.DRAFTING, key=lambda k: (x[k]["tokens_per_s"],
                                                               -cost.DRAFTING.index(k)))
        assert x["block"]["best_depth"] <= cost.BLOCK_SIZE          # a block drafts <= 16
        assert x["block_collectives"] == (6 if x["draft_collectives"] else 0)
        assert x["dominated"] in ("acceptance", "cost", "tie")
        assert x["decided_by"] in ("acceptance", "cost", "tie")
        if x["dominated"] != "tie":
            assert max(x["acceptance_gain"], x["cost_gain"]) > 1
        # the parallel kind's own (lower) acceptance never beats it at the chain's
        assert x["parallel"]["speedup"] <= x["parallel_at_chain_acceptance"]["speedup"] + 1e-12
    on = {x["acceptance"]: x for x in r["rows"] if x["draft_collectives"]}
    off = {x["acceptance"]: x for x in r["rows"] if not x["draft_collectives"]}
    for a in (0.5, 0.7, 0.9):                     # collectives cost the chain more than parallel
        assert off[a]["chain"]["speedup"] > on[a]["chain"]["speedup"]
        lost_chain = off[a]["chain"]["speedup"] - on[a]["chain"]["speedup"]
        lost_par = off[a]["parallel"]["speedup"] - on[a]["parallel"]["speedup"]
        assert lost_chain > lost_par
    # docs/plan.md's table: at a = 0.9 with collectives the chain serves depth 8 (x2.73)
    assert (on[0.9]["chain"]["best_depth"], round(on[0.9]["chain"]["speedup"], 2)) == (8, 2.73)
    # the block drafter's derived (ASSUMED x1.084) acceptance wins it at a = 0.9
    assert on[0.9]["pick"] == "block" and on[0.9]["decided_by"] == "acceptance"
    out = tmp_path / "sk"
    rc = cli.main(["plan", "--sweep-kinds", "0.5", "0.9", "--profile", PCIE,
                   "--compare", PCIE_CURVE, "--out", str(out)])
    assert rc == 0
    j = json.load(open(out / "sweep_kinds.json"))
    assert j["profiles"] == [PCIE, PCIE_CURVE] and len(j["rows"]) == 8
    printed = capsys.readouterr().out
    assert "| 0.9 | 4 | 6 | 8 | x2.73 |" in printed and "plan picks" in printed
    rc = cli.main(["plan", "--sweep-kinds", "0.9", "--profile", PCIE, "--parallel-ratios",
                   "1.0", "1.0", "--block-ratios", "0.5", "0.5", "--out", str(out)])
    assert rc == 0 and json.load(open(out / "sweep_kinds.json"))["rows"][0]["pick"] == "parallel"
    rc = cli.main(["plan", "--sweep-kinds", "1.5", "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "[0, 1]" in capsys.readouterr().err


def test_a_bench_serve_json_gives_each_kind_its_own_arms(tmp_path):
    """bench serve --parallel-drafter keeps the parallel arms' acceptance apart: the chain reads
    the fixed-depth arms', the parallel kind its own, and a run without parallel arms says so."""
    import json
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"bench": "serve", "runs": {}, "planner": {
        "cond_acc": [0.4, 0.3], "parallel": {"cond_acc": [0.3, 0.1]}}}))
    assert acceptance.acceptance_from(str(path))[0] == [0.4, 0.3]
    assert acceptance.acceptance_from(str(path), drafting="parallel")[0] == [0.3, 0.1]
    path.write_text(json.dumps({"bench": "serve", "runs": {}, "planner": {"cond_acc": [0.4]}}))
    with pytest.raises(ValueError, match="without parallel arms"):
        acceptance.acceptance_from(str(path), drafting="parallel")
