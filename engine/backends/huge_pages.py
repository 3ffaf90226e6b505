"""The model's weights and the KV cache on 2 MiB pages (Linux transparent huge pages), on CPU.

Why: a decode step streams every weight once and reads every sequence's KV blocks, from memory, since the weights
are many times the caches. On 4 KiB pages a step of SmolLM2 (270 MB of bf16 weights) crosses about 66,000 pages,
each a TLB miss and a page walk, and a sequence's KV blocks (2 KiB of one layer and head) each sit on a page of
their own. The kernel gives huge pages to memory that asks for them (madvise, the default setting of most
distributions) and not otherwise, so nothing of the engine's had them. On huge pages (measured in bf16) a step's
linears ran a little faster, and decode attention over a cold cache faster still.

A Region is one anonymous mapping, advised MADV_HUGEPAGE and aligned to 2 MiB, cut into storages of their own
(torch.frombuffer: each storage keeps the mapping alive and is counted as itself by engine/memory.py). Moving a
module re-seats each of its tensors in place (Tensor.set_), so every reference to a parameter, buffer or view taken
before the move sees the new memory; a storage shared by several tensors (tied embeddings) moves once and stays
shared. Where the kernel has no transparent huge pages the advice is refused and the memory is ordinary.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
REGION_BYTES = 256 << 20  # a region's most: copying a module holds at most this much twice


def supported() -> bool:
    """Whether this platform can advise memory to huge pages (Linux, Python's mmap with MADV_HUGEPAGE)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")


@dataclass
class Region:
    """One anonymous mapping of `size` bytes (a multiple of 2 MiB, from a 2 MiB boundary), handed out in order."""
    size: int
    _map: mmap.mmap = field(init=False, repr=False)
    _start: int = field(init=False, default=0)  # the first byte on a 2 MiB boundary
    _used: int = field(init=False, default=0)

    def __post_init__(self):
        self.size = -(-self.size // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._start = (-address) % HUGE_PAGE
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE, self._start, self.size)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        """The next `nbytes` of the region, zero until written, as a storage of its own."""
        offset = _aligned(self._used)
        if offset + nbytes > self.size:
            raise ValueError(f"huge-page region of {self.size} bytes has {self.size - offset} left, {nbytes} asked")
        self._used = offset + nbytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=max(nbytes, 1),
                                offset=self._start + offset).untyped_storage()


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on huge pages of its own, its pages faulted in now (not in the first steps that touch
    them)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    tensor = torch.empty(0, dtype=dtype).set_(Region(nbytes).storage(nbytes), 0, shape)
    return tensor.zero_()


def move_module(module: nn.Module) -> int:
    """Re-seat every dense CPU tensor of `module` (parameters, buffers, tensor attributes; bitsandbytes' and oneDNN's
    opaque ones excepted) on huge pages, in regions of up to REGION_BYTES. Returns the bytes moved."""
    moved = 0
    for batch, size in _batches(_by_storage(module)):
        region = Region(size)
        for tensors in batch:
            moved += _move_storage(tensors, region)
    return moved


def _move_storage(tensors: list[torch.Tensor], region: Region) -> int:
    """Copy the tensors' shared storage into the region and re-seat each tensor on the copy."""
    old = tensors[0].untyped_storage()
    new = region.storage(old.nbytes())
    with torch.no_grad():
        torch.empty(0, dtype=torch.uint8).set_(new).copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for tensor in tensors:
            tensor.set_(new, tensor.storage_offset(), tensor.size(), tensor.stride())
    return old.nbytes()


def _batches(groups: list[list[torch.Tensor]]):
    """Storages in module order, cut into runs of up to REGION_BYTES (one larger storage is a run of its own), each
    with the bytes its region needs."""
    batch: list[list[torch.Tensor]] = []
    size = 0
    for tensors in groups:
        nbytes = _aligned(tensors[0].untyped_storage().nbytes())
        if batch and size + nbytes > REGION_BYTES:
            yield batch, size
            batch, size = [], 0
        batch.append(tensors)
        size += nbytes
    if batch:
        yield batch, size


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to a whole number of cache lines (where the next storage may start)."""
    return -(-nbytes // ALIGN) * ALIGN


def _by_storage(module: nn.Module) -> list[list[torch.Tensor]]:
    """The module's movable tensors grouped by the storage they share, each tensor object once."""
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in _tensors(module):
        if id(tensor) in seen or not _movable(tensor):
            continue
        seen.add(id(tensor))
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return list(groups.values())


def _tensors(module: nn.Module):
    """Parameters, buffers, and the tensors a module keeps as attributes, alone or in a list or tuple (views of a
    buffer, such as a LoRA linear's per-slot weights)."""
    for child in module.modules():
        yield from child.parameters(recurse=False)
        yield from (buffer for buffer in child.buffers(recurse=False) if buffer is not None)
        for value in vars(child).values():
            values = value if isinstance(value, (list, tuple)) else (value,)
            yield from (item for item in values if isinstance(item, torch.Tensor))


def _movable(tensor: torch.Tensor) -> bool:
    """Plain dense CPU tensors and parameters: not bitsandbytes' parameter classes (their quantization state
    travels with them), not oneDNN's opaque tensors, not empty ones."""
    return (type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type == "cpu" and tensor.layout ==
            torch.strided and not tensor.is_mkldnn and tensor.untyped_storage().nbytes() > 0)
