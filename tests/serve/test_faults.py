"""Faults on the builtin engine (serve/app.py), for real: a small deployment of its own (the tiny
random verifier, depth 0, one request at a time and one queued, request_timeout_s 3 s) on the
test Ray cluster, driven over HTTP; each test asserts what the client sees and how long it
took. Non-destructive tests first; the last two kill the replica (the builtin engine decodes in
the replica's process, so "the engine dies" is "the replica's process dies") and check that
Serve replaces it (7-9 s) and that the next requests succeed. ~45 s on 2 cores.

    .venv/bin/python -m pytest -q -s tests/serve/test_faults.py     # -s: the measured times
"""
import json
import os
import signal
import threading
import time

import pytest
import requests

from eagle3_ray.serve import app as serve
from eagle3_ray.serve.app import ServeConfig
from conftest import free_port

MODEL = "tiny-faults"
APP = "faults"
TIMEOUT_S = 3.0                            # ServeConfig.request_timeout_s of this deployment
LONG = 2000                                # max_tokens no request here reaches within TIMEOUT_S



@pytest.fixture(scope="module")
def server(ray_cluster, tiny_verifier):
    from ray import serve as ray_serve
    cfg = ServeConfig(verifier=tiny_verifier, drafter=None, model_name=MODEL, depth=0,
                      cpus_per_replica=0.5, max_ongoing_requests=1, max_queued_requests=1,
                      request_timeout_s=TIMEOUT_S, api_key=None, max_model_len=4096,
                      port=free_port(), torch_threads=1)
    url = serve.start(cfg, name=APP)
    yield url
    ray_serve.shutdown()


def post(url, body, stream=False, timeout=60):
    return requests.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0,
                                                        **body}, stream=stream, timeout=timeout)


def short(url):
    t0 = time.perf_counter()
    r = post(url, {"prompt": "Hello", "max_tokens": 4})
    return r, time.perf_counter() - t0


def replicas() -> list[dict]:
    """This app's replicas as Serve's controller reports them (replica_id, state, pid, ...)."""
    from ray.serve.context import _get_global_client
    apps = _get_global_client().get_serve_details()["applications"]
    deployments = apps[APP]["deployments"] if APP in apps else {}
    return [r for d in deployments.values() for r in d["replicas"]]


def running_replica(other_than: str | None = None, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in replicas():
            if r["state"] == "RUNNING" and r["replica_id"] != other_than:
                return r
        time.sleep(0.2)
    raise AssertionError(f"no RUNNING replica (other than {other_than}) after {timeout_s}s: "
                         f"{replicas()}")


def read_until_cut(resp, on_first):
    """Read an SSE stream; call on_first() after its first event. -> (events, error or None,
    seconds from on_first to the end of the stream)."""
    events, err, t_first = [], None, None
    try:
        for line in resp.iter_lines():
            if not line:
                continue
            events.append(line.decode())
            if t_first is None:
                t_first = time.perf_counter()
                on_first()
    except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError) as e:
        err = e
    return events, err, time.perf_counter() - (t_first or time.perf_counter())


def test_health_check_fails_while_the_decode_thread_is_wedged():
    """SpeculativeServer.check_health (Serve calls it every HEALTH_CHECK_PERIOD_S; its timeout,
    30 s, thrice in a row replaces the replica) waits for a no-op on the decode thread: it does
    not return while that thread is stuck, and returns once it is free. No Ray needed."""
    import asyncio
    import concurrent.futures
    import types
    check = serve.SpeculativeServer.func_or_class.check_health
    replica = types.SimpleNamespace(pool=concurrent.futures.ThreadPoolExecutor(1))
    stuck = threading.Event()
    replica.pool.submit(stuck.wait)                       # a round that never ends

    async def probe(timeout):
        try:
            await asyncio.wait_for(check(replica), timeout)
            return "healthy"
        except asyncio.TimeoutError:
            return "timed out"
    assert asyncio.run(probe(0.3)) == "timed out"
    stuck.set()
    assert asyncio.run(probe(5)) == "healthy"
    replica.pool.shutdown()
    assert serve.deployment_options(ServeConfig(cpus_per_replica=1))[
        "health_check_period_s"] == serve.HEALTH_CHECK_PERIOD_S == 2.0


def test_timeout_is_a_408_with_an_openai_body(server):
    """Past request_timeout_s the replica answers 408 itself (an OpenAI error body), just before
    the proxy would; a stream, whose 200 is already sent, ends with the error event and [DONE];
    a request still queued when the proxy's timeout strikes gets Ray's own 408 (plain text);
    the slot is free at once."""
    url = server
    t0 = time.perf_counter()
    r = post(url, {"prompt": "Count", "max_tokens": LONG})
    took = time.perf_counter() - t0
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout_error" and err["code"] == "request_timeout"
    assert err["message"].startswith(f"request timed out after {TIMEOUT_S:g}s")
    assert serve.app_timeout_s(TIMEOUT_S) <= took < TIMEOUT_S + 0.5, took

    t0 = time.perf_counter()
    with post(url, {"prompt": "Count", "max_tokens": LONG, "stream": True}, stream=True) as r:
        assert r.status_code == 200
        events = [ln.decode() for ln in r.iter_lines() if ln]
    took_stream = time.perf_counter() - t0
    assert events[-1] == "data: [DONE]" and len(events) > 3
    last = json.loads(events[-2][6:])
    assert last["error"]["code"] == "request_timeout", last
    assert took_stream < TIMEOUT_S + 0.5, took_stream

    results = {}

    def one(name):
        t = time.perf_counter()
        resp = post(url, {"prompt": "Count", "max_tokens": LONG})
        results[name] = (resp.status_code, resp.text, time.perf_counter() - t)
    first = threading.Thread(target=one, args=("running",))
    first.start()
    time.sleep(0.3)
    one("queued")                          # waits behind "running", then the proxy times it out
    first.join()
    assert results["running"][0] == 408 and json.loads(results["running"][1])["error"]
    code, text, took_queued = results["queued"]
    assert code == 408 and text.startswith("Request ") and \
        text.endswith(f"timed out after {TIMEOUT_S}s."), text   # Ray's proxy: plain text
    assert TIMEOUT_S <= took_queued < TIMEOUT_S + 1.0
    r, took_short = short(url)
    assert r.status_code == 200
    print(f"\n[faults] builtin 408: replica's after {took:.2f}s (stream {took_stream:.2f}s), "
          f"proxy's for a queued request after {took_queued:.2f}s; next request "
          f"{took_short:.2f}s")


