"""Incremental detokenization: same text as a full decode, no broken UTF-8, stop strings cut right."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer, token_decoder

TEXTS = ["Hello, world! Ünïcödé façade — naïve café.",
         "日本語のテキストと絵文字 🚀🔥👩‍👩‍👧",
         "  leading spaces\n\ttabs and\r\nlines  "]


def _stream(tokenizer, text, stop=(), prompt="Say:", stream=True, keep_stop=False):
    detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt).input_ids, list(stop), stream=stream,
                                   keep_stop=keep_stop)
    pieces, hit = [], False
    for token in tokenizer(text, add_special_tokens=False).input_ids:
        hit = detok.add_token(token)
        pieces.append(detok.take_new_text(finished=hit))
        if hit:
            break
    pieces.append(detok.take_new_text(finished=True))
    return pieces, detok, hit


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "python-path"])
def test_stream_equals_full_decode_and_never_breaks_utf8(tokenizer, stream):
    for text in TEXTS:
        pieces, detok, _ = _stream(tokenizer, text, stream=stream)
        assert "".join(pieces) == detok.text == text
        assert not any("\ufffd" in piece for piece in pieces)
        assert (detok.stream is not None) == stream  # SmolLM2's fast tokenizer takes the tokenizers stream


@pytest.mark.parametrize("skip", [True, False])
def test_both_paths_and_a_switch_between_them_give_the_full_decode(tokenizer, skip):
    """Random ids (special tokens, partial UTF-8 byte tokens) through the tokenizers stream, the Python path, and the
    stream left for the Python path part-way (what a stream that refuses a token does), against one decode of all
    of them."""
    rng = random.Random(1)
    prompt = tokenizer("Say:").input_ids
    for _ in range(30):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        texts = []
        for switch in (None, 0, len(ids) // 2, len(ids)):
            detok = IncrementalDetokenizer(tokenizer, prompt, [], skip_special_tokens=skip, stream=switch is not None)
            for i, token in enumerate(ids):
                if i == switch:
                    detok.leave_stream()
                detok.add_token(token)
            texts.append(detok.text)
        want = tokenizer.decode(prompt[-CONTEXT_TOKENS:] + ids, skip_special_tokens=skip)
        want = want[len(tokenizer.decode(prompt[-CONTEXT_TOKENS:], skip_special_tokens=skip)):]
        assert len(set(texts)) == 1, (ids, texts)
        assert texts[0] in (want, want.rstrip("\ufffd")), (ids, texts, want)  # trailing partial bytes held back


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    text = "The answer is forty-two, said the computer."
    pieces, detok, hit = _stream(tokenizer, text, stop=["forty-two"])
    assert hit
    assert detok.text == "The answer is "
    assert "".join(pieces) == "The answer is "
    assert not any("forty" in piece for piece in pieces)


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "python-path"])
def test_a_kept_stop_string_ends_the_text_and_the_first_to_begin_wins(tokenizer, stream):
    text = "The answer is forty-two, said the computer."
    pieces, detok, hit = _stream(tokenizer, text, stop=["said", "forty-two", "two"], stream=stream, keep_stop=True)
    assert hit and detok.text == "".join(pieces) == "The answer is forty-two"


def test_partial_stop_prefix_is_released_when_not_a_stop(tokenizer):
    pieces, detok, hit = _stream(tokenizer, "abc abd abe", stop=["abx"])
    assert not hit
    assert "".join(pieces) == "abc abd abe"


def test_the_short_decode_path_gives_what_the_tokenizer_gives(tokenizer):
    """The backend's decode is taken only where transformers adds nothing to it: random ids (special tokens
    included), with and without skipping special tokens, give tokenizer.decode's text; a tokenizer that cleans
    up spaces keeps transformers' decode."""
    decode = token_decoder(tokenizer)
    assert decode != tokenizer.decode  # SmolLM2's tokenizer does not clean up spaces: the short path is taken
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))] + [tokenizer.eos_token_id]
        for skip in (True, False):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert token_decoder(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False
