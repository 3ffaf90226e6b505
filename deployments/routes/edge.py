"""What every route module shares: the served engine and the admitted tenant of a request, a tenant's scope,
a request's choices started and their first events, an engine's refusal as an HTTP answer, and the adapters a
tenant sees.

The routes know the engine only through its EngineClient (deployments/routes/engine_client.py). Each choice of a
request is one engine request: a prompt's first choice runs alone until its first token, when the prompt's KV
blocks are cached, and its other choices then start at once and find them there; a refused or failed choice, or a
client that left, stops every choice started.
"""


import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from ray.serve.exceptions import BackPressureError

from deployments.api.chat import ChatMessage, TemplateOptions, chat_prompt
from deployments.api.errors import (
    RequestRefused,
)
from deployments.api.events import TokenEvent
from deployments.api.tools import ToolUse
from deployments.gate.gate import Tenant
from deployments.routes.choice_streams import (
    Choice,
    Metered,
    cancel,
)
from deployments.routes.engine_client import Served
from engine.errors import OVERLOADED_RETRY_AFTER_S, Refusal, RefusalKind
from lora_cache.adapter_folder import AdapterCacheUnavailableError
from lora_cache.cache_stats import AdapterResidence, CacheStats


def served_of(http: Request) -> Served:
    """The engine the app serves, and what the routes keep beside it."""
    return http.app.state.served


STATUS = {RefusalKind.BAD_REQUEST: 400, RefusalKind.NOT_FOUND: 404, RefusalKind.OVERLOADED: 429,
          RefusalKind.UNAVAILABLE: 503}


def refused_answer(refusal: Refusal, max_tokens_name: str) -> RequestRefused:
    """The HTTP answer to an engine's refusal: its kind's status (429 and 503 with Retry-After), and a refused
    max_tokens worded with the route's own name for the parameter, which it names as the field at fault."""
    if refusal.budget is not None:
        return RequestRefused(refusal.budget.message(max_tokens_name), 400, param=max_tokens_name)
    return RequestRefused(refusal.reason, STATUS[refusal.kind], refusal.retry_after_s)


def tenant_of(http: Request) -> Tenant:
    """The tenant the gate admitted this request as (deployments/gate/gate.py)."""
    return http.state.tenant


def check_scope(tenant: Tenant, adapter: str | None) -> None:
    if adapter is None:
        tenant.check_base()
    else:
        tenant.check_adapter(adapter)


async def first_event(events, max_tokens_name: str) -> TokenEvent:
    """The first token event; a refusal arrives as the only event and becomes an HTTP error."""
    try:
        first = await events.__anext__()
    except BackPressureError as exc:  # the engine deployment's max_queued_requests is reached
        raise RequestRefused(f"the server is overloaded, retry later: {exc}", 503,
                             OVERLOADED_RETRY_AFTER_S) from None
    if isinstance(first, Refusal):
        raise refused_answer(first, max_tokens_name)
    return first


async def refusal_events(reason: str) -> AsyncIterator[Refusal]:
    yield Refusal(reason)


async def start_choices(prompts: list[list[Callable[[bool], Metered]]], stream: bool,
                        max_tokens_name: str) -> list[Choice]:
    """Every choice of every prompt (given as starters, in order), with its first event. Each prompt's first
    choice runs alone (streamed, whatever the request asked) until its first token, when the prompt's KV blocks are
    cached; then the prompt's other choices start at once and find them there. With n = 4 choices, a request over a long
    prompt finishes sooner this way than with all four started together (each prefills the prompt) or with each run
    whole after the one before; over a short prompt, sooner than one after another. The prompts' first choices start
    together (sooner than one prompt after another). A refused or failed choice, or a client that left, stops every
    choice started."""
    opened: list[Metered] = []

    def start(starter: Callable[[bool], Metered], as_stream: bool) -> Metered:
        opened.append(starter(as_stream))
        return opened[-1]

    try:
        leads = [start(choices[0], stream or len(choices) > 1) for choices in prompts]
        lead_firsts = await asyncio.gather(*(first_event(events, max_tokens_name) for events in leads))
        rest = [[start(choice, stream) for choice in choices[1:]] for choices in prompts]
        rest_firsts = iter(await asyncio.gather(*(first_event(e, max_tokens_name) for group in rest for e in group)))
    except BaseException:
        cancel(opened)
        raise
    choices = []
    for lead, lead_first, group in zip(leads, lead_firsts, rest):
        choices.append(Choice(lead_first, lead))
        choices += [Choice(next(rest_firsts), events) for events in group]
    return choices


def chat_prompt_of(served: Served, messages: list[ChatMessage], tools: ToolUse | None, options: TemplateOptions) -> str:
    try:
        return chat_prompt(served.tokenizer, messages, tools, options)
    except ValueError as exc:  # a template that cannot render the messages or take tool_choice "auto"
        raise RequestRefused(str(exc), 400) from None


async def listed_adapters(served: Served, tenant: Tenant) -> dict[str, AdapterResidence]:
    """residence, or none while the cache actor restarts or does not answer (a listing still answers)."""
    try:
        return await residence(served, tenant)
    except RequestRefused:
        return {}


async def residence(served: Served, tenant: Tenant) -> dict[str, AdapterResidence]:
    """Adapter id -> residence (object store, replicas' device slots and CPU copies, source loads), of the
    adapters in the tenant's scope; a 503 while the cache actor restarts or does not answer."""
    if not served.lora_enabled:
        return {}
    try:
        stats: CacheStats | None = await served.client.adapter_stats()
    except AdapterCacheUnavailableError as exc:
        raise RequestRefused(str(exc), 503, exc.retry_after_s) from None
    residence = stats.residence() if stats is not None else {}
    return {adapter: residence[adapter] for adapter in tenant.visible(residence)}
