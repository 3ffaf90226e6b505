"""Attention on CUDA over the paged KV cache: one layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head dim
128), bf16, 16-token blocks scattered over the cache.

Decode: the Triton kernel that reads the cache in place, against gathering every block of every sequence into a
copy and running SDPA on it (the engine's CPU-style path), at batch 1 / 64 / 256 and contexts of 512 and 2,048
tokens. The floor is the K/V bytes each call must read once, over the device's copy bandwidth measured in the same run.

Prefill: a step's prompt chunks, 16 fresh prompts of 2,048 tokens, 16 chunks of 512 after 1,536 cached tokens and
one such chunk alone, through the three paths of the cuda_prefill option: gather + SDPA one chunk at a time
("sdpa", the default: a fresh prompt on its own keys, a chunk after cached tokens on a gathered copy with a boolean
mask); the Triton prefill kernel, in place, one call ("triton", engine/kernels/paged_prefill.py; a few tile
configurations swept); and FlexAttention over a paged block mask, compiled ("flex": its block mask built in the
call, as the engine does in every layer, and prebuilt). TFLOP/s count 4 * heads * head_dim per visible (query, key) pair.

    python -m benchmarks gpu_attention [--out DIR] [--quick] [--sections decode,prefill]
    python -m benchmarks gpu_attention --tiny   # CPU smoke run: tiny prefill shapes, SDPA and FlexAttention eager

--quick: decode at batch 1 and 64 at 512 tokens, prefill with 4 segments. Writes gpu_attention.md and
gpu_attention.png to benchmarks/results/KIND/, KIND the GPU's model (h100, h200), and gpu_attention.json to
benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from benchmarks.common import benchmark_args, save_results
from benchmarks.gpu.gpu_timing import device_name, median_seconds
from engine.layers.attention import (
    PrefillSegment,
    _gather_blocks,
    _prefill,
    _write,
    block_rows,
    masked_after_cached,
    paged_prefill,
)

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16
SECTIONS = ("decode", "prefill")


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and written."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def bench_ms(fn, device: str) -> float:
    """Median milliseconds of fn(): triton's do_bench on CUDA (events, cache flushed), wall time on CPU."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    return 1e3 * median_seconds(device, fn, repeats=3)


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
    import triton.testing

    from engine.kernels.paged_attention import paged_decode_attention

    args = _inputs(batch, context)
    reference = _gather_sdpa(*args).float()
    error = ((paged_decode_attention(*args).float() - reference).norm() / reference.norm()).item()
    kernel = triton.testing.do_bench(lambda: paged_decode_attention(*args), return_mode="median")
    gather = triton.testing.do_bench(lambda: _gather_sdpa(*args), return_mode="median")
    kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
    floor = kv_bytes / bandwidth * 1e3
    return {"batch": batch, "context": context, "triton_ms": kernel, "gather_sdpa_ms": gather,
            "floor_ms": floor, "triton_of_floor": floor / kernel, "speedup": gather / kernel, "rel_error": error}


# ---- prefill -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillCase:
    segments: int
    chunk: int  # new tokens per segment
    cached: int  # tokens cached before each chunk


@dataclass
class PrefillInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    segments: list[PrefillSegment]
    slots: torch.Tensor


