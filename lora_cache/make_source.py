"""The adapter source a SourceConfig names: a folder tree, the Hugging Face Hub or S3 (lora_cache/sources.py,
hub_source.py, s3_source.py). The remote sources' libraries load only when one is made."""

from __future__ import annotations

from lora_cache.source_config import SOURCES, SourceConfig
from lora_cache.sources import AdapterSource, LocalSource


def make_source(config: SourceConfig) -> AdapterSource:
    if config.kind == "local":
        if config.adapters_root is None:
            raise ValueError("the local adapter source needs an adapters root folder")
        return LocalSource(config.adapters_root)
    if config.kind not in SOURCES:
        raise ValueError(f"unknown adapter source {config.kind!r}; known: {', '.join(SOURCES)}")
    if config.kind == "s3" and config.adapters_root is None:
        raise ValueError("the s3 adapter source needs adapters_root: s3://bucket/prefix")
    return remote_source(config.kind, config, config.adapters_root)


def remote_source(kind: str, config: SourceConfig, root: str | None) -> AdapterSource:
    """The hub or s3 source, downloading into the disk tier of `config`; an s3 source without a root fetches only
    whole locations (S3Source.fetch)."""
    from lora_cache.disk_tier import DiskTier  # the remote sources' libraries load only when one is used

    tier = DiskTier(config.disk_folder(), config.disk_cache_bytes, config.max_adapter_bytes)
    if kind == "hub":
        from lora_cache.hub_source import HubSource

        return HubSource(tier, config.hub_cache, config.download_timeout_s, config.download_retries)
    from lora_cache.s3_source import S3Source

    return S3Source(tier, root, config.download_timeout_s, config.download_retries)
