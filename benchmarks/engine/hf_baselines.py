"""Hugging Face transformers baselines: static batches through `model.generate`, and transformers' own continuous
batching (`model.generate_batch` and the manager it wraps). All greedy, EOS ignored."""

from __future__ import annotations

import math
import time

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingConfig

NO_EOS = -1  # an EOS id no token can match: generation always runs to max_new_tokens


@torch.inference_mode()
def generate_static(model, tokenizer, requests, batch_size) -> list[list[int]]:
    """`model.generate` over fixed left-padded batches; a batch runs until its longest request is done
    (`min_new_tokens` forbids EOS before that), shorter requests keep their first max_new_tokens."""
    outputs = []
    for start in range(0, len(requests), batch_size):
        group = requests[start:start + batch_size]
        steps = max(n for _, n in group)
        batch = tokenizer([prompt for prompt, _ in group], return_tensors="pt", padding=True)
        ids = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        new = ids[:, batch.input_ids.shape[1]:].tolist()
        outputs += [row[:n] for row, (_, n) in zip(new, group)]
    return outputs


def _cb_configs(tokenizer, requests, max_batch: int, max_batch_tokens: int, page_size: int = 32):
    """Generation config without EOS, and a KV cache sized for `max_batch` concurrent requests (on CPU the default
    would size the cache from free RAM)."""
    longest = max(len(tokenizer(p).input_ids) + n for p, n in requests)
    num_blocks = math.ceil(1.25 * min(max_batch, len(requests)) * math.ceil(longest / page_size)) + 4
    gen = GenerationConfig(max_new_tokens=max(n for _, n in requests), do_sample=False, eos_token_id=NO_EOS,
                           pad_token_id=tokenizer.pad_token_id)
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_batch)
    return gen, cb


def generate_continuous(model, tokenizer, requests, max_batch: int, max_batch_tokens: int = 4096) -> list[list[int]]:
    """transformers' continuous batching. `generate_batch` takes one max_new_tokens for all requests, so workloads
    with mixed lengths go through the manager it wraps (`continuous_batching_context_manager`), one add_request each.
    Not under inference_mode: the manager's worker thread updates tensors created here in place."""
    gen, cb = _cb_configs(tokenizer, requests, max_batch, max_batch_tokens)
    inputs = [tokenizer(prompt).input_ids for prompt, _ in requests]
    if len({n for _, n in requests}) == 1:
        results = model.generate_batch(inputs=inputs, generation_config=gen, continuous_batching_config=cb)
        ordered = list(results.values())
    else:
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       block=True, timeout=5) as manager:
            ids = [manager.add_request(x, max_new_tokens=n) for x, (_, n) in zip(inputs, requests)]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching loop stopped unexpectedly")
        ordered = [results[i] for i in ids]
    errors = [r.error for r in ordered if r.error is not None]
    if errors or len(ordered) != len(requests):
        raise RuntimeError(f"generate_batch: {len(ordered)}/{len(requests)} results, errors: {errors[:1]}")
    return [list(r.generated_tokens) for r in ordered]


class _TokenClock:
    """A generate() streamer that only timestamps: the first put() is the prompt, each later one a new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.inference_mode()
def decode_ms_per_token(model, tokenizer, prompt: str, new_tokens: int) -> float:
    """Single-stream decode speed of `model.generate`: (latency - time to first token) / (new_tokens - 1)."""
    batch = tokenizer(prompt, return_tensors="pt")
    clock = _TokenClock()
    start = time.perf_counter()
    model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=tokenizer.pad_token_id, streamer=clock)
    latency = time.perf_counter() - start
    ttft = clock.times[1] - start
    return (latency - ttft) / (new_tokens - 1) * 1000
