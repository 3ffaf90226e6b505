"""Multi-LoRA benchmark, part 3: time to first token for a cold adapter and for a warm slot switch."""

from __future__ import annotations

import statistics
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.common import fmt, markdown_table, timed
from benchmarks.lora.lora_setup import LoraPlan, make_llm, source_reads
from benchmarks.workloads import PROMPTS
from engine import LLM, SamplingParams


def first_token(llm: LLM, adapter: str | None) -> dict:
    """One request, one new token: wall time of the generate call (= call to first token) and the engine's ttft."""
    outputs, seconds = timed(llm.generate, [PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0),
                             use_tqdm=False, adapters=[adapter])
    return {"call_ms": seconds * 1000, "ttft_ms": outputs[0].ttft * 1000}


def cold_load(root: Path, ids: dict[str, list[str]], plan: LoraPlan, bar) -> dict:
    """Never-loaded adapter (fresh id each time) vs a resident adapter vs base; fp32. The order of the three
    rotates every round, so none of them always runs right after a cold load."""
    max_loras = len(ids["cold"]) + 2
    llm = make_llm("float32", root, max_loras)
    resident, (warm_cold, *cold) = ids["lora"][0], ids["cold"]
    for adapter in (None, resident, warm_cold):
        first_token(llm, adapter)
    samples = {"cold": [], "resident": [], "base": []}
    cache = llm.engine.adapters
    for i, cold_id in enumerate(cold):
        cases = [("cold", cold_id), ("resident", resident), ("base", None)]
        for case, adapter in cases[i % 3:] + cases[:i % 3]:
            before = source_reads(cache)
            samples[case].append(first_token(llm, adapter))
            if case == "cold" and source_reads(cache) != before + 1:
                raise RuntimeError(f"cold adapter {adapter!r} was not read from its source")
        bar.update(1)
    return {"samples": samples, "median": _medians(samples), "max_loras": max_loras,
            "source_reads": source_reads(cache), "slot_loads": llm.engine.adapter_slots.loads,
            "components": components(llm, root, resident, 10)}


def warm_switch(root: Path, ids: dict[str, list[str]], plan: LoraPlan, bar) -> dict:
    """max_loras=2, 4 adapters already in the CPU tier: cycling over them needs a slot reload every request.
    Each switch is followed by a second request for the same (now resident) adapter."""
    llm = make_llm("float32", root, 2)
    four = ids["lora"][:4]
    for adapter in four:  # into the CPU tier once (and through the slots)
        first_token(llm, adapter)
    cache, slots = llm.engine.adapters, llm.engine.adapter_slots
    reads, loads = source_reads(cache), slots.loads
    samples = {"switch": [], "resident": []}
    for i in range(plan.switch_requests):
        adapter = four[i % 4]
        samples["switch"].append(first_token(llm, adapter))
        samples["resident"].append(first_token(llm, adapter))
        bar.update(1)
    return {"samples": samples, "median": _medians(samples), "source_reads_during": source_reads(cache) - reads,
            "slot_loads_during": slots.loads - loads, "evictions": slots.evictions}


def components(llm: LLM, root: Path, adapter_id: str, repeats: int) -> dict:
    """Direct timings of the two steps a cold request adds: read + validate from disk, copy into a device slot
    (re-copying a resident adapter into its own slot, so the engine's bookkeeping stays true)."""
    cache, slot = llm.engine.adapters, llm.engine.adapter_slots.slot_of[adapter_id]
    read = [timed(cache.reader.read, adapter_id, root / adapter_id)[1] for _ in range(repeats)]
    adapter = cache.get(adapter_id)
    copy = [timed(llm.engine.runner.copy_adapter, slot, adapter)[1] for _ in range(repeats)]
    return {"read_validate_ms": statistics.median(read) * 1000, "slot_copy_ms": statistics.median(copy) * 1000,
            "adapter_mib": adapter.nbytes / 2 ** 20, "repeats": repeats}


def _medians(samples: dict[str, list[dict]]) -> dict:
    return {k: {f: statistics.median(s[f] for s in v) for f in ("call_ms", "ttft_ms")} for k, v in samples.items()}


def latency(root: Path, ids: dict[str, list[str]], plan: LoraPlan) -> dict:
    with tqdm(total=plan.ttft_repeats + plan.switch_requests, desc="cold load / warm switch", unit="item") as bar:
        return {"cold": cold_load(root, ids, plan, bar), "switch": warm_switch(root, ids, plan, bar)}


def latency_section(lat: dict) -> str:
    cold, switch = lat["cold"], lat["switch"]
    entries = [  # label, phase, case, reference case (same engine)
        ("base model (no adapter)", cold, "base", "resident"),
        ("resident adapter (already in a slot)", cold, "resident", "resident"),
        ("cold adapter (never loaded: read + validate + slot copy)", cold, "cold", "resident"),
        ("max_loras=2: resident adapter (same adapter again)", switch, "resident", "resident"),
        ("max_loras=2: warm switch (in CPU tier, slot reload)", switch, "switch", "resident")]
    rows = []
    for label, phase, case, ref in entries:
        m, r = phase["median"][case], phase["median"][ref]
        rows.append([label, fmt(m["call_ms"]), fmt(m["ttft_ms"]), fmt(m["call_ms"] - r["call_ms"]),
                     str(len(phase["samples"][case]))])
    header = ["request", "call -> first token ms", "engine ttft ms", "extra vs resident (same engine) ms",
              "samples"]
    note = ("Method: fp32, one request (the first workload prompt, 7 tokens) with max_tokens=1, medians. "
            "\"call -> first token\" is the wall time of `generate` (the request ends at its first token); "
            "\"engine ttft\" is `out.ttft`, which starts when the request enters the engine, i.e. after "
            "`prepare_request` has already read a cold adapter from disk, so it includes the slot copy but not "
            f"the read. Cold (engine with max_loras={lat['cold']['max_loras']}): a fresh adapter id each time (the "
            "files were just written, so they come from the OS page cache), interleaved with a resident-adapter and "
            "a base request in rotating order. Warm switch (engine with max_loras=2): 4 adapters already in the CPU "
            "tier, cycled one request at a time, each switch followed by a second request for the same, now "
            "resident, adapter.")
    c, sw = cold["components"], switch
    lines = [note, "", markdown_table(header, rows), "",
             f"Components, timed directly (median of {c['repeats']}): reading + validating one adapter "
             f"({c['adapter_mib']:.1f} MiB of fp32 A/B) {c['read_validate_ms']:.1f} ms; copying it into a device "
             f"slot {c['slot_copy_ms']:.2f} ms. The single-request prefill itself varies by several ms between "
             f"calls on this machine, so the TTFT differences above are only meaningful at that scale.",
             "",
             f"Counters: {cold['source_reads']} source reads in the cold engine (warm-ups plus one per cold "
             f"request); during the switch phase {sw['source_reads_during']} source reads and "
             f"{sw['slot_loads_during']} slot loads for {len(sw['samples']['switch'])} switches."]
    return "\n".join(lines)
