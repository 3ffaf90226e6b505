"""The model a replica serves: which weights, in which dtype, how they are read, and how long a context runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.options import DTYPES, check_choice, default_cache_dir

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = ("none", "int8", "nf4")  # bitsandbytes' (engine/layers/quantized.py)


@dataclass
class ModelConfig:
    OPTION_NAMES = {"model": "name"}  # options whose field has another name here

    name: str = "smollm2-135m-instruct"  # a local Hugging Face model folder, or the embedded default's name
    dtype: str = "float32"  # the compute dtype; with quantization, that of everything not quantized
    quantization: str = "none"  # "none", "int8" or "nf4" (bitsandbytes) for the decoder layers' linears
    load_format: str = "safetensors"  # "dummy": random weights, no checkpoint read (speed tests of model shapes)
    max_model_len: int | None = None  # defaults to the model's context length
    cache_dir: str | None = None  # where converted models live; default $LORA_SERVE_CACHE, else ~/.cache/lora-serve
    seed: int = 0  # the seed of the generator that sampled requests without a seed of their own share

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("quantization", self.quantization, QUANTIZATIONS)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def model_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir() / "models"
