"""Direct ingress: each engine replica serves HTTP on a port of its own, behind HAProxy or beside Serve's proxy.

Through Serve's HTTP proxy a request costs two Ray calls before its route runs: the proxy hands the replica the
request's scope, and the replica calls the proxy back for the body. Its events then travel replica -> proxy -> client.
Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS) starts the ingress deployment's own uvicorn server in each
replica, on a port the controller allocates from [RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT). With RAY_SERVE_ENABLE_HA_PROXY, HAProxy serves Serve's HTTP port and relays
each request to the port of the replica that the ingress request router picks (deployments/routing/ingress_router.py);
without it Serve's Python proxy keeps the HTTP port, with adapter-aware routing (deployments/routing/request_router.py).
A replica that receives a request on its own port still forwards it to a better peer (deployments/routing/peer_view.py).
Serve lists the replicas' ports as target groups for an external load balancer (ServeInstanceDetails.target_groups, the
dashboard's /api/serve/applications/).

Per-request timestamps in the replica showed both costs: from the client to the route's first line took longer
through the proxy (reaching the replica, then fetching the body and parsing) than on the replica's port, more so
as concurrent streams grew, and the first event back to the client took longer too. In `benchmarks serve_load`
the replica's port gave a lower TTFT than the proxy (docs/benchmarks.md).

The controller reads these variables, and so does every replica: serve_config.yaml sets them in the
controller's runtime_env, and build_app, which Serve runs in that environment, hands them on to the engine
replicas and to the ingress request router (direct_ingress_env).
"""

from __future__ import annotations

import os

ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
ENABLE_HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
PREFIXES = ("RAY_SERVE_DIRECT_INGRESS", "RAY_SERVE_HAPROXY", "RAY_SERVE_INGRESS_REQUEST_ROUTER")


def direct_ingress_env() -> dict[str, str]:
    """Serve's direct-ingress and HAProxy variables of this process (build_app's: the controller's runtime_env)."""
    return {k: v for k, v in os.environ.items() if k in (ENABLE, ENABLE_HAPROXY) or k.startswith(PREFIXES)}


def haproxy_enabled() -> bool:
    """Whether Serve runs HAProxy on its HTTP port (the controller's environment, which build_app runs in)."""
    return os.environ.get(ENABLE_HAPROXY) == "1"
