"""cluster/: the launcher YAML passes Ray's own validation; the KubeRay manifests name the same
node groups, GPU/CPU counts, custom resources and image; every resource the jobs and the Serve
app request (computed by the real config code from the real command lines) exists in a node
type. No cluster is started: these are the files a team hands to `ray up` / `kubectl apply`."""
import argparse
import json
import os
import shlex

import pytest
import yaml

from eagle3_ray import cli
from eagle3_ray.serve import app as serve
from eagle3_ray.extract.pipeline import NODE_RESOURCE_SLIVER
from eagle3_ray.train.trainer import worker_resources

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "cluster")


def load(name):
    with open(os.path.join(CLUSTER, name)) as f:
        return yaml.safe_load(f)


def launcher():
    return load("ray-cluster.yaml")


def k8s_group_resources(group: dict) -> dict:
    """A KubeRay group's Ray resources: container limits + rayStartParams custom resources."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    out = {"CPU": int(limits["cpu"]), "GPU": int(limits.get("nvidia.com/gpu", 0))}
    custom = group["rayStartParams"].get("resources")
    if custom:
        out.update(json.loads(json.loads(custom)))  # '"{\"pcie_node\": 1}"' -> dict
    return out


def test_launcher_yaml_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config
    config = prepare_config(launcher())
    validate_config(config)
    types = config["available_node_types"]
    assert config["head_node_type"] == "head" and types["head"]["resources"]["CPU"] == 0
    assert types["pcie-serve"]["resources"] == {"CPU": 192, "GPU": 8, "pcie_node": 1}
    assert all(t.get("min_workers", 0) == 0 for t in types.values())   # GPUs only on demand


def test_kuberay_manifests_match_the_launcher():
    types = {k: v for k, v in launcher()["available_node_types"].items() if k != "head"}
    rc = load("kuberay/raycluster.yaml")
    assert rc["kind"] == "RayCluster" and rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(types)
    for name, g in groups.items():
        assert k8s_group_resources(g) == types[name]["resources"], name
        assert (g["minReplicas"], g["maxReplicas"]) == \
            (types[name]["min_workers"], types[name]["max_workers"]), name

    svc = load("kuberay/rayservice.yaml")
    svc_groups = {g["groupName"]: g for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(svc_groups) == {"pcie-serve"}
    assert k8s_group_resources(svc_groups["pcie-serve"]) == types["pcie-serve"]["resources"]
    assert svc_groups["pcie-serve"]["template"]["spec"]["nodeSelector"] == \
        groups["pcie-serve"]["template"]["spec"]["nodeSelector"]
    # the RayService runs exactly the app of cluster/serve.yaml
    inline, standalone = yaml.safe_load(svc["spec"]["serveConfigV2"]), load("serve.yaml")
    assert inline["http_options"] == standalone["http_options"]
    strip = [{k: v for k, v in a.items() if k != "runtime_env"} for a in standalone["applications"]]
    assert inline["applications"] == strip

    # one image everywhere, and it is the one cluster/Dockerfile builds
    images = {launcher()["docker"]["image"]}
    for name in ("raycluster.yaml", "rayservice.yaml"):
        text = open(os.path.join(CLUSTER, "kuberay", name)).read()
        images |= {line.split("image:")[1].strip() for line in text.splitlines()
                   if "image:" in line}
    assert len(images) == 1
    assert f"-t {images.pop()} ." in open(os.path.join(CLUSTER, "Dockerfile")).read()


def job_config(rayjob: str, add_args, make_config):
    entry = shlex.split(load(f"kuberay/{rayjob}")["spec"]["entrypoint"])
    assert entry[0] == "python" and entry[1].startswith("/home/ray/eagle3_ray/jobs/")
    p = argparse.ArgumentParser()
    add_args(p)
    return make_config(p.parse_args(entry[2:]))


def fits(request: dict, node: dict) -> bool:
    return all(node.get(k, 0) >= v for k, v in request.items() if v)


@pytest.mark.parametrize("what", ["extract", "train", "serve"])
def test_every_requested_resource_exists_in_a_node_type(what):
    types = launcher()["available_node_types"]
    if what == "extract":
        cfg = job_config("rayjob-extract.yaml", cli.add_extract_args, cli.extract_config)
        request = {"GPU": cfg.gpus_per_replica, "CPU": 0.25, cfg.node_resource:
                   NODE_RESOURCE_SLIVER}  # = extract.build_pipeline's VerifierExtractor
        total = cfg.replicas
    elif what == "train":
        cfg = job_config("rayjob-train.yaml", cli.add_train_args, cli.train_config)
        request, total = worker_resources(cfg), cfg.num_workers
        assert request["GPU"] == 1 and cfg.use_gpu
    else:
        args = load("serve.yaml")["applications"][0]["args"]
        actor = serve.deployment_options(serve.ServeConfig.from_dict(args))["ray_actor_options"]
        request = {"CPU": actor["num_cpus"], "GPU": actor["num_gpus"], **actor["resources"]}
        total = 1
    homes = [name for name, t in types.items() if fits(request, t["resources"])]
    assert len(homes) == 1, (what, request, homes)   # exactly one node type can host it
    home = types[homes[0]]
    per_node = min(home["resources"][k] // v for k, v in request.items()
                   if v >= 1) if any(v >= 1 for v in request.values()) else total
    assert per_node * home["max_workers"] >= total, (what, per_node, home["max_workers"])
