"""A simulated two-node cluster (tests/two_nodes/conftest.py): one engine replica per node, both serving adapters
through the one cache actor."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

from engine import LLM, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, actor_node, replica_stats, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
ADAPTERS = ("alpha", "beta", "gamma", "delta")
ROUTED = "epsilon"  # requested by the routing test alone


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("multinode-adapters"), ADAPTERS + (ROUTED,))


@pytest.fixture(scope="module")
def server(two_nodes, tiny_llama_path, adapters_root):
    from deployments.replica.llm_server import LLMServer

    engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 4,
              "adapters_root": str(adapters_root)}
    llm = LLMServer.options(num_replicas=2, ray_actor_options={"num_cpus": 0.5, "resources": {"llm_node": 1}})
    with serving(two_nodes, llm.bind(engine)) as url:
        yield url


def test_replicas_on_two_nodes_serve_adapters_through_one_cache_actor(two_nodes, server, tiny_llama_path,
                                                                      adapters_root):
    import ray

    url, llm_nodes = server, two_nodes.node_ids()
    assert {s.node_id for s in replica_stats().values()} == llm_nodes  # one replica on each of the two nodes

    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=4, adapters_root=str(adapters_root),
              log_stats=False)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = {a: llm.generate([PROMPTS[3]], params, use_tqdm=False, adapters=[a])[0].token_ids for a in ADAPTERS}

    def ask(adapter):
        body = {"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 8, "details": True, "adapter_id": adapter}}
        r = requests.post(f"{url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return adapter, [t["id"] for t in r.json()["details"]["tokens"]]

    with ThreadPoolExecutor(8) as pool:  # new adapter ids go to the replica holding the fewest
        answers = list(pool.map(ask, [a for a in ADAPTERS for _ in range(3)]))
    assert all(tokens == expected[a] for a, tokens in answers)

    holders = {}  # adapter -> nodes whose replica fetched it
    for stats in replica_stats().values():
        for adapter, usage in stats.adapters.items():
            if usage.requests:
                holders.setdefault(adapter, set()).add(stats.node_id)
    assert set().union(*holders.values()) == llm_nodes  # both nodes served adapters
    cache = ray.get(ray.get_actor("lora-serve-adapter-cache").stats.remote())
    assert cache.load_counts == {a: 1 for a in ADAPTERS}  # each read from its source once, for both nodes
    assert actor_node("lora-serve-adapter-cache") == two_nodes.cluster.head_node.node_id  # not a replica's node


def test_an_adapter_that_one_replica_holds_is_served_by_that_replica(server):
    """The proxy picks replicas by load alone; a replica that gets a request for an adapter only the other one
    holds forwards it there."""
    import ray

    from deployments.replica.llm_server import REPORT_INTERVAL_S
    from lora_cache.actor import ACTOR_NAME

    url = server
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 4, "adapter_id": ROUTED}}
    assert requests.post(f"{url}/generate", json=body, timeout=120).status_code == 200
    actor = ray.get_actor(ACTOR_NAME)
    deadline = time.monotonic() + 30
    while not ((held := ray.get(actor.stats.remote()).residence().get(ROUTED)) and held.cpu_replicas):
        assert time.monotonic() < deadline, "the replica that fetched the adapter never reported it"
        time.sleep(0.5)
    deadline = time.monotonic() + 60  # the other replica hears of it at its next report, late on 2 busy cores
    while not all(r.knows for r in _replicas(ROUTED)):
        assert time.monotonic() < deadline, "a replica never heard which peer holds the adapter"
        time.sleep(REPORT_INTERVAL_S)
    before = _replicas(ROUTED)
    with ThreadPoolExecutor(3) as pool:  # 3 at a time: the proxy, routing by load, sends some to each replica
        codes = list(pool.map(lambda _: requests.post(f"{url}/generate", json=body, timeout=120).status_code,
                              range(12)))
    assert codes == [200] * 12
    after = {r.replica: r for r in _replicas(ROUTED)}
    assert [after[r.replica].served - r.served for r in before] == [0, 12], (before, after)
    # the replica without the adapter received some of the 12, and forwarded them
    assert after[before[0].replica].forwarded > before[0].forwarded, (before, after)


@dataclass
class _Replica:
    replica: str
    served: int  # the adapter's requests it ran
    knows: bool  # it holds the adapter, or has heard which peer does
    forwarded: int  # requests it forwarded to a peer, for any adapter


def _replicas(adapter: str) -> list[_Replica]:
    """Both replicas, the one that ran fewer of the adapter's requests first."""
    replicas = []
    for name, stats in replica_stats().items():
        served = stats.adapter_requests(adapter)
        heard = any(adapter in held for held in stats.peer_adapters.values())
        replicas.append(_Replica(name, served, served > 0 or heard, stats.forwarded))
    return sorted(replicas, key=lambda r: r.served)
