"""HAProxy's ingress request router: port 8000 without a Python process on the data path.

With `RAY_SERVE_ENABLE_HA_PROXY=1` (serve_config.yaml) Serve runs HAProxy on port 8000 in place of its Python
HTTP proxy, and HAProxy relays each request's bytes, both ways, to an engine replica's own HTTP port (direct
ingress, deployments/routing/direct_ingress.py). No Ray call and no pickled ASGI message stand between a client and the
routes, and none between an event and the client. HAProxy's Lua action first asks this deployment which replica
should serve a request: it POSTs the request's body to `/internal/route`, and this router answers with the
replica's id, which HAProxy maps to that replica's port. The answer also sets the `serve_multiplexed_model_id`
header, so the replica sees the adapter as it would through Serve's proxy. (Ray 2.60 hooks such a router onto an
application with the private `Application._with_ingress_request_router`, the hook Ray Serve LLM uses.)

The choice is the engine deployment's own router (deployments/routing/request_router.py), run here through a handle's
`choose_replica` without reserving a slot: it ranks the replicas by adapter residence, cached prefix and load
(deployments/routing/policy.py). Within a rank it takes a replica at random rather than Serve's shorter queue: a choice
without a reservation, and requests that then go to a replica's own port, leave Serve's cache of queue lengths as it was
until it expires (10 s), so every request would go to the same replica. Unlike Serve's proxy, which does not read
bodies, this router reads the body, so it knows the adapter of every request, not only of those whose client set the
header. Prompt digests are left to the replica (deployments/routing/peer_view.py), which tokenizes the prompt anyway:
the router stays one cheap JSON parse a request.

In `benchmarks serve_load` (against vLLM's OpenAI server) HAProxy served about vLLM's tokens/s or more, with a
lower TTFT, where Serve's Python proxy served fewer tokens/s with a higher TTFT; the router and HAProxy took a
small share of the cores (docs/benchmarks.md).
"""

import json

from fastapi import FastAPI, HTTPException, Request
from ray import serve
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from deployments.routing.policy import RouteRequest

MULTIPLEXED_MODEL_ID_HEADER = "serve_multiplexed_model_id"  # Serve's header for a request's adapter

router_app = FastAPI()


def requested_adapter(body: bytes, model_name: str) -> str | None:
    """The adapter a request body names: OpenAI's `model` when it is not the base model, LoRAX's
    `parameters.adapter_id`; None for the base model, and for a body that is not a JSON object or nests too deep
    for Python's parser (the replica answers those with its 4xx)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    model = data.get("model")
    if isinstance(model, str):
        return None if model == model_name else model
    parameters = data.get("parameters")
    adapter = parameters.get("adapter_id") if isinstance(parameters, dict) else None
    return adapter if isinstance(adapter, str) else None


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(router_app)
class AdapterRouter:
    def __init__(self, server: DeploymentHandle, model_name: str):
        self._server = server
        self._model_name = model_name
        self._deployment = DeploymentID(name=server.deployment_name, app_name=server.app_name)

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> dict:
        """{"replica_id": ..., "request_headers": {...}}: the replica HAProxy sends the request to."""
        adapter = requested_adapter(await request.body(), self._model_name)
        handle = self._server.options(multiplexed_model_id=adapter) if adapter else self._server
        route = RouteRequest(adapter=adapter, unreserved=True)
        try:
            async with handle.choose_replica(route, _reserve=False) as selection:
                replica_id = selection.replica_id
        except DeploymentUnavailableError as exc:
            raise HTTPException(503, str(exc)) from None
        answer = {"replica_id": self._full_replica_id(replica_id)}
        if adapter:
            answer["request_headers"] = {MULTIPLEXED_MODEL_ID_HEADER: adapter}
        return answer

    def _full_replica_id(self, unique_id: str) -> str:
        """HAProxy names replicas by Serve's full replica id (SERVE_REPLICA::<app>#<deployment>#<unique id>)."""
        return ReplicaID(unique_id, self._deployment).to_full_id_str()
