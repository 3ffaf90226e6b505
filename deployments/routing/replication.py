"""Replicas per adapter by load: a hot adapter is preloaded onto more replicas, and dropped again when it cools.

Each replica decides for itself, from its own report and its peers' (the same reports routing ranks by:
deployments/routing/policy.py), so no process coordinates the replicas and a lost one decides nothing:
- **Preload.** An adapter is hot when every replica that holds it (device slot or CPU copy) runs
  `hot_adapter_requests` of its requests. The least loaded replica that does not hold it (ties broken by replica
  id, so that every replica picks the same one) fetches it into its CPU copy before any request asks for it there.
  Routing then ranks it with the holders, so the adapter's next requests spread without paying the adapter's
  fetch on their first token. One replica joins per report interval and adapter, while the adapter stays hot.
- **Release.** A replica drops an adapter it preloaded once none of its requests run there and the adapter's
  requests on all its holders would fit one holder fewer at half the hot level (the gap keeps an adapter at the
  edge from being dropped and preloaded again by turns). Routing then goes back to ranking the remaining holders
  first.
- **Scale-up.** When a hot adapter is held by every replica, spreading cannot go further: the replica says so to
  the autoscaling policy (`unspreadable`, deployments/replica/autoscaling.py), which adds a replica.

`hot_adapter_requests: null` in the routing config turns all of this off, and residence alone routes an
adapter's requests: its holders keep them however long their queues grow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from lora_cache.replica_report import AdapterTier, ReplicaReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSpread:
    """One adapter across the replicas: which hold it, and its requests on each. Routing's ranking
    (deployments/routing/policy.py) and replication read hot and warm from it alike."""
    adapter: str
    holders: tuple[ReplicaReport, ...]

    @classmethod
    def of(cls, adapter: str, reports: list[ReplicaReport], content_id: str | None = None) -> AdapterSpread:
        """Its holders among `reports`, of version `content_id` when the asker knows which it wants."""
        return cls(adapter, tuple(r for r in reports if r.tier(adapter, content_id) >= AdapterTier.CPU))

    def counts(self) -> list[int]:
        """Its requests on each holder."""
        return [r.adapter_requests.get(self.adapter, 0) for r in self.holders]

    def requests(self) -> int:
        return sum(self.counts())

    def hot(self, hot_requests: int) -> bool:
        """Every holder runs at least `hot_requests` of its requests: only another replica can take more."""
        counts = self.counts()
        return bool(counts) and min(counts) >= hot_requests

    def warm(self, hot_requests: int) -> bool:
        """Some holder runs at least `hot_requests` of its requests: its holders should share them."""
        return max(self.counts(), default=0) >= hot_requests

    def cool(self, hot_requests: int) -> bool:
        """Its requests would fit one holder fewer at half the hot level."""
        return len(self.holders) > 1 and self.requests() <= hot_requests * (len(self.holders) - 1) / 2

    def holds(self, replica: str) -> bool:
        return any(r.replica == replica for r in self.holders)


def adapters_named(reports: list[ReplicaReport]) -> set[str]:
    """Every adapter some replica holds or runs requests of."""
    return {name for r in reports for name in (*r.held(), *r.adapter_requests)}


def to_preload(own: ReplicaReport, peers: list[ReplicaReport], hot_requests: int) -> list[str]:
    """The hot adapters this replica should fetch now: it holds none of them, and is the least loaded replica
    that does not."""
    reports = [own, *peers]
    spreads = (AdapterSpread.of(name, reports) for name in sorted(adapters_named(reports)))
    return [s.adapter for s in spreads
            if s.hot(hot_requests) and not s.holds(own.replica) and _next_holder(s, reports) == own.replica]


def _next_holder(spread: AdapterSpread, reports: list[ReplicaReport]) -> str | None:
    others = [r for r in reports if not spread.holds(r.replica)]
    return min(others, key=lambda r: (r.load, r.replica)).replica if others else None


def to_release(own: ReplicaReport, peers: list[ReplicaReport], preloaded: set[str], hot_requests: int) -> list[str]:
    """The adapters this replica preloaded that it should drop now: none of their requests run here, and they
    have cooled across their holders."""
    reports = [own, *peers]
    return sorted(name for name in preloaded if not own.adapter_requests.get(name)
                  and AdapterSpread.of(name, reports).cool(hot_requests))


def unspreadable(own: ReplicaReport, peers: list[ReplicaReport], hot_requests: int) -> int:
    """How many adapters are hot on every replica, so that only another replica can spread them further."""
    reports = [own, *peers]
    spreads = (AdapterSpread.of(name, reports) for name in adapters_named(reports))
    return sum(1 for s in spreads if s.hot(hot_requests) and len(s.holders) == len(reports))


class Replicator:
    """One replica's side of replication: follows each report interval's reports, fetching and dropping
    adapters through the callables it is given (the replica's adapter cache and engine), by adapter name."""

    def __init__(self, hot_requests: int, fetch: Callable[[str], None], drop: Callable[[str], None]):
        self.hot_requests = hot_requests
        self._fetch, self._drop = fetch, drop
        self.preloaded: set[str] = set()  # adapters this replica fetched because they were hot elsewhere

    def follow(self, own: ReplicaReport, peers: list[ReplicaReport]) -> ReplicationSignals:
        """Preload what is hot elsewhere and release what has cooled; what the autoscaling policy should hear now.
        An adapter that fails to fetch (a bad one, or one unregistered meanwhile) is left to the requests that ask
        for it, which report why."""
        for name in to_preload(own, peers, self.hot_requests):
            if _tried(self._fetch, name, "preload"):
                self.preloaded.add(name)
        for name in to_release(own, peers, self.preloaded, self.hot_requests):
            _tried(self._drop, name, "release")
            self.preloaded.discard(name)
        return ReplicationSignals(unspreadable(own, peers, self.hot_requests), len(self.preloaded))


def _tried(action: Callable[[str], None], name: str, what: str) -> bool:
    try:
        action(name)
        return True
    except Exception:  # noqa: BLE001 - the report thread goes on; the adapter's own requests get the error
        log.warning("could not %s hot adapter %r", what, name, exc_info=True)
        return False


@dataclass(frozen=True)
class ReplicationSignals:
    """What a replica tells the autoscaling policy of replication (deployments/replica/autoscaling.py)."""
    unspreadable: int  # adapters hot on every replica: only another replica spreads them further
    preloaded: int  # adapters this replica holds because they were hot elsewhere: the replica is in use for them
