"""Autoscaling of the builtin engine's deployment (serve/app.py, `ServeConfig.autoscaling` ->
Serve's autoscaling_config), for real: the tiny random verifier on the test Ray cluster
(2 CPUs), one request at a time per replica, min 1 / max 2 replicas, short delays. A sustained
queue (three clients in a loop) must add the second replica; an idle period must remove it;
every request meanwhile must succeed. What 2 cores allow: two replicas of a tiny verifier, not a
cluster of nodes (the autoscaler adding *nodes* is Ray's, checked by cluster/ configs only).
~30 s on 2 cores.

    .venv/bin/python -m pytest -q -s tests/serve/test_autoscale.py     # -s: the measured times
"""
import threading
import time

import pytest
import requests

from eagle3_ray.serve import app as serve
from eagle3_ray.serve.app import ServeConfig
from conftest import free_port

MODEL = "tiny-autoscale"
APP = "autoscale"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
               "metrics_interval_s": 0.5, "look_back_period_s": 1.0,
               "upscale_delay_s": 0.5, "downscale_delay_s": 2.0}


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_verifier):
    from ray import serve as ray_serve
    cfg = ServeConfig(verifier=tiny_verifier, drafter=None, model_name=MODEL, depth=0,
                      cpus_per_replica=0.5, autoscaling=AUTOSCALING, max_ongoing_requests=1,
                      max_queued_requests=32, request_timeout_s=60, api_key=None,
                      max_model_len=4096, port=free_port(), torch_threads=1)
    url = serve.start(cfg, name=APP)
    yield url
    ray_serve.shutdown()


def running() -> int:
    """RUNNING replicas of this app, as Serve's controller reports them."""
    from ray.serve.context import _get_global_client
    app = _get_global_client().get_serve_details()["applications"].get(APP)
    return sum(r["state"] == "RUNNING" for d in (app or {}).get("deployments", {}).values()
               for r in d["replicas"])


def wait_for(replicas: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while running() != replicas:
        assert time.monotonic() - t0 < timeout_s, f"{running()} RUNNING replicas, not {replicas}, " \
                                                 f"after {timeout_s}s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_sustained_queue_adds_a_replica_and_idle_removes_it(server):
    assert wait_for(1, 30) < 30                         # min_replicas at start
    stop, codes = threading.Event(), []

    def client():
        while not stop.is_set():
            r = requests.post(server + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "Tell me about rivers.", "max_tokens": 48,
                "temperature": 0})
            codes.append(r.status_code)
    clients = [threading.Thread(target=client) for _ in range(3)]
    for c in clients:
        c.start()
    try:
        up_s = wait_for(2, 60)                          # queue 3 / target 1 -> max_replicas
        served_before = len(codes)
        time.sleep(2.0)
        assert len(codes) > served_before               # both replicas keep serving
    finally:
        stop.set()
        for c in clients:
            c.join()
    down_s = wait_for(1, 60)                            # idle past downscale_delay_s
    print(f"\nautoscale: 2nd replica RUNNING {up_s:.1f}s into the load, removed {down_s:.1f}s "
          f"after it stopped; {len(codes)} requests")
    assert codes and set(codes) == {200}, codes         # no request lost to the scaling
    r = requests.post(server + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
