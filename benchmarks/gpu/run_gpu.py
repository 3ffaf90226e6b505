"""lora-serve on a GPU: batch-1 decode against the weight-read bound, throughput against transformers, 32 LoRA
adapters against base, time to first token, and decode steps eager against CUDA graphs, all in one run.

Models are typed-in shapes with random weights (benchmarks/gpu/gpu_models.py): speed depends on shapes, not values.
Every figure is a median after a warm-up, timed between device synchronisations. The weight-read bound of a
batch-1 decode step is the bytes of weights it must read over the copy bandwidth measured in the same run.
Prefix caching is off: the warm-ups and repeats reuse prompts, and a cache hit would time nothing.
Each section runs on its own: one that fails is recorded with its traceback and the rest still run.

    python -m benchmarks gpu --tokenizer DIR [--out DIR] [--quick]       # full run
    python -m benchmarks gpu --device cpu --tiny                          # smoke run of every section

Writes gpu.md and gpu.png (when matplotlib is installed) to benchmarks/results/KIND/, KIND the GPU's model (h100,
h200), and gpu.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results); gpu.md and gpu.json also after
every section, so a run cut short still leaves the figures it has.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import traceback
from dataclasses import fields
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from benchmarks.common import Folders, benchmark_args, environment, markdown_table, scaled, write_raw, write_summary
from benchmarks.engine.hf_baselines import NO_EOS
from benchmarks.gpu.gpu_bounds import BOUND_SECTIONS, bounds_lines
from benchmarks.gpu.gpu_engine import Bench, Plan, decode_ms, error_text, guarded, llm_throughput, make_llm, run_llm
from benchmarks.gpu.gpu_models import build_model_dir, decode_weight_bytes, shape
from benchmarks.gpu.gpu_timing import copy_bandwidth, device_name, free_device, matmul_rate, timed
from benchmarks.lora_adapters import write_random_adapter

DEFAULT_TOKENIZERS = (Path(__file__).parents[2] / ".gpu/cache/models/smollm2-135m-instruct",
                      Path.home() / ".cache/lora-serve/models/smollm2-135m-instruct")


# ---------------------------------------------------------------------------------------------------- HF


def hf_model(bench: Bench, model: str):
    config = transformers.AutoConfig.from_pretrained(bench.models[model])
    with torch.device(bench.device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return hf.eval()


@torch.inference_mode()
def hf_static(model, prompts: list[list[int]], new: int, device: str) -> int:
    """`model.generate` on one batch of equal-length prompts (no padding needed); returns tokens generated."""
    ids = torch.tensor(prompts, device=device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    generated = out.shape[1] - ids.shape[1]
    if generated != new:
        raise RuntimeError(f"HF generate produced {generated} tokens, asked for {new}")
    return ids.shape[0] * new


def hf_continuous(model, prompts: list[list[int]], new: int, page_size: int = 32) -> int:
    """transformers' `generate_batch` (its continuous batching), KV cache sized for every request at once."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingConfig

    pages = -(-(len(prompts[0]) + new) // page_size)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=NO_EOS, pad_token_id=0)
    # transformers renamed block_size to page_size (5.2x); the GPU image's 5.17 knows only the old name
    names = {field.name for field in fields(ContinuousBatchingConfig)}
    page = {"page_size" if "page_size" in names else "block_size": page_size}
    cb = ContinuousBatchingConfig(**page, num_blocks=int(1.25 * len(prompts) * pages) + 4,
                                  max_batch_tokens=max(2048, len(prompts[0])), max_requests_per_batch=len(prompts))
    results = list(model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb).values())
    lengths = [len(r.generated_tokens) for r in results if r.error is None]
    if lengths != [new] * len(prompts):
        raise RuntimeError(f"generate_batch: {len(lengths)}/{len(prompts)} results of lengths {lengths[:4]}...")
    return sum(lengths)


