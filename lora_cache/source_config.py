"""The adapter sources' options: where lora_cache reads adapters from, how it downloads them, and what it stores.

They are lora_cache's concern, not the engine's. Users still write them flat among the engine's options (a serve
config's `engine:` section, `LLM(model, adapters_root=...)`): lora_cache/plugin.py registers this dataclass as the
options of the engine's default adapter provider, so the engine accepts, validates and stores them without reading
a field (engine/lora/provider.py: ProviderPlugin). The module imports nothing of the engine at its top, so the
engine's config loads it cheaply and without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SOURCES = ("hub", "local", "s3")


@dataclass(frozen=True)
class SourceConfig:
    """Where a cache reads adapters from, how it downloads them, and the limit on an adapter's files."""
    OPTION_NAMES = {"adapter_source": "kind", "adapter_disk_cache": "disk_cache",  # options named otherwise here
                    "adapter_disk_cache_bytes": "disk_cache_bytes", "adapter_download_timeout_s": "download_timeout_s",
                    "adapter_download_retries": "download_retries"}

    kind: str = "local"  # "local", "hub" (the Hugging Face Hub, HF_ENDPOINT) or "s3" (AWS_ENDPOINT_URL)
    adapters_root: str | None = None  # "local": a folder of adapters; "s3": s3://bucket/prefix
    hub_cache: str | None = None  # a Hugging Face cache read when HF_HUB_OFFLINE is set or the Hub is unreachable
    disk_cache: str | None = None  # downloaded adapters (hub, s3); default <cache dir>/adapters
    disk_cache_bytes: int = 8 << 30  # LRU by bytes beyond this
    max_adapter_bytes: int = 1 << 30  # an adapter's files; a download stops here
    download_timeout_s: float = 30.0  # per connection and per read
    download_retries: int = 3  # further tries of a failed download (hub, s3)

    def validate(self) -> None:
        if self.kind not in SOURCES:
            raise ValueError(f"adapter_source must be one of {', '.join(SOURCES)}, got {self.kind!r}")
        if self.download_timeout_s <= 0 or self.download_retries < 0:
            raise ValueError("adapter_download_timeout_s must be positive and adapter_download_retries >= 0")

    def disk_folder(self) -> Path:
        """Where downloads are kept: adapter_disk_cache, else the engine's cache folder's adapters/."""
        # imported here: the engine's config package loads this module (through the plugin) as it starts
        from engine.config.options import default_cache_dir

        return Path(self.disk_cache) if self.disk_cache else default_cache_dir() / "adapters"
