"""The markdown report (engine.md) built from the measured Results."""

from __future__ import annotations

from benchmarks.engine import systems
from benchmarks.common import Result, fmt, markdown_table, ratio
from benchmarks.workloads import Plan

def _row_status(r: Result) -> str:
    return f"**error**: {r.error}" if r.error else r.note


def throughput_section(results: list[Result], workload: str) -> str:
    rows = [r for r in results if r.workload == workload]
    by_label = {r.system: r.tok_s for r in rows}
    hf, ls = by_label.get(systems.HF_STATIC), by_label.get(systems.LS_FP32)
    entries = [(r.system, r.tok_s, fmt(None if r.error else r.tokens, 0), fmt(None if r.error else r.seconds, 2),
                _row_status(r)) for r in rows]
    table = [[label, fmt(tok_s), tokens, secs, fmt(ratio(tok_s, hf), 2), fmt(ratio(tok_s, ls), 2), status]
             for label, tok_s, tokens, secs, status in entries]
    header = ["System", "tok/s", "tokens", "wall s", f"vs {systems.HF_STATIC}", f"vs {systems.LS_FP32}", "note"]
    return markdown_table(header, table)


def sweep_section(results: list[Result], plan: Plan) -> str:
    names = (systems.HF_STATIC, systems.LS_FP32, systems.LS_BF16)
    cell = {(r.workload, r.system): r for r in results if r.workload.startswith("c:")}
    table = []
    for batch in plan.batch_sizes:
        row = [str(batch)]
        for name in names:
            r = cell.get((f"c:{batch}", name))
            row += ["error", "error"] if r is None or r.error else [fmt(r.tok_s), fmt(r.extra["ms_per_token"])]
        table.append(row)
    header = ["batch"] + [f"{name} {unit}" for name in names for unit in ("tok/s", "ms/token")]
    return markdown_table(header, table)


def decode_section(results: list[Result]) -> str:
    rows = [r for r in results if r.workload == "d"]
    ms = {r.system: (None if r.error else r.extra["ms_per_token"]) for r in rows}
    hf, ls = ms.get("HF generate"), ms.get(systems.LS_FP32)
    entries = [(r.system, ms[r.system], _row_status(r)) for r in rows]
    # Speed-up = reference ms / system ms, so > 1 means faster, like the throughput ratios.
    table = [[label, fmt(v, 2), fmt(ratio(1000, v)), fmt(ratio(hf, v), 2), fmt(ratio(ls, v), 2), status]
             for label, v, status in entries]
    header = ["System", "ms/token", "tok/s", "speed-up vs HF generate", f"speed-up vs {systems.LS_FP32}", "note"]
    return markdown_table(header, table)


def markdown(results: list[Result], plan: Plan, env: dict, quick: bool, plotted: str, others: list[str], peer: str,
             command: str) -> str:
    """plotted: what engine.png shows; others: the file names of the plots written beside engine.json."""
    parts = [
        "# lora-serve engine benchmark: SmolLM2-135M-Instruct on CPU",
        "> **Quick smoke run** (`--quick`): tiny workloads, numbers only show the pipeline works." if quick else "",
        f"Command: `{command}`  \nDate: {env['date']}  \nCPU: {env['cpu']} ({env['cpu_count']} cores visible); "
        f"torch {env['torch']} with {env['torch_threads']} threads; OpenMP: {env['openmp']}; "
        f"transformers {env['transformers']}; Python {env['python']}",
        "Method: greedy decoding, EOS ignored, every request gets exactly its requested number of new tokens "
        "(HF `generate` via `min_new_tokens`, HF continuous batching via `eos_token_id=-1`, lora-serve via "
        "`ignore_eos`). Throughput = requested new tokens / wall time of the whole workload (static batching decodes "
        "each batch to its longest request; the extra tokens are not counted). Each system runs a short warm-up "
        "first. HF models run in fp32 with SDPA attention. HF continuous batching: `generate_batch` for uniform "
        "workloads, its `continuous_batching_context_manager` with per-request `max_new_tokens` for (b); KV cache "
        "sized explicitly (page 32 tokens), `max_batch_tokens` 4096 like lora-serve's token budget; its timed call "
        "includes its own per-call setup (cache allocation, worker thread), as `generate_batch` does. The "
        "one-at-a-time course loops run on the first requests only where noted: prompts cycle every 16 requests "
        "and lengths every 8, so in the full run the first 16 requests are one full cycle of the workload and "
        "their one-at-a-time rate (tok/s) is the rate of the whole workload.",
        f"## (a) {plan.uniform_requests} requests x {plan.uniform_tokens} new tokens, max batch "
        f"{plan.uniform_requests}",
        throughput_section(results, "a"),
        f"## (b) Mixed lengths: {plan.mixed_requests} requests, every 8th wants {plan.mixed_long} new tokens, the "
        f"rest {plan.mixed_short}; max batch {plan.mixed_requests}",
        throughput_section(results, "b"),
        f"## (c) Throughput and per-token latency vs batch size ({plan.sweep_tokens} new tokens per request)",
        "ms/token = wall time of the batch / decode steps: the time between two tokens as each request sees it.",
        sweep_section(results, plan),
        f"## (d) Single-stream decode, one request x {plan.stream_tokens} new tokens",
        "ms/token = (latency - time to first token) / (new tokens - 1).",
        decode_section(results),
        peer,
        f"## Plot: {plotted}",
        "![engine](engine.png)",
        f"The other plots ({', '.join(others)}) are written beside engine.json.",
    ]
    return "\n\n".join(p for p in parts if p) + "\n"
