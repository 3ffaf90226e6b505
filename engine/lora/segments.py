"""The per-step layout of adapter tokens that every LoRA linear of the model shares.

Tokens are grouped into segments of one adapter slot: a run of adjacent tokens, or all of a slot's
tokens when its runs are many (one weight copy per segment, never per token).
Segments of similar length form a group, computed as one padded [segments, longest, in] batched
matmul; a long prefill chunk next to single decode tokens gets a group of its own instead of
padding every decode segment to its length. The groups' deltas are concatenated, the padding is
dropped, and the rest is added to the tokens' rows of the base output.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import torch

from engine.transfer import to_device

# An extra group costs about as much as this much padded LoRA math (the fixed cost of its ~6 kernel launches).
GROUP_COST_FLOPS = 1_000_000
# Copying one segment's weights costs about as much as this many padded rows of LoRA math (a copy moves
# each weight once, at memory speed; a padded row multiplies by each weight once, at compute speed).
WEIGHT_COPY_ROWS = 8


@dataclass
class AdapterRun:
    """A stretch of adjacent tokens of the flat batch that share one adapter slot (-1: the base model only)."""
    slot: int
    tokens: int


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

    @property
    def in_order_group(self) -> LoRAGroup | None:
        """The one group, when it holds every token of the step in order, unpadded: its delta is the
        output's own layout."""
        if self.token_rows is None and len(self.groups) == 1:
            return self.groups[0]
        return None


@dataclass
class SlotOrder:
    """The flat batch's rows grouped by adapter slot: tokens[starts[s]:starts[s] + counts[s]] are slot s's rows, in
    batch order; base-model rows are in no slot's range. All on the device, read by the kernels."""
    tokens: torch.Tensor  # [T] int64
    starts: torch.Tensor  # [slots] int64
    counts: torch.Tensor  # [slots] int64


def slot_order_values(slots: list[int], num_slots: int) -> list[int]:
    """tokens (padded to len(slots)), starts and counts of a SlotOrder, on the host, as one flat list (the caller
    copies it to the device in one transfer)."""
    counts = [0] * num_slots
    for slot in slots:
        if slot >= 0:
            counts[slot] += 1
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    order = sorted((row for row, slot in enumerate(slots) if slot >= 0), key=slots.__getitem__)
    return order + [0] * (len(slots) - len(order)) + starts + counts


def slot_order(slots: list[int], num_slots: int, device: torch.device) -> SlotOrder:
    """The SlotOrder of the rows' slots (-1: base model), for slots 0 .. num_slots - 1."""
    if any(slot >= num_slots for slot in slots):
        raise ValueError(f"slot_order: a slot in {sorted(set(slots))} is not below {num_slots}")
    values = to_device(slot_order_values(slots, num_slots), device, torch.long)
    tokens, starts, counts = values.split([len(slots), num_slots, num_slots])
    return SlotOrder(tokens, starts, counts)


