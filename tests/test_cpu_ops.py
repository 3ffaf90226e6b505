"""The C++ CPU operators against the PyTorch paths they replace (engine/kernels/cpu_ops.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.kernels import cpu_ops
from engine.models.llama import RMSNorm


def _norm(size: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    """An RMSNorm with weights around 1, on the PyTorch path (cpu_ops unset)."""
    norm = RMSNorm(size, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=gen) * 0.5 + 1)
    return norm


def _assert_norms_match(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within float32 rounding in fp32; in bf16/fp16 bitwise on most elements (the float32 sum may differ in its
    last bit) and close everywhere."""
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got == want).float().mean() > 0.99
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (300, 96), (2, 3, 40)])
def test_rms_norm_rounds_as_the_pytorch_path(dtype, shape):
    """The same rounding as transformers' RMSNorm: bitwise equal in bf16/fp16 on most elements (the float32 sum
    may differ in its last bit), within float32 rounding everywhere; 300 rows run on both threads."""
    ops = cpu_ops.load()
    assert ops is not None, "the C++ CPU operators did not build"
    gen = torch.Generator().manual_seed(shape[-1])
    norm = _norm(shape[-1], dtype, gen)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    want = norm(x)
    norm.fused_ops = ops
    _assert_norms_match(norm(x), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, heads, dim, turned", [(1, 12, 64, 64), (37, 4, 16, 16), (3, 7, 128, 128),
                                                       (5, 3, 128, 96), (37, 2, 128, 64), (2, 3, 16, 12)])
def test_rotary_rounds_as_the_pytorch_path(dtype, tokens, heads, dim, turned):
    """Bitwise equal to apply_rotary in every dtype, on a strided view of a fused projection as the model passes
    it (37 tokens run on both threads); a partial rotary (Phi-4-mini's 96 of 128) turns the first dimensions and
    copies the rest; an odd or too wide rotary is refused."""
    from engine.kernels.torch_rotary import apply_rotary

    ops = cpu_ops.load()
    assert ops is not None, "the C++ CPU operators did not build"
    gen = torch.Generator().manual_seed(tokens * dim)
    fused = torch.randn(tokens, (heads + 3) * dim, generator=gen).to(dtype)
    x = fused[:, :heads * dim].view(tokens, heads, dim)
    cos = torch.randn(tokens, 1, turned, generator=gen).to(dtype)
    sin = torch.randn(tokens, 1, turned, generator=gen).to(dtype)
    got = ops.rotary(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rotary(x, cos, sin))
    for width in (turned - 1, dim + 2):
        with pytest.raises(RuntimeError, match="an even number of dimensions up to head_dim"):
            ops.rotary(x, torch.zeros(tokens, 1, width, dtype=dtype), torch.zeros(tokens, 1, width, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (300, 96), (2, 3, 40)])