def _prefill_inputs(case: PrefillCase, heads: int, kv_heads: int, dim: int, device: str) -> PrefillInputs:
    """Each segment's blocks scattered over the cache, its chunk's keys and values written at their slots (as
    paged_attention() does before attending), the segments as the CUDA backend gives them (fresh prompts without a
    table, block rows computed once per step)."""
    context = case.cached + case.chunk
    per_seq = -(-context // BLOCK)
    num_blocks = case.segments * per_seq + 1
    options = {"dtype": torch.bfloat16, "device": device}
    k_cache = torch.randn(kv_heads, num_blocks, BLOCK, dim, **options)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks - 1, device=device)[:case.segments * per_seq].view(case.segments, per_seq)
    positions = torch.arange(case.cached, context, device=device)
    slots = (tables[:, positions // BLOCK] * BLOCK + positions % BLOCK).flatten()
    tokens = case.segments * case.chunk
    q = torch.randn(tokens, heads, dim, **options)
    k, v = torch.randn(tokens, kv_heads, dim, **options), torch.randn(tokens, kv_heads, dim, **options)
    _write(k_cache, k, slots)
    _write(v_cache, v, slots)
    segments = [PrefillSegment(i * case.chunk, case.chunk, context, tables[i] if case.cached else None,
                               block_rows(tables[i], kv_heads, num_blocks) if case.cached else None)
                for i in range(case.segments)]
    return PrefillInputs(q, k, v, k_cache, v_cache, segments, slots)


def _gather_sdpa_prefill(x: PrefillInputs, out: torch.Tensor) -> torch.Tensor:
    """The "sdpa" route: one chunk at a time, attention.py's _prefill."""
    for seg in x.segments:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill(x.q[rows], x.k[rows], x.v[rows], x.k_cache, x.v_cache, seg,
                             after_cached=masked_after_cached)
    return out


def _swept_tiles():
    """The tile configurations the sweep compares with the kernel's default (HALF_TILES: 128 x 64, 8 warps, 2 stages)."""
    from engine.kernels.paged_prefill import TileConfig

    return [TileConfig(128, 32, 4, 2), TileConfig(64, 64, 4, 2), TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 2)]


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def _timed_path(fn, x: PrefillInputs, reference: torch.Tensor, device: str) -> dict:
    """{ms, rel_error} of fn(out), or {error} where it fails (a tile configuration out of resources, a FlexAttention
    that does not compile), so that one path's failure leaves the others' figures."""
    out = torch.empty_like(x.q)
    try:
        error = _rel_error(fn(out), reference)
        return {"ms": bench_ms(lambda: fn(out), device), "rel_error": error}
    except Exception as exc:  # noqa: BLE001 - recorded in the results, the run goes on
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def _prefill_paths(x: PrefillInputs, device: str, reference: torch.Tensor) -> dict:
    """Every path's figures; the Triton kernel only on CUDA (on CPU its interpreter runs in the tests)."""
    from engine.kernels.paged_prefill import (
        cuda_flex_options,
        flex_prefill_attention,
        paged_block_mask,
        paged_prefill_attention,
    )

    batch = paged_prefill(x.segments, x.slots, BLOCK)
    compiled = device == "cuda"
    flex = functools.partial(flex_prefill_attention, compiled=compiled,
                             kernel_options=cuda_flex_options(BLOCK) if compiled else None)
    num_blocks = x.k_cache.shape[1]
    paths = {"metadata": {"ms": bench_ms(lambda: paged_prefill(x.segments, x.slots, BLOCK), device)},
             "flex": _timed_path(lambda out: flex(x.q, x.k_cache, x.v_cache, batch, out), x, reference, device)}
    mask = paged_block_mask(batch, num_blocks, BLOCK)
    paths["flex_prebuilt_mask"] = _timed_path(lambda out: flex(x.q, x.k_cache, x.v_cache, batch, out,
                                                               block_mask=mask), x, reference, device)
    if device == "cuda":
        paths["triton"] = _timed_path(lambda out: paged_prefill_attention(x.q, x.k_cache, x.v_cache, batch, out),
                                      x, reference, device)
        for tiles in _swept_tiles():
            paths[f"triton {tiles.rows}x{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"] = _timed_path(
                lambda out, tiles=tiles: paged_prefill_attention(x.q, x.k_cache, x.v_cache, batch, out, tiles),
                x, reference, device)
    return paths


def measure_prefill(case: PrefillCase, device: str, heads: int = HEADS, kv_heads: int = KV_HEADS,
                    dim: int = DIM) -> dict:
    x = _prefill_inputs(case, heads, kv_heads, dim, device)
    reference = _gather_sdpa_prefill(x, torch.empty_like(x.q)).float()
    sdpa = bench_ms(lambda: _gather_sdpa_prefill(x, torch.empty_like(x.q)), device)
    pairs = case.segments * (case.chunk * case.cached + case.chunk * (case.chunk + 1) // 2)
    paths = _prefill_paths(x, device, reference)
    timed = {name: path["ms"] for name, path in paths.items() if name.startswith("triton") and "ms" in path}
    row = {**asdict(case), "gather_sdpa_ms": sdpa, "flops": 4 * heads * dim * pairs, "paths": paths,
           "triton_ms": paths.get("triton", {}).get("ms")}
    if timed:
        row["triton_best"] = min(timed.items(), key=lambda item: item[1])
    return row


def _prefill_cases(args) -> list[PrefillCase]:
    if args.tiny:
        return [PrefillCase(2, 48, 0), PrefillCase(2, 16, 40)]
    segments = 4 if args.quick else 16
    return [PrefillCase(segments, 2048, 0), PrefillCase(segments, 512, 1536), PrefillCase(1, 512, 1536)]


def _ms(path: dict | None) -> str:
    return f"{path['ms']:.3f}" if path and "ms" in path else "-"


def _error(path: dict | None) -> str:
    return f"{path['rel_error']:.1e}" if path and "rel_error" in path else "-"


def _prefill_line(r: dict) -> str:
    p, triton = r["paths"], r["triton_ms"]
    best = f"{r['triton_best'][1]:.3f} ({r['triton_best'][0]})" if "triton_best" in r else "-"
    rate = f"{r['flops'] / triton / 1e9:.0f}" if triton else "-"
    speedup = f"{r['gather_sdpa_ms'] / triton:.1f}x" if triton else "-"
    return (f"| {r['segments']} x ({r['chunk']} after {r['cached']}) | {r['gather_sdpa_ms']:.3f} | "
            f"{_ms(p.get('triton'))} | {best} | {_ms(p['flex'])} | {_ms(p['flex_prebuilt_mask'])} | {rate} | "
            f"{speedup} | {_error(p.get('triton'))} / {_error(p['flex'])} | {p['metadata']['ms']:.3f} |")


def _prefill_lines(rows: list[dict], device: str) -> list[str]:
    lines = [f"Prefill attention, one layer, a step's chunks, bf16, {device}", "",
             ("| segments x (chunk after cached) | gather + SDPA (ms) | Triton in place (ms) | Triton, best tiles (ms) "
              "| FlexAttention (ms) | Flex, mask prebuilt (ms) | Triton TFLOP/s | Triton speed-up | "
              "rel. error Triton / Flex | metadata per step (ms) |"), "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_prefill_line(r) for r in rows]
    failed = [f"- {r['segments']} x {r['chunk']} after {r['cached']}, {name}: {path['error']}"
              for r in rows for name, path in r["paths"].items() if "error" in path]
    return lines + ([""] + failed if failed else [])


def _decode_lines(rows: list[dict], bandwidth: float) -> list[str]:
    lines = [(f"Decode attention, one layer, Llama-3-8B shape, bf16, {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s"), "",
             ("| batch | context | Triton paged, in place (ms) | gather + SDPA (ms) | speed-up | K/V read floor (ms) "
              "| Triton at % of floor | rel. error |"), "|---|---|---|---|---|---|---|---|"]
    return lines + [f"| {r['batch']} | {r['context']} | {r['triton_ms']:.3f} | {r['gather_sdpa_ms']:.3f} | "
                    f"{r['speedup']:.1f}x | {r['floor_ms']:.3f} | {100 * r['triton_of_floor']:.0f}% | "
                    f"{r['rel_error']:.1e} |" for r in rows]


def _add_arguments(parser) -> None:
    parser.add_argument("--sections", default=",".join(SECTIONS), help="decode, prefill or both (the default)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny prefill shapes, no Triton kernel")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "decode at batch 1 and 64 at 512 tokens, prefill with 4 segments", argv,
                          _add_arguments, device="cuda", quick_is_smoke=False)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        raise SystemExit(f"--sections takes {', '.join(SECTIONS)}, not {args.sections!r}")
    if args.tiny and "prefill" not in sections:
        raise SystemExit("--tiny runs the prefill section only: the decode section times the Triton kernel, on CUDA")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available (use --tiny for a CPU smoke run)")
    raw, lines = {"mode": "tiny" if args.tiny else "quick" if args.quick else "full", "rows": []}, []
    if "decode" in sections and not args.tiny:
        raw["bandwidth"] = bandwidth = copy_bandwidth()
        batches, contexts = ((1, 64), (512,)) if args.quick else ((1, 64, 256), (512, 2048))
        raw["rows"] = [measure(b, c, bandwidth) for b in batches for c in contexts]
        lines += _decode_lines(raw["rows"], bandwidth) + [""]
    if "prefill" in sections:
        shape = (4, 2, 32) if args.tiny else (HEADS, KV_HEADS, DIM)
        raw["prefill"] = [measure_prefill(case, device, *shape) for case in _prefill_cases(args)]
        lines += _prefill_lines(raw["prefill"], f"{device_name(device)}, torch {torch.__version__}")
    save_results(args.folders, "gpu_attention", raw, plot, "\n".join(lines) + "\n")


def plot(raw: dict):
    """Milliseconds per call of each path: decode per (batch, context) with the floor, prefill per case."""
    import matplotlib.pyplot as plt

    panels = [(rows, draw) for rows, draw in ((raw.get("rows"), _plot_decode), (raw.get("prefill"), _plot_prefill))
              if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 4), squeeze=False)
    for ax, (rows, draw) in zip(axes[0], panels):
        draw(ax, rows)
    fig.tight_layout()
    return fig


def _bars(ax, labels: list[str], series: dict[str, list[float | None]]) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))],
               [v if v is not None else 0 for v in values], width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("ms per layer call")
    ax.set_yscale("log")
    ax.legend()


def _plot_decode(ax, rows: list[dict]) -> None:
    _bars(ax, [f"{r['batch']} x {r['context']}" for r in rows],
          {name: [r[key] for r in rows] for key, name in (("triton_ms", "Triton, in place"),
                                                          ("gather_sdpa_ms", "gather + SDPA"),
                                                          ("floor_ms", "K/V read floor"))})
    ax.set_xlabel("batch x context tokens")
    ax.set_title("Decode attention, one layer, Llama-3-8B shape, bf16")


def _plot_prefill(ax, rows: list[dict]) -> None:
    series = {"gather + SDPA": [r["gather_sdpa_ms"] for r in rows],
              "Triton, in place": [r.get("triton_ms") for r in rows],
              "FlexAttention": [r["paths"]["flex"].get("ms") for r in rows]}
    _bars(ax, [f"{r['segments']} x {r['chunk']} after {r['cached']}" for r in rows], series)
    ax.set_xlabel("segments x chunk tokens after cached tokens")
    ax.set_title("Prefill attention, one layer, a step's chunks, bf16")


if __name__ == "__main__":
    main()
