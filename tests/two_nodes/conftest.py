"""One simulated two-node cluster for the modules of this package, started once and shut down after the last of
them (a package-scoped fixture: this folder is a package so that pytest ends it there, before the modules on the
one-node cluster start Ray of their own). Starting three raylets and Serve costs about 20 s on 2 cores.

Each module deploys its app and deletes it (tests/helpers.py serving). test_faults removes a node, so it runs last:
modules run in the order of their names."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from engine.free_ports import free_port
from tests.helpers import ray_and_serve

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster


@dataclass(frozen=True)
class TwoNodes:
    url: str  # Serve's one HTTP proxy, on the head
    cluster: Cluster  # to remove a node from
    nodes: tuple  # the two worker nodes (ray's node handles), each with 1 CPU and the resource llm_node

    def node_ids(self) -> set[str]:
        return {node.node_id for node in self.nodes}


@pytest.fixture(scope="package")
def two_nodes(tmp_path_factory):
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    # Cluster records its address under Ray's default temp folder, whatever temp_dir says: on a machine where
    # no Ray ever ran, that folder does not exist yet.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": str(tmp_path_factory.mktemp("ray"))})
    nodes = [cluster.add_node(num_cpus=1, resources={"llm_node": 1}) for _ in range(2)]
    cluster.wait_for_nodes()
    port = free_port()
    # One proxy, on the head: on one machine every simulated node's proxy would listen on this port (SO_REUSEPORT),
    # and the kernel could hand a connection to the proxy of the node being removed, which a real client, holding
    # a live node's address, does not meet (a request sat 120 s unanswered there once)
    try:
        with ray_and_serve({"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port}},
                           address=cluster.address):
            yield TwoNodes(f"http://127.0.0.1:{port}", cluster, tuple(nodes))
    finally:
        cluster.shutdown()
