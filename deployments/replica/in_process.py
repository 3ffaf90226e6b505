"""The HTTP API over an engine in this process, without Ray: the same routes and gate as a Serve replica's.

    engine = InProcessEngine(EngineConfig.from_overrides("smollm2-135m-instruct"))
    uvicorn.run(engine.tracing.instrument(http_app(engine.served, Gate(GateConfig()))), port=8000)

It serves one engine and no peers. Adapters come from the engine's own provider (offline: lora_cache's
local_adapters, over adapter_source); loading and unloading adapters at run time is refused by name, since that is
the cluster's cache actor's (serve run serve_config.yaml), and /v1/models lists the base model only. Its requests
are traced when it is given a RequestTracing that is on (deployments/replica/tracing.py; `instrument` adds the
route's and the gate's spans to the app). The serving tests run the routes over it to test them against a real
engine in one process.
"""

from __future__ import annotations

import uuid

from deployments.replica.engine_events import EngineEvents, EventRequest, Unwatched
from deployments.replica.event_streams import LocalEvents
from deployments.replica.replica_stats import engine_info
from deployments.replica.tracing import RequestTracing
from deployments.routes.engine_client import Served
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import key_name
from engine.lora.merge_spec import MergeSpec
from engine.lora.provider import AdapterProvider, AdapterProviderFactory, LoraShapes, ProviderOptions
from engine.sampling import SamplingParams

NO_LIFECYCLE = ("loading and unloading adapters at run time needs the cluster's adapter cache "
                "(serve run serve_config.yaml); this server reads adapters from its adapter_source only")


class InProcessEngine:
    """An EngineClient (deployments/routes/engine_client.py) over an AsyncEngine of this process."""

    def __init__(self, config: EngineConfig, adapters: AdapterProviderFactory | None = None,
                 tracing: RequestTracing | None = None):
        """tracing: this server's, which it owns from then on (shut down with it); None: off."""
        self._provider: AdapterProvider | None = None
        self.tracing = tracing or RequestTracing()
        self._make_provider = adapters
        self.engine = AsyncEngine(config, self._provider_for if adapters is not None else None)
        self.served = Served(self, config, self.engine.tokenizer)
        self.events = EngineEvents(self.engine, self.served.token_texts, self._content_id)

    def _provider_for(self, sources: ProviderOptions, shapes: LoraShapes) -> AdapterProvider:
        """The engine's provider, kept here too: the Final names the weights' content id, and merges go to it."""
        self._provider = self._make_provider(sources, shapes)
        return self._provider

    def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                 stream: bool = True) -> LocalEvents:
        request_id = uuid.uuid4().hex
        watch = self.tracing.watch(Unwatched(), request_id, key_name(adapter) if adapter is not None else None)
        events = self.events.events(EventRequest(request_id, prompt, params, adapter, stream), watch)
        return LocalEvents(events, lambda: self.engine.abort(request_id))

    def running(self) -> bool:
        return self.engine.is_healthy

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def replica_info(self) -> dict:
        return engine_info("in-process", self.engine)

    async def adapter_stats(self) -> None:
        return None

    async def register_adapter(self, name: str, lora_path: str):
        raise ValueError(NO_LIFECYCLE)

    async def unregister_adapter(self, name: str) -> None:
        raise ValueError(NO_LIFECYCLE)

    async def merge_adapters(self, spec: MergeSpec) -> str:
        if self._provider is None:
            raise ValueError("this server runs without LoRA (max_loras is 0): it cannot merge adapters")
        return self._provider.merge(spec)

    def _content_id(self, key: str) -> str | None:
        return self._provider.get(key).content_id if self._provider is not None else None

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.tracing.shutdown()
