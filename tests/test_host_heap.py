"""The CPU engine keeps the memory its steps free (engine/host_heap.py): glibc takes its thresholds, and an engine
replica on CPU starts with the same settings for all its threads. What that is worth is in the serving benchmarks:
the kernel's page reclaim makes a step's page faults too uneven to assert on."""

import subprocess
import sys
from pathlib import Path

import pytest

from deployments.app import _engine_actor_options
from engine import host_heap

pytestmark = pytest.mark.skipif(not host_heap.on_glibc(), reason="glibc's malloc only")
ROOT = Path(__file__).resolve().parents[1]

KEEP = "from engine import host_heap; print(host_heap.keep_freed_memory())"


def test_glibc_takes_both_thresholds():
    """In a process of its own: the thresholds hold for the rest of a process."""
    done = subprocess.run([sys.executable, "-c", KEEP], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "True"


def test_cpu_replicas_start_with_the_heap_settings_and_gpu_replicas_without():
    tunables = _engine_actor_options({"CPU": 1})["runtime_env"]["env_vars"]["GLIBC_TUNABLES"]
    assert "glibc.malloc.arena_max=1" in tunables
    assert f"glibc.malloc.trim_threshold={host_heap.TRIM_THRESHOLD}" in tunables
    gpu = _engine_actor_options({"CPU": 1, "GPU": 1}).get("runtime_env", {}).get("env_vars", {})
    assert "GLIBC_TUNABLES" not in gpu


def test_tunables_a_user_sets_come_last_and_win():
    env = host_heap.process_env("glibc.malloc.arena_max=4")
    assert env["GLIBC_TUNABLES"].endswith(":glibc.malloc.arena_max=4")
    assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.arena_max=1:")