def test_add_rms_norm_adds_in_place_and_norms_as_the_pytorch_path(dtype, shape):
    """The fused residual addition: the residual equals residual + delta bitwise, the output the PyTorch path's
    norm of it (its own rounding bounds as above); 300 rows run on both threads."""
    ops = cpu_ops.load()
    assert ops is not None, "the C++ CPU operators did not build"
    gen = torch.Generator().manual_seed(shape[-1] + 1)
    norm = _norm(shape[-1], dtype, gen)
    residual = (torch.randn(shape, generator=gen) * 3).to(dtype)
    delta = torch.randn(shape, generator=gen).to(dtype)
    want_residual = residual + delta
    want = norm(want_residual)
    norm.fused_ops = ops
    got = norm.add_and_norm(delta, residual)
    assert torch.equal(residual, want_residual)
    _assert_norms_match(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, width", [(1, 1536), (37, 500), (3, 35), (64, 1536)])
def test_silu_and_mul_matches_the_pytorch_mlp(dtype, tokens, width):
    """silu(gate) * up from the fused gate_up output, as the eager MLP computes it, widths that leave ATen's vector
    loop a scalar tail included: bitwise in float32; in bf16 and fp16, whose fast silu may round to the neighbour
    of PyTorch's, bitwise on almost every element and within two units of the last place on the rest, with the
    extremes (overflowing exp, infinities, NaN) as PyTorch gives them."""
    from engine.models.llama import LlamaMLP

    ops = cpu_ops.load()
    assert ops is not None, "the C++ CPU operators did not build"
    gen = torch.Generator().manual_seed(tokens * width)
    gate_up = (torch.randn(tokens, 2 * width, generator=gen) * 4).to(dtype)
    extremes = torch.tensor([-100.0, -89.0, -87.0, -30.0, 30.0, 88.0, float("inf"), float("-inf"), float("nan"), 0.0])
    gate_up[0, :min(width, len(extremes))] = extremes[:width].to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    config = SimpleNamespace(hidden_size=8, intermediate_size=width, hidden_act="silu")
    got, want = ops.silu_and_mul(gate_up), LlamaMLP(config).act(gate) * up
    if dtype == torch.float32:
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
        return
    assert got.dtype == dtype and (got == want).logical_or(want.isnan()).float().mean() > 0.99
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=1e-30, equal_nan=True)
    torch.testing.assert_close(got[0, :10], want[0, :10], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, width", [(1, 1536), (37, 500), (3, 35), (64, 1536)])
@pytest.mark.parametrize("name", ["gelu_pytorch_tanh", "gelu"])
def test_gelu_and_mul_matches_the_pytorch_mlp(dtype, tokens, width, name):
    """gelu(gate) * up from the fused gate_up output, as the eager MLP of a GELU model (Gemma's tanh approximation,
    or the exact one) computes it, widths that leave a scalar tail included: ATen's own GELU formulas, so bitwise
    on almost every element and an ulp away on the rest, where the two builds order or fuse the float32
    arithmetic differently, with the extremes as PyTorch gives them. The reference is ATen's kernel, oneDNN's off:
    eager PyTorch hands a contiguous gate (one row of the split, or transformers' separate gate projection) to
    oneDNN's GELU, whose own approximation of erf matched ATen's on 49% of a float32 row here."""
    from engine.models.llama import LlamaMLP

    ops = cpu_ops.load()
    assert ops is not None, "the C++ CPU operators did not build"
    gen = torch.Generator().manual_seed(tokens * width)
    gate_up = (torch.randn(tokens, 2 * width, generator=gen) * 4).to(dtype)
    extremes = torch.tensor([-100.0, -10.0, -3.0, 3.0, 10.0, 100.0, float("inf"), float("-inf"), float("nan"), 0.0])
    gate_up[0, :min(width, len(extremes))] = extremes[:width].to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    config = SimpleNamespace(hidden_size=8, intermediate_size=width, hidden_act=name)
    got = ops.gelu_and_mul(gate_up, int(name == "gelu_pytorch_tanh"))
    with torch.backends.mkldnn.flags(enabled=False):
        want = LlamaMLP(config).act(gate) * up
    assert got.dtype == dtype and (got == want).logical_or(want.isnan()).float().mean() > 0.99
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(got[0, :10], want[0, :10], rtol=0, atol=0, equal_nan=True)


def test_the_module_shares_the_processs_libstdcxx_and_its_checks_raise():
    """One C++ library in the process: a module with its own static copy crashed formatting a check's message."""
    module = cpu_ops.load()
    assert module is not None, "the C++ CPU operators did not build"
    linked = subprocess.run(["ldd", module.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in linked, linked
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache's 64 slots"):
        module.write_kv_cache(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 4, 16, 8),
                              torch.zeros(1, 4, 16, 8), torch.tensor([64]))


def test_the_bindings_convert_by_type_and_refuse_by_name():
    """The C API bindings: a Parameter is a tensor, None an absent bias, a tuple a list of tensors, an in-place
    operator writes the caller's tensor; a wrong type or count is a TypeError naming the operator and argument."""
    module = cpu_ops.load()
    assert module is not None, "the C++ CPU operators did not build"
    weight = torch.nn.Parameter(torch.full((4,), 2.0), requires_grad=False)
    x = torch.ones(2, 4)
    assert torch.equal(module.rms_norm(x, weight, 0.0), torch.full((2, 4), 2.0))
    counts = torch.zeros(5, dtype=torch.int32)
    assert module.parallel_for_count_(counts, 1, -1) is None and counts.tolist() == [1] * 5
    assert isinstance(module.vector_width(), int) and module.simd_linear_widens_bf16() in (True, False)
    y = torch.zeros(1, 4)
    a, b = torch.ones(1, 2, 4).transpose(1, 2), (torch.ones(1, 2, 4),)  # A K-major
    module.lora_add_(y, x[:1], a, b, torch.tensor([0]), 2)
    assert torch.equal(y, torch.full((1, 4), 8.0))
    with pytest.raises(TypeError, match=r"rms_norm: argument 1 must be a Tensor, not list"):
        module.rms_norm(x, [1.0] * 4, 1e-6)
    with pytest.raises(TypeError, match=r"rms_norm: argument 2 must be a float, not str"):
        module.rms_norm(x, weight, "1e-6")
    with pytest.raises(TypeError, match=r"parallel_for_count_: argument 1 must be an int, not float"):
        module.parallel_for_count_(counts, 1.5, -1)
    with pytest.raises(TypeError, match=r"rms_norm: takes 3 arguments \(2 given\)"):
        module.rms_norm(x, weight)
    with pytest.raises(TypeError, match=r"lora_add_: argument 3 holds a int, not a Tensor"):
        module.lora_add_(y, x[:1], a, [1], torch.tensor([0]), 2)
    with pytest.raises(RuntimeError, match="item 3 failed"):
        module.parallel_for_count_(counts, 1, 3)


def test_an_operator_runs_without_the_gil():
    """While an operator runs, another Python thread runs. The other thread gives the GIL up at every turn, and a
    switch interval of 1 s keeps the interpreter from taking it from this thread itself, so the other thread runs
    in the first half of the operator's time only if the operator gave the GIL up (holding it, the other thread
    ran only in the last quarter, after the operator). A loaded machine may not schedule the other thread within
    one call's few milliseconds, so the check gets three tries: an operator that holds the GIL fails all three."""
    module = cpu_ops.load()
    assert module is not None, "the C++ CPU operators did not build"
    x, weight = torch.randn(8192, 4096), torch.ones(4096)
    assert any(_other_thread_ran_during(lambda: module.rms_norm(x, weight, 1e-6)) for _ in range(3)), (
        "the GIL was held through the operator"
    )


def _other_thread_ran_during(operator) -> bool:
    """Whether a thread that is already taking turns takes one in the first half of ``operator``'s run."""
    turns, ready, stop = [], threading.Event(), threading.Event()

    def other():
        while not stop.is_set():
            turns.append(time.perf_counter())
            ready.set()
            time.sleep(0)  # the GIL goes back to whoever waits for it

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=other)
    try:
        thread.start()
        ready.wait()
        sys.setswitchinterval(1.0)
        start = time.perf_counter()
        operator()
        end = time.perf_counter()
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    return any(start < turn < start + (end - start) / 2 for turn in turns)


def test_a_build_killed_half_way_does_not_block_later_starts():
    """A replica stopped while it compiles leaves torch's lock file behind; the next start must not wait on it."""
    assert cpu_ops.load() is not None, "the C++ CPU operators did not build"
    folder = cpu_ops.build_directory(cpu_ops.build_name())
    (folder / "lock").touch()  # what a killed build leaves
    code = "from engine.kernels import cpu_ops; assert cpu_ops.load() is not None"
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, timeout=120, check=True)
    assert not (folder / "lock").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 17])
