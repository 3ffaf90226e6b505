"""A mixture of experts on this machine's CPU: tokens/s of a random-weight Qwen3-MoE at 1, 16 and 64 sequences, the
base model, 8 attention adapters and 8 adapters on attention and the experts, against transformers (and vLLM's CPU
build, where it runs the model) in the same run.

    PYTHONPATH=. python -m benchmarks moe                                          # full run
    PYTHONPATH=. python -m benchmarks moe --vllm-python /work/vllm-venv/bin/python # with vLLM
    PYTHONPATH=. python -m benchmarks moe --quick                                  # smoke test

Design: one Qwen3-MoE of a few hundred million parameters with random weights (hidden 768, 12 layers of 32
experts of 384, top 4 renormalized; 12 query and 4 KV heads; SmolLM2's vocabulary), saved once in bf16 so that
every side loads the same weights; 8 rank-8 q,k,v,o adapters of random weights, and 8 more on every layer's
stacked experts too (PEFT's target_parameters, gate/up and down). Each case is N requests of a short prompt and 32
new tokens (EOS ignored), all submitted at once; the adapter cases give request i adapter i mod 8 of their kind.
lora-serve: the offline engine stepped to the end (benchmarks/peers/peer_timing.py), all 16 adapters resident.
transformers: one static batch through `generate` (left-padded, min_new_tokens = max_new_tokens), with PEFT's
mixed-adapter batches (`adapter_names`) for the attention adapters; PEFT refuses mixed batches of expert adapters
(ParamWrapper), so those run one batch per adapter, in turn, as a PEFT user would. vLLM: its worker
(benchmarks/peers/vllm_worker.py), where its CPU build loads the model; its error is reported otherwise. Rounds
interleave the sides, in turn first.

Writes moe.md and moe.png to benchmarks/results/KIND/ and moe.json to benchmarks/runs/KIND/.
"""

from __future__ import annotations

import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import benchmark_args, environment, markdown_table, report_header, save_results  # noqa: E402
from benchmarks.lora_adapters import write_random_adapter  # noqa: E402
from benchmarks.peers.peer_timing import Batch, Timing, VLLMWorker, run_lora_serve  # noqa: E402
from benchmarks.peers.vllm_env import NOT_INSTALLED, vllm_python  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

ADAPTERS = 8  # of each kind
SIDES = ("lora-serve", "transformers", "vLLM")
KINDS = ("base", "attention", "experts")  # the base model; adapters on attention; on attention and the experts


@dataclass(frozen=True)
class Plan:
    sequences: tuple[int, ...]
    new_tokens: int
    rounds: int
    shape: dict  # Qwen3MoeConfig arguments

    @staticmethod
    def of(quick: bool) -> Plan:
        if quick:
            return Plan((1, 4), 4, 1, dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=64, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=128))
        return Plan((1, 16, 64), 32, 3, dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                              num_key_value_heads=4, head_dim=64, num_experts=32,
                                              num_experts_per_tok=4, moe_intermediate_size=384))


def write_model(folder: Path, shape: dict) -> int:
    """The random Qwen3-MoE in bf16, with SmolLM2's tokenizer, in folder; returns its parameter count."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct", default_cache_dir() / "models"))
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), intermediate_size=4 * shape["hidden_size"],
                            norm_topk_prob=True, tie_word_embeddings=True, max_position_embeddings=2048,
                            eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:
                param.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_adapters(model: Path, root: Path) -> dict[str, list[Path]]:
    """The adapters of each kind (attention: "attention-i"; attention and experts: "experts-i")."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return {kind: [write_random_adapter(root / f"{kind}-{i}", config, rank=8, seed=i, experts=kind == "experts")
                   for i in range(ADAPTERS)] for kind in KINDS[1:]}


def batch(sequences: int, new_tokens: int, kind: str) -> Batch:
    names = [None if kind == "base" else f"{kind}-{i % ADAPTERS}" for i in range(sequences)]
    return Batch([PROMPTS[i % len(PROMPTS)] for i in range(sequences)], [new_tokens] * sequences, names)


