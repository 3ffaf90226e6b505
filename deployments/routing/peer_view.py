"""A replica's view of its peers, to decide whether to serve a request it parsed or to forward it.

Serve's HTTP proxy does not read request bodies, so it routes by load (and by the adapter header, when a client
sets it); the replica that receives a request knows its adapter and prompt. It ranks itself and its peers with
the router's ranking (deployments/routing/policy.py) and serves the request itself whenever it is among the best, which
saves the Ray hop per event that forwarding costs; otherwise it forwards the request to the best peer.

Peers' reports come from the cache actor once a report interval. A replica that forwards requests between two
reports counts those still in flight onto the peer's load, so a burst does not all go to the peer that looked idle
at the last report, while requests that have already ended do not push a holder out of the load band. Its own
load, and each adapter's requests, it counts as it goes (requests in flight here), so a flood for one adapter
spreads as soon as the holder runs `hot_adapter_requests` of them, not a report later.

A peer that Serve no longer routes to (`live`: stopping in a scale-down or a rolling update, while its last report
is still fresh) is not chosen: Serve's router would send the request back to this replica through Ray, a hop onto
itself whose stream on Ray 2.60 can fail to end under load.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

from deployments.routing.policy import RouteRequest, RoutingPolicy, rank, serve_replica_id
from lora_cache.replica_report import ReplicaReport


class PeerView:
    def __init__(self, policy: RoutingPolicy, live: Callable[[], frozenset[str] | None] = lambda: None):
        """live: the unique ids of the replicas Serve routes to now (None: not known yet, every peer counts)."""
        self.policy = policy
        self._live = live
        self._reports: list[ReplicaReport] = []
        self._sent: Counter[str] = Counter()  # requests forwarded to each peer since its last report, in flight
        self._counted: set[int] = set()  # the id()s of the forwards counted in _sent

    @property
    def has_peers(self) -> bool:
        return bool(self._reports)

    def held_by_peers(self) -> dict[str, list[str]]:
        """Each peer's adapters in its device slots or CPU copy, as this replica last heard: what it routes by."""
        return {r.replica: r.held() for r in self._reports}

    def update(self, reports: list[ReplicaReport] | None) -> None:
        """The peers' latest reports (None while the cache actor restarts: serve everything here until then)."""
        self._reports, self._sent, self._counted = list(reports or ()), Counter(), set()

    def choose(self, request: RouteRequest, own: ReplicaReport) -> RouteRequest | None:
        """None to serve the request here; else the request with the peer chosen for it as its target."""
        live, sent = self._live(), self._sent
        reports = [r for r in self._reports if live is None or serve_replica_id(r.replica) in live]
        if not reports:
            return None
        peers = [dataclasses.replace(r, waiting=r.waiting + sent[r.replica]) for r in reports]
        best = rank(request, [own] + peers, self.policy)[0]
        if any(r.replica == own.replica for r in best):
            return None
        choice = min(best, key=lambda r: r.load)
        sent[choice.replica] += 1
        route = dataclasses.replace(request, target=choice.replica, sender=own.replica)
        self._counted.add(id(route))
        return route

    def finished(self, route: RouteRequest) -> None:
        """A forwarded request ended: it leaves its peer's counted load (a report since counts it no more)."""
        if id(route) in self._counted:
            self._counted.discard(id(route))
            self._sent[route.target] -= 1
