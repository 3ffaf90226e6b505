"""The HTTP edge: LoRAX / TGI and OpenAI-compatible routes (FastAPI), with SSE streaming.

`HttpRoutes` holds the routes and renders engine events for each API; the engine replica's deployment
(deployments/replica/llm_server.py) takes them through @serve.ingress, so Serve's HTTP proxy hands a request straight to
the replica that runs the engine. A separate ingress deployment cost one more process and one more Ray hop per
event: serving the routes in the engine replica gave more tokens/s, the more so at more concurrent streams.
Status codes are chosen here, at the edge: the replica says why it refuses (deployments/api/events.py), and
deployments/routes/error_handlers.py answers what a route raises. The answers' shapes are rendered apart: LoRAX's and TGI's
in deployments/api/tgi_render.py, OpenAI's in deployments/api/openai_render.py and deployments/api/responses_render.py.
"""

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray.serve.exceptions import BackPressureError

from deployments.api import openai_protocol as oai
from deployments.api.chat import ChatMessage, TemplateOptions, chat_prompt
from deployments.api.errors import BudgetRefused, RequestRefused, client_message, error_response
from deployments.api.events import Refusal, RefusalKind, TokenEvent
from deployments.api.openai_render import ChatRenderer, CompletionRenderer, Renderer, completion_id, request_id, usage
from deployments.api.responses_protocol import ResponsesRequest
from deployments.api.responses_render import ResponseRenderer
from deployments.api.tgi_protocol import GenerateRequest
from deployments.api.tgi_render import TgiRenderer, TgiTokens
from deployments.api.token_texts import TokenTexts
from deployments.api.tokenizing import (
    ChatTokenize,
    Detokenize,
    PromptTokenize,
    TgiTokenize,
    detokenize,
    tokenize_prompt,
    tokenize_tgi,
)
from deployments.api.tools import ToolUse
from deployments.gate.gate import GateMiddleware, Tenant
from deployments.routes.choice_streams import Choice, Metered, Started, cancel, openai_sse, response_events, wholes
from deployments.routes.error_handlers import ENGINE_STOPPED_RETRY_AFTER_S, answer_errors
from engine.adapter_ids import validate_adapter_id
from engine.config import EngineConfig
from engine.errors import OVERLOADED_RETRY_AFTER_S, AdapterNotFoundError
from engine.merge_spec import MergeSpec
from engine.sampling import SamplingParams
from lora_cache.adapter_folder import AdapterCacheUnavailableError
from lora_cache.cache_stats import AdapterResidence, CacheStats
from lora_cache.registry import Registration

app = FastAPI(title="lora-serve")
VERSION = importlib.metadata.version("lora-serve")
app.add_middleware(GateMiddleware)
answer_errors(app)


# Module helpers stand above the routes class: Serve captures the class's globals when it is defined.
def _refused(refusal: Refusal) -> RequestRefused:
    """The HTTP answer to an engine's refusal: 400 for a bad request, 429 with Retry-After when overloaded, 503
    with Retry-After when the adapter cache does not answer."""
    if refusal.kind is RefusalKind.OVERLOADED:
        return RequestRefused(refusal.reason, 429, refusal.retry_after_s)
    if refusal.kind is RefusalKind.UNAVAILABLE:
        return RequestRefused(refusal.reason, 503, refusal.retry_after_s)
    if refusal.budget is not None:
        return BudgetRefused(refusal.budget)
    return RequestRefused(refusal.reason, 404 if refusal.kind is RefusalKind.NOT_FOUND else 400)


@contextlib.contextmanager
def _max_tokens_named(name: str):
    """An engine's refusal of max_tokens, worded with the route's name for the parameter."""
    try:
        yield
    except BudgetRefused as exc:
        raise exc.named(name) from None


async def _lifecycle(change):
    """Await a load or unload in the cache actor; its AdapterError becomes a 404 or a 400 with the reason, a cache
    that does not answer a 503."""
    try:
        return await change
    except AdapterCacheUnavailableError as exc:
        raise RequestRefused(str(exc), 503, exc.retry_after_s) from None
    except AdapterNotFoundError as exc:
        raise RequestRefused(client_message(exc), 404) from None
    except ValueError as exc:  # AdapterError and a server without LoRA
        raise RequestRefused(client_message(exc), 400) from None


def _tenant(http: Request) -> Tenant:
    """The tenant the gate admitted this request as (deployments/gate/gate.py)."""
    return http.state.tenant


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