class HFSide:
    """transformers' generate over a static batch: PEFT's mixed-adapter batches for the attention adapters, a batch
    per adapter for the expert ones (each kind on a PEFT model of its own)."""

    def __init__(self, model: Path, adapters: dict[str, list[Path]]):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
        self.peft = {kind: _peft_model(model, paths) for kind, paths in adapters.items()}

    @torch.inference_mode()
    def run(self, b: Batch) -> Timing:
        start, tokens = time.perf_counter(), 0
        if b.adapters[0] is None:
            with self.peft["attention"].disable_adapter():
                tokens = self._generate(self.peft["attention"], b.prompts, b.max_tokens[0])
        elif b.adapters[0].startswith("attention"):
            tokens = self._generate(self.peft["attention"], b.prompts, b.max_tokens[0], adapter_names=b.adapters)
        else:
            for name in dict.fromkeys(b.adapters):
                self.peft["experts"].set_adapter(name)
                prompts = [p for p, a in zip(b.prompts, b.adapters) if a == name]
                tokens += self._generate(self.peft["experts"], prompts, b.max_tokens[0])
        return Timing(time.perf_counter() - start, tokens)

    def _generate(self, model, prompts: list[str], new: int, **kwargs) -> int:
        inputs = self.tokenizer(prompts, return_tensors="pt", padding=True)
        out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=self.tokenizer.eos_token_id, **kwargs)
        return (out.shape[1] - inputs.input_ids.shape[1]) * len(prompts)


