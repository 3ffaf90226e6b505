"""The Triton fused element-wise operators (engine/kernels/cuda_ops.py) against the eager PyTorch ops they replace.

On CPU (CI) they run in Triton's interpreter, in float32, so their indexing, masks and rounding steps are checked
everywhere; on a CUDA machine the same tests run the compiled kernels in bf16 and fp16 too. Inputs are fresh random
values, and outputs start as NaN wherever a kernel must write.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # set before triton is first imported (see test_lora_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels import cuda_ops
from engine.kernels.torch_rotary import apply_rotary
from engine.layers.attention import _write
from engine.models.llama import RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [])


def _randn(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def _ulps_apart(out: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at the reference's magnitude."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=1e-3)
    return ((out.float() - want.float()).abs() / spacing).max().item()


def _norm(width: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(width, 1e-5).to(DEVICE, dtype)
    norm.weight.data.copy_(_randn(width, dtype=dtype, seed=seed))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (5, 576), (3, 1000)])
def test_rms_norm_matches_eager(dtype, rows, width):
    norm = _norm(width, dtype, seed=width)
    x = _randn(rows, width, dtype=dtype, seed=rows, scale=3.0)
    want = norm(x)
    norm.fused_ops = cuda_ops
    got = norm(x)
    assert got.dtype == dtype and got.shape == want.shape
    assert _ulps_apart(got, want) <= 4  # the sum of squares may add up in another order (then two roundings)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 300)])
def test_add_rms_norm_updates_the_residual_in_place(dtype, rows, width):
    norm = _norm(width, dtype, seed=width + 1)
    residual = _randn(rows, width, dtype=dtype, seed=1)
    delta = _randn(rows, width, dtype=dtype, seed=2)
    want_residual = residual.clone()
    want = norm.add_and_norm(delta, want_residual)
    norm.fused_ops = cuda_ops
    got = norm.add_and_norm(delta, residual)
    assert torch.equal(residual, want_residual)  # the sum rounds as residual.add_(delta) does, bit for bit
    assert _ulps_apart(got, want) <= 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, head_dim", [(1, 3, 64), (6, 12, 128), (4, 5, 16)])
def test_rotary_matches_eager(dtype, tokens, heads, head_dim):
    wide = _randn(tokens, heads + 2, head_dim, dtype=dtype, seed=heads)
    x = wide[:, 1:heads + 1]  # a strided view, as the q/k split of the fused projection is
    angles = _randn(tokens, 1, head_dim, dtype=torch.float32, seed=7, scale=3.0)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cuda_ops.rotary(x, cos, sin)
    # The interpreter rounds every product as eager does (equal bit for bit there); compiled, Triton may fuse a
    # product and the sum into one FMA and skip a product's rounding: within an ulp of the products, and of the sum
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).float()
    products = (x.float() * cos.float()).abs() + (rotated * sin.float()).abs()
    bound = torch.finfo(dtype).eps * (products + apply_rotary(x, cos, sin).float().abs())
    assert ((got.float() - apply_rotary(x, cos, sin).float()).abs() <= bound).all()


def test_a_partial_rotary_takes_the_pytorch_path():
    """cos and sin narrower than the head (Phi-4-mini's rotary over part of each head): apply_rotary itself."""
    x = _randn(3, 4, 128, dtype=torch.float32, seed=1)
    angles = _randn(3, 1, 96, dtype=torch.float32, seed=2)
    assert torch.equal(cuda_ops.rotary(x, angles.cos(), angles.sin()), apply_rotary(x, angles.cos(), angles.sin()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 64), (3, 1536), (2, 2500)])
def test_silu_and_mul_matches_eager(dtype, rows, width):
    x = _randn(rows, 2 * width, dtype=dtype, seed=width, scale=4.0)
    gate, up = x.split(width, dim=-1)
    want = F.silu(gate) * up
    got = cuda_ops.silu_and_mul(x)
    assert got.shape == want.shape
    # exp is the GPU's fast exponential (a few float32 ulps from PyTorch's), then two roundings
    assert _ulps_apart(got, want) <= (8 if dtype == torch.float32 else 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_index_copy(dtype):
    kv_heads, blocks, block_size, head_dim, tokens = 3, 10, 4, 16, 9
    k_cache = torch.full((kv_heads, blocks, block_size, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(0))[:tokens].to(DEVICE)
    qkv = _randn(tokens, 4 + 2 * kv_heads, head_dim, dtype=dtype, seed=3)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]  # strided views, as the engine's are
    want_k, want_v = k_cache.clone(), v_cache.clone()
    _write(want_k, k, slots)
    _write(want_v, v, slots)
    cuda_ops.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), want_k.nan_to_num(7.0))  # untouched slots stay NaN in both
    assert torch.equal(v_cache.nan_to_num(7.0), want_v.nan_to_num(7.0))


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="weight"):
        cuda_ops.rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="power-of-2"):
        cuda_ops.rotary(torch.zeros(2, 3, 24, device=DEVICE), torch.zeros(2, 1, 24, device=DEVICE),
                        torch.zeros(2, 1, 24, device=DEVICE))


def test_a_tiny_llama_with_the_fused_ops_generates_as_eager(tiny_llama_path):
    """The operators inside the model (the residual stream updated in place, the q/k views of the fused projection,
    the MLP's [gate | up]), greedy tokens equal to the eager ops'. On CPU the engine runs its PyTorch paths here
    (cpu_kernels=False) and the Triton ones are handed to the model through the same hook as on CUDA."""
    from engine import LLM, SamplingParams
    from engine.models import use_fused_ops
    from tests.helpers import PROMPTS

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    llm = LLM(str(tiny_llama_path), device=str(DEVICE), cpu_kernels=False, cuda_fused_ops=False, log_stats=False)
    eager = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    use_fused_ops(llm.engine.runner.model, cuda_ops)
    fused = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(eager, fused):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_gemma_norms_scale_in_float32(dtype):
    """A Gemma norm's float32 1 + w beside a half-precision row: the row scaled in float32 and rounded once, as the
    PyTorch path and transformers do (float16 in the interpreter, whose bfloat16 rounds otherwise)."""
    norm = RMSNorm(300, 1e-6, float32_scale=True).to(DEVICE)
    norm.weight.data.copy_(_randn(300, dtype=torch.float32, seed=3, scale=0.3) + 1)
    x = _randn(7, 300, dtype=dtype, seed=4, scale=3.0)
    residual, delta = x.clone(), _randn(7, 300, dtype=dtype, seed=5)
    want, want_added = norm(x), norm.add_and_norm(delta, residual.clone())
    norm.fused_ops = cuda_ops
    for got, expected in ((norm(x), want), (norm.add_and_norm(delta, residual), want_added)):
        assert (got == expected).float().mean() > 0.99  # rounding the row before the scale: 74% equal here
        assert _ulps_apart(got, expected) <= 4
    with pytest.raises(ValueError, match="must be .* or float32"):
        cuda_ops.rms_norm(x, torch.ones(300, dtype=torch.float64, device=DEVICE), 1e-6)