def test_argmax_rows_matches_torch(vocab, dtype):
    """First maximal index, as torch.argmax: random rows, ties (in bf16 and fp16 also those that rounding makes),
    a NaN (which wins), a row of -inf, and widths that leave a scalar tail after the vector loop; 64 rows run on
    both threads; anything but a float dtype or a 2-D tensor is refused by name."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=gen).to(dtype)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 50.0  # a tie: the first wins
    logits[2, vocab - 1] = 50.0  # the maximum in the scalar tail
    logits[3, vocab // 2] = float("nan")
    logits[4] = float("-inf")
    torch.testing.assert_close(module.argmax_rows(logits), logits.argmax(-1), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        module.argmax_rows(logits.double())
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        module.argmax_rows(logits[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000, 17])
def test_log_normalizers_match_torch_logsumexp(vocab, dtype):
    """Each row's logsumexp in float32, as torch.logsumexp of the float32 logits, within the fast exp's error:
    random rows of large logits, widths that leave a scalar tail, and torch's answers for a +inf (inf), a row of
    -inf (-inf), a NaN (NaN) and a row half -inf; 64 rows run on both threads; anything but a float dtype or a 2-D
    tensor is refused by name."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(64, vocab, generator=gen) * 8).to(dtype)
    logits[1, vocab - 1] = float("inf")
    logits[2] = float("-inf")
    logits[3, vocab // 2] = float("nan")
    logits[4, ::2] = float("-inf")
    got = module.log_normalizers(logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, logits.float().logsumexp(-1), rtol=0, atol=1e-5, equal_nan=True)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        module.log_normalizers(logits.double())
    with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
        module.log_normalizers(logits[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_rows_is_index_select(dtype):
    """Rows by index as index_select gives them, repeats and any order, from a table whose rows are strided (a
    column slice of a wider tensor); an index outside the table, negative or past its end, or not int64, is refused
    by name, and nothing is read past the table."""
    module = cpu_ops.load()
    wide = torch.randn(300, 80, generator=torch.Generator().manual_seed(5)).to(dtype)
    table = wide[:, 8:72]
    index = torch.tensor([299, 0, 7, 7, 150] * 13)
    out = module.gather_rows(table, index)
    assert out.is_contiguous()
    torch.testing.assert_close(out, table.index_select(0, index), rtol=0, atol=0)
    assert module.gather_rows(table, index[:0]).shape == (0, 64)
    for bad in (torch.tensor([0, 300]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="outside the table's 300 rows"):
            module.gather_rows(table, bad)
    with pytest.raises(RuntimeError, match="int64 index"):
        module.gather_rows(table, index.int())


def test_model_gathers_embeddings_and_sampled_rows_on_the_operators():
    """With the C++ operators, the embedding and rotary lookups take gather_rows and a step of decodes alone
    samples its hidden rows as they are: a model's logits are bitwise those of torch's own lookups."""
    from engine import LLM, SamplingParams
    from engine.layers.embedding import Embedding
    from engine.layers.rotary import RotaryEmbedding

    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", num_threads=2, log_stats=False)
    lookups = [m for m in llm.engine.runner.model.modules() if isinstance(m, (Embedding, RotaryEmbedding))]
    assert len(lookups) == 2 and all(m.fused_ops is cpu_ops.load() for m in lookups)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = ["What is the capital of France?", "Why do cats purr?"]
    fused = llm.generate(prompts, params, use_tqdm=False)
    for module in lookups:
        module.fused_ops = None
    plain = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (64, 49152), (3, 8193), (2, 17)])
def test_widen_is_bitwise_torch_float(dtype, rows, vocab):
    """Logits widened into a kept float32 buffer exactly as .float(), for widths that leave a partial last chunk
    and a scalar tail; a buffer of another shape or dtype is refused by name, not written past."""
    module = cpu_ops.load()
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 30).to(dtype)
    logits[0, -1] = float("nan")
    logits[-1, 0] = float("-inf")
    out = torch.full((rows, vocab), 7.0)
    module.widen_(out, logits)
    assert torch.equal(out.isnan(), logits.float().isnan())
    torch.testing.assert_close(out, logits.float(), rtol=0, atol=0, equal_nan=True)
    for wrong in (torch.empty(rows, vocab + 1), torch.empty(rows, vocab, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="widen_ takes"):
            module.widen_(wrong, logits)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_write_kv_cache_matches_index_copy(dtype, cache_dtype):
    """The same cache as the PyTorch write (index_copy_ per tensor), from a strided view of a fused projection,
    float32 keys rounded to a bf16/fp16 cache as torch rounds them; a slot outside the cache is refused with the
    reason, not written."""
    from engine.layers.attention import _write

    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(3)
    kv_heads, blocks, block, dim, tokens = 3, 48, 16, 64, 700
    fused = torch.randn(tokens, 3 * kv_heads * dim, generator=gen).to(dtype)
    k, v = (part.view(tokens, kv_heads, dim) for part in fused[:, kv_heads * dim:].split(kv_heads * dim, dim=-1))
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    caches = [torch.zeros(kv_heads, blocks, block, dim, dtype=cache_dtype) for _ in range(4)]
    module.write_kv_cache(k, v, caches[0], caches[1], slots)
    _write(caches[2], k, slots)
    _write(caches[3], v, slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="outside the cache"):
        module.write_kv_cache(k[:1], v[:1], caches[0], caches[1], torch.tensor([blocks * block]))


@pytest.mark.skipif(not (cpu_ops.load() is not None and cpu_ops.load().bf16_prompt_attention()),
                    reason="the prompt kernel needs a build for a CPU with AVX-512 BF16")
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("new, cached", [(64, 0), (77, 0), (300, 0), (130, 45), (17, 200), (1, 40)])
@pytest.mark.parametrize("block", [16, 32, 8])
def test_prompt_attention_matches_float32_attention(heads, kv_heads, dim, new, cached, block):
    """A prompt chunk (fresh, or after cached tokens) read from scattered cache blocks, against causal attention in
    float32 on the same bf16 inputs: within bf16's rounding of the probabilities and the output. Blocks of 16 and
    32 tokens take the AMX kernel where the build has it, blocks of 8 the AVX-512 BF16 one. Cache slots past the
    context hold NaN, as a slot never written may: nothing may read them into the output."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(new * 7 + cached + dim)
    context = new + cached
    blocks = (context + block - 1) // block
    k_cache = torch.randn(kv_heads, blocks + 5, block, dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, blocks + 5, block, dim, generator=gen).bfloat16()
    table = torch.randperm(blocks + 5, generator=gen)[:blocks]
    for cache in (k_cache, v_cache):
        tail = cache[:, table].flatten(1, 2)  # a copy (advanced indexing), written back
        tail[:, context:] = float("nan")
        cache[:, table] = tail.view(kv_heads, blocks, block, dim)
    fused = torch.randn(new, heads + 2 * kv_heads, dim, generator=gen).bfloat16()  # q as a view of a projection
    q = fused[:, :heads]
    out = module.prompt_attention(q, k_cache, v_cache, table, context)
    keys = k_cache[:, table].flatten(1, 2)[:, :context].float().repeat_interleave(heads // kv_heads, 0)
    values = v_cache[:, table].flatten(1, 2)[:, :context].float().repeat_interleave(heads // kv_heads, 0)
    visible = torch.arange(context)[None, :] <= torch.arange(new)[:, None] + cached
    want = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values,
                                                            attn_mask=visible).transpose(0, 1)
    assert out.dtype == torch.bfloat16 and out.shape == (new, heads, dim)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.prompt_attention(q.float(), k_cache, v_cache, table, context)


LORA_SHAPES = [(64, 6, [24, 8, 8]), (100, 16, [40]), (300, 8, [96, 33]), (50, 4, [8, 8, 8, 8, 5]), (576, 8, [576])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features, rank, outs", LORA_SHAPES)
@pytest.mark.parametrize("weights_in_dtype", [False, True], ids=["float32 weights", "weights in x's dtype"])
def test_lora_add_matches_float64_reference(dtype, in_features, rank, outs, weights_in_dtype):
    """The multi-LoRA delta, each token reading its own slot in place, on the K-major weights LoRALinear keeps on
    CPU (float32, or the model's dtype): in and out sizes off the vector width, one to five sub-modules,
    tokens of one slot scattered and more than a group of them, base-model tokens (-1) untouched; y summed in
    float32 and rounded once, so within one rounding of y's dtype of the float64 result on the same weights."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(in_features + rank)
    subs, slots_count = len(outs), 4
    packed = torch.randn(slots_count, in_features * rank * subs + rank * sum(outs), generator=gen)
    packed = packed.to(dtype) if weights_in_dtype else packed
    a = packed[:, :in_features * rank * subs].view(slots_count, -1, in_features).transpose(1, 2)
    bs, start = [], in_features * rank * subs
    for out in outs:
        bs.append(packed[:, start:start + rank * out].view(slots_count, rank, out))
        start += rank * out
    slots = torch.tensor([2, -1, 0, 2, 3, -1, 2, 1, 1, 2, 2, 2, 0])  # slot 2's six tokens: a group of 4, then 2
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(outs), generator=gen).to(dtype)
    chosen = slots.clamp(min=0)
    shrunk = torch.einsum("ti,tik->tk", x.double(), a[chosen].double())
    delta = torch.cat([torch.einsum("tr,tro->to", shrunk[:, i * rank:(i + 1) * rank], b[chosen].double())
                       for i, b in enumerate(bs)], dim=1)
    want = y.double() + delta * (slots >= 0)[:, None]
    got = y.clone()
    module.lora_add_(got, x, a, bs, slots, rank)
    assert torch.equal(got[slots < 0], y[slots < 0])
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance


def test_lora_add_refuses_what_it_cannot_read():
    module = cpu_ops.load()
    packed = torch.zeros(2, 16 * 4 + 4 * 8)
    a_k_major = packed[:, :64].view(2, 4, 16).transpose(1, 2)
    b = packed[:, 64:].view(2, 4, 8)
    x, y = torch.zeros(3, 16), torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="K-major"):
        module.lora_add_(y, x, packed[:, :64].view(2, 16, 4), [b], torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(RuntimeError, match="outside the 2 slots"):
        module.lora_add_(y, x, a_k_major, [b], torch.tensor([0, 2, -1]), 4)
    with pytest.raises(RuntimeError, match="add up to y's columns"):
        module.lora_add_(torch.zeros(3, 9), x, a_k_major, [b], torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(RuntimeError, match="float32 or x's dtype"):
        module.lora_add_(y, x, a_k_major.half(), [b.half()], torch.zeros(3, dtype=torch.long), 4)


def _amx_linear_usable() -> bool:
    module = cpu_ops.load()
    return module is not None and module.amx_linear_usable(64, 64)


@pytest.mark.skipif(not _amx_linear_usable(), reason="the AMX linear needs a build and a CPU with AMX")
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 33, 64, 100])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (64, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_matches_float64_reference(rows, out_features, in_features, bias):
    """Row counts off the 16-row tiles and off the 32-row passes, weights of one and of many column groups, with
    and without bias: within bf16's rounding of the output, every element (a column group or row never written,
    or written from the wrong weights, is off by the values' own size)."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    got = module.amx_linear(x, module.amx_pack_linear_weight(w), b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-3 * want.abs().max()).all()


@pytest.mark.skipif(not _amx_linear_usable(), reason="the AMX linear needs a build and a CPU with AMX")
def test_amx_linear_refuses_what_it_cannot_take():
    module = cpu_ops.load()
    assert not module.amx_linear_usable(48, 64) and not module.amx_linear_usable(64, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.amx_pack_linear_weight(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16 weight"):
        module.amx_pack_linear_weight(torch.zeros(64, 64))
    packed = module.amx_pack_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="takes 64"):
        module.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias of 3 values"):
        module.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.skipif(not _amx_linear_usable(), reason="the AMX linear needs a build and a CPU with AMX")
def test_prepacked_linear_takes_the_amx_kernel_for_a_decode_steps_rows():
    """Given the operators, a bf16 PrepackedLinear keeps the AMX packing and gives oneDNN's results within bf16's
    rounding for a decode step's rows; longer chunks take oneDNN itself (bitwise its result)."""
    from engine.layers.linear import AMX_MAX_ROWS, CppLinearKernels, PrepackedLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 960, bias=True).bfloat16()
    amx, onednn = PrepackedLinear(linear, CppLinearKernels(cpu_ops.load())), PrepackedLinear(linear)
    assert amx.kernel.name == "amx" and amx.own_weight is not None and onednn.kernel is None
    for rows in (3, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 576).bfloat16()
        got, want = amx(x), onednn(x)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2)
        by_amx = cpu_ops.load().amx_linear(x, amx.own_weight, amx.bias)
        assert torch.equal(got, want if rows > AMX_MAX_ROWS else by_amx)


