"""Random-weight LoRA adapters in PEFT's on-disk format, for benchmarks (no training, no PEFT model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models import lora_shapes

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_random_adapter(folder: Path, hf_config, rank: int = 8, targets=ATTENTION, seed: int = 0,
                         experts: bool = False) -> Path:
    """adapter_config.json + adapter_model.safetensors with small random A and B for every layer; experts: on a
    mixture of experts, its stacked gate/up and down too (target_parameters), laid out as PEFT saves them."""
    gen = torch.Generator().manual_seed(seed)
    shapes = lora_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for key, (fan_in, fan_out) in shapes.modules.items():
            if key.rsplit(".", 1)[-1] in targets:
                tensors.update(_pair(f"base_model.model.model.layers.{layer}.{key}", rank, fan_in, fan_out, gen))
        if experts and layer in shapes.expert_layers:
            tensors.update(_expert_pairs(f"base_model.model.model.layers.{layer}.mlp.experts", shapes, rank, gen))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "bias": "none", "base_model_name_or_path": "smollm2-135m-instruct",
              **({"target_parameters": sorted(shapes.experts)} if experts else {})}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def _pair(prefix: str, rank: int, fan_in: int, fan_out: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"{prefix}.lora_A.weight": torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5,
            f"{prefix}.lora_B.weight": torch.randn(fan_out, rank, generator=gen) * 0.02}


def _expert_pairs(prefix: str, shapes, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Every expert's A and B of gate/up (nested under base_layer, as PEFT nests a module's second parameter)
    and of down, stacked as PEFT's ParamWrapper saves them ([experts * r, in] and [out, r * experts])."""
    nested = {"mlp.experts.gate_up_proj": f"{prefix}.base_layer", "mlp.experts.down_proj": prefix}
    tensors = {}
    for key, (fan_in, fan_out) in shapes.experts.items():
        tensors.update(_pair(nested[key], rank * shapes.num_experts, fan_in, fan_out, gen))
    return tensors