def hf_throughput(bench: Bench, fn, hf, model: str, prompts, new: int) -> dict:
    fn(hf, bench.prompts(model, len(prompts), len(prompts[0]), seed=99), 4)  # warm-up at the same shapes
    tokens, seconds = timed(bench.device, fn, hf, prompts, new)
    return {"tok_s": tokens / seconds, "seconds": seconds}


# ---------------------------------------------------------------------------------------------------- sections


def section_bandwidth(bench: Bench) -> dict:
    """The yardsticks: copy bandwidth (memory-bound figures) and the bf16 matmul rate (prefill)."""
    bench.bandwidth = copy_bandwidth(bench.device, bench.plan.copy_bytes)
    bench.matmul_flops = matmul_rate(bench.device, 8192 if not bench.tiny else 256)
    return {"copy_bandwidth_gb_s": bench.bandwidth / 1e9, "copy_bytes": bench.plan.copy_bytes,
            "matmul_tflop_s": bench.matmul_flops / 1e12}


def decode_one(bench: Bench, model: str, overrides: dict | None = None) -> dict:
    plan = bench.plan
    started = time.perf_counter()  # the engine ready: dummy weights built and drawn, KV allocated, graphs captured
    llm = make_llm(bench, model, max_seqs=4, max_len=plan.decode_prompt + plan.decode_new + 16, **(overrides or {}))
    ready_s = time.perf_counter() - started
    prompt = bench.prompts(model, 1, plan.decode_prompt)
    run_llm(llm, prompt, 8)  # warm-up
    runs = [decode_ms(run_llm(llm, prompt, plan.decode_new)) for _ in range(plan.decode_repeats)]
    del llm
    free_device(bench.device)
    weights = decode_weight_bytes(shape(model, bench.tiny))
    ms = statistics.median(runs)
    bound = weights / bench.bandwidth * 1e3 if bench.bandwidth else None
    return {"ms_per_token": ms, "runs_ms": runs, "weight_bytes": weights, "bound_ms": bound,
            "of_bound": bound / ms if bound else None, "ready_s": ready_s}


UNFUSED = ", eager element-wise ops"  # the decode rows run again with cuda_fused_ops=False: the fusion's gain


def section_decode(bench: Bench) -> dict:
    """Batch-1 decode ms/token of the 1B and 8B shapes, against weight bytes / copy bandwidth; each shape with the
    fused element-wise operators (the default) and with the eager PyTorch ops, in the same run."""
    rows = {}
    for model in ("llama-3.2-1b", "llama-3-8b"):
        rows[model] = guarded(f"decode {model}", bench.device, decode_one, bench, model)
        rows[model + UNFUSED] = guarded(f"decode {model}{UNFUSED}", bench.device, decode_one, bench, model,
                                        {"cuda_fused_ops": False})
    return rows


def lora_serve_throughput(bench: Bench, model: str) -> dict:
    plan = bench.plan
    llm = make_llm(bench, model, max_seqs=max(plan.batches), max_len=plan.prompt + plan.new + 16)
    rows = {f"lora-serve@{batch}": llm_throughput(bench, llm, model, bench.prompts(model, batch, plan.prompt),
                                                  plan.new) for batch in plan.batches}
    del llm
    free_device(bench.device)
    return rows


def hf_baselines(bench: Bench, model: str) -> dict:
    plan, rows = bench.plan, {}
    hf = hf_model(bench, model)

    def static(model_, prompts_, new_):
        return hf_static(model_, prompts_, new_, bench.device)

    for batch in plan.batches:
        prompts = bench.prompts(model, batch, plan.prompt)
        for name, fn in (("HF generate (static)", static), ("HF generate_batch", hf_continuous)):
            rows[f"{name}@{batch}"] = guarded(f"{name} at {batch}", bench.device, hf_throughput, bench, fn, hf,
                                              model, prompts, plan.new)
            free_device(bench.device)
    del hf
    free_device(bench.device)
    return rows


