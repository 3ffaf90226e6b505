"""The step's prompt chunks as one batch for the CUDA prefill kernels (engine/kernels/paged_prefill.py): device
tensors of every segment's rows, lengths and block table. Apart from the kernels, which import triton, so that the
attention layer can build it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedPrefill:
    """The step's prompt chunks as the CUDA prefill kernel reads them in one call: segment i's queries are rows
    query_starts[i] .. + query_lens[i] of the flat batch, the last positions of its context_lens[i] tokens, and its
    block table is tables[table_starts[i]:], every segment's table one after another (no padding to the widest)."""
    tables: torch.Tensor  # [sum of the segments' table lengths]
    table_starts: torch.Tensor  # [S]
    query_starts: torch.Tensor  # [S]
    query_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    max_len: int  # the longest chunk: the kernel's grid
    num_tokens: int  # the chunks' queries in all
    widest: int  # the most blocks one context spans
