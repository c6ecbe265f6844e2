"""The Ray Serve OpenAI app (serve/app.py) through real HTTP: a real Serve deployment on the test
Ray cluster, the tiny random verifier and an untrained drafter saved as a real checkpoint."""
import argparse
import importlib
import json
import os
import threading
import time

import pytest
import requests
import yaml
from conftest import UNAUTHORIZED, check_malformed, free_port, malformed_requests

from eagle3_ray.serve import app as serve
from eagle3_ray.train import checkpoint, kinds
from eagle3_ray.serve.app import ServeConfig

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"


def save_untrained(spec: str, out: str, ttt_steps: int = 2, drafting: str = "chain") -> str:
    drafter, _ = kinds.untrained_drafter(spec, draft_vocab_size=2000, drafting=drafting)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens")}
    checkpoint.save_drafter(out, state, drafter.config, {"ttt_steps": ttt_steps, "verifier": spec})
    return out



@pytest.fixture(scope="module")
def server(ray_cluster, tiny_verifier, tmp_path_factory):
    from ray import serve as ray_serve
    drafter = save_untrained(tiny_verifier, str(tmp_path_factory.mktemp("srv") / "drafter"))
    cfg = ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL, depth=2,
                      max_depth=8, branches=2,                     # greedy: 2-chain trees
                      cpus_per_replica=0.5, max_ongoing_requests=2,
                      max_queued_requests=1, api_key=KEY, max_model_len=256,
                      max_request_bytes=1 << 16, port=free_port(), torch_threads=1)
    url = serve.start(cfg)
    yield url, cfg
    ray_serve.shutdown()


def post(url, path, body, headers=AUTH, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url + path, data=data, timeout=120,
                         headers={"Content-Type": "application/json", **headers}, **kw)


def chat(content="Tell me about rivers.", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 16, **kw}


def sse(resp) -> list:
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if line:
            assert line.startswith("data: ")
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def metrics(url) -> dict:
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    return serve.parse_metrics(r.text)


def test_chat_and_completions_greedy_match_plain_decoding(server):
    url, _ = server
    r = post(url, "/v1/chat/completions", chat())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    text = body["choices"][0]["message"]["content"]
    u = body["usage"]
    assert u["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"
    assert u["total_tokens"] == u["prompt_tokens"] + 16
    s = u["speculation"]
    assert s["depth"] == 2 and s["rounds"] >= 1 and s["drafted_tokens"] == 2 * s["rounds"]
    assert 1 <= s["acceptance_length"] <= 3 and len(s["accepted_per_position"]) == 2
    for depth in (0, 5):  # greedy output is the verifier's at any depth
        other = post(url, "/v1/chat/completions", chat(speculation_depth=depth)).json()
        assert other["choices"][0]["message"]["content"] == text
        assert other["usage"]["speculation"]["depth"] == depth
    assert "warning" in other["usage"]["speculation"]      # 5 > the drafter's ttt_steps (2)

    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                      "temperature": 0, "max_tokens": 10, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion" and r.json()["usage"]["completion_tokens"] == 10
    sampled = [post(url, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 12,
                                             "temperature": 0.8, "seed": 11}).json()
               for _ in range(2)]
    assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]  # seeded


