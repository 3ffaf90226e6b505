"""Quantized base weights (bitsandbytes int8 / NF4) with LoRA adapters on top, and memory accounting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.layers.linear import PrepackedLinear
from engine.layers.quantized import dequantized_weight
from engine.lora.linear import LoRALinear
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
# Against the dequantized weights in fp32: int8 (LLM.int8) also rounds the activations to int8, and NF4 on an
# AVX-512 BF16 CPU computes in bf16.
TOLERANCE = {"nf4": dict(atol=0.05, rtol=0.05), "int8": dict(atol=0.05, rtol=0.05)}


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("quant-adapters"), ("alpha",))


def _quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    import bitsandbytes as bnb

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)):
            found[name.removesuffix(".base")] = module
    return found


def _with_dequantized_weights(reference: LLM, quantized: LLM) -> None:
    """Give the reference (fp32) engine's linears the weights the quantized engine computes with."""
    model = reference.engine.runner.model
    for path, module in _quantized_linears(quantized.engine.runner.model).items():
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            linear.weight.copy_(dequantized_weight(module))
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        parent_path, _, name = path.rpartition(".")
        parent, current = model.get_submodule(parent_path), model.get_submodule(path)
        if isinstance(current, LoRALinear):
            current.base = PrepackedLinear(linear)
        else:
            setattr(parent, name, PrepackedLinear(linear))


@pytest.mark.parametrize("method, bits", [("int8", 8), ("nf4", 4)])
def test_adapter_on_quantized_base_matches_a_dequantized_reference(tiny_llama_path, adapters_root, method, bits):
    options = dict(adapters=local_adapters, dtype="float32", max_loras=2, adapters_root=str(adapters_root),
                   log_stats=False)
    quantized = LLM(str(tiny_llama_path), quantization=method, **options)
    linears = _quantized_linears(quantized.engine.runner.model)
    assert len(linears) == 2 * 4  # q/k/v, o, gate/up, down in each of the 2 layers
    assert all(m.weight.data.numel() * m.weight.data.element_size() * 8 == m.in_features * m.out_features * bits
               for m in linears.values())

    # the modules' path: the linears are swapped below, after the engine built its decoder stack on the old ones
    reference = LLM(str(tiny_llama_path), decoder_stack=False, **options)
    _with_dequantized_weights(reference, quantized)  # before any forward: bnb's CPU kernel then repacks NF4

    prompts = PROMPTS[:4]
    with_adapter = quantized.generate(prompts, GREEDY, use_tqdm=False, adapters=["alpha"] * 4)
    base = quantized.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in with_adapter] != [o.token_ids for o in base]  # the adapter changes the output

    first = SamplingParams(max_tokens=1, temperature=0, logprobs=5)  # one step: no divergence can compound
    got = quantized.generate(PROMPTS, first, use_tqdm=False, adapters=["alpha"] * len(PROMPTS))
    want = reference.generate(PROMPTS, first, use_tqdm=False, adapters=["alpha"] * len(PROMPTS))
    agree = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
    assert agree >= len(PROMPTS) - 1  # a near-tie may flip one
    for g, w in zip(got, want):
        common = [t for t in w.top_logprobs[0] if t in g.top_logprobs[0]]
        assert len(common) >= 3
        torch.testing.assert_close(torch.tensor([g.top_logprobs[0][t] for t in common]),
                                   torch.tensor([w.top_logprobs[0][t] for t in common]), **TOLERANCE[method])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_quantized_smollm2_still_knows_paris(smollm2_path, method):
    llm = LLM(str(smollm2_path), dtype="bfloat16", quantization=method, log_stats=False)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert "Paris" in out.text
    full = LLM(str(smollm2_path), dtype="bfloat16", log_stats=False).engine.memory()
    assert llm.engine.memory().total_weight_bytes < 0.75 * full.total_weight_bytes


@pytest.mark.parametrize("method", ["none", "int8", "nf4"])
def test_reported_footprint_equals_the_tensors_bytes(tiny_llama_path, adapters_root, method):
    llm = LLM(str(tiny_llama_path), dtype="float32", quantization=method, adapters=local_adapters, max_loras=2,
              adapters_root=str(adapters_root), log_stats=False)
    report = llm.engine.memory()
    model = llm.engine.runner.model
    storages = {}
    for module in model.modules():
        if isinstance(module, LoRALinear):
            continue  # its own tensors are the slots; its base is visited as a child
        tensors = list(module.parameters(recurse=False)) + [b for b in module.buffers(recurse=False) if b is not None]
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        int8_state = getattr(module, "state", None)
        tensors += [t for t in (getattr(weight, "SCB", None), getattr(int8_state, "SCB", None),
                                state and state.absmax, state and state.code) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.is_mkldnn:  # a oneDNN-prepacked weight: opaque, its own size
                storages[id(t)] = t.numel() * t.element_size()
            else:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert report.total_weight_bytes == sum(storages.values())
    slots = [m.packed for m in model.modules() if isinstance(m, LoRALinear)]
    assert report.adapter_slot_bytes == sum(s.numel() * s.element_size() for s in slots) > 0
    layout = llm.engine.runner.layout
    cache = llm.engine.runner.kv_caches[0][0]
    assert report.kv_bytes_per_token == 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 4
    assert report.kv_bytes == 2 * len(llm.engine.runner.kv_caches) * cache.numel() * cache.element_size()


def test_footprints_shrink_with_the_bits(tiny_llama_path):
    totals = {m: LLM(str(tiny_llama_path), dtype="float32", quantization=m, log_stats=False).engine.memory()
              for m in ("none", "int8", "nf4")}
    assert totals["nf4"].weight_bytes["uint8"] > 0 and totals["int8"].weight_bytes["int8"] > 0
    assert totals["nf4"].total_weight_bytes < totals["int8"].total_weight_bytes < totals["none"].total_weight_bytes


def test_kv_budget_as_a_share_of_free_memory_and_bad_options(tiny_llama_path):
    import psutil

    llm = LLM(str(tiny_llama_path), kv_cache_memory_fraction=0.01, log_stats=False)
    budget = 0.01 * psutil.virtual_memory().available
    assert 0.5 * budget < llm.engine.memory().kv_bytes <= 1.5 * budget
    with pytest.raises(ValueError, match="quantization must be one of none, int8, nf4"):
        LLM(str(tiny_llama_path), quantization="int4", log_stats=False)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        LLM(str(tiny_llama_path), kv_cache_memory_fraction=1.5, log_stats=False)