def _peft_model(model: Path, adapters: list[Path]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    peft = PeftModel.from_pretrained(base, adapters[0], adapter_name=adapters[0].name)
    for path in adapters[1:]:
        peft.load_adapter(path, adapter_name=path.name)
    return peft.eval()


def sides(model: Path, adapters: dict[str, list[Path]], plan: Plan, vllm: Path | None,
          log: Path) -> tuple[dict, dict, list]:
    """Each side's runner by (side, kind), why any is missing, and what to close after the run."""
    from engine import LLM
    from lora_cache.local_cache import local_adapters

    llm = LLM(str(model), dtype="bfloat16", adapters=local_adapters, max_loras=2 * ADAPTERS,
              adapters_root=str(adapters["attention"][0].parent), max_num_seqs=max(plan.sequences), log_stats=False)
    hf = HFSide(model, adapters).run
    runners = {(side, kind): run for side, run in (("lora-serve", lambda b: run_lora_serve(llm, b)),
                                                    ("transformers", hf)) for kind in KINDS}
    if vllm is None:
        return runners, {"vLLM": NOT_INSTALLED}, []
    missing, workers = {}, []
    for kind in ("attention", "base"):  # one worker each: vLLM enables LoRA for a whole engine
        name = log.with_name(f"moe_vllm{'_lora' if kind != 'base' else ''}.log")
        side = "vLLM" + " with adapters" * (kind != "base")
        worker, why = _vllm_worker(vllm, model, adapters.get(kind, []), name, max(plan.sequences), kind)
        if worker is None:
            missing[side] = f"{side} not measured: {why}"
        else:
            runners["vLLM", kind] = worker.run
            workers.append(worker)
    return runners, missing, workers


def _vllm_worker(python: Path, model: Path, adapters: list[Path], log: Path, max_num_seqs: int, kind: str):
    """A vLLM worker that has run one warm-up batch, or None and the reason its CPU build gave."""
    worker = None
    try:
        worker = VLLMWorker(python, model, "bfloat16", 512, adapters, log, kv_cache_gib=2, max_num_seqs=max_num_seqs)
        worker.run(batch(2, 2, kind))
        return worker, None
    except RuntimeError as error:
        if worker is not None:
            worker.close()
        return None, f"its CPU build did not run this model ({_root_cause(log) or error}; log: {log.name})."


def _root_cause(log: Path) -> str | None:
    """The first exception the log names other than vLLM's own wrappers of it."""
    for line in log.read_text(errors="replace").splitlines():
        found = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if found and found.group(1) not in ("RuntimeError", "EngineDeadError"):
            return f"{found.group(1)}: {found.group(2).strip()}"
    return None


def measure(runners: dict, plan: Plan) -> dict[tuple[str, int, str], list[float]]:
    """tokens/s per (side, sequences, kind), over interleaved rounds (each round the sides in turn first)."""
    cases = [(n, kind) for n in plan.sequences for kind in KINDS]
    samples = {(side, n, kind): [] for side, kind in runners for n in plan.sequences}
    names = list(dict.fromkeys(side for side, _ in runners))
    for (_, a), run in runners.items():  # warm-up
        run(batch(2, 2, a))
    with tqdm(total=plan.rounds * len(samples), desc="moe") as progress:
        for r in range(plan.rounds):
            for n, a in cases:
                for name in names[r % len(names):] + names[:r % len(names)]:
                    if (name, a) in runners:
                        samples[name, n, a].append(runners[name, a](batch(n, plan.new_tokens, a)).tok_s)
                        progress.update()
    return samples


def figures(samples: dict) -> list[dict]:
    return [{"side": side, "sequences": n, "adapters": kind, "tok_s": statistics.median(v),
             "min": min(v), "max": max(v)} for (side, n, kind), v in samples.items()]


def table(rows: list[dict]) -> str:
    by = {(r["side"], r["sequences"], r["adapters"]): r for r in rows}
    present = [s for s in SIDES if any(r["side"] == s for r in rows)]
    keys = sorted({(r["sequences"], r["adapters"]) for r in rows}, key=lambda k: (k[0], KINDS.index(k[1])))
    header = ["sequences", "adapters"] + [f"{s} tok/s" for s in present] + [f"lora-serve / {s}" for s in present[1:]]
    body = []
    for n, a in keys:
        ours = by["lora-serve", n, a]["tok_s"]
        body.append([str(n), str(a)] + [_cell(by.get((s, n, a))) for s in present]
                    + [f"{ours / by[s, n, a]['tok_s']:.2f}x" if (s, n, a) in by else "-" for s in present[1:]])
    return markdown_table(header, body)


def _cell(row: dict | None) -> str:
    return "-" if row is None else f"{row['tok_s']:.1f} ({row['min']:.1f}-{row['max']:.1f})"


def markdown(rows: list[dict], missing: dict, plan: Plan, params: int, command: str, env: dict, quick: bool) -> str:
    lines = report_header("Mixture of experts on CPU: a random Qwen3-MoE, base and adapters", command, env)
    shape = plan.shape
    model = (f"Model: Qwen3-MoE with random weights, bf16, {params / 1e6:.0f}M parameters: hidden "
             f"{shape['hidden_size']}, {shape['num_hidden_layers']} layers of {shape['num_experts']} experts of "
             f"{shape['moe_intermediate_size']} (top {shape['num_experts_per_tok']}), {shape['num_attention_heads']} "
             f"query and {shape['num_key_value_heads']} KV heads. Each case: N requests of a short prompt and "
             f"{plan.new_tokens} new tokens, all at once; attention: 8 rank-8 q,k,v,o adapters, request i on "
             f"adapter i mod 8; experts: 8 rank-8 adapters on q,k,v,o and every layer's stacked experts (gate/up, "
             f"down), which PEFT runs one adapter's batch at a time (it refuses mixed batches of them). Median "
             f"tokens/s over {plan.rounds} interleaved rounds (min-max in brackets).")
    lines += ["> quick smoke run: not comparable" if quick else "", "", model, "",
              table(rows), ""]
    lines += list(missing.values())
    return "\n".join(lines + ["", "![moe](moe.png)", ""])


def plot(raw: dict):
    rows = raw["figures"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, kind in zip(axes, KINDS):
        for side in SIDES:
            these = sorted((r for r in rows if r["side"] == side and r["adapters"] == kind),
                           key=lambda r: r["sequences"])
            if these:
                ax.plot([r["sequences"] for r in these], [r["tok_s"] for r in these], marker="o", label=side)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences")
        ax.set_ylabel("tokens/s")
        ax.set_title({"base": "base model", "attention": f"{ADAPTERS} attention adapters",
                      "experts": f"{ADAPTERS} adapters on attention and experts"}[kind])
        ax.legend()
    fig.suptitle("Qwen3-MoE (random, bf16) on CPU")
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "a 2-layer model, 1 and 4 sequences, 4 tokens: a smoke run", argv,
                          lambda p: p.add_argument("--vllm-python", default=None, help="vLLM's venv python"))
    plan, env = Plan.of(args.quick), environment()
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        model = Path(tmp) / "model"
        params = write_model(model, plan.shape)
        adapters = write_adapters(model, Path(tmp) / "adapters")
        args.folders.raw.mkdir(parents=True, exist_ok=True)
        runners, missing, workers = sides(model, adapters, plan, vllm_python(args.vllm_python),
                                          args.folders.raw / "moe_vllm.log")
        try:
            samples = measure(runners, plan)
        finally:
            for worker in workers:
                worker.close()
    rows = figures(samples)
    raw = {"environment": env, "plan": plan.__dict__, "figures": rows, "missing": missing, "parameters": params}
    save_results(args.folders, "moe", raw, plot, markdown(rows, missing, plan, params, args.command, env, args.quick))


if __name__ == "__main__":
    main()