def test_streaming_chat_and_completions(server):
    url, _ = server
    full = post(url, "/v1/chat/completions", chat()).json()["choices"][0]["message"]["content"]
    with post(url, "/v1/chat/completions",
              chat(stream=True, stream_options={"include_usage": True}), stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == full
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16

    with post(url, "/v1/completions", {"model": MODEL, "prompt": "Hello", "stream": True,
                                       "temperature": 0, "max_tokens": 8}, stream=True) as r:
        events = sse(r)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    plain = post(url, "/v1/completions", {"model": MODEL, "prompt": "Hello", "temperature": 0,
                                          "max_tokens": 8}).json()["choices"][0]["text"]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain


def test_stop_strings(server):
    url, _ = server
    full = post(url, "/v1/completions", {"model": MODEL, "prompt": "The", "temperature": 0,
                                         "max_tokens": 24}).json()["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "The", "temperature": 0,
                                      "max_tokens": 24, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == full[:full.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_bad_input_gets_openai_errors_and_the_replica_keeps_serving(server):
    """conftest's table of malformed requests, the same the vLLM engine answers
    (test_served_vllm.py), each a 4xx naming the field; n > 1, which this engine cannot do, is a
    400 too; then the replica still serves."""
    url, cfg = server
    cases = malformed_requests(MODEL, cfg.max_model_len, cfg.max_request_bytes)
    assert len(cases) >= 12
    cases.append(("n 2 (one choice only here)", chat(n=2), 400, "n", "only n=1"))
    assert check_malformed(url, AUTH, cases, chat(max_tokens=2)) == []


def test_unknown_chat_role_is_a_400_naming_the_field(server):
    """The OpenAI API answers 400 for a role outside system/user/assistant/tool/developer; the
    chat template must never render one."""
    url, _ = server
    body = chat()
    body["messages"] = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "zap"}]
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages.1.role"
    assert err["message"].startswith("messages[1].role: 'wizard' is not one of system, user")
    body["messages"][1]["role"] = "assistant"
    assert post(url, "/v1/chat/completions", body).status_code == 200


def test_api_key_models_health(server):
    url, _ = server
    r = post(url, "/v1/chat/completions", chat(), headers={})
    assert r.status_code == 401 and r.json() == UNAUTHORIZED        # the vLLM engine's too
    r = post(url, "/v1/chat/completions", chat(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert requests.get(url + "/v1/models", timeout=30).status_code == 401
    m = requests.get(url + "/v1/models", headers=AUTH, timeout=30).json()
    assert m["data"][0]["id"] == MODEL and m["data"][0]["max_model_len"] == 256
    health = requests.get(url + "/health", timeout=30).json()      # trees exact on every CPU
    assert health == {"status": "ok", "exact": {"chain": True, "tree": True}, "fallbacks": []}
    assert metrics(url)['eagle3_ray_exact_info{path="tree"}'] == 1


def test_metrics_reflect_requests(server):
    url, _ = server
    before = metrics(url)
    u = post(url, "/v1/chat/completions", chat(max_tokens=9, speculation_depth=3)).json()["usage"]
    post(url, "/v1/chat/completions", chat(temperature=-1))
    after = metrics(url)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)
    assert delta('eagle3_ray_requests_total{endpoint="chat",status="200"}') == 1
    assert delta('eagle3_ray_requests_total{endpoint="chat",status="400"}') == 1
    assert delta("eagle3_ray_generation_tokens_total") == 9
    assert delta("eagle3_ray_prompt_tokens_total") == u["prompt_tokens"]
    s = u["speculation"]
    assert delta("eagle3_ray_rounds_total") == s["rounds"]
    assert delta("eagle3_ray_drafted_tokens_total") == s["drafted_tokens"]
    assert delta("eagle3_ray_accepted_tokens_total") == s["accepted_tokens"]
    assert delta("eagle3_ray_lookup_rounds_total") == s["lookup_rounds"]
    assert delta('eagle3_ray_drafted_at_position_total{position="2"}') == s["rounds"]
    assert delta('eagle3_ray_accepted_at_position_total{position="0"}') == \
        s["accepted_per_position"][0]
    assert delta("eagle3_ray_request_latency_seconds_count") == 1
    assert after["eagle3_ray_acceptance_length"] >= 1


def test_overload_answers_503_at_once(server):
    url, _ = server
    results = []

    def one():
        t0 = time.perf_counter()
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "Count", "max_tokens": 150,
                                          "temperature": 0, "speculation_depth": 0})
        results.append((r.status_code, time.perf_counter() - t0))
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [c for c, _ in results]
    assert codes.count(200) >= 2 and codes.count(503) >= 1, codes
    slowest_ok = max(s for c, s in results if c == 200)
    assert all(s < slowest_ok for c, s in results if c == 503)  # rejected, not queued


def test_client_disconnect_frees_the_slot(server):
    url, _ = server
    before = metrics(url)
    with post(url, "/v1/completions", {"model": MODEL, "prompt": "Go", "stream": True,
                                       "max_tokens": 240, "temperature": 0,
                                       "speculation_depth": 0}, stream=True) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
    # the connection is closed: Serve cancels the request, the decode loop stops early
    deadline = time.time() + 60
    key = 'eagle3_ray_requests_total{endpoint="completions",status="cancelled"}'
    while time.time() < deadline and metrics(url).get(key, 0) == before.get(key, 0):
        time.sleep(0.2)
    after = metrics(url)
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert after["eagle3_ray_generation_tokens_total"] - \
        before["eagle3_ray_generation_tokens_total"] < 240
    assert post(url, "/v1/chat/completions", chat(max_tokens=2)).status_code == 200


