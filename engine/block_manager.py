"""Paged KV cache bookkeeping: fixed-size blocks handed out from a free list.

Reference counts are kept per block so that prefix sharing can later map one block into several
sequences' block tables; today every block has exactly one owner.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` still needs so that its block table covers `num_tokens` tokens."""
        return max(0, blocks_needed(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > len(self.free_blocks):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self.free_blocks)}")
        for _ in range(missing):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
