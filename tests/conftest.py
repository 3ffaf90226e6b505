"""Shared fixtures: the embedded SmolLM2 model, tiny random-weight models built from configs, and one Ray cluster
with Serve for the modules that serve apps (helpers that are not fixtures: tests/helpers.py)."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from dataclasses import dataclass
from pathlib import Path

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

from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from engine.config import default_cache_dir
from engine.model_files import resolve_model

SHARED_CLUSTER = "serve_cluster"


def pytest_collection_modifyitems(items):
    """The modules that use the shared cluster run last, together, in their usual order: it starts once, at the
    first of them, and no other test shares the cores with its idle processes or finds Ray already started."""
    shared = {item.path for item in items if SHARED_CLUSTER in item.fixturenames}
    items.sort(key=lambda item: item.path in shared)


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_each_module():
    """A module's engines and HF references freed at its end. An engine in a reference cycle (a test's patch
    closing over an engine's own method) is freed only by the collector's full pass, which few allocations trigger
    while each engine holds hundreds of MB: without this the suite's process grew by gigabytes."""
    yield
    from tests.helpers import forget_hf_models

    forget_hf_models()
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """Freed heap memory handed back to the kernel (glibc keeps what sits below a live allocation), so that the
    suite's resident memory is what its live objects take."""
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


@dataclass(frozen=True)
class ServeCluster:
    url: str  # Serve's HTTP proxy
    metrics_url: str  # Ray's Prometheus export
    temp: Path  # Ray's temporary folder, its logs included


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory):
    """One local Ray cluster of 4 logical CPUs with Serve's HTTP proxy, for the modules that serve apps on one
    node (each deploys its own app and deletes it: tests/helpers.py serving). Starting Ray and Serve and shutting
    them down again cost about 14 s a module on 2 cores. Modules that need a cluster of their own (several nodes,
    environment variables read at start) start it and run before these."""
    from engine.free_ports import free_port
    from tests.helpers import ray_and_serve

    port, metrics_port, temp = free_port(), free_port(), tmp_path_factory.mktemp("ray")
    with ray_and_serve({"http_options": {"host": "127.0.0.1", "port": port}}, num_cpus=4, include_dashboard=False,
                       _temp_dir=str(temp), _metrics_export_port=metrics_port):
        yield ServeCluster(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", temp)


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def _tiny_decoder(tokenizer, **architecture) -> dict:
    """The shape every tiny Llama-family model here shares (2 layers, 64 wide, 4 query and 2 KV heads), with the
    config arguments of its own architecture. A large init range makes the random model's logits peaked, so greedy
    choices are not near-ties."""
    return dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                eos_token_id=tokenizer.eos_token_id, **architecture)


