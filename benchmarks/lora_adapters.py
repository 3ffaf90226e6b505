"""Random-weight LoRA adapters in PEFT's on-disk format, for benchmarks (no training, no PEFT model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models import lora_shapes

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_random_adapter(folder: Path, hf_config, rank: int = 8, targets=ATTENTION, seed: int = 0) -> Path:
    """adapter_config.json + adapter_model.safetensors with small random A and B for every layer."""
    gen = torch.Generator().manual_seed(seed)
    shapes = lora_shapes(hf_config).modules
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for key, (fan_in, fan_out) in shapes.items():
            if key.rsplit(".", 1)[-1] not in targets:
                continue
            prefix = f"base_model.model.model.layers.{layer}.{key}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none", "base_model_name_or_path": "smollm2-135m-instruct"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
