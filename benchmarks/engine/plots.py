"""The engine benchmark's plots (matplotlib, Agg backend), as figures for benchmarks/common.py: save_results."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.engine import systems  # noqa: E402
from benchmarks.common import Result  # noqa: E402


def _bars(ax, results: list[Result], workload: str, title: str) -> None:
    """Horizontal bars of tok/s per system (vLLM is compared in its own plot, engine_vs_vllm.png)."""
    rows = [(r.system, r.tok_s or 0.0, 0.0, r.error is not None) for r in results if r.workload == workload]
    labels, values, spans, failed = zip(*rows)
    y = range(len(rows))
    bars = ax.barh(y, values, color="tab:blue")
    ranged = [(i, v, s) for i, (v, s) in enumerate(zip(values, spans)) if s]
    if ranged:
        rows_i, mids, halves = zip(*ranged)
        ax.errorbar(mids, rows_i, xerr=halves, fmt="none", ecolor="black", capsize=4)
    for bar, label in zip(bars, labels):
        if label.startswith("vLLM"):
            bar.set(color="lightgray", hatch="//", edgecolor="gray")
        elif label.startswith("lora-serve"):
            bar.set_color("tab:orange")
    for i, (value, bad) in enumerate(zip(values, failed)):
        ax.text(value + spans[i], i, " error" if bad else f" {value:,.0f}", va="center", fontsize=8)
    ax.set_xlim(0, 1.15 * max(v + s for v, s in zip(values, spans)))
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens / s")
    ax.set_title(title, fontsize=10)


def throughput_bars(results: list[Result]):
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    _bars(axes[0], results, "a", "(a) uniform: N requests x T tokens")
    _bars(axes[1], results, "b", "(b) mixed lengths: every 8th request long")
    return fig


def batch_sweep(results: list[Result]):
    """The course's plot: throughput and per-token latency against batch size, one line per system."""
    fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r.extra["batch"] for r in results if r.workload.startswith("c:")})
    for name in (systems.HF_STATIC, systems.LS_FP32, systems.LS_BF16):
        points = sorted((r.extra["batch"], r.tok_s, r.extra["ms_per_token"]) for r in results
                        if r.workload.startswith("c:") and r.system == name and r.error is None)
        if not points:
            continue
        batch, tok_s, ms = zip(*points)
        ax_tps.plot(batch, tok_s, marker="o", label=name)
        ax_lat.plot(batch, ms, marker="o", label=name)
    for ax, ylabel in ((ax_tps, "throughput (tokens / s)"), (ax_lat, "mean per-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig
