"""Engine replica: one AsyncEngine per replica, streaming token events to the ingress."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from ray import serve

from engine import AsyncEngine, EngineConfig, SamplingParams


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10)
class LLMServer:
    def __init__(self, engine: dict | None = None):
        self.engine = AsyncEngine(EngineConfig.from_overrides(**(engine or {})))

    async def generate(self, prompt: str, params: SamplingParams) -> AsyncIterator[dict]:
        """Yield one event per new token; the last one carries finish_reason and counts."""
        request_id = uuid.uuid4().hex
        stream = self.engine.generate(request_id, prompt, params)
        try:
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
            }

    def stats(self) -> dict:
        s = self.engine.stats()
        return {"waiting": s.waiting, "running": s.running, "kv_blocks_used": s.kv_blocks_used,
                "kv_blocks_total": s.kv_blocks_total, "kv_utilisation": s.kv_utilisation}

    def check_health(self) -> None:
        if not self.engine.is_healthy:
            raise RuntimeError("engine loop is not running")


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item
