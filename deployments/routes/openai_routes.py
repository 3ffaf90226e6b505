"""OpenAI's routes: completions, chat completions (tools included) and the stateless Responses API, streamed or
not; `model` names the base model or an adapter id, and n choices per prompt run as n engine requests."""


from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from deployments.api import openai_protocol as oai
from deployments.api.chat import TemplateOptions
from deployments.api.errors import RequestRefused
from deployments.api.openai_render import (
    ChatRenderer,
    CompletionRenderer,
    Renderer,
    completion_id,
    request_id,
    usage,
)
from deployments.api.responses_protocol import ResponsesRequest
from deployments.api.responses_render import ResponseRenderer
from deployments.gate.gate import Tenant
from deployments.routes.choice_streams import (
    Metered,
    Started,
    openai_sse,
    response_events,
    wholes,
)
from deployments.routes.edge import (
    chat_prompt_of,
    check_scope,
    served_of,
    start_choices,
    tenant_of,
)
from deployments.routes.engine_client import Served
from engine.lora.ids import validate_adapter_id
from engine.sampling import SamplingParams

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: oai.CompletionRequest, http: Request):
    """OpenAI's completions, streamed or not; `model` names the base model or an adapter."""
    served = served_of(http)
    renderer = CompletionRenderer(request, served.token_texts)
    return await _openai(served, request, http, request.prompts, renderer)


@router.post("/v1/chat/completions")
async def chat_completions(request: oai.ChatRequest, http: Request):
    """OpenAI's chat completions through the model's chat template, tools included, streamed or not."""
    served = served_of(http)
    prompt = chat_prompt_of(served, request.messages, request.tool_use(), request.template_options())
    return await _openai(served, request, http, [prompt], ChatRenderer(request, served.token_texts))


async def _openai(served: Served, request: oai.OpenAISampling, http: Request, prompts: list, render: Renderer):
    """n choices per prompt, each one engine request (start_choices); choice j of prompt i has index i * n + j,
    as in vLLM."""
    started = await _begin(served, request, http, prompts, render.default_max_tokens)
    cid, choices = completion_id(render.id_prefix, started.request_id), started.choices
    if request.stream:
        return StreamingResponse(openai_sse(request, render, cid, [c.first for c in choices],
                                            [c.events for c in choices]), media_type="text/event-stream")
    lasts = await wholes(choices)
    finals = [render.finished(last, prompt)
              for last, prompt in zip(lasts, (p for p in prompts for _ in range(request.n)))]
    return render.body(cid, finals, usage(lasts, request.n))


async def _begin(served: Served, request: oai.OpenAISampling | ResponsesRequest, http: Request, prompts: list,
                 default_max_tokens: int | None) -> Started:
    """The request's id and its started choices, once the tenant's scope and priority, the sampling parameters
    and the adapter's id were checked (a RequestRefused says which failed)."""
    tenant, rid = tenant_of(http), request_id(_client_request_id(request, http))
    adapter = None if request.model == served.model_name else request.model
    check_scope(tenant, adapter)
    tenant.check_priority(request.priority)
    sequences = len(prompts) * request.n
    # could never be queued at once: not worth a retry (429)
    if sequences > served.config.scheduler.max_waiting_requests:
        raise RequestRefused(f"{len(prompts)} prompts x n={request.n} is {sequences} sequences; this server queues "
                             f"at most {served.config.scheduler.max_waiting_requests} (max_waiting_requests)")
    try:
        params = [request.to_sampling_params(default_max_tokens, choice) for choice in range(request.n)]
        if adapter is not None:
            validate_adapter_id(adapter)
    except ValueError as exc:  # a combination the engine refuses, e.g. an empty stop string; a bad id
        raise RequestRefused(str(exc), 400) from None
    starters = [[_starter(served, prompt, p, adapter, tenant) for p in params] for prompt in prompts]
    choices = await start_choices(starters, request.stream, request.max_tokens_name())
    return Started(rid, choices)


def _starter(served: Served, prompt, params: SamplingParams, adapter: str | None,
             tenant: Tenant) -> Callable[[bool], Metered]:
    """start(stream) -> the events of one engine request for this prompt and choice."""
    return lambda stream: Metered(served.client.generate(prompt, params, adapter, stream), tenant, adapter)


def _client_request_id(request: oai.OpenAISampling | ResponsesRequest, http: Request) -> str | None:
    """The body's request_id (vLLM's), else the X-Request-Id header. Serve gives every request that header (the
    client's, or one it makes) and sends it back on the response, so the header cannot tell whether the client set
    it: the body's field, which only a client sets, comes first (vLLM puts the header first)."""
    if request.request_id is not None:
        return request.request_id
    given = http.headers.get("x-request-id")
    try:
        return None if given is None else oai.valid_request_id(given)
    except ValueError as exc:
        raise RequestRefused(f"X-Request-Id {exc}", 400) from None


@router.post("/v1/responses")
async def responses(request: ResponsesRequest, http: Request):
    """OpenAI's Responses API (stateless: store false), streamed as its typed events or not."""
    served = served_of(http)
    prompt = chat_prompt_of(served, request.messages(), request.tool_use(), TemplateOptions())
    render = ResponseRenderer(request, served.token_texts)
    started = await _begin(served, request, http, [prompt], render.default_max_tokens)
    render.name(started.request_id)
    if request.stream:
        return StreamingResponse(response_events(render, started.choices[0]), media_type="text/event-stream")
    return render.body((await wholes(started.choices))[0])
