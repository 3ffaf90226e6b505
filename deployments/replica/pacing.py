"""Fewer, larger events under load: when a request's stream in an engine replica sends its next event.

Each item of a Ray stream costs the replica's Ray and event-loop threads CPU and, worse, the GIL, which the
engine's step thread needs between every torch op: with one event per token, the events of 32 streams slowed
every engine step. So a replica paces its streams to a total of about `events_per_s`: with n streams open, a
stream sends at most one event every n / events_per_s seconds and holds the tokens in between (a stream's first
and last events always go at once). A lone stream still gets each token as it comes (its interval is shorter
than a step); 32 streams get a few tokens per event. The engine adds to this: a step's outputs wake each event
loop once (engine/async_engine.py), not once per request.

Measured on 2 cores (SmolLM2 bf16, `serve run serve_config.yaml`, streamed /v1/completions x 64 tokens, one
engine thread): four tokens per event instead of one took 32 concurrent streams from 195-209 to 272 tok/s and
TPOT p50 from 140-154 to 103 ms, and 8 streams from 119-138 to 169 tok/s. With the engine on both cores (Intel
OpenMP), a budget of 32 events/s served the same as 64 (356-360 tok/s at 32 streams, 175-180 at 8); 128 served
8-18% less.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.api.events import TokenEvent

EVENTS_PER_S = 64.0


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
    """The replica's streams share an event budget; stream() opens one (as a context manager)."""
    events_per_s: float = EVENTS_PER_S
    open_streams: int = field(default=0)

    def interval_s(self) -> float:
        return self.open_streams / self.events_per_s

    def stream(self) -> StreamPace:
        return StreamPace(self)
