"""The application's quota ledger as a Ray actor: one per application, named after it, found or created by the
first replica that needs it.

Detached, so that it outlives the replicas: a rolling update or a scale-down keeps every key's buckets, and a key
does not get a fresh minute's allowance from a redeploy. Ray restarts it if its process dies; it then starts with
full buckets and no slots held (replicas re-take their slots at their next renewal). It takes no CPU: its calls
are a few arithmetic operations.
"""

from __future__ import annotations

import logging

import ray

from deployments.control_node import ControlPlacement
from deployments.gate.quota_ledger import Lease, LeaseAsk, QuotaLedger

LEDGER_NAME = "lora-serve-quota-ledger"
logger = logging.getLogger(__name__)


class RayLedger:
    """A replica's handle on its application's ledger actor (deployments/gate/quota_ledger.py: Ledger)."""

    def __init__(self, app_name: str, placement: ControlPlacement):
        """placement: the nodes the ledger may run on (deployments/control_node.py)."""
        self._actor = (ray.remote(QuotaLedger)
                       .options(name=f"{LEDGER_NAME}:{app_name}", lifetime="detached", get_if_exists=True,
                                num_cpus=0, max_restarts=-1, scheduling_strategy="DEFAULT",
                                resources=placement.resources())
                       .remote())  # outside the replica's placement group, which goes with the replica

    async def lease(self, ask: LeaseAsk) -> Lease:
        return await self._actor.lease.remote(ask)

    def leave(self, replica: str) -> None:
        try:
            self._actor.leave.remote(replica)
        except Exception as exc:  # noqa: BLE001 - a replica's teardown may outlive its Ray worker
            logger.info("the quota ledger was not told this replica left (its slots expire instead): %r", exc)
