"""Where the application's cluster-wide actors run: the adapter cache actor and the quota ledger.

The autoscaler removes a node only when nothing runs on it. These actors take no CPU and live as long as the
application, and the first replica that needs one creates it; on a node that scale-up added for engine replicas
they would keep it up, and its GPUs paid for, after the load had gone. They go where the cluster always has a node
instead: the head, by the resource Ray gives it alone (`node:__internal_head__`, as Ray Train places its own state
actor), or the nodes carrying a resource the config names (a KubeRay worker group of small CPU nodes given
`lora-serve-control: 1`, say). A config may name none, and then Ray places them anywhere, engine nodes included.

Serve's own pieces need nothing here: its controller runs on the head, and its proxies and the ingress request
router run on the head and on each node while it holds engine replicas, and stop when they are gone.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_NODE = "node:__internal_head__"
SHARE = 0.001  # of the resource each piece asks: any positive amount places it, and many fit on one node


@dataclass(frozen=True)
class ControlPlacement:
    resource: str | None = HEAD_NODE  # None: anywhere Ray places them

    def resources(self) -> dict[str, float]:
        """The custom resources each piece's actor asks for (Ray's `resources` option)."""
        return {self.resource: SHARE} if self.resource else {}
