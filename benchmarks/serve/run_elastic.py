"""python -m benchmarks elastic: `serve run serve_config.yaml` on a cluster that Ray's own autoscaler grows and shrinks.

One elastic cycle (benchmarks/serve/elastic_cycle.py, in a PID namespace of its own): the cluster starts with its
head alone; a Zipf load over 32 adapters and the base model rises to 16 streams, holds 30 s once the second replica
serves, falls to 4 streams for 20 s, and stops. It reports the seconds from the load's rise to the second node
serving, the requests that failed, and the worker node-seconds the cycle used against a cluster held at its peak
size over the same time, with a plot of nodes, replicas, tokens/s and TTFT p99 over time. Worker nodes here are
raylets on this machine sharing its cores: the figures are about when nodes come and go, not about their speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

from benchmarks.common import benchmark_args, environment, markdown_table, report_header, save_results
from benchmarks.serve.fake_cluster import isolated_command
from benchmarks.serve.run_serve_load import quantile

WINDOW_S = 5.0


@dataclass(frozen=True)
class Window:
    t: float  # the window's end, seconds since the cluster started
    nodes: int
    replicas: int
    tok_s: float
    ttft_p99_s: float | None


def windows(cycle: dict) -> list[Window]:
    """The cycle in WINDOW_S windows: nodes and replicas at the window's end, the tokens streamed in it, and the
    TTFT p99 of the requests that ended in it."""
    samples, out, last = cycle["samples"], [], None
    for sample in samples:
        if last is not None and sample["t"] - last["t"] < WINDOW_S and sample is not samples[-1]:
            continue
        start = last["t"] if last else 0.0
        ended = sorted(o["ttft_s"] for o in cycle["outcomes"] if start < o["t_end"] <= sample["t"] and o["ttft_s"])
        tokens = sample["tokens"] - (last["tokens"] if last else 0)
        out.append(Window(sample["t"], sample["nodes"], sample["replicas"], tokens / max(sample["t"] - start, 1e-9),
                          quantile(ended, 0.99)))
        last = sample
    return out


def node_seconds(cycle: dict) -> tuple[float, float]:
    """Worker node-seconds the cycle used, and those of its peak node count held over the same time."""
    samples = cycle["samples"]
    used = sum(a["nodes"] * (b["t"] - a["t"]) for a, b in zip(samples, samples[1:]))
    held = max(s["nodes"] for s in samples) * (samples[-1]["t"] - samples[0]["t"])
    return used, held


def scaled_down_at(cycle: dict) -> float:
    """When the deployment went back to one replica: the first sample after the peak with one running."""
    peak = cycle["events"]["2 replicas running"]
    return next(s["t"] for s in cycle["samples"] if s["t"] > peak and s["replicas"] == 1)


def summarise(cycle: dict, profile: str) -> dict:
    events = cycle["events"]
    used, held = node_seconds(cycle)
    return {"profile": profile, "events": events, "placement": cycle["placement"],
            "rise_to_second_node_s": round(events["2 replicas running"] - events["load rises"], 1),
            "replica_to_node_gone_s": round(events["1 worker node"] - scaled_down_at(cycle), 1),
            "requests": len(cycle["outcomes"]), "failed": sum(o["status"] != 200 for o in cycle["outcomes"]),
            "node_seconds": round(used), "peak_node_seconds": round(held),
            "samples": [{k: s[k] for k in ("t", "nodes", "replicas")} for s in cycle["samples"]],
            "windows": [w.__dict__ for w in windows(cycle)]}


def table(raw: dict, command: str, env: dict) -> str:
    rows = [["seconds from the load's rise to the second node serving", f"{raw['rise_to_second_node_s']:.1f}"],
            ["seconds from the second replica's stop to its node's removal",
             f"{raw['replica_to_node_gone_s']:.1f}"],
            ["requests, failed", f"{raw['requests']}, {raw['failed']}"],
            ["worker node-seconds used, held at peak size", f"{raw['node_seconds']}, {raw['peak_node_seconds']}"],
            ["cluster-wide actors on the head", ", ".join(f"{k}: {v}" for k, v in raw["placement"].items())]]
    milestones = markdown_table(["milestone", "seconds"], [[k, f"{v:.1f}"] for k, v in raw["events"].items()])
    return "\n".join(report_header("Elastic cycle on Ray's autoscaler", command, env) + [
        markdown_table(["", ""], rows), "", milestones, ""])


def plot(raw: dict):
    import matplotlib.pyplot as plt

    w, s = raw["windows"], raw["samples"]
    t = [x["t"] for x in w]
    fig, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    axes[0].step([x["t"] for x in s], [x["nodes"] for x in s], where="post", label="worker nodes")
    axes[0].step([x["t"] for x in s], [x["replicas"] for x in s], where="post", linestyle="--",
                 label="engine replicas")
    axes[0].set_yticks([0, 1, 2])
    axes[0].legend(loc="upper right")
    axes[1].plot(t, [x["tok_s"] for x in w])
    axes[1].set_ylabel("tokens/s")
    axes[2].plot(t, [x["ttft_p99_s"] for x in w], marker=".")
    axes[2].set_ylabel("TTFT p99 (s)")
    axes[2].set_xlabel("seconds since the cluster started")
    for name, at in raw["events"].items():
        if name.startswith("load"):
            for ax in axes:
                ax.axvline(at, color="grey", linewidth=0.6)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "the quick profile: 12 streams over the base model and pirate, a 4-s peak",
                          argv)
    profile = "quick" if args.quick else "zipf"
    out = args.folders.raw / "elastic_cycle.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.serve.elastic_cycle", "--profile", profile, "--out", str(out)]
    subprocess.run(isolated_command(command), check=True)
    raw = summarise(json.loads(out.read_text()), profile)
    save_results(args.folders, "elastic", raw, plot, table(raw, args.command, environment()))


if __name__ == "__main__":
    main()
