"""Two figures of the GPU benchmark against the hardware's own bound, each measured in the same run as its
yardstick (the bandwidth section: copy bandwidth and the bf16 matmul rate).

- Decode at many sequences (1B and 8B shapes, `bound_batch` sequences of `bound_prompt` tokens): a decode step must
  read every weight once and every sequence's keys and values; its bound is those bytes over the copy bandwidth.
  The step time is a run of `new` tokens less a run of one token (the same prefill and first token), over new - 1:
  every sequence decodes in each of those steps. Decodes that join the first run's prefill steps count against it,
  so the figure errs low. Each shape runs synchronous (the default) and with async scheduling.
- Prefill (8B shape, `prefill_prompts` prompts of `prefill_len` tokens, max_tokens 1): the FLOPs of the linears (2
  per weight per token; the LM head only for each prompt's last token) and of causal attention (4 x query heads x
  head_dim per visible query-key pair), over the run's time, against the bf16 matmul rate; once per CUDA prefill
  kernel (the cuda_prefill option), so an opt-in kernel is measured against the default in the same run.
"""

from __future__ import annotations

from benchmarks.common import markdown_table, scaled
from benchmarks.gpu.gpu_engine import Bench, guarded, make_llm, run_llm
from benchmarks.gpu.gpu_models import decode_weight_bytes, kv_bytes_per_token, shape
from benchmarks.gpu.gpu_timing import free_device, timed
from engine.config import CUDA_PREFILLS

BOUND_MODELS = ("llama-3.2-1b", "llama-3-8b")
PREFILL_MODEL = "llama-3-8b"
PREFILL_STEP_TOKENS = 16384  # the prefill's token budget a step: 8 prompts of 2,048
STEP_VARIANTS = (("", {}), (", async scheduling", {"async_scheduling": True}))


def decode_at_bound(bench: Bench, model: str, overrides: dict) -> dict:
    plan, config = bench.plan, shape(model, bench.tiny)
    batch, prompt, new = plan.bound_batch, plan.bound_prompt, plan.new
    llm = make_llm(bench, model, max_seqs=batch, max_len=prompt + new + 16, **overrides)
    prompts = bench.prompts(model, batch, prompt)
    run_llm(llm, bench.prompts(model, batch, prompt, seed=99), 4)  # warm-up: every shape compiled and captured
    _, first = timed(bench.device, run_llm, llm, prompts, 1)
    _, whole = timed(bench.device, run_llm, llm, prompts, new)
    del llm
    free_device(bench.device)
    step = (whole - first) / (new - 1)
    weights = decode_weight_bytes(config)
    kv = batch * (prompt + new / 2) * kv_bytes_per_token(config)  # the mean context over the decode steps
    bound = (weights + kv) / bench.bandwidth if bench.bandwidth else None
    return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step, "weight_bytes": weights, "kv_bytes": kv,
            "bound_ms": bound * 1e3 if bound else None, "of_bound": bound / step if bound else None}


def section_decode_bound(bench: Bench) -> dict:
    """Each shape synchronous (the default) and with async scheduling (opt-in until a GPU run verifies it), in the
    same run."""
    return {f"{model}{label}": guarded(f"decode bound {model}{label}", bench.device, decode_at_bound, bench, model,
                                       overrides)
            for model in BOUND_MODELS for label, overrides in STEP_VARIANTS}


def prefill_flops(config: dict, prompts: int, length: int) -> float:
    hidden, layers, heads = config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    linear = layers * (2 * hidden * q + 2 * hidden * kv + 3 * hidden * config["intermediate_size"])
    pairs = length * (length + 1) / 2  # causal: query i sees keys 0..i
    return (2 * linear * length + 4 * layers * heads * head_dim * pairs) * prompts \
        + 2 * config["vocab_size"] * hidden * prompts


def prefill_rate(bench: Bench, kernel: str) -> dict:
    plan = bench.plan
    count, length = plan.prefill_prompts, plan.prefill_len
    llm = make_llm(bench, PREFILL_MODEL, max_seqs=count, max_len=length + 16,
                   max_num_batched_tokens=min(count * length, PREFILL_STEP_TOKENS), cuda_prefill=kernel)
    run_llm(llm, bench.prompts(PREFILL_MODEL, count, length, seed=99), 1)  # warm-up
    _, seconds = timed(bench.device, run_llm, llm, bench.prompts(PREFILL_MODEL, count, length), 1)
    del llm
    free_device(bench.device)
    rate = prefill_flops(shape(PREFILL_MODEL, bench.tiny), count, length) / seconds
    return {"prompts": count, "length": length, "seconds": seconds, "tflop_s": rate / 1e12,
            "of_matmul": rate / bench.matmul_flops if bench.matmul_flops else None}


def section_prefill(bench: Bench) -> dict:
    """The 8B shape's prefill on each CUDA prefill kernel (cuda_prefill: sdpa, the default, then the opt-in ones)."""
    return {f"{PREFILL_MODEL}, {kernel}": guarded(f"prefill {kernel}", bench.device, prefill_rate, bench, kernel)
            for kernel in CUDA_PREFILLS}


BOUND_SECTIONS = (("decode_bound", section_decode_bound), ("prefill", section_prefill))



def bounds_lines(results: dict) -> list[str]:
    """The two sections' tables for gpu.md (none for a section that did not run)."""
    lines = []
    decode = (results.get("decode_bound") or {}).get("figures") or {}
    if decode:
        rows = [[m, r.get("batch"), scaled(r.get("step_ms"), 2), scaled(r.get("tok_s"), 0), scaled(r.get("weight_bytes"), 1, 1e-9),
                 scaled(r.get("kv_bytes"), 1, 1e-9), scaled(r.get("bound_ms"), 2), scaled(r.get("of_bound"), 0, 100, "%"),
                 r.get("error", "")] for m, r in decode.items()]
        lines += ["## Decode at many sequences against its bandwidth bound", "", markdown_table(
            ["shape", "sequences", "step (ms)", "output tok/s", "weights (GB)", "K/V read (GB)", "bound (ms)",
             "% of bound", "error"], rows), ""]
    prefill = (results.get("prefill") or {}).get("figures") or {}
    if prefill:
        rows = [[m, r.get("prompts"), r.get("length"), scaled(r.get("seconds"), 3), scaled(r.get("tflop_s"), 0),
                 scaled(r.get("of_matmul"), 0, 100, "%"), r.get("error", "")] for m, r in prefill.items()]
        lines += ["## Prefill against the bf16 matmul rate", "", markdown_table(
            ["shape", "prompts", "tokens each", "seconds", "TFLOP/s", "% of matmul rate", "error"], rows), ""]
    return lines
