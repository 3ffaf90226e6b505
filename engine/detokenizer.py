"""Incremental detokenization for streaming, with stop strings.

Each new token's text is released only once it no longer ends in a partial UTF-8 character. Stop strings are
searched in the new text (and the tail before it, so a stop string split across tokens is found); the text is cut
where the stop string begins, or where it ends when the request keeps it. While streaming, a tail that could still
grow into a stop string is held back.

With a fast tokenizer whose decoding transformers leaves as is (no clean-up of spaces), each token goes through
the tokenizers library's own incremental decoder (DecodeStream, in Rust, one call a token) instead of two decodes
of a window, and the stop-string bookkeeping skips what cannot match. A token added and its text taken (SmolLM2's
tokenizer, mixed text and emoji) costs much less that way than two decodes of a window and a full stop search,
with stop strings or without. On an H100 at batch 64 they were one of the largest items of a decode step's host
work, which the device waits for, beside scheduling and the graph's replay (gpu_profile, docs/benchmarks.md).

Otherwise, and for the rest of a request whose stream refuses a token (tokenizers raises "Invalid prefix
encountered" where a decoder's text is not monotonic in its tokens), the Python path decodes the window twice per
token, through the fast tokenizer's own `decode` where it can (the transformers wrapper converts and checks its
arguments at every call, which costs more than a few tokens' decode).
"""

from __future__ import annotations

from typing import Callable

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 6  # prompt tokens decoded along with the first outputs, for tokenizers whose spacing depends on them


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 stream: bool = True, keep_stop: bool = False):
        """stream: the tokenizers library's incremental decoder where the tokenizer allows it (False: the Python
        path, the stream's reference in tests). keep_stop: the text keeps the stop string it ends with."""
        self.decode = token_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.keep_stop = keep_stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_emitted_chars = 0
        self.backend = stream_backend(tokenizer) if stream else None
        self.stream = None if self.backend is None else DecodeStream(ids=list(self.ids),
                                                                     skip_special_tokens=skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Decode one more token. Returns True when a stop string has been reached."""
        self.ids.append(token_id)
        if self.stream is not None:
            try:
                new_text = self.stream.step(self.backend, token_id)
            except Exception:  # noqa: BLE001 - the stream's state is lost: the Python path takes over from here
                self.leave_stream()
                return self._decode_window()
            if not new_text:
                return False  # held back: an incomplete character
            self.read_offset = len(self.ids)  # every id so far has its text out
            return self._append(new_text)
        return self._decode_window()

    def leave_stream(self) -> None:
        """Go on with the Python path: the ids not yet turned into text are decoded with the next token, after up
        to CONTEXT_TOKENS of those before them."""
        self.stream = None
        self.prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)

    def _decode_window(self) -> bool:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet, or a multi-byte character still incomplete
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(new_text)

    def _append(self, new_text: str) -> bool:
        if not self.stop:
            self.text += new_text
            return False
        search_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += new_text
        hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            start, stop = min(hits, key=lambda hit: hit[0])  # the first to begin; of those, the first listed
            self.text = self.text[:start + len(stop) if self.keep_stop else start]
            return True
        return False

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, minus a tail that may begin a stop string."""
        end = len(self.text) if finished or not self.stop else len(self.text) - self._partial_stop_len()
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta

    def _partial_stop_len(self) -> int:
        longest = 0
        tail = self.text[1 - self.longest_stop:] if self.longest_stop > 1 else ""
        for stop in self.stop:
            if stop[0] not in tail:  # no stop begins in the tail: the common case, one scan of a few characters
                continue
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=self.skip_special_tokens)


def stream_backend(tokenizer):
    """The tokenizers library's tokenizer under `tokenizer` when its decoding, whole or incremental, gives what
    `tokenizer.decode` gives (a fast tokenizer without transformers' clean-up of spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


def token_decoder(tokenizer) -> Callable[..., str]:
    """decode(ids, skip_special_tokens=...) giving what `tokenizer.decode` gives, by the shortest path."""
    backend = stream_backend(tokenizer)
    return tokenizer.decode if backend is None else backend.decode
