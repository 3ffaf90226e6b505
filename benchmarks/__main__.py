"""One command line for every benchmark: `python -m benchmarks NAME [its options]`.

The benchmarks are grouped by subject in sub-packages (engine/, lora/, serve/, gpu/; peers/ holds the vLLM
runners they compare against). NAME is a `run_NAME.py` module of any of them; with no NAME, or an unknown one,
the list is printed. Each benchmark parses its own options (benchmarks/common.py: benchmark_args).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SUBJECTS = ("engine", "lora", "serve", "gpu")


def benchmarks() -> dict[str, str]:
    """NAME -> module, for every run_NAME.py of every subject."""
    here = Path(__file__).parent
    return {path.stem.removeprefix("run_"): f"benchmarks.{subject}.{path.stem}"
            for subject in SUBJECTS for path in sorted((here / subject).glob("run_*.py"))}


def main(argv: list[str]) -> int:
    known = benchmarks()
    if not argv or argv[0] not in known:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print("usage: python -m benchmarks NAME [options]; NAME is one of:\n  " +
              "\n  ".join(f"{name:<14} {module}" for name, module in known.items()), file=sys.stderr)
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    sys.argv = [f"benchmarks {argv[0]}", *argv[1:]]
    runpy.run_module(known[argv[0]], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
