"""Multi-LoRA: how many adapters the device slots hold and how large, which adapters are loaded at start or
pinned, and how long requests wait on an adapter. Where adapters are read from is the sources' concern
(lora_cache/source_config.py: SourceConfig, the options of the adapter provider)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora.ids import validate_adapter_id


@dataclass
class LoRAConfig:
    # adapters in device slots per replica (0 disables LoRA)
    max_loras: int = 0
    max_lora_rank: int = 16  # the largest adapter rank a slot holds; a larger adapter is refused at load
    # a mixture of experts: slots hold adapters' weights on the experts too (PEFT's target_parameters), every
    # expert's, which for a large mixture is far more than its attention's (the memory plan shows the slots'
    # bytes); False keeps them off and refuses such adapters by name
    expert_lora: bool = True
    adapter_cache_timeout_s: float = 30.0  # in serving, the cache actor silent this long: adapter requests get 503
    max_adapter_wait_s: float = 1.0  # after this, a request whose adapter has no slot stops being passed
    # Loaded into the CPU tier and device slots when the engine starts (so into every replica added by scale-up):
    # their first requests find them warm. Pinned adapters also keep their slots for good.
    preload_adapters: tuple[str, ...] = ()
    pinned_adapters: tuple[str, ...] = ()  # preloaded, and holding their device slots for good

    def validate(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, "
                             f"got {self.max_loras}, {self.max_lora_rank}")
        if self.adapter_cache_timeout_s <= 0:
            raise ValueError(f"adapter_cache_timeout_s must be positive, got {self.adapter_cache_timeout_s}")
        self._validate_preloads()

    def _validate_preloads(self) -> None:
        self.preload_adapters, self.pinned_adapters = tuple(self.preload_adapters), tuple(self.pinned_adapters)
        if (self.preload_adapters or self.pinned_adapters) and not self.max_loras:
            raise ValueError("preload_adapters and pinned_adapters need LoRA: set max_loras > 0")
        if self.pinned_adapters and len(set(self.pinned_adapters)) >= self.max_loras:
            raise ValueError(f"{len(set(self.pinned_adapters))} pinned_adapters leave none of the {self.max_loras} "
                             f"device slots (max_loras) to other adapters")
        for adapter_id in self.preload_adapters + self.pinned_adapters:
            validate_adapter_id(adapter_id)
