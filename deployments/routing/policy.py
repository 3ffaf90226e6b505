"""Which replica serves a request: adapter residence first, then the cached prompt prefix, within a load band.

Every replica whose load (running plus waiting requests) is within `imbalance` of the least loaded one, and
whose KV cache is less than `kv_high` full, is ranked by
1. the tier of the request's adapter there: device slot, then CPU copy, then the object store of the replica's node
   (the cache actor's node, where the adapter's primary copy lives), then cold;
2. the leading prompt blocks its prefix cache holds (digests the engine reports: engine/block_manager.py).
Replicas equal on both form one rank. Ray's router probes the queue lengths of a rank and takes the shortest;
a rank of more than two replicas is cut to two at random first (power of two choices), which is also all that
is left when a request says nothing of adapter or prompt. The other replicas come last, least loaded first:
residence and a cached prefix save a copy and a prefill, never a long queue or a preemption for KV space.

A hot adapter spreads: once every replica that holds it runs `hot_adapter_requests` of its requests, residence
stops counting for it, so prefix and load choose, and the replica chosen fetches the adapter too. Replicas also
preload a hot adapter ahead of its requests and drop it when it cools (deployments/routing/replication.py); while
some holder runs `hot_adapter_requests` of them, its holders rank alike, whatever their tier and cached prefix, so
load spreads it over them. `hot_adapter_requests: None` turns all of this off: residence alone routes an adapter's
requests.

The same ranking serves Ray's router (deployments/routing/request_router.py: the HTTP proxy, and a replica's handle
to its peers) and a replica deciding whether to serve a request it parsed or to forward it
(deployments/replica/llm_server.py); they differ only in what they know of the request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deployments.routing.replication import AdapterSpread
from lora_cache.replica_report import AdapterTier, ReplicaReport


@dataclass(frozen=True)
class RouteRequest:
    """What routing knows of a request."""
    adapter: str | None = None  # the adapter's name, None for the base model
    content_id: str | None = None  # the version of it wanted, when the asker knows (lora_cache/replica_report.py)
    prompt_digests: tuple[int, ...] = ()  # engine/block_manager.py prompt_digests, empty when not tokenized
    target: str | None = None  # the replica a forwarding replica chose; the router sends it there if it can
    sender: str | None = None  # the replica that forwarded it; the router sends it elsewhere while it can
    unreserved: bool = False  # chosen without reserving a slot (HAProxy's ingress router): Serve's queue-length cache
    # then goes stale, so the router orders a rank at random itself (request_router.py: probe_order)


def serve_replica_id(replica: str) -> str:
    """The Serve unique id a replica's name starts with (deployments/replica/llm_server.py names it id@node)."""
    return replica.partition("@")[0]


@dataclass(frozen=True)
class RoutingPolicy:
    imbalance: int = 8  # requests more than the least loaded replica's that residence and prefix may outweigh
    hot_adapter_requests: int | None = 16  # an adapter's requests on each holder past which it spreads; None: never
    kv_high: float = 0.9  # a replica whose KV cache is this full ranks last, with the overloaded ones

    def __post_init__(self):
        hot = self.hot_adapter_requests
        if self.imbalance < 0 or (hot is not None and hot < 1) or not 0 < self.kv_high <= 1:
            raise ValueError(f"routing policy: imbalance must be >= 0, hot_adapter_requests >= 1 or None and "
                             f"kv_high in (0, 1], got {self.imbalance}, {self.hot_adapter_requests} and {self.kv_high}")


def rank(request: RouteRequest, reports: list[ReplicaReport], policy: RoutingPolicy) -> list[list[ReplicaReport]]:
    """The replicas in ranks, best first (see the module docstring); a target replica, when given and within
    the band, is a rank of its own at the front."""
    if not reports:
        return []
    floor = min(r.load for r in reports)
    fits = [r.load <= floor + policy.imbalance and r.kv_utilisation < policy.kv_high for r in reports]
    near = [r for r, fit in zip(reports, fits) if fit]
    far = sorted((r for r, fit in zip(reports, fits) if not fit), key=lambda r: (r.load, r.kv_utilisation))
    target = [r for r in near if r.replica == request.target]
    if target:
        return [target] + _ranks(request, [r for r in near if r is not target[0]], policy) + [[r] for r in far]
    return _ranks(request, near, policy) + [[r] for r in far]


def _tier(report: ReplicaReport, request: RouteRequest) -> AdapterTier:
    return report.tier(request.adapter, request.content_id)


def _ranks(request: RouteRequest, reports: list[ReplicaReport], policy: RoutingPolicy) -> list[list[ReplicaReport]]:
    """Hot on every holder: residence stops counting. Hot on some holder: its holders rank alike, whatever their
    tier and cached prefix, so load spreads it over them (a replica that preloaded it among them)."""
    level = policy.hot_adapter_requests if request.adapter is not None else None  # the base model never spreads
    spread = AdapterSpread.of(request.adapter, reports, request.content_id) if level is not None else None
    hot, warm = (spread.hot(level), spread.warm(level)) if spread is not None else (False, False)
    groups: dict[tuple[int, int], list[ReplicaReport]] = {}
    for r in reports:
        tier = AdapterTier.COLD if hot else _tier(r, request)
        held_alike = warm and tier >= AdapterTier.CPU
        key = (-AdapterTier.SLOT, 0) if held_alike else (-tier, -r.cached_blocks(request.prompt_digests))
        groups.setdefault(key, []).append(r)
    return [_two_at_random(groups[score]) for score in sorted(groups)]


def _two_at_random(replicas: list[ReplicaReport]) -> list[ReplicaReport]:
    return random.sample(replicas, 2) if len(replicas) > 2 else replicas
