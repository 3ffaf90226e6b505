"""LoRAX's merged_adapters: several adapters combined into one virtual adapter, with PEFT's merge functions.

As PEFT's `add_weighted_adapter` does for its linear, ties, dare_linear and dare_ties combinations: per target
module, the adapters' A matrices are combined with weights sign(w s) sqrt(|w s|) and their B matrices with
sqrt(|w s|) (w the adapter's merge weight, s its scaling), through `peft.utils.merge_utils`; the merged adapter has
rank r and alpha r (scaling 1). Every adapter must have the same rank on each module it targets. The modules are
visited in the model's order, A before B, so DARE's random drops (seeded from the spec) fall as PEFT's do after
the same `torch.manual_seed`. A distinct spec is merged once and cached under its key like any adapter; the key
holds '~', which no adapter id can (lora_cache/sources.py), so merges and adapters never collide.
"""

from __future__ import annotations

import hashlib
import math

import torch

from engine.errors import AdapterError
from engine.lora.merge_spec import MergeSpec
from engine.lora.provider import ExpertLoRAWeights, LoRAAdapter, LoRAWeights


def merge_adapters(key: str, adapters: list[LoRAAdapter], spec: MergeSpec, module_order: list[str]) -> LoRAAdapter:
    """The merged adapter of `adapters` (in spec.ids order); module_order: the model's target modules in order."""
    for adapter in adapters:
        if any(isinstance(w, ExpertLoRAWeights) for per_layer in adapter.layers.values() for w in per_layer.values()):
            raise AdapterError(key, f"adapter {adapter.adapter_id!r} has weights on a mixture of experts' experts "
                                    f"(target_parameters): merging such adapters is not supported")
    layers: dict[int, dict[str, LoRAWeights]] = {}
    num_layers = 1 + max(layer for adapter in adapters for layer in adapter.layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed())
        for layer in range(num_layers):
            for module in module_order:
                parts = [(a.layers[layer][module], w) for a, w in zip(adapters, spec.weights)
                         if module in a.layers.get(layer, {})]
                if parts:
                    layers.setdefault(layer, {})[module] = _merge_module(key, parts, spec)
    weights = [w for per_layer in layers.values() for w in per_layer.values()]
    return LoRAAdapter(adapter_id=key, rank=max(w.lora_a.shape[0] for w in weights),
                       target_modules=tuple(sorted({m for per_layer in layers.values() for m in per_layer})),
                       layers=layers, nbytes=sum(w.lora_a.nbytes + w.lora_b.nbytes for w in weights),
                       base_model_name_or_path=adapters[0].base_model_name_or_path,
                       content_id=hashlib.sha256("".join(a.content_id for a in adapters).encode()
                                                 + key.encode()).hexdigest()[:16])


def _merge_module(key: str, parts: list[tuple[LoRAWeights, float]], spec: MergeSpec) -> LoRAWeights:
    ranks = {w.lora_a.shape[0] for w, _ in parts}
    if len(ranks) > 1:
        raise AdapterError(key, f"merged adapters must share each module's rank, got ranks {sorted(ranks)}")
    scaled = [weight * w.scaling for w, weight in parts]
    weights_a = torch.tensor([math.copysign(math.sqrt(abs(s)), s) for s in scaled])
    weights_b = torch.tensor([math.sqrt(abs(s)) for s in scaled])
    lora_a = _combine([w.lora_a for w, _ in parts], weights_a, spec)
    lora_b = _combine([w.lora_b for w, _ in parts], weights_b, spec)
    if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
        raise AdapterError(key, f"merge weights {list(spec.weights)} make the merged weights overflow float32")
    return LoRAWeights(lora_a.contiguous(), lora_b.contiguous(), 1.0)


def _combine(tensors: list[torch.Tensor], weights: torch.Tensor, spec: MergeSpec) -> torch.Tensor:
    # Imported here, not with the module: peft brings transformers' modeling code and torch._dynamo with it, a long
    # import on every replica's start, for requests that merge adapters only.
    from peft.utils import merge_utils

    if spec.merge_strategy == "linear":
        return merge_utils.task_arithmetic(tensors, weights)
    if spec.merge_strategy == "ties":
        return merge_utils.ties(tensors, weights, spec.density, spec.majority_sign_method)
    if spec.merge_strategy == "dare_linear":
        return merge_utils.dare_linear(tensors, weights, spec.density)
    return merge_utils.dare_ties(tensors, weights, spec.density, spec.majority_sign_method)
