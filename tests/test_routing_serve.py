"""Routing on a local cluster with two replicas of a tiny model behind Serve's HTTP proxy: an adapter's requests
go to the replica holding it in a device slot, a shared prompt prefix goes to the replica that cached it, a flood
for one adapter spreads over both, a hot adapter is preloaded onto the other replica and dropped when it cools, and a
replica that dies is routed around."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.helpers import PROMPTS, adapter_requests, replica_stats, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
ADAPTERS = ("alpha", "beta", "gamma", "delta")
HOT_ADAPTER_REQUESTS = 3
SETTLE_S = 2.5  # a replica's report reaches its peers within two report intervals


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.replica.llm_server import LLMServer
    from deployments.routing.policy import RoutingPolicy
    from deployments.routing.request_router import router_config

    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("routing-adapters"), ADAPTERS)
    # A wide load band: only the hot-adapter rule may spread an adapter that one replica holds.
    policy = RoutingPolicy(imbalance=100, hot_adapter_requests=HOT_ADAPTER_REQUESTS)
    engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 2,
              "adapters_root": str(root)}
    llm = LLMServer.options(num_replicas=2, ray_actor_options={"num_cpus": 1},
                            request_router_config=router_config(policy))
    with serving(serve_cluster, llm.bind(engine, routing=policy)) as url:
        yield url


def _generate(url: str, prompt: str, adapter: str | None = None, tokens: int = 4) -> None:
    parameters = {"max_new_tokens": tokens, "ignore_eos_token": True, **({"adapter_id": adapter} if adapter else {})}
    r = requests.post(f"{url}/generate", json={"inputs": prompt, "parameters": parameters}, timeout=120)
    assert r.status_code == 200, r.text


def test_adapter_requests_go_to_the_replica_holding_it_in_a_slot(server):
    _generate(server, PROMPTS[0], "alpha")
    time.sleep(SETTLE_S)
    [holder] = [r for r, s in replica_stats().items() if "alpha" in s.resident_adapters]
    for i in range(10):
        _generate(server, PROMPTS[i % len(PROMPTS)], "alpha")
    assert adapter_requests("alpha") == {r: 11 if r == holder else 0 for r in replica_stats()}
    _through_serve_router("alpha", 6)  # Serve's router alone, from the reports it collects
    assert adapter_requests("alpha") == {r: 17 if r == holder else 0 for r in replica_stats()}


def _through_serve_router(adapter: str, n: int) -> None:
    """Requests sent through a handle, as a replica forwards them but naming no replica: Serve's router
    (deployments/routing/request_router.py) places them by the reports alone."""
    from ray import serve

    from deployments.routing.policy import RouteRequest
    from engine import SamplingParams

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve").options(stream=True)
    for i in range(n):
        events = list(handle.forwarded.remote(RouteRequest(adapter), PROMPTS[i], SamplingParams(max_tokens=2), False))
        assert events[-1].final is not None


def test_a_forwarded_request_goes_to_another_replica_than_its_sender(server):
    """A request forwarded by the holder naming the holder (its chosen target stopped, a fresh report named it
    anyway) goes to the other replica, not back to its sender through Ray."""
    from ray import serve

    from deployments.routing.policy import RouteRequest
    from engine import SamplingParams

    _generate(server, PROMPTS[0], "alpha")
    time.sleep(SETTLE_S)
    [holder] = [r for r, s in replica_stats().items() if "alpha" in s.resident_adapters]
    before = adapter_requests("alpha")
    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve").options(stream=True)
    for i in range(4):
        route = RouteRequest("alpha", target=holder, sender=holder)
        events = list(handle.forwarded.remote(route, PROMPTS[i], SamplingParams(max_tokens=2), False))
        assert events[-1].final is not None
    after = adapter_requests("alpha")
    assert {r: after[r] - before[r] for r in after} == {r: 0 if r == holder else 4 for r in after}


def test_a_shared_prefix_goes_to_the_replica_that_cached_it(server):
    prefix = " ".join(PROMPTS) * 2  # well over ten 16-token blocks
    before = {r: s.prefix_cache for r, s in replica_stats().items()}
    _generate(server, prefix + " first")
    time.sleep(SETTLE_S)
    middle = {r: s.prefix_cache for r, s in replica_stats().items()}
    [cacher] = [r for r in middle if middle[r].queried_tokens > before[r].queried_tokens]
    for i in range(8):
        _generate(server, f"{prefix} question {i}")
    after = {r: s.prefix_cache for r, s in replica_stats().items()}
    other = next(r for r in after if r != cacher)
    assert after[other].queried_tokens == middle[other].queried_tokens  # nothing reached the other one
    assert after[cacher].hit_tokens - middle[cacher].hit_tokens >= 8 * 10 * 16


def test_a_flood_for_one_adapter_spreads_over_replicas(server):
    """The flood first spreads the adapter to the second replica, which takes part once it holds it; a second flood,
    on two holders, is shared by load."""
    _generate(server, PROMPTS[1], "beta")
    time.sleep(SETTLE_S)
    sent = _flood(server, "beta", seconds=4)
    spread = adapter_requests("beta")
    assert sum(spread.values()) == sent + 1
    assert min(spread.values()) > 0, spread  # without the hot-adapter rule the holder takes every request
    time.sleep(SETTLE_S)
    sent = _flood(server, "beta", seconds=6)
    served = adapter_requests("beta")
    assert sum(served.values()) - sum(spread.values()) == sent
    assert min(served[r] - spread[r] for r in served) >= sent // 5, (spread, served)


def _flood(url: str, adapter: str, seconds: float, clients: int = 8) -> int:
    """Requests for `adapter` from `clients` threads for `seconds`; how many were sent."""
    stop = threading.Event()

    def client(i: int) -> int:
        sent = 0
        while not stop.is_set():
            _generate(url, PROMPTS[(i + sent) % len(PROMPTS)], adapter, tokens=32)
            sent += 1
        return sent

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, i) for i in range(clients)]
        time.sleep(seconds)
        stop.set()
        return sum(f.result(timeout=120) for f in futures)


def test_a_hot_adapter_is_preloaded_onto_the_other_replica_and_dropped_when_it_cools(server):
    """Requests for delta, each forwarded to its holder (a target within the wide band), make it hot there: the other
    replica puts it in a device slot before serving any of them, and drops it once they are over."""
    _generate(server, PROMPTS[3], "delta")
    time.sleep(SETTLE_S)
    [holder] = [r for r, s in replica_stats().items() if "delta" in s.resident_adapters]
    stop = threading.Event()
    with ThreadPoolExecutor(8) as pool:
        clients = [pool.submit(_forward_until, "delta", holder, stop) for _ in range(8)]
        try:
            preloaded = _wait_for(lambda: _other_holding("delta", holder), timeout_s=15)
        finally:
            stop.set()
        assert all(f.result(timeout=120) > 0 for f in clients)
    assert preloaded is not None, "the other replica never preloaded the hot adapter"
    assert preloaded.preloaded == ["delta"] and preloaded.adapter_requests("delta") == 0
    released = _wait_for(lambda: _released("delta", holder), timeout_s=15)
    assert released is not None, f"the other replica still holds delta: {_other_holding('delta', holder)}"


def _forward_until(adapter: str, target: str, stop: threading.Event) -> int:
    """Requests for `adapter` sent to replica `target` through Serve's router until `stop`; how many."""
    from ray import serve

    from deployments.routing.policy import RouteRequest
    from engine import SamplingParams

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve").options(stream=True)
    sent = 0
    while not stop.is_set():
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        events = list(handle.forwarded.remote(RouteRequest(adapter, target=target), PROMPTS[sent % 4], params, False))
        assert events[-1].final is not None
        sent += 1
    return sent


