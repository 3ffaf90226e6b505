"""SamplingParams: what one request asks of the sampler and the stop checker.

ResponseFormat, its structured-output constraint, is checked against size limits here, where it is made (at the
HTTP edge too), before anything compiles it: its walkers recurse once per nesting level, and a grammar's cost
grows with its size. Whether a regex or grammar parses is llguidance's to say (engine/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.watermark import Watermark

# A JSON schema's size as compact JSON (UTF-8): real schemas (OpenAI's tools, pydantic models) take a few KiB
MAX_SCHEMA_BYTES = 64 * 1024
# dicts and lists inside each other in a schema (an object property is 2 levels: "properties", then its schema);
# the schema walkers and jsonschema recurse once per level, far from Python's recursion limit at 32
MAX_SCHEMA_DEPTH = 32
# A regex or a Lark grammar, in characters
MAX_PATTERN_CHARS = 64 * 1024
# choice: the strings, and each string's characters; a choice at both limits still compiles quickly (SmolLM2)
MAX_CHOICE_STRINGS = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("schema", "regex", "choice", "grammar")


@dataclass
class ResponseFormat:
    """Constrain the output with exactly one of: a JSON schema (the output is JSON valid for it), a regex (the
    whole output matches it), a choice (the output is one of the strings) or a grammar (Lark, in llguidance's
    syntax, as vLLM's guided_grammar). None given: any JSON object."""
    schema: dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ValueError(f"response_format takes one of {', '.join(KINDS)}; got {' and '.join(given)}")
        if not given:
            self.schema = {"type": "object"}
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: "schema", "regex", "choice" or "grammar"."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def value(self) -> dict | str | list[str]:
        return getattr(self, self.kind)

    def validate(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"response_format takes exactly one of {', '.join(KINDS)}; got {given or 'none'}")
        if self.schema is not None:
            _check_schema(self.schema)
        for kind in ("regex", "grammar"):
            if getattr(self, kind) is not None:
                _check_pattern(kind, getattr(self, kind))
        if self.choice is not None:
            _check_choice(self.choice)


def _check_schema(schema) -> None:
    if not isinstance(schema, dict):
        raise ValueError("response_format schema must be a JSON object")
    if _nested_deeper(schema, MAX_SCHEMA_DEPTH):  # first: a deeper one would overflow json.dumps' recursion
        raise ValueError(f"JSON schema nested more than {MAX_SCHEMA_DEPTH} levels deep: at most "
                         f"{MAX_SCHEMA_DEPTH} levels of objects and arrays are allowed")
    try:
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError) as e:
        raise ValueError(f"JSON schema must hold only JSON values: {e}") from None
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"JSON schema is {size} bytes as compact JSON: at most {MAX_SCHEMA_BYTES} are allowed")


