"""Pydantic models and response shapes of the OpenAI-compatible API (completions, chat, models)."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deployments.events import TokenEntry, TokenEvent
from engine.sampling import ResponseFormat, SamplingParams

FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort"}
MAX_CHOICES = 16  # n: each choice is one more request (sharing the prompt's cached KV blocks)
MAX_PROMPTS = 64  # prompts in one completions request


class JSONSchemaSpec(BaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


class OpenAIResponseFormat(BaseModel):
    """{"type": "text"}, {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema": {...}}."""
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a "json_schema" object with a "schema"')
        return self

    def to_engine(self) -> ResponseFormat | None:
        if self.type == "text":
            return None
        return ResponseFormat(self.json_schema.json_schema) if self.type == "json_schema" else ResponseFormat()


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk, with no choices, carries the usage


class OpenAISampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)
    chunk_object: ClassVar[str]  # the "object" of this API's stream chunks

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    response_format: OpenAIResponseFormat | None = None
    stream_options: StreamOptions | None = None
    # token id (a JSON object key, so a string of digits) -> bias added to its logit
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM's extra sampling parameters (openai clients send them in extra_body)
    top_k: int = Field(0, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, ge=0)

    def logprobs_wanted(self) -> int | None:
        """None: no logprobs in the response; k: the chosen tokens' logprobs and their k most likely alternatives."""
        return None

    def logprobs_object(self, tokens: list[TokenEntry], tokenizer, offset: int) -> dict | None:
        """The response's `logprobs` for these generated tokens (None when not asked for)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        return None

    def final(self, last: TokenEvent, tokenizer, prompt) -> tuple[str, TokenEvent, dict | None]:
        """A finished choice (its one event, with every token): (text, that event, logprobs object)."""
        return last.final.generated_text, last, self.logprobs_object(last.entries(), tokenizer, 0)

    def to_sampling_params(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """The parameters of choice `choice` of n; with a seed, choice i draws with seed + i (reproducible,
        and the choices differ)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, seed=seed, stop=stop,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              top_k=self.top_k, repetition_penalty=self.repetition_penalty,
                              logit_bias=self.logit_bias or {},
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                              min_tokens=self.min_tokens,
                              skip_special_tokens=self.skip_special_tokens,
                              logprobs=self.logprobs_wanted() or 0, prompt_logprobs=self.prompt_logprobs_wanted(),
                              response_format=self.response_format.to_engine() if self.response_format else None)


class CompletionRequest(OpenAISampling):
    chunk_object: ClassVar[str] = "text_completion"
    prompt: str | list[str] | list[int] | list[list[int]]  # text, token ids, or a batch of either
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) in the logprobs

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    def final(self, last: TokenEvent, tokenizer, prompt) -> tuple[str, TokenEvent, dict | None]:
        if not self.echo:
            return super().final(last, tokenizer, prompt)
        prompt_text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        prompt_tokens = last.final.prompt_token_entries or []  # scored only when logprobs were asked for
        return (prompt_text + last.final.generated_text, last,
                self.logprobs_object(prompt_tokens + last.entries(), tokenizer, 0))

    def logprobs_object(self, tokens: list[TokenEntry], tokenizer, offset: int) -> dict | None:
        """The legacy completions shape; text_offset counts from `offset` characters into the generated text."""
        if self.logprobs is None:
            return None
        starts = itertools.accumulate((len(t.text) for t in tokens[:-1]), initial=offset)
        return {"tokens": [tokenizer.decode([t.id]) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None else  # the first prompt token, echoed
                                 {tokenizer.decode([i]): lp for i, lp in _with_chosen(t).items()} for t in tokens],
                "text_offset": list(starts) if tokens else []}

    @model_validator(mode="after")
    def _prompts_given(self):
        if not self.prompts or not all(self.prompts):
            raise ValueError("prompt must not be empty")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if len(self.prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(self.prompts)}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt) and self.prompt:
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(OpenAISampling):
    chunk_object: ClassVar[str] = "chat.completion.chunk"
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def logprobs_object(self, tokens: list[TokenEntry], tokenizer, offset: int) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [{**_chat_token(t.id, t.logprob, tokenizer),
                             "top_logprobs": [_chat_token(i, lp, tokenizer)
                                              for i, lp in (t.top_logprobs or {}).items()]}
                            for t in tokens]}


def _with_chosen(token: TokenEntry) -> dict[int, float]:
    """The alternatives and the chosen token (vLLM's completions include it, even when it is not among them)."""
    return {**(token.top_logprobs or {}), token.id: token.logprob}


def _chat_token(token_id: int, logprob: float, tokenizer) -> dict:
    text = tokenizer.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(lasts: list[TokenEvent], n: int) -> dict:
    """Token counts of a request's choices (their last events), n per prompt: each prompt once, every choice's
    completion."""
    prompt = sum(last.final.prompt_tokens for last in lasts[::n])
    completion = sum(last.final.generated_tokens for last in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(cid: str, model: str, finals: list[tuple[str, TokenEvent, dict | None]], usage: dict) -> dict:
    """finals: per choice, its text, its last event and its logprobs object."""
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": finals[0][1].final.adapter_version,
            "choices": [{"index": i, "text": text, "logprobs": logprobs,
                         "finish_reason": FINISH_REASONS[last.final.finish_reason]}
                        for i, (text, last, logprobs) in enumerate(finals)],
            "usage": usage}


def chat_body(cid: str, model: str, finals: list[tuple[str, TokenEvent, dict | None]], usage: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": finals[0][1].final.adapter_version,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": FINISH_REASONS[last.final.finish_reason]}
                        for i, (text, last, logprobs) in enumerate(finals)],
            "usage": usage}


def usage_chunk(cid: str, model: str, chunk_object: str, usage: dict) -> dict:
    """stream_options.include_usage: the stream's last chunk."""
    return {"id": cid, "object": chunk_object, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage}


def completion_chunk(cid: str, model: str, index: int, event: TokenEvent, text: str, first: bool,
                     logprobs: dict | None) -> dict:
    reason = FINISH_REASONS[event.final.finish_reason] if event.finished else None
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": _fingerprint(event),
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}


def chat_chunk(cid: str, model: str, index: int, event: TokenEvent, text: str, first: bool,
               logprobs: dict | None) -> dict:
    reason = FINISH_REASONS[event.final.finish_reason] if event.finished else None
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "system_fingerprint": _fingerprint(event),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def _fingerprint(event: TokenEvent) -> str | None:
    """system_fingerprint: the content id of the adapter weights that answered (None for the base model), on a
    request's last chunk, once the replica knows it."""
    return event.final.adapter_version if event.finished else None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter."""
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096, description="an absolute local folder, "
                           "s3://bucket/prefix or hf://org/name[@revision]")


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id is vLLM's internal number: not taken)."""
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
