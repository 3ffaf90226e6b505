"""Where vLLM's CPU build lives and how it runs at its best on this machine: the one place both the engine
benchmark and the HTTP benchmark take it from.

vLLM runs from a virtual environment of its own (benchmarks/peers/install_vllm.sh), found from --vllm-python or
$VLLM_PYTHON. As its peer notes prescribe: its OpenMP threads bound to both cores (unbound, it leaves a core to
its scheduler) and Intel's OpenMP runtime preloaded (vLLM's CPU build runs slower on GNU OpenMP).
"""

from __future__ import annotations

import os
from pathlib import Path

NOT_INSTALLED = ("vLLM not measured: no vLLM environment given. Install it with "
                 "`bash benchmarks/peers/install_vllm.sh` and pass `--vllm-python /work/vllm-venv/bin/python` "
                 "(or set $VLLM_PYTHON).")


def vllm_python(given: str | None) -> Path | None:
    """The python of vLLM's virtual environment, from the argument or $VLLM_PYTHON; None when neither is set.
    A path given but missing is an error, not a silent skip."""
    value = given or os.environ.get("VLLM_PYTHON")
    if not value:
        return None
    path = Path(value)
    if not path.exists():
        raise SystemExit(f"vLLM python {path} does not exist: run benchmarks/peers/install_vllm.sh first")
    return path


def vllm_env(python: Path, kv_cache_gib: int) -> dict[str, str]:
    """The environment vLLM's processes run in: both cores bound, Intel OpenMP when its venv has it."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    env.pop("PYTHONPATH", None)
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def describe_openmp(env: dict[str, str]) -> str:
    runtime = "Intel OpenMP (libiomp5, LD_PRELOAD)" if "libiomp5" in env.get("LD_PRELOAD", "") else "GNU OpenMP"
    return f"{runtime}, threads bound to cores {env.get('VLLM_CPU_OMP_THREADS_BIND', '?')}"
