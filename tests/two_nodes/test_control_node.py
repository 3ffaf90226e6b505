"""The application's cluster-wide actors run on the head node (deployments/control_node.py), even when a replica on
a node that scale-up added creates them, so that such a node is idle, and released, once its replicas are gone; a
config may name another resource, or none."""

from __future__ import annotations

import pytest

from deployments.control_node import ControlPlacement
from tests.helpers import actor_node

pytestmark = pytest.mark.slow


def _created_on_a_worker(placement: ControlPlacement, suffix: str, root) -> tuple[str, str]:
    """The nodes of a cache actor and a quota ledger that a task on a worker node (where replicas run) created."""
    import ray

    from deployments.gate.ray_ledger import LEDGER_NAME, RayLedger
    from lora_cache.actor import ACTOR_NAME, get_or_create_cache_actor
    from lora_cache.source_config import SourceConfig

    @ray.remote(num_cpus=0, resources={"llm_node": 0.01})
    def create() -> str:
        get_or_create_cache_actor(SourceConfig(adapters_root=str(root)), f"{ACTOR_NAME}-{suffix}",
                                  placement.resources())
        RayLedger(suffix, placement)
        return ray.get_runtime_context().get_node_id()

    creator = ray.get(create.remote())
    try:
        nodes = actor_node(f"{ACTOR_NAME}-{suffix}"), actor_node(f"{LEDGER_NAME}:{suffix}")
    finally:
        for name in (f"{ACTOR_NAME}-{suffix}", f"{LEDGER_NAME}:{suffix}"):
            ray.kill(ray.get_actor(name))
    return creator, nodes


def test_a_replica_on_a_worker_node_creates_the_cluster_wide_actors_on_the_head(two_nodes, tmp_path):
    creator, nodes = _created_on_a_worker(ControlPlacement(), "head", tmp_path)
    assert creator in two_nodes.node_ids()
    assert set(nodes) == {two_nodes.cluster.head_node.node_id}


def test_a_named_resource_places_them_on_the_nodes_that_carry_it(two_nodes, tmp_path):
    _, nodes = _created_on_a_worker(ControlPlacement("llm_node"), "named", tmp_path)
    assert set(nodes) <= two_nodes.node_ids()
