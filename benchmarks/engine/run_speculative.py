"""Speculative decoding (n-gram prompt lookup) against decoding one token a step, on SmolLM2 (bf16).

    PYTHONPATH=. python -m benchmarks speculative --vllm-python ~/vllm-venv/bin/python   # full run
    PYTHONPATH=. python -m benchmarks speculative --quick                                # smoke test

Run it on Intel's OpenMP, as replicas run (docs/usage.md): LD_PRELOAD=.../libiomp5.so KMP_BLOCKTIME=0.

Three workloads of chat requests, each at 1, 8 and 32 streams (a batch of that many requests at once; at 1 stream
the requests run one after another), greedy, up to 96 new tokens:
- extraction: quote the sentence of a passage that answers a question (the answer quotes the prompt);
- editing: rewrite a paragraph with one word changed (the answer repeats the prompt);
- pirate chat: the shipped pirate adapter answering questions (drafts come only from its own words).
The same engine options run with `speculative_method` off and `ngram`, in two engines, rounds interleaved; the
requests whose outputs are the same with and without speculation are counted. Reported: generated tokens/s, the speed-up, the share of draft tokens accepted,
and the mean accepted length per draft. With --vllm-python, vLLM's CPU build runs the base model's cases in each
round too, off and with its own n-gram speculation (it refuses LoRA with speculative decoding).
Writes speculative.md and speculative.png to benchmarks/results/KIND/ and speculative.json to benchmarks/runs/KIND/.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (  # noqa: E402
    benchmark_args,
    environment,
    fmt,
    markdown_table,
    report_header,
    save_results,
)
from benchmarks.peers.vllm_env import NOT_INSTALLED, describe_openmp, vllm_env, vllm_python  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

ADAPTERS = Path(__file__).resolve().parents[2] / "examples" / "adapters"
PASSAGES = [
    "The lighthouse on Gull Point was built in 1874 and stands 31 metres tall. Its lamp can be seen from 40 "
    "kilometres away on a clear night. The last keeper left in 1991, when the light was automated. Visitors may "
    "climb the 164 steps to the gallery every Saturday from May to September.",
    "Our bakery opens at seven every weekday and at eight on Saturdays. Sourdough loaves come out of the oven at "
    "ten, and rye bread at noon. We close on Sundays and on public holidays. Orders for birthday cakes need two "
    "days of notice and a deposit of ten euros.",
    "The river Aln rises in the Cheviot Hills and flows east for 38 kilometres to the North Sea. Salmon and sea "
    "trout run up it in autumn. The town of Alnmouth lies at its mouth, and a railway viaduct crosses it near "
    "Lesbury. Its valley was a route for drovers taking cattle south.",
    "The committee meets on the first Tuesday of every month in room 4B. Minutes are circulated within a week of "
    "each meeting. Proposals must reach the secretary ten days before the meeting to be put on the agenda. A "
    "quorum is five members, one of whom must be the chair or the treasurer.",
]
QUESTIONS = ["When was it built or when does it open?", "What happens in autumn or at ten?",
             "What is the rule about notice?", "How many of something are there?"]
EDITS = [("Saturday", "Sunday"), ("ten", "eleven"), ("east", "west"), ("Tuesday", "Wednesday")]
PIRATE = ["Tell me about your ship.", "What do you eat at sea?", "Where is the treasure buried?",
          "How do you find your way without a map?", "What is your favourite song?", "Who is your first mate?",
          "What do you do in a storm?", "Why do you wear an eye patch?"]


def requests(tokenizer, workload: str, n: int) -> list[tuple[str, str | None]]:
    """n chat prompts of a workload, each with its adapter (None: the base model)."""
    chats = []
    for i in range(n):
        passage = PASSAGES[i % len(PASSAGES)]
        if workload == "extraction":
            chats.append((f"{passage}\n\nQuote, word for word, the sentence of this text that answers: "
                          f"{QUESTIONS[(i // len(PASSAGES)) % len(QUESTIONS)]}", None))
        elif workload == "editing":
            old, new = EDITS[i % len(EDITS)]
            chats.append((f"Rewrite this text exactly, changing only '{old}' to '{new}':\n\n{passage}", None))
        else:
            chats.append((PIRATE[i % len(PIRATE)], "pirate"))
    return [(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), adapter) for text, adapter in chats]


def engine(path: Path, speculative: bool, max_num_seqs: int) -> LLM:
    method = "ngram" if speculative else None
    return LLM(str(path), dtype="bfloat16", log_stats=False, kv_cache_bytes=256 << 20, max_num_seqs=max_num_seqs,
               max_loras=1, adapters_root=str(ADAPTERS), speculative_method=method, num_speculative_tokens=4)


def run(llm: LLM, batch: list[tuple[str, str | None]], streams: int, new_tokens: int) -> dict:
    """The batch, `streams` requests at a time: tokens/s, the outputs, and the draft counts it added."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    speculator = llm.engine.speculator
    before = (speculator.stats.drafts, speculator.stats.proposed, speculator.stats.accepted) if speculator else None
    outputs, start = [], time.perf_counter()
    for i in range(0, len(batch), streams):
        part = batch[i:i + streams]
        outs = llm.generate([p for p, _ in part], params, use_tqdm=False, adapters=[a for _, a in part])
        outputs += [o.token_ids for o in outs]
    seconds = time.perf_counter() - start
    result = {"tok_s": sum(map(len, outputs)) / seconds, "outputs": outputs}
    if speculator is not None:
        after = (speculator.stats.drafts, speculator.stats.proposed, speculator.stats.accepted)
        result["drafts"], result["proposed"], result["accepted"] = (b - a for a, b in zip(before, after))
    return result


