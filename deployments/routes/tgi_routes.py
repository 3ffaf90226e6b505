"""LoRAX's and TGI's routes: /generate (best_of included), /generate_stream and TGI's root route, with LoRAX's
adapter_id, adapter_source and merged_adapters; deployments/api/tgi_render.py renders the answers."""


from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from deployments.api.errors import RequestRefused, client_message
from deployments.api.events import TokenEvent
from deployments.api.tgi_protocol import GenerateRequest
from deployments.api.tgi_render import TgiRenderer
from deployments.gate.gate import Tenant
from deployments.routes.choice_streams import Metered, wholes
from deployments.routes.edge import (
    check_scope,
    first_event,
    refusal_events,
    served_of,
    start_choices,
    tenant_of,
)
from deployments.routes.engine_client import Served
from engine.errors import Refusal
from engine.lora.ids import validate_adapter_id
from engine.sampling import SamplingParams
from lora_cache.adapter_folder import AdapterCacheUnavailableError

router = APIRouter()


@router.post("/")
async def root(request: GenerateRequest, http: Request):
    """TGI's root route: /generate_stream when `stream` is set, else /generate's answer in a list."""
    if request.stream:
        return await generate_stream(request, http)
    response = await generate(request, http)
    return [response] if isinstance(response, dict) else response


@router.post("/generate")
async def generate(request: GenerateRequest, http: Request):
    """One sequence, or with best_of that many drawn at once: the one whose tokens' logprobs sum highest
    answers (as TGI picks), the others in details.best_of_sequences."""
    served = served_of(http)
    tenant, count = tenant_of(http), request.parameters.sequences
    starter = lambda stream: _events(served, request, tenant, stream)  # noqa: E731
    lasts = await wholes(await start_choices([[starter] * count], False, request.max_tokens_name()))
    return TgiRenderer(request, served.tgi).body(lasts)


@router.post("/generate_stream")
async def generate_stream(request: GenerateRequest, http: Request):
    """LoRAX's streamed generation: one server-sent event per token, the last with the whole text."""
    served = served_of(http)
    if request.parameters.sequences > 1:
        raise RequestRefused("best_of > 1 is not supported when streaming (as in TGI): use /generate", 422)
    events = _events(served, request, tenant_of(http))
    first = await first_event(events, request.max_tokens_name())
    return StreamingResponse(TgiRenderer(request, served.tgi).sse(first, events), media_type="text/event-stream")


def _events(served: Served, request: GenerateRequest, tenant: Tenant, stream: bool = True) -> Metered:
    """The request's events, charged to its tenant; RequestRefused for an adapter outside the tenant's scope."""
    parameters = request.parameters
    merged = parameters.merged_adapters
    for adapter in merged.ids if merged is not None else [parameters.adapter_id]:
        check_scope(tenant, adapter)
    return Metered(_request_events(served, request, stream), tenant, parameters.adapter_id)


def _request_events(served: Served, request: GenerateRequest, stream: bool) -> AsyncIterator[TokenEvent | Refusal]:
    """The request's events from the engine, or a refusal made here as its only event."""
    parameters = request.parameters
    source = parameters.adapter_source
    if source is not None and source != served.config.sources.kind:
        return refusal_events(f"adapter_source {source!r} is not served here; this server reads adapters "
                             f"from {served.config.sources.kind!r}")
    try:
        params = parameters.to_sampling_params()
        if parameters.adapter_id is not None:
            validate_adapter_id(parameters.adapter_id)
    except ValueError as exc:  # a combination the engine refuses; an id that is not an adapter id
        return refusal_events(str(exc))
    if parameters.merged_adapters is not None:
        return _merged_stream(served, request, params, stream)
    return served.client.generate(request.inputs, params, parameters.adapter_id, stream)


async def _merged_stream(served: Served, request: GenerateRequest, params: SamplingParams,
                         stream: bool) -> AsyncIterator[TokenEvent | Refusal]:
    """LoRAX's merged_adapters: the events of the request on the merge of its adapters."""
    try:
        key = await served.client.merge_adapters(request.parameters.merged_adapters.to_spec())
    except (ValueError, AdapterCacheUnavailableError) as exc:  # a bad spec, no LoRA, a cache that does not answer
        yield Refusal.of(exc, client_message(exc))
        return
    async for event in served.client.generate(request.inputs, params, key, stream):
        yield event
