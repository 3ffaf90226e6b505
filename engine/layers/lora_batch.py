"""The per-step layout of adapter tokens that every LoRA linear of the model shares.

Tokens are grouped by adapter slot into segments (one weight copy per adapter, never per token).
Segments of similar length form a group, computed as one padded [segments, longest, in] batched
matmul; a long prefill chunk next to single decode tokens gets a group of its own instead of
padding every decode segment to its length. The groups' deltas are concatenated, the padding is
dropped, and the rest is added to the tokens' rows of the base output.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

# An extra group costs about as much as this much padded LoRA math (its ~6 kernel launches, ~30 us on a CPU).
GROUP_COST_FLOPS = 1_000_000


@dataclass
class LoRAGroup:
    segments: int
    longest: int
    gather_index: torch.Tensor | None  # [segments * longest] token rows, padded with row 0; None: all rows, in order
    slots: torch.Tensor | slice  # [segments]; a slice when the slots are contiguous (weights are then a view)


@dataclass
class LoRABatch:
    groups: list[LoRAGroup]
    valid_positions: torch.Tensor | None  # the real tokens' positions in the groups' concatenated grid; None: all
    token_rows: torch.Tensor | None  # the row of each real token, same order; None: every row, in order


class LoRAStepState:
    """The runner sets `batch` before each forward pass; every LoRALinear reads it."""

    def __init__(self):
        self.batch: LoRABatch | None = None


def padding_allowance(row_flops: int) -> int:
    """Padded rows a group may take on rather than start a new group, for LoRA math of row_flops per row
    (averaged over the model's LoRA linears: each of them pays for both)."""
    return max(1, GROUP_COST_FLOPS // row_flops)


def build_lora_batch(runs: list[tuple[int, int]], device: torch.device, allowance: int = 32) -> LoRABatch | None:
    """runs: (adapter slot, token count) for consecutive stretches of the flat batch; slot -1 is base-only.
    allowance: padded rows a group may add before a new group pays off (see padding_allowance)."""
    rows_by_slot: dict[int, list[int]] = {}
    total = 0
    for slot, count in runs:
        if slot >= 0:
            rows_by_slot.setdefault(slot, []).extend(range(total, total + count))
        total += count
    if not rows_by_slot:
        return None
    groups = _group_segments({slot: len(rows) for slot, rows in rows_by_slot.items()}, allowance)
    gather: list[int] = []
    valid: list[int] = []
    token_rows: list[int] = []
    for longest, slots in groups:
        for slot in slots:
            rows = rows_by_slot[slot]
            valid += range(len(gather), len(gather) + len(rows))
            token_rows += rows
            gather += rows
            gather += [0] * (longest - len(rows))
    padded = len(valid) < len(gather)
    in_order = not padded and token_rows == list(range(total))
    sizes = [longest * len(slots) for longest, slots in groups] + [len(slots) for _, slots in groups]
    packed = gather + [slot for _, slots in groups for slot in slots] + valid + token_rows
    tensors = torch.frombuffer(array("q", packed), dtype=torch.long).to(device).split(
        sizes + [len(valid), len(token_rows)])  # one host-to-device copy for every index
    return LoRABatch(
        [LoRAGroup(len(slots), longest, None if in_order else gather_t, _slot_index(slots, slots_t))
         for (longest, slots), gather_t, slots_t in zip(groups, tensors, tensors[len(groups):])],
        tensors[-2] if padded else None,
        None if in_order else tensors[-1])


def _group_segments(lengths: dict[int, int], allowance: int) -> list[tuple[int, list[int]]]:
    """(longest, slots) per group. Longest segments first; a group takes the next one while its padding stays
    within the allowance. A group's slots are sorted, so that they are often one contiguous slice."""
    groups: list[tuple[int, list[int]]] = []
    padding = 0
    for slot, length in sorted(lengths.items(), key=lambda item: -item[1]):
        if groups and padding + groups[-1][0] - length <= allowance:
            groups[-1][1].append(slot)
            padding += groups[-1][0] - length
        else:
            groups.append((length, [slot]))
            padding = 0
    for _, slots in groups:
        slots.sort()
    return groups


def _slot_index(slots: list[int], as_tensor: torch.Tensor) -> torch.Tensor | slice:
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[-1] + 1)
    return as_tensor
