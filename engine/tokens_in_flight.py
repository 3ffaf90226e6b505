"""Tokens in flight (async scheduling): a step's sampled tokens read back to the host a step late, without
stalling the device's queue, while the next step takes them as inputs on the device.

A step's sampled tokens are needed on the host only to detokenize them and check stops, which can wait until the
next step is on its way. `.tolist()` on a CUDA tensor waits for everything queued before it, the next step's
forward included once that is launched; instead the copies into pinned host memory are queued right behind the
sampling kernels, an event marks their end, and reading waits for that event alone (`CopiedToHost`). On CPU the
results are already on the host and are read as they are (`OnHost`). The step backend picks one (`readback`).

The next step is scheduled meanwhile, each sequence counting its token in flight (Sequence.reserve_token); the
runner builds its inputs on the host with a placeholder there and PendingInputs fills the rows from the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from engine.transfer import to_device

T = TypeVar("T")


class OnHost(Generic[T]):
    """A step's results computed on the host: read as they are."""

    def __init__(self, result: T):
        self._result = result

    def result(self) -> T:
        return self._result


class CopiedToHost(Generic[T]):
    def __init__(self, result: T):
        """Starts copying the tensors of `result` (a dataclass whose fields are tensors, dataclasses of them, or
        plain values) from the GPU to pinned host memory, behind the work queued so far."""
        self._host = _to_host(result)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> T:
        """`result` with its tensors on the host, once they are copied."""
        self._event.synchronize()
        return self._host


Readback = OnHost[T] | CopiedToHost[T]


def _to_host(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True).copy_(value, non_blocking=True)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _to_host(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


@dataclass
class PendingInputs:
    """Input tokens that the step before sampled and the host has not read yet: row rows[i] of the flat batch takes
    row index[i] of that step's tokens, on the device."""
    rows: list[int]
    index: list[int]

    def fill(self, input_ids: torch.Tensor, tokens: torch.Tensor | None) -> None:
        """Write the tokens into input_ids, on its device, without reading them."""
        if not self.rows:
            return
        rows = to_device(self.rows, input_ids.device)
        input_ids.index_copy_(0, rows, tokens[to_device(self.index, tokens.device)])
