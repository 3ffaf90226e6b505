"""The engine's side of adapters: what it asks of wherever adapters come from, and the types that cross.

The engine holds one AdapterProvider and knows nothing of where its adapters live (a folder, the Hub, S3, a Ray
actor): lora_cache implements the protocol, and whoever builds the engine passes a factory that makes the provider
once the engine knows its model's LoRA shapes (`AdapterProviderFactory`). A caller that passes none gets the one
lora_cache registers as the package's default (an entry point: `ProviderPlugin`), whose options (where adapters
are read from) the engine takes as its own without reading them, so `LLM(model, max_loras=2, adapters_root=DIR)`
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
    stacked parameters that adapters may target (PEFT's target_parameters), each expert's (in, out); `max_rank`, the
    engine's slots' rank."""
    modules: Mapping[str, tuple[int, int]]
    num_layers: int
    experts: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    num_experts: int = 0
    expert_layers: frozenset[int] = frozenset()  # the layers that have experts (Qwen3-MoE's dense ones do not)
    max_rank: int | None = None  # the largest rank a slot holds (max_lora_rank); None: no limit


@dataclass(frozen=True)
class LoadStats:
    """Reads of one adapter from the tier below, and the seconds they took in all."""
    loads: int
    seconds: float

    @property
    def mean_seconds(self) -> float | None:
        return self.seconds / self.loads if self.loads else None


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


class ProviderOptions(Protocol):
    """A provider's own options (lora_cache's SourceConfig): a dataclass whose fields are engine options, under
    the names its OPTION_NAMES gives. The engine validates and stores them, and hands them to the provider unread."""

    def validate(self) -> None:
        """ValueError naming the option that is wrong."""


@dataclass(frozen=True)
class NoProviderOptions:
    """The options where no installed package registers a default provider: none."""

    def validate(self) -> None:
        pass


# Called by the engine once it has read its model's config, with the config's provider options (config.sources)
# and its LoRA shapes: the provider checks every adapter against the shapes.
AdapterProviderFactory = Callable[[ProviderOptions, LoraShapes], AdapterProvider]


@dataclass(frozen=True)
class ProviderPlugin:
    """What a package registers as the engine's default provider: its options' dataclass, whose fields become
    engine options (engine/config/engine.py), and the factory the engine calls when the caller passes none."""
    options: type
    factory: AdapterProviderFactory


PROVIDERS_GROUP = "lora_serve.adapter_providers"  # the entry points a package registers providers under


def default_plugin() -> ProviderPlugin | None:
    """The plugin registered as "default" (lora_cache's, which reads the configured adapter source in this
    process), found through the installed packages' entry points, so the engine imports nothing above it."""
    found = entry_points(group=PROVIDERS_GROUP, name="default")
    return next(iter(found)).load() if found else None


def default_options() -> type:
    """The dataclass of the default provider's options, or NoProviderOptions where none is installed."""
    plugin = default_plugin()
    return plugin.options if plugin is not None else NoProviderOptions


def check_rank(adapter_id: str, rank: int, max_rank: int | None) -> None:
    """AdapterError unless the rank fits the server's max_lora_rank (None: no limit)."""
    if max_rank is not None and rank > max_rank:
        raise AdapterError(adapter_id, f"rank {rank} is above this server's max_lora_rank {max_rank}")