def padding_allowance(row_flops: int) -> int:
    """Padded rows a group may take on rather than start a new group, for LoRA math of row_flops per row
    (averaged over the model's LoRA linears: each of them pays for both)."""
    return max(1, GROUP_COST_FLOPS // row_flops)


def build_lora_batch(runs: list[AdapterRun], device: torch.device, allowance: int = 32) -> LoRABatch | None:
    """runs: the flat batch's consecutive stretches of one slot each, in order.
    allowance: padded rows a group may add before a new group pays off (see padding_allowance)."""
    segments, total = _segments(runs, allowance)
    if not segments:
        return None
    groups = _group_segments(segments, allowance)
    gather: list[int] = []
    valid: list[int] = []
    token_rows: list[int] = []
    for longest, members in groups:
        for _, rows in members:
            valid += range(len(gather), len(gather) + len(rows))
            token_rows += rows
            gather += rows
            gather += [0] * (longest - len(rows))
    padded = len(valid) < len(gather)
    in_order = not padded and token_rows == list(range(total))
    slots = [[slot for slot, _ in members] for _, members in groups]
    sizes = [longest * len(members) for longest, members in groups] + [len(s) for s in slots]
    packed = gather + [slot for group_slots in slots for slot in group_slots] + valid + token_rows
    tensors = torch.frombuffer(array("q", packed), dtype=torch.long).to(device).split(
        sizes + [len(valid), len(token_rows)])  # one host-to-device copy for every index
    return LoRABatch(
        [LoRAGroup(len(group_slots), longest, None if in_order else gather_t, _slot_index(group_slots, slots_t))
         for (longest, _), group_slots, gather_t, slots_t in zip(groups, slots, tensors, tensors[len(groups):])],
        tensors[-2] if padded else None,
        None if in_order else tensors[-1])


def per_token_slots(runs: list[AdapterRun]) -> list[int]:
    """Each token's slot (-1: the base model), in batch order."""
    return [run.slot for run in runs for _ in range(run.tokens)]


def token_slots(runs: list[AdapterRun], device: torch.device) -> torch.Tensor | None:
    """Each token's slot as a tensor, for the C++ call that indexes by it (cpu/lora.cpp); None when no token has
    an adapter."""
    if all(run.slot < 0 for run in runs):
        return None
    return torch.frombuffer(array("q", per_token_slots(runs)), dtype=torch.long).to(device)


def _segments(runs: list[AdapterRun], allowance: int) -> tuple[list[tuple[int, list[int]]], int]:
    """(slot, token rows) per segment, and the batch's token count.

    A segment per run of adjacent tokens of one slot keeps the tokens in batch order (no gather, no
    scatter), at the price of one weight copy per run. When slots recur across runs (several decodes
    of one adapter) and the extra copies cost more than the allowance, a segment per slot instead."""
    by_run: list[tuple[int, list[int]]] = []
    total = 0
    for run in runs:
        rows = range(total, total + run.tokens)
        if run.slot >= 0 and by_run and by_run[-1][0] == run.slot and by_run[-1][1][-1] == total - 1:
            by_run[-1][1].extend(rows)
        elif run.slot >= 0:
            by_run.append((run.slot, list(rows)))
        total += run.tokens
    extra_copies = len(by_run) - len({slot for slot, _ in by_run})
    if extra_copies * WEIGHT_COPY_ROWS <= allowance:
        return _equal_lengths(by_run, allowance), total
    by_slot: dict[int, list[int]] = {}
    for slot, rows in by_run:
        by_slot.setdefault(slot, []).extend(rows)
    return list(by_slot.items()), total


def _equal_lengths(segments: list[tuple[int, list[int]]], allowance: int) -> list[tuple[int, list[int]]]:
    """Segments of unequal lengths cut into pieces of their greatest common length, when the extra weight
    copies cost less than padding them to one length would (and than the allowance). Equal segments form
    one unpadded group; covering the whole batch, it needs no gather and no scatter. (Two adjacent
    requests of one adapter merge into one run of twice the length: cutting it back costs one copy.)"""
    lengths = [len(rows) for _, rows in segments]
    if len(set(lengths)) <= 1:
        return segments
    piece = math.gcd(*lengths)
    extra_copies = sum(lengths) // piece - len(segments)
    padding = max(lengths) * len(lengths) - sum(lengths)
    if extra_copies * WEIGHT_COPY_ROWS > min(allowance, padding):
        return segments
    return [(slot, rows[i:i + piece]) for slot, rows in segments for i in range(0, len(rows), piece)]


def _group_segments(segments: list[tuple[int, list[int]]], allowance: int):
    """(longest, segments) per group. Longest segments first; a group takes the next one while its padding
    stays within the allowance. A group's segments are put in slot order where that makes the slots one
    contiguous range (their weights are then a view); otherwise they keep batch order."""
    groups: list[tuple[int, list[tuple[int, list[int]]]]] = []
    padding = 0
    for segment in sorted(segments, key=lambda seg: -len(seg[1])):
        length = len(segment[1])
        if groups and padding + groups[-1][0] - length <= allowance:
            groups[-1][1].append(segment)
            padding += groups[-1][0] - length
        else:
            groups.append((length, [segment]))
            padding = 0
    for _, members in groups:
        by_slot = sorted(members, key=lambda seg: seg[0])
        if _is_contiguous([slot for slot, _ in by_slot]):
            members[:] = by_slot
    return groups


def _is_contiguous(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


def _slot_index(slots: list[int], as_tensor: torch.Tensor) -> torch.Tensor | slice:
    if _is_contiguous(slots):
        return slice(slots[0], slots[-1] + 1)
    return as_tensor