def measure(engines: dict[bool, LLM], batch, streams: int, new_tokens: int, into: dict) -> None:
    """One round, off then on, into the case's figures, with how many requests' outputs the two runs share."""
    off, on = (run(engines[speculative], batch, streams, new_tokens) for speculative in (False, True))
    into.setdefault("off_tok_s", []).append(off["tok_s"])
    into.setdefault("on_tok_s", []).append(on["tok_s"])
    into.setdefault("same_outputs", []).append(sum(a == b for a, b in zip(off["outputs"], on["outputs"])))
    into["requests"] = len(batch)
    for key in ("drafts", "proposed", "accepted"):
        into[key] = into.get(key, 0) + on[key]


def vllm_round(python: Path, model: Path, cases: dict, new_tokens: int, folder: Path, results: dict) -> None:
    """vLLM off, then with its n-gram speculation, over the base model's cases (it refuses LoRA with
    speculation), each setting in a process of its own; figures added to each case's."""
    jobs = [{"key": key, "prompts": [p for p, _ in batch], "streams": streams, "max_tokens": new_tokens}
            for key, (batch, streams) in cases.items() if all(a is None for _, a in batch)]
    jobs_path = folder / "speculative_vllm_jobs.json"
    worker = Path(__file__).parents[1] / "peers" / "vllm_speculative.py"
    jobs_path.write_text(json.dumps(jobs))
    for method in ("off", "ngram"):
        out = folder / f"speculative_vllm_{method}.json"
        with open(folder / f"speculative_vllm_{method}.log", "a") as log:
            subprocess.run([str(python), str(worker), str(model), "bfloat16", method, str(jobs_path), str(out)],
                           env=vllm_env(python, 2), stdout=log, stderr=subprocess.STDOUT, check=True, timeout=1800)
        for key, figures in json.loads(out.read_text()).items():
            vllm = results[key].setdefault("vllm", {})
            vllm.setdefault(f"{method}_tok_s", []).append(figures["tok_s"])
            if method == "ngram" and figures["proposed"]:
                vllm["acceptance"] = figures["accepted"] / figures["proposed"]


def _median_ratio(on: list[float], off: list[float]) -> float:
    return statistics.median(on) / statistics.median(off)


def _vllm_cell(vllm: dict | None) -> str:
    """vLLM's n-gram tokens/s, and its speed-up over its own off."""
    if vllm is None:
        return "not measured"
    on, off = vllm["ngram_tok_s"], vllm["off_tok_s"]
    return f"{fmt(statistics.median(on))} ({_median_ratio(on, off):.2f}x its own off)"


