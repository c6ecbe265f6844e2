"""Launching on a real cluster: `ray job submit` to a real local head (`ray start --head` on
loopback), and placement on a simulated multi-node cluster (ray.cluster_utils.Cluster: several
raylets on this machine, one node carrying the PCIe resource and fake GPUs — a multi-node GPU
cluster cannot run here)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port, make_conversations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")



@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head of its own (process group, so teardown stops only it, not the test cluster)."""
    d = tmp_path_factory.mktemp("head")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    dash = free_port()
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={free_port()}", f"--dashboard-port={dash}",
         "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
         "--num-cpus=2", f"--temp-dir={d / 'ray'}", f"--ray-client-server-port={free_port()}",
         f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"],
        env=env, start_new_session=True, stdout=open(d / "head.log", "w"), stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while time.time() < deadline:
        r = subprocess.run([RAY, "job", "list", "--address", address], env=env,
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            break
        time.sleep(2)
    else:
        raise RuntimeError(f"head did not come up: {(d / 'head.log').read_text()[-2000:]}")
    yield address, env
    os.killpg(proc.pid, signal.SIGTERM)   # a graceful stop takes ~30 s on 2 cores: 10, then kill
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def submit(head, *args, timeout=600):
    """`ray job submit --working-dir <repo> -- python jobs/...`: waits, returns (ok, logs)."""
    address, env = head
    r = subprocess.run([RAY, "job", "submit", "--address", address, "--working-dir", ROOT,
                        "--", sys.executable, *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = r.stdout + r.stderr
    return "succeeded" in out and r.returncode == 0, out


def test_extract_then_train_with_ray_job_submit(head, tiny_verifier, tmp_path):
    convs = tmp_path / "convs.json"
    convs.write_text(json.dumps(make_conversations(24)))
    hs, run = tmp_path / "hs", tmp_path / "run"
    ok, logs = submit(head, "jobs/extract.py", "--inputs", str(convs), "--verifier", tiny_verifier,
                      "--output", str(hs), "--max-length", "64", "--batch-rows", "8")
    assert ok, logs[-3000:]
    manifest = json.loads((hs / "manifest.json").read_text())
    assert manifest["summary"]["samples"] == 24
    ok, logs = submit(head, "jobs/train.py", "--dataset", str(hs), "--output", str(run),
                      "--verifier", tiny_verifier, "--ttt-steps", "2", "--max-steps", "4",
                      "--draft-vocab-size", "2000", "--batch-size", "4", "--log-every", "2",
                      "--checkpoint-every", "4", "--eval-every", "0", "--cpus-per-worker", "0.5")
    assert ok, logs[-3000:]
    meta = json.loads((run / "drafter" / "meta.json").read_text())
    assert meta["steps"] == 4 and meta["ttt_steps"] == 2


def test_a_bad_input_path_fails_the_job_with_a_clear_message(head, tiny_verifier, tmp_path):
    missing = tmp_path / "nope.json"
    ok, logs = submit(head, "jobs/extract.py", "--inputs", str(missing), "--verifier",
                      tiny_verifier, "--output", str(tmp_path / "hs"))
    assert not ok
    assert f"eagle3-ray: error: input not found: {missing}" in logs
    assert not (tmp_path / "hs").exists()


def test_serve_replica_lands_on_the_pcie_node_and_extraction_on_the_others(tiny_verifier,
                                                                            tmp_path):
    """A fresh driver process (tests/placement_driver.py) builds the simulated cluster: a head,
    two 2-CPU `extract_node` nodes, one 8-(fake)-GPU node carrying `pcie_node`; the verifier
    replicas run on CPU (the fake GPUs are there for the placement only). Then an online
    training run places its verifier replica and its training worker independently."""
    convs = tmp_path / "convs.json"
    convs.write_text(json.dumps(make_conversations(12)))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "placement_driver.py"),
                        tiny_verifier, str(convs), str(tmp_path / "hs")],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ""})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("PLACEMENT "))
    got = json.loads(line[len("PLACEMENT "):])
    assert got["serve_replica_nodes"] == [got["pcie_node"]]
    assert got["answer_tokens"] > 0                              # it serves from there
    assert len(got["extractor_nodes"]) == 2, got                  # two replicas ...
    assert set(got["extractor_nodes"]) == set(got["extract_nodes"])   # ... one on each
    # online training: its extractor on the extract nodes (above), its worker on the pcie node
    assert got["train_worker_nodes"] == [got["pcie_node"]], got
    assert got["samples"] == 12


def test_local_ray_quiets_the_placement_group_cleaner():
    """A local Ray started by init_ray has no dashboard, so no State API: Ray Train's
    PlacementGroupCleaner would warn every second that it cannot ask it (~500 lines in a demo).
    Its workers drop those warnings; others' stay. A real local Ray in a process of its own."""
    code = (
        "import logging, ray\n"
        "from eagle3_ray.launch import init_ray\n"
        "init_ray(None, 1)\n"
        "from eagle3_ray import launch\n"
        "assert launch._LOCAL_RAY\n"
        "@ray.remote\n"
        "def levels():\n"
        "    g = logging.getLogger\n"
        "    return (g('ray.train.v2._internal.execution.controller.placement_group_cleaner')"
        ".getEffectiveLevel(), g('eagle3_ray.train.trainer').getEffectiveLevel())\n"
        "print(*ray.get(levels.remote()))\n")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    cleaner, ours = map(int, out.stdout.split()[-2:])
    assert cleaner == 40 and ours < 40                       # logging.ERROR; ours untouched
