"""EngineClient: what the HTTP routes ask of the engine behind them, and the state the routes keep beside it.

The routes (deployments/routes/routes.py) know nothing of Ray Serve, of peers or of the cache actor: they take one
EngineClient, which a Serve replica implements (deployments/replica/llm_server.py: its requests may be forwarded
to a better placed peer) and which an AsyncEngine in one process implements too
(deployments/replica/in_process.py), so that the routes run and are tested against a real engine without Ray.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deployments.api.events import TokenEvent
from deployments.api.tgi_render import TgiTokens
from deployments.api.token_texts import TokenTexts
from engine.errors import Refusal

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.lora.merge_spec import MergeSpec
    from engine.sampling import SamplingParams
    from lora_cache.cache_stats import CacheStats
    from lora_cache.registry import Registration


class EventStream(Protocol):
    """One engine request's events: TokenEvents of one or more tokens (the last carries the Final), or a single
    Refusal. cancel() stops the engine request (a client that left, a failed sibling choice)."""

    def __aiter__(self) -> AsyncIterator[TokenEvent | Refusal]: ...

    async def __anext__(self) -> TokenEvent | Refusal: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    """The engine as the routes use it: a request's events, its health and limits, and its adapters."""

    def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                 stream: bool = True) -> EventStream:
        """The events of one request for `adapter` (None: the base model); with stream False, one event holding
        every token."""

    def running(self) -> bool:
        """Whether the engine loop runs (/health)."""

    def max_model_len(self) -> int:
        """The longest context a request may fill."""

    def replica_info(self) -> dict:
        """This engine's memory accounting, prefix-cache and slot counts, and load, as /info shows them."""

    async def adapter_stats(self) -> CacheStats | None:
        """The adapter cache's view of every adapter (None where no cache lists them); AdapterCacheUnavailableError
        while the cache does not answer."""

    async def register_adapter(self, name: str, lora_path: str) -> Registration:
        """Serve `name` from `lora_path` from now on; AdapterError says why not."""

    async def unregister_adapter(self, name: str) -> None:
        """Stop serving what register_adapter registered under `name`."""

    async def merge_adapters(self, spec: MergeSpec) -> str:
        """The adapter id that serves the merge of spec's adapters (LoRAX's merged_adapters)."""


@dataclass
class Served:
    """What the routes hold for the engine they serve: its client, its options, its tokenizer, and the token
    texts cached for responses (deployments/api/token_texts.py)."""
    client: EngineClient
    config: EngineConfig
    tokenizer: Any
    token_texts: TokenTexts = field(init=False)
    tgi: TgiTokens = field(init=False)

    def __post_init__(self):
        self.token_texts = TokenTexts(self.tokenizer)
        self.tgi = TgiTokens(self.token_texts)

    @property
    def model_name(self) -> str:
        return self.config.model.name

    @property
    def lora_enabled(self) -> bool:
        return self.config.lora.max_loras > 0
