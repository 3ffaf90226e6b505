"""Paged KV cache bookkeeping: fixed-size blocks, reference counted, with automatic prefix caching.

A full block whose K/V are computed is keyed by (its parent block's digest, its token ids, the
sequence's adapter id, whether it runs on a longrope model's long factors): the same tokens after the same prefix
under the same adapter have the same K/V, and a prefix computed under one adapter, or one set of rotary factors
(engine/layers/rotary.py), is never reused under another. A block's digest chains
its parent's digest, its tokens and a CRC of its adapter id through the hash of a tuple of ints, which,
unlike the hash of a string, is the same in every process: a router computes a prompt's digests with
`prompt_digests` and compares them with the ones a replica reports (`cached_digests`). A new sequence takes
the cached blocks of its longest matching prefix by reference instead of recomputing them. A block
whose last owner finishes goes back to the free list but keeps its key, so it can still be matched
until its space is needed; the free list hands out the least recently freed block first (and frees
a sequence's tail blocks before its head, which more sequences share). In a model whose every layer slides over a
window, a running sequence gives back the blocks behind it as it goes (`release_behind`), the same way.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the serving side computes prompt_digests without torch, which engine.sequence imports
    from engine.sequence import Sequence


REPORTED_DEPTH = 64  # cached_digests reports blocks among the first this many of a prompt (1,024 tokens at 16)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def kv_code(adapter_id: str | None, long_rope: bool = False) -> int:
    """What, besides the tokens, a block's K/V depend on: the adapter's CRC (32 bits), and the long rotary factors
    above them."""
    return (zlib.crc32(adapter_id.encode()) if adapter_id is not None else 0) | (long_rope << 32)


def chain_digest(parent: int, tokens: tuple[int, ...], code: int) -> int:
    """A block's digest: the same in every process for the same tokens after the same prefix and kv_code."""
    return hash((parent, tokens, code))


def prompt_digests(token_ids: list[int], adapter_id: str | None, block_size: int,
                   max_blocks: int = REPORTED_DEPTH, long_rope: bool = False) -> list[int]:
    """The digests of the prompt blocks a sequence could take from a prefix cache (its last token always
    computed), as far as `max_blocks`."""
    code, parent, digests = kv_code(adapter_id, long_rope), 0, []
    for i in range(min(max_blocks, (len(token_ids) - 1) // block_size)):
        parent = chain_digest(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), code)
        digests.append(parent)
    return digests


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens of admitted sequences
    hit_tokens: int = 0  # of those, taken from cached blocks
    evictions: int = 0  # cached blocks reused for other tokens


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.cached: dict[tuple, int] = {}  # block key -> block holding those K/V
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.digest_of = [0] * num_blocks  # chain_digest of the block's key, while it has one
        self.depth_of = [0] * num_blocks  # the block's index in the sequence that keyed it
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its block table covers `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Whether `seq`, after taking the cached `prefix` blocks, can cover `num_tokens` tokens."""
        missing = max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table) - len(prefix))
        free_after = len(self.free_blocks) - sum(1 for block in prefix if block in self.free_blocks)
        return missing <= free_after

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self.free_blocks)}")
        for _ in range(missing):
            block, _ = self.free_blocks.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            seq.add_block(block)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of `seq`'s tokens, at least its last token left out (it
        must be computed for its logits). Takes nothing yet."""
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        blocks, parent = [], 0
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(self._key(seq, i, parent))
            if block is None:
                break
            blocks.append(block)
            parent = self.digest_of[block]
        return blocks

    def take_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Give a sequence without blocks the cached prefix blocks by reference; they count as computed."""
        for block in prefix:
            self.free_blocks.pop(block, None)
            self.ref_counts[block] += 1
            seq.add_block(block)
        seq.took_prefix(len(prefix), self.block_size)
        if self.enable_prefix_caching:
            self.prefix_stats.queried_tokens += seq.num_tokens
            self.prefix_stats.hit_tokens += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Key the sequence's blocks that became full and computed, so later sequences can match them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        code = kv_code(seq.adapter_id, seq.long_rope)
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            parent = self.digest_of[seq.block_table[i - 1]] if i else 0
            key = self._key(seq, i, parent)
            self.key_of[block] = key  # a duplicate of a cached block keeps the key too: its children chain from it
            self.digest_of[block] = chain_digest(parent, key[1], code)
            self.depth_of[block] = i
            self.cached.setdefault(key, block)
        seq.hashed(full)

    def cached_digests(self) -> frozenset[int]:
        """The digests of cached blocks among the first REPORTED_DEPTH of their prompts, for routing. Safe from
        another thread: list() copies the dict's values without letting the engine thread run."""
        blocks = list(self.cached.values())
        return frozenset(self.digest_of[b] for b in blocks if self.depth_of[b] < REPORTED_DEPTH)

    def _key(self, seq: Sequence, index: int, parent: int) -> tuple:
        """(the parent block's digest, the block's tokens, the adapter id, long rotary factors or not): the id
        itself, not its CRC, so two adapters never share K/V."""
        start = index * self.block_size
        return parent, tuple(seq.token_slice(start, start + self.block_size)), seq.adapter_id, seq.long_rope

    def _forget(self, block: int) -> None:
        key = self.key_of[block]
        if key is not None:
            self.key_of[block] = None
            if self.cached.get(key) == block:
                del self.cached[key]
                self.prefix_stats.evictions += 1

    def release_behind(self, seq: Sequence, window: int) -> None:
        """Give back the blocks whose every key lies behind the window of the sequence's next token, in a model
        whose every layer attends over `window` keys: no query reads them again (the attention kernel starts at
        a window's first block). Their entries stay in the block table, so that later blocks keep their index;
        a keyed block stays in the prefix cache until it is reused. Call it after cache_computed_blocks, whose
        digests chain through the block table."""
        first_key = seq.num_computed_tokens - window + 1  # the next query's window: keys first_key .. its position
        behind = max(0, first_key) // self.block_size
        if self.enable_prefix_caching:  # the next block keyed chains from the last keyed one's digest: keep that
            behind = max(0, min(behind, seq.num_hashed_blocks - 1))
        for block in seq.block_table[seq.num_released_blocks:behind]:
            self._unref(block)
        seq.released(behind)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table[seq.num_released_blocks:]):
            self._unref(block)
        seq.freed()

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None  # most recently freed: reused last
