"""Tokenizing and detokenizing over HTTP, in the shapes vLLM's and LoRAX's (TGI's) clients send.

`POST /tokenize` takes vLLM's two bodies, a prompt (`{"prompt"}`) or a conversation rendered by the model's chat
template (`{"messages"}`), and answers vLLM's `{"count", "max_model_len", "tokens", "token_strs"}`; or TGI's body
(`{"inputs"}`), answered as TGI does, a list of `{"id", "text", "start", "stop"}` with each token's characters in
the input. `POST /detokenize` takes `{"tokens"}` and answers `{"prompt"}`. Every adapter of the base model shares
its tokenizer, so these run on the replica's tokenizer without the engine: a client counts a prompt's tokens
before sending it, or checks it fits `max_model_len`.
"""

from __future__ import annotations

from pydantic import Field

from deployments.api.chat import ChatMessage, TemplateControls
from deployments.api.strict import OpenAIModel, StrictModel

# characters of a text, ids of a list: the gate's body size limit comes first; this bounds the work anyway
MAX_TOKENIZE_LENGTH = 1 << 20


class PromptTokenize(OpenAIModel):
    """vLLM's completion form."""
    model: str | None = None
    prompt: str = Field(max_length=MAX_TOKENIZE_LENGTH)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenize(TemplateControls):
    """vLLM's chat form: the prompt /v1/chat/completions would run (tools aside), with its template controls."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    return_token_strs: bool = False


class TgiTokenize(StrictModel):
    """TGI's and LoRAX's form."""
    inputs: str = Field(max_length=MAX_TOKENIZE_LENGTH)
    add_special_tokens: bool = True


class Detokenize(OpenAIModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKENIZE_LENGTH)


def tokenize_prompt(tokenizer, text: str, add_special_tokens: bool, return_token_strs: bool,
                    max_model_len: int) -> dict:
    """vLLM's TokenizeResponse."""
    ids = tokenizer(text, add_special_tokens=add_special_tokens).input_ids
    strs = tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def tokenize_tgi(tokenizer, text: str, add_special_tokens: bool) -> list[dict]:
    """TGI's answer: each token with the characters of the input it came from (a special token added before the
    text has none: start = stop)."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return [{"id": token, "text": text[start:stop], "start": start, "stop": stop}
            for token, (start, stop) in zip(encoded.input_ids, encoded.offset_mapping)]


def detokenize(tokenizer, tokens: list[int]) -> dict:
    """vLLM's DetokenizeResponse; ValueError names the ids outside the vocabulary."""
    outside = [t for t in tokens if not 0 <= t < len(tokenizer)]
    if outside:
        raise ValueError(f"token ids outside the vocabulary [0, {len(tokenizer)}): {outside[:8]}")
    return {"prompt": tokenizer.decode(tokens)}
