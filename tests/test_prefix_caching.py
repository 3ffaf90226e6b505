"""Automatic prefix caching: shared blocks by reference, keyed by adapter, LRU reuse; same tokens as without."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.sampling import SamplingParams as Params
from engine.sequence import Sequence
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

GREEDY = SamplingParams(max_tokens=10, temperature=0)
BASE = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one


def _seq(tokens, adapter=None, rid="r"):
    return Sequence(rid, list(tokens), Params(max_tokens=4), adapter_id=adapter)


def _run(bm: BlockManager, seq: Sequence) -> None:
    """Admit seq as the scheduler does and mark its whole prompt computed."""
    prefix = bm.cached_prefix(seq)
    bm.take_prefix(seq, prefix)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def test_a_shared_prefix_is_taken_by_reference_and_kept_after_free():
    bm = BlockManager(num_blocks=8, block_size=16)
    first = _seq(BASE)
    _run(bm, first)
    assert bm.num_cached_blocks == 2  # only full blocks are keyed
    second = _seq(BASE[:32] + [7, 8, 9], rid="s")
    assert bm.cached_prefix(second) == first.block_table[:2]
    _run(bm, second)
    assert second.block_table[:2] == first.block_table[:2] and bm.ref_counts[first.block_table[0]] == 2
    assert bm.prefix_stats.hit_tokens == 32 and bm.prefix_stats.queried_tokens == 40 + 35
    bm.free(first)
    bm.free(second)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # freed, still matchable
    third = _seq(BASE[:16] + [1] * 20, rid="t")
    assert len(bm.cached_prefix(third)) == 1


def test_the_last_token_is_always_computed_and_adapters_never_share():
    bm = BlockManager(num_blocks=8, block_size=16)
    _run(bm, _seq(BASE[:32]))
    assert len(bm.cached_prefix(_seq(BASE[:32], rid="same"))) == 1  # block 2 holds the last token: recompute it
    assert bm.cached_prefix(_seq(BASE[:32] + [5], adapter="alpha", rid="a")) == []
    _run(bm, _seq(BASE[:33], adapter="alpha", rid="a"))
    assert len(bm.cached_prefix(_seq(BASE[:33], adapter="alpha", rid="a2"))) == 2
    assert len(bm.cached_prefix(_seq(BASE[:33], rid="b2"))) == 2  # the base model's own blocks


def test_freed_cached_blocks_are_reused_least_recent_first_tail_first():
    bm = BlockManager(num_blocks=4, block_size=16)
    old, new = _seq(list(range(33))), _seq(list(range(1000, 1033)), rid="n")
    for seq in (old, new):  # 3 blocks each, 4 in all: the second reuses the never-used block, then old's tail
        _run(bm, seq)
        bm.free(seq)
    assert bm.prefix_stats.evictions == 1  # old's second full block; its partial third had no key
    assert len(bm.cached_prefix(_seq(list(range(1000, 1033)), rid="x"))) == 2
    assert len(bm.cached_prefix(_seq(list(range(33)), rid="y"))) == 1  # old's first block survives


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("prefix-adapters"), ("alpha", "beta"))


def _prompts(tokenizer) -> list[list[int]]:
    """Prompts sharing prefixes of 16, 32 (block-aligned) and 23, 41 (not) tokens with a 48-token base."""
    base = tokenizer(" ".join(PROMPTS))["input_ids"][:48]
    tails = [tokenizer(p)["input_ids"][:6] for p in PROMPTS[:4]]
    return [base] + [base[:n] + tail for n, tail in zip((16, 32, 23, 41), tails)]


def _engines(path, adapters_root, **options):
    common = dict(adapters=local_adapters, dtype="float32", log_stats=False, max_loras=2,
                  adapters_root=str(adapters_root), **options)
    return LLM(str(path), **common), LLM(str(path), enable_prefix_caching=False, **common)


def test_blocks_behind_a_window_go_back_but_the_chain_s_last_keyed_block_stays():
    """release_behind gives back a sequence's blocks behind its next token's window, each once, and keeps them keyed;
    but never the last keyed block, whose digest the next block chains from through the block table: reused by
    another sequence first, it would key the chain under that sequence's prefix."""
    bm = BlockManager(num_blocks=8, block_size=16)
    seq = _seq(BASE[:39])
    _run(bm, seq)  # 39 tokens: blocks 0 and 1 full and keyed, block 2 partial
    bm.release_behind(seq, window=16)  # the next token (position 39) sees keys 24..39: block 0 is behind it
    assert seq.num_released_blocks == 1 and bm.ref_counts[seq.block_table[0]] == 0
    assert bm.ref_counts[seq.block_table[1]] == 1 and bm.num_cached_blocks == 2  # released, still matchable
    bm.release_behind(seq, window=16)  # again: nothing given back twice
    assert bm.ref_counts[seq.block_table[0]] == 0 and bm.num_free_blocks == 6
    seq.num_computed_tokens += 8  # position 47's window starts at key 32: block 1 is behind it, but is the last keyed
    bm.release_behind(seq, window=16)
    assert seq.num_released_blocks == 1 and bm.ref_counts[seq.block_table[1]] == 1
    bm.free(seq)
    assert set(bm.ref_counts) == {0} and bm.num_free_blocks == 8


@pytest.mark.parametrize("adapters", [[None] * 5, ["alpha", "alpha", None, "beta", "alpha"]], ids=["base", "mixed"])
def test_outputs_equal_caching_off_for_shared_prefixes(tiny_llama_path, tokenizer, adapters_root, adapters):
    cached, uncached = _engines(tiny_llama_path, adapters_root)
    prompts = _prompts(tokenizer)
    for llm in (cached, uncached):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, adapters=adapters[:1])  # computes the shared base
    got = cached.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
    want = uncached.generate(prompts, GREEDY, use_tqdm=False, adapters=adapters)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = cached.engine.stats()
    assert stats.prefix_cache_hit_tokens > 0 and uncached.engine.stats().prefix_cache_hit_tokens == 0
    assert stats.kv_blocks_used == 0


def test_a_prefix_under_two_adapters_is_computed_twice(tiny_llama_path, tokenizer, adapters_root):
    cached, uncached = _engines(tiny_llama_path, adapters_root)
    prompt = _prompts(tokenizer)[0]
    hits = []
    for adapter in ("alpha", "beta", "alpha", None):
        before = cached.engine.stats().prefix_cache_hit_tokens
        out = cached.generate([prompt], GREEDY, use_tqdm=False, adapters=[adapter])[0]
        hits.append(cached.engine.stats().prefix_cache_hit_tokens - before)
        assert out.num_cached_tokens == hits[-1]  # what usage reports as the request's cached tokens
        assert out.token_ids == uncached.generate([prompt], GREEDY, use_tqdm=False, adapters=[adapter])[0].token_ids
    assert hits == [0, 0, 32, 0]  # 48 tokens: 2 full blocks reusable, the third holds the last token


def test_outputs_equal_caching_off_under_preemption(tiny_llama_path, tokenizer, adapters_root):
    cached, uncached = _engines(tiny_llama_path, adapters_root, num_kv_blocks=12)
    prompts = _prompts(tokenizer) * 2
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    got = cached.generate(prompts, params, use_tqdm=False)
    want = uncached.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert cached.engine.stats().preemptions > 0 and cached.engine.stats().prefix_cache_hit_tokens > 0
