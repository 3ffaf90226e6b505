"""LoRAX's merged_adapters parameter (MergeSpec) and the cache key of its merge; merging itself is
lora_cache/merge.py. Apart from it so that the HTTP side parses and validates a spec without torch
(deployments/app.py is imported by Serve's build step, before any replica)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

from engine.lora.ids import validate_adapter_id

STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")
KEY_PREFIX = "merge~"


@dataclass(frozen=True)
class MergeSpec:
    """LoRAX's merged_adapters parameter."""
    ids: tuple[str, ...]
    weights: tuple[float, ...]
    merge_strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"

    def __post_init__(self):
        if len(self.ids) < 1 or len(self.ids) != len(self.weights):
            raise ValueError(f"merged_adapters needs one weight per id: {len(self.ids)} ids, "
                             f"{len(self.weights)} weights")
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in self.weights):
            raise ValueError(f"merged_adapters weights must be finite numbers, got {list(self.weights)}")
        if self.merge_strategy not in STRATEGIES:
            raise ValueError(f"merge_strategy {self.merge_strategy!r} is not one of {', '.join(STRATEGIES)}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if self.majority_sign_method not in SIGN_METHODS:
            raise ValueError(f"majority_sign_method must be one of {', '.join(SIGN_METHODS)}")
        for adapter_id in self.ids:
            validate_adapter_id(adapter_id)

    def key(self) -> str:
        return KEY_PREFIX + hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def seed(self) -> int:
        return int(self.key()[len(KEY_PREFIX):], 16) % (1 << 31)


def is_merge_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX)