def _simd_linear_usable(dtype: torch.dtype) -> bool:
    """Whether the SIMD linear multiplies rows of `dtype` by weights of `dtype` (a build that widens bf16 weights
    takes float32 rows with them instead: _widens_bf16)."""
    module = cpu_ops.load()
    if module is None or not module.simd_linear_usable(torch.zeros(64, 64, dtype=dtype)):
        return False
    return dtype != torch.bfloat16 or not module.simd_linear_widens_bf16()


def _widens_bf16() -> bool:
    module = cpu_ops.load()
    return module is not None and module.simd_linear_widens_bf16()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 100])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 1536), (64, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_simd_linear_matches_float64_reference(dtype, rows, out_features, in_features, bias):
    """Every row-block size (6 rows and the tails of 1-5), several column blocks, biases: within the dtype's rounding
    of a float64 reference (a weight packed in the wrong order, or a row or block skipped, is off by the values' own
    size)."""
    if not _simd_linear_usable(dtype):
        pytest.skip(f"the SIMD linear in {dtype} needs a build and a CPU with it (AVX-512 BF16 for bf16)")
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(rows * 11 + out_features)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    got = module.simd_linear(x, module.simd_pack_linear_weight(w), b)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.dtype == dtype and got.shape == want.shape
    relative = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= want.abs() * relative + relative * want.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("counts", [[3, 0, 9, 2], [0, 0, 1, 0], [20, 13, 0, 7]])
def test_grouped_simd_linear_is_each_experts_simd_linear(dtype, counts):
    """A mixture's experts in one call: each expert's rows (6-row blocks and their tails, experts without rows
    skipped) give what simd_linear gives them against that expert's weight, bit for bit."""
    if not _simd_linear_usable(dtype):
        pytest.skip(f"the SIMD linear in {dtype} needs a build and a CPU with it (AVX-512 BF16 for bf16)")
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(sum(counts))
    weights = torch.randn(len(counts), 192, 96, generator=gen).to(dtype)
    packed = torch.stack([module.simd_pack_linear_weight(w) for w in weights])
    offsets = torch.tensor([0, *counts]).cumsum(0)
    x = torch.randn(sum(counts), 96, generator=gen).to(dtype)
    got = module.grouped_simd_linear(x, packed, offsets)
    for expert, weight in enumerate(weights):
        rows = slice(offsets[expert], offsets[expert + 1])
        if counts[expert]:
            assert torch.equal(got[rows], module.simd_linear(x[rows], packed[expert], None))


@pytest.mark.skipif(not _simd_linear_usable(torch.float32), reason="the SIMD linear needs a build and a CPU with "
                    "AVX-512 or AVX2 and FMA")
def test_grouped_simd_linear_refuses_offsets_that_do_not_cover_its_rows():
    module = cpu_ops.load()
    packed = torch.stack([module.simd_pack_linear_weight(torch.zeros(64, 64)) for _ in range(3)])
    x = torch.zeros(5, 64)
    for offsets, reason in [([0, 2, 4, 6], "rise from 0 to x's 5 rows"), ([0, 3, 2, 5], "rise from 0"),
                            ([0, 5], "int64 \\[experts \\+ 1\\]")]:
        with pytest.raises(RuntimeError, match=reason):
            module.grouped_simd_linear(x, packed, torch.tensor(offsets))
    with pytest.raises(RuntimeError, match="x in the weights' dtype with their features"):
        module.grouped_simd_linear(torch.zeros(5, 32), packed, torch.tensor([0, 1, 2, 5]))


@pytest.mark.skipif(not _simd_linear_usable(torch.float32), reason="the SIMD linear needs a build and a CPU with "
                    "AVX-512 or AVX2 and FMA")
def test_simd_linear_refuses_what_it_cannot_take():
    module = cpu_ops.load()
    dtype = torch.bfloat16 if _simd_linear_usable(torch.bfloat16) else torch.float32
    refused = [torch.zeros(72, 64, dtype=dtype), torch.zeros(64, 64, dtype=torch.float16), torch.zeros(64)]
    if dtype == torch.bfloat16:  # a bf16 lane holds two depths
        refused.append(torch.zeros(64, 63, dtype=dtype))
    for weight in refused:
        assert not module.simd_linear_usable(weight)
        with pytest.raises(RuntimeError, match="out a multiple of (16|64)"):
            module.simd_pack_linear_weight(weight)
    packed = module.simd_pack_linear_weight(torch.zeros(64, 64, dtype=dtype))
    with pytest.raises(RuntimeError, match="takes 64"):
        module.simd_linear(torch.zeros(2, 32, dtype=dtype), packed, None)
    with pytest.raises(RuntimeError, match="x in the weight's dtype"):
        module.simd_linear(torch.zeros(2, 64, dtype=torch.float16), packed, None)
    with pytest.raises(RuntimeError, match="bias of 3 values"):
        module.simd_linear(torch.zeros(2, 64, dtype=dtype), packed, torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepacked_linear_takes_the_simd_kernel_without_amx(dtype):
    """Without AMX, a PrepackedLinear runs its own kernel and gives oneDNN's results within the dtype's rounding, 2-D
    or 3-D: at every row count with no oneDNN copy kept (bf16, and float32 with AVX2), or up to FP32_MAX_ROWS rows
    and oneDNN itself beyond, bitwise its result (float32 with AVX-512)."""
    from engine.layers.linear import FP32_MAX_ROWS, CppLinearKernels, PrepackedLinear

    if cpu_ops.has_cpu_flag("amx_bf16") or not _simd_linear_usable(dtype):
        pytest.skip("the SIMD linear serves CPUs that have it and no AMX")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 960, bias=True).to(dtype)
    own, onednn = PrepackedLinear(linear, CppLinearKernels(cpu_ops.load())), PrepackedLinear(linear)
    limit = FP32_MAX_ROWS if dtype == torch.float32 and cpu_ops.has_cpu_flag("avx512f") else None
    assert own.kernel.name == "simd" and own.kernel.max_rows == limit and onednn.kernel is None
    assert (own.packed_weight is None) == (limit is None)
    tolerance = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for shape in ((3, 576), (64, 576), (FP32_MAX_ROWS + 1, 576), (2, 5, 576)):
        x = torch.randn(*shape).to(dtype)
        got, want = own(x), onednn(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **tolerance)
        rows = x.reshape(-1, 576)
        if limit is not None and rows.shape[0] > limit:
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.reshape(-1, 960), cpu_ops.load().simd_linear(rows, own.own_weight, own.bias))