def test_overload_gets_503_or_bounded_queueing_never_500(server):
    """One running + one queued (max_ongoing_requests 1, max_queued_requests 1): a burst of 5
    gets 200 for those two (the queued one served after the first) and 503 for the rest, at
    once; no 500, no hang."""
    url = server
    results = []

    def one():
        t = time.perf_counter()
        resp = post(url, {"prompt": "Count", "max_tokens": 48})
        results.append((resp.status_code, time.perf_counter() - t))
    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    codes = sorted(c for c, _ in results)
    assert set(codes) <= {200, 503} and codes.count(200) >= 2 and codes.count(503) >= 1, codes
    slowest_ok = max(s for c, s in results if c == 200)
    assert max(s for c, s in results if c == 503) < min(0.5, slowest_ok), results
    assert slowest_ok < TIMEOUT_S
    print(f"\n[faults] builtin burst of 5 at 1+1: {codes}, 503s within "
          f"{max(s for c, s in results if c == 503):.2f}s, slowest 200 {slowest_ok:.2f}s")


def test_disconnect_frees_the_slot_for_the_next_request(server):
    """A client that drops a long stream: Serve cancels it, and the next request (which would
    otherwise wait ~TIMEOUT_S behind it, the only slot) is served at its usual speed."""
    url = server
    base = min(short(url)[1] for _ in range(3))
    with post(url, {"prompt": "Go", "max_tokens": LONG, "stream": True}, stream=True) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
    r, took = short(url)
    assert r.status_code == 200
    assert took < base + 1.0, (took, base)       # behind the stream it would be >= ~2.5 s
    print(f"\n[faults] builtin disconnect: next request {took:.2f}s (alone {base:.2f}s)")


def test_replica_killed_mid_stream(server):
    """ray.kill of the replica actor while it streams: the client's stream breaks at once (a
    cut chunked response, no [DONE]: never a hang), Serve starts a new replica, and the next
    requests succeed."""
    import ray
    url = server
    old = running_replica()
    killed = {}

    def kill():
        killed["t"] = time.perf_counter()
        ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
    with post(url, {"prompt": "Count", "max_tokens": LONG, "stream": True}, stream=True) as r:
        assert r.status_code == 200
        events, err, to_error = read_until_cut(r, kill)
    assert "data: [DONE]" not in events and 1 <= len(events)
    assert isinstance(err, requests.exceptions.ChunkedEncodingError), (err, events[-3:])
    assert to_error < 5, to_error
    # sent at once: queued until the new replica is up, or the proxy's 408 within the timeout
    during, took_during = short(url)
    assert (during.status_code, during.status_code == 408 or took_during < TIMEOUT_S) in \
        ((200, True), (408, True)), (during.status_code, during.text, took_during)
    assert took_during < TIMEOUT_S + 1.0
    new = running_replica(other_than=old["replica_id"])
    to_replica = time.perf_counter() - killed["t"]
    r, took = short(url)
    assert r.status_code == 200, r.text
    assert all(short(url)[0].status_code == 200 for _ in range(2))
    print(f"\n[faults] builtin replica killed mid-stream: client error after {to_error:.2f}s "
          f"({type(err).__name__}), new replica {new['replica_id']} RUNNING after "
          f"{to_replica:.1f}s, next request {took:.2f}s; one sent at the cut: "
          f"{during.status_code} after {took_during:.2f}s")


def test_engine_process_killed_mid_request(server):
    """SIGKILL of the replica's process (the builtin engine's: what the OOM killer does) during
    a non-streaming request: the client gets a 500 from the proxy at once (Ray's, plain text:
    the request was lost with the process), Serve replaces the replica, the next requests
    succeed."""
    url = server
    old = running_replica()
    out = {}

    def one():
        resp = post(url, {"prompt": "Count", "max_tokens": LONG})
        out["r"], out["t"] = resp, time.perf_counter()
    th = threading.Thread(target=one)
    th.start()
    time.sleep(0.8)
    t_kill = time.perf_counter()
    os.kill(old["pid"], signal.SIGKILL)
    th.join(30)
    assert not th.is_alive()
    to_error = out["t"] - t_kill
    assert out["r"].status_code == 500, out["r"].text      # not a hang, not a 408 later
    assert to_error < 5, to_error
    new = running_replica(other_than=old["replica_id"])
    to_replica = time.perf_counter() - t_kill
    assert new["pid"] != old["pid"]
    r, took = short(url)
    assert r.status_code == 200, r.text
    print(f"\n[faults] builtin engine process SIGKILLed: client {out['r'].status_code} after "
          f"{to_error:.2f}s ({out['r'].text[:40]!r}), new replica RUNNING after "
          f"{to_replica:.1f}s, next request {took:.2f}s")
