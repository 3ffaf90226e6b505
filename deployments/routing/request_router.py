"""Ray Serve's router for the engine deployment: ranks replicas by adapter residence, cached prefix and load
(deployments/routing/policy.py) from the reports replicas hand Serve through `record_routing_stats`.

Serve runs one router per caller: in the HTTP proxy, which knows a request's adapter only from the
`serve_multiplexed_model_id` header (it does not read bodies), and in each replica's handle to its peers, for
requests a replica forwards with their adapter, prompt digests, chosen replica and sender (`RouteRequest`), which
go to another replica than their sender whenever one is running. Within a rank Serve probes queue lengths and
takes the shortest replica that accepts; when none in any rank accepts, it backs off and asks again. A replica
that died leaves the candidates Serve passes in, so it is routed around.

The replicas Serve routes to are also kept for the process's peer views (live_replicas): a replica Serve stopped
(a scale-down, a rolling update) still reports to the cache actor while it drains, and a request forwarded to it
would come back to its sender through Ray (deployments/routing/peer_view.py).
"""

from __future__ import annotations

import dataclasses
import random

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter
from ray.serve.config import RequestRouterConfig

from deployments.routing.policy import RouteRequest, RoutingPolicy, rank, serve_replica_id
from lora_cache.replica_report import ReplicaReport

ROUTING_STATS_KEY = "lora_serve"  # record_routing_stats() -> {ROUTING_STATS_KEY: ReplicaReport}
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve's controller collects the reports for the routers
# A forwarded request's target holds what the sender lacks; a probe of it that misses Serve's first deadline
# (0.1 s) is most often the sender's handle opening its connection, on a busy node. The target is probed this many
# times, under the deadlines Serve's backoff grows (0.1, 0.2, 0.4 s), before the other ranks: the next of which
# is usually the sender itself, that would then fetch the adapter and serve it after a pointless Ray hop.
TARGET_PROBES = 3
# (app, deployment) -> the unique ids of the replicas Serve routes to, as this process's routers last heard
_LIVE: dict[tuple[str, str], frozenset[str]] = {}


class LoraAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance: int = 8, hot_adapter_requests: int | None = 16, kv_high: float = 0.9):
        """request_router_kwargs of the deployment's request_router_config (Serve calls this once, after
        construction, with no arguments when there are none)."""
        self.policy = RoutingPolicy(imbalance, hot_adapter_requests, kv_high)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's running replicas (a stopping one is left out at once), kept for live_replicas too."""
        super().update_replicas(replicas)
        deployment = self._deployment_id
        _LIVE[(deployment.app_name, deployment.name)] = frozenset(r.replica_id.unique_id for r in replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every candidate is ranked each time
        request = _route_request(pending_request)
        if request.sender is not None:
            candidate_replicas = _off_sender(candidate_replicas, request.sender)
        reports = [_report(r) for r in candidate_replicas]
        by_name = {report.replica: r for report, r in zip(reports, candidate_replicas)}
        ranks = probe_order(request, rank(request, reports, self.policy))
        return [[by_name[report.replica] for report in group] for group in ranks]


def _off_sender(candidates: list[RunningReplica], sender: str) -> list[RunningReplica]:
    """A forwarded request's candidates without its sender while another can take it: its target may have stopped
    since the sender chose it. When none other runs, the sender hands it back (deployments/replica/event_streams.py)."""
    others = [r for r in candidates if r.replica_id.unique_id != serve_replica_id(sender)]
    return others or candidates


def live_replicas(app: str, deployment: str) -> frozenset[str] | None:
    """The unique ids of the deployment's replicas that Serve routes to, as a router in this process last heard;
    None before one has heard."""
    return _LIVE.get((app, deployment))


def probe_order(request: RouteRequest, ranks: list[list[ReplicaReport]]) -> list[list[ReplicaReport]]:
    """The ranks in the order Serve probes them: a target at the front is tried TARGET_PROBES times; a choice made
    without a reservation takes each rank's replicas one at a time, in random order."""
    if request.unreserved:
        return [[r] for rank in ranks for r in random.sample(rank, len(rank))]
    if request.target is None or not ranks or ranks[0][0].replica != request.target:
        return ranks
    return [ranks[0]] * TARGET_PROBES + ranks[1:]


def _report(replica: RunningReplica) -> ReplicaReport:
    """The replica's last report; a replica that has not reported yet counts as idle, holding nothing."""
    report = replica.routing_stats.get(ROUTING_STATS_KEY)
    return report if isinstance(report, ReplicaReport) else ReplicaReport(replica.replica_id.unique_id)


def _route_request(pending: PendingRequest | None) -> RouteRequest:
    """A forwarded request carries its RouteRequest as the first argument; a request from the HTTP proxy has
    its adapter in the multiplexed model id, if the client set the header."""
    if pending is None:
        return RouteRequest()
    if pending.args and isinstance(pending.args[0], RouteRequest):
        return pending.args[0]
    return RouteRequest(adapter=pending.metadata.multiplexed_model_id or None)


def router_config(policy: RoutingPolicy) -> RequestRouterConfig:
    """The engine deployment's request_router_config: this router, ranking by the policy its replicas use."""
    return RequestRouterConfig(request_router_class=LoraAwareRouter,
                               request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
                               request_router_kwargs=dataclasses.asdict(policy))
