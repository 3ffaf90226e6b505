"""Structured output: the cost of JSON-schema masks in a batch of 32, and the grammar libraries compared.

    PYTHONPATH=. python -m benchmarks structured            # full run
    PYTHONPATH=. python -m benchmarks structured --quick    # smoke test

1. Grammar libraries on SmolLM2's 49,152-token vocabulary: time to compile a schema and to compute one
   request's mask, along a real token path through a JSON document; and a batch of 32 masks per step.
   xgrammar and outlines-core are measured when installed (they are not dependencies).
2. The engine (SmolLM2, bf16): 32 requests x 64 tokens, all free, half constrained, all constrained;
   tokens/s per mix (median of rounds, mixes taking turns), and the mask work per step measured inside.

Writes structured.md and structured.png to benchmarks/results/KIND/ and structured.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.common import benchmark_args, environment, fmt, markdown_table, save_results  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.grammar import JSON_LAYOUT  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.sampling import ResponseFormat  # noqa: E402

BATCH = 32
SCHEMA = {"type": "object", "required": ["name", "age", "tags", "address"], "properties": {
    "name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    "address": {"type": "object", "required": ["city", "zip"],
                "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
DOCUMENT = {"name": "Alice", "age": 31, "tags": ["a", "ccc"], "address": {"city": "Paris", "zip": "75001"}}
# At least 64 words: every constrained request runs its full 64 tokens, as the free ones do with ignore_eos.
LONG_SCHEMA = {"type": "object", "required": ["words"], "properties": {
    "words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}}}
PROMPT = "List words about the sea, as JSON."


def _path(tokenizer, document_text: str) -> list[int]:
    return tokenizer(document_text, add_special_tokens=False).input_ids


def _walk(tokens: list[int], fill, consume) -> list[float]:
    """Seconds of fill() at each step of the token path; consume(token) moves on after each."""
    seconds = []
    for token in tokens:
        start = time.perf_counter()
        fill()
        seconds.append(time.perf_counter() - start)
        consume(token)
    return seconds


def _summary(compile_s: float, steps: list[float], batch_steps: list[float] | None) -> dict:
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.median(steps) * 1e6,
            "mask_mean_us": statistics.fmean(steps) * 1e6,
            "batch32_ms": statistics.median(batch_steps) * 1e3 if batch_steps else None}


def _consume_all(matchers, method: str):
    """Feed a token to every matcher; the path is valid JSON for the schema, so each must accept it."""
    def consume(token):
        for m in matchers:
            if getattr(m, method)(token) is False:
                raise AssertionError(f"token {token} refused")
    return consume


def _llguidance(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_LAYOUT)
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    mask = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
    steps = _walk(tokens, lambda: matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4),
                  _consume_all([matcher], "consume_token"))
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    masks = torch.empty(BATCH, mask.shape[1], dtype=torch.int32)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    batch_steps = _walk(tokens, lambda: executor.unsafe_compute_mask_ptr(pairs, masks.data_ptr(), masks.shape[1] * 4,
                                                                         BATCH),
                        _consume_all(matchers, "consume_token"))
    return _summary(compile_s, steps, batch_steps)


def _xgrammar(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - start
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
    steps = _walk(tokens, lambda: matcher.fill_next_token_bitmask(mask, 0), _consume_all([matcher], "accept_token"))
    matchers, masks = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)], xgr.allocate_token_bitmask(BATCH, vocab)
    batch = xgr.BatchGrammarMatcher()
    batch_steps = _walk(tokens, lambda: batch.batch_fill_next_token_bitmask(matchers, masks),
                        _consume_all(matchers, "accept_token"))
    return _summary(compile_s, steps, batch_steps)


def _outlines_core(tokenizer, vocab: int, tokens: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    by_text: dict[str, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i != tokenizer.eos_token_id:
            by_text.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(i)
    start = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(tokenizer.eos_token_id, by_text))
    compile_s = time.perf_counter() - start
    guide, mask = Guide(index), torch.empty((vocab + 31) // 32, dtype=torch.int32)
    steps = _walk(tokens, lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4), guide.advance)
    return _summary(compile_s, steps, None)


LIBRARIES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core}


def libraries(tokenizer, vocab: int) -> dict:
    tokens = _path(tokenizer, json.dumps(DOCUMENT))
    results = {}
    for name, measure in tqdm(LIBRARIES.items(), desc="grammar libraries", unit="lib"):
        if importlib.util.find_spec(name) is None:
            results[name] = {"error": "not installed"}
            continue
        try:
            results[name] = measure(tokenizer, vocab, tokens)
        except Exception as exc:  # a peer that fails is reported, not fatal
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


class MaskTimer:
    """Wall time of the engine's mask fill (on its worker thread) and of the sampler applying the masks."""

    def __init__(self, llm: LLM):
        self.fill, self.apply = [], []
        compiler = llm.engine.grammars
        fill, apply = compiler.fill_masks, Sampler._apply_masks

        def timed_fill(matchers):
            start = time.perf_counter()
            result = fill(matchers)
            self.fill.append(time.perf_counter() - start)
            return result

        def timed_apply(logits, seqs, masks):
            start = time.perf_counter()
            result = apply(logits, seqs, masks)
            self.apply.append(time.perf_counter() - start)
            return result

        compiler.fill_masks = timed_fill
        llm.engine.sampler._apply_masks = timed_apply


