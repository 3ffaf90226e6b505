"""Time to first answer after start-up: `serve run serve_config.yaml` against vLLM's OpenAI server, each with a
cold and with a warm build cache.

    PYTHONPATH=. python -m benchmarks startup --vllm-python /work/vllm-venv/bin/python   # full run
    PYTHONPATH=. python -m benchmarks startup --quick                                    # lora-serve, one round

What each server compiles on its first start on a machine, and keeps:
- lora-serve: its C++ CPU operators (engine/kernels/cpu_ops.py), under $TORCH_EXTENSIONS_DIR. "cold" gives the
  server a fresh, empty folder there (the first start on a machine, or after the sources or torch change); "warm"
  reuses the folder the cold start filled (every later start, and every replica after the first).
- vLLM: its torch.compile artifacts, under $VLLM_CACHE_ROOT, made cold and warm the same way.
The model files are converted and on disk for both in either state (lora-serve converts the embedded GGUF once, at
its first load; that is install-time work, not part of a start). Measured: the server process starts -> the first
200 answer to a 1-token /v1/completions on its public port (HAProxy for lora-serve). A request is sent again 0.25 s
after a refusal or an error answer, and one the server accepts is waited for until the deadline: a client that
gives up on a request that waits at Serve's fallback proxy while the replica starts leaves HAProxy 2.8 looping on
the closed connection, on most of a core, until the request is answered: CPU taken from the very start it times.
Rounds are interleaved: each round starts every system cold, then warm, alone on the machine; who goes first
alternates. Writes startup.md and startup.png to benchmarks/results/KIND/ and startup.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import requests  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (benchmark_args, environment, markdown_table, report_header,  # noqa: E402
                               save_results, value_range)
from benchmarks.peers.vllm_env import NOT_INSTALLED, vllm_python  # noqa: E402
from benchmarks.serve.http_servers import ROOT, Server, start_lora_serve, start_vllm  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
STATES = ("cold", "warm")
CACHE_VARIABLE = {"lora-serve": "TORCH_EXTENSIONS_DIR", "vLLM": "VLLM_CACHE_ROOT"}


@dataclass
class Start:
    """One start: the system, cold or warm, the round, and the seconds from the process start to the first
    answer."""
    system: str
    state: str
    round: int
    seconds: float


def first_answer(server: Server, started: float, timeout_s: float) -> float:
    """Seconds from `started` to the first 200 answer to a 1-token completion."""
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 1}
    while time.perf_counter() - started < timeout_s:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode} before answering; see "
                               f"{server.log}")
        try:
            wait_s = max(1.0, timeout_s - (time.perf_counter() - started))
            if requests.post(f"{server.url}/v1/completions", json=body, timeout=wait_s).status_code == 200:
                return time.perf_counter() - started
        except requests.RequestException:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{server.name} gave no answer in {timeout_s:.0f} s; see {server.log}")


def start(system: str, args, tmp: Path, cache: Path) -> Server:
    env = {CACHE_VARIABLE[system]: str(cache)}
    if system == "lora-serve":
        return start_lora_serve(system, args.config, tmp, env=env)
    return start_vllm(args.vllm_python, resolve_model(MODEL, default_cache_dir() / "models"), MODEL, tmp, env=env)


def one_start(system: str, state: str, rnd: int, args, tmp: Path, cache: Path) -> Start:
    """Start `system` with its build cache in `cache` (empty for a cold start), time its first answer, stop it."""
    tmp.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    server = start(system, args, tmp, cache)
    try:
        return Start(system, state, rnd, first_answer(server, started, args.timeout))
    finally:
        server.stop()


def run(args) -> dict:
    systems = ["lora-serve"] + (["vLLM"] if args.vllm_python else [])
    rounds = 1 if args.quick else args.rounds
    starts: list[Start] = []
    with tempfile.TemporaryDirectory(prefix="su-", dir="/tmp") as folder, \
            tqdm(total=rounds * len(systems) * len(STATES), desc="start-ups", unit="start") as bar:
        for rnd in range(rounds):
            for system in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                cache = Path(folder) / f"cache-{system}-{rnd}"  # empty: the cold start fills it, the warm one reuses
                for state in STATES:
                    starts.append(one_start(system, state, rnd, args, Path(folder) / f"{system}-{state}-{rnd}",
                                            cache))
                    bar.update()
                    tqdm.write(f"round {rnd} {system} {state}: {starts[-1].seconds:.1f} s to the first answer")
    return {"systems": systems, "rounds": rounds, "starts": [asdict(s) for s in starts]}


def _seconds(raw: dict, system: str, state: str) -> list[float]:
    return [s["seconds"] for s in raw["starts"] if s["system"] == system and s["state"] == state]


def table(raw: dict) -> str:
    """Per system: seconds to the first answer, cold and warm (ranges over rounds), and what cold adds."""
    rows = []
    for system in raw["systems"]:
        cold, warm = _seconds(raw, system, "cold"), _seconds(raw, system, "warm")
        added = [c - w for c, w in zip(cold, warm)]
        rows.append([system, CACHE_VARIABLE[system], value_range(cold), value_range(warm), value_range(added)])
    return markdown_table(["server", "build cache", "cold: s to first answer", "warm: s to first answer",
                           "cold adds, s"], rows)


def plot(raw: dict):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.35
    for i, state in enumerate(STATES):
        values = [statistics.median(_seconds(raw, system, state)) for system in raw["systems"]]
        ax.bar([x + (i - 0.5) * width for x in range(len(raw["systems"]))], values, width, label=state)
    ax.set_xticks(range(len(raw["systems"])), raw["systems"])
    ax.set_ylabel("seconds from start to the first answer")
    ax.set_title(f"Start-up, SmolLM2 bf16, cold and warm build cache: median of {raw['rounds']} rounds",
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml", help="lora-serve's serve config")
    parser.add_argument("--vllm-python", default=None,
                        help="python of vLLM's virtual environment (default $VLLM_PYTHON); without it, no vLLM")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a start may take")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "lora-serve only, one round", argv, add_arguments)
    args.vllm_python = None if args.quick else vllm_python(args.vllm_python)
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, **run(args)}
    method = ("Method: the server process starts -> the first 200 answer to a 1-token /v1/completions on its public "
              "port; cold: an empty build cache (lora-serve's C++ CPU operators, vLLM's torch.compile artifacts), "
              "warm: the one the cold start filled; model files on disk in both; rounds interleaved.")
    notes = [] if args.vllm_python else [NOT_INSTALLED, ""]
    text = "\n".join(report_header(f"Start-up ({raw['mode']})", args.command, env)
                     + [method, "", *notes, table(raw), "", "![startup](startup.png)", ""])
    save_results(args.folders, "startup", raw, plot, text)


if __name__ == "__main__":
    main()
