"""The engine's side of adapters: what it asks of wherever adapters come from, and the types that cross.

The engine holds one AdapterProvider and knows nothing of where its adapters live (a folder, the Hub, S3, a Ray
actor): lora_cache implements the protocol, and whoever builds the engine passes a factory that makes the provider
once the engine knows its model's LoRA shapes (`AdapterProviderFactory`). A caller that passes none gets the one
lora_cache registers as the package's default (an entry point), so `LLM(model, max_loras=2, adapters_root=DIR)`
needs no other import. The types here are plain dataclasses and
load no torch, so the serving side's error handling and request parsing import them before any model is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol

from engine.errors import AdapterError

if TYPE_CHECKING:
    import torch

    from engine.lora.merge_spec import MergeSpec

SOURCES = ("hub", "local", "s3")


@dataclass
class LoRAWeights:
    """One target module of one layer; delta(x) = x @ lora_a.T @ lora_b.T * scaling."""
    lora_a: torch.Tensor  # [rank, in_features], float32, CPU, contiguous
    lora_b: torch.Tensor  # [out_features, rank], float32, CPU, contiguous
    scaling: float


@dataclass
class ExpertLoRAWeights:
    """One stacked expert parameter of one layer (PEFT's target_parameters, e.g. "mlp.experts.gate_up_proj"):
    expert e's delta(x) = x @ lora_a[e].T @ lora_b[e].T * scaling."""
    lora_a: torch.Tensor  # [experts, rank, in_features], float32, CPU, contiguous
    lora_b: torch.Tensor  # [experts, out_features, rank], float32, CPU, contiguous
    scaling: float


@dataclass
class LoRAAdapter:
    adapter_id: str
    rank: int  # max rank over modules (an expert parameter's: each expert's)
    # module keys present, sorted, e.g. ("mlp.down_proj", "self_attn.q_proj"), expert parameters' keys among them
    target_modules: tuple[str, ...]
    layers: dict[int, dict[str, LoRAWeights | ExpertLoRAWeights]]  # layer index -> module key -> weights
    nbytes: int  # bytes of all A and B tensors (float32)
    base_model_name_or_path: str | None
    # The version of these weights: a hash of the config and weights files. Responses carry it, so a client knows
    # which weights answered, and a retrained adapter under a reused name is told apart.
    content_id: str = ""


@dataclass(frozen=True)
class LoraShapes:
    """The base model's LoRA-capable linears, as its model class declares them (engine/models/): what an adapter
    must fit. `modules` maps a PEFT module key to its (in_features, out_features); `experts`, a mixture of experts'
    stacked parameters that adapters may target (PEFT's target_parameters), each expert's (in, out)."""
    modules: Mapping[str, tuple[int, int]]
    num_layers: int
    experts: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    num_experts: int = 0
    expert_layers: frozenset[int] = frozenset()  # the layers that have experts (Qwen3-MoE's dense ones do not)


@dataclass(frozen=True)
class LoadStats:
    """Reads of one adapter from the tier below, and the seconds they took in all."""
    loads: int
    seconds: float

    @property
    def mean_seconds(self) -> float | None:
        return self.seconds / self.loads if self.loads else None


@dataclass(frozen=True)
class SourceConfig:
    """Where a cache reads adapters from, how it downloads them, and the limits every adapter it reads meets.
    max_lora_rank is the LoRA config's, filled in by EngineConfig.adapter_sources."""
    OPTION_NAMES = {"adapter_source": "kind", "adapter_disk_cache": "disk_cache",  # options named otherwise here
                    "adapter_disk_cache_bytes": "disk_cache_bytes", "adapter_download_timeout_s": "download_timeout_s",
                    "adapter_download_retries": "download_retries"}

    kind: str = "local"  # "local", "hub" (the Hugging Face Hub, HF_ENDPOINT) or "s3" (AWS_ENDPOINT_URL)
    adapters_root: str | None = None  # "local": a folder of adapters; "s3": s3://bucket/prefix
    hub_cache: str | None = None  # a Hugging Face cache read when HF_HUB_OFFLINE is set or the Hub is unreachable
    disk_cache: str | None = None  # downloaded adapters (hub, s3); default <cache dir>/adapters
    disk_cache_bytes: int = 8 << 30  # LRU by bytes beyond this
    max_adapter_bytes: int = 1 << 30  # an adapter's files; a download stops here
    max_lora_rank: int | None = None
    download_timeout_s: float = 30.0  # per connection and per read
    download_retries: int = 3  # further tries of a failed download (hub, s3)

    def validate(self) -> None:
        if self.kind not in SOURCES:
            raise ValueError(f"adapter_source must be one of {', '.join(SOURCES)}, got {self.kind!r}")
        if self.download_timeout_s <= 0 or self.download_retries < 0:
            raise ValueError("adapter_download_timeout_s must be positive and adapter_download_retries >= 0")


class AdapterProvider(Protocol):
    def get(self, key: str) -> LoRAAdapter:
        """The adapter of a key, read from the tier below on a miss; AdapterError (a ValueError) with the reason."""

    def key(self, name: str) -> str:
        """The key the adapter called `name` is known by now (a reloaded adapter gets a new one)."""

    def merge(self, spec: MergeSpec) -> str:
        """The key of the adapter that merges spec's adapters (LoRAX's merged_adapters), merged on its first use."""

    def __contains__(self, key: str) -> bool:
        """Whether the adapter is held here, in the CPU tier."""

    def cached(self) -> list[str]:
        """The keys held here, least recently used first."""

    def load_stats(self) -> dict[str, LoadStats]:
        """Per key ever read from the tier below: how often, and how long it took in all."""


# Called by the engine once it has read its model's config, with its adapter options (EngineConfig.adapter_sources):
# the provider checks every adapter against the shapes.
AdapterProviderFactory = Callable[[SourceConfig, LoraShapes], AdapterProvider]


PROVIDERS_GROUP = "lora_serve.adapter_providers"  # the entry points a package registers providers under


def default_provider() -> AdapterProviderFactory | None:
    """The provider registered as "default" (lora_cache's, which reads the config's adapter source in this
    process), found through the installed packages' entry points, so the engine imports nothing above it."""
    found = entry_points(group=PROVIDERS_GROUP, name="default")
    return next(iter(found)).load() if found else None


def check_rank(adapter_id: str, rank: int, max_rank: int | None) -> None:
    """AdapterError unless the rank fits the server's max_lora_rank (None: no limit)."""
    if max_rank is not None and rank > max_rank:
        raise AdapterError(adapter_id, f"rank {rank} is above this server's max_lora_rank {max_rank}")
