"""A scheduled step as the model's inputs: one flat batch, decodes first, then prompt chunks, with no padding.

Per token an id, a position and a cache slot; per sequence its adapter run; the rows whose logits are sampled
(the last token of each sequence that completes its prompt or decodes, and each row of a speculative draft: those
of one sequence are consecutive) and the prompt rows whose logprobs were asked for. The attention metadata and the prompt segments come from the step backend (engine/backends/), which
knows how its kernels read the cache; this builder knows only the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.backends import TorchBackend
from engine.backends.cuda_graphs import DecodeInputs
from engine.backends.torch_reference import InPlaceChunk
from engine.forward_batch import ForwardBatch, ScoredRows
from engine.layers.attention import PrefillSegment
from engine.lora.segments import AdapterRun
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.tokens_in_flight import PendingInputs


@dataclass
class PromptChunkScoring:
    """A prompt chunk whose prompt logprobs were asked for: rows row, row + 1, ... of the step's hidden states hold
    prompt positions start, start + 1, ...; each predicts the next prompt token, targets[i]."""
    seq: Sequence
    row: int
    start: int
    targets: list[int]


@dataclass
class StepInputs:
    """A step's flattened batch (decodes first): the model's inputs (`forward`, whose sample_rows are the last row
    of each chunk that completes its prompt) and the sequences they belong to."""
    forward: ForwardBatch  # a token still on the device (`pending`) is filled into its input_ids there
    sampling: list[ScheduledSeq]  # the sequences of forward.sample_rows, in the same order (1 + len(draft) rows each)
    scoring: list[PromptChunkScoring]  # those of forward.scored, in the same order
    pending: PendingInputs


@dataclass
class _Rows:
    """The flat batch as it is built, one sequence at a time."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    adapter_runs: list[AdapterRun]
    last_rows: list[int]


def is_decode(s: ScheduledSeq) -> bool:
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0


def decodes_first(scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
    return sorted(scheduled, key=lambda s: not is_decode(s))  # stable


class StepBuilder:
    def __init__(self, backend: TorchBackend, block_size: int, long_rope_rows: int | None):
        """long_rope_rows: None, or where a longrope model's long factors start in its rotary tables."""
        self.backend = backend
        self.block_size = block_size
        self.long_rope_rows = long_rope_rows

    def build(self, ordered: list[ScheduledSeq]) -> StepInputs:
        rows = _Rows([], [], [], [], [])
        sample_rows, sampling, scoring, decode = [], [], [], []
        in_place: list[InPlaceChunk] = []
        prefills: list[PrefillSegment] = []
        for s in ordered:
            row, start, end = self._append(rows, s)
            decoding = is_decode(s)
            if decoding:
                decode.append(s.seq)
            else:
                scoring += _prompt_scoring(s.seq, row, start, end)
            if self.backend.attends_in_place(decoding, s.num_new_tokens):
                in_place.append(InPlaceChunk(s.seq.block_table, end, row, s.num_new_tokens))
            elif not decoding:
                prefills.append(self.backend.prefill_segment(s.seq.block_table, row, start, end))
            if s.completes_prompt:  # a draft's rows each sample too: the model's token after each draft token
                sample_rows += range(len(rows.input_ids) - 1 - len(s.draft), len(rows.input_ids))
                sampling.append(s)
        return self._inputs(rows, ordered, decode, prefills, in_place, sample_rows, sampling, scoring)

    def _append(self, rows: _Rows, s: ScheduledSeq) -> tuple[int, int, int]:
        """The sequence's new tokens onto the batch: its first row, and the positions start..end they fill."""
        seq, bs = s.seq, self.block_size
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens
        row = len(rows.input_ids)
        rows.input_ids += seq.token_slice(start, start + s.num_known_tokens) + list(s.draft)
        rows.last_rows.append(len(rows.input_ids) - 1)
        offset = self.row_offset(seq)
        rows.positions += range(start + offset, end + offset)
        rows.slots += (seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
        rows.adapter_runs.append(AdapterRun(_slot(seq), s.num_new_tokens))
        return row, start, end

    def _inputs(self, rows: _Rows, ordered: list[ScheduledSeq], decode: list[Sequence],
                prefills: list[PrefillSegment], in_place: list[InPlaceChunk], sample_rows: list[int],
                sampling: list[ScheduledSeq], scoring: list[PromptChunkScoring]) -> StepInputs:
        tensor = self.backend.tensor
        meta = self.backend.attention_metadata(tensor(rows.slots), [seq.block_table for seq in decode],
                                               [seq.num_computed_tokens + 1 for seq in decode], prefills, in_place)
        scored = [ScoredRows(chunk.row, len(chunk.targets)) for chunk in scoring]
        batch = ForwardBatch(tensor(rows.input_ids), tensor(rows.positions), meta, rows.adapter_runs, sample_rows,
                             scored)
        return StepInputs(batch, sampling, scoring, pending_inputs([s.seq for s in ordered], rows.last_rows))

    def decode_inputs(self, ordered: list[ScheduledSeq]) -> DecodeInputs:
        """A decode-only step as a graph replay takes it."""
        bs = self.block_size
        seqs = [s.seq for s in ordered]
        positions = [seq.num_computed_tokens for seq in seqs]
        return DecodeInputs(
            input_ids=[seq.token_slice(p, p + 1)[0] for seq, p in zip(seqs, positions)],
            positions=[p + self.row_offset(seq) for seq, p in zip(seqs, positions)],
            slot_mapping=[seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)],
            block_tables=[seq.block_table for seq in seqs],
            context_lens=[p + 1 for p in positions],
            lora_slots=[_slot(seq) for seq in seqs],
            pending=pending_inputs(seqs, range(len(seqs))))

    def row_offset(self, seq: Sequence) -> int:
        """A token's row in the rotary tables less its position: past its long_rope switch, a sequence reads a
        longrope model's long factors (engine/layers/rotary.py)."""
        return self.long_rope_rows if seq.long_rope else 0


def _slot(seq: Sequence) -> int:
    return -1 if seq.lora_slot is None else seq.lora_slot


def _prompt_scoring(seq: Sequence, row: int, start: int, end: int) -> list[PromptChunkScoring]:
    """The chunk's prompt logprobs to compute, if its request asked for them (else none)."""
    scored_end = min(end, len(seq.prompt_token_ids) - 1)  # positions whose next token is the prompt's
    if seq.params.prompt_logprobs is None or scored_end <= start:
        return []
    return [PromptChunkScoring(seq, row, start, seq.prompt_token_ids[start + 1:scored_end + 1])]


def pending_inputs(seqs: list[Sequence], last_rows) -> PendingInputs:
    """The rows whose token is still on the device: a reserved token is always its sequence's last, fed in the row
    of the sequence's last token this step (last_rows, one per sequence)."""
    held = [(row, seq.pending_index) for seq, row in zip(seqs, last_rows) if seq.pending_index is not None]
    return PendingInputs([row for row, _ in held], [index for _, index in held])
