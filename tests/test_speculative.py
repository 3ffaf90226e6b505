"""Speculative decoding (engine/speculative/): the n-gram proposer, and greedy outputs equal to decoding without it,
token for token, for the base model and mixed adapters in one batch, with preemption, chunked prefill, prefix-cache
hits, stop strings and length limits; requests that do not decode greedily share the steps unspeculated."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex
from engine.speculative.speculator import SequenceDrafts, Speculator
from engine.step_cost import StepCost, StepShape
from lora_cache.local_cache import local_adapters
from tests.helpers import write_tiny_adapters

# Steps sized by tokens alone: without the step-cost model every sequence drafts, whatever its record, so that
# these tests verify drafts throughout
OPTIONS = {"kv_cache_bytes": 32 << 20, "step_time_target_s": None}
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4}
# Prompts that SmolLM2 continues by quoting them, as extraction and editing do: most drafts are right
QUOTING = ["Copy the list exactly.\nList: apples, pears, plums, cherries, figs, dates, limes, grapes.\nCopy: apples,",
           "Fix the typo and repeat the sentence: The quick brown fox jumpd over the lazy dog by the river.\nFixed:",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Repeat after me: red, green, blue, red, green, blue, red,"]


def test_the_longest_tail_seen_before_proposes_what_followed_its_latest_occurrence():
    index = NgramIndex(shortest=2, longest=3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert index.propose(3) == [7, 8, 5]  # "2 3" last followed at 6; "5 2 3" was never seen
    index.extend([1])
    assert index.propose(4) == []  # "3 1" and "2 3 1": never followed before... until now
    index.extend([2, 3])
    assert index.propose(2) == [7, 8]  # "1 2 3" latest followed at positions 4-6
    assert index.propose(1) == [7]
    assert NgramIndex(2, 4).propose(3) == []


def test_options_refused_by_name():
    with pytest.raises(ValueError, match="speculative_method must be one of ngram, got 'suffix'"):
        EngineConfig.from_overrides(speculative_method="suffix")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_overrides(speculative_method="ngram", async_scheduling=True)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig.from_overrides(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    assert not EngineConfig().speculative.enabled


def _generate(path, prompts, params, adapter_ids=None, **options):
    llm = LLM(str(path), log_stats=False, **{**OPTIONS, **options})
    outs = llm.generate(prompts, params, use_tqdm=False, adapters=adapter_ids)
    return llm, [(o.token_ids, o.text, o.finish_reason) for o in outs]


def _same_with_and_without(path, prompts, params, adapter_ids=None, **options):
    """Every request's tokens, text and finish reason equal; the speculating engine, whose stats must show drafts
    both accepted and rejected, so that the comparison is not vacuous."""
    plain = _generate(path, prompts, params, adapter_ids, **options)[1]  # its engine freed before the next loads
    llm, speculated = _generate(path, prompts, params, adapter_ids, **{**options, **NGRAM})
    for i, (a, b) in enumerate(zip(plain, speculated)):
        assert a == b, f"request {i}: {a} != {b}"
    stats = llm.engine.stats()
    assert 0 < stats.speculative_accepted_tokens < stats.speculative_proposed_tokens
    return llm


def _mixed(count: int) -> list[SamplingParams]:
    """Mostly greedy; every fourth seeded and sampled, every fifth with logprobs (neither speculates), stop strings
    and lengths that end apart."""
    return [SamplingParams(max_tokens=16 + 7 * (i % 3), temperature=0.8 if i % 4 == 3 else 0.0, seed=i,
                           logprobs=1 if i % 5 == 4 else None, stop=[", red"] if i % 6 == 2 else [],
                           ignore_eos=True) for i in range(count)]


@pytest.fixture(scope="module")
def tiny_16_path(tmp_path_factory, tokenizer):
    """A random tiny Llama over 16 tokens: its greedy output falls into loops, so its drafts are right at times
    (one over SmolLM2's vocabulary never repeats itself)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-16")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _token_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 16) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def test_random_model_with_mixed_adapters(tiny_16_path, tmp_path):
    write_tiny_adapters(tiny_16_path, tmp_path, ["a0", "a1"])
    prompts = _token_prompts(12)
    adapter_ids = [None, "a0", "a1"] * 4
    _same_with_and_without(tiny_16_path, prompts, _mixed(len(prompts)), adapter_ids, adapters=local_adapters,
                           max_loras=2, adapters_root=str(tmp_path))


def test_preempted_chunked_and_prefix_cached(tiny_16_path):
    """Few KV blocks preempt running sequences (drafts then go without); a small token budget chunks the prompts
    and bounds the drafts; repeated prompts hit the prefix cache."""
    prompts = _token_prompts(8, seed=1) * 2
    llm = _same_with_and_without(tiny_16_path, prompts, _mixed(len(prompts)), max_num_seqs=16, num_kv_blocks=40,
                                 block_size=4, max_num_batched_tokens=24)
    assert llm.engine.scheduler.total_preemptions > 0
    assert llm.engine.block_manager.prefix_stats.hit_tokens > 0


def test_real_model_quoting_with_mixed_adapters(smollm2_path, tmp_path):
    """SmolLM2 quoting its prompt, for the base model and two adapters in the same steps: every text is the
    same."""
    write_tiny_adapters(smollm2_path, tmp_path, ["a0", "a1"])
    params = [SamplingParams(max_tokens=24, temperature=0.0, stop=[", red"] if i == 3 else []) for i in range(4)]
    _same_with_and_without(smollm2_path, QUOTING, params, [None, "a0", None, "a1"], dtype="float32",
                           adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path))


