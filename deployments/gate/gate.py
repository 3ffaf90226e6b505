"""The gate in front of every route but /health: body size, API key, per-key limits; and the admitted tenant.

`GateMiddleware` is plain ASGI, so it acts before FastAPI parses a body: a body over max_request_bytes is
refused (413) without being parsed, and a request without a valid key (401) or over its key's limits (429,
Retry-After) never reaches a route. The admitted request's `Tenant` rides in the ASGI scope's state; routes
check adapters against its scope and charge its tokens, and the middleware counts the request out when its
response has been sent (a stream included), whatever way it ended.

Each server builds its app with its own `Gate` (deployments/routes/routes.py: http_app), from the app args in a
Serve replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.api.errors import RequestRefused, error_response
from deployments.gate.auth import OPEN, ApiKey, KeyRing, KeyScope, Unauthorized
from deployments.gate.quota_ledger import Ledger, LocalLedger
from deployments.gate.rate_limits import KeyLimiter, RateLimited
from deployments.gate.tenant_metrics import TenantMetrics

OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
MAX_REQUEST_BYTES = 8 << 20  # 64 prompts of a full 8k context as token ids fit in about 3 MiB


@dataclass
class Tenant:
    """An admitted request's key (its name and what it may reach), its limiter and the metrics it counts in."""
    name: str  # the key's name: its metrics label
    scope: KeyScope
    limiter: KeyLimiter
    metrics: TenantMetrics
    hide_missing: bool  # with keys, every unknown adapter gets the same answer, in or out of scope

    def check_adapter(self, adapter_id: str) -> None:
        if not self.scope.allows_adapter(adapter_id):
            raise RequestRefused(not_found(adapter_id), 404)

    def check_base(self) -> None:
        if not self.scope.base_model:
            raise RequestRefused("this API key may not use the base model: name one of its adapters", 403)

    def check_priority(self, priority: int) -> None:
        """A key with min_priority may not ask to be served ahead of it: tenants that share a server cannot
        overtake each other past what the operator gave them."""
        floor = self.scope.min_priority
        if floor is not None and priority < floor:
            raise RequestRefused(f"this API key may ask priority {floor} or above (lower is more urgent), "
                                 f"got {priority}", 403)

    def check_manage(self, adapter_id: str) -> None:
        if not self.scope.manage_adapters:
            raise RequestRefused("this API key may not load or unload adapters", 403)
        if not self.scope.allows_adapter(adapter_id):
            raise RequestRefused(f"this API key may not load or unload adapter {adapter_id!r}", 403)

    def visible(self, adapter_ids) -> list[str]:
        return [a for a in adapter_ids if self.scope.allows_adapter(a)]

    def not_found_message(self, adapter_id: str | None, message: str) -> str:
        return not_found(adapter_id) if self.hide_missing and adapter_id is not None else message

    def release(self) -> None:
        self.limiter.release()

    def charge(self, prompt_tokens: int, generated_tokens: int) -> None:
        self.limiter.charge(prompt_tokens + generated_tokens)
        self.metrics.tokens(self.name, prompt_tokens, generated_tokens)


def not_found(adapter_id: str) -> str:
    return f"adapter {adapter_id!r} not found"


@dataclass(frozen=True)
class GateConfig:
    """What build_app hands each replica: the keys (hashes only, read from the app args and key file once, on
    the driver), the body size limit, and how many keys keep their own metric labels."""
    keys: tuple[ApiKey, ...] = ()
    max_request_bytes: int = MAX_REQUEST_BYTES
    top_tenants: int = 20

    @property
    def limited(self) -> bool:
        """Whether any key has limits: only then do replicas share a quota ledger."""
        return any(key.limits != OPEN.limits for key in self.keys)


class Gate:
    """A replica's keys, their limiters and metrics, and the body size limit. The limiters hold the keys' limits
    for the whole application through `ledger` (deployments/gate/quota_ledger.py), which knows this replica as
    `replica`; without one, for this process alone."""

    def __init__(self, config: GateConfig, ledger: Ledger | None = None, replica: str = "local"):
        self.ring = KeyRing(list(config.keys))
        self.max_request_bytes = config.max_request_bytes
        self.metrics = TenantMetrics(config.top_tenants)
        self._ledger, self._replica = ledger or LocalLedger(), replica
        self.limiters = {key.name: KeyLimiter(key.name, key.limits, self._ledger, replica) for key in self.ring.keys}
        self._open = KeyLimiter(OPEN.name, OPEN.limits, self._ledger, replica)  # a key-less server has no limits

    def close(self) -> None:
        """This replica stops: the ledger frees its slots now, not at their expiry."""
        self._ledger.leave(self._replica)

    async def admit(self, authorization: str | None) -> Tenant:
        """The request's tenant, counted in; RequestRefused with 401, 429 or 503 otherwise."""
        try:
            key = self.ring.authenticate(authorization)
        except Unauthorized as exc:
            self.metrics.request(None, "unauthorized")
            raise RequestRefused(str(exc), 401) from None
        limiter = self.limiters.get(key.name, self._open)
        try:
            await limiter.admit()
        except RateLimited as exc:
            self.metrics.request(key.name, "rate_limited")
            raise RequestRefused(str(exc), exc.status, exc.retry_after_s) from None
        self.metrics.request(key.name, "admitted")
        return Tenant(key.name, key.scope, limiter, self.metrics, self.ring.enabled)


class GateMiddleware:
    """ASGI middleware: the gate of the app's server, before any route."""

    def __init__(self, app, gate: Gate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        gate = self.gate
        try:
            receive = await _bounded_body(scope, receive, gate.max_request_bytes)
            tenant = await gate.admit(_header(scope, b"authorization"))
        except RequestRefused as exc:
            response = error_response(scope["path"], str(exc), exc.status, exc.retry_after_s)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        try:
            await self.app(scope, receive, send)
        finally:
            tenant.release()


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _bounded_body(scope, receive, limit: int):
    """Read the whole body (413 past `limit` bytes, told by Content-Length or counted), and a receive that
    replays it, then goes on to the client's own (which reports a disconnect)."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestRefused(f"the request body is {int(declared)} bytes; the limit is {limit}", 413)
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return _replay([message], receive)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise RequestRefused(f"the request body is over the limit of {limit} bytes", 413)
        more = message.get("more_body", False)
    return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed
