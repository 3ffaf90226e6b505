"""Soak: `serve run serve_config.yaml` under a mixed load with adapter churn, for half an hour; does anything grow?

    PYTHONPATH=. python -m benchmarks soak                # 30 minutes
    PYTHONPATH=. python -m benchmarks soak --minutes 5
    PYTHONPATH=. python -m benchmarks soak --quick        # 2 minutes, a smoke run

The shipped config, as a user starts it (SmolLM2 bf16, the shipped pirate adapter). CLIENTS concurrent clients
send, in turn: a streamed base completion, a pirate chat, a structured-output chat (a JSON schema), a stream the
client drops after a few chunks, a completion on a churned adapter, and a pirate chat that must call a tool
(tool_choice "required"). Meanwhile the adapters churn-0..2 are loaded again, from one of four weight folders in
turn, through /v1/load_lora_adapter every CHURN_S seconds, and now and then unloaded. Every SAMPLE_S seconds:
RSS, private memory (USS) and open file descriptors of every process of the server's tree, by role; the
replica's requests and KV blocks in use (/info); the Ray object store's bytes (`ray memory`). RSS also counts the
shared pages a process has touched (the object store's, where a replica reads its adapters); USS does not.

The figures compare the first sample after WARMUP_S (caches, pools and allocators filled) with the last one, taken
once the load has stopped and the server is idle. Writes soak.md and soak.png to benchmarks/results/KIND/ and
soak.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import psutil  # noqa: E402
import requests  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import benchmark_args, environment, fmt, markdown_table, save_results  # noqa: E402
from benchmarks.serve.http_servers import ROOT, Server, role, start_lora_serve  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402

CLIENTS = 8
CHURN_S = 20.0
SAMPLE_S = 30.0
WARMUP_S = 180.0
VERSIONS = 4  # weight folders a churned adapter is loaded from in turn
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}}, "required": ["city", "population"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
ROLES = ("engine replica", "HTTP proxy", "Serve controller", "adapter cache actor", "raylet", "Ray GCS")


def write_churn_adapters(folder: Path) -> list[Path]:
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter
    from engine.config import default_cache_dir
    from engine.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct", default_cache_dir() / "models"))
    return [write_random_adapter(folder / f"v{i}", config, rank=8, seed=i) for i in range(VERSIONS)]


async def one_request(session: aiohttp.ClientSession, url: str, i: int, loaded: list[str]) -> str:
    """Request number i of the mix; its outcome ("200", "404", ..., "dropped" for a stream the client left)."""
    prompt = PROMPTS[i % len(PROMPTS)]
    kind = i % 6
    if kind == 0:
        body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 48, "stream": True}
    elif kind == 1:
        body = {"model": "pirate", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
    elif kind == 2:
        body = {"model": "smollm2-135m-instruct", "max_tokens": 64, "messages": [
            {"role": "user", "content": "Name a city and its population as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
    elif kind == 3:
        body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 200, "stream": True}
    elif kind == 4:
        body = {"model": loaded[i % len(loaded)] if loaded else "pirate", "prompt": prompt, "max_tokens": 32}
    else:
        body = {"model": "pirate", "max_tokens": 64, "tools": TOOLS, "tool_choice": "required", "messages": [
            {"role": "user", "content": "What is the weather in Lisbon?"}]}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(f"{url}{path}", json=body) as response:
        if kind == 3 and response.status == 200:
            for _ in range(3):
                await response.content.readline()
            return "dropped"  # leaving the block closes the connection: the server must stop the request
        await response.read()
        return str(response.status)


async def clients(url: str, deadline: float, outcomes: Counter, loaded: list[str]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def client(c: int) -> None:
            i = c
            while time.monotonic() < deadline:
                try:
                    outcomes[await one_request(session, url, i, loaded)] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    outcomes[type(exc).__name__] += 1
                i += CLIENTS

        await asyncio.gather(*(client(c) for c in range(CLIENTS)))


async def churn(url: str, deadline: float, folders: list[Path], outcomes: Counter, loaded: list[str]) -> None:
    """Load churn-(i % 3) from folder i % VERSIONS every CHURN_S; every fifth turn unload the oldest."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        i = 0
        while time.monotonic() < deadline:
            name = f"churn-{i % 3}"
            if i % 5 == 4 and loaded:
                gone = loaded.pop(0)
                async with session.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": gone}) as r:
                    outcomes[f"unload {r.status}"] += 1
            async with session.post(f"{url}/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": str(folders[i % VERSIONS])}) as r:
                outcomes[f"load {r.status}"] += 1
            if name not in loaded:
                loaded.append(name)
            i += 1
            await asyncio.sleep(CHURN_S)


def object_store_mib(ray_dir: Path) -> float | None:
    """The Ray object store's bytes in use, as `ray memory --stats-only` reports them."""
    env = {**os.environ, "RAY_TMPDIR": str(ray_dir)}
    if (Path.home() / ".ray" / "auth_token").is_file():  # the cluster `serve run` starts asks for Ray's token
        env["RAY_AUTH_MODE"] = "token"
    try:
        out = subprocess.run(["ray", "memory", "--stats-only", "--address", "auto"], env=env, capture_output=True,
                             text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return None
    match = re.search(r"Plasma memory usage ([\d.]+) MiB", out)
    return float(match.group(1)) if match else None


def sample(server: Server, ray_dir: Path, start: float) -> dict:
    rss, uss, fds = Counter(), Counter(), Counter()
    for process in server.tree():
        try:
            name = role(process)
            memory = process.memory_full_info()
            rss[name] += memory.rss / 2**20
            uss[name] += memory.uss / 2**20
            fds[name] += process.num_fds()
        except psutil.Error:
            pass
    info = requests.get(f"{server.url}/info", timeout=30).json()
    return {"t": time.monotonic() - start, "rss_mib": dict(rss), "uss_mib": dict(uss), "fds": dict(fds),
            "kv_blocks_used": info["kv_blocks_used"], "running": info["running"] + info["waiting"],
            "object_store_mib": object_store_mib(ray_dir)}


def soak(server: Server, ray_dir: Path, folders: list[Path], seconds: float) -> tuple[list[dict], Counter]:
    outcomes, loaded, samples = Counter(), [], []
    start = time.monotonic()
    deadline = start + seconds

    async def run() -> None:
        load = asyncio.gather(clients(server.url, deadline, outcomes, loaded),
                              churn(server.url, deadline, folders, outcomes, loaded))
        with tqdm(total=round(seconds), desc="soak", unit="s") as bar:
            while time.monotonic() < deadline:
                samples.append(await asyncio.to_thread(sample, server, ray_dir, start))
                await asyncio.sleep(min(SAMPLE_S, max(0.0, deadline - time.monotonic())))
                bar.update(round(time.monotonic() - start) - bar.n)
        await load

    asyncio.run(run())
    time.sleep(10)  # idle: cancelled and finished requests have given their blocks back
    samples.append(sample(server, ray_dir, start))
    return samples, outcomes


def rows(samples: list[dict], warmup_s: float) -> list[list[str]]:
    warm = next((s for s in samples if s["t"] >= warmup_s), samples[0])
    end = samples[-1]
    table = []
    for label, get, unit in _metrics():
        first, last = get(warm), get(end)
        peak = max((v for v in map(get, samples) if v is not None), default=None)
        change = None if first is None or last is None else last - first
        table.append([label, f"{fmt(first)} {unit}", f"{fmt(last)} {unit}", f"{fmt(peak)} {unit}",
                      f"{'+' if change and change > 0 else ''}{fmt(change)}"])
    return table


def _metrics():
    for name in ROLES:
        yield f"RSS, {name}", lambda s, n=name: s["rss_mib"].get(n), "MiB"
    yield "RSS, whole tree", lambda s: sum(s["rss_mib"].values()), "MiB"
    yield "private memory (USS), engine replica", lambda s: s["uss_mib"].get("engine replica"), "MiB"
    yield "private memory (USS), whole tree", lambda s: sum(s["uss_mib"].values()), "MiB"
    yield "open fds, engine replica", lambda s: s["fds"].get("engine replica"), ""
    yield "open fds, whole tree", lambda s: sum(s["fds"].values()), ""
    yield "KV blocks in use", lambda s: s["kv_blocks_used"], ""
    yield "requests in the engine", lambda s: s["running"], ""
    yield "object store", lambda s: s["object_store_mib"], "MiB"


def plot(raw: dict):
    samples = raw["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name in ROLES:
        axes[0][0].plot(t, [s["rss_mib"].get(name, 0) for s in samples], label=name)
    axes[0][0].plot(t, [s["uss_mib"].get("engine replica", 0) for s in samples], "--", label="engine replica, USS")
    axes[0][0].set(title="RSS by process, and the replica's private memory (MiB)", xlabel="minutes")
    axes[0][0].legend(fontsize=7)
    axes[0][1].plot(t, [sum(s["fds"].values()) for s in samples], label="whole tree")
    axes[0][1].plot(t, [s["fds"].get("engine replica", 0) for s in samples], label="engine replica")
    axes[0][1].set(title="open file descriptors", xlabel="minutes")
    axes[0][1].legend(fontsize=7)
    axes[1][0].plot(t, [s["kv_blocks_used"] for s in samples])
    axes[1][0].set(title="KV blocks in use", xlabel="minutes")
    axes[1][1].plot(t, [s["object_store_mib"] or 0 for s in samples])
    axes[1][1].set(title="Ray object store (MiB)", xlabel="minutes")
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "2 minutes", argv, lambda p: p.add_argument("--minutes", type=float, default=30))
    seconds = 120.0 if args.quick else args.minutes * 60
    warmup = min(WARMUP_S, seconds / 3)
    with tempfile.TemporaryDirectory(prefix="sk-", dir="/tmp") as tmp:
        tmp = Path(tmp)
        folders = write_churn_adapters(tmp / "churn")
        server = start_lora_serve("lora-serve", ROOT / "serve_config.yaml", tmp)
        try:
            server.wait_healthy(600, "/v1/models")
            samples, outcomes = soak(server, server.scratch, folders, seconds)
        finally:
            server.stop()
    table = markdown_table(["", "after warm-up", "end (idle)", "peak", "change"], rows(samples, warmup))
    total = sum(n for k, n in outcomes.items() if not k.startswith(("load", "unload")))
    text = (f"# Soak: {seconds / 60:.0f} minutes of mixed load with adapter churn\n\n"
            f"{CLIENTS} clients; warm-up sample at {warmup / 60:.0f} min; {total} requests "
            f"({total / seconds:.1f}/s). Outcomes: {dict(sorted(outcomes.items()))}\n\n{table}\n")
    save_results(args.folders, "soak", {"environment": environment(), "seconds": seconds, "warmup_s": warmup,
                                    "outcomes": dict(outcomes), "samples": samples}, plot, text)


if __name__ == "__main__":
    main()
