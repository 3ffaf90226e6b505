"""The quota ledger: every API key's limits for the whole application, whatever its replica count.

One ledger holds, per key, the buckets of its requests and tokens per minute (TokenBucket) and the requests each
replica has in flight against its max_concurrent. Replicas do not ask it per request: each holds a lease of the
key's budget (a second of the key's rate, at least one request or token), spends it locally and tops it up from
the ledger in the background when it runs low (deployments/gate/rate_limits.py: KeyLimiter). A lease is taken
from the bucket, so no replica admits what the bucket did not hold; the bucket refills while leases are out, so
over any window a key gets its limit give or take one lease per replica. Tokens are charged after the fact (a
request's cost is known when it ends): a replica's spending past its lease is debt, paid to the ledger at its next
top-up whatever the bucket holds, and the key then waits for the bucket to refill, on every replica.

Concurrency is exact: a replica asks the ledger for a slot before it admits a request of a key with max_concurrent
(one round trip), and gives it back in the background when the request ends. A replica renews its slots while it
holds any; the slots of one that stopped renewing (it died) are freed after HOLD_TTL_S.

The ledger is plain Python; deployments/gate/ray_ledger.py makes it one Ray actor per application, and LocalLedger
serves a process without Ray (an in-process server, the unit tests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from deployments.gate.auth import KeyLimits

HOLD_TTL_S = 10.0  # a replica's slots outlive its last renewal this long (replicas renew every RENEW_S)
RENEW_S = 2.0


@dataclass
class TokenBucket:
    """Up to a minute's allowance, refilled continuously: a key may burst to its per-minute figure, then runs at
    its rate. Its level may go below zero (tokens charged after the fact): that debt is paid back before the next
    unit is granted."""
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


@dataclass(frozen=True)
class BudgetAsk:
    """A replica's top-up of one budget (requests or tokens)."""
    debt: float = 0.0  # spent past what was granted: paid whatever the bucket holds
    wanted: float = 0.0  # a new lease, granted from what the bucket holds, in whole units


@dataclass(frozen=True)
class BudgetGrant:
    granted: float = 0.0  # the debt paid and the lease granted: what the replica adds to its balance
    wait_s: float = 0.0  # 0 when the whole lease was granted, else how long until the bucket holds one unit


@dataclass(frozen=True)
class LeaseAsk:
    """What one replica asks for one key: top-ups of its budgets and the slots it wants to hold in all."""
    replica: str
    key: str
    limits: KeyLimits
    requests: BudgetAsk = BudgetAsk()
    tokens: BudgetAsk = BudgetAsk()
    in_flight: int = 0  # the key's requests running on this replica: slots it keeps whatever it wants
    slots_wanted: int = 0


@dataclass(frozen=True)
class Lease:
    requests: BudgetGrant = BudgetGrant()
    tokens: BudgetGrant = BudgetGrant()
    slots: int = 0  # the slots this replica holds now, its requests in flight included


@dataclass
class _Holding:
    slots: int
    renewed: float = field(default_factory=time.monotonic)


class KeyLedger:
    """One key's buckets and slot holdings, for its limits as configured."""

    def __init__(self, limits: KeyLimits):
        self.limits = limits
        self.requests = TokenBucket(limits.requests_per_minute) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute) if limits.tokens_per_minute else None
        self.holdings: dict[str, _Holding] = {}

    def lease(self, ask: LeaseAsk) -> Lease:
        return Lease(_grant(self.requests, ask.requests), _grant(self.tokens, ask.tokens), self._slots(ask))

    def _slots(self, ask: LeaseAsk) -> int:
        """Slots up to what the others leave free, never fewer than the replica has in flight."""
        if self.limits.max_concurrent is None:
            return 0
        self._expire()
        others = sum(h.slots for replica, h in self.holdings.items() if replica != ask.replica)
        slots = max(ask.in_flight, min(ask.slots_wanted, self.limits.max_concurrent - others))
        if slots:
            self.holdings[ask.replica] = _Holding(slots)
        else:
            self.holdings.pop(ask.replica, None)
        return slots

    def _expire(self) -> None:
        stale = time.monotonic() - HOLD_TTL_S
        for replica in [r for r, h in self.holdings.items() if h.renewed < stale]:
            del self.holdings[replica]

    def leave(self, replica: str) -> None:
        self.holdings.pop(replica, None)


def _grant(bucket: TokenBucket | None, ask: BudgetAsk) -> BudgetGrant:
    """Pay the debt, then grant what the bucket holds of the lease asked for, in whole units."""
    if bucket is None or not (ask.debt or ask.wanted):
        return BudgetGrant()
    bucket.take(ask.debt)
    granted = min(ask.wanted, math.floor(max(0.0, bucket.level)))
    bucket.take(granted)
    wait = bucket.wait_s(1) if granted < ask.wanted else 0.0
    return BudgetGrant(ask.debt + granted, wait)


class QuotaLedger:
    """Every key's ledger, by its name and limits: a redeploy that changes a key's limits starts it afresh, and
    while it rolls out, the old replicas and the new ones each hold the figures they were given."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, KeyLimits], KeyLedger] = {}

    def lease(self, ask: LeaseAsk) -> Lease:
        ledger = self._keys.get((ask.key, ask.limits))
        if ledger is None:
            ledger = self._keys[ask.key, ask.limits] = KeyLedger(ask.limits)
        return ledger.lease(ask)

    def leave(self, replica: str) -> None:
        """A replica that stops gives its slots back at once."""
        for ledger in self._keys.values():
            ledger.leave(replica)


class Ledger(Protocol):
    """Where a replica's limiters top up their leases: LocalLedger, or the application's Ray actor
    (deployments/gate/ray_ledger.py)."""

    async def lease(self, ask: LeaseAsk) -> Lease: ...

    def leave(self, replica: str) -> None: ...


class LocalLedger:
    """The ledger in this process, behind the awaitable interface the Ray actor has (a server without Ray)."""

    def __init__(self) -> None:
        self._ledger = QuotaLedger()

    async def lease(self, ask: LeaseAsk) -> Lease:
        return self._ledger.lease(ask)

    def leave(self, replica: str) -> None:
        self._ledger.leave(replica)