def _other_stats(holder: str):
    """The stats of the replica other than `holder` (under the flood the handle's router picks the idle one)."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve")
    for _ in range(40):
        stats = handle.stats.remote().result(timeout_s=30)
        if stats.replica != holder:
            return stats
    raise AssertionError(f"the handle reached only {holder}")


def _other_holding(adapter: str, holder: str):
    """The other replica's stats when it holds `adapter` in a device slot, else None."""
    other = _other_stats(holder)
    return other if adapter in other.resident_adapters else None


def _released(adapter: str, holder: str):
    other = _other_stats(holder)
    return other if adapter not in other.resident_adapters and not other.preloaded else None


def _wait_for(found, timeout_s: float):
    """found()'s first answer other than None within timeout_s, polled every half second; None if none came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = found()
        if answer is not None:
            return answer
        time.sleep(0.5)
    return None


def test_a_replica_that_dies_is_routed_around(server):
    import ray

    _generate(server, PROMPTS[2], "gamma")
    time.sleep(SETTLE_S)
    [holder] = [r for r, s in replica_stats().items() if "gamma" in s.resident_adapters]
    [actor] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if "LLMServer" in a["name"] and holder.split("@")[0] in a["name"]]
    ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
    start = time.monotonic()
    for i in range(6):  # its peer still holds the dead replica's report, which named gamma
        _generate(server, PROMPTS[i % len(PROMPTS)], "gamma")
    assert time.monotonic() - start < 60
