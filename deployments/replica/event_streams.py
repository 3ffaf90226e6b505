"""A request's events as the HTTP routes read them: served here, or forwarded to a peer with failover.

Both kinds are async iterators of TokenEvent | Refusal with cancel(), which stops the engine request behind them
(the routes call it when a client leaves or another choice of the request fails).

A forwarded request whose peer dies (its process killed, its node removed: Ray's RayActorError) before any event
came back has sent nothing to the client yet, so this replica serves it itself, from the start: a replica's death
costs its forwarded requests a restart, not an error. Once events have gone out, the text cannot be continued
elsewhere as it would have gone on (the peer's sampling state died with it), so the stream ends with PeerLost,
which the routes answer with an error event that ends the response. Without this, the route raised Ray's error:
a 500 whose traceback named processes and addresses.

A forwarded request that Serve's router sent back to its sender (its target stopped after the sender chose it, and
no other replica runs) is refused there at once with ReturnedToSender, and the sender serves it, from the start,
as it does when the peer died. Sender and receiver are then one process, so the receiver also marks the forward as
come back in process (Comebacks), and the sender stops waiting at once: a Ray stream from a replica onto itself
sometimes never ends on Ray 2.60, not even with the error that refuses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from ray.exceptions import RayActorError

from deployments.api.events import PeerLost, TokenEvent
from engine.errors import Refusal

log = logging.getLogger("ray.serve")


class ReturnedToSender(Exception):
    """Raised by the replica that forwarded a request, when the request came back to it (before any event)."""


class Comebacks:
    """This replica's forwards in flight, by id: the one that Serve's router sends back here is marked, in process.
    Its futures are thread-safe, as the receiving call may run on another event loop than the sender's."""

    def __init__(self):
        self._open: dict[str, concurrent.futures.Future] = {}

    def open(self) -> tuple[str, concurrent.futures.Future]:
        """A new forward's id, and the future that completes if it comes back here."""
        forward_id = uuid.uuid4().hex
        self._open[forward_id] = back = concurrent.futures.Future()
        return forward_id, back

    def came_back(self, forward_id: str | None) -> None:
        back = self._open.get(forward_id)
        if back is not None and back.set_running_or_notify_cancel():
            back.set_result(None)

    def close(self, forward_id: str) -> None:
        self._open.pop(forward_id, None)


class LocalEvents:
    """The events of a request this replica serves itself."""

    def __init__(self, events: AsyncIterator[TokenEvent | Refusal], abort):
        self._events = events
        self._abort = abort  # a coroutine function: stops the engine request and frees its KV blocks

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | Refusal:
        return await self._events.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._abort())


class ForwardedEvents:
    """The events of a request forwarded to a peer (a Serve response stream); served here instead, from the start,
    if the peer dies before its first event."""

    def __init__(self, forwarded, serve_here: Callable[[], LocalEvents], on_end: Callable[[], None] = lambda: None,
                 came_back: concurrent.futures.Future | None = None):
        """on_end: called once when the request ends, however it ends (the sender counts its forwards in flight);
        came_back: completes if the request comes back to this replica (Comebacks)."""
        self._events = forwarded
        self._serve_here = serve_here
        self._on_end = on_end
        self._came_back = came_back
        self._started = False  # an event came back: the client may have it

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | Refusal:
        try:
            event = await self._next()
        except BaseException:
            self._end()
            raise
        self._started = True
        return event

    async def _next(self) -> TokenEvent | Refusal:
        try:
            return await (self._first() if not self._started and self._came_back else self._events.__anext__())
        except ReturnedToSender:
            log.info("a forwarded request came back to this replica, which serves it")
            return await self._restart_here()
        except RayActorError as exc:
            if self._started:
                raise PeerLost() from exc
            log.warning("the peer serving a forwarded request died before its first event (%s); serving it "
                        "here", type(exc).__name__)
            return await self._restart_here()

    async def _first(self) -> TokenEvent | Refusal:
        """The first event; ReturnedToSender as soon as the request comes back here, whether or not Ray's stream
        onto this replica ends."""
        step = asyncio.ensure_future(self._events.__anext__())
        back, self._came_back = asyncio.wrap_future(self._came_back), None
        try:
            await asyncio.wait({step, back}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the client leaves meanwhile
            back.cancel()
            answered = step.done()
            if not answered:
                step.add_done_callback(_retrieved)
                step.cancel()
        if answered:
            return step.result()
        raise ReturnedToSender()

    async def _restart_here(self) -> TokenEvent | Refusal:
        """The request served here from the start, in place of the forwarded stream, which ended before its first
        event."""
        self._events.cancel()
        self._events = self._serve_here()
        return await self._events.__anext__()

    def cancel(self) -> None:
        self._end()
        self._events.cancel()

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, lambda: None
        on_end()


def _retrieved(task: asyncio.Future) -> None:
    """A step given up on: its outcome is read, so that asyncio logs no unretrieved error."""
    if not task.cancelled():
        task.exception()
