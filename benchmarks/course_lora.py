"""The multi-LoRA lesson of the "Efficiently Serving LLMs" course, on a toy model, next to lora-serve's LoRA layer.

The toy model is one linear layer (hidden 1024 -> 1024; the course itself used hidden 10 so that the base matmul
stays negligible on CPU, measured here too) and many LoRA adapters of rank 2..8. Each row of a batch is one request
decoding one token with its own adapter. Three ways to add the per-row LoRA delta, plus the base linear alone:

  loop      the course's first version: one row at a time, y[i] += x[i] @ A[idx] @ B[idx]
  gathered  the course's second version: index_select each row's A and B (padded to the top rank), two batched bmm
  lora-serve engine.layers.lora.LoRALinear: rows grouped by adapter slot (one weight copy per adapter, not per row),
            its per-step batch built by build_lora_batch inside the timed call (and, as a fourth line, prebuilt:
            the engine builds it once per step for all of its LoRA layers)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn
from tqdm.auto import tqdm

from engine.layers.lora import LoRALinear, LoRAStepState, LoRASubModule, build_lora_batch

HIDDEN = 1024
COURSE_HIDDEN = 10  # the course's own toy size
NUM_ADAPTERS = 64
MAX_RANK = 8
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("loop (course)", "gathered (course)", "lora-serve LoRALinear")
PREBUILT = "lora-serve, batch prebuilt"  # as in the engine: one build_lora_batch per step serves every layer
BASE = "base linear only (no LoRA)"
CPU = torch.device("cpu")


@dataclass
class ToyLoRAModel:
    """One base linear plus NUM_ADAPTERS adapters, stored the way each of the three methods wants them."""
    base: nn.Linear
    a: list[torch.Tensor]  # per adapter [in, r], unpadded (the loop)
    b: list[torch.Tensor]  # per adapter [r, out]
    a_stacked: torch.Tensor  # [adapters, in, MAX_RANK], zero-padded ranks (the gathered version)
    b_stacked: torch.Tensor  # [adapters, MAX_RANK, out]
    lora: LoRALinear  # lora-serve's layer, adapter i in slot i
    state: LoRAStepState = field(default_factory=LoRAStepState)


def build_toy(hidden: int = HIDDEN, num_adapters: int = NUM_ADAPTERS, seed: int = 0) -> ToyLoRAModel:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    base = nn.Linear(hidden, hidden).eval()
    ranks = [2 + i % (MAX_RANK - 1) for i in range(num_adapters)]  # 2, 3, ..., 8, 2, 3, ...
    a = [torch.randn(hidden, r, generator=gen) / hidden ** 0.5 for r in ranks]
    b = [torch.randn(r, hidden, generator=gen) * 0.02 for r in ranks]
    a_stacked = torch.zeros(num_adapters, hidden, MAX_RANK)
    b_stacked = torch.zeros(num_adapters, MAX_RANK, hidden)
    for i, r in enumerate(ranks):
        a_stacked[i, :, :r], b_stacked[i, :r] = a[i], b[i]
    state = LoRAStepState()
    lora = LoRALinear(base, hidden, [LoRASubModule("m", 0, hidden)], state, num_adapters, MAX_RANK,
                      torch.float32, CPU)
    for slot in range(num_adapters):  # lora-serve's convention: lora_a [r, in], lora_b [out, r], scaling
        weights = SimpleNamespace(lora_a=a[slot].t().contiguous(), lora_b=b[slot].t().contiguous(), scaling=1.0)
        lora.load_slot(slot, {"m": weights})
    return ToyLoRAModel(base, a, b, a_stacked, b_stacked, lora, state)


def loop_forward(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    y = toy.base(x)
    for row, adapter in enumerate(lora_indices.tolist()):
        y[row] += x[row] @ toy.a[adapter] @ toy.b[adapter]
    return y


def gathered_forward(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    y = toy.base(x)
    a = torch.index_select(toy.a_stacked, 0, lora_indices)  # [batch, in, r]: one weight copy per row
    b = torch.index_select(toy.b_stacked, 0, lora_indices)  # [batch, r, out]
    y += torch.bmm(torch.bmm(x.unsqueeze(1), a), b).squeeze(1)
    return y


def lora_serve_forward(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    toy.state.batch = build_lora_batch(lora_indices.tolist(), CPU)
    return toy.lora(x)


def prebuilt_forward(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    return toy.lora(x)  # the caller set toy.state.batch for these lora_indices


def base_forward(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> torch.Tensor:
    return toy.base(x)


FORWARDS = dict(zip(METHODS + (PREBUILT, BASE),
                    (loop_forward, gathered_forward, lora_serve_forward, prebuilt_forward, base_forward)))


def mean_latency_ms(forward, toy, x, lora_indices, iters: int) -> float:
    for _ in range(3):
        forward(toy, x, lora_indices)
    start = time.perf_counter()
    for _ in range(iters):
        forward(toy, x, lora_indices)
    return (time.perf_counter() - start) / iters * 1000


@torch.inference_mode()
def max_difference(toy: ToyLoRAModel, x: torch.Tensor, lora_indices: torch.Tensor) -> float:
    """Largest |difference| of the gathered and lora-serve outputs from the loop's: the three compute the same."""
    reference = loop_forward(toy, x, lora_indices)
    return max((FORWARDS[m](toy, x, lora_indices) - reference).abs().max().item() for m in METHODS[1:])


@torch.inference_mode()
def sweep(hidden: int, batch_sizes, rounds: int, iters: int, seed: int = 0) -> dict:
    """Per method and batch size: the mean latency per forward of each round (all methods interleaved in a round)."""
    toy = build_toy(hidden, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {b: (torch.randn(b, hidden, generator=gen), torch.randint(0, NUM_ADAPTERS, (b,), generator=gen))
              for b in batch_sizes}
    samples = {m: {b: [] for b in batch_sizes} for m in FORWARDS}
    items = [(r, b, m) for r in range(rounds) for b in batch_sizes for m in FORWARDS]
    for _, b, m in tqdm(items, desc=f"course toy model, hidden {hidden}", unit="item"):
        toy.state.batch = build_lora_batch(inputs[b][1].tolist(), CPU) if m == PREBUILT else None
        samples[m][b].append(mean_latency_ms(FORWARDS[m], toy, *inputs[b], iters))
    return {"hidden": hidden, "num_adapters": NUM_ADAPTERS, "ranks": "2..8 (cycled)", "rounds": rounds,
            "iters": iters, "batch_sizes": list(batch_sizes),
            "max_abs_difference": max(max_difference(toy, *inputs[b]) for b in batch_sizes),
            "distinct_adapters": {b: len(set(inputs[b][1].tolist())) for b in batch_sizes},
            "median_ms": {m: {b: statistics.median(v) for b, v in per.items()} for m, per in samples.items()},
            "samples_ms": samples}


def run(batch_sizes=BATCH_SIZES, rounds: int = 5, iters: int = 50, hidden_sizes=(HIDDEN, COURSE_HIDDEN)) -> dict:
    """hidden size -> sweep results."""
    return {h: sweep(h, batch_sizes, rounds, iters) for h in hidden_sizes}
