"""The depth planner: the cost model's arithmetic on hand-computed cases, extrapolation, node
profiles (YAML, packaged), acceptance sources, the `plan` command, and measuring a profile."""
import http.server
import json
import math
import threading

import pytest
import yaml

from eagle3_ray.plan import acceptance, cost, output, profiles
from eagle3_ray.serve.profile import measure_profile

DECAYING = [round(max(0.05, 0.8 - 0.05 * i), 4) for i in range(32)]   # 0.8, 0.75, 0.7, ...


def profile(**kw) -> profiles.NodeProfile:
    """1 GPU (no comm), verify 10/12/16 ms at 1/2/4 tokens (= 8 + 2t ms), draft step 1 ms."""
    d = dict(name="one-gpu", description="test", sources=["hand"], gpus=1,
             interconnect=profiles.Interconnect(0.0, 1.0, 0, 1000, 2),
             verify_ms={1: 10.0, 2: 12.0, 4: 16.0}, draft_step_ms=1.0)
    d.update(kw)
    return profiles.NodeProfile(**d)


def two_nodes():
    """Same compute (verify 4 + t ms, draft 0.5 ms), 8 GPUs, 100 all-reduces of t·1000·2 B at
    1000 GB/s; PCIe-like α = 40 µs vs NVLink-like α = 5 µs."""
    common = dict(gpus=8, verify_ms={1: 5.0, 33: 37.0}, draft_step_ms=0.5)
    ic = profiles.Interconnect
    pcie = profile(name="pcie", interconnect=ic(40.0, 1000.0, 100, 1000, 2), **common)
    nvl = profile(name="nvlink", interconnect=ic(5.0, 1000.0, 100, 1000, 2), **common)
    return pcie, nvl


# --- arithmetic ---------------------------------------------------------------------------------

def test_verify_table_interpolates_and_extrapolates_linearly():
    p = profile()
    assert cost.compute_s(p, 1) == pytest.approx(10e-3)
    assert cost.compute_s(p, 3) == pytest.approx(14e-3)           # between 2 and 4
    assert cost.compute_s(p, 6) == pytest.approx(20e-3)           # past 4: slope of (2, 4)
    assert cost.comm_s(p, 5) == 0.0                                # one GPU: no all-reduce
    assert cost.round_s(p, 3) == pytest.approx(3e-3 + 16e-3)       # 3 drafts + verify of 4 tokens


def test_comm_formula_hand_computed():
    p = profile(gpus=4, interconnect=profiles.Interconnect(50.0, 10.0, 10, 1000, 2))
    # 10 · (50 µs + 2·3/4 · t·1000·2 B / 10 GB/s) = 0.5 ms + 3 µs·t
    assert cost.comm_s(p, 1) == pytest.approx(0.503e-3)
    assert cost.comm_s(p, 3) == pytest.approx(0.509e-3)
    assert cost.verify_s(p, 3) == pytest.approx(14e-3 + 0.509e-3)
    sharded = profile(gpus=4, interconnect=profiles.Interconnect(50.0, 10.0, 10, 1000, 2),
                      draft_collectives=3)
    assert cost.draft_s(sharded) == pytest.approx(1e-3 + 3 * 50.3e-6)


def test_constant_acceptance_half():
    r = cost.plan([0.5] * 4, profile(), max_depth=4)
    taus = [row["accept_len"] for row in r["depths"]]
    assert taus == pytest.approx([1, 1.5, 1.75, 1.875, 1.9375])
    rounds = [row["round_ms"] for row in r["depths"]]
    assert rounds == pytest.approx([10, 13, 16, 19, 22])       # k·1 + (8 + 2(k+1))
    tps = [row["tokens_per_s"] for row in r["depths"]]
    assert tps == pytest.approx([100, 1.5 / 0.013, 1.75 / 0.016, 1.875 / 0.019, 1.9375 / 0.022])
    assert r["best_depth"] == 1 and r["ttt_steps"] == 1
    assert r["best"]["speedup"] == pytest.approx(1.5 * 10 / 13)
    assert not any(row["extrapolated"] for row in r["depths"])


