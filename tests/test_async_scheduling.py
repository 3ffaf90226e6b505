"""Async scheduling (the async_scheduling option) gives every request the synchronous engine's tokens.

On CPU the model runs on the host, so the overlap saves nothing there, but the mechanism is the same as on CUDA:
step N+1 is scheduled and run before step N's tokens are read, its decode inputs taken from step N's sampled
tokens as tensors, and a sequence that step N ended has its row of N+1 dropped. These tests run both engines on the
same requests, in float32, and compare every token, logprob and finish reason: greedy and seeded sampling, stop
strings, penalties, preemption, chunked prefill with prefix caching, adapters, and aborts while a token is in flight.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import PENDING_TOKEN
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters


def _params(count: int) -> list[SamplingParams]:
    """A mix: greedy and seeded rows, stop strings, logprobs, a repetition penalty, min_tokens, lengths that end
    apart."""
    params = []
    for i in range(count):
        params.append(SamplingParams(
            max_tokens=12 + 5 * (i % 4), temperature=0.0 if i % 2 else 0.9, top_p=0.9 if i % 3 == 1 else 1.0,
            seed=100 + i, stop=["."] if i % 3 == 0 else [], logprobs=2 if i % 4 == 0 else None,
            repetition_penalty=1.3 if i % 5 == 2 else 1.0, min_tokens=4 if i % 5 == 3 else 0))
    return params


KV_CACHE = {"kv_cache_bytes": 32 << 20}  # the default 512 MiB, times a dozen engines, would crowd out the suite


def _generate(path, overlap: bool, prompts, params, adapter_ids=None, **options):
    llm = LLM(str(path), async_scheduling=overlap, log_stats=False, **{**KV_CACHE, **options})
    outs = llm.generate(prompts, params, use_tqdm=False, adapters=adapter_ids)
    return llm, [(o.token_ids, o.text, o.finish_reason, o.logprobs, o.top_logprobs) for o in outs]


def _same_with_and_without(path, prompts, params, adapter_ids=None, **options):
    """Tokens, text and finish reasons equal; logprobs within 1e-4 (a step's batch can differ: a sequence ended by
    the token in flight still holds its row, so float32 sums may round apart)."""
    _, synchronous = _generate(path, False, prompts, params, adapter_ids, **options)
    llm, overlapped = _generate(path, True, prompts, params, adapter_ids, **options)
    for i, (a, b) in enumerate(zip(synchronous, overlapped)):
        assert a[:3] == b[:3], f"request {i}: {a[:3]} != {b[:3]}"
        assert a[3] == pytest.approx(b[3], abs=1e-4)
        assert [set(top) for top in a[4]] == [set(top) for top in b[4]]
        for top_a, top_b in zip(a[4], b[4]):
            assert top_a == pytest.approx(top_b, abs=1e-4)
    return llm


def test_off_by_default_on_every_device():
    """Opt-in until a GPU run verifies it (docs/gpu.md), on CUDA as on CPU."""
    for device in ("cpu", "cuda"):
        assert not EngineConfig.from_overrides(device=device).scheduler.async_scheduling
    assert EngineConfig.from_overrides(device="cpu", async_scheduling=True).scheduler.async_scheduling


def test_real_model_sampled_stopped_and_scored(smollm2_path):
    """SmolLM2 writes real text, so the stop strings end requests early, a step before the overlapped engine
    learns of it."""
    params = _params(len(PROMPTS))
    llm = _same_with_and_without(smollm2_path, PROMPTS, params, max_num_seqs=8)
    assert llm.engine.overlap


def test_preempted_and_chunked(tiny_llama_path):
    """Few KV blocks: running sequences are preempted (some with a token in flight) and recomputed; a small token
    budget chunks the prompts, and a repeated prompt reuses the first's cached blocks."""
    prompts = PROMPTS[:12] + [PROMPTS[1] * 3, PROMPTS[1] * 3]
    params = _params(len(prompts))
    llm = _same_with_and_without(tiny_llama_path, prompts, params, max_num_seqs=16, num_kv_blocks=24, block_size=4,
                                 max_num_batched_tokens=24)
    assert llm.engine.scheduler.total_preemptions > 0
    assert llm.engine.block_manager.prefix_stats.hit_tokens > 0


def test_mixed_adapters(tiny_llama_path, tmp_path):
    write_tiny_adapters(tiny_llama_path, tmp_path, ("a", "b", "c"))
    adapter_ids = [None, "a", "b", "c", "a", None, "c", "b"]
    prompts = PROMPTS[:len(adapter_ids)]
    _same_with_and_without(tiny_llama_path, prompts, _params(len(prompts)), adapter_ids, adapters=local_adapters,
                           max_loras=2, adapters_root=str(tmp_path))


def _engine(path, overlap: bool) -> LLMEngine:
    return LLMEngine(EngineConfig.from_overrides(str(path), async_scheduling=overlap, log_stats=False, **KV_CACHE))


def _run(engine: LLMEngine, abort_after: int) -> dict:
    """Four greedy requests; request "r1" is aborted after `abort_after` steps. Returns each request's last
    output."""
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=16, temperature=0.0))
    last, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            last[out.request_id] = out
        steps += 1
        if steps == abort_after:
            last["r1"] = engine.abort("r1")
    return last


def test_abort_with_a_token_in_flight(tiny_llama_path):
    """An abort between two steps finds the aborted request's last token still in flight in the overlapped
    engine: that token is dropped, none of its outputs follow the abort, and the other requests are unchanged."""
    synchronous, overlapped = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    expected, got = _run(synchronous, abort_after=3), _run(overlapped, abort_after=3)
    for request_id in ("r0", "r2", "r3"):
        assert got[request_id].token_ids == expected[request_id].token_ids
    aborted = got["r1"]
    assert aborted.finish_reason == "abort" and PENDING_TOKEN not in aborted.token_ids
    # the overlapped engine had read back one token fewer when the abort came
    assert aborted.token_ids == expected["r1"].token_ids[:-1]
    assert not overlapped.requests and not overlapped.block_manager.num_used_blocks


def test_tokens_come_back_one_step_late(tiny_llama_path):
    """The overlap is real: the step that samples a request's first token returns nothing, and the next call
    returns it, with the next step already run."""
    engine = _engine(tiny_llama_path, True)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.step() == []  # the prompt ran and its first token is in flight
    seq = engine.scheduler.running[0]
    assert seq.output_token_ids == [PENDING_TOKEN]
    first = engine.step()  # the first decode ran on the token in flight; its own token is in flight now
    assert [len(out.new_token_ids) for out in first] == [1]
    assert seq.num_computed_tokens == len(seq.prompt_token_ids) + 1
    outputs = first
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 3


@pytest.mark.parametrize("overlap", [False, True])
def test_nothing_left_behind(tiny_llama_path, overlap):
    """Every request finishes, and each frees its blocks, whichever engine ran it."""
    llm, outs = _generate(tiny_llama_path, overlap, PROMPTS[:6], _params(6))
    assert all(reason for _, _, reason, _, _ in outs)
    assert not llm.engine.block_manager.num_used_blocks and not llm.engine.has_unfinished()
