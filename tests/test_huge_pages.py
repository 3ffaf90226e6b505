"""Weights and KV cache on huge pages (engine/backends/huge_pages.py): moved tensors keep their values, their
sharing and every reference to them; the memory is advised to huge pages; an engine on them generates what one
without does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.backends import huge_pages
from engine.memory import weight_bytes
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

pytestmark = pytest.mark.skipif(not huge_pages.supported(), reason="no MADV_HUGEPAGE on this platform")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _transparent_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # one storage, two modules
        self.register_buffer("packed", torch.arange(4 * 96, dtype=torch.bfloat16).view(4, 96))
        self.halves = [self.packed[:, :48], self.packed[:, 48:]]  # views kept in a list, as LoRA's B slots are
        self.first = self.packed[0]


def test_moved_tensors_keep_values_sharing_and_references():
    module = _Tied()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    param = module.embed.weight
    counted = weight_bytes(module)
    moved = huge_pages.move_module(module)
    assert moved == param.untyped_storage().nbytes() + module.packed.untyped_storage().nbytes()
    assert module.embed.weight is param and module.head.weight is param  # the same objects, re-seated
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert weight_bytes(module) == counted  # each storage still counted once, at its own size
    with torch.no_grad():
        module.packed.fill_(3)
    assert all(bool((view == 3).all()) for view in (*module.halves, module.first))  # views follow the move
    for tensor in (param, module.packed):
        assert tensor.data_ptr() % huge_pages.ALIGN == 0
        if _transparent_huge_pages():
            assert "hg" in _vm_flags(tensor.data_ptr())


def test_zeros_and_a_full_region():
    cache = huge_pages.zeros((2, 3, 5), torch.bfloat16)
    assert cache.shape == (2, 3, 5) and cache.dtype == torch.bfloat16 and not cache.any()
    region = huge_pages.Region(100)
    assert region.size == huge_pages.HUGE_PAGE
    region.storage(huge_pages.HUGE_PAGE)
    with pytest.raises(ValueError, match="has 0 left, 1 asked"):
        region.storage(1)


def test_engine_on_huge_pages_generates_the_same_tokens(tiny_llama_path, tmp_path):
    root = write_tiny_adapters(tiny_llama_path, tmp_path, ("alpha",))
    options = dict(adapters=local_adapters, dtype="float32", max_loras=2, adapters_root=str(root), log_stats=False)
    on, off = LLM(str(tiny_llama_path), **options), LLM(str(tiny_llama_path), huge_pages=False, **options)
    params = SamplingParams(max_tokens=12, temperature=0)
    adapters = ["alpha", None] * (len(PROMPTS) // 2)
    got = [o.token_ids for o in on.generate(PROMPTS, params, use_tqdm=False, adapters=adapters)]
    assert got == [o.token_ids for o in off.generate(PROMPTS, params, use_tqdm=False, adapters=adapters)]
    assert on.engine.memory().total_weight_bytes == off.engine.memory().total_weight_bytes
    runner = on.engine.runner
    if _transparent_huge_pages():
        lora = next(m for m in runner.model.modules() if hasattr(m, "b_slots"))
        for tensor in (runner.kv_caches[0][0], lora.b_slots[0], next(runner.model.parameters())):
            assert "hg" in _vm_flags(tensor.data_ptr())
        assert "hg" not in _vm_flags(off.engine.runner.kv_caches[0][0].data_ptr())
