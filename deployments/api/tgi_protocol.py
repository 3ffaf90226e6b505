"""Pydantic models of the HTTP API (LoRAX / TGI style). Validation errors become HTTP 422 with the reason."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.api.openai_protocol import MAX_CHOICES, MAX_STOP, StopString
from deployments.api.strict import StrictModel
from engine.lora.merge_spec import MergeSpec
from engine.sampling import (
    LOGPROBS,
    MAX_TOKENS,
    PROBABILITY_MASS,
    REPETITION_PENALTY,
    SEED,
    TEMPERATURE,
    TOP_K,
    TRUNCATE,
    ResponseFormat,
    SamplingParams,
)
from engine.watermark import Watermark

LORAX_WATERMARK = Watermark(greenlist_ratio=0.5, bias=2.0)  # LoRAX's (and TGI's) default gamma and delta


class JSONResponseFormat(BaseModel):
    """LoRAX's response_format: {"type": "json_object", "schema": {...}}; without a schema, any JSON object."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_object", "json_schema"]
    json_schema: dict | None = Field(None, alias="schema")

    def to_engine(self) -> ResponseFormat:
        return ResponseFormat(self.json_schema) if self.json_schema is not None else ResponseFormat()


class MergedAdapters(StrictModel):
    """LoRAX's merged_adapters: these adapters merged into one (lora_cache/merge.py)."""
    ids: list[str] = Field(min_length=1, max_length=16)
    weights: list[float] = Field(min_length=1, max_length=16)
    merge_strategy: Literal["linear", "ties", "dare_linear", "dare_ties"] = "linear"
    density: float = Field(1.0, gt=0, le=1)
    majority_sign_method: Literal["total", "frequency"] = "total"

    def to_spec(self) -> MergeSpec:
        return MergeSpec(tuple(self.ids), tuple(self.weights), self.merge_strategy, self.density,
                         self.majority_sign_method)


class GenerateParameters(StrictModel):
    max_new_tokens: int = Field(20, **MAX_TOKENS.field())
    do_sample: bool = False
    temperature: float | None = Field(None, **TEMPERATURE.field())
    top_k: int | None = Field(None, **TOP_K.field())
    top_p: float | None = Field(None, **PROBABILITY_MASS.field())
    typical_p: float | None = Field(None, **PROBABILITY_MASS.field())  # locally typical sampling
    truncate: int | None = Field(None, **TRUNCATE.field())  # only the prompt's last `truncate` tokens
    repetition_penalty: float | None = Field(None, **REPETITION_PENALTY.field())
    seed: int | None = Field(None, **SEED.field())
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos_token: bool = False
    return_full_text: bool = False
    details: bool = False
    adapter_id: str | None = Field(None, min_length=1, description="LoRA adapter; none for the base model")
    adapter_source: Literal["local", "hub", "s3"] | None = None
    # LoRAX clients send these (usually null or false); set to anything else they are refused by name below.
    decoder_input_details: bool = False  # prompt tokens (ids, text, logprobs) in details.prefill
    api_token: str | None = None
    merged_adapters: MergedAdapters | None = None  # instead of adapter_id
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # sequences drawn; the likeliest answers
    watermark: bool = False  # the green-list watermark with LoRAX's gamma 0.5 and delta 2.0 (engine/watermark.py)
    return_k_alternatives: int | None = Field(None, **LOGPROBS.field())  # each token's k most likely alternatives
    response_format: JSONResponseFormat | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.merged_adapters is not None and self.adapter_id is not None:
            raise ValueError("give adapter_id or merged_adapters, not both")
        if self.api_token:  # a request's token would fetch an adapter that every later request then shares
            raise ValueError("api_token is not supported: the server reads adapters with its own credentials "
                             "($HF_TOKEN, or the S3 client's)")
        if self.sequences > 1 and self.seed is not None:  # as TGI: one seed cannot draw several sequences
            raise ValueError("seed must not be set when best_of > 1")
        if self.sequences > 1 and not self.sampled:
            raise ValueError("best_of > 1 needs sampling: set do_sample, temperature, top_k, top_p or typical_p")
        return self

    @property
    def sequences(self) -> int:
        """How many sequences the request draws (best_of); the likeliest answers."""
        return self.best_of or 1

    @property
    def sampled(self) -> bool:
        """Whether the request samples (TGI: do_sample, or any sampling parameter set) or decodes greedily."""
        return (self.do_sample or (self.temperature not in (None, 0)) or bool(self.top_k) or self.top_p is not None
                or self.typical_p is not None)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new_tokens,
            temperature=(self.temperature if self.temperature is not None else 1.0) if self.sampled else 0.0,
            top_k=self.top_k or 0,
            top_p=self.top_p or 1.0,
            typical_p=self.typical_p or 1.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            stop=self.stop,
            include_stop_str_in_output=True,  # as LoRAX and TGI answer: the text ends with the stop sequence
            ignore_eos=self.ignore_eos_token,
            logprobs=self.return_k_alternatives or 0,  # TGI reports each token's logprob
            prompt_logprobs=0 if self.decoder_input_details else None,
            response_format=self.response_format.to_engine() if self.response_format else None,
            truncate_prompt_tokens=self.truncate,
            watermark=LORAX_WATERMARK if self.watermark else None,
        )


class GenerateRequest(StrictModel):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False

    def max_tokens_name(self) -> str:
        """The parameter a refused token budget is named by."""
        return "max_new_tokens"
