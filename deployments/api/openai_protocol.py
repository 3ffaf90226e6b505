"""Request schemas of the OpenAI-compatible API (completions, chat, the adapter lifecycle);
deployments/api/openai_render.py renders the responses."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from deployments.api.chat import ChatMessage, TemplateControls
from deployments.api.strict import OpenAIModel
from deployments.api.tools import MAX_TOOLS, NamedToolChoice, Tool, ToolUse, may_call, tool_use
from engine.sampling import (
    LOGIT_BIAS,
    LOGPROBS,
    MAX_CHOICE_CHARS,
    MAX_CHOICE_STRINGS,
    MAX_PATTERN_CHARS,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOKENS,
    MIN_P,
    MIN_TOKENS,
    PENALTY,
    PRIORITY,
    PROBABILITY_MASS,
    REPETITION_PENALTY,
    SEED,
    SEED_MIN,
    TEMPERATURE,
    TOKEN_ID,
    TRUNCATE,
    ResponseFormat,
    SamplingParams,
)


def valid_request_id(value: str) -> str:
    """A request id as an HTTP header carries it: printable ASCII, no spaces, short enough for a log line."""
    if not re.fullmatch(r"[\x21-\x7e]{1,128}", value):
        raise ValueError("must be 1-128 printable ASCII characters without spaces")
    return value


RequestId = Annotated[str, AfterValidator(valid_request_id)]
MAX_CHOICES = 16  # n: each choice is one more request (sharing the prompt's cached KV blocks)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 16  # stop strings, and stop token ids, per request: each one is checked after every token
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 300  # logit_bias entries, as OpenAI allows
MAX_ALLOWED_IDS = 4096  # allowed_token_ids: the sampler copies them into each step's row
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")  # OpenAI's four fields; another is refused by name

    name: str = "response"
    description: str | None = None
    json_schema: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


class OpenAIResponseFormat(OpenAIModel):
    """{"type": "text"}, {"type": "json_object"} (any JSON object) or {"type": "json_schema", "json_schema": {...}}."""
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


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # a last chunk, with no choices, carries the usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far too

    @model_validator(mode="after")
    def _continuous_with_usage(self):
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage: true")
        return self


def _json_schema(value: dict | str) -> dict:
    """vLLM takes a JSON schema as an object or as a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return value


# The limits of engine/sampling.py, stated in the OpenAPI schema (the engine checks a schema's size and depth)
Schema = Annotated[dict | str, AfterValidator(_json_schema),
                   Field(description=f"a JSON schema, or a string holding one: at most {MAX_SCHEMA_BYTES} bytes as "
                                     f"compact JSON, objects and arrays nested at most {MAX_SCHEMA_DEPTH} deep")]
Pattern = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS)]
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICE_STRINGS)]


class StructuredOutputs(OpenAIModel):
    """vLLM's structured_outputs: one of json (a JSON schema), regex (the whole output matches it), choice (the
    output is one of the strings), grammar (Lark, in llguidance's syntax) or json_object: true (any JSON object)."""
    json_schema: Schema | None = Field(None, alias="json")  # a field named json would shadow BaseModel.json
    regex: Pattern | None = None
    choice: Choices | None = None
    grammar: Pattern | None = None
    json_object: bool | None = None


class OpenAIBookkeeping(OpenAIModel):
    """OpenAI's bookkeeping fields, which every generation route takes: accepted, with no effect on the output."""
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: Literal[False] | None = None  # this server stores nothing
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)  # the prefix cache needs no key


