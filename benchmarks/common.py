"""Shared helpers for the benchmarks: environment description, the machine kind, timing, number formatting,
markdown tables, the command line, writing a run's results.

Where a run writes: its summary (NAME.md) and its plot (NAME.png) in benchmarks/results/KIND/, which is committed and
holds the current summary of each benchmark per machine kind; its raw figures (NAME.json), any further plots and
its logs in benchmarks/runs/KIND/, which git ignores. A smoke run (--quick on the CPU, --tiny on the GPU benchmarks)
writes all of it in benchmarks/runs/KIND/smoke/, so it never replaces a summary; --out DIR puts all of it in DIR.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

RESULTS = Path(__file__).parent / "results"  # committed: KIND/NAME.md and KIND/NAME.png
RUNS = Path(__file__).parent / "runs"  # git-ignored: KIND/NAME.json, further plots, logs; KIND/smoke/


def openmp_runtime() -> str:
    """Which OpenMP runtime this process uses: Intel's libiomp5 when preloaded, else the one torch ships (libgomp)."""
    if "libiomp5" in os.environ.get("LD_PRELOAD", ""):
        return "Intel OpenMP (libiomp5, LD_PRELOAD)"
    try:
        with open("/proc/self/maps") as maps:
            loaded = maps.read()
    except OSError:
        loaded = ""
    for marker, name in (("libiomp5", "Intel OpenMP (libiomp5)"), ("libgomp", "GNU OpenMP (libgomp)")):
        if marker in loaded:
            return name
    return "unknown"


def _cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (model name, vendor_id, cpu family, flags, ...); none where
    there is no such file."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _cpu_info().get("model name") or platform.processor() or "unknown"


def cpu_kind() -> str:
    """The CPU's machine kind, named by what picks the engine's CPU kernels: `amx` (AMX tiles: an Intel Xeon),
    `zen4` (AVX-512 executed as two 256-bit halves: AMD family 25 with AVX-512), `avx512` (any other CPU with
    AVX-512), `avx2`; else the architecture's name. A VM's model name is often just "AMD EPYC", so the flags and
    the family tell the kinds apart."""
    info = _cpu_info()
    flags = set(info.get("flags", "").split())
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:
        return "zen4" if info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25" else "avx512"
    if "avx2" in flags:
        return "avx2"
    return platform.machine().lower() or "cpu"


def gpu_kind() -> str | None:
    """The CUDA device's model in lower case (h100, h200, a100: the first word of its name with a digit in it);
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    words = torch.cuda.get_device_name().removeprefix("NVIDIA ").split()
    model = next((word for word in words if any(c.isdigit() for c in word)), "-".join(words))
    return model.split("-")[0].lower()


def machine_kind(device: str = "cpu") -> str:
    """The results folder of a run on `device`: the GPU's model for a run on CUDA (when there is one), else the
    CPU's kind."""
    return (device.startswith("cuda") and gpu_kind()) or cpu_kind()


@dataclass(frozen=True)
class Folders:
    """Where one run writes: `results`, its summary and its plot; `raw`, its raw figures, further plots and logs."""
    results: Path
    raw: Path

    @staticmethod
    def of(out: Path | None, kind: str, smoke: bool) -> Folders:
        """--out DIR: everything in DIR; a smoke run: everything in runs/KIND/smoke; else results/KIND and
        runs/KIND."""
        if out is not None:
            return Folders(out, out)
        if smoke:
            return Folders(RUNS / kind / "smoke", RUNS / kind / "smoke")
        return Folders(RESULTS / kind, RUNS / kind)


def environment() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "openmp": openmp_runtime(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cpu": cpu_model(),
    }


@dataclass
class Result:
    """One measurement: `tokens` generated (the requested ones) in `seconds` of wall time."""
    workload: str
    system: str
    tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds and self.error is None else None

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s}


def timed(fn, *args, **kwargs):
    """(return value, wall seconds) of fn(*args, **kwargs)."""
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - start


def check_lengths(outputs: list[list[int]], requests) -> int:
    """Every request must get exactly its max_new_tokens; returns the total number of generated tokens."""
    got = [len(o) for o in outputs]
    want = [n for _, n in requests]
    if got != want:
        raise RuntimeError(f"generated lengths {got[:8]}... differ from the requested {want[:8]}...")
    return sum(got)


def fmt(value, digits: int = 1) -> str:
    """Numbers for tables; (lo, hi) pairs print as ranges, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return "-".join(fmt(v, digits) for v in value)
    return f"{value:,.{digits}f}"


def scaled(value: float | None, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    """A figure for tables, times `scale`, with a unit `suffix`; None as a dash."""
    return "-" if value is None else f"{value * scale:,.{digits}f}{suffix}"


def value_range(values: list[float | None], digits: int = 1) -> str:
    """The spread of a figure over rounds, for tables: "lo-hi", one number when they print alike, "-" for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt(lo, digits) if round(lo, digits) == round(hi, digits) else f"{fmt(lo, digits)}-{fmt(hi, digits)}"