def test_mismatched_drafter_is_refused(tiny_verifier, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    other = tmp_path / "other_verifier"
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=3000)
    LlamaForCausalLM(cfg).save_pretrained(other)
    bad = save_untrained(str(other), str(tmp_path / "bad_drafter"))
    with pytest.raises(ValueError, match="hidden_size 32 != verifier 64"):
        serve.build_app(ServeConfig(verifier=tiny_verifier, drafter=bad))
    with pytest.raises(ValueError, match="needs a drafter"):
        serve.Engine(ServeConfig(verifier=tiny_verifier, depth=3))


def test_serve_yaml_builds_the_app(tiny_verifier, tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "cluster", "serve.yaml")
    conf = yaml.safe_load(open(path))
    app = conf["applications"][0]
    assert app["import_path"] == "eagle3_ray.serve.app:app_builder"
    # configs written before the stage packages name eagle3_ray.serve:app_builder: still resolves
    assert importlib.import_module("eagle3_ray.serve").app_builder is serve.app_builder
    args = dict(app["args"], verifier=tiny_verifier,
                drafter=save_untrained(tiny_verifier, str(tmp_path / "d")))
    built = serve.app_builder(args)
    d = built._bound_deployment
    assert d.ray_actor_options["resources"] == {args["node_resource"]: 0.001}
    assert d.ray_actor_options["num_gpus"] == args["gpus_per_replica"]
    with pytest.raises(ValueError, match="unknown field"):
        serve.app_builder({"depht": 3})


def test_engine_dynamic_depth_over_a_simulated_interconnect(tiny_verifier, tmp_path, one_thread):
    """The replica's engine (no HTTP needed: the routes are the same code as above): requests
    without speculation_depth get a per-round depth policy planned on the replica's measured
    times plus a SIMULATED PCIe interconnect, which every verify really sleeps; the output is
    still plain decoding's; an explicit speculation_depth still wins."""
    from eagle3_ray.plan import planner
    drafter = save_untrained(tiny_verifier, str(tmp_path / "d"))
    node = "pcie-8x-rtx-pro-6000-kimi-k2.5"
    eng = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL,
                                   max_depth=6, dynamic_depth=True, simulate_interconnect=node,
                                   torch_threads=1))
    comm = planner.comm_s(planner.load_profile(node), 1)
    assert eng.depth_profile.simulated and comm > 1e-3
    assert eng.spec.simulated_comm(1) == comm and eng.prior == [0.5]   # untrained: no metrics
    req = serve.ChatRequest(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                            temperature=0, max_tokens=10)
    prompt = eng.prompt_ids(req)
    sp, policy, _ = eng.sampling(req, len(prompt))
    assert isinstance(policy, planner.DynamicDepth)
    rounds = list(eng.spec.generate(prompt, sp, policy))
    plain = [t for r in eng.spec.generate(prompt, sp, 0) for t in r.tokens]
    assert [t for r in rounds for t in r.tokens] == plain
    assert [r.drafted for r in rounds[1:]] == policy.depths[:len(rounds) - 1]
    assert all(r.verify_s >= comm for r in rounds)                  # the simulation was paid
    spec = serve.usage(len(prompt), rounds, policy, None)["speculation"]
    assert spec["depth"] == "dynamic"
    assert spec["mean_depth"] == sum(policy.depths[:len(rounds) - 1]) / (len(rounds) - 1)
    fixed = serve.ChatRequest(model=MODEL, messages=req.messages, speculation_depth=2)
    assert eng.sampling(fixed, len(prompt))[1] == 2


@pytest.mark.parametrize("kind", ["parallel", "block"])
def test_engine_dynamic_depth_prices_one_forward_rounds(kind, tiny_verifier, tmp_path,
                                                        one_thread):
    """A parallel or block drafter served with dynamic depth: the replica also times its
    one-forward rounds (draft_parallel_ms by drafts; draft_block_ms by query slots, drafts + 1)
    and the policy prices rounds as that kind; output unchanged."""
    from eagle3_ray.plan import planner
    drafter = save_untrained(tiny_verifier, str(tmp_path / "p"), drafting=kind)
    eng = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL,
                                   max_depth=4, dynamic_depth=True, torch_threads=1))
    forward = (eng.depth_profile.draft_parallel_ms if kind == "parallel"
               else eng.depth_profile.draft_block_ms)
    assert set(forward) == ({1, 2, 4} if kind == "parallel" else {2, 3, 5})
    req = serve.ChatRequest(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                            temperature=0, max_tokens=8)
    prompt = eng.prompt_ids(req)
    sp, policy, _ = eng.sampling(req, len(prompt))
    assert isinstance(policy, planner.DynamicDepth) and policy.drafting == kind
    out = [t for r in eng.spec.generate(prompt, sp, policy) for t in r.tokens]
    assert out == [t for r in eng.spec.generate(prompt, sp, 0) for t in r.tokens]


