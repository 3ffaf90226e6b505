"""What one engine replica tells the cluster about itself, for routing: where each adapter resides there, what
its prefix cache holds, and how loaded it is.

A replica sends its report to the cache actor every report interval (lora_cache/actor.py), which answers with
the other live replicas' reports, and hands the same report to Ray Serve's routers through
`record_routing_stats`. The cache actor is the cluster's directory of replicas because it already was the
directory of adapters: both routing decisions, the router's and a replica's own (deployments/routing.py), read
these reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class AdapterTier(IntEnum):
    """Where an adapter resides for a replica, the higher the fewer copies before a request can start."""
    COLD = 0  # not in the object store of the replica's node: read from its source or from another node
    OBJECT_STORE = 1  # in the object store of the replica's node (the cache actor's): one read from shared memory
    CPU = 2  # in the replica's CPU copy: one copy into a device slot
    SLOT = 3  # in a device slot now


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # the replica's unique id in its deployment (Serve's replica_id.unique_id)
    device: tuple[str, ...] = ()  # adapter keys in device slots
    cpu: tuple[str, ...] = ()  # adapter keys in the replica's CPU copy
    node_store: frozenset[str] = frozenset()  # adapter keys in the object store on the replica's node
    prefix_digests: frozenset[int] = frozenset()  # engine/block_manager.py cached_digests
    running: int = 0
    waiting: int = 0
    kv_utilisation: float = 0.0
    adapter_requests: dict[str, int] = field(default_factory=dict)  # adapter key -> its requests in flight here
    reported_at: float = 0.0  # monotonic seconds on the cache actor, set when it stores the report

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def tier(self, adapter: str | None) -> AdapterTier:
        if adapter is None or adapter in self.device:
            return AdapterTier.SLOT
        if adapter in self.cpu:
            return AdapterTier.CPU
        return AdapterTier.OBJECT_STORE if adapter in self.node_store else AdapterTier.COLD

    def cached_blocks(self, digests: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these digests this replica's prefix cache holds."""
        count = 0
        for digest in digests:
            if digest not in self.prefix_digests:
                break
            count += 1
        return count


@dataclass(frozen=True)
class ClusterView:
    """The cache actor's answer to a report: the other live replicas' reports, and the adapter keys in the object
    store of the actor's node."""
    peers: list[ReplicaReport]
    stored: frozenset[str]
    store_node: str  # the cache actor's node id

    def node_store(self, node_id: str) -> frozenset[str]:
        """The adapters in the object store on node `node_id`, as far as routing counts them."""
        return self.stored if node_id == self.store_node else frozenset()
