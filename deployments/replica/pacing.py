"""Fewer, larger events under load: when a request's stream in an engine replica sends its next event.

Each item of a Ray stream costs the replica's Ray and event-loop threads CPU and, worse, the GIL, which the
engine's step thread needs between every torch op: with one event per token, the events of 32 streams slowed
every engine step. So a replica paces its streams to a total of about `events_per_s`: with n streams open, a
stream sends at most one event every n / events_per_s seconds and holds the tokens in between (a stream's first
and last events always go at once). A lone stream still gets each token as it comes (its interval is shorter
than a step); 32 streams get a few tokens per event. The engine adds to this: a step's outputs wake each event
loop once (engine/async_engine.py), not once per request.

The budget alone makes a reader wait n / events_per_s between bursts of text (half a second at 32 streams), so the
interval is capped at `stream_interval_ms` (AppArgs): under load a stream's events still hold several tokens, and
none of its gaps is much longer than the cap plus a step.

Under `serve run serve_config.yaml` with one engine thread, four tokens per event instead of one raised the
tokens/s of 8 and of 32 concurrent streams and lowered their TPOT. With the engine on both cores (Intel OpenMP), a
budget of 32 events/s served the same as 64; 128 served less.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.api.events import TokenEvent

EVENTS_PER_S = 64.0
STREAM_INTERVAL_MS = 25.0  # the longest a producing stream holds its tokens (AppArgs.stream_interval_ms)


@dataclass
class StreamPace:
    """One request's stream: due() says whether its held tokens should go now. Pacing starts once some text has
    gone (a first token whose text the detokenizer still holds back must not delay the first visible one)."""
    pacer: EventPacer
    last_sent: float | None = None

    def due(self) -> bool:
        return self.last_sent is None or time.monotonic() - self.last_sent >= self.pacer.interval_s()

    def sent(self, event: TokenEvent) -> None:
        if self.last_sent is not None or any(event.texts):
            self.last_sent = time.monotonic()

    def __enter__(self) -> StreamPace:
        self.pacer.open_streams += 1
        return self

    def __exit__(self, *exc) -> None:
        self.pacer.open_streams -= 1


@dataclass
class EventPacer:
    """The replica's streams share an event budget, but none waits longer than max_interval_s between events;
    stream() opens one (as a context manager) once its request produces tokens, so requests still queued in the
    engine take none of the budget."""
    events_per_s: float = EVENTS_PER_S
    max_interval_s: float = STREAM_INTERVAL_MS / 1000
    open_streams: int = field(default=0)

    def interval_s(self) -> float:
        return min(self.open_streams / self.events_per_s, self.max_interval_s)

    def stream(self) -> StreamPace:
        return StreamPace(self)
