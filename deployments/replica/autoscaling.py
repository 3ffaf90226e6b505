"""Ray Serve custom autoscaling policy for the engine deployment: queue depth and KV-cache memory.

Each LLMServer replica reports `waiting`, `running` and `kv_utilisation` through
record_autoscaling_stats(); Serve aggregates them per replica over look_back_period_s and calls the
policy in its controller. Serve then applies the config's upscale/downscale delays and the
min/max replica bounds to what the policy asks for.

Replicas also report replication (deployments/routing/replication.py): `unspreadable`, the adapters hot on every
replica, which only another replica can spread, so the policy adds one; and `preloaded`, the adapters a replica
holds because they were hot elsewhere, so the policy removes none while a replicated adapter is still warm.

    autoscaling_config:
      policy:
        policy_function: deployments.replica.autoscaling:EngineLoadPolicy
        policy_kwargs: {target_running_per_replica: 32, kv_high: 0.85, kv_low: 0.5}
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    """The deployment's load, summed (requests) or maximised (KV utilisation) over its replicas."""
    running: float
    waiting: float
    kv_utilisation: float
    unspreadable: float = 0.0  # adapters hot on every replica (the most any replica reports)
    preloaded: float = 0.0  # adapters preloaded because they were hot (over the replicas)


def desired_replicas(current: int, load: EngineLoad, target_running_per_replica: float, kv_high: float,
                     kv_low: float) -> int:
    """Enough replicas to run every running and waiting request at the target batch size; one more than now
    when some replica's KV cache is nearly full, or a hot adapter is on every replica; fewer only while KV memory
    is low everywhere and no adapter is replicated for its load."""
    by_requests = math.ceil((load.running + load.waiting) / target_running_per_replica)
    if load.kv_utilisation >= kv_high or load.unspreadable > 0:
        return max(by_requests, current + 1)
    if by_requests < current and (load.kv_utilisation > kv_low or load.preloaded > 0):
        return current  # requests alone would allow fewer, but the KV cache or a hot adapter still needs them
    return by_requests


class EngineLoadPolicy:
    """policy_function for Serve (a class, so that policy_kwargs reach it); returns (replicas, state)."""

    def __init__(self, target_running_per_replica: float = 32, kv_high: float = 0.85, kv_low: float = 0.5):
        if target_running_per_replica <= 0 or not 0 < kv_low < kv_high <= 1:
            raise ValueError(f"need target_running_per_replica > 0 and 0 < kv_low < kv_high <= 1, got "
                             f"{target_running_per_replica}, {kv_low}, {kv_high}")
        self.target_running_per_replica = target_running_per_replica
        self.kv_high = kv_high
        self.kv_low = kv_low

    def __call__(self, ctx) -> tuple[int, dict]:
        load = self.load(ctx.aggregated_metrics or {}, ctx.total_num_requests, ctx.total_queued_requests)
        desired = desired_replicas(ctx.current_num_replicas, load, self.target_running_per_replica,
                                   self.kv_high, self.kv_low)
        return desired, {"load": load.__dict__, "desired": desired}

    @staticmethod
    def load(metrics: dict[str, dict], ongoing_requests: float, queued_at_handles: float | None) -> EngineLoad:
        """From Serve's per-replica aggregates plus the requests queued at handles (not in any engine yet);
        before any replica has reported, Serve's own count of ongoing requests stands in for running."""
        running = sum(metrics.get("running", {}).values())
        waiting = sum(metrics.get("waiting", {}).values()) + (queued_at_handles or 0.0)
        kv = max(metrics.get("kv_utilisation", {}).values(), default=0.0)
        if not metrics.get("running"):
            running = ongoing_requests or 0.0
        unspreadable = max(metrics.get("unspreadable", {}).values(), default=0.0)
        return EngineLoad(running, waiting, kv, unspreadable, sum(metrics.get("preloaded", {}).values()))
