"""Every benchmarked system behind one signature: run(requests, batch_size) -> generated token ids per request,
plus a single-stream decode timer (ms per token) for the systems measured on workload (d)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.engine import course_loops, hf_baselines
from engine import LLM, SamplingParams
from engine.config import default_cache_dir
from engine.model_files import resolve_model

MODEL = "smollm2-135m-instruct"

NO_KV = "course: no KV cache, one at a time"
KV_ONE = "course: KV cache, one at a time"
COURSE_STATIC = "course: static batching (left padding)"
HF_STATIC = "HF generate, static batching"
HF_CB = "HF generate_batch (continuous batching)"
LS_FP32 = "lora-serve fp32"
LS_BF16 = "lora-serve bf16"
SLOW = (NO_KV, KV_ONE)  # run on a subset of the requests
ALL = (NO_KV, KV_ONE, COURSE_STATIC, HF_STATIC, HF_CB, LS_FP32, LS_BF16)


def load_hf(threads: int):
    """The HF fp32 model and a left-padding tokenizer, as the course uses them."""
    torch.set_num_threads(threads)
    path = resolve_model(MODEL, default_cache_dir() / "models")
    tokenizer = course_loops.prepare_tokenizer(AutoTokenizer.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, tokenizer


def lora_serve_run(llm: LLM, requests) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    outputs = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
    return [out.token_ids for out in outputs]


def lora_serve_decode_ms(llm: LLM, prompt: str, new_tokens: int) -> float:
    """(latency - time to first token) / (new_tokens - 1), from the engine's own request timestamps."""
    out = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    return (out.latency - out.ttft) / (len(out.token_ids) - 1) * 1000


def build(threads: int, max_batch: int):
    """(runners, decoders): name -> run(requests, batch_size), name -> decode_ms(prompt, new_tokens)."""
    model, tok = load_hf(threads)
    engines = {name: LLM(MODEL, dtype=dtype, max_num_seqs=max_batch, num_threads=threads)
               for name, dtype in ((LS_FP32, "float32"), (LS_BF16, "bfloat16"))}
    runners = {
        NO_KV: lambda reqs, b: course_loops.generate_no_kv_cache(model, tok, reqs, b),
        KV_ONE: lambda reqs, b: course_loops.generate_kv_cache(model, tok, reqs, b),
        COURSE_STATIC: lambda reqs, b: course_loops.generate_static_batches(model, tok, reqs, b),
        HF_STATIC: lambda reqs, b: hf_baselines.generate_static(model, tok, reqs, b),
        HF_CB: lambda reqs, b: hf_baselines.generate_continuous(model, tok, reqs, b),
        **{name: (lambda reqs, b, llm=llm: lora_serve_run(llm, reqs)) for name, llm in engines.items()},
    }
    decoders = {
        HF_STATIC: lambda prompt, n: hf_baselines.decode_ms_per_token(model, tok, prompt, n),
        **{name: (lambda prompt, n, llm=llm: lora_serve_decode_ms(llm, prompt, n)) for name, llm in engines.items()},
    }
    return runners, decoders
