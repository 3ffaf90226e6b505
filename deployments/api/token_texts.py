"""The text of single tokens, as the HTTP responses show them, cached per replica.

Logprobs show every chosen token and each of its alternatives as text, and TGI marks special tokens: without a
cache, one tokenizer call per alternative per streamed token (and transformers rebuilds `all_special_ids` on every
access, so the special ids are taken once). A token's text never changes, so each is decoded once and kept; the
cache is bounded by the vocabulary (SmolLM2: 49,152 short strings, a few MiB at most). Reads and writes of a dict
are atomic under the GIL, and a race only decodes a token twice.
"""

from __future__ import annotations

from collections.abc import Iterable


class TokenTexts:
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def text(self, token_id: int) -> str:
        """The token decoded alone (what `tokenizer.decode([token_id])` gives)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def texts(self, token_ids: Iterable[int]) -> list[str]:
        return [self.text(t) for t in token_ids]

    def piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it (TGI shows special tokens so)."""
        return self._tokenizer.convert_ids_to_tokens(token_id)

    def decode(self, token_ids: list[int]) -> str:
        """A whole sequence's text (an echoed prompt given as token ids)."""
        return self._tokenizer.decode(token_ids)
