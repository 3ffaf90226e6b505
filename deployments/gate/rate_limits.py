"""Per-key limits at one replica: requests and tokens per minute, and requests in flight, held for the whole
application by the quota ledger (deployments/gate/quota_ledger.py).

A KeyLimiter spends the leases its replica holds and tops them up from the ledger in the background when they run
low, so a request waits on the ledger only when its replica's lease is spent (a key's first request at a replica,
or a key at its limit), or to take a slot for a key with max_concurrent. While the ledger says a budget is empty,
the limiter refuses at once (429, Retry-After: when the ledger said it holds one again) without asking it again.
A ledger that does not answer within LEDGER_TIMEOUT_S gets the requests it had to decide 503 with Retry-After:
retryable, and no key goes past its limits meanwhile.

A request takes one from the request budget when admitted; its tokens (prompt and generated) are charged when
they are known, which may take the budget below zero: that debt is paid to the ledger, and the key's next request,
on any replica, waits until the bucket has refilled. Charging after the fact, rather than reserving max_tokens up
front, counts what a request really cost: most stop well before their max_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from deployments.gate.auth import KeyLimits
from deployments.gate.quota_ledger import RENEW_S, BudgetAsk, BudgetGrant, LeaseAsk, Ledger

LEDGER_TIMEOUT_S = 2.0
logger = logging.getLogger(__name__)


class RateLimited(Exception):
    """Over a key's limit (HTTP 429), or its limits could not be checked (503); retry_after_s says when to retry."""

    def __init__(self, message: str, retry_after_s: float, status: int = 429):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status = status


@dataclass
class Budget:
    """This replica's balance of one of a key's budgets: what the ledger granted less what was spent (below zero:
    debt), and until when the ledger said its bucket is empty."""
    per_minute: int
    balance: float = 0.0
    empty_until: float = 0.0

    @property
    def lease(self) -> float:
        return max(1.0, math.floor(self.per_minute / 60))  # a second of the key's rate

    def ask(self) -> BudgetAsk:
        return BudgetAsk(max(0.0, -self.balance), max(0.0, self.lease - max(0.0, self.balance)))

    def settle(self, grant: BudgetGrant) -> None:
        self.balance += grant.granted
        self.empty_until = time.monotonic() + grant.wait_s if grant.wait_s else 0.0

    def empty_for_s(self) -> float:
        return max(0.0, self.empty_until - time.monotonic())

    def undecided(self) -> bool:
        """Spent, and not known to be empty: only the ledger can tell."""
        return self.balance < 1 and not self.empty_for_s()


class KeyLimiter:
    """One key's limits at this replica: its budgets, the slots it holds and its requests in flight."""

    def __init__(self, key: str, limits: KeyLimits, ledger: Ledger, replica: str):
        self.key, self.limits, self._ledger, self._replica = key, limits, ledger, replica
        self.requests = Budget(limits.requests_per_minute) if limits.requests_per_minute else None
        self.tokens = Budget(limits.tokens_per_minute) if limits.tokens_per_minute else None
        self.in_flight = 0
        self._slots = 0  # held at the ledger, this replica's requests in flight included
        self._asking = 0  # admissions waiting on the ledger for a slot
        self._sync: asyncio.Task | None = None
        self._again = False  # something changed while a sync was on its way: sync once more
        self._renewal: asyncio.TimerHandle | None = None
        self._unreachable = False

    def _budgets(self) -> list[Budget]:
        return [b for b in (self.requests, self.tokens) if b is not None]

    async def admit(self) -> None:
        """Count a request in, or raise RateLimited with the limit it meets."""
        for _ in range(2):  # a sync already on its way may not have counted this request; then one of its own
            if not self._needs_ledger():
                break
            await self._ask_ledger()
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        if self.requests is not None:
            self.requests.balance -= 1
        self.in_flight += 1
        if any(b.balance < b.lease / 2 for b in self._budgets()):
            self._sync_soon()

    def release(self) -> None:
        self.in_flight -= 1
        if self.limits.max_concurrent is not None:
            self._sync_soon()  # the slot goes back

    def charge(self, tokens: int) -> None:
        if self.tokens is not None:
            self.tokens.balance -= tokens
            if self.tokens.balance < self.tokens.lease / 2:
                self._sync_soon()

    def _wants_slot(self) -> bool:
        return self.limits.max_concurrent is not None and self.in_flight >= self._slots

    def _needs_ledger(self) -> bool:
        return self._wants_slot() or any(b.undecided() for b in self._budgets())

    async def _ask_ledger(self) -> None:
        asking = self._wants_slot()
        self._asking += asking
        try:
            await asyncio.shield(self._start_sync())
        finally:
            self._asking -= asking

    def _refusal(self) -> RateLimited | None:
        limits = self.limits
        if self._wants_slot():
            return self._refused(f"this API key has {limits.max_concurrent} requests in flight, its limit "
                                 f"(max_concurrent {limits.max_concurrent}): wait for one to finish", 1.0)
        if self.requests is not None and self.requests.balance < 1:
            return self._refused(f"this API key's limit of {limits.requests_per_minute} requests per minute is "
                                 f"reached", self.requests.empty_for_s())
        if self.tokens is not None and self.tokens.balance < 1:
            return self._refused(f"this API key's limit of {limits.tokens_per_minute} tokens per minute is "
                                 f"reached", self.tokens.empty_for_s())
        return None

    def _refused(self, message: str, retry_after_s: float) -> RateLimited:
        if self._unreachable:
            return RateLimited("this API key's limits could not be checked (the quota ledger did not answer): "
                               "try again", 1.0, 503)
        return RateLimited(message, max(retry_after_s, 1.0))

    def _sync_soon(self) -> None:
        if self._sync is not None:
            self._again = True
        else:
            self._start_sync()

    def _start_sync(self) -> asyncio.Task:
        if self._sync is None:
            self._sync = asyncio.get_running_loop().create_task(self._synced())
        return self._sync

    async def _synced(self) -> None:
        try:
            self._again = True
            while self._again:
                self._again = False
                await self._lease()
        finally:
            self._sync = None
            self._renew_later()

    async def _lease(self) -> None:
        """One round trip: pay debts, top the leases up, hold the slots wanted."""
        ask = LeaseAsk(self._replica, self.key, self.limits, _ask(self.requests), _ask(self.tokens),
                       self.in_flight, min(self.in_flight + self._asking, self.limits.max_concurrent or 0))
        try:
            lease = await asyncio.wait_for(self._ledger.lease(ask), LEDGER_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure of the call: decide nothing new, say 503 where it mattered
            self._unreachable = True
            logger.warning("the quota ledger did not answer for key %r: %r", self.key, exc)
            return
        self._unreachable = False
        for budget, grant in ((self.requests, lease.requests), (self.tokens, lease.tokens)):
            if budget is not None:
                budget.settle(grant)
        self._slots = lease.slots

    def _renew_later(self) -> None:
        """While it holds slots, this replica renews them (the ledger frees a silent replica's)."""
        if self._renewal is not None:
            self._renewal.cancel()
        self._renewal = (asyncio.get_running_loop().call_later(RENEW_S, self._sync_soon)
                         if self._slots else None)


def _ask(budget: Budget | None) -> BudgetAsk:
    return budget.ask() if budget is not None else BudgetAsk()
