"""Model resolution: the embedded default, local folders, and clear errors."""

from __future__ import annotations

import pytest

from engine import LLM, ModelNotFoundError
from engine.model_files import resolve_model


def test_embedded_model_resolves_to_converted_folder(smollm2_path):
    assert (smollm2_path / "config.json").is_file()
    assert list(smollm2_path.glob("*.safetensors"))
    assert resolve_model("SmolLM2-135M-Instruct", smollm2_path.parent) == smollm2_path


def test_unknown_model_gives_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found.*smollm2-135m-instruct"):
        resolve_model("no-such-org/no-such-model", tmp_path)


def test_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path), tmp_path)


def test_unknown_engine_option_is_refused(tiny_llama_path):
    with pytest.raises(TypeError, match="unknown engine option.*max_num_sequences"):
        LLM(str(tiny_llama_path), max_num_sequences=4)


@pytest.mark.parametrize("option", [{"adapter_cache_timeout_s": 0}, {"adapter_cache_timeout_s": -1.0}])
def test_a_bound_that_is_not_positive_is_refused_by_name(option):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match=f"{next(iter(option))} must be positive"):
        EngineConfig.from_overrides(**option)


def test_startup_prints_kv_figures(tiny_llama_path, capsys):
    LLM(str(tiny_llama_path), kv_cache_bytes=1 << 20)
    out = capsys.readouterr().out
    assert "KiB/token" in out and "tokens" in out


def test_dummy_weights_load_and_generate(tiny_llama_path):
    """load_format "dummy": random weights from the config alone, no checkpoint read; differ from the checkpoint's
    and still serve a request to its length."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    dummy = LLM(str(tiny_llama_path), load_format="dummy", log_stats=False)
    real = LLM(str(tiny_llama_path), log_stats=False)
    dummy_out, real_out = dummy.generate(["Hello"], params)[0], real.generate(["Hello"], params)[0]
    assert len(dummy_out.token_ids) == 5 and dummy_out.token_ids != real_out.token_ids


def test_checkpoint_missing_part_of_a_fused_weight_is_refused(tiny_llama_path, tmp_path):
    """q/k/v (and gate/up) load into one fused weight whose storage starts unfilled: a checkpoint that holds q and v
    but not k must be refused by name, not served with the missing rows' leftover memory."""
    import shutil

    from safetensors.torch import load_file, save_file

    for file in tiny_llama_path.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, tmp_path / file.name)
    tensors = load_file(str(tiny_llama_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks part of the fused weights.*layers.1.self_attn.qkv_proj.weight"):
        LLM(str(tmp_path), log_stats=False)


def test_dummy_weights_are_finite_with_zero_biases(tiny_qwen2_path):
    """Built without drawing initial weights, a dummy model still has every value set: matrices drawn, q/k/v biases
    (Qwen2's) zero, norm scales one. On the engine's device (CUDA with LORA_SERVE_DEVICE=cuda)."""
    import torch
    from transformers import AutoConfig

    from engine.config import EngineConfig
    from engine.models import load_model

    config = AutoConfig.from_pretrained(tiny_qwen2_path)
    device = EngineConfig.from_overrides(str(tiny_qwen2_path)).backend.torch_device
    model = load_model(tiny_qwen2_path, config, torch.float32, device, 512, load_format="dummy")
    state = model.state_dict()
    # prepacked linears keep their weights in oneDNN's layout (or the engine's own packing) on CPU
    dense = {name: t if t.layout == torch.strided else t.to_dense()
             for name, t in state.items() if t is not None and t.is_floating_point()}
    assert {t.device.type for t in dense.values()} == {device.type}
    assert all(torch.isfinite(t).all() for t in dense.values())
    biases = [t for name, t in dense.items() if name.endswith("qkv_proj.bias")]
    norms = [t for name, t in dense.items() if name.endswith("layernorm.weight")]
    assert len(biases) == 2 and all((t == 0).all() for t in biases)
    assert len(norms) == 4 and all((t == 1).all() for t in norms)
    weights = [t for name, t in dense.items() if "gate_up_proj" in name and t.numel() > 1000]
    assert weights and all(0.015 < t.float().std() < 0.025 for t in weights)


def test_unfilled_modules_follow_the_device_and_dtype_in_force():
    """The engine builds its model under `torch.device(device)` and a default dtype (CUDA on a GPU): the unfilled
    linears and embeddings must land there, as torch's own modules do."""
    import torch

    from engine.layers import uninitialized
    from engine.models import _default_dtype

    with _default_dtype(torch.bfloat16), torch.device("meta"):
        linear, embedding = uninitialized.linear(8, 4, bias=True), uninitialized.embedding(10, 8)
    assert {linear.weight.device.type, linear.bias.device.type, embedding.weight.device.type} == {"meta"}
    assert linear.weight.dtype == linear.bias.dtype == embedding.weight.dtype == torch.bfloat16
    assert linear.weight.shape == (4, 8) and embedding.weight.shape == (10, 8)
    assert type(linear) is torch.nn.Linear and isinstance(embedding, torch.nn.Embedding)
