"""The engine's C++ CPU operators (engine/kernels/cpu/): one extension module, compiled once per machine.

torch's cpp_extension builds it with ninja and a C++ compiler at install (.ci/install.sh) or else the first time an
engine starts on a machine, and keeps it under torch's extensions directory ($TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions), in lora-serve/<name>: a later process, or another replica on the node, loads it
without building. The build is two translation units, compiled side by side, each a file generated in the build
folder that includes its sources (a unity build): the bindings with the kernels of BESIDE_BINDINGS, and every other
kernel. Parsing torch's headers is most of a file's compile time, paid once per file: hence two units rather than
one file per source, and no ATen/ops/empty.h (ops.h says why). The bindings are CPython's C API, not pybind11
(bindings.cpp): pybind11 and torch's casters made them far slower to compile. lora.cpp (the most code to generate)
sits beside the bindings, not with the other kernels, so that the two units, compiling at once, are closer in
length. A Xeon with AMX, whose build compiles the AVX-512 and AMX kernels too, built as fast on 2 of its cores as
on 16.
Each kernel file keeps its internals in a namespace of its own (lora_serve::<file>_detail), so the files share a
unit without sharing names. Builds of one name take turns under an OS file lock, which dies with its process:
torch's own lock is a file that a build killed half-way (a replica stopped while it started) leaves behind, and
every later start would wait on it forever. The build name carries a hash of the sources, of the CPU's
instruction-set flags (it is compiled with -march=native) and of the torch version. Where it cannot be built,
`load()` says why once and returns None: the engine then keeps its pure-PyTorch paths, which are also the
operators' references in the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path

import torch

SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
BINDINGS = Path(__file__).parent / "cpu" / "bindings.cpp"
BESIDE_BINDINGS = ("lora.cpp",)  # kernel sources compiled in the bindings' unit, so the two units take alike
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


def has_cpu_flag(flag: str) -> bool:
    """Whether this CPU reports an instruction-set flag of /proc/cpuinfo (avx512_bf16, amx_bf16, ...)."""
    return flag in _cpu_flags().split()


def build_name() -> str:
    """Extension name: changes with the sources, the CPU's flags, the torch version and the link flags."""
    digest = hashlib.sha256(_cpu_flags().encode() + torch.__version__.encode() + " ".join(link_flags()).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return f"lora_serve_cpu_ops_{digest.hexdigest()[:12]}"


@functools.cache
def link_flags() -> tuple[str, ...]:
    """The shared libstdc++ this process already runs on (torch loaded it), named to the linker before the one the
    compiler adds itself. Where the compiler links a static libstdc++ instead (seen on a GPU host's image whose
    $CXX is a GCC of its own, /opt/gcc: the module defined 4,660 std symbols and needed no libstdc++.so; 139 with
    this flag), the module carries a second copy of the C++ library, and formatting a number into a TORCH_CHECK
    message there crashed the process on the other copy's locale where it should have raised the check's
    RuntimeError. A tuple: torch's loader extends the list it is given."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return (path,)
    except OSError:
        pass
    return ()


def vector_flags() -> list[str]:
    """ATen's vector types (at::vec) are plain arrays unless told the CPU's capability, as torch's own kernels
    are: AVX-512 where the CPU has it, else AVX2."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "lora-serve" / name


def unity_sources(folder: Path) -> list[Path]:
    """The two generated translation units: the bindings with BESIDE_BINDINGS, and the other kernels."""
    first = [BINDINGS] + [source for source in SOURCES if source.name in BESIDE_BINDINGS]
    return [_unity_file(folder / "bindings_unit.cpp", first),
            _unity_file(folder / "kernels_unit.cpp", [source for source in SOURCES if source not in first])]


def _unity_file(path: Path, sources: list[Path]) -> Path:
    """A generated file that includes `sources`, written only when its text changes (ninja rebuilds what is
    newer than its object)."""
    text = "// generated by engine/kernels/cpu_ops.py: sources in one translation unit\n" + "".join(
        f'#include "{source}"\n' for source in sources)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


@contextlib.contextmanager
def exclusive_build(folder: Path):
    """Hold the folder's build lock (fcntl, released when the holder exits, however it exits). While we hold it
    no build of ours runs, so a torch lock file found there is stale, and it goes."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        yield


@functools.cache
def load():
    """The compiled extension module, or None (with one warning saying why) where it cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    try:
        # no contraction of a * b + c into one FMA: fp32 results then round as PyTorch's separate ops do
        flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", *vector_flags()]
        name = build_name()
        folder = build_directory(name)
        with exclusive_build(folder):
            fresh = not (folder / f"{name}.so").exists()
            if fresh:  # a pause of seconds at a first start deserves a word
                print(f"[lora-serve] building the C++ CPU operators in {folder} (once per machine)", flush=True)
            started = time.perf_counter()
            module = load_extension(name, [str(path) for path in unity_sources(folder)], extra_cflags=flags,
                                    extra_ldflags=list(link_flags()), build_directory=str(folder), verbose=False)
            if fresh:
                print(f"[lora-serve] C++ CPU operators built in {time.perf_counter() - started:.1f} s", flush=True)
            return module
    except Exception as error:  # no compiler or ninja: the PyTorch paths still work, only slower
        log.warning("C++ CPU operators unavailable (%s: %s); the engine runs its PyTorch paths",
                    type(error).__name__, error)
        return None
