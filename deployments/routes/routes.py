"""The HTTP edge: LoRAX / TGI and OpenAI-compatible routes (FastAPI), with SSE streaming, and the server's own
(/health, /version, /info).

`http_app(served, gate)` builds the app of every route module (tgi_routes, openai_routes, adapter_routes) over one
EngineClient (deployments/routes/engine_client.py): the routes know nothing of Serve, of peers or of the cache
actor. The engine replica (deployments/replica/llm_server.py) builds it
at its start (Serve's late-bound ingress, `__serve_build_asgi_app__`), so that Serve's HTTP proxy and HAProxy hand
a request straight to the replica that runs the engine: a separate ingress deployment costs one more process and
one more Ray hop per event. The same app serves an engine in one process (deployments/replica/in_process.py).
Status codes are chosen here, at the edge: the engine side says why it refuses (deployments/api/events.py), and
deployments/routes/error_handlers.py answers what a route raises. The answers' shapes are rendered apart: LoRAX's
and TGI's in deployments/api/tgi_render.py, OpenAI's in deployments/api/openai_render.py and
deployments/api/responses_render.py.
"""

import dataclasses
import importlib.metadata

from fastapi import APIRouter, FastAPI, Request

from deployments.api.errors import error_response
from deployments.gate.gate import Gate, GateMiddleware
from deployments.routes import adapter_routes, openai_routes, tgi_routes
from deployments.routes.edge import listed_adapters, served_of, tenant_of
from deployments.routes.engine_client import Served
from deployments.routes.error_handlers import ENGINE_STOPPED_RETRY_AFTER_S, answer_errors

VERSION = importlib.metadata.version("lora-serve")
router = APIRouter()  # the server's own routes, defined below


def http_app(served: Served, gate: Gate) -> FastAPI:
    """The HTTP API over `served.client`: the gate first (body size, key, limits), then the routes."""
    app = routes_app()
    app.state.served = served
    app.add_middleware(GateMiddleware, gate=gate)
    answer_errors(app)
    return app


def routes_app() -> FastAPI:
    """Every route module's routes in one app, with no server behind them yet (its OpenAPI schema is the API's)."""
    app = FastAPI(title="lora-serve")
    for part in ROUTERS:
        app.include_router(part)
    return app


@router.get("/health")
async def health(http: Request):
    """200 while the engine loop runs, else 503 with Retry-After (no API key needed)."""
    served = served_of(http)
    if not served.client.running():
        return error_response(http.url.path, "engine loop is not running", 503, ENGINE_STOPPED_RETRY_AFTER_S)
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict:
    """vLLM's: the server's version (the lora-serve package's)."""
    return {"version": VERSION}


@router.get("/info")
async def info(http: Request) -> dict:
    """The served model and engine limits, one replica's memory accounting and prefix-cache counts, and where
    each adapter resides."""
    served = served_of(http)
    c = served.config
    adapters = await listed_adapters(served, tenant_of(http))
    return {"model_id": served.model_name, "version": VERSION, "dtype": c.model.dtype,
            "quantization": c.model.quantization, "max_loras": c.lora.max_loras, "max_lora_rank": c.lora.max_lora_rank,
            "adapter_source": c.sources.kind if c.lora.max_loras else None, "max_num_seqs": c.scheduler.max_num_seqs,
            "max_waiting_requests": c.scheduler.max_waiting_requests, **served.client.replica_info(),
            "adapters": {a: dataclasses.asdict(where) for a, where in adapters.items()}}


ROUTERS = (router, tgi_routes.router, openai_routes.router, adapter_routes.router)
