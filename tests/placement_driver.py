"""Driver for test_jobs.py's placement test, in a process of its own (it starts its own
simulated multi-node Ray cluster). Prints one line `PLACEMENT <json>`: where things ran.

    python tests/placement_driver.py <verifier dir> <conversations.json> <output dir>
"""
import json
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve as ray_serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from eagle3_ray.serve import app as serve  # noqa: E402
from eagle3_ray.train import online
from eagle3_ray.extract.pipeline import ExtractConfig, run_extract  # noqa: E402
from eagle3_ray.train.config import TrainConfig  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(spec: str, convs: str, out: str) -> None:
    dashboard = free_port()  # the state API (where did each actor run?) is served by it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_port": dashboard,
        "object_store_memory": 200 * 2**20})
    extract_nodes = [cluster.add_node(num_cpus=2, resources={"extract_node": 1},
                                      object_store_memory=200 * 2**20) for _ in range(2)]
    pcie = cluster.add_node(num_cpus=2, num_gpus=8, resources={"pcie_node": 1},
                            object_store_memory=200 * 2**20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        url = serve.start(serve.ServeConfig(verifier=spec, depth=0, cpus_per_replica=0.5,
                                            node_resource="pcie_node", port=free_port(),
                                            torch_threads=1), cluster.address)
        answer = requests.post(f"{url}/v1/completions", timeout=300, json={
            "model": "eagle3-ray", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
        manifest = run_extract(ExtractConfig(
            verifier=spec, inputs=[convs], output=out, replicas=2, cpus_per_replica=1,
            node_resource="extract_node", max_length=64, batch_rows=2, torch_threads=1,
            fault_injection="sleep:0.5"))  # slow batches: both replicas get work
        # online training: verifier replicas on the extract nodes, the trainer on the pcie node
        online.run_online(
            TrainConfig(dataset="", output=out + "-online", verifier=spec, max_steps=2,
                        batch_size=2, num_workers=1, cpus_per_worker=1, ttt_steps=1,
                        draft_vocab_size=1024, eval_every=0, node_resource="pcie_node"),
            ExtractConfig(verifier=spec, inputs=[convs], replicas=1, cpus_per_replica=1,
                          node_resource="extract_node", max_length=64, batch_rows=2,
                          torch_threads=1))
        actors = list_actors(address=f"http://127.0.0.1:{dashboard}", detail=True, limit=10_000)
        replicas = sorted({a.node_id for a in actors
                           if a.class_name.startswith("ServeReplica:") and a.state == "ALIVE"})
        extractors = sorted({a.node_id for a in actors
                             if "VerifierExtractor" in (a.repr_name or "")})
        trainers = sorted({a.node_id for a in actors if a.class_name == "RayTrainWorker"})
        print("PLACEMENT " + json.dumps({
            "pcie_node": pcie.node_id, "extract_nodes": [n.node_id for n in extract_nodes],
            "serve_replica_nodes": replicas, "extractor_nodes": extractors,
            "train_worker_nodes": trainers,
            "answer_tokens": answer["usage"]["completion_tokens"],
            "samples": manifest["summary"]["samples"],
            "actors": [(a.class_name, a.node_id, a.state) for a in actors
                       if a.class_name.startswith(("MapWorker", "ServeReplica"))]}), flush=True)
    finally:
        ray_serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
