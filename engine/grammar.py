"""Structured output: grammars, one matcher per constrained request, and the batch's token masks.

llguidance (the grammar engine behind vLLM's and SGLang's "guidance" backend) compiles a JSON schema, a regex,
a choice of strings (as a regex alternation) or a Lark grammar lazily against the tokenizer, so a new one is
ready almost at once, and computes the masks of a whole batch in parallel on its own Rust threads
without holding the GIL. A compiled grammar is kept (LRU, keyed by its kind and text) as a fresh matcher that
each new request copies.

Schemas are tightened, never widened, before they compile: every output of the compiled schema is valid for
the original. Objects that list properties are closed (closed_objects). Numbers are bounded (bounded_numbers):
a small model given an unbounded "integer" may write an 80-digit number until its token budget runs out (SmolLM2
asked for the atoms in the universe wrote a 1 and zeros for all of its 80 tokens; bounded, 10**15 in 21), so an
"integer" or "number" without a minimum (maximum) gets -(2**53 - 1) (2**53 - 1): JavaScript's safe integers,
the widest range whose every integer a JSON parser (a float64) holds exactly. llguidance turns a range into a
regex and cannot for every range: measured with 1.9.1, bounds of +-1e18 and +-9.2e18 compile, +-2**63 and
+-1e20 fail ("Failed to generate regex for integer/float range"), as does +-1e308 (float64's own limit), so
JavaScript's range is also the widest faithful one it takes. With a range, llguidance refuses exponents (1e20,
1.5e3) and integer parts of more than 16 digits; a number's fraction digits stay unbounded. A side the schema
bounds itself is kept, as are enum and const subschemas (already finite), and not/if subschemas (narrowing
them would widen the schema). A value of no stated type (any JSON, as in {"type": "object"} alone) stays unbounded.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.sampling import ResponseFormat

if TYPE_CHECKING:  # imported when the first structured-output request makes a compiler: the engine runs without them
    import llguidance

# json.dumps' separators, no other whitespace: a small model given free whitespace may emit it forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
VALUE_KEYWORDS = ("enum", "const", "default", "examples")
NEGATED_KEYWORDS = ("not", "if")  # a narrower subschema here admits more values: the rewrites leave them be
SAFE_INTEGER = 2**53 - 1  # JavaScript's Number.MAX_SAFE_INTEGER: every integer up to it is exact in a float64
ERRORS = {"schema": "JSON schema cannot be used", "regex": "invalid regex", "choice": "invalid choice",
          "grammar": "invalid grammar"}  # kind -> what llguidance's refusal means


@dataclass
class TokenMasks:
    """Allowed next tokens of a step's constrained requests: bit t of row i allows token t to request_ids[i]."""
    request_ids: list[str]
    bitmask: torch.Tensor  # int32 [len(request_ids), ceil(vocab / 32)]


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 256):
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor()
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = Lock()  # compiled from request threads (AsyncEngine prepares requests off the step thread)

    def matcher(self, response_format: ResponseFormat) -> llguidance.LLMatcher:
        """A fresh matcher for one request; ValueError with the reason for an invalid schema, regex or grammar."""
        key = f"{response_format.kind}:{json.dumps(response_format.value, sort_keys=True)}"
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template.deep_copy()
        template = self._compile(response_format)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _compile(self, response_format: ResponseFormat) -> llguidance.LLMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(response_format))
        if matcher.is_error():
            raise ValueError(f"{ERRORS[response_format.kind]}: {matcher.get_error().strip()}")
        return matcher

    def fill_masks(self, matchers: list[tuple[str, llguidance.LLMatcher]]) -> TokenMasks:
        """Masks of (request id, matcher) pairs, computed in parallel."""
        bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        pairs = [(matcher, i) for i, (_, matcher) in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(pairs))
        return TokenMasks([request_id for request_id, _ in matchers], bitmask)


def grammar_text(response_format: ResponseFormat) -> str:
    """llguidance's grammar for a response format (a JSON schema is checked, closed and bounded first)."""
    import llguidance

    if response_format.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(response_format.regex)
    if response_format.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex(choice_regex(response_format.choice))
    if response_format.grammar is not None:
        return llguidance.LLMatcher.grammar_from_lark(response_format.grammar)
    return _schema_grammar(response_format.schema)


def _schema_grammar(schema: dict) -> str:
    import llguidance
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"invalid JSON schema: {e.message}") from None
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(bounded_numbers(closed_objects(schema)),
                                                             defaults=JSON_LAYOUT)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"JSON schema cannot be used: {e}") from None


def choice_regex(choice: list[str]) -> str:
    """A regex matching exactly the strings; every character but ASCII letters and digits is written as
    \\x{hex}, which Rust's regex syntax reads literally whatever the character."""
    def literal(text: str) -> str:
        return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
    return "|".join(f"(?:{literal(text)})" for text in choice)


def closed_objects(schema):
    """The schema with additionalProperties: false on every object that lists properties and says nothing
    of other keys, as OpenAI's strict mode, xgrammar and Outlines do: otherwise a model may add keys forever.
    Every output of the closed schema is valid for the original."""
    return _each_subschema(schema, _closed)


def _closed(schema: dict) -> dict:
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def bounded_numbers(schema):
    """The schema with every "integer" or "number" (alone or in a list of types) bounded to +-SAFE_INTEGER on
    each side it leaves open (module docstring). Every output of the bounded schema is valid for the original."""
    return _each_subschema(schema, _bounded)


def _bounded(schema: dict) -> dict:
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if not {"integer", "number"} & set(types) or "enum" in schema or "const" in schema:
        return schema
    lows = [schema[k] for k in ("minimum", "exclusiveMinimum") if k in schema]
    highs = [schema[k] for k in ("maximum", "exclusiveMaximum") if k in schema]
    bounded = dict(schema)
    if not highs and all(low < SAFE_INTEGER for low in lows):  # a minimum beyond the bound keeps the top open
        bounded["maximum"] = SAFE_INTEGER
    if not lows and all(high > -SAFE_INTEGER for high in highs):
        bounded["minimum"] = -SAFE_INTEGER
    return bounded


def _each_subschema(schema, rewrite):
    """The schema with rewrite applied to each of its subschemas, innermost first. Values (enum, const, ...) are
    not schemas and stay as they are; neither do not/if subschemas; the names in a map of subschemas
    (properties, $defs, ...) are names, not keywords."""
    if isinstance(schema, list):
        return [_each_subschema(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            rewritten[key] = {name: _each_subschema(sub, rewrite) for name, sub in value.items()}
        elif key in VALUE_KEYWORDS or key in NEGATED_KEYWORDS:
            rewritten[key] = value
        else:
            rewritten[key] = _each_subschema(value, rewrite)
    return rewrite(rewritten)


def mask_penalty(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [rows, words] -> float32 [rows, vocab_size]: 0 where allowed, -1e30 elsewhere, to add to
    logits (-1e30, not -inf, so that 0 * penalty stays 0; this measured faster than torch's masked_fill_
    here)."""
    words = bitmask.cpu().numpy().view(np.uint8)  # little-endian: bit t of the row is token t
    bits = torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size])
    return bits.to(torch.float32).sub_(1).mul_(1e30)
