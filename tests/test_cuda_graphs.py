"""Decode CUDA graphs (with the in-place paged attention, the LoRA slot-tile kernels and the fused element-wise
operators) equal the eager path; the fused operators equal the eager ops.

CUDA only: these run on a GPU machine with LORA_SERVE_DEVICE=cuda; on CPU they are skipped (the
kernels' own tests run there in Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)


def _run(path, adapters=None, **overrides):
    llm = LLM(str(path), device="cuda", max_num_seqs=16, log_stats=False, **overrides)
    names = adapters or [None] * len(PROMPTS)
    return llm, llm.generate(PROMPTS, PARAMS, use_tqdm=False, adapters=names)


def _compare(eager, graphs, tolerance):
    for a, b in zip(eager, graphs):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tolerance


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_graphs_equal_eager(tiny_llama_path, dtype, tolerance):
    _, eager = _run(tiny_llama_path, dtype=dtype, enforce_eager=True)
    llm, graphs = _run(tiny_llama_path, dtype=dtype)
    assert llm.engine.runner.graphs.replays > 0  # the decode steps went through the graphs
    _compare(eager, graphs, tolerance)


def test_graphs_with_adapters_equal_eager(tiny_llama_path, tmp_path):
    root = write_tiny_adapters(tiny_llama_path, tmp_path, ["a", "b", "c"])
    names = [[None, "a", "b", "c"][i % 4] for i in range(len(PROMPTS))]
    lora = dict(adapters=local_adapters, max_loras=2, max_lora_rank=8,
                adapters_root=str(root))  # 2 slots for 3 adapters: slots reload
    _, eager = _run(tiny_llama_path, names, enforce_eager=True, **lora)
    llm, graphs = _run(tiny_llama_path, names, **lora)
    assert llm.engine.runner.graphs.replays > 0
    _compare(eager, graphs, 1e-4)


def test_fused_ops_equal_eager_ops(tiny_llama_path):
    """The Triton element-wise operators (engine/kernels/cuda_ops.py), on by default, against the eager ops in
    float32: the same tokens. (In bf16 an ulp of difference turns this random model's near-ties into other tokens;
    bf16 is checked against transformers' bf16 teacher-forced in test_hf_equivalence, with the operators on.)"""
    _, plain = _run(tiny_llama_path, dtype="float32", cuda_fused_ops=False)
    llm, fused = _run(tiny_llama_path, dtype="float32")
    assert llm.engine.runner.backend.fused_ops is not None
    _compare(plain, fused, 1e-4)
