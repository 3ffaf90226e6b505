"""LoRA adapter loading: real PEFT adapters on tiny random models, refusals with reasons, adapter sources."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import BertConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from engine.errors import AdapterError
from engine.lora.ids import validate_adapter_id
from engine.models import lora_shapes
from lora_cache.adapter import read_adapter
from lora_cache.local_cache import local_adapters
from lora_cache.make_source import make_source
from lora_cache.source_config import SourceConfig
from lora_cache.sources import HubCacheSource


def _llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, **overrides})


LLAMA = _llama_config()
GPT2 = GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4)
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Q_PROJ_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _peft_model(base_config, folder: Path, **lora_kwargs):
    """A PEFT LoRA model on a tiny random base (B non-zero), saved to `folder`; returns the PEFT model."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(base_config) if base_config.model_type == "llama" else GPT2LMHeadModel(base_config)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs)).eval()
    model.save_pretrained(folder)
    return model


def _delta(weights, x):
    return x @ weights.lora_a.T @ weights.lora_b.T * weights.scaling


def _peft_delta(module, x):
    with torch.no_grad():
        return module(x) - module.base_layer(x)


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-lora")
    return _peft_model(LLAMA, folder, r=8, lora_alpha=16, target_modules=LLAMA_MODULES), folder


@pytest.fixture
def llama_copy(llama_adapter, tmp_path):
    """A copy of the Llama adapter folder that a test may damage."""
    return Path(shutil.copytree(llama_adapter[1], tmp_path / "copy"))


def _edit_config(folder: Path, **changes):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_tensors(folder: Path, edit):
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _refused(folder, *reason_parts, config=LLAMA, adapter_id="acme/x", **kwargs):
    with pytest.raises(AdapterError) as err:
        read_adapter(adapter_id, folder, lora_shapes(config), **kwargs)
    message = str(err.value)
    assert f"adapter '{adapter_id}'" in message
    for part in reason_parts:
        assert part in message, message
    return message


def test_llama_adapter_matches_peft(llama_adapter):
    peft_model, folder = llama_adapter
    adapter = read_adapter("acme/llama", folder, lora_shapes(LLAMA))
    assert adapter.adapter_id == "acme/llama" and adapter.rank == 8
    assert adapter.target_modules == ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                                      "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")
    assert sorted(adapter.layers) == [0, 1]
    shapes = lora_shapes(LLAMA).modules
    assert shapes["self_attn.k_proj"] == (64, 32) and shapes["mlp.down_proj"] == (128, 64)
    for modules in adapter.layers.values():
        for key, weights in modules.items():
            in_features, out_features = shapes[key]
            assert weights.lora_a.shape == (8, in_features) and weights.lora_b.shape == (out_features, 8)
            assert weights.lora_a.dtype == torch.float32 and weights.lora_a.is_contiguous()
            assert weights.scaling == 2.0
    assert adapter.nbytes == 2 * sum(4 * 8 * (i + o) for i, o in shapes.values())

    layer = peft_model.base_model.model.model.layers[1]
    for module, key in [(layer.self_attn.q_proj, "self_attn.q_proj"), (layer.mlp.down_proj, "mlp.down_proj")]:
        x = torch.randn(5, shapes[key][0])
        ours = _delta(adapter.layers[1][key], x)
        assert ours.abs().max() > 1e-3  # a real, non-zero delta
        torch.testing.assert_close(ours, _peft_delta(module, x), atol=1e-5, rtol=1e-5)