def _save_tiny(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(**_tiny_decoder(tokenizer, tie_word_embeddings=False))
    return _save_tiny(LlamaForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory, tokenizer):
    torch.manual_seed(1)
    config = Qwen2Config(**_tiny_decoder(tokenizer, tie_word_embeddings=True))
    return _save_tiny(Qwen2ForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory, tokenizer):
    """Qwen3's layers: each query and key head normalized before the rotary embedding, head_dim apart from
    hidden / heads."""
    torch.manual_seed(4)
    config = Qwen3Config(**_tiny_decoder(tokenizer, head_dim=32, tie_word_embeddings=True))
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norm scales away from 1, so that a missing or misplaced norm shows
        for name, param in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                param.uniform_(0.5, 1.5)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_mistral_path(tmp_path_factory, tokenizer):
    """Mistral's architecture (Llama's layers) with attention that slides over 64 tokens, as Mistral 7B v0.1's over
    4,096."""
    torch.manual_seed(3)
    config = MistralConfig(**_tiny_decoder(tokenizer, sliding_window=64, tie_word_embeddings=False))
    return _save_tiny(MistralForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="session")
def tiny_phi3_path(tmp_path_factory, tokenizer):
    """Phi-3's layers: q/k/v and gate/up stored fused in the checkpoint (qkv_proj, gate_up_proj)."""
    torch.manual_seed(5)
    config = Phi3Config(**_tiny_decoder(tokenizer, original_max_position_embeddings=512, sliding_window=None,
                                        tie_word_embeddings=False, pad_token_id=0,
                                        bos_token_id=tokenizer.bos_token_id))
    return _save_tiny(Phi3ForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-phi3"))


@pytest.fixture(scope="session")
def tiny_phi4_path(tmp_path_factory, tokenizer):
    """Phi-4-mini's layers: Phi-3's, with a rotary embedding that turns only the first part of each head
    (partial_rotary_factor) and tied embeddings."""
    torch.manual_seed(8)
    config = Phi3Config(**_tiny_decoder(tokenizer, original_max_position_embeddings=512, partial_rotary_factor=0.5,
                                        sliding_window=None, tie_word_embeddings=True, pad_token_id=0,
                                        bos_token_id=tokenizer.bos_token_id))
    return _save_tiny(Phi3ForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-phi4"))


@pytest.fixture(scope="session")
def tiny_smollm3_path(tmp_path_factory, tokenizer):
    """SmolLM3's layers: Llama's, with every second one here attending without the rotary embedding (its
    no_rope_layers; every fourth in SmolLM3-3B)."""
    torch.manual_seed(9)
    config = SmolLM3Config(**_tiny_decoder(tokenizer, no_rope_layer_interval=2, tie_word_embeddings=True,
                                           pad_token_id=0, bos_token_id=tokenizer.bos_token_id))
    assert config.no_rope_layers == [1, 0]
    return _save_tiny(SmolLM3ForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-smollm3"))


@pytest.fixture(scope="session")
def tiny_granite_path(tmp_path_factory, tokenizer):
    """Granite's layers: Llama's, with its four scalars away from 1 (embeddings, residual additions, attention scale,
    logits), so that a missing or misplaced one shows."""
    torch.manual_seed(10)
    config = GraniteConfig(**_tiny_decoder(tokenizer, embedding_multiplier=6.0, residual_multiplier=0.3,
                                           attention_multiplier=0.125, logits_scaling=2.5, tie_word_embeddings=True,
                                           pad_token_id=0, bos_token_id=tokenizer.bos_token_id))
    return _save_tiny(GraniteForCausalLM(config), tokenizer, tmp_path_factory.mktemp("tiny-granite"))


@pytest.fixture(scope="session")
def tiny_gemma_path(tmp_path_factory, tokenizer):
    """Gemma's layers: norms that scale by 1 + weight, embeddings times sqrt(hidden), a GELU-gated MLP, head_dim
    apart from hidden / heads."""
    torch.manual_seed(6)
    config = GemmaConfig(**_tiny_decoder(tokenizer, head_dim=32, pad_token_id=0, bos_token_id=tokenizer.bos_token_id))
    model = GemmaForCausalLM(config)
    with torch.no_grad():  # norm weights away from 0 (a scale of 1), so that a norm computed as Llama's shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-gemma"))


@pytest.fixture(scope="session")
def tiny_gemma2_path(tmp_path_factory, tokenizer):
    """Gemma 2's layers: Gemma's, with sandwich norms, an attention scale of its own (query_pre_attn_scalar apart
    from head_dim), attention scores and logits soft-capped by tanh, and a layer attending over a sliding window of
    24 tokens beside a global one. The attention cap is low, so that without it every prompt's tokens change; the
    output norms scale by 4-7, so that the layers outweigh the embedding and the text does not repeat one token."""
    torch.manual_seed(11)
    config = Gemma2Config(**_tiny_decoder(tokenizer, head_dim=32, query_pre_attn_scalar=16,
                                          attn_logit_softcapping=4.0, final_logit_softcapping=3.0, sliding_window=24,
                                          pad_token_id=0, bos_token_id=tokenizer.bos_token_id))
    return _save_tiny(_gemma_norms_away_from_one(Gemma2ForCausalLM(config)), tokenizer,
                      tmp_path_factory.mktemp("tiny-gemma2"))


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory, tokenizer):
    """Gemma 3's text layers: Gemma 2's without the soft-capping, with per-head query and key norms (1 + weight), a
    sliding layer of 24 tokens whose rotary embedding turns by a base of its own, and a global one whose rotary is
    linearly scaled."""
    torch.manual_seed(12)
    config = Gemma3TextConfig(**_tiny_decoder(
        tokenizer, head_dim=32, query_pre_attn_scalar=16, sliding_window=24,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=tokenizer.bos_token_id,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}))
    return _save_tiny(_gemma_norms_away_from_one(Gemma3ForCausalLM(config)), tokenizer,
                      tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="session")
def tiny_olmo2_path(tmp_path_factory, tokenizer):
    """OLMo 2's layers: no input norms, attention and MLP outputs normalized before the residual add, the query and
    key projections normalized whole; every norm's scale away from 1, so that each shows."""
    torch.manual_seed(13)
    config = Olmo2Config(**_tiny_decoder(tokenizer, pad_token_id=0, bos_token_id=tokenizer.bos_token_id,
                                         tie_word_embeddings=False))
    model = Olmo2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(2.0, 4.0) if ".post_" in name else param.uniform_(0.5, 1.5)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-olmo2"))


def _tiny_moe(config_class, model_class, tokenizer, seed: int, **architecture):
    """A tiny mixture of experts on the tiny decoders' shape, 3 layers of 8 experts, 2 a token: its router and
    experts drawn at the tiny models' scale (transformers leaves stacked expert tensors to its init), so routing is
    decided, not near-tied."""
    torch.manual_seed(seed)
    config = config_class(**{**_tiny_decoder(tokenizer, tie_word_embeddings=False), "num_hidden_layers": 3,
                             "num_experts_per_tok": 2, **architecture})
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path(tmp_path_factory, tokenizer):
    """Qwen3-MoE: Qwen3's attention, experts in layers 0 and 2 and a dense MLP in layer 1 (mlp_only_layers), the
    top 2 weights renormalized (norm_topk_prob)."""
    model = _tiny_moe(Qwen3MoeConfig, Qwen3MoeForCausalLM, tokenizer, 21, num_experts=8, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1], head_dim=16)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="session")
