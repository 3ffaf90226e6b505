"""Shared fixtures: the embedded SmolLM2 model and tiny random-weight models built from configs (helpers that are
not fixtures: tests/helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels' tests run in its interpreter on CPU; it is read as triton is
    os.environ.setdefault("TRITON_INTERPRET", "1")  # imported, and transformers imports triton below


def _interpreter_scalars_as_indices() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(array), which NumPy
    2.4 refuses: a loop bound read from memory (range(0, length, step)) then fails in the interpreter only."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalars_as_indices()

from transformers import (AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from engine.config import default_cache_dir
from engine.model_files import resolve_model

@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _save_tiny(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    # A large init range makes the random model's logits peaked, so greedy choices are not near-ties.
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    return _save_tiny(LlamaForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, tokenizer):
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    return _save_tiny(Qwen2ForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_gpt2_path(tmp_path_factory, tokenizer):
    torch.manual_seed(2)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)
    return _save_tiny(GPT2LMHeadModel(config), tokenizer, tmp_path_factory.mktemp("tiny-gpt2"))