@pytest.mark.skipif(not _widens_bf16(), reason="bf16 weights with float32 rows: a build with AVX2 and no AVX-512")
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_simd_linear_widens_bf16_weights_exactly(rows, bias):
    """bf16 weights against float32 rows give bit for bit what the float32 kernel gives on the same weights in
    float32 (the widening is exact and the sums run in the same order), within float32 rounding of float64; a
    column block's two vectors packed into one word, so a swapped half shows up as wrong columns."""
    module = cpu_ops.load()
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen)
    b = torch.randn(960, generator=gen) if bias else None
    packed = module.simd_pack_linear_weight(w)
    assert packed.dtype == torch.bfloat16 and packed.numel() == w.numel()
    got = module.simd_linear(x, packed, b)
    assert got.dtype == torch.float32
    assert torch.equal(got, module.simd_linear(x, module.simd_pack_linear_weight(w.float()), b))
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((got.double() - want).abs() <= 1e-5 * (want.abs() + want.abs().max())).all()
    with pytest.raises(RuntimeError, match="float32 for a bf16 weight"):
        module.simd_linear(x.bfloat16(), packed, b)


@pytest.mark.skipif(not _widens_bf16(), reason="bf16 weights with float32 rows: a build with AVX2 and no AVX-512")
def test_prepacked_linear_keeps_bf16_storage_where_the_kernel_widens_it():
    """A float32 linear holding bf16 values, prepacked with storage_dtype bf16: its weight is stored in bf16 (half
    the bytes) and it computes bit for bit what the same linear stored in float32 computes, 2-D or 3-D; a bf16
    weight with bf16 rows gets no own kernel there."""
    from engine.layers.linear import CppLinearKernels, PrepackedLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 960, bias=True)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.bfloat16())
    kernels = CppLinearKernels(cpu_ops.load())
    narrow, wide = PrepackedLinear(linear, kernels, torch.bfloat16), PrepackedLinear(linear, kernels)
    assert narrow.own_weight.dtype == torch.bfloat16 and narrow.packed_weight is None
    assert narrow.own_weight.numel() == wide.own_weight.numel() and wide.own_weight.dtype == torch.float32
    for shape in ((1, 576), (64, 576), (2, 5, 576)):
        x = torch.randn(*shape)
        assert torch.equal(narrow(x), wide(x))
    assert kernels.for_weight(linear.weight.bfloat16()) is None
    assert kernels.for_weight(linear.weight.bfloat16(), torch.float32).name == "simd"