def _check_scope(tenant: Tenant, adapter: str | None) -> None:
    if adapter is None:
        tenant.check_base()
    else:
        tenant.check_adapter(adapter)


def _model_card(name: str, root: str, parent: str | None, max_model_len: int) -> dict:
    """A /v1/models entry's fields as vLLM gives them: OpenAI's (created as vLLM sets it, at the answer), the
    weights' root, the base model an adapter applies to, and the context a request may fill."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "lora-serve", "root": root,
            "parent": parent, "max_model_len": max_model_len}


def _adapter_card(name: str, base_model: str, where: AdapterResidence, max_model_len: int) -> dict:
    """An adapter's entry in /v1/models: the model card, its content id and lora_path, and its residence."""
    residence = dataclasses.asdict(where)
    lora_path = residence.pop("lora_path")
    return {**_model_card(name, lora_path or name, base_model, max_model_len),
            "content_id": residence.pop("content_id"), "lora_path": lora_path, "residence": residence}


class HttpRoutes:
    """The routes of @serve.ingress(app). The class serving them provides `_stream` (a request's events) and
    `_replica_info` (this replica's memory and prefix-cache figures) and `_engine_running`, and calls
    `_init_routes` first."""

    def _init_routes(self, config: EngineConfig, tokenizer) -> None:
        self.model_name = config.model
        self.config = config
        self.adapter_source = config.adapter_source
        self.lora_enabled = config.max_loras > 0
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.tgi = TgiTokens(self.token_texts)

    def _stream(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                stream: bool = True) -> AsyncIterator[TokenEvent | Refusal]:
        """Events of one or more tokens each (one event with every token when not streaming); the iterator has
        cancel(), which stops its engine request."""
        raise NotImplementedError

    def _replica_info(self) -> dict:
        raise NotImplementedError

    def _engine_running(self) -> bool:
        raise NotImplementedError

    def _max_model_len(self) -> int:
        raise NotImplementedError

    async def _register(self, name: str, lora_path: str) -> Registration:
        raise NotImplementedError

    async def _unregister(self, name: str) -> None:
        raise NotImplementedError

    async def _merge(self, spec: MergeSpec) -> str:
        raise NotImplementedError

    @app.get("/health")
    async def health(self, http: Request):
        """200 while the engine loop runs, else 503 with Retry-After (no API key needed)."""
        if not self._engine_running():
            return error_response(http.url.path, "engine loop is not running", 503, ENGINE_STOPPED_RETRY_AFTER_S)
        return {"status": "ok"}

    @app.get("/version")
    async def version(self) -> dict:
        """vLLM's: the server's version (the lora-serve package's)."""
        return {"version": VERSION}

    @app.get("/info")
    async def info(self, http: Request) -> dict:
        """The served model and engine limits, one replica's memory accounting and prefix-cache counts, and where
        each adapter resides."""
        c = self.config
        adapters = await self._adapters(_tenant(http))
        return {"model_id": self.model_name, "version": VERSION, "dtype": c.dtype, "quantization": c.quantization,
                "max_loras": c.max_loras, "max_lora_rank": c.max_lora_rank,
                "adapter_source": c.adapter_source if c.max_loras else None, "max_num_seqs": c.max_num_seqs,
                "max_waiting_requests": c.max_waiting_requests, **self._replica_info(),
                "adapters": {a: dataclasses.asdict(where) for a, where in adapters.items()}}

    @app.post("/")
    async def root(self, request: GenerateRequest, http: Request):
        """TGI's root route: /generate_stream when `stream` is set, else /generate's answer in a list."""
        if request.stream:
            return await self.generate_stream(request, http)
        response = await self.generate(request, http)
        return [response] if isinstance(response, dict) else response

    @app.post("/generate")
    async def generate(self, request: GenerateRequest, http: Request):
        """One sequence, or with best_of that many drawn at once: the one whose tokens' logprobs sum highest
        answers (as TGI picks), the others in details.best_of_sequences."""
        tenant, count = _tenant(http), request.parameters.sequences
        starter = lambda stream: self._events(request, tenant, stream)  # noqa: E731
        with _max_tokens_named(request.max_tokens_name()):
            lasts = await wholes(await self._start_choices([[starter] * count], stream=False))
        return TgiRenderer(request, self.tgi).body(lasts)

    @app.post("/generate_stream")
    async def generate_stream(self, request: GenerateRequest, http: Request):
        """LoRAX's streamed generation: one server-sent event per token, the last with the whole text."""
        if request.parameters.sequences > 1:
            raise RequestRefused("best_of > 1 is not supported when streaming (as in TGI): use /generate", 422)
        events = self._events(request, _tenant(http))
        with _max_tokens_named(request.max_tokens_name()):
            first = await self._first_event(events)
        return StreamingResponse(TgiRenderer(request, self.tgi).sse(first, events), media_type="text/event-stream")

    @staticmethod
    async def _first_event(events) -> TokenEvent:
        """The first token event; a refusal arrives as the only event and becomes an HTTP error."""
        try:
            first = await events.__anext__()
        except BackPressureError as exc:  # the engine deployment's max_queued_requests is reached
            raise RequestRefused(f"the server is overloaded, retry later: {exc}", 503,
                                 OVERLOADED_RETRY_AFTER_S) from None
        if isinstance(first, Refusal):
            raise _refused(first)
        return first

    @staticmethod
    async def _refused(reason: str) -> AsyncIterator[Refusal]:
        yield Refusal(reason)

    def _events(self, request: GenerateRequest, tenant: Tenant, stream: bool = True) -> Metered:
        """The request's events, charged to its tenant; RequestRefused for an adapter outside the tenant's scope."""
        parameters = request.parameters
        merged = parameters.merged_adapters
        for adapter in merged.ids if merged is not None else [parameters.adapter_id]:
            _check_scope(tenant, adapter)
        return Metered(self._request_events(request, stream), tenant, parameters.adapter_id)

    def _request_events(self, request: GenerateRequest, stream: bool) -> AsyncIterator[TokenEvent | Refusal]:
        """The request's events from the engine, or a refusal made here as its only event."""
        parameters = request.parameters
        source = parameters.adapter_source
        if source is not None and source != self.adapter_source:
            return self._refused(f"adapter_source {source!r} is not served here; this server reads adapters "
                                 f"from {self.adapter_source!r}")
        try:
            params = parameters.to_sampling_params()
            if parameters.adapter_id is not None:
                validate_adapter_id(parameters.adapter_id)
        except ValueError as exc:  # a combination the engine refuses; an id that is not an adapter id
            return self._refused(str(exc))
        if parameters.merged_adapters is not None:
            return self._merged_stream(request, params, stream)
        return self._stream(request.inputs, params, parameters.adapter_id, stream)

    async def _merged_stream(self, request: GenerateRequest, params: SamplingParams,
                             stream: bool) -> AsyncIterator[TokenEvent | Refusal]:
        """LoRAX's merged_adapters: the events of the request on the merge of its adapters."""
        try:
            key = await self._merge(request.parameters.merged_adapters.to_spec())
        except ValueError as exc:  # a bad spec, or a server without LoRA
            yield Refusal(client_message(exc))
            return
        except AdapterCacheUnavailableError as exc:
            yield Refusal(str(exc), RefusalKind.UNAVAILABLE, exc.retry_after_s)
            return
        async for event in self._stream(request.inputs, params, key, stream):
            yield event

    # ---- OpenAI-compatible API: `model` names the base model or an adapter id ----

    @app.get("/v1/models")
    async def models(self, http: Request) -> dict:
        """The base model and the adapters the cache actor knows: each with the content id of its weights (once
        loaded), its lora_path when it was loaded at run time, and where it resides."""
        context = self._max_model_len()
        base = _model_card(self.model_name, self.model_name, None, context)
        adapters = [_adapter_card(a, self.model_name, where, context)
                    for a, where in (await self._adapters(_tenant(http))).items()]
        return {"object": "list", "data": [base] + adapters}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: oai.LoadLoRAAdapterRequest, http: Request) -> dict:
        """vLLM's route: serve `lora_name` from `lora_path`; loading a name again replaces its weights (requests
        already running finish on the old ones). Answers once every live replica serves the new weights."""
        _tenant(http).check_manage(request.lora_name)
        if request.lora_name == self.model_name:  # requests naming it would be the base model's
            raise RequestRefused(f"lora_name {request.lora_name!r} is the base model's name; choose another")
        done = await _lifecycle(self._register(request.lora_name, request.lora_path))
        return {"lora_name": done.name, "content_id": done.content_id,
                "message": f"LoRA adapter {done.name!r} loaded from {request.lora_path}"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: oai.UnloadLoRAAdapterRequest, http: Request) -> dict:
        """vLLM's route: stop serving what load_lora_adapter loaded under `lora_name`."""
        _tenant(http).check_manage(request.lora_name)
        await _lifecycle(self._unregister(request.lora_name))
        return {"lora_name": request.lora_name, "message": f"LoRA adapter {request.lora_name!r} unloaded"}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(self, model: str, http: Request) -> dict:
        """OpenAI's retrieve: the base model or a known adapter, as /v1/models lists it."""
        cards = (await self.models(http))["data"]
        for card in cards:
            if card["id"] == model:
                return card
        raise RequestRefused(f"model {model!r} is not served here (GET /v1/models lists what is)", 404)

    @app.post("/tokenize")
    async def tokenize_text(self, request: PromptTokenize | ChatTokenize | TgiTokenize, http: Request):
        """vLLM's forms (a prompt, or messages through the chat template) and TGI's (`inputs`):
        deployments/api/tokenizing.py."""
        model = None if isinstance(request, TgiTokenize) else request.model  # TGI's form names none: the base's
        await self._check_tokenizer_model(model, _tenant(http))
        if isinstance(request, TgiTokenize):
            return tokenize_tgi(self.tokenizer, request.inputs, request.add_special_tokens)
        text = (request.prompt if isinstance(request, PromptTokenize)
                else self._chat_prompt(request.messages, None, request.template_options()))
        return tokenize_prompt(self.tokenizer, text, request.add_special_tokens, request.return_token_strs,
                               self._max_model_len())

    @app.post("/detokenize")
    async def detokenize_ids(self, request: Detokenize, http: Request) -> dict:
        """vLLM's: the text of a list of token ids."""
        await self._check_tokenizer_model(request.model, _tenant(http))
        try:
            return detokenize(self.tokenizer, request.tokens)
        except ValueError as exc:
            raise RequestRefused(str(exc), 400) from None

    async def _check_tokenizer_model(self, model: str | None, tenant: Tenant) -> None:
        """A tokenizing request's model: none, the base model or an adapter the tenant sees (they all share the
        base model's tokenizer); another is refused, as a generation request naming it would be."""
        adapter = None if model == self.model_name else model
        _check_scope(tenant, adapter)
        if adapter is not None and adapter not in await self._residence(tenant):
            raise RequestRefused(f"model {adapter!r} is not served here: tokenizing takes the base model's name "
                                 f"({self.model_name!r}) or a loaded adapter's (GET /v1/models lists them)", 404)

    async def _adapters(self, tenant: Tenant) -> dict[str, AdapterResidence]:
        """_residence, or none while the cache actor restarts or does not answer (a listing still answers)."""
        try:
            return await self._residence(tenant)
        except RequestRefused:
            return {}

    async def _residence(self, tenant: Tenant) -> dict[str, AdapterResidence]:
        """Adapter id -> residence (object store, replicas' device slots and CPU copies, source loads), of the
        adapters in the tenant's scope; a 503 while the cache actor restarts or does not answer."""
        if not self.lora_enabled:
            return {}
        try:
            stats: CacheStats = await self.adapter_cache.cache_stats()
        except AdapterCacheUnavailableError as exc:
            raise RequestRefused(str(exc), 503, exc.retry_after_s) from None
        residence = stats.residence()
        return {adapter: residence[adapter] for adapter in tenant.visible(residence)}

    @app.post("/v1/completions")
    async def completions(self, request: oai.CompletionRequest, http: Request):
        """OpenAI's completions, streamed or not; `model` names the base model or an adapter."""
        renderer = CompletionRenderer(request, self.token_texts)
        return await self._openai(request, http, request.prompts, renderer)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: oai.ChatRequest, http: Request):
        """OpenAI's chat completions through the model's chat template, tools included, streamed or not."""
        prompt = self._chat_prompt(request.messages, request.tool_use(), request.template_options())
        return await self._openai(request, http, [prompt], ChatRenderer(request, self.token_texts))

    def _chat_prompt(self, messages: list[ChatMessage], tools: ToolUse | None, options: TemplateOptions) -> str:
        try:
            return chat_prompt(self.tokenizer, messages, tools, options)
        except ValueError as exc:  # a template that cannot render the messages or take tool_choice "auto"
            raise RequestRefused(str(exc), 400) from None

    @app.post("/v1/responses")
    async def responses(self, request: ResponsesRequest, http: Request):
        """OpenAI's Responses API (stateless: store false), streamed as its typed events or not."""
        prompt = self._chat_prompt(request.messages(), request.tool_use(), TemplateOptions())
        render = ResponseRenderer(request, self.token_texts)
        started = await self._begin(request, http, [prompt], render.default_max_tokens)
        render.name(started.request_id)
        if request.stream:
            return StreamingResponse(response_events(render, started.choices[0]), media_type="text/event-stream")
        return render.body((await wholes(started.choices))[0])

    async def _openai(self, request: oai.OpenAISampling, http: Request, prompts: list, render: Renderer):
        """n choices per prompt, each one engine request (_start_choices); choice j of prompt i has index i * n + j,
        as in vLLM."""
        started = await self._begin(request, http, prompts, render.default_max_tokens)
        cid, choices = completion_id(render.id_prefix, started.request_id), started.choices
        if request.stream:
            return StreamingResponse(openai_sse(request, render, cid, [c.first for c in choices],
                                                [c.events for c in choices]), media_type="text/event-stream")
        lasts = await wholes(choices)
        finals = [render.finished(last, prompt)
                  for last, prompt in zip(lasts, (p for p in prompts for _ in range(request.n)))]
        return render.body(cid, finals, usage(lasts, request.n))

    async def _begin(self, request: oai.OpenAISampling | ResponsesRequest, http: Request, prompts: list,
                     default_max_tokens: int | None) -> Started:
        """The request's id and its started choices, once the tenant's scope and priority, the sampling parameters
        and the adapter's id were checked (a RequestRefused says which failed)."""
        tenant, rid = _tenant(http), request_id(_client_request_id(request, http))
        adapter = None if request.model == self.model_name else request.model
        _check_scope(tenant, adapter)
        tenant.check_priority(request.priority)
        sequences = len(prompts) * request.n
        if sequences > self.config.max_waiting_requests:  # could never be queued at once: not worth a retry (429)
            raise RequestRefused(f"{len(prompts)} prompts x n={request.n} is {sequences} sequences; this server queues "
                                 f"at most {self.config.max_waiting_requests} (max_waiting_requests)")
        try:
            params = [request.to_sampling_params(default_max_tokens, choice) for choice in range(request.n)]
            if adapter is not None:
                validate_adapter_id(adapter)
        except ValueError as exc:  # a combination the engine refuses, e.g. an empty stop string; a bad id
            raise RequestRefused(str(exc), 400) from None
        with _max_tokens_named(request.max_tokens_name()):
            choices = await self._start_choices(
                [[self._starter(prompt, p, adapter, tenant) for p in params] for prompt in prompts], request.stream)
        return Started(rid, choices)

    def _starter(self, prompt, params: SamplingParams, adapter: str | None,
                 tenant: Tenant) -> Callable[[bool], Metered]:
        """start(stream) -> the events of one engine request for this prompt and choice."""
        return lambda stream: Metered(self._stream(prompt, params, adapter, stream), tenant, adapter)

    async def _start_choices(self, prompts: list[list[Callable[[bool], Metered]]], stream: bool) -> list[Choice]:
        """Every choice of every prompt (given as starters, in order), with its first event. Each prompt's first
        choice runs alone (streamed, whatever the request asked) until its first token, when the prompt's KV blocks
        are cached; then the prompt's other choices start at once and find them there. With n = 4 choices, a
        request over a long prompt finishes sooner this way than with all four started together (each prefills the
        prompt) or with each run whole after the one before; over a short prompt, sooner than one after another. The prompts'
        first choices start together (sooner than one prompt after another). A refused or failed choice, or a
        client that left, stops every choice started."""
        opened: list[Metered] = []

        def start(starter: Callable[[bool], Metered], as_stream: bool) -> Metered:
            opened.append(starter(as_stream))
            return opened[-1]

        try:
            leads = [start(choices[0], stream or len(choices) > 1) for choices in prompts]
            lead_firsts = await asyncio.gather(*(self._first_event(events) for events in leads))
            rest = [[start(choice, stream) for choice in choices[1:]] for choices in prompts]
            rest_firsts = iter(await asyncio.gather(*(self._first_event(e) for group in rest for e in group)))
        except BaseException:
            cancel(opened)
            raise
        choices = []
        for lead, lead_first, group in zip(leads, lead_firsts, rest):
            choices.append(Choice(lead_first, lead))
            choices += [Choice(next(rest_firsts), events) for events in group]
        return choices
