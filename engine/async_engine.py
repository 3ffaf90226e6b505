"""AsyncEngine: the engine's step loop on a background thread, with one async stream per request.

torch releases the GIL inside its kernels, and so do the engine's C++ operators (engine/kernels/cpu/bindings.cpp),
so the event loop stays responsive while a step runs.
New requests and aborts are handed to the loop thread and applied between steps; a step's outputs go back
to their requests' asyncio queues with one call_soon_threadsafe per event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import OVERLOADED_RETRY_AFTER_S, EngineDeadError, EngineOverloadedError
from engine.llm_engine import LLMEngine, Prompt, TrackedRequest
from engine.lora.provider import AdapterProviderFactory
from engine.memory import MemoryReport
from engine.outputs import AdapterStats, EngineStats, RequestOutput
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.executor.workers import WorkerLauncher

# A base-model prompt up to this many characters, with no grammar to compile, is prepared on the event loop: its
# tokenization is quick, while a worker thread's turn cost far more of TTFT under load, waiting for the GIL
# beside the step thread. Longer prompts, grammars and adapter reads (a disk read when cold)
# still go to a worker thread, so they never stall the loop.
INLINE_PROMPT_CHARS = 2048

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _prepares_quickly(prompt: Prompt, params: SamplingParams, adapter: str | None) -> bool:
    short = len(prompt) <= INLINE_PROMPT_CHARS if isinstance(prompt, str) else True
    return short and adapter is None and params.response_format is None


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, adapters: AdapterProviderFactory | None = None,
                 workers: WorkerLauncher | None = None, **overrides):
        """adapters: the provider's factory when max_loras > 0 (by default lora_cache's); workers: where tensor-parallel ranks
        1..N-1 run, None for local processes (LLMEngine)."""
        self.engine = LLMEngine(config or EngineConfig.from_overrides(**overrides), adapters, workers)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[TrackedRequest] = []
        self._preparing = 0  # requests past the queue check whose prompt is still being tokenized
        self._pending_aborts: list[tuple[str, asyncio.Future | None]] = []
        self._pending_slot_changes: list[Callable[[], bool]] = []  # adapters into or out of device slots
        self._wakeup = threading.Event()
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="lora-serve-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        """The step loop runs, and so does every tensor-parallel worker (an idle engine would find a dead one only
        at its next step)."""
        return self._error is None and self._thread.is_alive() and self.engine.workers_alive()

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt and output tokens) a request may reach."""
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def memory(self) -> MemoryReport:
        return self.engine.memory()

    def adapter_stats(self) -> dict[str, AdapterStats]:
        return self.engine.adapter_stats()

    def cached_prefix_digests(self) -> frozenset[int]:
        return self.engine.cached_prefix_digests()

    def prompt_digests(self, token_ids: list[int], adapter_id: str | None) -> list[int]:
        return self.engine.prompt_digests(token_ids, adapter_id)

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request (of the base model, or of LoRA adapter `adapter`);
        closing the stream early aborts the request."""
        chunks = self.generate_chunks(request_id, prompt, params, adapter)
        try:
            async for chunk in chunks:
                for out in chunk:
                    yield out
        finally:
            await chunks.aclose()

    async def generate_chunks(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                              adapter: str | None = None) -> AsyncIterator[list[RequestOutput]]:
        """Like generate, but each item is every output ready at that moment (one or more): a consumer slower
        than the engine, such as a stream through Ray, pays its per-item cost once per chunk, not per token."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        self._reserve_queue_place()
        params = params or SamplingParams()
        try:
            if _prepares_quickly(prompt, params, adapter):
                prepared = self.engine.prepare_request(request_id, prompt, params, adapter)
            else:
                prepared = await asyncio.to_thread(self.engine.prepare_request, request_id, prompt, params, adapter)
        finally:
            with self._lock:
                self._preparing -= 1
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._error is not None:  # it died while this prompt was prepared: no one would answer the stream
                raise EngineDeadError(f"engine loop died: {self._error!r}")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending_adds.append(prepared)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                errors = [item for item in items if isinstance(item, BaseException)]
                if errors:
                    raise errors[0]
                finished = items[-1].finished
                yield items
        finally:
            if not finished:
                self._request_abort(request_id, None)

    def _reserve_queue_place(self) -> None:
        with self._lock:
            waiting = self.engine.num_waiting() + len(self._pending_adds) + self._preparing
            if waiting >= self.engine.config.scheduler.max_waiting_requests:
                raise EngineOverloadedError(waiting, retry_after_s=OVERLOADED_RETRY_AFTER_S)
            self._preparing += 1

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its KV blocks are free."""
        done = asyncio.get_running_loop().create_future()
        self._request_abort(request_id, done)
        await done

    def _request_abort(self, request_id: str, done: asyncio.Future | None) -> None:
        with self._lock:
            self._pending_aborts.append((request_id, done))
        self._wakeup.set()

    def load_adapter(self, adapter_id: str) -> None:
        """Copy the adapter into a device slot between two steps, unpinned, so that its first request here finds
        it there (the provider must hold it already: the step loop would wait for a fetch). Skipped when every slot
        is pinned then."""
        self._change_slots(functools.partial(self.engine.load_adapter, adapter_id))

    def unload_adapter(self, adapter_id: str) -> None:
        """Free the adapter's device slot between two steps, unless running requests pin it then (its slot is
        then freed as any idle slot is, when another adapter needs one)."""
        self._change_slots(functools.partial(self.engine.unload_adapter, adapter_id))

    def _change_slots(self, change: Callable[[], bool]) -> None:
        with self._lock:
            self._pending_slot_changes.append(change)
        self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # a step still running keeps its workers until interpreter exit
            self.engine.close()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - every waiting stream must learn of it
            log.exception("engine loop died; every request of this engine fails from now on")
            self._error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for stream in streams:
                stream.put(EngineDeadError(f"engine loop died: {exc!r}"))

    def _apply_pending(self) -> None:
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            slot_changes, self._pending_slot_changes = self._pending_slot_changes, []
        for change in slot_changes:
            try:
                change()
            except Exception:  # noqa: BLE001 - an adapter that cannot go into a slot now waits for its requests
                log.warning("could not change an adapter's device slot", exc_info=True)
        for prepared in adds:
            self.engine.add_prepared(prepared)
        for request_id, done in aborts:
            self.engine.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)
            if done is not None:
                done.get_loop().call_soon_threadsafe(_resolve, done)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their streams with one wake-up per event loop, not one per output: each
        wake-up of a loop takes the GIL from this thread, between the step's torch ops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outs:
                stream = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
