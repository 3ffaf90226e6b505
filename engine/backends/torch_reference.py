"""The plain PyTorch step backend: the reference that the kernels' backends are tested against, and the path of a
device that neither the C++ operators nor CUDA serve.

Decode attention gathers each sequence's blocks into a masked copy (the rows to gather computed once a step for
every layer), prompt chunks attend by SDPA over their gathered context, the KV write is two index copies, and
adapters' tokens run as segments of one adapter each (engine/lora/segments.py). The kernels' backends
(cpu.py, cuda.py) subclass this one and replace what their device does faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import nn

from engine.config import EngineConfig
from engine.kernels.prefill_batch import PagedPrefill
from engine.layers.attention import (
    AttentionMetadata,
    GatheredAttention,
    KVCache,
    PrefillKernel,
    PrefillSegment,
    block_rows,
    paged_prefill,
)
from engine.lora.backends import LoRAStepState, TorchLoRA
from engine.models.packing import AsLoaded, OneDnnPacked, onednn_linear_supported
from engine.sampler_ops import HostSamplerOps, TorchSamplerOps
from engine.tokens_in_flight import CopiedToHost, OnHost, Readback
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.backends.cuda_graphs import DecodeGraphs

T = TypeVar("T")


@dataclass
class InPlaceChunk:
    """A decode token or short prompt chunk that a kernel attends by reading the cache in place."""
    block_table: list[int]
    context_len: int  # tokens in the cache once this step's are written
    row: int  # its first token's row in the flat batch
    length: int


class TorchBackend:
    name = "torch"
    cpu_ops = None  # the C++ operators, where the backend runs on them (cpu.py)
    fused_ops = None  # the fused element-wise operators the model's modules call, where the backend has them
    scratch_blocks = 0  # KV blocks beyond the block manager's, that the backend writes padding rows to
    prompt_kernel = False  # long prompt chunks attend in the C++ prompt kernel
    in_place_limit = 0  # >0: decodes, and prompt chunks shorter than this, read the cache in place in one kernel

    def __init__(self, config: EngineConfig):
        self.device = config.backend.torch_device
        self.dtype = config.compute_dtype
        self.block_size = config.cache.block_size
        self.prefill_kernel: PrefillKernel | None = self._prefill_kernel(config)
        self.cache_shape: tuple[int, int] = (0, 0)  # the cache's (KV heads, blocks), once allocated
        self.lora = self._lora_backend()
        self.sampler_ops = self._sampler_ops()
        self.packing = self._packing(config)

    def _packing(self, config: EngineConfig) -> AsLoaded:
        """How the loaded model's linears are laid out: oneDNN's prepacking on a CPU that has its linear for the
        dtype, else as loaded."""
        if self.device.type == "cpu" and onednn_linear_supported(self.dtype):
            return OneDnnPacked()
        return AsLoaded()

    def _sampler_ops(self) -> TorchSamplerOps:
        """The sampler's argmax, widening and logsumexp: PyTorch's, on the host into a buffer kept for the next."""
        return HostSamplerOps() if self.device.type == "cpu" else TorchSamplerOps()

    def _lora_backend(self) -> TorchLoRA:
        """How adapters' tokens take their deltas: as segments of one adapter each; on CPU from float32 slots."""
        on_cpu = self.device.type == "cpu"
        return TorchLoRA(self.device, float32_slots=on_cpu, a_k_major=on_cpu)

    def _prefill_kernel(self, config: EngineConfig) -> PrefillKernel | None:
        """The kernel that takes every prompt chunk of a step in one call; None: gather + SDPA per chunk."""
        return None

    @property
    def kv_write(self):
        """The step's keys and values into the cache in one fused call, or None for two index copies."""
        return self.fused_ops.write_kv_cache if self.fused_ops is not None else None

    def free_memory(self) -> int:
        """The bytes the KV cache may take a fraction of, once the weights are loaded."""
        import psutil

        return psutil.virtual_memory().available

    def allocate_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[KVCache]:
        """shape: (layers, 2, KV heads, blocks, block size, head dim), the backend's scratch blocks included."""
        cache = self._zeros(shape, dtype)
        self.cache_shape = (shape[2], shape[3])
        return [(cache[i, 0], cache[i, 1]) for i in range(shape[0])]

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def place_model(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState,
                    config: EngineConfig) -> None:
        """Whatever the backend does to the loaded model once its LoRA wrappers are in place."""

    def bind_model(self, model: nn.Module) -> None:
        """The paths this loaded model takes; a model whose attention only the C++ kernel computes (Gemma 2's
        capped scores, sliding windows) is refused here, saying why this backend cannot run it."""
        if model.kernel_only_attention is not None:
            raise ValueError(f"this model's attention has {model.kernel_only_attention}, which only the C++ CPU "
                             f"attention kernel computes, and it cannot serve here: {self._no_kernel()}")

    def _no_kernel(self) -> str:
        if self.device.type != "cpu":
            return f"the device is {self.device.type}"
        return "the C++ operators are off (cpu_kernels) or did not build"

    def attends_in_place(self, is_decode: bool, num_new_tokens: int) -> bool:
        """Whether a decode or prompt chunk joins the in-place kernel's queries rather than the prefills."""
        return self.in_place_limit > 0 and (is_decode or num_new_tokens < self.in_place_limit)

    def prefill_segment(self, block_table: list[int], row: int, start: int, end: int) -> PrefillSegment:
        """A prompt chunk that attends outside the in-place kernel: over its gathered context, by SDPA or by the
        step's prefill kernel."""
        table = self.tensor(block_table) if start > 0 else None
        rows = self._block_rows(table) if table is not None else None
        return PrefillSegment(row, end - start, end, table, rows)

    def attention_metadata(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                           prefills: list[PrefillSegment], in_place: list[InPlaceChunk]) -> AttentionMetadata:
        """The step's attention metadata, built once for every layer: the decodes over their gathered blocks."""
        meta = GatheredAttention(slots, len(decode_lens), prefills, self.kv_write, self.prompt_kernel,
                                 self.prefill_kernel, self._prefill_batch(prefills, slots))
        if decode_tables:
            tables, device = self.tensor(padded(decode_tables)), self.device
            visible = torch.arange(tables.shape[1] * self.block_size, device=device)[None, :] < \
                self.tensor(decode_lens)[:, None]
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=device).masked_fill_(~visible, float("-inf"))
            meta.decode_block_tables, meta.decode_rows = tables, self._block_rows(tables)
            meta.decode_mask = mask[:, None, None, :]
        return meta

    def _prefill_batch(self, prefills: list[PrefillSegment], slots: torch.Tensor) -> PagedPrefill | None:
        """The prefill kernel's view of the step's chunks, built once for every layer, where a kernel takes them."""
        if self.prefill_kernel is None or not prefills:
            return None
        return paged_prefill(prefills, slots, self.block_size)

    def _block_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        """The cache rows attention gathers these blocks from, computed once per step for all layers."""
        return block_rows(block_tables, *self.cache_shape)

    def gather_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return hidden[to_device(rows, self.device)]

    def tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        """An int64 tensor of a step's (rectangular) lists. On CPU through numpy, which converts holding the GIL:
        torch.tensor releases it for its copy, and in a replica the step thread would then wait for the event
        loop to give it back."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.array(values, dtype=np.int64))
        return to_device(values, self.device, torch.long)

    def decode_graphs(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState,
                      config: EngineConfig, max_model_len: int, num_blocks: int) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, where the backend captures them; None: every step runs eager."""
        return None

    def readback(self, result: T) -> Readback[T]:
        """A step's sampled tokens on their way to the host (engine/tokens_in_flight.py)."""
        return OnHost(result) if self.device.type == "cpu" else CopiedToHost(result)


def padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables padded with block 0 to the widest (padding entries are never read: the lengths bound them)."""
    widest = max(len(table) for table in tables)
    return [table + [0] * (widest - len(table)) for table in tables]
