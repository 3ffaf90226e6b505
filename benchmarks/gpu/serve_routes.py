"""The GPU serve benchmark's route checks: each OpenAI (/v1/completions, /v1/chat/completions) and LoRAX (/generate,
/generate_stream) route, whole and streamed, for the base model and an adapter; a check passes when the route
answers 200 with exactly the tokens asked for.
"""

from __future__ import annotations

import json
import time

import requests
from tqdm.auto import tqdm

from benchmarks.gpu.gpu_serve_plan import error_text
from benchmarks.workloads import PROMPTS


def _openai(stream: bool, tokens: int) -> dict:
    """OpenAI's sampling fields of a check; a stream ends with its usage (include_usage)."""
    return {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


def _completion(model: str, adapter: str | None, tokens: int, stream: bool) -> tuple[str, dict]:
    return "/v1/completions", {"model": model, "prompt": PROMPTS[0], **_openai(stream, tokens)}


def _chat(model: str, adapter: str | None, tokens: int, stream: bool) -> tuple[str, dict]:
    messages = [{"role": "user", "content": PROMPTS[0]}]
    return "/v1/chat/completions", {"model": model, "messages": messages, **_openai(stream, tokens)}


def _generate(model: str, adapter: str | None, tokens: int, stream: bool) -> tuple[str, dict]:
    """LoRAX names the adapter in adapter_id (none: the base model), not in a model field."""
    parameters = {"max_new_tokens": tokens, "ignore_eos_token": True, "details": True, "adapter_id": adapter}
    return "/generate_stream" if stream else "/generate", {"inputs": PROMPTS[0], "parameters": parameters}


def openai_tokens(response: requests.Response, stream: bool) -> int:
    """completion_tokens of a whole answer, or of a stream's usage chunk (include_usage), which must end in [DONE]."""
    if not stream:
        return response.json()["usage"]["completion_tokens"]
    lines = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    if lines[-1] != b"data: [DONE]":
        raise ValueError(f"the stream ends with {lines[-1][:80]!r}, not [DONE]")
    return next(c["usage"]["completion_tokens"] for c in map(json.loads, (x[6:] for x in lines[:-1])) if c.get("usage"))


def lorax_tokens(response: requests.Response, stream: bool) -> int:
    """details.generated_tokens of a whole answer, or of a stream's last event (the one with the generated text)."""
    if not stream:
        return response.json()["details"]["generated_tokens"]
    events = [json.loads(line[len(b"data:"):]) for line in response.iter_lines() if line.startswith(b"data:")]
    if events[-1].get("generated_text") is None:
        raise ValueError("the stream's last event holds no generated_text")
    return events[-1]["details"]["generated_tokens"]


def check_route(url: str, route, model: str, tokens: int, stream: bool, base: str) -> dict:
    """One route answering one request: 200 and exactly `tokens` new tokens pass."""
    make, count = route
    path, body = make(model, None if model == base else model, tokens, stream)
    row = {"route": path, "stream": stream, "model": "base" if model == base else f"adapter {model}"}
    started = time.perf_counter()
    try:
        response = requests.post(f"{url}{path}", json=body, timeout=120, stream=stream)
        got = count(response, stream) if response.status_code == 200 else None
        detail = f"{got} tokens" if got is not None else f"HTTP {response.status_code}: {response.text[:200]}"
        row.update(ok=got == tokens, status=response.status_code, detail=detail)
    except Exception as error:  # noqa: BLE001 - a failed check is a row of the table
        row.update(ok=False, status=None, detail=error_text(error))
    row["ms"] = (time.perf_counter() - started) * 1e3
    return row


ROUTES = ((_completion, openai_tokens), (_chat, openai_tokens), (_generate, lorax_tokens))


def check_routes(url: str, base: str, adapter: str, tokens: int) -> list[dict]:
    rows = [check_route(url, route, model, tokens, stream, base) for route in ROUTES for stream in (False, True)
            for model in (base, adapter)]
    tqdm.write(f"routes: {sum(r['ok'] for r in rows)} of {len(rows)} passed")
    return rows
