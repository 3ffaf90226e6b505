"""SamplingParams: what one request asks of the sampler and the stop checker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ResponseFormat:
    """Constrain the output to JSON valid for a JSON schema; the default schema admits any JSON object."""
    schema: dict = field(default_factory=lambda: {"type": "object"})


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token the output already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the output holds the token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also its top-k alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (given the tokens before it)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # structured output (engine/grammar.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not isinstance(t, int) or t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (integers >= 0) to biases between -100 and 100")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.response_format is not None and not isinstance(self.response_format.schema, dict):
            raise ValueError("response_format schema must be a JSON object")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be between 0 and 20, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
