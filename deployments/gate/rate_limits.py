"""Per-key limits: requests and tokens per minute (token buckets) and requests in flight.

A bucket holds up to a minute's allowance and refills continuously, so a key may burst to its per-minute figure
and then runs at its rate. A request takes one from the request bucket when admitted; its tokens (prompt and
generated) are charged to the token bucket when they are known, which may take the bucket below zero: the key's
next request then waits until the debt is paid back, and is told for how long (Retry-After). Charging after
the fact, rather than reserving max_tokens up front, counts what a request really cost: most stop well before
their max_tokens.

The buckets live in each engine replica, in its event loop (no lock, no Ray hop per request): with R replicas
behind the proxy, a key's figures apply per replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deployments.gate.auth import KeyLimits


class RateLimited(Exception):
    """Over a key's limit (HTTP 429); retry_after_s says when the request would be admitted."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TokenBucket:
    per_minute: float
    level: float = field(init=False)
    _at: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.per_minute, self.level + (now - self._at) * self.per_minute / 60)
        self._at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is in the bucket (0: now)."""
        self._refill()
        return max(0.0, (amount - self.level) * 60 / self.per_minute)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


class KeyLimiter:
    """One key's buckets and its requests in flight."""

    def __init__(self, limits: KeyLimits):
        self.limits = limits
        self.requests = TokenBucket(limits.requests_per_minute) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute) if limits.tokens_per_minute else None
        self.in_flight = 0

    def admit(self) -> None:
        """Count a request in, or raise RateLimited with the limit it meets."""
        limits = self.limits
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            raise RateLimited(f"this API key has {self.in_flight} requests in flight, its limit "
                              f"(max_concurrent {limits.max_concurrent}): wait for one to finish", 1.0)
        if self.requests is not None and (wait := self.requests.wait_s(1)) > 0:
            raise RateLimited(f"this API key's limit of {limits.requests_per_minute} requests per minute is "
                              f"reached", wait)
        if self.tokens is not None and (wait := self.tokens.wait_s(1)) > 0:
            raise RateLimited(f"this API key's limit of {limits.tokens_per_minute} tokens per minute is "
                              f"reached", wait)
        if self.requests is not None:
            self.requests.take(1)
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def charge(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.take(tokens)
