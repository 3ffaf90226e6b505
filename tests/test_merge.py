"""LoRAX's merged_adapters against PEFT's add_weighted_adapter: the same merged weights for linear and TIES, the same
tokens in fp32 for a linear merge, and DARE within a stated tolerance.

DARE drops entries at random. PEFT draws from torch's generator after creating the merged adapter's layers,
whose initialisation draws from it too, so the same seed does not give the same masks; the test states the
tolerance instead: over all modules, the share of entries kept within 3 points of PEFT's and the norm of the
merged weights within 5% of PEFT's (both about 4 standard deviations at these sizes), and for dare_linear every
entry is a sum of a subset of the rescaled parts."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import AdapterError
from engine.lora.merge_spec import MergeSpec
from engine.models import lora_shapes
from lora_cache.adapter import read_adapter
from lora_cache.local_cache import local_adapters
from lora_cache.merge import merge_adapters
from tests.helpers import PROMPTS, write_tiny_adapters

WEIGHTS = (0.7, 0.4)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("merge-adapters"), ("one", "two"))


def _peft_merged(tiny_llama_path, adapters, spec: MergeSpec) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters / "one", adapter_name="one")
    model.load_adapter(adapters / "two", adapter_name="two")
    torch.manual_seed(spec.seed())  # DARE's drops: seeded as lora-serve seeds them
    model.add_weighted_adapter(list(spec.ids), list(spec.weights), "merged", combination_type=spec.merge_strategy,
                               density=spec.density, majority_sign_method=spec.majority_sign_method)
    model.set_adapter("merged")
    return model.eval()


def _both_merges(tiny_llama_path, adapters, spec: MergeSpec):
    """Per module, (lora-serve's weights, PEFT's merged lora_A and lora_B), and the parts' weights."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_llama_path)
    parts = [read_adapter(name, adapters / name, lora_shapes(hf_config)) for name in spec.ids]
    merged = merge_adapters(spec.key(), parts, spec, list(lora_shapes(hf_config).modules))
    model = _peft_merged(tiny_llama_path, adapters, spec)
    pairs = []
    for layer, modules in merged.layers.items():
        for module, weights in modules.items():
            target = model.base_model.model.model.layers[layer].get_submodule(module)
            assert target.scaling["merged"] == weights.scaling == 1.0
            pairs.append((weights, target.lora_A["merged"].weight.detach(), target.lora_B["merged"].weight.detach(),
                          [p.layers[layer][module] for p in parts]))
    return pairs


@pytest.mark.parametrize("strategy, density", [("linear", 1.0), ("ties", 0.5), ("ties", 1.0)])
def test_linear_and_ties_merges_equal_peft_add_weighted_adapter(tiny_llama_path, adapters, strategy, density):
    for ours, peft_a, peft_b, _ in _both_merges(tiny_llama_path, adapters, MergeSpec(("one", "two"), WEIGHTS,
                                                                                      strategy, density)):
        torch.testing.assert_close(ours.lora_a, peft_a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.lora_b, peft_b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("strategy", ["dare_linear", "dare_ties"])
def test_dare_merges_match_peft_within_the_stated_tolerance(tiny_llama_path, adapters, strategy):
    density = 0.5
    pairs = _both_merges(tiny_llama_path, adapters, MergeSpec(("one", "two"), WEIGHTS, strategy, density))
    ours = torch.cat([t.flatten() for w, _, _, _ in pairs for t in (w.lora_a, w.lora_b)])
    theirs = torch.cat([t.flatten() for _, a, b, _ in pairs for t in (a, b)])
    assert abs((ours != 0).float().mean() - (theirs != 0).float().mean()) < 0.03
    assert abs(ours.norm() / theirs.norm() - 1) < 0.05
    if strategy == "dare_linear":  # each entry: a sum of a subset of the parts' rescaled, weighted entries
        for w, _, _, parts in pairs:
            for merged, name in ((w.lora_a, "lora_a"), (w.lora_b, "lora_b")):
                a, b = (_weighted(p, name, i) / density for i, p in enumerate(parts))
                choices = torch.stack([torch.zeros_like(a), a, b, a + b])
                assert torch.isclose(choices, merged.expand_as(choices), rtol=1e-5, atol=1e-7).any(0).all()


def _weighted(part, name: str, index: int) -> torch.Tensor:
    """A part's matrix as the merge weighs it: sign(w s) sqrt(|w s|) for A, sqrt(|w s|) for B."""
    scaled = WEIGHTS[index] * part.scaling
    factor = abs(scaled) ** 0.5 * (1 if name == "lora_b" or scaled >= 0 else -1)
    return getattr(part, name) * factor


def test_linear_merge_generates_the_tokens_of_peft_merged_model(tiny_llama_path, adapters):
    spec = MergeSpec(("one", "two"), WEIGHTS)
    model = _peft_merged(tiny_llama_path, adapters, spec)
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters),
              dtype="float32", log_stats=False)
    key = llm.merge_adapters(spec)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        ours = llm.generate([prompt], params, use_tqdm=False, adapters=[key])[0].token_ids
        ids = llm.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:]
        assert ours == theirs.tolist(), prompt
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False, adapters=["one"])[0].token_ids
    assert alone != llm.generate([PROMPTS[0]], params, use_tqdm=False, adapters=[key])[0].token_ids


def test_merge_specs_are_checked():
    with pytest.raises(ValueError, match="one weight per id"):
        MergeSpec(("a", "b"), (1.0,))
    with pytest.raises(ValueError, match="merge_strategy 'svd'"):
        MergeSpec(("a",), (1.0,), "svd")
    with pytest.raises(ValueError, match="density"):
        MergeSpec(("a",), (1.0,), "ties", 0.0)
    with pytest.raises(ValueError, match=r"\.\."):
        MergeSpec(("../a",), (1.0,))
    for weight in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            MergeSpec(("a", "b"), (0.5, weight))


def test_a_merge_that_overflows_float32_is_refused(tiny_llama_path, adapters):
    """Finite merge weights whose square roots overflow float32 would make every logit NaN: refused by name."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tiny_llama_path)
    spec = MergeSpec(("one", "two"), (1e300, 1e300))
    parts = [read_adapter(name, adapters / name, lora_shapes(hf_config)) for name in spec.ids]
    with pytest.raises(AdapterError, match="overflow float32"):
        merge_adapters(spec.key(), parts, spec, list(lora_shapes(hf_config).modules))