class OpenAISampling(OpenAIBookkeeping):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, **MAX_TOKENS.field())
    max_completion_tokens: int | None = Field(None, **MAX_TOKENS.field())
    temperature: float = Field(1.0, **TEMPERATURE.field(), le=2)  # OpenAI's ceiling
    top_p: float = Field(1.0, **PROBABILITY_MASS.field())
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, **SEED.field())
    presence_penalty: float = Field(0.0, **PENALTY.field())
    frequency_penalty: float = Field(0.0, **PENALTY.field())
    response_format: OpenAIResponseFormat | None = None
    stream_options: StreamOptions | None = None
    # token id (a JSON object key, so a string of digits) -> bias added to its logit
    logit_bias: Annotated[dict[Annotated[int, Field(**TOKEN_ID.field())],
                               Annotated[float, Field(**LOGIT_BIAS.field())]],
                          Field(max_length=MAX_LOGIT_BIAS,
                                json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})] | None = None
    # vLLM's extra sampling parameters (openai clients send them in extra_body)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, **MIN_P.field())  # tokens at least min_p x the most likely one's probability; 0: off
    repetition_penalty: float = Field(1.0, **REPETITION_PENALTY.field())
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[Annotated[int, Field(**TOKEN_ID.field())]] | None = Field(None, min_length=1,
                                                                                      max_length=MAX_ALLOWED_IDS)
    bad_words: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, **MIN_TOKENS.field())
    truncate_prompt_tokens: int | None = Field(None, **TRUNCATE.field())  # only the prompt's last k tokens
    prompt_logprobs: int | None = Field(None, **LOGPROBS.field())  # each prompt token's logprob, rank, k others
    priority: int = Field(0, **PRIORITY.field())  # lower: admitted first, preempted last
    request_id: RequestId | None = None  # vLLM's: names the response (its id); else the X-Request-Id header does
    # vLLM's structured output (engine/grammar.py): at most one constraint, response_format's included
    guided_json: Schema | None = None
    guided_regex: Pattern | None = None
    guided_choice: Choices | None = None
    guided_grammar: Pattern | None = None  # Lark, in llguidance's syntax
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: Literal["guidance", "auto"] | None = None  # llguidance is the one backend here
    guided_whitespace_pattern: None = Field(None, description="JSON whitespace is fixed (json.dumps' separators)")

    @model_validator(mode="after")
    def _stream_options_on_streams(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only for streams (stream: true)")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_whole(self):
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self):
        given = self._structured()
        if len(given) > 1:
            raise ValueError(f"at most one structured-output constraint per request, got {', '.join(given)}")
        return self

    def _structured(self) -> dict[str, dict]:
        """The structured-output constraints given: {field name: the engine ResponseFormat's arguments}."""
        so = self.structured_outputs or StructuredOutputs()
        response_format = self.response_format.to_engine() if self.response_format else None
        fields = {"response_format": {"schema": response_format.schema if response_format else None},
                  "guided_json": {"schema": self.guided_json}, "guided_regex": {"regex": self.guided_regex},
                  "guided_choice": {"choice": self.guided_choice}, "guided_grammar": {"grammar": self.guided_grammar},
                  "structured_outputs.json": {"schema": so.json_schema},
                  "structured_outputs.regex": {"regex": so.regex}, "structured_outputs.choice": {"choice": so.choice},
                  "structured_outputs.grammar": {"grammar": so.grammar},
                  "structured_outputs.json_object": {"schema": {"type": "object"} if so.json_object else None}}
        return {name: constraint for name, constraint in fields.items() if None not in constraint.values()}

    def engine_response_format(self) -> ResponseFormat | None:
        """The request's structured-output constraint for the engine; ValueError naming the field for one past a
        limit of engine/sampling.py."""
        for name, constraint in self._structured().items():  # at most one (_one_structured_output)
            try:
                return ResponseFormat(**constraint)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        return None

    def logprobs_wanted(self) -> int | None:
        """None: no logprobs in the response, and none computed (a step whose rows all ask none skips each row's
        logsumexp over the vocabulary); k: the chosen tokens' logprobs and their k most likely alternatives."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """How many alternatives the engine scores for each prompt token (None: the prompt is not scored)."""
        return self.prompt_logprobs

    def max_tokens_name(self) -> str:
        """The parameter a refused token budget is named by: the one the client set (max_completion_tokens wins, as
        in to_sampling_params)."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def to_sampling_params(self, default_max_tokens: int | None, choice: int = 0) -> SamplingParams:
        """The parameters of choice `choice` of n; with a seed, choice i draws with seed + i (reproducible,
        and the choices differ). A default_max_tokens of None lets the output fill the context."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = None if self.seed is None else _wrap_seed(self.seed + choice)
        return SamplingParams(max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, seed=seed, stop=stop,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              allowed_token_ids=self.allowed_token_ids, bad_words=list(self.bad_words),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              logit_bias=self.logit_bias or {},
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                              min_tokens=self.min_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
                              skip_special_tokens=self.skip_special_tokens,
                              logprobs=self.logprobs_wanted(), prompt_logprobs=self.prompt_logprobs_wanted(),
                              response_format=self.engine_response_format())


class CompletionRequest(OpenAISampling):
    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])  # text, ids, or a batch
    logprobs: int | None = Field(None, **LOGPROBS.field())
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) in the logprobs; a
                        # stream sends it in each choice's first chunk

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        """echo with logprobs scores the prompt too; with prompt_logprobs as well, the larger k serves both."""
        echoed = self.logprobs if self.echo else None
        wanted = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    @model_validator(mode="after")
    def _prompts_given(self):
        if not self.prompts or not all(self.prompts):
            raise ValueError("prompt must not be empty")
        if len(self.prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(self.prompts)}")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt) and self.prompt:
            return [self.prompt]
        return list(self.prompt)


class ChatRequest(OpenAISampling, TemplateControls):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **LOGPROBS.field())
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: the answer starts with the last message's content when that is an assistant's
    # Derived once, when the request is validated: the renderer, the prompt and each choice's grammar all ask
    _tool_use: ToolUse | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools_fit(self):
        # ValueError for a tool_choice the tools do not allow
        use = self._tool_use = tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)
        if use is not None and use.response_format() is not None and self._structured():
            raise ValueError(f"tool_choice {self.tool_choice!r} sets the output's grammar: "
                             f"{', '.join(self._structured())} cannot be given with it")
        if self.calls_tools() and self.stream and self.logprobs:
            raise ValueError("logprobs are not supported on a stream with tools (its calls arrive as one delta)")
        return self

    def tool_use(self) -> ToolUse | None:
        return self._tool_use

    def calls_tools(self) -> bool:
        return may_call(self.tool_use())

    def engine_response_format(self) -> ResponseFormat | None:
        use = self.tool_use()
        calls = use.response_format() if use is not None else None
        return calls or super().engine_response_format()

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def echoed(self) -> str:
        """The text echo puts before the answer: the last message's, when the answer is that role's (an assistant's
        message, continued with continue_final_message or answered by a new turn, as vLLM does); else none."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/load_lora_adapter."""
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096, description="an absolute local folder, "
                           "s3://bucket/prefix or hf://org/name[@revision]")


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id is vLLM's internal number: not taken)."""
    lora_name: str = Field(min_length=1, max_length=256)


def _wrap_seed(seed: int) -> int:
    """A choice's seed (the request's + its index) back into the 64-bit range the engine takes, so that the
    largest seed still gives n choices."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN
