"""The engine autoscaling policy's decisions, and the bounded adapter labels of the metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.gate.tenant_metrics import TopLabels
from deployments.replica.autoscaling import EngineLoad, EngineLoadPolicy, desired_replicas
from deployments.replica.metrics import BASE

TARGETS = dict(target_running_per_replica=8, kv_high=0.85, kv_low=0.5)


@pytest.mark.parametrize("current, load, expected", [
    (1, EngineLoad(running=8, waiting=0, kv_utilisation=0.3), 1),  # one full batch: enough
    (1, EngineLoad(running=8, waiting=9, kv_utilisation=0.3), 3),  # the queue grows: scale up to cover it
    (1, EngineLoad(running=3, waiting=0, kv_utilisation=0.9), 2),  # KV memory runs high: one more
    (3, EngineLoad(running=4, waiting=0, kv_utilisation=0.7), 3),  # fewer requests, KV still busy: hold
    (3, EngineLoad(running=4, waiting=0, kv_utilisation=0.2), 1),  # fewer requests and KV low: scale down
    (2, EngineLoad(running=0, waiting=0, kv_utilisation=0.0), 0),  # idle: Serve raises it to min_replicas
    (2, EngineLoad(running=8, waiting=0, kv_utilisation=0.2, unspreadable=1), 3),  # hot on every replica: one more
    (3, EngineLoad(running=4, waiting=0, kv_utilisation=0.2, preloaded=1), 3),  # a replicated adapter warm: hold
])
def test_desired_replicas(current, load, expected):
    assert desired_replicas(current, load, **TARGETS) == expected


def test_policy_reads_serve_context():
    policy = EngineLoadPolicy(**TARGETS)
    ctx = SimpleNamespace(current_num_replicas=2, total_num_requests=30.0, total_queued_requests=4.0,
                          aggregated_metrics={"running": {"r1": 8.0, "r2": 8.0}, "waiting": {"r1": 5.0, "r2": 0.0},
                                              "kv_utilisation": {"r1": 0.4, "r2": 0.6}})
    desired, state = policy(ctx)
    assert desired == 4  # (16 running + 5 waiting + 4 queued at handles) / 8 per replica, rounded up
    assert state["load"] == {"running": 16.0, "waiting": 9.0, "kv_utilisation": 0.6, "unspreadable": 0.0,
                             "preloaded": 0.0}


def test_policy_reads_replication_signals():
    policy = EngineLoadPolicy(**TARGETS)
    ctx = SimpleNamespace(current_num_replicas=2, total_num_requests=8.0, total_queued_requests=0.0,
                          aggregated_metrics={"running": {"r1": 4.0, "r2": 4.0}, "waiting": {"r1": 0.0, "r2": 0.0},
                                              "kv_utilisation": {"r1": 0.1, "r2": 0.1},
                                              "unspreadable": {"r1": 1.0, "r2": 0.0},
                                              "preloaded": {"r1": 0.0, "r2": 1.0}})
    desired, state = policy(ctx)
    assert desired == 3  # 8 requests fit one replica, but a hot adapter is on both: a third spreads it
    assert state["load"]["unspreadable"] == 1.0 and state["load"]["preloaded"] == 1.0


def test_policy_before_replicas_report_uses_ongoing_requests():
    ctx = SimpleNamespace(current_num_replicas=1, total_num_requests=20.0, total_queued_requests=None,
                          aggregated_metrics={})
    assert EngineLoadPolicy(**TARGETS)(ctx)[0] == 3


def test_policy_refuses_bad_targets():
    with pytest.raises(ValueError, match="kv_low < kv_high"):
        EngineLoadPolicy(target_running_per_replica=8, kv_high=0.4, kv_low=0.5)


def test_adapter_labels_are_bounded_to_the_most_requested():
    labels = TopLabels(top_n=2, none=BASE)
    assert labels.label(None) == "base"
    for adapter, times in (("a", 5), ("b", 3)):
        for _ in range(times):
            assert labels.label(adapter) == adapter
    assert labels.label("c") == "other"  # a third adapter, requested once, shares one series
    assert {labels.label(f"rare-{i}") for i in range(100)} == {"other"}
