"""The engine's config by concern: flat options, as users write them, land in one concern each; unknown and
invalid ones are refused by name; a config gives its flat options back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import OPTIONS, EngineConfig
from engine.config.engine import CONCERNS
from engine.config.options import default_cache_dir
from lora_cache.source_config import SourceConfig


def test_every_field_of_every_concern_is_one_option():
    homes = {(where.concern, where.field) for where in OPTIONS.values()}
    fields = {(concern, f.name) for concern, cls in CONCERNS.items() for f in dataclasses.fields(cls)}
    assert fields == homes and len(homes) == len(OPTIONS)


def test_the_adapter_sources_are_the_options_lora_cache_registers():
    assert CONCERNS["sources"] is SourceConfig
    assert isinstance(EngineConfig.from_overrides(adapters_root="/a").sources, SourceConfig)


def test_flat_options_land_in_their_concerns():
    config = EngineConfig.from_overrides("some-model", block_size=32, max_num_seqs=8, max_loras=2, device="cpu",
                                         adapter_source="hub", adapter_download_retries=1, log_stats=False)
    assert config.model.name == "some-model" and config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 8 and config.lora.max_loras == 2 and config.backend.device == "cpu"
    assert config.sources.kind == "hub" and config.sources.download_retries == 1 and not config.log_stats


def test_a_config_gives_back_the_options_it_was_built_from():
    config = EngineConfig.from_overrides(dtype="bf16", kv_cache_bytes=64 << 20, adapters_root="/adapters",
                                         pinned_adapters=["a"], max_loras=2)
    assert EngineConfig.from_overrides(**config.options()) == config
    assert config.options()["adapters_root"] == "/adapters" and config.options()["pinned_adapters"] == ("a",)


def test_with_options_is_a_validated_copy():
    config = EngineConfig.from_overrides(max_num_seqs=4)
    changed = config.with_options(num_threads=1, max_num_seqs=6)
    assert (changed.backend.num_threads, changed.scheduler.max_num_seqs) == (1, 6)
    assert (config.backend.num_threads, config.scheduler.max_num_seqs) == (None, 4)
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        config.with_options(max_num_seqs=0)


@pytest.mark.parametrize("options, named", [({"block_sise": 8}, "block_sise"),
                                            ({"max_lora_ranks": 8, "cache": {}}, "cache, max_lora_ranks")])
def test_unknown_options_are_refused_by_name(options, named):
    with pytest.raises(TypeError, match=f"unknown engine option\\(s\\): {named}; known: .*adapter_source"):
        EngineConfig.from_overrides(**options)


@pytest.mark.parametrize("options, message", [({"adapter_source": "ftp"}, "adapter_source must be one of"),
                                              ({"kv_cache_dtype": "fp8"}, "fp8 KV caches are not implemented"),
                                              ({"cuda_prefill": "xla"}, "cuda_prefill must be one of"),
                                              ({"pinned_adapters": ["a"]}, "need LoRA: set max_loras")])
def test_each_concern_validates_its_options(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_overrides(**options)


def test_downloads_go_under_the_engines_cache_folder_unless_a_disk_cache_is_named():
    sources = EngineConfig.from_overrides(adapter_source="hub").sources
    assert sources.disk_folder() == default_cache_dir() / "adapters"
    assert EngineConfig.from_overrides(adapter_disk_cache="/d").sources.disk_folder() == Path("/d")
