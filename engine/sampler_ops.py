"""The sampler's row operations, one class per kernel set, chosen by the step backend (engine/backends/): the
greedy argmax, the float32 copy of a step's logits, each row's logsumexp, and how top-p and typical-p rank a row
(engine/sampling_filters.py).

- `TorchSamplerOps`: PyTorch's own, on any device; rows ranked by one sort, which needs no test on the host.
- `HostSamplerOps`: on the CPU a bf16/fp16 model's logits are widened into a buffer kept from step to step: a fresh
  12 MB tensor a step (64 rows of 49,152) cost more in page faults than the copy itself. Each call's result is
  read within that call, and the next overwrites it. Rows are ranked in tiers: a CPU sort of a whole batch costs
  more than the decode step it follows.
- `CppSamplerOps`: the C++ operators reduce and widen the rows as they are, on their own threads: PyTorch's argmax
  is a scalar loop (cpu/argmax.cpp is much faster in float32 and more so in bf16, with the same ties and NaN
  handling), and torch's copy stalled now and then, waking OpenMP's threads (cpu/widen.cpp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.sampling_filters import rank_in_tiers, rank_whole


class TorchSamplerOps:
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of every row, in any float dtype."""
        return logits.argmax(dim=-1)

    def widened(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits in float32."""
        return logits.float()

    def log_normalizers(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's logsumexp in float32."""
        return logits.float().logsumexp(dim=-1)

    def rank(self, keys: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, cut: Callable) -> torch.Tensor:
        return rank_whole(keys, probs, mass, cut)


class HostSamplerOps(TorchSamplerOps):
    def __init__(self):
        self.buffer: torch.Tensor | None = None  # float32 logits, reused from step to step

    def widened(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype == torch.float32:
            return logits
        rows, vocab = logits.shape
        if self.buffer is None or self.buffer.shape[0] < rows or self.buffer.shape[1] != vocab:
            self.buffer = torch.empty(rows, vocab, dtype=torch.float32)
        return self._widen(self.buffer[:rows], logits)

    def _widen(self, out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return out.copy_(logits)

    def rank(self, keys: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor, cut: Callable) -> torch.Tensor:
        return rank_in_tiers(keys, probs, mass, cut)


class CppSamplerOps(HostSamplerOps):
    def __init__(self, cpu_ops):
        super().__init__()
        self.cpu_ops = cpu_ops

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.cpu_ops.argmax_rows(logits)

    def _widen(self, out: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not logits.is_contiguous():
            return out.copy_(logits)
        self.cpu_ops.widen_(out, logits)
        return out

    def log_normalizers(self, logits: torch.Tensor) -> torch.Tensor:
        return self.cpu_ops.log_normalizers(logits)
