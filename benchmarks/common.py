"""Shared helpers for the benchmarks: environment description, timing, number formatting, markdown tables,
the command line, writing a run's results."""

from __future__ import annotations

import argparse
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

RESULTS = Path(__file__).parent / "results"


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


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


def benchmark_args(doc: str, quick_help: str, argv: list[str] | None, add_arguments=None) -> argparse.Namespace:
    """The command line every benchmark takes: --quick (a smoke run) and --out (the results folder), plus what
    add_arguments(parser) adds for one benchmark."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = command_line(sys.argv[0], sys.argv[1:] if argv is None else argv)
    return args


def command_line(script: str, options: list[str]) -> str:
    """The command that ran a benchmark, for its results file: every option but the output folder. script is the
    benchmark's run_NAME.py (sys.argv[0] once `python -m benchmarks NAME` has handed over to it)."""
    kept = [o for i, o in enumerate(options) if o != "--out" and not o.startswith("--out=")
            and (i == 0 or options[i - 1] != "--out")]
    name = Path(script).stem.removeprefix("run_")
    return "PYTHONPATH=. python -m " + shlex.join(["benchmarks", name, *kept])


def save_results(folder: Path, name: str, raw: dict, plot, text: str) -> None:
    """folder/name.json (the raw figures), name.png (the figure plot(raw) returns) and name.md (text, also
    printed)."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(raw, indent=2) + "\n")
    fig = plot(raw)
    fig.tight_layout()
    fig.savefig(folder / f"{name}.png", dpi=110)
    plt.close(fig)
    (folder / f"{name}.md").write_text(text)
    print(text)