def test_engine_lookup_fallback_on_by_default_and_off(tiny_verifier, tmp_path, one_thread):
    """The lookup fallback is on unless --no-lookup: the engine hands it to every chain round,
    the output stays plain decoding's, and usage counts the rounds it drafted."""
    from eagle3_ray import cli
    from eagle3_ray.serve import speculate
    drafter = save_untrained(tiny_verifier, str(tmp_path / "d"))
    eng = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL,
                                   torch_threads=1))
    assert eng.lookup == speculate.LookupParams()
    req = serve.ChatRequest(model=MODEL, messages=[{"role": "user", "content": "a b a b a b"}],
                            temperature=0, max_tokens=24)
    prompt = eng.prompt_ids(req)
    sp, depth, _ = eng.sampling(req, len(prompt))
    rounds = list(eng.spec.generate(prompt, sp, depth, lookup=eng.lookup))
    plain = [t for r in eng.spec.generate(prompt, sp, 0) for t in r.tokens]
    assert [t for r in rounds for t in r.tokens] == plain
    spec = serve.usage(len(prompt), rounds, depth, None)["speculation"]
    assert spec["lookup_rounds"] == sum(r.lookup for r in rounds) > 0   # a looping tiny model
    off = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, lookup=False,
                                   torch_threads=1))
    assert off.lookup is None and off.lookup_greedy is None
    off_tree = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, lookup=False,
                                        branches=2, lookup_branch=True, torch_threads=1))
    assert off_tree.lookup_greedy is None and off_tree.branches == 2   # no lookup in the tree
    branch = serve.Engine(ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL,
                                      lookup_branch=True, torch_threads=1))
    assert branch.lookup_greedy == speculate.LookupParams(branch=True)    # greedy: a tree
    assert branch.lookup == speculate.LookupParams()                     # sampled: the fallback
    rounds = list(branch.spec.generate(prompt, sp, depth, lookup=branch.lookup_greedy))
    assert [t for r in rounds for t in r.tokens] == plain and any(r.lookup for r in rounds)
    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    assert cli.serve_config(p.parse_args(["--drafter", drafter, "--no-lookup"])).lookup is False
    assert cli.serve_config(p.parse_args(["--drafter", drafter])).lookup is True
    assert cli.serve_config(p.parse_args(["--drafter", drafter, "--lookup-branch"])).lookup_branch


def test_engine_falls_back_to_what_is_exact_on_this_host(tiny_verifier, tmp_path, one_thread,
                                                         make_inexact):
    """A replica whose start-up check (Speculator.check_exact) finds a tree verify inexact on
    its kernels (a MOCK of such kernels: none here) serves chains instead of --branches and
    --lookup-branch, and one whose multi-token verify is inexact serves depth 0; each says why
    in its log and /health (fallbacks), and greedy output stays the verifier's."""
    from eagle3_ray.serve import speculate
    drafter = save_untrained(tiny_verifier, str(tmp_path / "d"))
    cfg = ServeConfig(verifier=tiny_verifier, drafter=drafter, model_name=MODEL, depth=3,
                      branches=2, lookup_branch=True, torch_threads=1)
    req = serve.ChatRequest(model=MODEL, messages=[{"role": "user", "content": "a b a b a b"}],
                            temperature=0, max_tokens=12, speculation_depth=3)
    make_inexact("tree")
    eng = serve.Engine(cfg)
    assert eng.branches == 1 and eng.lookup_greedy == speculate.LookupParams()   # no tree
    assert len(eng.fallbacks) == 1 and eng.fallbacks[0].startswith("chains instead of trees")
    prompt = eng.prompt_ids(req)
    sp, depth, _ = eng.sampling(req, len(prompt))
    plain = [t for r in eng.spec.generate(prompt, sp, 0) for t in r.tokens]
    rounds = list(eng.spec.generate(prompt, sp, depth, branches=eng.branches,
                                    lookup=eng.lookup_greedy))
    assert depth == 3 and [t for r in rounds for t in r.tokens] == plain
    make_inexact("chain")
    eng = serve.Engine(cfg)
    assert eng.sampling(req, len(prompt))[1] == 0
    assert any(f.startswith("depth 0 for every request") for f in eng.fallbacks)
