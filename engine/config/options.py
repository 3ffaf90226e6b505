"""What every concern of the engine's config shares: the dtype names, closed choices refused by name, and where
converted models and downloaded adapters live by default. torch is imported only where a torch dtype or device is
asked for: the serving side validates a config in Serve's build step, which must not import torch."""

from __future__ import annotations

import os
from pathlib import Path

# dtype names -> torch's names for them
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
          "fp16": "float16"}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """An option with a closed set of values: an unknown one refused by name, the known ones listed."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def check_positive(owner: object, *names: str) -> None:
    """Each named field of `owner` above 0, else ValueError naming it."""
    for name in names:
        if getattr(owner, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(owner, name)}")


def default_cache_dir() -> Path:
    """Where converted models live: $LORA_SERVE_CACHE, else ~/.cache/lora-serve."""
    env = os.environ.get("LORA_SERVE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(xdg) / "lora-serve"
