"""Timing a tensor-parallel engine's steps from its driver (rank 0), for benchmarks/engine/run_tp.py.

- `collective_clock`: while it is open, TensorParallel.all_reduce and all_gather (the model's collectives: two
  all-reduces a layer, the embedding's all-reduce, the logits' all-gather) and StepChannel.send (the step's
  broadcast to the workers) are wrapped at class level with perf_counter accumulation. Only this process, rank 0,
  is patched: ranks 1..N-1 are processes of their own, forked from a server that imported the engine unpatched
  (engine/executor/workers.py). No engine code changes; at N = 1 nothing is sharded and the wrappers are never
  called.
- `measure_case`: `batch` requests added at once, then engine.step() one call at a time: the first step prefills
  every prompt (within max_num_batched_tokens: one step), each later one decodes one token of each sequence.
  Each step's wall time, with the collective seconds rank 0 spent inside it and the tokens it ran (the
  executor's `execute` is wrapped on the instance for the count).
- `divisible_model`: a random-weight Llama shaped like SmolLM2-135M (hidden 576, MLP 1536, 30 layers, vocabulary
  49,152, tied embeddings) but with 12 query heads of 48 and 6 KV heads, so that N = 1, 2 and 3 all divide it;
  config.json and SmolLM2's tokenizer in a temporary folder, loaded with load_format="dummy" (no weights file).

Rank 0's time inside a collective is the transfer plus its wait for the slowest rank to reach it: on 2 cores
shared by N workers that wait includes the others' lag, so it is the collectives' cost to a step as rank 0 sees it.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm
from transformers import LlamaConfig

from engine import SamplingParams
from engine.distributed.parallel import TensorParallel
from engine.executor.step_channel import StepChannel

TIMED = {"all_reduce": (TensorParallel, "all_reduce"), "all_gather": (TensorParallel, "all_gather"),
         "broadcast": (StepChannel, "send")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass
class CollectiveClock:
    """Seconds and calls of each timed collective since the clock opened (rank 0's)."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMED, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIMED, 0))

    def snapshot(self) -> tuple[dict[str, float], int]:
        """The seconds so far, and the model's collectives (all-reduces and all-gathers) called so far."""
        return dict(self.seconds), self.calls["all_reduce"] + self.calls["all_gather"]


def _timed(original, clock: CollectiveClock, name: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            clock.seconds[name] += time.perf_counter() - start
            clock.calls[name] += 1
    return wrapper


@contextmanager
def collective_clock():
    """A CollectiveClock over this process's collectives while the block runs; the methods restored after."""
    clock = CollectiveClock()
    originals = {name: getattr(cls, attr) for name, (cls, attr) in TIMED.items()}
    for name, (cls, attr) in TIMED.items():
        setattr(cls, attr, _timed(originals[name], clock, name))
    try:
        yield clock
    finally:
        for name, (cls, attr) in TIMED.items():
            setattr(cls, attr, originals[name])


@dataclass
class StepTime:
    """One engine.step(): its wall seconds, the tokens it ran, and rank 0's seconds in each collective."""
    kind: str  # "prefill" (any prompt token) or "decode"
    tokens: int
    seconds: float
    all_reduce_s: float
    all_gather_s: float
    broadcast_s: float
    collectives: int  # all-reduces and all-gathers rank 0 called in the step

    @property
    def collective_s(self) -> float:
        return self.all_reduce_s + self.all_gather_s


@dataclass
class CaseResult:
    """One case (prefill or decode at a batch) of one engine (model, N): every step of its rounds."""
    model: str
    tp: int
    decoder_stack: bool  # whether the C++ decoder stack ran (N = 1 only); else the modules' path, as every N > 1
    case: str
    batch: int
    threads_per_worker: int
    steps: list[StepTime]

    def of(self, kind: str) -> list[StepTime]:
        return [s for s in self.steps if s.kind == kind]


class _TokenCount:
    """Wraps an executor's execute on the instance: the tokens of the last step it ran."""

    def __init__(self, executor):
        self.tokens, self.execute = 0, executor.execute
        executor.execute = self

    def __call__(self, scheduled, pending_tokens=None):
        self.tokens = sum(s.num_new_tokens for s in scheduled)
        return self.execute(scheduled, pending_tokens)


def _step(engine, clock: CollectiveClock, count: _TokenCount, batch: int, first: bool) -> StepTime:
    """One engine.step(), timed: a decode step runs one token of each of the batch's sequences."""
    before, calls = clock.snapshot()
    start = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - start
    after, calls_after = clock.snapshot()
    spent = {name: after[name] - before[name] for name in TIMED}
    kind = "decode" if count.tokens == batch and not first else "prefill"
    return StepTime(kind, count.tokens, seconds, spent["all_reduce"], spent["all_gather"], spent["broadcast"],
                    calls_after - calls)


def run_steps(llm, prompts: list[str], decode_steps: int, clock: CollectiveClock, label: str) -> list[StepTime]:
    """Every step of len(prompts) requests added at once, each of decode_steps + 1 greedy tokens (EOS ignored)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    stamp = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{stamp}-{i}", prompt, params)
    count = _TokenCount(engine.executor)
    steps: list[StepTime] = []
    try:
        with tqdm(total=decode_steps + 1, desc=label, leave=False) as bar:
            while engine.has_unfinished():
                steps.append(_step(engine, clock, count, len(prompts), first=not steps))
                bar.update()
    finally:
        del engine.executor.execute  # the class's method again
    return steps


def divisible_model(smollm2: Path) -> Path:
    """A folder holding the SmolLM2-shaped random Llama's config.json and SmolLM2's tokenizer (see the module)."""
    folder = Path(tempfile.mkdtemp(prefix="tp-llama-"))
    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=12, num_key_value_heads=6, head_dim=48, max_position_embeddings=2048,
                rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, folder / name)
    return folder


def _bare_rank(rank: int, size: int, address: str, calls: int, width: int, out) -> None:
    """One process of bare_all_reduce: join a gloo group, all-reduce a (1, width) float32 tensor `calls` times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    x = torch.ones(1, width)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(sorted(times)[len(times) // 2])
    dist.destroy_process_group()


def bare_all_reduce(size: int, calls: int = 400, width: int = 576) -> float:
    """Median seconds of one gloo all-reduce of a decode step's hidden state (1 x width float32) among `size`
    processes doing nothing else: the collective's own latency on this machine, without a model."""
    import torch.multiprocessing as mp

    from engine.distributed.process_group import free_address

    ctx = mp.get_context("spawn")
    out, address = ctx.SimpleQueue(), free_address()
    procs = [ctx.Process(target=_bare_rank, args=(rank, size, address, calls, width, out)) for rank in range(size)]
    for p in procs:
        p.start()
    median = out.get()
    for p in procs:
        p.join()
    return median
