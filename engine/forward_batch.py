"""`ForwardBatch`: one step's model inputs, everything a model's forward and its logits need and nothing of the
scheduler's sequences: the flat batch's ids and positions, the attention metadata, the adapter runs, and which
hidden rows become logits (the sampled rows, and the prompt rows scored for prompt logprobs).

It is what the model runner prepares and runs, and, under tensor parallelism, what the driver sends every worker
once per step (engine/executor/step_channel.py): each rank runs the same forward on its shard and computes the
same logits in the same order, so that their collectives meet. It holds tensors, ints and small dataclasses
only (the attention metadata's `kv_write` is the runner's own and is set by each rank), so it pickles as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionMetadata
from engine.lora.segments import AdapterRun
from engine.transfer import moved

SCORED_ROWS_PER_SLICE = 256  # prompt-scoring logits are [rows, vocab] float32: bounded, whatever the chunk size


@dataclass(frozen=True)
class ScoredRows:
    """Hidden rows row, row + 1, ... (count of them) whose logits score prompt tokens."""
    row: int
    count: int

    def slices(self) -> list[slice]:
        """The rows' logits are computed SCORED_ROWS_PER_SLICE rows at a time, in this order."""
        return [slice(self.row + offset, self.row + min(self.count, offset + SCORED_ROWS_PER_SLICE))
                for offset in range(0, self.count, SCORED_ROWS_PER_SLICE)]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]; a token still on the device is filled in before the forward
    positions: torch.Tensor  # [tokens]: each token's rotary row
    attention: AttentionMetadata
    adapter_runs: list[AdapterRun]  # row after row
    sample_rows: list[int]  # ascending: the rows whose logits are sampled
    scored: list[ScoredRows]  # the prompt chunks scored, in order

    def portable(self) -> ForwardBatch:
        """The batch as it travels to another process: its tensors on the host (a worker's device is not the
        driver's: each rank's GPU is cuda:0 to its own Ray actor) and without the runner's own cache writer (each
        rank sets its own)."""
        host = moved(self, torch.device("cpu"))
        return dataclasses.replace(host, attention=dataclasses.replace(host.attention, kv_write=None))

    def on(self, device: torch.device) -> ForwardBatch:
        """A received batch with its tensors on this rank's device (no copy on CPU)."""
        return moved(self, device)
