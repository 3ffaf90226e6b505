"""The malloc tunables that keep the memory a CPU step frees (engine/host_heap.py): glibc reads them as meant, a
user's own come last and win, and CPU replicas, not GPU ones, start with them. What they are worth is in the serving
benchmarks: the kernel's page reclaim makes a step's page faults too uneven to assert on."""

import os
import shutil
import subprocess

import pytest

from deployments.app import _engine_actor_options
from engine import host_heap

pytestmark = pytest.mark.skipif(not host_heap.on_glibc(), reason="glibc's malloc only")


def _tunables_as_read(env: dict[str, str]) -> dict[str, int]:
    """The malloc tunables a process started with env holds, as glibc's loader lists them."""
    if shutil.which("ld.so") is None:
        pytest.skip("no ld.so to list glibc's tunables")
    done = subprocess.run(["ld.so", "--list-tunables"], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True)
    rows = (line.split(":", 1) for line in done.stdout.splitlines() if line.startswith("glibc.malloc."))
    return {name.removeprefix("glibc.malloc."): int(value.split()[0], 0) for name, value in rows}


def test_glibc_reads_the_tunables_as_meant():
    read = _tunables_as_read(host_heap.process_env())
    assert read["arena_max"] == 1
    assert read["mmap_threshold"] == host_heap.MMAP_THRESHOLD
    assert read["trim_threshold"] == host_heap.TRIM_THRESHOLD


def test_tunables_a_user_sets_come_last_and_win():
    read = _tunables_as_read(host_heap.process_env("glibc.malloc.arena_max=4"))
    assert read["arena_max"] == 4
    assert read["trim_threshold"] == host_heap.TRIM_THRESHOLD


def test_cpu_replicas_start_with_the_heap_settings_and_gpu_replicas_without():
    cpu = _engine_actor_options({"CPU": 1})["runtime_env"]["env_vars"]
    assert cpu["GLIBC_TUNABLES"] == host_heap.process_env(os.environ.get("GLIBC_TUNABLES"))["GLIBC_TUNABLES"]
    gpu = _engine_actor_options({"CPU": 1, "GPU": 1}).get("runtime_env", {}).get("env_vars", {})
    assert "GLIBC_TUNABLES" not in gpu
