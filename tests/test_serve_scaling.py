"""Ray Serve on a local cluster: the custom policy scales the engine 1 -> 2 -> 1, and a killed replica comes back."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
APP = "scaling"


def _running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments["LLMServer"]
    return deployment.replica_states.get("RUNNING", 0)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.replica.llm_server import LLMServer

    adapters = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("scaling-adapters"), ("warm",))
    engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 2,
              "adapters_root": str(adapters), "adapter_disk_cache": str(tmp_path_factory.mktemp("disk-tier")),
              "preload_adapters": ["warm"]}
    autoscaling = {"min_replicas": 1, "max_replicas": 2, "metrics_interval_s": 0.5, "look_back_period_s": 1,
                   "upscale_delay_s": 1, "downscale_delay_s": 4,
                   "policy": {"policy_function": "deployments.replica.autoscaling:EngineLoadPolicy",
                              "policy_kwargs": {"target_running_per_replica": 2}}}
    llm = LLMServer.options(autoscaling_config=autoscaling, ray_actor_options={"num_cpus": 1},
                            health_check_period_s=1, health_check_timeout_s=10)
    with serving(serve_cluster, llm.bind(engine), APP) as url:
        yield url


def _replica_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP).stats.remote().result()


def _new_replica_holds_preloaded_adapter(first: str, adapter: str) -> None:
    """The replica that scale-up added (Serve's router prefers it: the first one is busy) holds the adapter in a
    device slot, though no request asked for it."""
    seen = {}
    for _ in range(30):
        stats = _replica_stats()
        seen[stats.replica] = stats.adapters.get(adapter)
    added = [usage for replica, usage in seen.items() if replica != first]
    assert added and added[0].residence == "device" and added[0].requests == 0, seen


def _load(url: str, stop: threading.Event, workers: int = 6) -> list[int]:
    """Keep `workers` long requests in flight until stop is set; the HTTP statuses of all of them."""
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 200, "ignore_eos_token": True}}

    def worker(_):
        statuses = []
        while not stop.is_set():
            try:
                statuses.append(requests.post(f"{url}/generate", json=body, timeout=120).status_code)
            except requests.RequestException:
                statuses.append(-1)  # the connection broke (its replica was killed): an answer, not a hang
        return statuses

    with ThreadPoolExecutor(workers) as pool:
        return [s for per in pool.map(worker, range(workers)) for s in per]


def test_queue_depth_scales_the_engine_up_and_idleness_back_down(server):
    assert _running_replicas() == 1
    first = _replica_stats().replica
    stop = threading.Event()
    loader = threading.Thread(target=lambda: _load(server, stop))
    loader.start()
    try:
        _wait_for(lambda: _running_replicas() == 2, 90, "scale-up to 2 replicas under load")
        _new_replica_holds_preloaded_adapter(first, "warm")
    finally:
        stop.set()
        loader.join()
    _wait_for(lambda: _running_replicas() == 1, 90, "scale-down to 1 replica when idle")


def test_killed_replica_is_replaced_and_no_request_hangs(server):
    import ray

    stop, statuses = threading.Event(), []
    loader = threading.Thread(target=lambda: statuses.extend(_load(server, stop, workers=3)))
    loader.start()
    time.sleep(2)
    [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if f"{APP}#LLMServer" in a["name"]][:1]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    time.sleep(3)
    stop.set()
    loader.join(timeout=180)
    assert not loader.is_alive(), "a request hung"
    assert 200 in statuses  # requests were answered around the kill
    _wait_for(lambda: _running_replicas() >= 1, 90, "a replacement replica")
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 5}}
    _wait_for(lambda: requests.post(f"{server}/generate", json=body, timeout=60).status_code == 200, 90,
              "a successful request after recovery")
