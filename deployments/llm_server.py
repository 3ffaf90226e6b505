"""Engine replica: one AsyncEngine per replica, streaming token events to the ingress.

The LoRA adapter of a request arrives as Ray Serve's multiplexed model id, so the router prefers
replicas that already hold it. Adapters come from the cluster's one cache actor; a replica added by
scale-up reaches every adapter through it at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from ray import serve
from transformers import AutoConfig

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.model_files import resolve_model
from lora_cache.actor import RayAdapterCache, get_or_create_cache_actor


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10)
class LLMServer:
    def __init__(self, engine: dict | None = None, cache_actor_name: str | None = None):
        config = EngineConfig.from_overrides(**(engine or {}))
        provider = self._adapter_provider(config, cache_actor_name) if config.max_loras else None
        self.engine = AsyncEngine(config, provider)

    @staticmethod
    def _adapter_provider(config: EngineConfig, cache_actor_name: str | None) -> RayAdapterCache:
        base_config = AutoConfig.from_pretrained(resolve_model(config.model, config.model_cache_dir)).to_dict()
        options = dict(adapter_source=config.adapter_source, adapters_root=config.adapters_root,
                       hub_cache=config.hub_cache, max_adapter_bytes=config.max_adapter_bytes)
        if cache_actor_name:
            options["name"] = cache_actor_name
        return RayAdapterCache(get_or_create_cache_actor(base_config, **options))

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _adapter(self, adapter_id: str) -> str:
        """Fetch the adapter into this replica's CPU copy; Serve then routes its requests here first."""
        await asyncio.to_thread(self.engine.engine.adapters.get, adapter_id)
        return adapter_id

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[dict]:
        """Yield one event per new token; the last one carries finish_reason and counts. A request the engine
        refuses yields one {"error": reason} event instead."""
        adapter = serve.get_multiplexed_model_id() or None
        try:
            if adapter is not None:
                if self.engine.engine.adapters is None:
                    raise ValueError(f"adapter {adapter!r} requested but this server runs without LoRA "
                                     f"(engine.max_loras is 0)")
                await self._adapter(adapter)
            stream = self.engine.generate(uuid.uuid4().hex, prompt, params, adapter)
            first = await stream.__anext__()
        except (ValueError, TypeError) as exc:  # the request itself is bad: tell the client, keep serving
            yield {"error": str(exc)}
            return
        async for out in _chain(first, stream):
            yield {
                "token_id": out.new_token_ids[-1] if out.new_token_ids else None,
                "logprob": out.logprobs[-1] if out.logprobs else None,
                "text": out.delta_text,
                "finished": out.finished,
                "finish_reason": out.finish_reason,
                "generated_text": out.text if out.finished else None,
                "generated_tokens": len(out.token_ids),
                "prompt_tokens": len(out.prompt_token_ids),
                "prompt_token_ids": out.prompt_token_ids if out.finished else None,
            }

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"waiting": s.waiting, "running": s.running, "kv_blocks_used": s.kv_blocks_used,
                "kv_blocks_total": s.kv_blocks_total, "kv_utilisation": s.kv_utilisation,
                "waiting_for_adapter": s.waiting_for_adapter, "resident_adapters": s.resident_adapters}

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError("engine loop is not running")


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item