def report_header(title: str, command: str, env: dict) -> list[str]:
    """The first lines of a results file: its title, the command that made it, the date and the CPU."""
    return [f"# {title}", "", f"Command: `{command}`  ", f"Date: {env['date']}  ",
            f"CPU: {env['cpu']} ({env['cpu_count']} cores)", ""]


def ratio(value, reference):
    """value / reference, elementwise over (lo, hi) ranges; None when either side is missing."""
    if value is None or reference is None or isinstance(reference, tuple):
        return None
    if isinstance(value, tuple):
        return tuple(v / reference for v in value)
    return value / reference


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def benchmark_args(doc: str, quick_help: str | None, argv: list[str] | None, add_arguments=None,
                   device: str = "cpu", quick_is_smoke: bool = True) -> argparse.Namespace:
    """The command line every benchmark takes: --quick (none where quick_help is None), --out (one folder for
    everything the run writes) and --kind (the machine kind), plus what add_arguments(parser) adds for one
    benchmark. args.folders is where the run writes (Folders.of): a smoke run, --quick or --tiny, apart from the
    summaries, unless quick_is_smoke is False (a GPU benchmark's --quick is a shorter run on the device, its
    --tiny the smoke run). device is where the benchmark runs, unless it takes a --device option of its own: a
    run on CUDA files its results under the GPU's model."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick_help is not None:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None,
                        help="write the summary, its plot, the raw JSON, further plots and logs all in this folder "
                             "(default: the summary and its plot in benchmarks/results/KIND/, the rest in "
                             "benchmarks/runs/KIND/; a smoke run all in benchmarks/runs/KIND/smoke/)")
    parser.add_argument("--kind", default=None,
                        help="the machine kind, the folder name under benchmarks/results/ and benchmarks/runs/ "
                             "(default: detected: the GPU's model for a run on CUDA, else amx, zen4, avx512 or avx2)")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    args.quick = getattr(args, "quick", False)
    args.command = command_line(sys.argv[0], sys.argv[1:] if argv is None else argv)
    args.kind = args.kind or machine_kind(getattr(args, "device", device))
    smoke = (args.quick and quick_is_smoke) or getattr(args, "tiny", False)
    args.folders = Folders.of(args.out, args.kind, smoke)
    return args


WHERE_OPTIONS = ("--out", "--kind")  # where a run writes: left out of the command its summary names


def command_line(script: str, options: list[str]) -> str:
    """The command that ran a benchmark, for its results file: every option but those of where it writes. script
    is the benchmark's run_NAME.py (sys.argv[0] once `python -m benchmarks NAME` has handed over to it)."""
    kept = [o for i, o in enumerate(options) if o not in WHERE_OPTIONS and not o.startswith(
        tuple(f"{w}=" for w in WHERE_OPTIONS)) and (i == 0 or options[i - 1] not in WHERE_OPTIONS)]
    name = Path(script).stem.removeprefix("run_")
    return "PYTHONPATH=. python -m " + shlex.join(["benchmarks", name, *kept])


def write_raw(folders: Folders, name: str, raw: dict) -> Path:
    """folders.raw/NAME.json: every figure of the run, for a later look or another plot."""
    folders.raw.mkdir(parents=True, exist_ok=True)
    path = folders.raw / f"{name}.json"
    path.write_text(json.dumps(raw, indent=2, default=str) + "\n")
    return path


def write_summary(folders: Folders, name: str, text: str) -> Path:
    """folders.results/NAME.md."""
    folders.results.mkdir(parents=True, exist_ok=True)
    path = folders.results / f"{name}.md"
    path.write_text(text)
    return path


def save_png(fig, path: Path, dpi: int = 110) -> Path:
    """The figure as a palette PNG: a plot's flat colours and their anti-aliased edges fit in 256, and the file
    takes a fraction of an RGBA one's bytes, which keeps the committed results small."""
    from PIL import Image

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").convert("P", palette=Image.ADAPTIVE, colors=256)
    path.parent.mkdir(parents=True, exist_ok=True)
    palette.save(path, format="PNG", optimize=True)
    return path


def save_results(folders: Folders, name: str, raw: dict, plot, text: str, more_plots: dict | None = None) -> None:
    """Every file of a run: folders.results/NAME.md (text, also printed; it links NAME.png, which is added where
    text does not) and NAME.png (the figure plot(raw) returns); folders.raw/NAME.json (raw) and NAME_KEY.png for
    each KEY: make of more_plots (figures from raw, as plot)."""
    import matplotlib.pyplot as plt

    figures = {folders.results / f"{name}.png": plot}
    figures.update({folders.raw / f"{name}_{key}.png": make for key, make in (more_plots or {}).items()})
    written = [write_raw(folders, name, raw)]
    for path, make in figures.items():
        fig = make(raw)
        written.append(save_png(fig, path))
        plt.close(fig)
    if f"({name}.png)" not in text:
        text = text.rstrip("\n") + f"\n\n![{name}]({name}.png)\n"
    written.append(write_summary(folders, name, text))
    print(text)
    print("wrote " + ", ".join(str(path) for path in written))