def test_the_build_compiles_every_source_once_in_two_units(tmp_path):
    """The two generated units include every kernel source once between them, the bindings' unit first."""
    units = cpu_ops.unity_sources(tmp_path)
    included = [line.split('"')[1] for unit in units for line in unit.read_text().splitlines()
                if line.startswith("#include")]
    assert len(units) == 2 and included[0] == str(cpu_ops.BINDINGS)
    assert sorted(included) == sorted(str(source) for source in cpu_ops.SOURCES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_norms_scale_in_float32_as_transformers(dtype):
    """Gemma's norms keep 1 + w in float32 and scale the float32 row by it, rounding once, as transformers'
    Gemma2RMSNorm does: the PyTorch path bitwise, the C++ operators (plain and after the residual addition) on most
    elements; the Llama rounding (1 + w in the model dtype, the row rounded before the scale) differs."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(5)
    width = 576
    reference = Gemma2RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_((torch.randn(width, generator=gen) * 0.3).to(dtype).float())
    norm = RMSNorm(width, 1e-6, float32_scale=True)
    with torch.no_grad():
        norm.weight.copy_(reference.weight + 1.0)
    x = (torch.randn(37, width, generator=gen) * 3).to(dtype)
    want = reference.to(dtype)(x)
    assert norm.weight.dtype == torch.float32 and torch.equal(norm(x), want)
    llama = RMSNorm(width, 1e-6).to(dtype)
    with torch.no_grad():
        llama.weight.copy_(norm.weight)
    assert (llama(x) != want).float().mean() > 0.05
    norm.fused_ops = cpu_ops.load()
    _assert_norms_match(norm(x), want, dtype)
    residual, delta = x.clone(), (torch.randn(37, width, generator=gen)).to(dtype)
    _assert_norms_match(norm.add_and_norm(delta, residual), reference.to(dtype)(x + delta), dtype)
    assert torch.equal(residual, x + delta)