def test_rslora_scaling(tmp_path):
    peft_model = _peft_model(LLAMA, tmp_path, r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj"])
    adapter = read_adapter("acme/rs", tmp_path, lora_shapes(LLAMA))
    weights = adapter.layers[0]["self_attn.q_proj"]
    assert weights.scaling == 16 / math.sqrt(4)
    x = torch.randn(3, 64)
    torch.testing.assert_close(_delta(weights, x), _peft_delta(peft_model.base_model.model.model.layers[0]
                                                               .self_attn.q_proj, x), atol=1e-5, rtol=1e-5)


def test_gpt2_adapter_matches_peft(tmp_path):
    # Conv1D stores its weight transposed; PEFT wants fan_in_fan_out=True for it (and warns otherwise).
    peft_model = _peft_model(GPT2, tmp_path, r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    adapter = read_adapter("gpt2-lora", tmp_path, lora_shapes(GPT2))
    assert adapter.target_modules == ("attn.c_attn", "mlp.c_fc") and adapter.rank == 4
    block = peft_model.base_model.model.transformer.h[1]
    x = torch.randn(5, 64)
    for module, key, out_features in [(block.attn.c_attn, "attn.c_attn", 192), (block.mlp.c_fc, "mlp.c_fc", 256)]:
        weights = adapter.layers[1][key]
        assert weights.lora_a.shape == (4, 64) and weights.lora_b.shape == (out_features, 4)
        torch.testing.assert_close(_delta(weights, x), _peft_delta(module, x), atol=1e-5, rtol=1e-5)


def test_rank_and_alpha_pattern(tmp_path):
    peft_model = _peft_model(LLAMA, tmp_path, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                             rank_pattern={"v_proj": 4}, alpha_pattern={"model.layers.1.self_attn.q_proj": 4})
    adapter = read_adapter("acme/pattern", tmp_path, lora_shapes(LLAMA))
    assert adapter.rank == 8
    assert adapter.layers[0]["self_attn.v_proj"].lora_a.shape == (4, 64)
    assert adapter.layers[0]["self_attn.v_proj"].scaling == 16 / 4
    assert adapter.layers[0]["self_attn.q_proj"].scaling == 16 / 8
    assert adapter.layers[1]["self_attn.q_proj"].scaling == 4 / 8
    layer = peft_model.base_model.model.model.layers[1]
    x = torch.randn(3, 64)
    for module, key in [(layer.self_attn.q_proj, "self_attn.q_proj"), (layer.self_attn.v_proj, "self_attn.v_proj")]:
        torch.testing.assert_close(_delta(adapter.layers[1][key], x), _peft_delta(module, x), atol=1e-5, rtol=1e-5)


def test_refuses_pickled_weights_without_reading_them(llama_copy):
    (llama_copy / "adapter_model.safetensors").unlink()
    (llama_copy / "adapter_model.bin").write_bytes(b"never unpickled")
    _refused(llama_copy, "pickled weights are refused", "adapter_model.bin", "convert to safetensors")


def test_refuses_weights_over_the_size_limit(llama_adapter):
    _refused(llama_adapter[1], "over the limit of 1000 bytes", max_bytes=1000)


def test_refuses_a_rank_over_the_servers_max_lora_rank(llama_adapter):
    _refused(llama_adapter[1], "rank 8 is above this server's max_lora_rank 4", max_rank=4)
    assert read_adapter("acme/x", llama_adapter[1], lora_shapes(LLAMA), max_rank=8).rank == 8


def test_the_in_process_cache_takes_the_rank_limit_from_the_shapes(llama_adapter):
    root = llama_adapter[1].parent
    cache = local_adapters(SourceConfig("local", str(root)), lora_shapes(LLAMA, max_rank=4))
    with pytest.raises(AdapterError, match="rank 8 is above this server's max_lora_rank 4"):
        cache.get(llama_adapter[1].name)
    assert local_adapters(SourceConfig("local", str(root)), lora_shapes(LLAMA, max_rank=8)).get(
        llama_adapter[1].name).rank == 8


def test_no_refusal_names_a_server_path(llama_copy, tmp_path):
    """A refusal reaches the client: it names the adapter and what is wrong, never a folder of the server."""
    messages = [_refused(tmp_path / "nowhere", "its folder was not found")]
    (llama_copy / "adapter_config.json").rename(llama_copy / "moved.json")
    messages.append(_refused(llama_copy, "adapter_config.json not found in its folder"))
    (llama_copy / "moved.json").rename(llama_copy / "adapter_config.json")
    (llama_copy / "adapter_model.safetensors").unlink()
    messages.append(_refused(llama_copy, "adapter_model.safetensors not found in its folder"))
    root = tmp_path / "root"
    root.mkdir()
    (root / "out").symlink_to(llama_copy, target_is_directory=True)
    source = make_source(SourceConfig("local", str(root)))
    for adapter_id, words in (("absent", "not found in the adapters root"), ("out", "outside the adapters root")):
        with pytest.raises(AdapterError, match=words) as refused:
            source.locate(adapter_id)
        messages.append(str(refused.value))
    assert not [m for m in messages if str(tmp_path) in m], messages


def test_refuses_a_rank_that_disagrees_with_the_config(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.update({Q_PROJ_A: t[Q_PROJ_A][:4].clone()}))
    _refused(llama_copy, "rank 8 in config but lora_A of model.layers.0.self_attn.q_proj has 4 rows")


def test_refuses_an_adapter_for_another_base_model(llama_adapter):
    _refused(llama_adapter[1], "different base model", config=_llama_config(hidden_size=32))
    _refused(llama_adapter[1], "layer 1", "has 1 layers", config=_llama_config(num_hidden_layers=1))


@pytest.mark.parametrize("key, value, reason", [
    ("peft_type", "IA3", "peft_type 'IA3' is not supported"),
    ("use_dora", True, "DoRA"),
    ("bias", "all", "bias='all'"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("lora_bias", True, "lora_bias"),
    ("init_lora_weights", "pissa", "rewrites the base weights"),
    ("r", 0, "positive integer"),
    ("lora_alpha", float("nan"), "lora_alpha a finite number"),  # every logit would be NaN
    ("lora_alpha", float("inf"), "lora_alpha a finite number"),
    ("alpha_pattern", {"q_proj": "x"}, "finite number for model.layers.0.self_attn.q_proj"),
    ("layers_to_transform", "all", "layers_to_transform must be an integer or a list"),
])
def test_refuses_unsupported_config(llama_copy, key, value, reason):
    _edit_config(llama_copy, **{key: value})
    _refused(llama_copy, reason)


@pytest.mark.parametrize("module, shown", [("lm_head", "'lm_head'"), ("embed_tokens", "'model.embed_tokens'")])
def test_refuses_unsupported_target_modules(tmp_path, module, shown):
    _peft_model(LLAMA, tmp_path, r=4, target_modules=["q_proj", module])
    message = _refused(tmp_path, f"target module {shown} is not supported")
    assert "self_attn.q_proj" in message  # names the supported modules


def test_layers_to_transform_must_cover_the_weights(tmp_path, llama_copy):
    """PEFT leaves weights of layers outside layers_to_transform unused: serving them would not be PEFT's model."""
    _edit_config(llama_copy, layers_to_transform=[0])
    _refused(llama_copy, "weights for layers [1], which layers_to_transform [0] leaves out")
    _peft_model(LLAMA, tmp_path, r=4, target_modules=["q_proj"], layers_to_transform=[1])
    assert set(read_adapter("acme/x", tmp_path, lora_shapes(LLAMA)).layers) == {1}


def test_refuses_missing_lora_b(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.pop(Q_PROJ_A.replace("lora_A", "lora_B")))
    _refused(llama_copy, "lora_B of model.layers.0.self_attn.q_proj is missing")


def test_refuses_non_finite_weights(llama_copy):
    _edit_tensors(llama_copy, lambda t: t[Q_PROJ_A].fill_(float("nan")))
    _refused(llama_copy, "NaN")


def test_accepts_adapter_name_in_tensor_names(llama_copy):
    _edit_tensors(llama_copy, lambda t: t.update({Q_PROJ_A.replace("lora_A.", "lora_A.default."): t.pop(Q_PROJ_A)}))
    assert read_adapter("acme/x", llama_copy, lora_shapes(LLAMA)).layers[0]["self_attn.q_proj"].lora_a.shape == (8, 64)


def test_refuses_malformed_config_and_missing_folder(llama_copy, tmp_path):
    (llama_copy / "adapter_config.json").write_text("{not json")
    _refused(llama_copy, "adapter_config.json is not valid JSON")
    _refused(tmp_path / "nowhere", "not found")


def test_refuses_empty_adapter(llama_copy):
    save_file({}, llama_copy / "adapter_model.safetensors")
    _refused(llama_copy, "holds no tensors")


def test_adapter_error_survives_pickling():  # Ray sends exceptions between processes pickled
    err = pickle.loads(pickle.dumps(AdapterError("acme/x", "not found in /adapters")))
    assert isinstance(err, AdapterError) and str(err) == "adapter 'acme/x': not found in /adapters"
    assert (err.adapter_id, err.reason) == ("acme/x", "not found in /adapters")
    reloaded = AdapterError("acme/x#3", "bad")  # a name loaded at run time, third generation: named as requested
    assert str(reloaded) == "adapter 'acme/x': bad" and reloaded.adapter_id == "acme/x#3"


def test_unsupported_base_architecture():
    with pytest.raises(ValueError, match="unsupported base architecture 'bert'"):
        lora_shapes(BertConfig()).modules


# ---- sources ----

def _adapter_files(folder: Path, src: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(src / name, folder / name)
    return folder


def test_local_source_finds_names_and_org_names(llama_adapter, tmp_path):
    _adapter_files(tmp_path / "plain", llama_adapter[1])
    _adapter_files(tmp_path / "acme" / "sql", llama_adapter[1])
    source = make_source(SourceConfig("local", str(tmp_path)))
    assert source.name == "local"
    assert source.locate("plain") == tmp_path / "plain"
    folder = source.locate("acme/sql")
    assert read_adapter("acme/sql", folder, lora_shapes(LLAMA)).rank == 8
    with pytest.raises(AdapterError, match="'acme/other': not found in"):
        source.locate("acme/other")
    with pytest.raises(AdapterError, match="a local adapter has no revisions"):
        source.locate("acme/sql@v2")


@pytest.mark.parametrize("bad_id", ["..", "/abs", "a/../b", "a\\b", "", "~root", "a/b/c", "a\0b", "x" * 300, "./a",
                                    "a@", "a@b/c", "a@..", "a@b@c"])
def test_adapter_ids_that_could_escape_are_refused(bad_id, tmp_path):
    with pytest.raises(AdapterError, match="adapter id"):
        validate_adapter_id(bad_id)
    with pytest.raises(AdapterError):
        make_source(SourceConfig("local", str(tmp_path))).locate(bad_id)


def test_local_source_refuses_symlinks_out_of_the_root(llama_adapter, tmp_path):
    root, outside = tmp_path / "root", _adapter_files(tmp_path / "outside", llama_adapter[1])
    root.mkdir()
    (root / "evil").symlink_to(outside, target_is_directory=True)
    sneaky = _adapter_files(root / "sneaky", llama_adapter[1])
    (sneaky / "adapter_config.json").unlink()
    (sneaky / "adapter_config.json").symlink_to(outside / "adapter_config.json")
    source = make_source(SourceConfig("local", str(root)))
    with pytest.raises(AdapterError, match="'evil'.*outside"):
        source.locate("evil")
    with pytest.raises(AdapterError, match="'sneaky'.*outside"):
        source.locate("sneaky")


def _hub_repo(cache: Path, repo_id: str, src: Path, commit: str, with_ref: bool) -> None:
    """The Hugging Face cache layout: snapshot files are symlinks into blobs/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("adapter_config.json", "adapter_model.safetensors")):
        shutil.copy(src / name, repo / "blobs" / f"blob{i}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"blob{i}")
    if with_ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)


def test_hub_cache_source(llama_adapter, tmp_path):
    _hub_repo(tmp_path, "acme/with-ref", llama_adapter[1], "a" * 40, with_ref=True)
    _hub_repo(tmp_path, "acme/single", llama_adapter[1], "b" * 40, with_ref=False)
    source = HubCacheSource(tmp_path)
    assert source.name == "hub"
    folder = source.locate("acme/with-ref")
    assert folder == tmp_path / "models--acme--with-ref" / "snapshots" / ("a" * 40)
    assert read_adapter("acme/with-ref", folder, lora_shapes(LLAMA)).rank == 8
    assert source.locate("acme/single").name == "b" * 40
    with pytest.raises(AdapterError, match="'acme/missing': not found in the Hugging Face cache"):
        source.locate("acme/missing")


def test_hub_cache_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert HubCacheSource().cache_dir == tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert HubCacheSource().cache_dir == tmp_path / "elsewhere"


def test_make_source_errors():
    with pytest.raises(ValueError, match="unknown adapter source 'ftp'; known: hub, local, s3"):
        make_source(SourceConfig("ftp"))
    with pytest.raises(ValueError, match="needs an adapters root"):
        make_source(SourceConfig("local"))
    with pytest.raises(ValueError, match="looks like s3://bucket/prefix"):
        make_source(SourceConfig("s3", "bucket/prefix", disk_cache="/tmp"))
