"""A request's typed events from an AsyncEngine: what the routes read of one engine request, wherever it is served.

The engine hands out chunks of RequestOutputs (every output ready since the last chunk: engine/async_engine.py);
they become TokenEvents of one or more tokens (deployments/api/events.py), the last carrying the Final, sent when
the pacer lets them go (deployments/replica/pacing.py: fewer, larger events under load). A request the engine will
not start becomes one Refusal, whose kind the edge turns into an HTTP status. A Serve replica
(deployments/replica/llm_server.py) and an engine in one process (deployments/replica/in_process.py) both serve
their requests' events through this one mechanism.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from deployments.api.errors import client_message
from deployments.api.events import Final, TokenEntry, TokenEvent
from deployments.api.token_texts import TokenTexts
from deployments.replica.pacing import EventPacer
from engine.errors import EngineOverloadedError, Refusal
from engine.sampling import SamplingParams
from lora_cache.adapter_folder import AdapterCacheUnavailableError

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.outputs import RequestOutput


@dataclass(frozen=True)
class EventRequest:
    """One engine request as the events know it: `adapter` is the engine's key for it (None: the base model)."""
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter: str | None
    stream: bool


@dataclass(frozen=True)
class AdapterFetch:
    """A request's adapter fetched into the replica before the engine took it: from its copy (hit) or from the
    cache actor, between two time.perf_counter() readings."""
    hit: bool
    start: float
    end: float


class RequestWatch(Protocol):
    """What a request's events tell whoever measures it (deployments/replica/metrics.py: RequestTimer;
    deployments/replica/tracing.py: RequestSpans)."""

    def token(self) -> None: ...

    def sent(self, event: TokenEvent) -> None: ...

    def adapter_fetched(self, fetch: AdapterFetch) -> None: ...

    def finished(self, output: RequestOutput) -> None:
        """The request's finished output: its reason, tokens and times in the engine (engine/outputs.py)."""


class Unwatched:
    """A request nobody measures (an engine served in one process exports no metrics)."""

    def token(self) -> None:
        pass

    def sent(self, event: TokenEvent) -> None:
        pass

    def adapter_fetched(self, fetch: AdapterFetch) -> None:
        pass

    def finished(self, output: RequestOutput) -> None:
        pass


@dataclass(frozen=True)
class Watches:
    """Several watches of one request, each told everything."""
    watches: tuple[RequestWatch, ...]

    def token(self) -> None:
        for watch in self.watches:
            watch.token()

    def sent(self, event: TokenEvent) -> None:
        for watch in self.watches:
            watch.sent(event)

    def adapter_fetched(self, fetch: AdapterFetch) -> None:
        for watch in self.watches:
            watch.adapter_fetched(fetch)

    def finished(self, output: RequestOutput) -> None:
        for watch in self.watches:
            watch.finished(output)


@dataclass
class StartedRequest:
    """A request the engine took: its first chunk of outputs, and the stream of the rest."""
    first: list
    chunks: AsyncIterator[list]


class EngineEvents:
    def __init__(self, engine: AsyncEngine, token_texts: TokenTexts, content_id: Callable[[str], str | None],
                 fetch: Callable[[str, RequestWatch], Awaitable[None]] | None = None,
                 pacer: EventPacer | None = None):
        """content_id: the content id of an adapter key's weights, for the Final. fetch: awaited for an adapter
        request before the engine takes it (a Serve replica loads the adapter through Serve's multiplexing).
        pacer: how often the streams send (deployments/replica/pacing.py; its defaults when None)."""
        self.engine = engine
        self.token_texts = token_texts
        self.content_id = content_id
        self.fetch = fetch
        self.pacer = pacer or EventPacer()

    async def events(self, request: EventRequest, watch: RequestWatch) -> AsyncIterator[TokenEvent | Refusal]:
        """TokenEvents of one or more new tokens each, the last carrying the Final; with stream False, one event
        holding every token. A request the engine refuses yields one Refusal instead."""
        started = await self._start(request, watch)
        if isinstance(started, Refusal):
            yield started
            return
        async for event in self._paced(request, started, watch):
            yield event

    async def _start(self, request: EventRequest, watch: RequestWatch) -> StartedRequest | Refusal:
        """The request's first chunk of outputs, or the refusal of a request the engine would not start."""
        try:
            if request.adapter is not None and self.fetch is not None:
                await self.fetch(request.adapter, watch)
            chunks = self.engine.generate_chunks(request.request_id, request.prompt, request.params, request.adapter)
            return StartedRequest(await chunks.__anext__(), chunks)
        except (EngineOverloadedError, AdapterCacheUnavailableError, ValueError, TypeError) as exc:
            return refusal(exc)

    async def _paced(self, request: EventRequest, started: StartedRequest,
                     watch: RequestWatch) -> AsyncIterator[TokenEvent]:
        """The request's events, each holding every token ready when the pacer lets the next one go."""
        held: TokenEvent | None = None
        scored = request.params.prompt_logprobs is None  # the prompt's scores go out once, with the first token
        with self.pacer.stream() as pace:
            async for chunk in _chain(started.first, started.chunks):
                watch.token()
                event = self._event(request, chunk, scored, watch)
                scored = scored or event.prompt_entries is not None
                held = event if held is None else held.extend(event)
                if event.final is not None or (request.stream and pace.due()):
                    pace.sent(held)
                    watch.sent(held)
                    yield held
                    held = None

    def _event(self, request: EventRequest, chunk: list, scored: bool, watch: RequestWatch) -> TokenEvent:
        """A chunk's event: its prompt's scores until they went out once, and the Final when the request ends."""
        event = _token_event(chunk, request.params)
        if not scored:
            event.prompt_entries = self._prompt_entries(chunk)
        last = chunk[-1]
        if last.finished:
            watch.finished(last)
            content_id = self.content_id(request.adapter) if request.adapter is not None else None
            event.final = Final(last.finish_reason, last.text, len(last.token_ids), content_id,
                                last.num_cached_tokens)
        return event

    def _prompt_entries(self, chunk: list) -> list[TokenEntry] | None:
        """The prompt's tokens in the shape of generated ones, from the chunk's output that carries them (the engine
        scores the prompt only when prompt logprobs were asked for, and hands the scores out with the first token)."""
        out = next((out for out in chunk if out.prompt_logprobs), None)
        if out is None:
            return None
        return [TokenEntry(t, self.token_texts.text(t), logprob, top, rank) for t, logprob, top, rank
                in zip(out.prompt_token_ids, out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_ranks)]


def refusal(exc: Exception) -> Refusal:
    """What the edge is told of a request the engine would not start (the exception says its kind), in the words a
    client may read: an error raised in another Ray process (the cache actor) by its own message."""
    return Refusal.of(exc, client_message(exc))


def _token_event(chunk: list, params: SamplingParams) -> TokenEvent:
    """The new tokens of a chunk of outputs (one each; id None for an output without a new token), as columns;
    logprobs only when the request asked for them."""
    outs = chunk
    logprobs = [out.new_logprobs[-1] if out.new_logprobs else None for out in outs] \
        if params.logprobs is not None else None
    top = [out.new_top_logprobs[-1] if out.new_top_logprobs else None for out in outs] if params.logprobs else None
    return TokenEvent([out.new_token_ids[-1] if out.new_token_ids else None for out in outs],
                      [out.delta_text for out in outs], logprobs, top, prompt_tokens=len(outs[-1].prompt_token_ids))


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item