def section_throughput(bench: Bench) -> dict:
    """1B shape, `batches` concurrent sequences, lora-serve."""
    return lora_serve_throughput(bench, "llama-3.2-1b")


def section_hf(bench: Bench) -> dict:
    """The same workloads through HF generate (static batch) and generate_batch; last, as the slowest section."""
    return hf_baselines(bench, "llama-3.2-1b")


def section_lora(bench: Bench) -> dict:
    """Same workload at the largest batch: one distinct adapter per request (round-robin), against base only, on
    the same engine: after a whole untimed run of each, `lora_rounds` timed runs of each, interleaved (base,
    adapters, adapters, base, ...); the median run of each is reported, and every run's throughput."""
    plan, model = bench.plan, "llama-3.2-1b"
    root = bench.work / "adapters"
    config = transformers.AutoConfig.from_pretrained(bench.models[model])
    names = [f"a{i:02d}" for i in range(plan.adapters)]
    for i, name in enumerate(tqdm(names, desc="adapters", leave=False)):
        write_random_adapter(root / name, config, rank=plan.adapter_rank, seed=i)
    batch = max(plan.batches)
    llm = make_llm(bench, model, max_seqs=batch, max_len=plan.prompt + plan.new + 16, max_loras=plan.adapters,
                   max_lora_rank=plan.adapter_rank, adapters_root=str(root))
    prompts = bench.prompts(model, batch, plan.prompt)
    adapters = [names[i % len(names)] for i in range(batch)]
    for warm_up in (None, adapters):  # a whole untimed run of each first: an engine's first run is its slowest
        run_llm(llm, prompts, plan.new, warm_up)
    runs = {"base": [], "lora": []}
    order = ("base", "lora", "lora", "base") * plan.lora_rounds  # ABBA: a drift weighs on both alike
    for kind in order[:2 * plan.lora_rounds]:
        runs[kind].append(llm_throughput(bench, llm, model, prompts, plan.new, adapters if kind == "lora" else None))
    del llm
    free_device(bench.device)
    base, lora = (sorted(runs[kind], key=lambda run: run["tok_s"])[len(runs[kind]) // 2] for kind in runs)
    return {"batch": batch, "adapters": plan.adapters, "rank": plan.adapter_rank, "base": base, "lora": lora,
            "ratio": lora["tok_s"] / base["tok_s"], "runs_tok_s": {k: [r["tok_s"] for r in v] for k, v in runs.items()}}


def section_ttft_graphs(bench: Bench) -> dict:
    """TTFT of one request alone, and decode step time at a few batch sizes, eager against CUDA graphs."""
    plan, model, rows = bench.plan, "llama-3.2-1b", {}
    for eager in (True, False):
        mode = "eager" if eager else "graphs"
        llm = make_llm(bench, model, max_seqs=max(plan.step_batches), max_len=plan.ttft_prompt + plan.step_new + 16,
                       enforce_eager=eager)
        alone = bench.prompts(model, 1, plan.ttft_prompt, seed=1)
        run_llm(llm, alone, 2)
        rows[f"ttft_alone_ms/{mode}"] = statistics.median(
            run_llm(llm, alone, 1)[0].ttft * 1e3 for _ in range(plan.decode_repeats))
        for batch in plan.step_batches:
            prompts = bench.prompts(model, batch, 128 if not bench.tiny else 16, seed=2)
            run_llm(llm, prompts, 4)
            runs = [decode_ms(run_llm(llm, prompts, plan.step_new)) for _ in range(plan.decode_repeats)]
            rows[f"step_ms@{batch}/{mode}"] = statistics.median(runs)
        del llm
        free_device(bench.device)
    return rows


SECTIONS = (("bandwidth", section_bandwidth), ("decode", section_decode), ("throughput", section_throughput),
            *BOUND_SECTIONS, ("lora", section_lora), ("ttft_graphs", section_ttft_graphs),
            ("hf_baselines", section_hf))




def run_sections(bench: Bench, only: set[str] | None, checkpoint) -> dict:
    """Every section in turn; checkpoint(results) after each, so a run cut short still leaves its figures."""
    results = {}
    bar = tqdm([s for s in SECTIONS if not only or s[0] in only], desc="sections", unit="section")
    for name, fn in bar:
        bar.set_postfix_str(name)
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "figures": fn(bench)}
        except Exception as error:  # noqa: BLE001 - record, print and go on: the run must yield every section it can
            tb = traceback.format_exc()
            tqdm.write(f"section {name} failed:\n{tb}")
            results[name] = {"ok": False, "error": error_text(error), "traceback": tb}
            free_device(bench.device)
        results[name]["seconds"] = time.perf_counter() - start
        tqdm.write(f"section {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
                   f"in {results[name]['seconds']:.1f} s")
        checkpoint(results)
    return results


# ---------------------------------------------------------------------------------------------------- report



def _figures(results: dict, name: str) -> dict:
    return results.get(name, {}).get("figures") or {}


def markdown(raw: dict) -> str:
    results, plan = raw["sections"], raw["plan"]
    lines = [f"# lora-serve on {raw['device_name']}", "",
             (f"torch {raw['environment']['torch']}, transformers {raw['environment']['transformers']}, "
              f"bf16, random weights of typed-in shapes, mode {raw['mode']}, {raw['date']}."), ""]
    bw = _figures(results, "bandwidth").get("copy_bandwidth_gb_s")
    rate = _figures(results, "bandwidth").get("matmul_tflop_s")
    lines += [f"Device copy bandwidth (read + write): {scaled(bw, 0)} GB/s; bf16 matmul: {scaled(rate, 0)} TFLOP/s.", ""]
    lines += _decode_section(results) + bounds_lines(results) + _throughput_section(results, plan)
    lines += _lora_section(results)
    lines += _graphs_section(results, plan)
    lines += ["## Sections", "", markdown_table(
        ["section", "status", "seconds"],
        [[n, "ok" if r["ok"] else f"failed: {r['error']}", scaled(r["seconds"], 1)] for n, r in results.items()]), ""]
    return "\n".join(lines)


def _decode_section(results: dict) -> list[str]:
    rows = [[m, scaled(r.get("ms_per_token"), 2), scaled(r.get("weight_bytes"), 2, 1e-9), scaled(r.get("bound_ms"), 2),
             scaled(r.get("of_bound"), 0, 100, "%"), scaled(r.get("ready_s"), 1), r.get("error", "")]
            for m, r in _figures(results, "decode").items()]
    return ["## Batch-1 decode", "", markdown_table(["shape", "ms / token", "weights read (GB)",
                                                     "weight-read bound (ms)", "% of bound", "engine ready (s)",
                                                     "error"], rows),
            "", "Engine ready: from `LLM(...)` to its return: random weights built and drawn on the device, KV "
            "allocated, decode graphs captured.", ""]


def _throughput_section(results: dict, plan: dict) -> list[str]:
    tp = {**_figures(results, "throughput"), **_figures(results, "hf_baselines")}
    rows = []
    for batch in plan["batches"]:
        ls = tp.get(f"lora-serve@{batch}", {}).get("tok_s")
        for system in ("lora-serve", "HF generate (static)", "HF generate_batch"):
            r = tp.get(f"{system}@{batch}", {})
            ratio = ls / r["tok_s"] if ls and r.get("tok_s") else None
            rows.append([batch, system, scaled(r.get("tok_s"), 0), scaled(ratio, 2, suffix="x"),
                         scaled(r.get("ttft_median_ms"), 0), r.get("error", "")])
    return [f"## Throughput, Llama-3.2-1B shape, {plan['prompt']}-token prompts, {plan['new']} new tokens", "",
            markdown_table(["sequences", "system", "output tok/s", "lora-serve / this", "median TTFT (ms)", "error"],
                           rows), ""]


def _lora_section(results: dict) -> list[str]:
    lo = _figures(results, "lora")
    if not lo:
        return []
    return [f"## {lo['adapters']} distinct rank-{lo['rank']} adapters, {lo['batch']} sequences", "",
            markdown_table(["run", "output tok/s", "median TTFT (ms)"],
                           [["base only", scaled(lo["base"]["tok_s"], 0), scaled(lo["base"]["ttft_median_ms"], 0)],
                            [f"{lo['adapters']} adapters", scaled(lo["lora"]["tok_s"], 0),
                             scaled(lo["lora"]["ttft_median_ms"], 0)]]),
            "", f"Adapters keep {scaled(lo['ratio'], 0, 100, '%')} of base throughput (median runs).", ""] + _lora_runs(lo)


def _lora_runs(lo: dict) -> list[str]:
    runs = lo.get("runs_tok_s")
    if not runs:
        return []
    listed = {kind: ", ".join(scaled(v, 0) for v in values) for kind, values in runs.items()}
    return [f"Every run, in tok/s, base: {listed['base']}; adapters: {listed['lora']}.", ""]


def _graphs_section(results: dict, plan: dict) -> list[str]:
    tg = _figures(results, "ttft_graphs")
    if not tg:
        return []
    rows = [[f"TTFT alone, {plan['ttft_prompt']}-token prompt (ms)", scaled(tg.get("ttft_alone_ms/eager"), 1),
             scaled(tg.get("ttft_alone_ms/graphs"), 1), ""]]
    for batch in plan["step_batches"]:
        e, g = tg.get(f"step_ms@{batch}/eager"), tg.get(f"step_ms@{batch}/graphs")
        rows.append([f"decode step, batch {batch} (ms)", scaled(e, 2), scaled(g, 2), scaled(e / g if e and g else None, 2,
                                                                               suffix="x")])
    return ["## TTFT and decode step time, eager against CUDA graphs (Llama-3.2-1B shape)", "",
            markdown_table(["figure", "eager", "CUDA graphs", "speed-up"], rows), ""]


def plot(raw: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, plan = raw["sections"], raw["plan"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    dec = {n: r for n, r in _figures(results, "decode").items() if "error" not in r}
    names = list(dec)
    axes[0].bar([i - 0.2 for i in range(len(names))], [dec[n]["ms_per_token"] for n in names], 0.4, label="lora-serve")
    axes[0].bar([i + 0.2 for i in range(len(names))], [dec[n]["bound_ms"] or 0 for n in names], 0.4,
                label="weight-read bound", color="lightgray")
    axes[0].set_xticks(range(len(names)), names)
    axes[0].set(ylabel="ms / token", title="batch-1 decode")
    axes[0].legend(fontsize=8)
    tp = {**_figures(results, "throughput"), **_figures(results, "hf_baselines")}
    systems = ("lora-serve", "HF generate (static)", "HF generate_batch")
    for j, system in enumerate(systems):
        values = [tp.get(f"{system}@{b}", {}).get("tok_s") or 0 for b in plan["batches"]]
        axes[1].bar([i + (j - 1) * 0.27 for i in range(len(values))], values, 0.27, label=system)
    axes[1].set_xticks(range(len(plan["batches"])), [f"{b} seqs" for b in plan["batches"]])
    axes[1].set(ylabel="output tokens / s", title="throughput, 1B shape")
    axes[1].legend(fontsize=8)
    lo, tg = _figures(results, "lora"), _figures(results, "ttft_graphs")
    if lo:
        axes[2].bar(["base", f"{lo['adapters']} adapters"], [lo["base"]["tok_s"], lo["lora"]["tok_s"]],
                    color=["tab:blue", "tab:orange"])
    axes[2].set(ylabel="output tokens / s", title=f"multi-LoRA against base, {max(plan['batches'])} seqs")
    for j, mode in enumerate(("eager", "graphs")):
        values = [tg.get(f"step_ms@{b}/{mode}") or 0 for b in plan["step_batches"]]
        axes[3].bar([i + (j - 0.5) * 0.4 for i in range(len(values))], values, 0.4, label=mode)
    axes[3].set_xticks(range(len(plan["step_batches"])), [f"batch {b}" for b in plan["step_batches"]])
    axes[3].set(ylabel="ms / decode step", title="decode step: eager vs CUDA graphs")
    axes[3].legend(fontsize=8)
    return fig


def write_text_results(folders: Folders, raw: dict, text: str) -> None:
    write_raw(folders, "gpu", raw)
    write_summary(folders, "gpu", text)


def save(folders: Folders, raw: dict, text: str) -> None:
    """gpu.json and gpu.md always; gpu.png through common.save_results when matplotlib is installed."""
    write_text_results(folders, raw, text)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(text)
        print("matplotlib is not installed: gpu.png skipped (gpu.json and gpu.md written)")
        return
    try:
        from benchmarks.common import save_results

        save_results(folders, "gpu", raw, plot, text)
    except Exception:  # noqa: BLE001 - a plot must not cost the figures
        print(text)
        print(f"gpu.png failed:\n{traceback.format_exc()}")


# ---------------------------------------------------------------------------------------------------- main


def _gpu_arguments(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny configs and workloads: a smoke run (CPU)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with SmolLM2's tokenizer files (default: the first of "
                             + ", ".join(str(p) for p in DEFAULT_TOKENIZERS) + " that exists)")
    parser.add_argument("--work", type=Path, default=None, help="folder for model folders and adapters (temp)")
    parser.add_argument("--sections", default="", help="comma-separated subset of: "
                        + ", ".join(n for n, _ in SECTIONS))


def parse_args(argv):
    return benchmark_args(__doc__, "fewer tokens per request (a shorter GPU run)", argv, _gpu_arguments,
                          device="cuda", quick_is_smoke=False)


def find_tokenizer(given: Path | None) -> Path:
    for folder in ([given] if given else DEFAULT_TOKENIZERS):
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
            return folder
    raise SystemExit(f"no tokenizer folder found ({given or DEFAULT_TOKENIZERS}); pass --tokenizer DIR")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny for a smoke run)")
    tokenizer_dir = find_tokenizer(args.tokenizer)
    work = args.work or Path(tempfile.mkdtemp(prefix="lora-serve-gpu-"))
    plan = Plan.tiny() if args.tiny else Plan.quick() if args.quick else Plan.full()
    names = ("llama-3.2-1b", "llama-3-8b", "smollm2-135m")
    models = {n: build_model_dir(work / "models", n, tokenizer_dir, args.tiny) for n in names}
    tokens = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    limits = {n: min(tokens, shape(n, args.tiny)["vocab_size"]) for n in names}
    bench = Bench(args.device, plan, args.tiny, models, work, limits)
    print(f"device {device_name(args.device)}, torch {torch.__version__}, work folder {work}")
    raw = {"mode": "tiny" if args.tiny else "quick" if args.quick else "full", "device": args.device,
           "device_name": device_name(args.device), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "environment": environment(), "plan": plan.__dict__, "tokenizer": str(tokenizer_dir), "sections": {}}

    def checkpoint(sections: dict) -> None:
        raw.update(sections=sections, total_seconds=time.perf_counter() - started)
        write_text_results(args.folders, raw, markdown(raw))

    run_sections(bench, {s for s in args.sections.split(",") if s} or None, checkpoint)
    raw["total_seconds"] = time.perf_counter() - started
    save(args.folders, raw, markdown(raw))
    print(f"total {raw['total_seconds']:.0f} s; wrote {args.folders.results / 'gpu.md'}, "
          f"{args.folders.raw / 'gpu.json'}")


if __name__ == "__main__":
    main()
