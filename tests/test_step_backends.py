"""The step backend is chosen once, by device and options, and everything device-specific of a step comes from it:
the C++ operators' backend reads the cache in place and takes adapters' tokens per token; the plain PyTorch one, the
reference, gathers blocks under a mask and groups adapters' tokens into segments. Both give the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends import CpuKernelsBackend, TorchBackend
from engine.kernels import cpu_ops
from engine.layers.attention import GatheredAttention, InPlaceAttention
from engine.lora.backends import CppLoRA, TorchLoRA
from engine.step_inputs import StepInputs
from tests.helpers import PROMPTS

OPTIONS = {"dtype": "float32", "log_stats": False, "max_loras": 2, "kv_cache_bytes": 16 << 20}


def _steps(llm: LLM) -> list[StepInputs]:
    """Every step's inputs as the runner prepared them, while the prompts run to 4 tokens each."""
    runner, seen = llm.engine.runner, []
    prepare = runner.prepare
    runner.prepare = lambda *args: seen.append(prepare(*args)) or seen[-1]
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    return seen


def test_each_backend_builds_its_own_step_metadata_and_the_tokens_agree(tiny_llama_path, tmp_path):
    if cpu_ops.load() is None:
        pytest.skip("the C++ CPU operators do not build here")
    kernels = LLM(str(tiny_llama_path), adapters_root=str(tmp_path), **OPTIONS)
    reference = LLM(str(tiny_llama_path), adapters_root=str(tmp_path), cpu_kernels=False, **OPTIONS)
    assert type(kernels.engine.runner.backend) is CpuKernelsBackend
    assert type(kernels.engine.runner.backend.lora) is CppLoRA
    assert type(reference.engine.runner.backend) is TorchBackend
    assert type(reference.engine.runner.backend.lora) is TorchLoRA
    # bf16 slots: read in place by the C++ call; float32 for PyTorch's batched matmuls on CPU
    assert kernels.engine.runner.backend.lora.slot_dtype(torch.bfloat16) == torch.bfloat16
    assert reference.engine.runner.backend.lora.slot_dtype(torch.bfloat16) == torch.float32
    kernel_steps, reference_steps = _steps(kernels), _steps(reference)
    decode = [step.forward.attention for step in kernel_steps if step.forward.attention.num_decode]
    assert decode and all(type(meta) is InPlaceAttention and meta.in_place is not None for meta in decode)
    decode = [step.forward.attention for step in reference_steps if step.forward.attention.num_decode]
    assert decode and all(type(meta) is GatheredAttention and meta.decode_mask is not None for meta in decode)
    params = SamplingParams(max_tokens=6, temperature=0)
    assert ([out.token_ids for out in kernels.generate(PROMPTS, params, use_tqdm=False)]
            == [out.token_ids for out in reference.generate(PROMPTS, params, use_tqdm=False)])
    kernels.close()
    reference.close()
