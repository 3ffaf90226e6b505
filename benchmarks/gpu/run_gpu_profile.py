"""Where a decode step's time goes on a GPU: wall time per engine step against the device's busy time in it, and
the host's share by function, at batch 1 and batch 64 on the Llama-3.2-1B shape (random weights).

A decode step is host work (schedule, fill the graph's inputs, sample, detokenize) around one graph replay. When
the host's part runs while the device waits, batch-1 decode cannot approach the weight-read bound, however fast
the kernels are; this says how large each part is, so the next change targets the larger one.

    python -m benchmarks gpu_profile --tokenizer DIR [--out DIR] [--steps N]     # --tiny: CPU smoke run

Writes gpu_profile.md (the table, the device's kernels by time, the host's functions by cumulative time) and
gpu_profile.png (device busy and host-only time per step, stacked) to benchmarks/results/KIND/, KIND the GPU's model
(h100, h200), and gpu_profile.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.common import benchmark_args, save_results
from benchmarks.gpu.gpu_models import build_model_dir, kv_bytes_per_token, shape
from engine import LLM, SamplingParams

MODEL = "llama-3.2-1b"


def make_engine(folder: Path, batch: int, context: int, tiny: bool):
    kv = int(1.3 * batch * context * kv_bytes_per_token(shape(MODEL, tiny))) + (64 << 20)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(folder), dtype="bfloat16", device=device, load_format="dummy", max_num_seqs=max(batch, 8),
              max_model_len=context, kv_cache_bytes=kv, log_stats=False, enable_prefix_caching=False)
    return llm.engine


def start_decoding(engine, batch: int, prompt: int, new: int) -> None:
    """Add `batch` requests and step until every prompt is done, so the next steps are decode-only."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + (7 * i + j) % 500 for j in range(prompt)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(output.request_id for output in engine.step())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_walls(engine, steps: int) -> list[float]:
    walls = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        walls.append(time.perf_counter() - start)
    return walls


def device_busy(engine, steps: int) -> tuple[float, str]:
    """Seconds of kernels per step (profiler's device time) and the table of kernels by total time."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    events = prof.key_averages()
    total_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1e6 / steps, events.table(sort_by="self_cuda_time_total", row_limit=15)


def host_profile(engine, steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    return text.getvalue()


@dataclass(frozen=True)
class StepProfile:
    batch: int
    wall_ms: float  # median engine step, device idle before and after
    busy_ms: float  # kernels' device time per step (profiler)
    kernels: str  # the profiler's table of kernels by device time
    host: str  # cProfile's functions by cumulative time

    def row(self) -> str:
        host_only, share = self.wall_ms - self.busy_ms, self.busy_ms / self.wall_ms
        return f"| {self.batch} | {self.wall_ms:.2f} | {self.busy_ms:.2f} | {host_only:.2f} | {share:.0%} |"

    def details(self, steps: int) -> list[str]:
        return [f"### batch {self.batch}: device kernels\n\n```\n{self.kernels}\n```",
                f"### batch {self.batch}: host functions (cProfile, {steps} steps)\n\n```\n{self.host}\n```"]


def measure(folder: Path, batch: int, steps: int, tiny: bool) -> StepProfile:
    engine = make_engine(folder, batch, 128 + 4 * steps + 16, tiny)
    start_decoding(engine, batch, 128, 4 * steps + 8)
    wall = statistics.median(step_walls(engine, steps))
    busy, kernels = device_busy(engine, steps)
    return StepProfile(batch, wall * 1e3, busy * 1e3, kernels, host_profile(engine, steps))


def plot(raw: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"batch {row['batch']}" for row in raw["rows"]]
    busy = [row["busy_ms"] for row in raw["rows"]]
    host = [row["wall_ms"] - row["busy_ms"] for row in raw["rows"]]
    ax.bar(labels, busy, label="device busy")
    ax.bar(labels, host, bottom=busy, label="host only (device idle)")
    ax.set(ylabel="ms / decode step", title=f"decode step, {MODEL} shape, {raw['device']}")
    ax.legend(fontsize=8)
    return fig


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def _arguments(parser) -> None:
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (CPU smoke run)")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, None, argv, _arguments, device="cuda")
    folder = build_model_dir(Path(tempfile.mkdtemp()), MODEL, args.tokenizer, args.tiny)
    profiles = [measure(folder, batch, args.steps, args.tiny) for batch in tqdm((1, 64), desc="batches")]
    table = ["| batch | step wall (ms) | device busy (ms) | host-only (ms) | busy share |", "|---|---|---|---|---|"]
    rows = [p.row() for p in profiles]
    details = [line for p in profiles for line in p.details(args.steps)]
    text = "\n".join([f"# Decode step on {device_name()} ({MODEL}, bf16, graphs)", "", *table, *rows, "",
                      *details]) + "\n"
    raw = {"device": device_name(), "model": MODEL, "steps": args.steps,
           "rows": [{"batch": p.batch, "wall_ms": p.wall_ms, "busy_ms": p.busy_ms} for p in profiles]}
    save_results(args.folders, "gpu_profile", raw, plot, text)


if __name__ == "__main__":
    main()