def test_decaying_acceptance():
    r = cost.plan([0.9, 0.6, 0.3], profile(), max_depth=3)
    # p = 0.9, 0.54, 0.162
    assert [x["accept_len"] for x in r["depths"]] == pytest.approx([1, 1.9, 2.44, 2.602])
    assert [x["tokens_per_s"] for x in r["depths"]] == pytest.approx(
        [100, 1.9 / 0.013, 2.44 / 0.016, 2.602 / 0.019])
    assert r["best_depth"] == 2 and r["ttt_steps"] == 2
    assert r["best"]["speedup"] == pytest.approx(2.44 * 10 / 16)
    assert cost.best_depth([0.9, 0.6, 0.3], profile()) == 2
    assert cost.plan([0.01] * 3, profile(), 3)["best_depth"] == 0   # drafting never pays


def test_pcie_goes_deeper_than_nvlink_hand_computed():
    pcie, nvl = two_nodes()
    # a = 0.8 constant: E[τ](k) = (1 − 0.8^(k+1)) / 0.2; round = 0.5k + 4 + (k+1) + comm(k+1) ms
    comm5 = 100 * (40e-6 + 2 * 7 / 8 * 5 * 2000 / 1e12)
    assert cost.comm_s(pcie, 5) == pytest.approx(comm5)
    assert cost.round_s(pcie, 4) == pytest.approx(2e-3 + 9e-3 + comm5)
    rp, rn = cost.plan([0.8] * 8, pcie, 8), cost.plan([0.8] * 8, nvl, 8)
    assert rp["depths"][4]["accept_len"] == pytest.approx(3.3616)
    assert rp["depths"][4]["tokens_per_s"] == pytest.approx(3.3616 / (11e-3 + comm5))
    assert rp["best_depth"] == 4 and rn["best_depth"] == 3
    # the reason: a depth-0 round is mostly all-reduce latency on the PCIe node
    assert rp["depths"][0]["comm_ms"] / rp["depths"][0]["round_ms"] > 0.4
    assert rn["depths"][0]["comm_ms"] / rn["depths"][0]["round_ms"] < 0.1
    assert "communication" in rp["why"] and "pcie" in output.compare_text(rp, rn)


def test_best_depth_matches_plan_and_extrapolates():
    pcie, nvl = two_nodes()
    for p in (pcie, nvl, profile()):
        for acc in (DECAYING, [0.9] * 32, [0.5, 0.4]):
            assert cost.best_depth(acc, p, 32) == cost.plan(acc, p, 32)["best_depth"]


# --- extrapolation ----------------------------------------------------------------------------

def test_extend_acceptance_is_conservative_and_marked():
    a, ext = acceptance.extend_acceptance([0.9, 0.8, 0.7], 6)
    assert a[:3] == [0.9, 0.8, 0.7] and ext == [False] * 3 + [True] * 3
    assert a[3:] == pytest.approx([0.7 * 0.9, 0.7 * 0.81, 0.7 * 0.729])   # min(last, mean) · 0.9^j
    a, _ = acceptance.extend_acceptance([0.5, 0.6, 0.95], 10)   # last known above the recent mean
    assert max(a[3:]) <= (0.5 + 0.6 + 0.95) / 3
    import random
    rng = random.Random(0)
    for _ in range(200):
        known = [rng.random() for _ in range(rng.randint(1, 8))]
        a, ext = acceptance.extend_acceptance(known, 32)
        tail = a[len(known):]
        assert all(x <= known[-1] for x in tail)
        assert all(x >= y for x, y in zip(tail, tail[1:]))
        assert ext.count(True) == 32 - len(known)
    assert acceptance.extend_acceptance([0.9, 0.8], 1) == ([0.9], [False])
    with pytest.raises(ValueError, match="no measured acceptance"):
        acceptance.extend_acceptance([], 4)


def test_plan_marks_extrapolated_depths_and_warns():
    r = cost.plan([0.95] * 8, profile(verify_ms={1: 10.0, 33: 10.5}, draft_step_ms=0.01),
               max_depth=16, known_depth=2)
    assert r["acceptance"]["known_depth"] == 2
    assert [row["extrapolated"] for row in r["depths"]][:4] == [False, False, False, True]
    assert r["acceptance"]["cond_acc"][2] < 0.95               # entries past known_depth replaced
    assert r["best_depth"] > 2 and "extrapolated" in r["warnings"][0]


def test_train_costs():
    r = cost.plan([0.9, 0.6, 0.3], profile(), 3, train_costs={1: 1.0, 4: 2.5, 8: 4.0})
    assert r["ttt_steps"] == 2
    assert r["ttt_steps_step_s"] == pytest.approx(1.5)          # interpolated between 1 and 4
    assert r["ttt_steps_relative_cost"] == pytest.approx(1.5)
    assert [t["relative_cost"] for t in r["train"]] == pytest.approx([1.0, 2.5, 4.0])


