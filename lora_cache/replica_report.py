"""What one engine replica tells the cluster about itself, for routing: where each adapter resides there, what
its prefix cache holds, and how loaded it is.

A replica sends its report to the cache actor every report interval (lora_cache/actor.py), which answers with
the other live replicas' reports, and hands the same report to Ray Serve's routers through
`record_routing_stats`. The cache actor is the cluster's directory of replicas because it already was the
directory of adapters: both routing decisions, the router's and a replica's own (deployments/routing/policy.py), read
these reports.

Across processes an adapter is known by one identity, `AdapterVersion`: the name clients ask for, and the content id
of the weights served under it. A replica's keys ("name#generation", lora_cache/registry.py) tell its engine and
caches apart a reloaded adapter's old and new weights; they stay inside the replica, so a router that reads only
a request's body (`model`, `adapter_id`) finds the holder of an adapter loaded at run time as it finds one of the
adapters root's. A replica reports only its adapters' current versions: the old weights a reload left running in
a slot hold no requests that routing could send there.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class AdapterTier(IntEnum):
    """Where an adapter resides for a replica, the higher the fewer copies before a request can start."""
    COLD = 0  # not in the object store of the replica's node: read from its source or from another node
    OBJECT_STORE = 1  # in the object store of the replica's node (the cache actor's): one read from shared memory
    CPU = 2  # in the replica's CPU copy: one copy into a device slot
    SLOT = 3  # in a device slot now


@dataclass(frozen=True)
class AdapterVersion:
    """An adapter as every process routes it: its name, and the content id of its weights (lora_cache/adapter.py
    content_id; empty where the reporter does not know it)."""
    name: str
    content_id: str = ""

    def matches(self, name: str, content_id: str | None) -> bool:
        """Whether this is adapter `name`, in version `content_id` when the asker knows which it wants."""
        return self.name == name and (content_id is None or self.content_id == content_id)


def _holds(versions: Collection[AdapterVersion], name: str, content_id: str | None) -> bool:
    return any(v.matches(name, content_id) for v in versions)


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # the replica's unique id in its deployment (Serve's replica_id.unique_id)
    device: tuple[AdapterVersion, ...] = ()  # in device slots
    cpu: tuple[AdapterVersion, ...] = ()  # in the replica's CPU copy
    node_store: frozenset[AdapterVersion] = frozenset()  # in the object store on the replica's node
    prefix_digests: frozenset[int] = frozenset()  # engine/block_manager.py cached_digests
    running: int = 0
    waiting: int = 0
    kv_utilisation: float = 0.0
    adapter_requests: dict[str, int] = field(default_factory=dict)  # adapter name -> its requests in flight here
    reported_at: float = 0.0  # monotonic seconds on the cache actor, set when it stores the report

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def tier(self, adapter: str | None, content_id: str | None = None) -> AdapterTier:
        """Where adapter `adapter` (a name; None: the base model) resides here, in version content_id if given."""
        if adapter is None or _holds(self.device, adapter, content_id):
            return AdapterTier.SLOT
        if _holds(self.cpu, adapter, content_id):
            return AdapterTier.CPU
        return AdapterTier.OBJECT_STORE if _holds(self.node_store, adapter, content_id) else AdapterTier.COLD

    def held(self) -> list[str]:
        """The names of the adapters in its device slots or CPU copy."""
        return sorted({v.name for v in self.device + self.cpu})

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
    """The cache actor's answer to a report: the other live replicas' reports, and the adapters in the object store
    of the actor's node."""
    peers: list[ReplicaReport]
    stored: frozenset[AdapterVersion]
    store_node: str  # the cache actor's node id

    def node_store(self, node_id: str) -> frozenset[AdapterVersion]:
        """The adapters in the object store on node `node_id`, as far as routing counts them."""
        return self.stored if node_id == self.store_node else frozenset()