def tiny_mixtral_path(tmp_path_factory, tokenizer):
    """Mixtral: Mistral's attention, experts in every layer, saved under block_sparse_moe as its checkpoints are."""
    model = _tiny_moe(MixtralConfig, MixtralForCausalLM, tokenizer, 22, num_local_experts=8,
                      intermediate_size=32)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-mixtral"))


@pytest.fixture(scope="session")
def tiny_olmoe_path(tmp_path_factory, tokenizer):
    """OLMoE: the query and key projections normalized whole, experts in every layer, top 2 weights as routed
    (norm_topk_prob false)."""
    model = _tiny_moe(OlmoeConfig, OlmoeForCausalLM, tokenizer, 23, num_experts=8, intermediate_size=32,
                      norm_topk_prob=False, pad_token_id=0, bos_token_id=tokenizer.bos_token_id)
    return _save_tiny(model, tokenizer, tmp_path_factory.mktemp("tiny-olmoe"))


def _gemma_norms_away_from_one(model):
    """Norm weights away from 0 (a scale of 1), so that each norm shows; the output norms scaling by 4-7."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(3.0, 6.0) if ".post_" in name else param.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="session")
def tiny_gpt2_path(tmp_path_factory, tokenizer):
    torch.manual_seed(2)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                        bos_token_id=tokenizer.bos_token_id)
    return _save_tiny(GPT2LMHeadModel(config), tokenizer, tmp_path_factory.mktemp("tiny-gpt2"))
