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
