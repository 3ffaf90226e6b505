"""A request's started choices, as the OpenAI, Responses and LoRAX routes serve them: each choice's events charged
to its tenant (Metered), gathered whole, or streamed as the OpenAI API's chunks (a usage chunk and [DONE] last) or
the Responses API's typed events. A stream that fails after its first token ends with its API's error event (503
when this replica's engine stopped, 500 when the peer serving it died), never cut off without one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

from deployments.api.errors import mid_stream_status, openai_error
from deployments.api.events import PeerLost, TokenEvent
from deployments.api.openai_protocol import OpenAISampling
from deployments.api.openai_render import Renderer, usage, usage_counts
from deployments.api.responses_render import ResponseRenderer
from deployments.gate.gate import Tenant
from engine.errors import EngineDeadError, Refusal, RefusalKind


class Metered:
    """A request's events, its tokens charged to its tenant when the last one arrives; with API keys, a missing
    adapter is refused in the same words as one outside the key's scope, so that names do not leak."""

    def __init__(self, events, tenant: Tenant, adapter: str | None):
        self._events = events
        self._tenant = tenant
        self._adapter = adapter

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | Refusal:
        event = await self._events.__anext__()
        if isinstance(event, Refusal) and event.kind is RefusalKind.NOT_FOUND:
            return Refusal(self._tenant.not_found_message(self._adapter, event.reason), event.kind)
        if isinstance(event, TokenEvent) and event.finished:
            self._tenant.charge(event.prompt_tokens, event.final.generated_tokens)
        return event

    def cancel(self) -> None:
        cancel = getattr(self._events, "cancel", None)  # a refusal made here has nothing to stop
        if cancel is not None:
            cancel()


@dataclasses.dataclass
class Choice:
    """One started choice of a request: its first event and the stream of the rest."""
    first: TokenEvent
    events: Metered


@dataclasses.dataclass
class Started:
    """A request begun: its id (which names the response) and its choices, each with its first event."""
    request_id: str
    choices: list[Choice]


async def wholes(choices: list[Choice]) -> list[TokenEvent]:
    """Each choice's events as one; a failed choice, or a client that left, stops every choice."""
    try:
        return await asyncio.gather(*(whole(choice.first, choice.events) for choice in choices))
    except BaseException:
        cancel([choice.events for choice in choices])
        raise


def _raise_failure(pumps: list[asyncio.Task]) -> None:
    """The exception of a choice's pump that has failed, if one has."""
    for task in pumps:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def _typed(event: dict) -> str:
    """A server-sent event that names its type, as the Responses API's stream sends each."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def cancel(streams) -> None:
    """Stop the engine requests behind these responses (a no-op for finished ones)."""
    for events in streams:
        events.cancel()


async def whole(first: TokenEvent, events) -> TokenEvent:
    """A choice's events as one (one event already, unless it was streamed to tell when its prompt was cached)."""
    whole = first
    async for event in events:
        whole = whole.extend(event)
    return whole


async def openai_sse(request: OpenAISampling, render: Renderer, cid: str, firsts: list[TokenEvent],
                     streams) -> AsyncIterator[str]:
    """The choices' chunks as they come, each marked with its choice's index."""
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    lasts: list[TokenEvent] = list(firsts)

    continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats

    async def pump(index: int, event: TokenEvent | None, events) -> None:
        first, generated = True, 0
        try:
            while event is not None:
                data = render.chunk(cid, index, event, event.text, first)
                generated += sum(token is not None for token in event.token_ids)
                if data is not None and continuous:  # vLLM's: this choice's tokens so far
                    data["usage"] = usage_counts(event.prompt_tokens, generated)
                if data is not None:  # None: a chunk held back (a choice that may call tools)
                    lines.put_nowait(f"data: {json.dumps(data)}\n\n")
                first, lasts[index] = False, event
                event = await anext(events, None)
        finally:
            lines.put_nowait(None)

    pumps = [asyncio.create_task(pump(i, first, events))
             for i, (first, events) in enumerate(zip(firsts, streams))]
    try:
        for _ in pumps:
            while (line := await lines.get()) is not None:
                yield line
            _raise_failure(pumps)  # a choice that failed fails the stream at once
        if request.stream_options is not None and request.stream_options.include_usage:
            yield f"data: {json.dumps(render.usage_chunk(cid, usage(lasts, request.n)))}\n\n"
    except (PeerLost, EngineDeadError) as exc:  # as vLLM: an error event, then the stream's end
        yield f"data: {json.dumps(openai_error(str(exc), mid_stream_status(exc)))}\n\n"
    finally:
        for task in pumps:
            task.cancel()
        cancel(streams)
    yield "data: [DONE]\n\n"

async def response_events(render: ResponseRenderer, choice: Choice) -> AsyncIterator[str]:
    """The Responses API's stream: its typed events, each named on an `event:` line too; no [DONE]."""
    try:
        for event in render.opening():
            yield _typed(event)
        event, last = choice.first, choice.first
        while event is not None:
            if (delta := render.delta(event)) is not None:
                yield _typed(delta)
            last, event = event, await anext(choice.events, None)
        for event in render.closing(last):
            yield _typed(event)
    except (PeerLost, EngineDeadError) as exc:
        yield _typed(render.error(str(exc), mid_stream_status(exc)))
    finally:
        cancel([choice.events])
