"""The engine's C++ CPU operators (engine/kernels/cpu/): one extension module, compiled once per machine.

torch's cpp_extension builds it with ninja and a C++ compiler the first time an engine starts on a machine
(about 35 s) and keeps it in torch's extensions directory ($TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions): a later process, or another replica on the node, loads it in well under a
second. The build name carries a hash of the sources, of the CPU's instruction-set flags (it is compiled with
-march=native) and of the torch version. Where it cannot be built, `load()` says why once and returns None:
the engine then keeps its pure-PyTorch paths, which are also the operators' references in the tests.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
log = logging.getLogger(__name__)


@functools.cache
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """Extension name: changes with the sources, the CPU's flags and the torch version."""
    digest = hashlib.sha256(_cpu_flags().encode() + torch.__version__.encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return f"lora_serve_cpu_ops_{digest.hexdigest()[:12]}"


def vector_flags() -> list[str]:
    """ATen's vector types (at::vec) are plain arrays unless told the CPU's capability, as torch's own kernels
    are: AVX-512 where the CPU has it, else AVX2."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


@functools.cache
def load():
    """The compiled extension module, or None (with one warning saying why) where it cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    try:
        # no contraction of a * b + c into one FMA: fp32 results then round as PyTorch's separate ops do
        flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *vector_flags()]
        return load_extension(build_name(), [str(p) for p in SOURCES], extra_cflags=flags, verbose=False)
    except Exception as error:  # no compiler or ninja: the PyTorch paths still work, only slower
        log.warning("C++ CPU operators unavailable (%s: %s); the engine runs its PyTorch paths",
                    type(error).__name__, error)
        return None
