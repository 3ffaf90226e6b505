"""The lora-serve against vLLM section of the engine benchmark's summary, and its plot (ratio per workload)."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import fmt, markdown_table  # noqa: E402
from benchmarks.peers.peer_compare import PeerResult, median_spread  # noqa: E402
from benchmarks.peers.peer_timing import Timing  # noqa: E402

NAMES = {"a": "(a) uniform (64 x 32 in the full run)", "s": "(s) (a) sampled, temperature 1, top-p 0.9",
         "b": "(b) mixed lengths", "d": "(d) single stream",
         "lora": "(a) with 8 rank-8 adapters", "e": "(e) long prompts (16 x 2,000 tokens in the full run)"}


@dataclass(frozen=True)
class Metric:
    label: str
    value: object  # Timing -> float
    higher_is_better: bool = True
    digits: int = 1


TOK_S = Metric("tok/s", lambda t: t.tok_s)
MS_PER_TOKEN = Metric("ms/token", lambda t: (t.seconds - t.first_token_s[0]) / (t.tokens - 1) * 1000, False, 2)
PREFILL_S = Metric("prefill s", lambda t: t.prefill_s, False, 2)
DECODE = Metric("decode tok/s", lambda t: t.decode_tok_s)


def metrics(workload: str) -> list[Metric]:
    return {"d": [MS_PER_TOKEN], "e": [TOK_S, PREFILL_S, DECODE]}.get(workload, [TOK_S])


@dataclass
class Row:
    workload: str
    dtype: str
    metric: Metric
    lora_serve: tuple[float, float, float] | None  # median, min, max
    vllm: tuple[float, float, float] | None
    error: str | None

    @property
    def ratio(self) -> float | None:
        """lora-serve / vLLM on medians, as a speed: > 1 means lora-serve is faster."""
        if not self.lora_serve or not self.vllm:
            return None
        ours, theirs = self.lora_serve[0], self.vllm[0]
        return ours / theirs if self.metric.higher_is_better else theirs / ours


def rows(results: list[PeerResult]) -> list[Row]:
    out = []
    for result in results:
        for metric in metrics(result.job.workload):
            out.append(Row(result.job.workload, result.job.dtype, metric, _summary(result.lora_serve, metric),
                           _summary(result.vllm, metric), result.error))
    return out


def _summary(timings: list[Timing], metric: Metric) -> tuple[float, float, float] | None:
    return median_spread([metric.value(t) for t in timings]) if timings else None


def _cell(summary, digits: int) -> str:
    if summary is None:
        return "-"
    median, lo, hi = summary
    return f"{fmt(median, digits)} ({fmt(lo, digits)}-{fmt(hi, digits)})"


def kept_with_adapters(table_rows: list[Row]) -> list[list[str]]:
    """Per dtype and side: tok/s with 8 adapters / tok/s on the base model, on the same requests (medians)."""
    tok_s = {(r.workload, r.dtype): r for r in table_rows if r.metric is TOK_S}
    out = []
    for (workload, dtype), lora in tok_s.items():
        base = tok_s.get(("a", dtype))
        if workload != "lora" or base is None:
            continue
        kept = [fmt(_share(getattr(lora, side), getattr(base, side)), 2) for side in ("lora_serve", "vllm")]
        out.append([dtype, *kept])
    return out


def _share(part, whole) -> float | None:
    return part[0] / whole[0] if part and whole else None


def markdown(table_rows: list[Row], rounds: int, env: dict) -> str:
    table = [[NAMES[r.workload], r.dtype, r.metric.label,
              _cell(r.lora_serve, r.metric.digits), _cell(r.vllm, r.metric.digits), fmt(r.ratio, 2),
              f"**error**: {r.error}" if r.error else ""] for r in table_rows]
    header = ["workload", "dtype asked", "metric", "lora-serve median (min-max)", "vLLM median (min-max)",
              "lora-serve / vLLM (speed)", "note"]
    kept = kept_with_adapters(table_rows)
    shares = ["Share of base-model throughput kept with 8 adapters (medians, same run):",
              markdown_table(["dtype asked", "lora-serve", "vLLM"], kept)] if kept else []
    return "\n\n".join([
        f"## lora-serve against vLLM's CPU build, same run, {rounds} interleaved rounds",
        f"vLLM: {env['vllm']}; lora-serve: {env['lora_serve']}. Each cell: median over the rounds (min-max). "
        "The ratio compares medians as a speed (> 1: lora-serve faster; for ms/token and prefill s it is "
        "vLLM's time / lora-serve's). Prefill = until the last request's first token; decode tok/s = the tokens "
        "after each request's first / the time after that.",
        markdown_table(header, table), *shares])


def plot(table_rows: list[Row]):
    shown = [r for r in table_rows if r.ratio is not None]
    labels = [f"{NAMES[r.workload]}, {r.dtype}, {r.metric.label}" for r in shown]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(shown) + 1.5))
    bars = ax.barh(range(len(shown)), [r.ratio for r in shown], color="tab:orange")
    for bar, r in zip(bars, shown):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r.ratio:.2f}x", va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("lora-serve / vLLM CPU, as a speed (median of the rounds; > 1: lora-serve faster)")
    return fig
