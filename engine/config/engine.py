"""The engine's configuration, by concern: the model, the KV cache, the scheduler, LoRA, the backend, and the
options of the adapter provider (lora_cache's adapter sources), which the engine stores without reading.

Users write options flat, as vLLM's engine arguments: a serve config's `engine:` section, `LLM(model, **options)`,
`EngineConfig.from_overrides(**options)`. Each option belongs to one concern (`OPTIONS`: the option's name -> its
concern and field), and an unknown one is refused by name. The engine reads `config.cache.block_size`,
`config.scheduler.max_num_seqs`, and so on. The sources' options are those of the default adapter provider that
an installed package registers (engine/lora/provider.py: ProviderPlugin); with none installed there are none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from engine.config.backend import BackendConfig
from engine.config.cache import CacheConfig
from engine.config.model import ModelConfig
from engine.config.options import DTYPES
from engine.config.scheduler import SchedulerConfig
from engine.lora.config import LoRAConfig
from engine.lora.provider import ProviderOptions, default_options
from engine.speculative.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

CONCERNS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "lora": LoRAConfig,
            "backend": BackendConfig, "speculative": SpeculativeConfig, "sources": default_options()}


class Option(NamedTuple):
    concern: str  # EngineConfig's field
    field: str  # the concern's field


def _options() -> dict[str, Option]:
    """Every option's name -> where it lives: a concern's field under its own name or the one its OPTION_NAMES
    gives; a field that an earlier concern already names is not an option."""
    options = {}
    for concern, cls in CONCERNS.items():
        renamed = {field: option for option, field in getattr(cls, "OPTION_NAMES", {}).items()}
        for f in dataclasses.fields(cls):
            name = renamed.get(f.name, f.name)
            if name not in options:
                options[name] = Option(concern, f.name)
    return options


OPTIONS = _options()


@dataclass
class EngineConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    backend: BackendConfig = dataclasses.field(default_factory=BackendConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    sources: ProviderOptions = dataclasses.field(default_factory=CONCERNS["sources"])
    log_stats: bool = True  # print the model's memory plan when the engine starts

    @classmethod
    def from_overrides(cls, model: str | None = None, **overrides) -> EngineConfig:
        """A validated config from flat options (model: the `model` option, given first)."""
        options = overrides if model is None else {"model": model, **overrides}
        return cls().with_options(**options)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> EngineConfig:
        """Load a preset from configs/*.yaml (its `engine:` section, or the whole file), then apply overrides."""
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        data = data.get("engine", data)
        return cls.from_overrides(**{**data, **overrides})

    def with_options(self, **options) -> EngineConfig:
        """A validated copy with these flat options changed; TypeError naming any unknown one."""
        unknown = sorted(set(options) - set(OPTIONS) - {"log_stats"})
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: "
                            f"{', '.join(sorted([*OPTIONS, 'log_stats']))}")
        changed = {concern: {} for concern in CONCERNS}
        for name, value in options.items():
            if name in OPTIONS:
                changed[OPTIONS[name].concern][OPTIONS[name].field] = value
        parts = {concern: dataclasses.replace(getattr(self, concern), **fields) for concern, fields in changed.items()}
        config = EngineConfig(**parts, log_stats=options.get("log_stats", self.log_stats))
        config.validate()
        return config

    def options(self) -> dict[str, object]:
        """The flat options this config was built from, by name (what with_options takes)."""
        flat = {name: getattr(getattr(self, where.concern), where.field) for name, where in OPTIONS.items()}
        return {**flat, "log_stats": self.log_stats}

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate(self.model.dtype)
        self.scheduler.validate()
        self.lora.validate()
        self.backend.validate()
        self.speculative.validate()
        self.sources.validate()
        self._validate_tensor_parallel()
        self._validate_speculation()

    def _validate_tensor_parallel(self) -> None:
        """What tensor parallelism does not run yet, refused by name (what needs the model or the device is refused
        when the engine starts: engine/executor/multiprocess.py)."""
        size = self.backend.tensor_parallel_size
        if self.cache.kv_cache_memory_fraction is not None and size > 1:
            raise ValueError(f"kv_cache_memory_fraction under tensor parallelism is not supported yet (each of the "
                             f"{size} workers would take that share of the free memory): set kv_cache_bytes, each "
                             f"worker's budget")

    def _validate_speculation(self) -> None:
        """What speculative decoding does not run with yet, refused by name."""
        if not self.speculative.enabled:
            return
        if self.scheduler.async_scheduling:
            raise ValueError("speculative decoding with async_scheduling is not supported yet: a draft is verified "
                             "before the next step is scheduled")
        if self.backend.tensor_parallel_size > 1:
            raise ValueError("speculative decoding under tensor parallelism is not supported yet")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model runs in: the model's, except where the platform computes it in another
        (engine/platform.py: bf16 on a CPU without bf16 matrix instructions). The weights keep the model dtype's
        values there (engine/models load_model), and the linears their storage where a C++ kernel widens them
        (engine/layers/linear.py)."""
        from engine.platform import platform_of

        return platform_of(self.backend.torch_device).compute_dtype(self.model.torch_dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype. "auto" keeps it in the model's dtype even where a bf16 model computes in float32:
        half the bytes, so twice the tokens in the same budget, and a long context's decode attention reads half as
        much (the C++ kernels widen the cached bf16 as they load it). float32 is taken only where the model computes
        in it."""
        import torch

        model_dtype, kv_dtype = self.model.torch_dtype, self.cache.kv_cache_dtype
        if kv_dtype == "auto":
            return model_dtype
        wanted = getattr(torch, DTYPES[kv_dtype])
        if wanted != model_dtype and wanted != self.compute_dtype:
            raise ValueError(f"kv_cache_dtype {kv_dtype!r} needs a model that computes in it: this "
                             f"{self.model.dtype} model computes in {str(self.compute_dtype).removeprefix('torch.')} "
                             f"here")
        return wanted
