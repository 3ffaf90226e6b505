"""Decode attention on CUDA: the Triton kernel that reads the paged KV cache in place, against gathering every
block of every sequence into a copy and running SDPA on it (the engine's CPU-style path).

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head dim 128), bf16, 16-token blocks scattered
over the cache, at batch 1 / 64 / 256 and contexts of 512 and 2,048 tokens. The floor is the K/V bytes each
call must read once, over the device's copy bandwidth measured in the same run.

    python -m benchmarks gpu_attention [--out DIR] [--quick]   # --quick: batch 1 and 64 at 512 tokens

Writes gpu_attention.md and gpu_attention.png to benchmarks/results/KIND/, KIND the GPU's model (h100, h200), and
gpu_attention.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton.testing

from benchmarks.common import benchmark_args, save_results
from engine.kernels.paged_attention import paged_decode_attention
from engine.layers.attention import _gather_blocks

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def _inputs(batch: int, context: int):
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(KV_HEADS, num_blocks, BLOCK, DIM, dtype=torch.bfloat16, device="cuda")  # head-major
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device="cuda")[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device="cuda")
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    return q, k_cache, v_cache, tables, lens


def _gather_sdpa(q, k_cache, v_cache, tables, lens):
    keys = _gather_blocks(k_cache, tables).transpose(0, 1)  # [B, kv_heads, L, D]
    values = _gather_blocks(v_cache, tables).transpose(0, 1)
    visible = torch.arange(keys.shape[2], device="cuda")[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape, dtype=q.dtype, device="cuda").masked_fill_(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                         enable_gqa=True)
    return out.squeeze(2)


def measure(batch: int, context: int, bandwidth: float) -> dict:
    args = _inputs(batch, context)
    reference = _gather_sdpa(*args).float()
    error = ((paged_decode_attention(*args).float() - reference).norm() / reference.norm()).item()
    kernel = triton.testing.do_bench(lambda: paged_decode_attention(*args), return_mode="median")
    gather = triton.testing.do_bench(lambda: _gather_sdpa(*args), return_mode="median")
    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
    floor = kv_bytes / bandwidth * 1e3
    return {"batch": batch, "context": context, "triton_ms": kernel, "gather_sdpa_ms": gather,
            "floor_ms": floor, "triton_of_floor": floor / kernel, "speedup": gather / kernel, "rel_error": error}


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "batch 1 and 64 at 512 tokens only", argv, device="cuda", quick_is_smoke=False)
    bandwidth = copy_bandwidth()
    batches, contexts = ((1, 64), (512,)) if args.quick else ((1, 64, 256), (512, 2048))
    rows = [measure(b, c, bandwidth) for b in batches for c in contexts]
    lines = [f"Decode attention, one layer, Llama-3-8B shape, bf16, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s", "",
             "| batch | context | Triton paged, in place (ms) | gather + SDPA (ms) | speed-up | K/V read floor (ms) "
             "| Triton at % of floor | rel. error |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context']} | {r['triton_ms']:.3f} | {r['gather_sdpa_ms']:.3f} | "
              f"{r['speedup']:.1f}x | {r['floor_ms']:.3f} | {100 * r['triton_of_floor']:.0f}% | {r['rel_error']:.1e} |"
              for r in rows]
    save_results(args.folders, "gpu_attention", {"bandwidth": bandwidth, "rows": rows}, plot, "\n".join(lines) + "\n")


def plot(raw: dict):
    """Milliseconds per call of each path, and the floor, per (batch, context)."""
    import matplotlib.pyplot as plt

    rows = raw["rows"]
    labels = [f"{r['batch']} x {r['context']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, (key, name) in enumerate((("triton_ms", "Triton, in place"), ("gather_sdpa_ms", "gather + SDPA"),
                                     ("floor_ms", "K/V read floor"))):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r[key] for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("batch x context tokens")
    ax.set_ylabel("ms per layer call")
    ax.set_yscale("log")
    ax.set_title("Decode attention, one layer, Llama-3-8B shape, bf16")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
