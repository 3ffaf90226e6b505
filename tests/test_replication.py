"""Replicas per adapter by load (deployments/routing/replication.py): which replica preloads a hot adapter, when it
drops it again, and what the autoscaling policy hears."""

from __future__ import annotations

import pytest

from deployments.routing.replication import Replicator, to_preload, to_release, unspreadable
from lora_cache.replica_report import AdapterVersion, ReplicaReport

HOT = 4


def report(name: str, holds: tuple[str, ...] = (), requests: dict[str, int] | None = None, running: int = 0,
           cpu_only: bool = False) -> ReplicaReport:
    versions = tuple(AdapterVersion(a) for a in holds)
    return ReplicaReport(name, device=() if cpu_only else versions, cpu=versions,
                         running=running, adapter_requests=requests or {})


def test_the_least_loaded_replica_without_a_hot_adapter_preloads_it():
    holder = report("r1", ("hot",), {"hot": HOT}, running=HOT)
    idle, busy = report("r2", running=1), report("r3", running=5)
    assert to_preload(idle, [holder, busy], HOT) == ["hot"]
    assert to_preload(busy, [holder, idle], HOT) == []  # the other one goes first
    assert to_preload(holder, [idle, busy], HOT) == []  # it holds it already


def test_ties_go_to_the_same_replica_on_every_side():
    holder = report("r1", ("hot",), {"hot": HOT})
    a, b = report("r2"), report("r3")
    assert to_preload(a, [holder, b], HOT) == ["hot"]
    assert to_preload(b, [holder, a], HOT) == []


def test_an_adapter_below_the_hot_level_on_some_holder_is_not_preloaded():
    busy = report("r1", ("hot",), {"hot": HOT})
    quiet = report("r2", ("hot",), {"hot": HOT - 1}, cpu_only=True)  # a CPU copy counts as holding it
    assert to_preload(report("r3"), [busy, quiet], HOT) == []


def test_a_preloaded_adapter_is_dropped_once_it_cools_and_none_of_its_requests_run_here():
    holder = report("r1", ("hot",), {"hot": 1})
    running_here = report("r2", ("hot",), {"hot": 1})
    assert to_release(running_here, [holder], {"hot"}, HOT) == []
    idle_here = report("r2", ("hot",))
    assert to_release(idle_here, [holder], {"hot"}, HOT) == ["hot"]
    assert to_release(idle_here, [holder], set(), HOT) == []  # one it did not preload stays


def test_a_preloaded_adapter_still_warm_across_its_holders_stays():
    holder = report("r1", ("hot",), {"hot": HOT // 2 + 1})  # more than one holder fewer takes at half the hot level
    assert to_release(report("r2", ("hot",)), [holder], {"hot"}, HOT) == []


def test_the_last_holder_never_drops_it():
    assert to_release(report("r1", ("hot",)), [report("r2")], {"hot"}, HOT) == []


def test_an_adapter_hot_on_every_replica_asks_for_another_replica():
    both = [report("r1", ("hot",), {"hot": HOT}), report("r2", ("hot",), {"hot": HOT + 3})]
    assert unspreadable(both[0], both[1:], HOT) == 1
    assert unspreadable(report("r1", ("hot",), {"hot": HOT}), [report("r2")], HOT) == 0  # it can spread to r2
    assert unspreadable(report("r1", ("hot",), {"hot": HOT}), [], HOT) == 1  # a lone replica cannot spread it


def test_the_replicator_preloads_then_releases_through_its_callables():
    fetched, dropped = [], []
    replicator = Replicator(HOT, fetched.append, dropped.append)
    own = report("r2")
    signals = replicator.follow(own, [report("r1", ("hot",), {"hot": HOT})])
    assert fetched == ["hot"] and replicator.preloaded == {"hot"}
    assert signals.preloaded == 1
    replicator.follow(report("r2", ("hot",)), [report("r1", ("hot",))])
    assert dropped == ["hot"] and replicator.preloaded == set()


def test_an_adapter_that_fails_to_fetch_is_not_counted_as_preloaded():
    def fetch(name: str) -> None:
        raise ValueError(f"adapter {name!r} is not a LoRA adapter")

    replicator = Replicator(HOT, fetch, lambda name: None)
    replicator.follow(report("r2"), [report("r1", ("hot",), {"hot": HOT})])
    assert replicator.preloaded == set()


@pytest.mark.parametrize("hot", [0, -1])
def test_a_routing_policy_refuses_a_hot_level_below_one(hot):
    from deployments.routing.policy import RoutingPolicy

    with pytest.raises(ValueError, match="hot_adapter_requests >= 1 or None"):
        RoutingPolicy(hot_adapter_requests=hot)