def markdown(raw: dict) -> str:
    rows = []
    for key, r in raw["results"].items():
        workload, streams = key.rsplit("@", 1)
        peer = "refuses LoRA with speculation" if workload == "pirate" else _vllm_cell(r.get("vllm"))
        rows.append([workload, streams, fmt(statistics.median(r["off_tok_s"])), fmt(statistics.median(r["on_tok_s"])),
                     f"{_median_ratio(r['on_tok_s'], r['off_tok_s']):.2f}x",
                     f"{r['accepted'] / r['proposed']:.0%}" if r["proposed"] else "-",
                     fmt(r["accepted"] / r["drafts"], 2) if r["drafts"] else "-",
                     f"{min(r['same_outputs'])}/{r['requests']}", peer])
    return "\n".join([
        *report_header("Speculative decoding: n-gram prompt lookup", raw["command"], raw["environment"]),
        f"SmolLM2-135M-Instruct, bf16, on {raw['environment']['openmp']}; greedy, up to {raw['new_tokens']} new "
        f"tokens; {raw['rounds']} rounds, "
        "speculation off and on interleaved, medians. Same output: the requests whose tokens equal those without "
        "speculation (the fewest over the rounds). bf16 is not batch-invariant: the same requests run alone and in a "
        "batch of 8 differ too, as in vLLM, where a near-tie resolves apart; in float32 the outputs are token for "
        "token (tests/test_speculative.py). "
        "Accepted: the share of draft tokens the model agreed with; mean accepted: draft tokens accepted per draft, "
        "the tokens a draft's step yields beyond a plain decode. vLLM: its CPU build in the same run, with its "
        f"n-gram speculation at the same draft length and n-gram sizes ({raw['vllm']}).", "",
        markdown_table(["workload", "streams", "off tok/s", "ngram tok/s", "speed-up", "accepted", "mean accepted",
                        "same output", "vLLM ngram tok/s"], rows), ""])


def plot(raw: dict):
    fig, ax = plt.subplots(figsize=(8, 4))
    keys = list(raw["results"])
    speedups = [_median_ratio(raw["results"][k]["on_tok_s"], raw["results"][k]["off_tok_s"]) for k in keys]
    ax.bar(range(len(keys)), speedups, color=["#37a" if s >= 1 else "#a73" for s in speedups])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)), [k.replace("@", "\n") + " streams" for k in keys], fontsize=7)
    ax.set_ylabel("tokens/s, ngram over off")
    ax.set_title("Speculative decoding on SmolLM2 (bf16)", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "1 and 8 streams, 2 workloads, 48 tokens, 1 round", argv, add_arguments=lambda p: (
        p.add_argument("--vllm-python", default=None, help="vLLM's venv python (default $VLLM_PYTHON; none: "
                                                           "lora-serve alone)")))
    torch.set_num_threads(2)
    path = resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")
    python = vllm_python(args.vllm_python)
    workloads, stream_counts, new_tokens, rounds = ((("extraction", "pirate"), (1, 8), 48, 1) if args.quick else
                                                    (("extraction", "editing", "pirate"), (1, 8, 32), 96, 2))
    engines = {speculative: engine(path, speculative, max(stream_counts)) for speculative in (False, True)}
    cases = {f"{w}@{s}": (requests(engines[False].tokenizer, w, max(4, s)), s) for w in workloads
             for s in stream_counts}
    for llm in engines.values():  # warm-up
        llm.generate([cases[next(iter(cases))][0][0][0]], SamplingParams(max_tokens=4), use_tqdm=False)
    raw = {"command": args.command, "environment": environment(), "new_tokens": new_tokens, "rounds": rounds,
           "results": {key: {} for key in cases}, "vllm": NOT_INSTALLED if python is None else "vLLM measured"}
    args.folders.raw.mkdir(parents=True, exist_ok=True)
    with tqdm(total=rounds * (len(cases) + (python is not None)), desc="speculative", unit="case") as bar:
        for _ in range(rounds):
            for key, (batch, streams) in cases.items():
                measure(engines, batch, streams, new_tokens, raw["results"][key])
                bar.update()
            if python is not None:
                vllm_round(python, path, cases, new_tokens, args.folders.raw, raw["results"])
                bar.update()
    if python is not None:
        raw["vllm"] = describe_openmp(vllm_env(python, 2))
    save_results(args.folders, "speculative", raw, plot, markdown(raw))


if __name__ == "__main__":
    main()