def engine_mixes(llm: LLM, rounds: int, tokens: int) -> dict:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                               add_generation_prompt=True)
    free = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=tokens, temperature=0, response_format=ResponseFormat(LONG_SCHEMA))
    mixes = {"all free": [free] * BATCH, "half constrained": [constrained, free] * (BATCH // 2),
             "all constrained": [constrained] * BATCH}
    timer = MaskTimer(llm)
    llm.generate([prompt] * 4, [constrained] * 4, use_tqdm=False)  # warm-up; compiles the schema
    seconds: dict[str, list[float]] = {name: [] for name in mixes}
    fill: dict[str, list[float]] = {name: [] for name in mixes}
    apply: dict[str, list[float]] = {name: [] for name in mixes}
    for _, (name, params) in tqdm([(r, m) for r in range(rounds) for m in mixes.items()], desc="engine mixes",
                                  unit="run"):
        timer.fill.clear()
        timer.apply.clear()
        start = time.perf_counter()
        outs = llm.generate([prompt] * BATCH, params, use_tqdm=False)
        seconds[name].append(time.perf_counter() - start)
        assert all(len(o.token_ids) == tokens for o in outs), [len(o.token_ids) for o in outs]
        fill[name] += timer.fill
        apply[name] += timer.apply
    base = statistics.median(seconds["all free"])
    return {name: {"tok_s": BATCH * tokens / statistics.median(s), "seconds": s,
                   "relative": base / statistics.median(s),
                   "fill_ms": statistics.fmean(fill[name]) * 1e3 if fill[name] else None,
                   "apply_ms": statistics.fmean(apply[name]) * 1e3 if apply[name] else None}
            for name, s in seconds.items()}


def markdown(raw: dict) -> str:
    env = raw["environment"]
    lib_rows = [[name, *(fmt(r.get(k), d) for k, d in (("compile_ms", 1), ("mask_us", 0), ("mask_mean_us", 0),
                                                        ("batch32_ms", 2)))] if "error" not in r
                else [name, r["error"], "-", "-", "-"] for name, r in raw["libraries"].items()]
    mix_rows = [[name, fmt(r["tok_s"]), f"{r['relative']:.0%}", fmt(r["fill_ms"], 2), fmt(r["apply_ms"], 2)]
                for name, r in raw["engine"].items()]
    constrained = raw["engine"]["all constrained"]
    return "\n".join([
        "# Structured output", "",
        f"{env['date']}, {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}; "
        f"mode: {raw['mode']}.", "",
        "## Grammar libraries on SmolLM2's vocabulary", "",
        f"One schema (nested object, enum array, bounded integer, string pattern), a {raw['path_tokens']}-token "
        "path through a JSON document; mask per request-step: median and mean; a batch of 32 masks per step "
        "(parallel where the library offers it).", "",
        markdown_table(["library", "compile ms", "mask us (median)", "mask us (mean)", "batch of 32 ms"], lib_rows),
        "", "## Engine: 32 requests x 64 tokens, SmolLM2 bf16", "",
        "Constrained requests follow a schema of at least 64 words, so they run their full 64 tokens, as the free "
        f"ones do with ignore_eos. Median of {raw['rounds']} rounds, mixes taking turns. Mask fill: llguidance's "
        "parallel executor, before the forward pass (on CPU); apply: the sampler adding the masks to the logits.", "",
        markdown_table(["mix", "tok/s", "of all-free", "mask fill ms/step", "mask apply ms/step"], mix_rows), "",
        f"All constrained: **{constrained['relative']:.0%}** of unconstrained throughput.", "",
        "![structured](structured.png)", ""])


def plot(raw: dict):
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(raw["engine"])
    left.bar(names, [raw["engine"][n]["tok_s"] for n in names], color=["#888", "#59a", "#27a"])
    left.set_ylabel("tokens/s")
    left.set_title("SmolLM2 bf16, batch 32 x 64 tokens", fontsize=10)
    libs = {n: r for n, r in raw["libraries"].items() if "error" not in r}
    right.bar(list(libs), [r["mask_us"] for r in libs.values()], color="#a73")
    right.set_ylabel("mask per request-step, median (us)")
    right.set_title("Grammar libraries, SmolLM2 vocabulary", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "one round of 16 tokens: a smoke test", argv)
    torch.set_num_threads(2)
    path = resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = LLM(str(path), dtype="bfloat16", log_stats=False)
    lib = libraries(tokenizer, llm.engine.vocab_size)
    rounds, tokens = (1, 16) if args.quick else (3, 64)
    raw = {"mode": "quick" if args.quick else "full", "environment": environment(), "rounds": rounds,
           "path_tokens": len(_path(tokenizer, json.dumps(DOCUMENT))),
           "libraries": lib, "engine": engine_mixes(llm, rounds, tokens)}
    save_results(args.folders, "structured", raw, plot, markdown(raw))


if __name__ == "__main__":
    main()
