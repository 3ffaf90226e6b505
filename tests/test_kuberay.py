"""deploy/kuberay/rayservice.yaml: its Serve config is configs/multi_node_gpu.yaml's, and the manifest is a valid
RayService of the KubeRay release whose CRD is kept in tests/data (v1.7.0's ray.io_rayservices.yaml, xz-packed).

The CRD's schema is checked as `kubectl apply --validate=strict` checks it: every field must be one the schema
names, unless the schema keeps unknown fields (x-kubernetes-preserve-unknown-fields), so a misspelt field fails
here rather than being dropped by the API server.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
CRD = Path(__file__).parent / "data" / "kuberay-v1.7.0-ray.io_rayservices.yaml.xz"


def _strict(schema: dict) -> dict:
    """The schema with every object closed to the fields it names (Kubernetes' strict field validation)."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(value) for value in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> dict:
    crd = yaml.safe_load(lzma.decompress(CRD.read_bytes()))
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(version["schema"]["openAPIV3Schema"])


def _manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _served(manifest: dict) -> dict:
    """The manifest's Serve config, parsed."""
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_serve_config_is_the_multi_node_config():
    assert _served(_manifest()) == yaml.safe_load((ROOT / "configs" / "multi_node_gpu.yaml").read_text())


def test_manifest_is_a_valid_rayservice(rayservice_schema):
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    jsonschema.validate(manifest, rayservice_schema)


def test_a_misspelt_field_is_refused(rayservice_schema):
    """The check can fail: a field the CRD does not name is an error, as the API server's strict validation makes
    it."""
    manifest = _manifest()
    manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 8
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(manifest, rayservice_schema)


def _groups(cluster: dict) -> dict[str, dict]:
    return {group["groupName"]: group for group in cluster["workerGroupSpecs"]}


def _resources(params: dict) -> dict:
    return yaml.safe_load(yaml.safe_load(params["resources"]))


def _engine(app: dict) -> dict:
    [llm] = [d for d in app["deployments"] if d["name"] == "LLMServer"]
    return llm


def _gpus(group: dict) -> int:
    [container] = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(group["rayStartParams"]["num-gpus"])
    return int(group["rayStartParams"]["num-gpus"])


def test_gpu_workers_carry_the_resource_the_engine_replicas_ask_for():
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    gpu = _groups(cluster)["gpu"]
    assert _resources(gpu["rayStartParams"]) == {"llm_node": 1}
    assert _resources(cluster["headGroupSpec"]["rayStartParams"]) == {"llm_node": 0}
    assert _gpus(gpu) == 1
    llm = _engine(_served(manifest)["applications"][0])
    assert llm["ray_actor_options"]["resources"] == {"llm_node": 1} and llm["ray_actor_options"]["num_gpus"] == 1
    assert gpu["maxReplicas"] == llm["autoscaling_config"]["max_replicas"]


def test_a_tensor_parallel_replica_has_a_node_of_its_gpus_that_one_gpu_replicas_cannot_take():
    """The 70B application's replica packs tensor_parallel_size one-GPU bundles on one node (STRICT_PACK): its
    group's nodes have that many GPUs, and no llm_node for the one-GPU replicas to land on."""
    manifest = _manifest()
    cluster = manifest["spec"]["rayClusterConfig"]
    app = _served(manifest)["applications"][1]
    group = _groups(cluster)["gpu-x4"]
    assert app["args"]["tensor_parallel"]["placement_strategy"] == "STRICT_PACK"
    assert _gpus(group) == app["args"]["engine"]["tensor_parallel_size"]
    assert _resources(group["rayStartParams"]) == {"llm_node": 0}
    assert group["maxReplicas"] == _engine(app)["autoscaling_config"]["max_replicas"]


def test_the_image_recipe_starts_the_config_the_manifest_serves():
    """deploy/Dockerfile cannot be built here (no Docker daemon, no GPU): what can be checked is that it starts from a
    CUDA build of PyTorch, installs this package without CI's CPU pin, and serves the config the manifest embeds."""
    recipe = (ROOT / "deploy" / "Dockerfile").read_text().splitlines()
    steps = [line for line in recipe if line and not line.startswith("#")]
    assert steps[0].startswith("FROM pytorch/pytorch:") and "cuda" in steps[0]
    assert any("pip install" in line and "-e ." in line and "constraints" not in line for line in steps)
    assert steps[-1] == 'CMD ["serve", "run", "configs/multi_node_gpu.yaml"]'
    assert (ROOT / "configs" / "multi_node_gpu.yaml").is_file()
