"""HTTP ingress (FastAPI through @serve.ingress): LoRAX / TGI style generate and SSE streaming."""

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.protocol import TGI_FINISH_REASONS, GenerateRequest

app = FastAPI(title="lora-serve")


class RequestRefused(Exception):
    """The engine refused the request (bad prompt, unknown or invalid adapter, ...): HTTP 400 with the reason."""


@app.exception_handler(RequestRefused)
async def _refused_response(_, exc: RequestRefused) -> JSONResponse:
    return JSONResponse({"error": str(exc), "error_type": "validation"}, status_code=400)


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, llm_server: DeploymentHandle, model_name: str, adapter_source: str = "local"):
        self.llm = llm_server.options(stream=True)
        self.model_name = model_name
        self.adapter_source = adapter_source

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/info")
    async def info(self) -> dict:
        return {"model_id": self.model_name, "version": "0.1.0"}

    @app.post("/")
    async def root(self, request: GenerateRequest):
        if request.stream:
            return await self.generate_stream(request)
        response = await self.generate(request)
        return [response] if isinstance(response, dict) else response

    @app.post("/generate")
    async def generate(self, request: GenerateRequest):
        events = self._events(request)
        first = await self._first_event(events)
        tokens, last = [first], first
        async for event in events:
            tokens.append(event)
            last = event
        body = {"generated_text": self._full_text(request, last["generated_text"])}
        if request.parameters.details:
            body["details"] = self._details(last, tokens)
        return body

    @app.post("/generate_stream")
    async def generate_stream(self, request: GenerateRequest):
        events = self._events(request)
        first = await self._first_event(events)
        return StreamingResponse(self._sse(request, first, events), media_type="text/event-stream")

    @staticmethod
    async def _first_event(events) -> dict:
        """The first token event; a refusal arrives as the only event and becomes HTTP 400."""
        first = await events.__anext__()
        if "error" in first:
            raise RequestRefused(first["error"])
        return first

    async def _refused(self, reason: str) -> AsyncIterator[dict]:
        yield {"error": reason}

    def _events(self, request: GenerateRequest) -> AsyncIterator[dict]:
        source = request.parameters.adapter_source
        if source is not None and source != self.adapter_source:
            return self._refused(f"adapter_source {source!r} is not served here; this server reads adapters "
                                 f"from {self.adapter_source!r}")
        adapter = request.parameters.adapter_id or ""  # the multiplexed model id: routes to replicas holding it
        return self.llm.options(multiplexed_model_id=adapter).generate.remote(
            request.inputs, request.parameters.to_sampling_params())

    async def _sse(self, request: GenerateRequest, first: dict, events) -> AsyncIterator[str]:
        event = first
        while True:
            payload = {"token": {"id": event["token_id"], "text": event["text"], "logprob": event["logprob"],
                                 "special": False},
                       "generated_text": None, "details": None}
            if event["finished"]:
                payload["generated_text"] = self._full_text(request, event["generated_text"])
                payload["details"] = {"finish_reason": TGI_FINISH_REASONS[event["finish_reason"]],
                                      "generated_tokens": event["generated_tokens"], "seed": request.parameters.seed}
            yield f"data:{json.dumps(payload)}\n\n"
            if event["finished"]:
                return
            event = await events.__anext__()

    @staticmethod
    def _full_text(request: GenerateRequest, generated: str) -> str:
        return request.inputs + generated if request.parameters.return_full_text else generated

    @staticmethod
    def _details(last: dict, events: list[dict]) -> dict:
        return {"finish_reason": TGI_FINISH_REASONS[last["finish_reason"]],
                "generated_tokens": last["generated_tokens"], "prompt_tokens": last["prompt_tokens"],
                "tokens": [{"id": e["token_id"], "text": e["text"], "logprob": e["logprob"], "special": False}
                           for e in events]}
