"""The three baseline generation loops of the "Efficiently Serving LLMs" course, on an HF causal LM, all greedy.

Each loop takes (model, tokenizer, requests, batch_size), where requests is a list of (prompt, max_new_tokens), and
returns the generated token ids of every request (EOS is ignored: every request gets exactly max_new_tokens).
"""

from __future__ import annotations

import torch


def prepare_tokenizer(tokenizer):
    """The course pads on the left so every prompt ends at the last column; pad with EOS when no pad token exists."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@torch.inference_mode()
def generate_no_kv_cache(model, tokenizer, requests, batch_size=1) -> list[list[int]]:
    """(i) One request at a time; every new token re-runs the model over the whole sequence so far."""
    outputs = []
    for prompt, max_new_tokens in requests:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits
            next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
        outputs.append(ids[0, -max_new_tokens:].tolist())
    return outputs


@torch.inference_mode()
def generate_kv_cache(model, tokenizer, requests, batch_size=1) -> list[list[int]]:
    """(ii) One request at a time; the prompt runs once, then each step feeds only the newest token plus the cache."""
    outputs = []
    for prompt, max_new_tokens in requests:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        past, tokens = None, []
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values  # a transformers Cache object: pass it back as returned
            ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens.append(ids.item())
        outputs.append(tokens)
    return outputs


@torch.inference_mode()
def generate_static_batches(model, tokenizer, requests, batch_size) -> list[list[int]]:
    """(iii) Static batching: fixed groups of `batch_size` requests, left padded, each group decoding until its
    longest request is done (shorter requests keep only their first max_new_tokens)."""
    prepare_tokenizer(tokenizer)
    outputs = []
    for start in range(0, len(requests), batch_size):
        group = requests[start:start + batch_size]
        batch = tokenizer([prompt for prompt, _ in group], return_tensors="pt", padding=True)
        rows = _decode_batch(model, batch.input_ids, batch.attention_mask, max(n for _, n in group))
        outputs += [row[:n] for row, (_, n) in zip(rows, group)]
    return outputs


def _decode_batch(model, input_ids, attention_mask, steps: int) -> list[list[int]]:
    """Greedy decode of one left-padded batch with a KV cache and explicit position ids."""
    # Positions count real tokens only; padding slots get a dummy position (they are masked out anyway).
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    past, new_ids = None, []
    for _ in range(steps):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        input_ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        new_ids.append(input_ids)
        attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=1)
        position_ids = position_ids[:, -1:] + 1
    return torch.cat(new_ids, dim=1).tolist()