def _nested_deeper(value, limit: int) -> bool:
    """Whether dicts and lists nest more than `limit` levels deep in value; iterative, so that any depth is
    measured without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _check_pattern(kind: str, pattern) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"response_format {kind} must be a non-empty string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"{kind} is {len(pattern)} characters: at most {MAX_PATTERN_CHARS} are allowed")


def _check_choice(choice) -> None:
    if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise ValueError("response_format choice must be a non-empty list of non-empty strings")
    if len(choice) > MAX_CHOICE_STRINGS:
        raise ValueError(f"choice has {len(choice)} strings: at most {MAX_CHOICE_STRINGS} are allowed")
    longest = max(len(c) for c in choice)
    if longest > MAX_CHOICE_CHARS:
        raise ValueError(f"a choice string has {longest} characters: at most {MAX_CHOICE_CHARS} are allowed")


# A temperature below this is greedy, as in vLLM: dividing logits by it leaves float32's range (at 5e-324 every
# probability is NaN and each draw token 0), and the draw would be the argmax anyway
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # a 64-bit integer, as vLLM takes; torch's generator refuses wider seeds
PRIORITY_MIN, PRIORITY_MAX = -2**31, 2**31 - 1  # a 32-bit integer: room for any tiering, and one JSON number
# Logits are divided (or multiplied) by the repetition penalty in float32: 1e-300 is 0 there, and every probability
# would be NaN. Inside this range a logit stays finite.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class Bounds:
    """A parameter's allowed range: SamplingParams.validate checks it, and the HTTP schemas declare the same bounds
    on their fields (pydantic then names the field at fault in its own API's words), so each limit is written once."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def holds(self, value) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def field(self) -> dict[str, float]:
        """The bounds as pydantic's Field takes them."""
        return {name: value for name, value in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if value is not None}


MAX_TOKENS = Bounds(ge=1)
MIN_TOKENS = Bounds(ge=0)  # and at most max_tokens
TEMPERATURE = Bounds(ge=0)
TOP_K = Bounds(ge=0)  # 0 is off (and -1, vLLM's spelling of it, becomes 0)
PROBABILITY_MASS = Bounds(gt=0, le=1)  # top_p, typical_p
MIN_P = Bounds(ge=0, le=1)
PENALTY = Bounds(ge=-2, le=2)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Bounds(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
LOGIT_BIAS = Bounds(ge=-100, le=100)
TOKEN_ID = Bounds(ge=0)
TRUNCATE = Bounds(ge=1)  # truncate_prompt_tokens
SEED = Bounds(ge=SEED_MIN, le=SEED_MAX)
PRIORITY = Bounds(ge=PRIORITY_MIN, le=PRIORITY_MAX)
LOGPROBS = Bounds(ge=0, le=20)  # logprobs' and prompt_logprobs' alternatives


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: as many as the context leaves (up to the engine's max_tokens_limit)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    typical_p: float = 1.0  # locally typical sampling (Meister et al.); 1.0: off
    min_p: float = 0.0  # keep the tokens at least min_p times as likely as the most likely one (vLLM's); 0: off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token the output already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the output holds the token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated; None: any
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words whose tokens the output never spells
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also its top-k alternatives
    prompt_logprobs: int | None = None  # the same for each prompt token (given the tokens before it)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # structured output (engine/grammar.py)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (left truncation)
    priority: int = 0  # vLLM's: a lower value is admitted first and preempted last; equal ones in arrival order
    watermark: Watermark | None = None  # green-list watermark on every generated token (engine/watermark.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first parameter out of its range: the HTTP edge answers it as a 400."""
        self._check_lengths()
        self._check_knobs()
        self._check_token_lists()
        self._check_request_fields()

    def _check_lengths(self) -> None:
        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and MAX_TOKENS.holds(self.max_tokens)):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        most = self.max_tokens if self.max_tokens is not None else float("inf")
        if not isinstance(self.min_tokens, int) or not MIN_TOKENS.holds(self.min_tokens) or self.min_tokens > most:
            raise ValueError(f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens!r}")

    def _check_knobs(self) -> None:
        if not TEMPERATURE.holds(self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not TOP_K.holds(self.top_k):
            raise ValueError(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if not PROBABILITY_MASS.holds(self.top_p):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not PROBABILITY_MASS.holds(self.typical_p):
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not MIN_P.holds(self.min_p):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or not TRUNCATE.holds(self.truncate_prompt_tokens)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if not REPETITION_PENALTY.holds(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be between {REPETITION_PENALTY_RANGE[0]} and "
                             f"{REPETITION_PENALTY_RANGE[1]}, got {self.repetition_penalty}")
        bias = self.logit_bias.items()
        if not all(isinstance(t, int) and TOKEN_ID.holds(t) and LOGIT_BIAS.holds(b) for t, b in bias):
            raise ValueError("logit_bias maps token ids (integers >= 0) to biases between -100 and 100")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY.holds(getattr(self, name)):
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")

    def _check_token_lists(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or not TOKEN_ID.holds(t)
                                                  for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-blank strings")

    def _check_request_fields(self) -> None:
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED.holds(self.seed)):
            raise ValueError(f"seed must be an integer between {SEED_MIN} and {SEED_MAX} (64 bits), got {self.seed!r}")
        if self.response_format is not None:
            self.response_format.validate()
        if not isinstance(self.priority, int) or not PRIORITY.holds(self.priority):
            raise ValueError(f"priority must be an integer between {PRIORITY_MIN} and {PRIORITY_MAX}, "
                             f"got {self.priority!r}")
        if self.watermark is not None and not isinstance(self.watermark, Watermark):
            raise ValueError(f"watermark must be a Watermark, got {type(self.watermark).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not LOGPROBS.holds(value):
                raise ValueError(f"{name} must be between 0 and 20, got {value}")

    def kept_prompt(self, token_ids: list[int]) -> list[int]:
        """The prompt tokens this request runs on: all of them, or the last truncate_prompt_tokens."""
        return token_ids if self.truncate_prompt_tokens is None else token_ids[-self.truncate_prompt_tokens:]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
