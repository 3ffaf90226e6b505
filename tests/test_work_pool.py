"""The C++ operators' parallel loop (engine/kernels/cpu/work_pool.cpp): every item once, errors raised on the
caller, the same results as one thread, and no hang when several threads or a forked child use it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="needs the C++ CPU operators")
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    with _torch_threads(2):
        yield


@pytest.fixture(params=[2, 4], ids=["own-loop", "aten-loop"])
def threads(request):
    """2 threads run on the pool; 4, more than it serves, on at::parallel_for: both must give the same results."""
    with _torch_threads(request.param) as count:
        yield count


@pytest.mark.parametrize("items, grain", [(1, 1), (2, 1), (7, 1), (33, 1), (1000, 1), (1000, 64), (100_000, 16)])
def test_every_item_runs_exactly_once(threads, items, grain):
    module = cpu_ops.load()
    for _ in range(200 if items < 10_000 else 20):
        counts = torch.zeros(items, dtype=torch.int32)
        module.parallel_for_count_(counts, grain, -1)
        assert bool((counts == 1).all()), f"items run {counts.min().item()}-{counts.max().item()} times"


@pytest.mark.parametrize("fail_item", [0, 499, 999])
def test_a_failing_item_raises_on_the_caller_and_the_loop_still_works(threads, fail_item):
    module = cpu_ops.load()
    with pytest.raises(RuntimeError, match=f"item {fail_item} failed"):
        module.parallel_for_count_(torch.zeros(1000, dtype=torch.int32), 1, fail_item)
    counts = torch.zeros(1000, dtype=torch.int32)
    module.parallel_for_count_(counts, 1, -1)
    assert bool((counts == 1).all())


def _linear_case(gen: torch.Generator):
    module = cpu_ops.load()
    if not module.simd_linear_usable(torch.zeros(64, 64)):
        pytest.skip("the SIMD linear needs AVX2 or AVX-512")
    weight = torch.randn(3072, 576, generator=gen)
    return module, module.simd_pack_linear_weight(weight), torch.randn(32, 576, generator=gen)


def test_several_threads_give_one_threads_result_bit_for_bit(threads):
    """Each output is one thread's sum in a fixed order, whichever thread takes its chunk."""
    module, packed, x = _linear_case(torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    want = module.simd_linear(x, packed, None)
    torch.set_num_threads(threads)
    for _ in range(50):
        assert torch.equal(module.simd_linear(x, packed, None), want)


def test_loops_from_several_python_threads_at_once(two_threads):
    """A loop started while another thread's runs runs on its caller alone: all finish, all right."""
    module, packed, x = _linear_case(torch.Generator().manual_seed(1))
    want = module.simd_linear(x, packed, None)
    failures: list[str] = []

    def call() -> None:
        for _ in range(30):
            if not torch.equal(module.simd_linear(x, packed, None), want):
                failures.append("different result")

    threads = [threading.Thread(target=call) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a loop hung"
    assert not failures


def test_a_child_forked_after_the_pool_started_still_computes():
    """fork copies only the forking thread: the child has no pool threads, and its loops run on the caller."""
    script = """
import os, sys, torch
from engine.kernels import cpu_ops
torch.set_num_threads(2)
module = cpu_ops.load()
counts = torch.zeros(1000, dtype=torch.int32)
module.parallel_for_count_(counts, 1, -1)          # the pool's threads start here
pid = os.fork()
if pid == 0:
    counts.zero_()
    module.parallel_for_count_(counts, 1, -1)
    os._exit(0 if bool((counts == 1).all()) else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
