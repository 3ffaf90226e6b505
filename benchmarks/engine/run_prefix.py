"""Prefix caching and chunked prefill on SmolLM2 (bf16).

    PYTHONPATH=. python -m benchmarks prefix            # full run
    PYTHONPATH=. python -m benchmarks prefix --quick    # smoke test

1. 64 chat requests that share a ~300-token system prompt, each with its own question, 32 new tokens:
   time to first token and throughput with prefix caching on and off, and the hit rate; once as a
   burst (all 64 at once) and once with Poisson arrivals (through AsyncEngine).
2. One ~2,000-token prompt arriving while 16 streams decode: the streams' worst gap between two
   tokens, with the whole prompt prefilled in one step and with a 256-token step budget (chunked).
Writes prefix.md and prefix.png to benchmarks/results/KIND/ and prefix.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import benchmark_args, environment, fmt, markdown_table, save_results  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402
from engine import LLM, AsyncEngine, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

SYSTEM = ("You are the support assistant of Northwind Outfitters, a shop for hiking, camping and climbing gear. "
          "Answer in a friendly, concise way. Policies: orders over 50 euros ship free within the EU; standard "
          "delivery takes three to five working days, express delivery one to two; returns are accepted within "
          "30 days if the item is unused and in its original packaging; sale items can be exchanged but not "
          "refunded; boots and tents carry a two-year warranty against manufacturing defects; the rental service "
          "offers tents, sleeping bags and stoves by the week, with a deposit of 100 euros; gift cards never expire. "
          "Opening hours: Monday to Saturday, nine to seven; closed on Sundays and public holidays. The flagship "
          "store is at 12 Harbour Street; the outlet is near the train station. Never invent prices; if a "
          "customer asks for one you do not know, point them to the website. If a question is not about the shop, "
          "politely say that you can only help with questions about Northwind Outfitters, its products, orders, "
          "deliveries, returns, rentals and stores. Loyalty members collect one point per euro spent and get a "
          "voucher of ten euros for every 200 points; points expire after two years. Repairs of zips, seams and "
          "boot soles are done in the flagship store's workshop and take about a week. Always end by asking "
          "whether there is anything else you can do.")


def chat_prompts(tokenizer, n: int) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (#{i})"}],
                                              tokenize=False, add_generation_prompt=True) for i in range(n)]


def burst(path: Path, caching: bool, n: int, tokens: int) -> dict:
    llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=caching, log_stats=False)
    prompts = chat_prompts(llm.tokenizer, n)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up (and, on, a cached prefix)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return _summary([o.ttft for o in outs], n * tokens / seconds, llm.engine.stats())


async def _poisson_run(engine: AsyncEngine, prompts: list[str], rate: float, tokens: int) -> list[float]:
    rng = random.Random(0)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def one(i: int, delay: float) -> float:
        await asyncio.sleep(delay)
        start = time.perf_counter()
        first = None
        async for _ in engine.generate(f"p{i}", prompts[i], params):
            first = first or time.perf_counter() - start
        return first

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    return await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))


def poisson(path: Path, caching: bool, n: int, tokens: int, rate: float) -> dict:
    engine = AsyncEngine(model=str(path), dtype="bfloat16", enable_prefix_caching=caching, log_stats=False)
    try:
        prompts = chat_prompts(engine.engine.tokenizer, n)
        start = time.perf_counter()
        ttfts = asyncio.run(_poisson_run(engine, prompts, rate, tokens))
        seconds = time.perf_counter() - start
        return _summary(ttfts, n * tokens / seconds, engine.stats())
    finally:
        engine.shutdown()


def _summary(ttfts: list[float], tok_s: float, stats) -> dict:
    ordered = sorted(ttfts)
    return {"ttft_mean_ms": statistics.fmean(ttfts) * 1e3, "ttft_p50_ms": ordered[len(ordered) // 2] * 1e3,
            "ttft_p90_ms": ordered[int(len(ordered) * 0.9)] * 1e3, "tok_s": tok_s,
            "hit_rate": stats.prefix_cache_hit_rate, "hit_tokens": stats.prefix_cache_hit_tokens,
            "queried_tokens": stats.prefix_cache_queried_tokens}


def chunked(path: Path, budget: int, streams: int, stream_tokens: int, long_tokens: int) -> dict:
    """Worst inter-token gap of `streams` decoding streams while a `long_tokens` prompt is prefilled."""
    engine = AsyncEngine(model=str(path), dtype="bfloat16", max_num_batched_tokens=budget,
                         enable_prefix_caching=False, log_stats=False)
    words = " ".join(PROMPTS * 40).split()
    long_prompt = engine.engine.tokenizer.decode(engine.engine.tokenizer(" ".join(words))["input_ids"][:long_tokens])

    async def run():
        stamps: dict[str, list[float]] = {}
        params = SamplingParams(max_tokens=stream_tokens, temperature=0, ignore_eos=True)

        async def stream(i):
            stamps[i] = []
            async for _ in engine.generate(f"s{i}", PROMPTS[i % len(PROMPTS)], params):
                stamps[i].append(time.perf_counter())

        async def long_request():
            while min((len(s) for s in stamps.values()), default=0) < stream_tokens // 4:
                await asyncio.sleep(0.01)
            start = time.perf_counter()
            async for out in engine.generate("long", long_prompt, SamplingParams(max_tokens=1)):
                pass
            return start, time.perf_counter() - start

        *_, (arrival, long_ttft) = await asyncio.gather(*(stream(i) for i in range(streams)), long_request())
        return stamps, arrival, long_ttft

    try:
        stamps, arrival, long_ttft = asyncio.run(run())
    finally:
        engine.shutdown()
    gaps = [b - a for s in stamps.values() for a, b in zip(s, s[1:])]
    during = [b - a for s in stamps.values() for a, b in zip(s, s[1:]) if b >= arrival and a <= arrival + long_ttft]
    return {"budget": budget, "worst_gap_ms": max(gaps) * 1e3, "median_gap_ms": statistics.median(gaps) * 1e3,
            "worst_gap_during_prefill_ms": max(during) * 1e3 if during else None, "long_ttft_ms": long_ttft * 1e3}


def markdown(raw: dict) -> str:
    env = raw["environment"]
    rows = []
    for mode, label in (("burst", "burst (all at once)"), ("poisson", f"Poisson {raw['rate']} req/s")):
        on, off = raw[mode]["on"], raw[mode]["off"]
        for name, r in (("off", off), ("on", on)):
            rows.append([label, name, fmt(r["ttft_mean_ms"]), fmt(r["ttft_p50_ms"]), fmt(r["ttft_p90_ms"]),
                         fmt(r["tok_s"]), f"{r['hit_rate']:.0%}"])
        rows.append([label, "on vs off", f"{off['ttft_mean_ms'] / on['ttft_mean_ms']:.1f}x lower",
                     f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower", "", f"{on['tok_s'] / off['tok_s']:.2f}x",
                     ""])
    chunk_rows = [["whole prompt in one step" if r["budget"] >= raw["long_tokens"] else f"chunks of {r['budget']}",
                   fmt(r["worst_gap_during_prefill_ms"]), fmt(r["worst_gap_ms"]), fmt(r["median_gap_ms"]),
                   fmt(r["long_ttft_ms"])] for r in raw["chunked"]]
    return "\n".join([
        "# Prefix caching and chunked prefill", "",
        f"{env['date']}, {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}; "
        f"mode: {raw['mode']}; SmolLM2-135M-Instruct, bf16.", "",
        f"## {raw['requests']} chat requests sharing a {raw['system_tokens']}-token system prompt", "",
        f"Each request: the system prompt, its own question, {raw['new_tokens']} new tokens (EOS ignored). Caching off "
        "and on run in fresh engines; a warm-up request precedes the burst. Hit rate: prompt tokens read from cached "
        "blocks / prompt tokens of admitted requests.", "",
        markdown_table(["arrivals", "prefix caching", "TTFT mean ms", "TTFT p50 ms", "TTFT p90 ms", "tok/s",
                        "hit rate"], rows), "",
        f"## One {raw['long_tokens']}-token prompt arriving while {raw['streams']} streams decode", "",
        "Gaps between consecutive tokens of the decoding streams; \"during prefill\": gaps that overlap the long "
        "prompt's prefill.", "",
        markdown_table(["prefill", "worst gap during prefill ms", "worst gap ms", "median gap ms",
                        "long prompt TTFT ms"], chunk_rows), "",
        "![prefix](prefix.png)", ""])


def plot(raw: dict):
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    modes = ["burst", "poisson"]
    x = range(len(modes))
    left.bar([i - 0.2 for i in x], [raw[m]["off"]["ttft_mean_ms"] for m in modes], 0.4, label="caching off")
    left.bar([i + 0.2 for i in x], [raw[m]["on"]["ttft_mean_ms"] for m in modes], 0.4, label="caching on")
    left.set_xticks(list(x), ["burst", f"Poisson {raw['rate']} req/s"])
    left.set_ylabel("mean time to first token (ms)")
    left.legend(fontsize=8)
    left.set_title(f"{raw['requests']} requests, shared {raw['system_tokens']}-token system prompt", fontsize=10)
    labels = [f"budget {r['budget']}" for r in raw["chunked"]]
    right.bar(labels, [r["worst_gap_during_prefill_ms"] or 0 for r in raw["chunked"]], color="#a73")
    right.set_ylabel("streams' worst inter-token gap during the prefill (ms)")
    right.set_title(f"{raw['long_tokens']}-token prompt vs {raw['streams']} decoding streams", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "16 requests, 8 tokens, a 500-token long prompt", argv)
    torch.set_num_threads(2)
    path = resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")
    n, tokens, rate, long_tokens, streams, stream_tokens = ((16, 8, 4.0, 500, 4, 24) if args.quick
                                                            else (64, 32, 4.0, 2000, 16, 96))
    raw = {"mode": "quick" if args.quick else "full", "environment": environment(), "requests": n,
           "new_tokens": tokens, "rate": rate, "long_tokens": long_tokens, "streams": streams}
    steps = [("burst", c) for c in (False, True)] + [("poisson", c) for c in (False, True)]
    for mode, caching in tqdm(steps, desc="prefix caching", unit="run"):
        result = burst(path, caching, n, tokens) if mode == "burst" else poisson(path, caching, n, tokens, rate)
        raw.setdefault(mode, {})["on" if caching else "off"] = result
    raw["chunked"] = [chunked(path, budget, streams, stream_tokens, long_tokens)
                      for budget in tqdm((4096, 512, 256, 128), desc="chunked prefill", unit="run")]
    from transformers import AutoTokenizer

    raw["system_tokens"] = len(AutoTokenizer.from_pretrained(path)(SYSTEM)["input_ids"])
    save_results(args.folders, "prefix", raw, plot, markdown(raw))


if __name__ == "__main__":
    main()