# --- profiles ---------------------------------------------------------------------------------

def test_profile_yaml_round_trip_and_errors(tmp_path):
    p = profile(gpus=8, interconnect=profiles.Interconnect(40.0, 16.0, 124, 7168, 2),
                draft_collectives=2)
    path = str(tmp_path / "p.yaml")
    profiles.save_profile(p, path)
    q = profiles.load_profile(path)
    assert q == p and cost.round_s(q, 5) == cost.round_s(p, 5)
    d = yaml.safe_load(open(path))
    del d["verify_ms"]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"bad.yaml: missing field 'verify_ms'"):
        profiles.load_profile(str(tmp_path / "bad.yaml"))
    d = yaml.safe_load(open(path))
    del d["interconnect"]["latency_us"]
    (tmp_path / "bad2.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"bad2.yaml: interconnect: missing field 'latency_us'"):
        profiles.load_profile(str(tmp_path / "bad2.yaml"))
    d = yaml.safe_load(open(path))
    d["gpu"] = 8
    (tmp_path / "bad3.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gpu'\]"):
        profiles.load_profile(str(tmp_path / "bad3.yaml"))
    d = yaml.safe_load(open(path))
    d["draft_step_ms"] = "fast"
    (tmp_path / "bad4.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(ValueError, match=r"'draft_step_ms' must be a number"):
        profiles.load_profile(str(tmp_path / "bad4.yaml"))
    with pytest.raises(FileNotFoundError, match="packaged"):
        profiles.load_profile("no-such-node")


def test_packaged_profiles_load_and_pcie_goes_deeper():
    names = profiles.packaged_profiles()
    assert {"pcie-8x-rtx-pro-6000-kimi-k2.5", "nvlink-8x-h100-kimi-k2.5"} <= set(names)
    for name in names:
        p = profiles.load_profile(name)
        assert p.sources and p.gpus == 8 and p.interconnect.allreduces_per_forward == 124
        ys = [p.verify_ms[k] for k in sorted(p.verify_ms)]
        assert ys == sorted(ys) and max(p.verify_ms) >= 33
        assert 1 <= cost.best_depth(DECAYING, p, 32) <= 8
        assert 2 <= cost.best_depth([0.9] * 32, p, 32) <= 16
        # the drafter runs at the verifier's TP (vLLM V1, SGLang): 4 collectives a forward
        assert p.draft_collectives == 4 and p.draft_parallel_ms
        assert cost.draft_s(p) > p.draft_step_ms / 1e3
    pcie = cost.plan(DECAYING, profiles.load_profile("pcie-8x-rtx-pro-6000-kimi-k2.5"))
    nvl = cost.plan(DECAYING, profiles.load_profile("nvlink-8x-h100-kimi-k2.5"))
    assert pcie["best_depth"] >= nvl["best_depth"]
    assert cost.best_depth([0.8] * 32, profiles.load_profile(PCIE), 32) > \
        cost.best_depth([0.8] * 32, profiles.load_profile("nvlink-8x-h100-kimi-k2.5"), 32)
    assert pcie["best"]["speedup"] > nvl["best"]["speedup"] > 1
    share = [r["depths"][0]["comm_ms"] / r["depths"][0]["round_ms"] for r in (pcie, nvl)]
    assert share[0] > share[1]


def test_profiles_price_the_drafters_layer_shape(tmp_path):
    """An MLA drafter layer (Kimi's, vLLM's Eagle3DeepseekV3ForCausalLM) reads more weights per
    GPU than a Llama one at TP 8 (its q/kv LoRA projections are replicated): a dearer forward,
    the same four collectives, and `plan --draft-layer mla` says which shape it priced."""
    import subprocess
    import sys
    for name in ("pcie-8x-rtx-pro-6000-kimi-k2.5", "nvlink-8x-h100-kimi-k2.5"):
        llama = profiles.load_profile(name)
        mla = profiles.with_draft_layer(llama, "mla")
        assert (llama.draft_layer, mla.draft_layer) == ("llama", "mla")
        assert mla.draft_step_ms > llama.draft_step_ms and mla.draft_collectives == 4
        assert cost.draft_round_s(mla, 8) > cost.draft_round_s(llama, 8)
        assert cost.draft_round_s(mla, 8, "parallel") > cost.draft_round_s(llama, 8, "parallel")
        assert profiles.with_draft_layer(mla, "llama") == llama                 # and back
        assert profiles.with_draft_layer(llama, None) is llama
    p = profiles.load_profile("pcie-8x-rtx-pro-6000-kimi-k2.5")
    with pytest.raises(ValueError, match="not 'tree'"):
        profiles.with_draft_layer(p, "tree")
    out = subprocess.run([sys.executable, "-m", "eagle3_ray.cli", "plan", "--sweep", "0.7",
                          "--profile", p.name, "--draft-layer", "mla",
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_with_interconnect_is_labelled_a_simulation():
    pcie = profiles.load_profile("pcie-8x-rtx-pro-6000-kimi-k2.5")
    sim = profiles.with_interconnect(profile(), pcie)
    assert sim.simulated and "SIMULATION" in sim.description
    assert cost.compute_s(sim, 3) == cost.compute_s(profile(), 3)
    assert cost.comm_s(sim, 3) == pytest.approx(cost.comm_s(pcie, 3))
    assert "SIMULATED" in cost.plan([0.8] * 4, sim, 8)["why"]


# --- acceptance sources -----------------------------------------------------------------------

def test_acceptance_from_training_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": 10, "train/cond_acc_0": 0.4, "train/cond_acc_1": 0.3},
             {"step": 20, "eval/cond_acc_0": 0.6, "eval/cond_acc_1": 0.5, "eval/acc_0": 0.6},
             {"step": 30, "train/cond_acc_0": 0.7, "train/cond_acc_1": 0.6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    cond, known, desc = acceptance.acceptance_from(str(run))
    assert cond == [0.6, 0.5] and known == 2 and "step 20" in desc
    drafter = tmp_path / "run2" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "meta.json").write_text(json.dumps(
        {"ttt_steps": 3, "final_metrics": {"eval/cond_acc_0": 0.7, "eval/cond_acc_1": 0.6,
                                           "eval/cond_acc_2": 0.5}}))
    assert acceptance.acceptance_from(str(tmp_path / "run2"))[:2] == ([0.7, 0.6, 0.5], 3)
    assert acceptance.acceptance_from(str(drafter))[0] == [0.7, 0.6, 0.5]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no cond_acc_k"):
        acceptance.acceptance_from(str(tmp_path / "empty"))


def test_acceptance_from_bench_json(tmp_path):
    q = {"bench": "quality", "runs": {"1": {"ttt_steps": 1, "cond_acc": [0.5, 0.3]},
                                      "4": {"ttt_steps": 4, "cond_acc": [0.6, 0.5, 0.4]}}}
    (tmp_path / "quality.json").write_text(json.dumps(q))
    deepest = acceptance.acceptance_from(str(tmp_path / "quality.json"))[0]
    assert deepest == [0.6, 0.5, 0.4]
    assert acceptance.acceptance_from(str(tmp_path / "quality.json"), ttt_steps=1)[0] == [0.5, 0.3]
    with pytest.raises(ValueError, match="no run with ttt_steps=8"):
        acceptance.acceptance_from(str(tmp_path / "quality.json"), ttt_steps=8)
    # bench serve, acceptance lengths only: E[τ] 1.5 at depth 1, 1.9375 at depth 4 -> a = 0.5
    s = {"bench": "serve", "runs": {"0": {"depth": 0, "acceptance_length": 1.0},
                                    "1": {"depth": 1, "acceptance_length": 1.5},
                                    "4": {"depth": 4, "acceptance_length": 1.9375}}}
    (tmp_path / "serve.json").write_text(json.dumps(s))
    cond, known, desc = acceptance.acceptance_from(str(tmp_path / "serve.json"))
    assert cond == pytest.approx([0.5] * 4, abs=1e-6) and known == 4 and "fit" in desc
    # bench serve with per-position counts of the deepest run
    s["runs"]["4"].update(rounds=100, accepted_per_position=[80, 40, 20, 5])
    (tmp_path / "serve.json").write_text(json.dumps(s))
    cond = acceptance.acceptance_from(str(tmp_path / "serve.json"))[0]
    assert cond == pytest.approx([0.8, 0.5, 0.5, 0.25])
    (tmp_path / "train.json").write_text(json.dumps({"bench": "train", "results": [
        {"ttt_steps": 1, "step_s": 0.5}, {"ttt_steps": 4, "step_s": 1.25}]}))
    with pytest.raises(ValueError, match="--bench-train"):
        acceptance.acceptance_from(str(tmp_path / "train.json"))
    assert acceptance.train_costs_from(str(tmp_path / "train.json")) == {1: 0.5, 4: 1.25}
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench quality or bench serve"):
        acceptance.acceptance_from(str(tmp_path / "other.json"))
    with pytest.raises(FileNotFoundError, match="acceptance source not found"):
        acceptance.acceptance_from(str(tmp_path / "nope"))
    assert acceptance.acceptance_from("0.8, 0.7,0.6") == ([0.8, 0.7, 0.6], 3, "given list")


def served_metrics_text() -> str:
    """What a server's /metrics says after 4 depth-3 rounds accepting 3, 1, 0, 2 drafts."""
    from eagle3_ray.serve.app import Metrics
    from eagle3_ray.serve.speculate import Round
    m = Metrics()
    rounds = [Round([1], 0, 0)] + [Round([1] * (a + 1), 3, a) for a in (3, 1, 0, 2)]
    m.rounds(5, rounds)
    return m.render()


def test_acceptance_from_server_metrics_url():
    text = served_metrics_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text if self.path == "/metrics" else b"# nothing\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        for url in (base, base + "/metrics"):
            cond, known, desc = acceptance.acceptance_from(url)
            # accepted at positions 0/1/2 in 3/2/1 of 4 rounds: p = .75, .5, .25
            assert cond == pytest.approx([0.75, 0.5 / 0.75, 0.5]) and known == 3
            assert "4 rounds" in desc
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(ValueError, match="could not read metrics"):
        acceptance.acceptance_from(base)                                # the server is gone


# --- the command ------------------------------------------------------------------------------

def test_plan_cli_end_to_end(tmp_path, capsys):
    from eagle3_ray import cli
    q = {"bench": "quality", "runs": {"4": {"ttt_steps": 4, "cond_acc": DECAYING[:4]}}}
    (tmp_path / "quality.json").write_text(json.dumps(q))
    (tmp_path / "train.json").write_text(json.dumps({"bench": "train", "results": [
        {"ttt_steps": 1, "step_s": 0.5}, {"ttt_steps": 4, "step_s": 1.25}]}))
    out = tmp_path / "plan"
    rc = cli.main(["plan", "--acceptance", str(tmp_path / "quality.json"),
                   "--profile", "pcie-8x-rtx-pro-6000-kimi-k2.5",
                   "--compare", "nvlink-8x-h100-kimi-k2.5", "--max-depth", "12",
                   "--bench-train", str(tmp_path / "train.json"), "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "plan.json"))
    assert (out / "plan.png").stat().st_size > 10_000
    assert len(r["depths"]) == 13 and r["compare"]["profile"] == "nvlink-8x-h100-kimi-k2.5"
    assert r["best_depth"] == cost.best_depth(DECAYING[:4], profiles.load_profile(
        "pcie-8x-rtx-pro-6000-kimi-k2.5"), 12)
    assert r["best_depth"] >= r["compare"]["best_depth"]
    assert r["best"]["speedup"] > r["compare"]["best"]["speedup"]
    assert r["drafting"] == "chain" and r["drafting_choice"]["choice"] == "chain"
    assert r["other_kind"]["drafting"] == "parallel"                # the what-if, labelled
    assert "WHAT-IF" in r["other_kind"]["acceptance"]["source"]
    assert r["depths"][5]["extrapolated"] and not r["depths"][4]["extrapolated"]
    assert "ttt_steps_step_s" in r and r["comparison"]
    printed = capsys.readouterr().out
    assert "best depth" in printed and "why:" in printed
    rc = cli.main(["plan", "--acceptance", "0.8", "--profile", "no-such-node",
                   "--out", str(tmp_path / "x")])
    assert rc == 2 and "profile not found" in capsys.readouterr().err


# --- measuring ----------------------------------------------------------------------------------

def test_measure_profile_tiny_verifier(tiny_verifier, tmp_path, one_thread):
    p = measure_profile(tiny_verifier, max_tokens=4, context=16, reps=3, name="tiny")
    assert sorted(p.verify_ms) == [1, 2, 3, 4]
    assert all(v > 0 for v in p.verify_ms.values()) and p.draft_step_ms > 0
    assert p.verify_ms[4] > 0.3 * p.verify_ms[1]               # monotone-ish on a noisy box
    assert p.gpus == 1 and p.interconnect.allreduces_per_forward == 0
    assert cost.comm_s(p, 4) == 0.0
    path = str(tmp_path / "tiny.yaml")
    profiles.save_profile(p, path)
    assert profiles.load_profile(path) == p
    assert 0 <= cost.best_depth([0.8] * 4, p, 4) <= 4


def test_dynamic_depth_follows_the_request_acceptance():
    """Starts at the prior's best depth, goes deeper while drafts are accepted, backs off to
    plain decoding when they stop being accepted."""
    from types import SimpleNamespace as Round
    pcie, _ = two_nodes()
    dd = cost.DynamicDepth(pcie, [0.5], max_depth=16)
    first = dd([])
    assert first == cost.best_depth(acceptance.extend_acceptance([0.5], 16)[0], pcie, 16) >= 1
    history = [Round(drafted=first, accepted=first) for _ in range(30)]
    assert dd(history) > first
    history += [Round(drafted=dd.depths[-1], accepted=0) for _ in range(400)]
    assert dd(history) == 0
    assert dd.seen == len(history) and len(dd.depths) == 3


def test_dynamic_depth_prices_the_drafters_kind():
    """The same acceptance on a node where each drafter forward is dear: a chain's round pays
    one forward per draft, a parallel drafter's one in all, so its policy goes deeper."""
    import dataclasses
    pcie, _ = two_nodes()
    dear = dataclasses.replace(pcie, draft_step_ms=3.0, draft_parallel_ms={1: 3.0, 16: 3.2})
    chain = cost.DynamicDepth(dear, [0.7], max_depth=16)([])
    par = cost.DynamicDepth(dear, [0.7], max_depth=16, drafting="parallel")([])
    assert par > chain >= 1
    with pytest.raises(ValueError, match="drafting"):
        cost.DynamicDepth(dear, [0.7], max_depth=16, drafting="tree")


def test_dynamic_depth_keeps_a_measured_position_and_leaves_lookup_rounds_out():
    """A ttt-1 drafter: position 0 held out at 0.45, position 1 (one past its trained depth,
    the eval's probe) at 0.1. On a host where depth 2 would pay only if position 1 held
    ~0.9 x position 0 (the old extrapolation), the policy stays at depth 1 through rounds that
    accept position 0, which say nothing of position 1. Rounds drafted by the lookup fallback,
    which accept far deeper, do not move it; the same rounds from the drafter do."""
    from types import SimpleNamespace as Round
    from transformers import LlamaConfig
    cpu = profiles.single_device_profile("cpu", {k: 100.0 + 7 * (k - 1) for k in range(1, 10)}, 5.0,
                                  LlamaConfig(hidden_size=64))
    assert cost.best_depth([0.45, 0.45 * 0.9], cpu, 2) == 2
    assert cost.best_depth([0.45, 0.1], cpu, 2) == 1
    dd = cost.DynamicDepth(cpu, [0.45, 0.1], max_depth=8)
    assert dd([]) == 1
    assert dd([Round(drafted=1, accepted=1, lookup=False) for _ in range(30)]) == 1
    assert dd.cond_acc()[1] == pytest.approx(0.1)
    deep = [Round(drafted=8, accepted=8, lookup=True) for _ in range(50)]
    looked = cost.DynamicDepth(cpu, [0.45, 0.1], max_depth=8)
    assert looked(deep) == 1 and looked.reached == [0] * 8
    drafted = cost.DynamicDepth(cpu, [0.45, 0.1], max_depth=8)
    assert drafted([Round(drafted=8, accepted=8, lookup=False) for _ in range(50)]) >= 4


# --- a measured all-reduce curve instead of α/β -----------------------------------------------

CURVE = {4096: 45.0, 65536: 344.0}        # µs per all-reduce: the published PCIe points
PCIE = "pcie-8x-rtx-pro-6000-kimi-k2.5"
PCIE_CURVE = PCIE + "-allreduce-curve"


def test_allreduce_curve_is_log_log_and_replaces_alpha_beta():
    c = cost.allreduce_curve_us
    assert c(CURVE, 4096) == 45.0 and c(CURVE, 65536) == pytest.approx(344.0)
    assert c(CURVE, 100) == 45.0                               # below: the latency floor
    assert c(CURVE, 16384) == pytest.approx((45.0 * 344.0) ** 0.5)   # log-log midpoint
    assert c(CURVE, 4 * 65536) == pytest.approx(344.0 * (344.0 / 45.0) ** 0.5)   # continued
    assert c({1000: 50.0, 2000: 40.0}, 8000) == 40.0           # never falls past the data
    # 8 GPUs, 10 all-reduces of t·1024·2 B: the curve, not α/β, prices them
    ic = profiles.Interconnect(40.0, 16.0, 10, 1024, 2, allreduce_us=dict(CURVE))
    p = profile(gpus=8, interconnect=ic)
    assert profiles.message_bytes(p, 8) == 16384
    assert cost.comm_s(p, 1) == pytest.approx(10 * 45e-6)
    assert cost.comm_s(p, 8) == pytest.approx(10 * (45.0 * 344.0) ** 0.5 * 1e-6)
    ab = profile(gpus=8, interconnect=profiles.Interconnect(40.0, 16.0, 10, 1024, 2))   # fallback
    assert cost.comm_s(ab, 8) == pytest.approx(10 * (40e-6 + 2 * 7 / 8 * 16384 / 16e9))
    assert "measured curve" in output.allreduce_model(p)
    assert "alpha/beta" in output.allreduce_model(ab)
    assert "measured curve" in cost.plan([0.8] * 4, p, 4)["why"]
    # the α/β fallback fitted to a curve: exact on α/β data, defined on a curve that falls
    exact = {b: 40.0 + 2 * 7 / 8 * b / 16e9 * 1e6 for b in (2048, 16384, 131072, 473088)}
    assert profiles.fit_alpha_beta(exact, 8) == pytest.approx((40.0, 16.0))
    assert profiles.fit_alpha_beta({1000: 50.0, 2000: 40.0}, 2) == pytest.approx(
        (40.0, 2e3 / 50e-6 / 1e9), rel=1e-3)
    # a slow, noisy link (gloo between 2 busy CPU processes): its BW stays > 0, a valid profile
    noisy = {128: 2270.0, 256: 13009.7, 384: 1953.1, 640: 7099.5, 1152: 5145.1, 2176: 3956.4,
             4224: 3201.0}
    alpha, bw = profiles.fit_alpha_beta(noisy, 2)
    assert alpha == pytest.approx(1953.1, rel=1e-3) and 0 < bw < 1e-3
    slow = profiles.Interconnect(alpha, bw, 18, 64, 2, allreduce_us=noisy)
    profiles.profile_from_dict(profiles.profile_to_dict(profile(gpus=2, interconnect=slow)))


def test_curve_profile_yaml_round_trip_and_errors(tmp_path):
    ic = profiles.Interconnect(40.0, 16.0, 124, 7168, 2, allreduce_us=dict(CURVE))
    p = profile(gpus=8, interconnect=ic)
    path = str(tmp_path / "p.yaml")
    profiles.save_profile(p, path)
    assert yaml.safe_load(open(path))["interconnect"]["allreduce_us"] == CURVE
    q = profiles.load_profile(path)
    assert q == p and cost.comm_s(q, 9) == cost.comm_s(p, 9)
    profiles.save_profile(profile(), path)                     # α/β only: no such key written
    assert "allreduce_us" not in yaml.safe_load(open(path))["interconnect"]
    for bad, why in (({4096: 45.0}, "at least 2"), ({"4KB": 45.0, 65536: 1.0}, "integers"),
                     ({4096: -1.0, 65536: 1.0}, "must be a number")):
        d = yaml.safe_load(open(path))
        d["interconnect"]["allreduce_us"] = bad
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(d))
        with pytest.raises(ValueError, match=r"bad.yaml: interconnect: allreduce_us.*" + why):
            profiles.load_profile(str(tmp_path / "bad.yaml"))


def test_packaged_curve_profile_moves_the_best_depth():
    """The packaged PCIe profile with the published curve instead of α/β: the same node
    otherwise, a depth-0 round far more communication, and shallower best depths (the curve
    grows ~0.73 per log step of the message where α/β stays near its latency). These are the
    figures of docs/plan.md's table (`eagle3-ray plan --sweep`)."""
    ab, cu = profiles.load_profile(PCIE), profiles.load_profile(PCIE_CURVE)
    assert cu.interconnect.allreduce_us == CURVE and not ab.interconnect.allreduce_us
    assert cu.verify_ms == ab.verify_ms and cu.draft_step_ms == ab.draft_step_ms
    assert cost.comm_s(ab, 1) == pytest.approx(124 * (40e-6 + 1.75 * 14336 / 16e9))
    assert cost.comm_s(cu, 1) == pytest.approx(124 * 45.0 * (14336 / 4096) ** (
        math.log(344 / 45) / math.log(16)) * 1e-6)
    levels = [0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    best = {n: [cost.best_depth([a] * 32, p, 32) for a in levels] for n, p in (("ab", ab),
                                                                           ("cu", cu))}
    assert best["ab"] == [2, 2, 3, 4, 5, 6, 8, 14]
    assert best["cu"] == [0, 1, 1, 1, 2, 3, 5, 10]
    assert cost.best_depth(DECAYING, ab, 32) == 3 and cost.best_depth(DECAYING, cu, 32) == 2
    r = cost.plan(DECAYING, cu)
    assert any("extrapolated from the curve" in w and "from depth 4 on" in w
               for w in r["warnings"])
    assert not any("curve" in w for w in cost.plan(DECAYING, ab)["warnings"])


def test_plan_sweep_cli(tmp_path, capsys):
    from eagle3_ray import cli
    out = tmp_path / "sweep"
    rc = cli.main(["plan", "--sweep", "0.6", "0.8", "0.9", "--profile", PCIE,
                   "--compare", PCIE_CURVE, "--out", str(out)])
    assert rc == 0
    r = json.load(open(out / "sweep.json"))
    assert [row["acceptance"] for row in r["rows"]] == [0.6, 0.8, 0.9]
    assert [row[PCIE]["best_depth"] for row in r["rows"]] == [2, 5, 8]
    assert [row[PCIE_CURVE]["best_depth"] for row in r["rows"]] == [1, 2, 5]
    printed = capsys.readouterr().out
    assert "| 0.8 | 5 | x2.06 | 2 | x1.18 |" in printed and "measured curve" in printed
    rc = cli.main(["plan", "--sweep", "1.5", "--profile", PCIE, "--out", str(out)])
    assert rc == 2 and "[0, 1]" in capsys.readouterr().err


def test_allreduce_curve_measured_between_processes(tmp_path):
    """add_allreduce_curve, the path `eagle3-ray profile` takes with several GPUs (NCCL), run
    here with gloo between 2 CPU processes: one time per verify size, α/β fitted as the
    fallback, written and read back, and what the planner then charges."""
    base = profile(interconnect=profiles.Interconnect(0.0, 1.0, 0, 64, 2))
    p = profiles.add_allreduce_curve(base, procs=2, allreduces_per_forward=18, backend="gloo",
                              iters=20)
    sizes = [t * 64 * 2 for t in profiles.CURVE_TOKENS]
    assert sorted(p.interconnect.allreduce_us) == sizes
    assert all(v > 0 for v in p.interconnect.allreduce_us.values())
    assert p.gpus == 2 and p.interconnect.allreduces_per_forward == 18
    assert p.interconnect.latency_us >= 0 and p.interconnect.bandwidth_gbps > 0
    path = str(tmp_path / "measured.yaml")
    profiles.save_profile(p, path)
    q = profiles.load_profile(path)
    assert q.interconnect.allreduce_us == p.interconnect.allreduce_us
    for t in profiles.CURVE_TOKENS:
        assert cost.comm_s(q, t) == pytest.approx(18 * p.interconnect.allreduce_us[t * 128] * 1e-6)


def test_a_measured_curve_that_dips_does_not_send_dynamic_depth_deep():
    """A replica's 3-rep startup profile measured on a noisy AVX2-only host (verify ms for 1..4
    tokens, draft step 5.3 ms): its 4-token verify came out cheaper than its 3-token one, which
    sent DynamicDepth to depth 3 with this drafter's served acceptance (0.35, 0.14); 7-rep
    profiles gave depth 1. Pooled to a non-decreasing curve it plans depth 1; a curve that
    already rises (steps included) is kept exactly."""
    import dataclasses
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9)
    dip = {1: 111.0, 2: 125.0, 3: 138.0, 4: 117.0}
    assert profiles.monotone_curve(dip) == {1: 111.0, 2: 125.0, 3: 127.5, 4: 127.5}
    prof = profiles.single_device_profile("replica", dip, 5.3, cfg)
    assert prof.verify_ms == {1: 111.0, 2: 125.0, 3: 127.5, 4: 127.5}
    raw = dataclasses.replace(prof, verify_ms=dip)
    assert cost.best_depth([0.35, 0.14], raw, 3) == 3            # what the raw dip chose
    assert cost.best_depth([0.35, 0.14], prof, 3) == 1
    steps = {1: 28.2, 2: 28.2, 3: 33.0, 4: 33.4, 17: 50.2}     # a kernel switch at 3 rows
    assert profiles.monotone_curve(steps) == steps
    assert profiles.monotone_curve({1: 5.0, 2: 3.0, 3: 1.0}) == {1: 3.0, 2: 3.0, 3: 3.0}
