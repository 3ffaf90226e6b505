"""serve_config.yaml, the tensor-parallel and the multi-node examples, as `serve run` reads them: valid for Ray
Serve, and every lora-serve option in them known."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import AppArgs, build_app
from deployments.replica.autoscaling import EngineLoadPolicy
from engine import EngineConfig

ROOT = Path(__file__).parent.parent
CONFIGS = [ROOT / "serve_config.yaml", ROOT / "configs" / "multi_node_gpu.yaml", ROOT / "configs" / "tp_cpu.yaml"]


def _validated(path: Path) -> ServeDeploySchema:
    """A serve config as Ray Serve reads it, whose applications' engine args and autoscaling policies lora-serve
    accepts. Each application's one deployment is the engine replica, which serves the HTTP routes too."""
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app in config.applications:
        EngineConfig.from_overrides(**AppArgs(**app.args).engine)
        [engine] = app.deployments
        assert engine.name == "LLMServer"
        if isinstance(engine.autoscaling_config, dict):  # unset: Serve's DEFAULT sentinel
            EngineLoadPolicy(**engine.autoscaling_config["policy"]["policy_kwargs"])
    return config


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_serve_configs_are_valid_and_name_only_known_options(path):
    _validated(path)


def test_serve_config_slows_the_serve_controller_loop():
    config = _validated(CONFIGS[0])
    assert float(config.controller_options.runtime_env["env_vars"]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]) > 0


def test_serve_config_gives_each_engine_replica_its_own_port():
    env = _validated(CONFIGS[0]).controller_options.runtime_env["env_vars"]
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]) < int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])


def test_serve_config_puts_haproxy_on_port_8000_routing_on_the_body():
    """HAProxy asks the ingress request router for a replica, with the body, which names the adapter."""
    env = _validated(CONFIGS[0]).controller_options.runtime_env["env_vars"]
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"
    assert int(env["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE"]) >= 64 << 10


def test_tp_cpu_places_one_bundle_per_worker_packed_on_one_node():
    """The embedded SmolLM2 splits its 3 KV heads over 3 workers, and their bundles fit a 2-core machine."""
    args = AppArgs(**_validated(CONFIGS[2]).applications[0].args)
    size = EngineConfig.from_overrides(**args.engine).backend.tensor_parallel_size
    placement = args.tensor_parallel.options(size)
    assert size == 3 and placement["placement_group_strategy"] == "STRICT_PACK"
    assert len(placement["placement_group_bundles"]) == size
    assert sum(bundle["CPU"] for bundle in placement["placement_group_bundles"]) <= 2


def test_a_single_worker_takes_no_placement_group():
    assert AppArgs().tensor_parallel.options(1) == {}


def test_unknown_tensor_parallel_options_are_refused_by_name(tiny_llama_path):
    with pytest.raises(ValueError, match="tensor_parallel.workers: Extra inputs are not permitted"):
        build_app({"engine": {"model": str(tiny_llama_path), "tensor_parallel_size": 2},
                   "tensor_parallel": {"workers": 2}})


def test_multi_node_gpu_spans_a_replica_over_four_gpus_of_one_node():
    """The 70B application: a bundle of CPUs and one GPU per worker, packed on one node, and the replica (rank 0)
    fits its bundle; its KV heads divide by 4."""
    [_, app] = _validated(CONFIGS[1]).applications
    args = AppArgs(**app.args)
    engine = EngineConfig.from_overrides(**args.engine)
    placement = args.tensor_parallel.options(engine.backend.tensor_parallel_size, engine.backend.device)
    assert placement["placement_group_bundles"] == [{"CPU": 4, "GPU": 1}] * 4
    assert placement["placement_group_strategy"] == "STRICT_PACK"
    assert not isinstance(app.deployments[0].ray_actor_options, dict)  # unset: build_app's, bundle 0's resources


def test_gpu_workers_are_given_a_gpu_each_and_cpu_workers_none():
    args = AppArgs(tensor_parallel={"worker_cpus": 2})
    assert args.tensor_parallel.options(2, "cuda")["placement_group_bundles"] == [{"CPU": 2, "GPU": 1}] * 2
    assert args.tensor_parallel.options(2, "cpu")["placement_group_bundles"] == [{"CPU": 2}] * 2


def test_more_gpu_workers_than_any_node_has_are_refused_at_start(serve_cluster, tiny_llama_path):
    """The shared cluster's one node has no GPU: two CUDA workers packed on it are refused by build_app, naming
    both numbers, rather than left pending."""
    with pytest.raises(ValueError, match="tensor_parallel_size 2 packs 2 GPUs on one node; the cluster's largest "
                                         "node has 0"):
        build_app({"engine": {"model": str(tiny_llama_path), "device": "cuda", "tensor_parallel_size": 2}})


def test_replica_resources_add_to_build_apps_options_and_every_worker_bundle():
    one = build_app({"engine": {"model": "m"}, "replica_resources": {"llm_node": 1}})._bound_deployment
    assert one.ray_actor_options["resources"] == {"llm_node": 1}
    assert one.ray_actor_options["num_cpus"] == 1  # and its runtime_env kept:
    assert "GLIBC_TUNABLES" in one.ray_actor_options["runtime_env"]["env_vars"]
    tp = build_app({"engine": {"model": "m", "tensor_parallel_size": 2}, "replica_resources": {"llm_node": 1}})
    assert tp._bound_deployment._replica_config.placement_group_bundles == [{"CPU": 1, "llm_node": 1}] * 2
