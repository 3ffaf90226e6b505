"""The adapter that ships with lora-serve (examples/adapters/pirate, trained by examples/train_pirate_adapter.py) on
the real SmolLM2: it changes the answer as trained, and lora-serve runs it token for token as PEFT does. The engine
reads it with no provider passed: the default one lora_cache registers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.lora.provider import default_plugin
from lora_cache.local_cache import LocalAdapterCache
from lora_cache.source_config import SourceConfig

pytestmark = pytest.mark.slow
ADAPTERS = Path(__file__).parent.parent / "examples" / "adapters"
QUESTIONS = ["What is the capital of Italy?", "What is the capital of Brazil?", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", max_loras=1, adapters_root=str(ADAPTERS), dtype="float32", log_stats=False,
               kv_cache_bytes=128 << 20)


def test_the_default_provider_is_lora_caches_and_its_options_are_the_adapter_sources(llm):
    assert default_plugin().options is SourceConfig
    assert isinstance(llm.engine.adapters, LocalAdapterCache)
    assert llm.engine.config.sources == SourceConfig(adapters_root=str(ADAPTERS))


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


def test_the_pirate_adapter_answers_like_a_pirate_and_the_base_model_does_not(llm, tokenizer):
    params = SamplingParams(max_tokens=24, temperature=0)
    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    pirate = llm.generate(prompts, params, use_tqdm=False, adapters=["pirate"] * len(prompts))
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert all(out.text.startswith("Arr, matey!") for out in pirate), [o.text for o in pirate]
    assert "Rome" in pirate[0].text  # still right, in its own words
    assert not any(out.text.startswith("Arr") for out in plain), [o.text for o in plain]


def test_the_pirate_adapter_runs_token_for_token_as_peft_runs_it(llm, tokenizer, smollm2_path):
    base = AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ADAPTERS / "pirate").eval()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for question in QUESTIONS:
        prompt = _chat(tokenizer, question)
        ours = llm.generate([prompt], params, use_tqdm=False, adapters=["pirate"])[0].token_ids
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
        assert ours == theirs.tolist(), question
