"""Structured output: JSON grammars, one matcher per constrained request, and the batch's token masks.

llguidance (the grammar engine behind vLLM's and SGLang's "guidance" backend) compiles a JSON schema
lazily against the tokenizer, so a new schema is ready in about a millisecond, and computes the
masks of a whole batch in parallel on its own Rust threads without holding the GIL. A compiled
schema is kept (LRU) as a fresh matcher that each new request copies.
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
        """A fresh matcher for one request; ValueError with the reason for an invalid schema."""
        key = json.dumps(response_format.schema, sort_keys=True)
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template.deep_copy()
        template = self._compile(response_format.schema)
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _compile(self, schema: dict) -> llguidance.LLMatcher:
        import llguidance
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError

        try:
            Draft202012Validator.check_schema(schema)
        except SchemaError as e:
            raise ValueError(f"invalid JSON schema: {e.message}") from None
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_LAYOUT)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"JSON schema cannot be used: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"JSON schema cannot be used: {matcher.get_error()}")
        return matcher

    def fill_masks(self, matchers: list[tuple[str, llguidance.LLMatcher]]) -> TokenMasks:
        """Masks of (request id, matcher) pairs, computed in parallel."""
        bitmask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        pairs = [(matcher, i) for i, (_, matcher) in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(pairs))
        return TokenMasks([request_id for request_id, _ in matchers], bitmask)


def closed_objects(schema):
    """The schema with additionalProperties: false on every object that lists properties and says nothing
    of other keys, as OpenAI's strict mode, xgrammar and Outlines do: otherwise a model may add keys forever.
    Every output of the closed schema is valid for the original."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            closed[key] = value if key in VALUE_KEYWORDS else closed_objects(value)
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def mask_penalty(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [rows, words] -> float32 [rows, vocab_size]: 0 where allowed, -1e30 elsewhere, to add to
    logits (-1e30, not -inf, so that 0 * penalty stays 0; torch's masked_fill_ took ~3 ms for 32 x 49k here,
    this takes ~1 ms)."""
    words = bitmask.cpu().numpy().view(np.uint8)  # little-endian: bit t of the row is token t
    bits = torch.from_numpy(np.unpackbits(words, axis=1, bitorder="little")[:, :vocab_size])
    return bits.to(torch.float32).sub_(1).mul_(1e30)