def test_a_sequence_drafts_only_while_its_record_pays_at_the_steps_batch():
    """At one decode a draft token costs little beside the step, and even a poor record drafts; at 32 decodes a
    sequence whose drafts are mostly rejected stops, and one whose drafts are mostly right goes on."""
    cost = StepCost(0.5)
    for prefill, decodes in [(0, 1), (256, 0), (0, 32), (512, 8), (128, 16), (0, 8), (1024, 0), (64, 1)] * 3:
        cost.observe(StepShape(prefill, decodes), 0.010 + 0.00025 * prefill + 0.0004 * decodes)
    assert cost.learned
    speculator = Speculator(SpeculativeConfig("ngram", 4), max_model_len=512, step_cost=cost)
    repeating = [5, 6, 7, 8] * 6

    def drafts_with(proposed: int, accepted: int, decodes: int) -> tuple[int, ...]:
        seq = Sequence("r", repeating[:-1], SamplingParams(max_tokens=64, temperature=0.0))
        seq.append_token(repeating[-1])
        seq.speculate(SequenceDrafts(NgramIndex(2, 4), proposed, accepted))
        return speculator.draft(seq, budget=64, decodes=decodes)

    assert drafts_with(40, 4, decodes=1) == (5, 6, 7, 8)
    assert drafts_with(40, 4, decodes=32) == ()
    assert drafts_with(40, 36, decodes=32) == (5, 6, 7, 8)
    unmeasured = Speculator(SpeculativeConfig("ngram", 4), 512)  # no step-cost model: every draft goes
    assert unmeasured.draft(Sequence("s", repeating, SamplingParams(max_tokens=64, temperature=0.0)), 64, 32)


def test_streams_carry_each_accepted_token_and_an_abort_frees_its_blocks(tiny_16_path):
    """Through AsyncEngine: a stream's outputs add up to the offline text, several tokens a step arriving as
    outputs of their own; a stream closed mid-way frees every KV block."""
    import asyncio

    from engine import AsyncEngine

    prompts = _token_prompts(4, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, offline = _generate(tiny_16_path, prompts, [params] * len(prompts), **NGRAM)
    engine = AsyncEngine(model=str(tiny_16_path), log_stats=False, **OPTIONS, **NGRAM)

    async def stream(i: int, stop_after: int | None = None) -> list[int]:
        tokens = []
        async for out in engine.generate(f"{'cut' if stop_after else 'whole'}-{i}", prompts[i], params):
            tokens += out.new_token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                break
        return tokens

    async def run():
        return await asyncio.gather(*(stream(i) for i in range(len(prompts))), stream(0, stop_after=5))

    try:
        *whole, cut = asyncio.run(run())
        assert whole == [tokens for tokens, _, _ in offline] and len(cut) >= 5
        stats = engine.stats()
        assert stats.speculative_accepted_tokens > 0 and stats.kv_blocks_used == 0 and stats.running == 0
    finally:
        engine.shutdown()

