"""The GPU serve benchmark's report: gpu_serve.md (the server that ran, the route checks, the load, the HTTP share
of the offline engine's tokens/s) and gpu_serve.png.
"""

from __future__ import annotations

import traceback

from benchmarks.common import markdown_table, scaled, write_raw, write_summary
from benchmarks.gpu.gpu_serve_plan import NAME, SHARE_BAR, WORKLOADS


def markdown(raw: dict) -> str:
    plan, server = raw["plan"], raw["server"]
    lines = [f"# lora-serve over HTTP on {raw['device_name']}", "", f"Command: `{raw['command']}`  ",
             f"Date: {raw['date']}", "",
             (f"{plan['shape']} shape, bf16, random weights (load_format dummy), {plan['adapters']} rank-{plan['rank']}"
              f" adapters, max_num_seqs {plan['top']}; mode {raw['mode']}."), "", _server_line(server), ""]
    if server.get("ray_error"):
        lines += ["Ray Serve did not come up:", "", "```", server["ray_error"].strip(), "```", ""]
    lines += _routes_section(raw) + _load_section(raw) + _share_section(raw)
    lines += ["## Phases", "", markdown_table(["phase", "status", "seconds"], [
        [n, "ok" if p["ok"] else f"failed: {p['error'].splitlines()[0][:300]}", scaled(p["seconds"])]
        for n, p in raw["phases"].items()]), ""]
    return "\n".join(lines)


def _server_line(server: dict) -> str:
    if server.get("server") == "lora-serve":
        return (f"Server: Ray Serve, `serve run` of gpu_serve_config.yaml, requests through {server['proxy']} on its "
                f"HTTP port; healthy {scaled(server.get('ready_s'))} s after its start.")
    if server.get("server"):
        return (f"Server: in one process without Ray (deployments/replica/in_process.py over uvicorn); healthy "
                f"{scaled(server.get('ready_s'))} s after its start.")
    return "Server: none came up."


def _routes_section(raw: dict) -> list[str]:
    rows = [[r["route"], "yes" if r["stream"] else "no", r["model"], "pass" if r["ok"] else "FAIL", r["detail"],
             scaled(r["ms"], 0)] for r in raw.get("routes", [])]
    return [f"## Routes ({raw['plan']['check_tokens']} new tokens each)", "",
            markdown_table(["route", "streamed", "model", "result", "answer", "ms"], rows), ""] if rows else []


def _load_section(raw: dict) -> list[str]:
    rows = [[r["workload"], r["concurrency"], f"{r['ok']} / {r['requests']}", scaled(r["tok_s"]), scaled(r["ttft_ms_p50"]),
             scaled(r["tpot_ms_p50"], 2), scaled(r["itl_ms_p50"]), scaled(r["itl_ms_p99"]), scaled(r["events_per_request"])]
            for r in raw.get("load", [])]
    if not rows:
        return []
    return [f"## Streamed /v1/completions, {raw['plan']['new_tokens']} new tokens, closed loop", "",
            markdown_table(["workload", "streams", "ok / requests", "tok/s", "TTFT p50 ms", "TPOT p50 ms",
                            "ITL p50 ms", "ITL p99 ms", "events / request"], rows), "",
            ("adapters: requests round-robin over the adapters. ITL: gaps between a stream's events (chunks); a "
             "paced replica puts several tokens in one under load."), ""]


def _share_section(raw: dict) -> list[str]:
    rows = [[s["workload"], scaled(s["http_tok_s"]), scaled(s["offline_tok_s"]), scaled(s["share"], 0, 100, "%"),
             "met" if s["met"] else "not met"] for s in shares(raw)]
    if not rows:
        return []
    top = raw["plan"]["top"]
    return [f"## HTTP at {top} streams against the engine offline ({top} requests at once, server stopped)", "",
            markdown_table(["workload", f"HTTP tok/s at {top}", "offline tok/s", "HTTP share",
                            f"bar {SHARE_BAR:.0%}"], rows), ""]


def plot(raw: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for workload, color in zip(WORKLOADS, ("tab:blue", "tab:orange")):
        rows = [r for r in raw.get("load", []) if r["workload"] == workload]
        for ax, key in zip(axes, ("tok_s", "ttft_ms_p50", "itl_ms_p99")):
            ax.plot([r["concurrency"] for r in rows], [r[key] or 0 for r in rows], marker="o", color=color,
                    label=f"HTTP, {workload}")
        for off in (o for o in raw.get("offline", []) if o["workload"] == workload):
            axes[0].scatter([raw["plan"]["top"]], [off["tok_s"]], marker="*", s=160, color=color,
                            label=f"offline, {workload}")
    for ax, label in zip(axes, ("generated tokens / s", "TTFT p50 (ms)", "ITL p99 (ms)")):
        ax.set(xscale="log", xlabel="concurrent streams", ylabel=label)
        ax.set_xticks([c for c, _ in raw["plan"]["loads"]], [str(c) for c, _ in raw["plan"]["loads"]])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"lora-serve over HTTP ({raw['server'].get('server') or 'no server'}), {raw['plan']['shape']} "
                 f"shape on {raw['device_name']}", fontsize=10)
    return fig


def save(folders, raw: dict) -> None:
    """gpu_serve.json and gpu_serve.md always; gpu_serve.png through common.save_results where it can be drawn."""
    text = markdown(raw)
    write_raw(folders, NAME, raw)
    write_summary(folders, NAME, text)
    try:
        from benchmarks.common import save_results

        save_results(folders, NAME, raw, plot, text)
    except Exception:  # noqa: BLE001 - a plot must not cost the figures
        print(text)
        print(f"{NAME}.png failed:\n{traceback.format_exc()}")


def shares(raw: dict) -> list[dict]:
    """HTTP tok/s at the top concurrency over offline tok/s, per workload."""
    top = raw["plan"]["top"]
    http = {r["workload"]: r for r in raw.get("load", []) if r["concurrency"] == top}
    rows = []
    for off in raw.get("offline", []):
        served = http.get(off["workload"])
        share = served["tok_s"] / off["tok_s"] if served and off["tok_s"] else None
        rows.append({"workload": off["workload"], "http_tok_s": served and served["tok_s"], "offline_tok_s":
                     off["tok_s"], "share": share, "met": share is not None and share >= SHARE_BAR})
    return rows
