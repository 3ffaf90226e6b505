"""Parse and validate a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).

Only plain LoRA on the per-layer linear projections, and on a mixture of experts' stacked expert parameters, is
served; every other feature is refused with a reason instead of being served wrong. The delta of one module (of
one expert) is always

    delta(x) = x @ lora_a.T @ lora_b.T * scaling

An expert parameter (PEFT's target_parameters, "mlp.experts.gate_up_proj" or "mlp.experts.down_proj") is saved
by PEFT as one lora_A [experts * r, in] and one lora_B [out, r * experts] under the experts module
("mlp.experts.lora_A"; a second parameter of the same module nests, "mlp.experts.base_layer.lora_A"): expert e's
A is rows e*r..(e+1)*r, its B the columns e, e + experts, ... (PEFT's ParamWrapper). Which parameter a pair is
follows from its shapes, which differ between the two; it is read into ExpertLoRAWeights, expert by expert.

PEFT saves lora_A as [r, in_features] and lora_B as [out_features, r] for GPT-2's Conv1D too
(fan_in_fan_out only matters when merging into the transposed base weight), so no transpose is needed.
Weights are read with safetensors only: pickled checkpoints are never opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import AdapterError, AdapterNotFoundError
from engine.lora.provider import ExpertLoRAWeights, LoRAAdapter, LoraShapes, LoRAWeights, check_rank
from lora_cache.adapter_folder import CONFIG_FILE, WEIGHTS_FILE

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

# Config keys (when set) for features that a plain x @ A.T @ B.T delta cannot express.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}
# These initialisations rewrite the base weights; unless PEFT converted the adapter on save (which resets
# init_lora_weights to true), it only fits that rewritten base.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def read_adapter(adapter_id: str, folder: Path, shapes: LoraShapes, max_bytes: int = 1 << 30,
                 max_rank: int | None = None) -> LoRAAdapter:
    """Read and validate the adapter in `folder` against the base model's LoRA `shapes`, its weights file
    at most `max_bytes` and its rank at most `max_rank` (the server's max_lora_rank). Messages name the adapter and
    never the folder: it is a server path (an adapters root, a download cache)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterNotFoundError(adapter_id, "its folder was not found")
    config = _read_config(adapter_id, folder)
    _check_features(adapter_id, config)
    _check_target_parameters(adapter_id, config, shapes)
    weights_file = _weights_file(adapter_id, folder, max_bytes)
    modules = _group_by_module(adapter_id, _read_tensors(adapter_id, weights_file), shapes)
    _check_layers(adapter_id, config, {layer for layer, _ in modules})
    layers: dict[int, dict[str, LoRAWeights | ExpertLoRAWeights]] = {}
    for (layer, key), (name, pair) in sorted(modules.items()):
        key, weights = _weights_of(adapter_id, config, name, pair, shapes, layer, key)
        if key in layers.get(layer, {}):
            raise AdapterError(adapter_id, f"{key} of layer {layer} has two pairs of LoRA weights")
        layers.setdefault(layer, {})[key] = weights
    weights = [w for modules_of_layer in layers.values() for w in modules_of_layer.values()]
    rank = max(w.lora_a.shape[-2] for w in weights)  # [r, in], or an expert parameter's [experts, r, in]
    check_rank(adapter_id, rank, max_rank)
    return LoRAAdapter(
        adapter_id=adapter_id,
        rank=rank,
        target_modules=tuple(sorted({key for per_layer in layers.values() for key in per_layer})),
        layers=layers,
        nbytes=sum(w.lora_a.nbytes + w.lora_b.nbytes for w in weights),
        base_model_name_or_path=config.get("base_model_name_or_path"),
        content_id=content_id(folder),
    )


def content_id(folder: Path) -> str:
    """sha256 of the adapter's config and weights files, 16 hex digits."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with (Path(folder) / name).open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _read_config(adapter_id: str, folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(adapter_id, f"{CONFIG_FILE} not found in its folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(adapter_id, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(adapter_id, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_features(adapter_id: str, config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise AdapterError(adapter_id, f"peft_type {config.get('peft_type')!r} is not supported; only LORA")
    for key, feature in UNSUPPORTED_FEATURES.items():
        if config.get(key):
            raise AdapterError(adapter_id, f"{feature} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(adapter_id, f"bias={config['bias']!r} is not supported; only 'none'")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(BASE_REWRITING_INITS):
        raise AdapterError(adapter_id, f"init_lora_weights={init!r} rewrites the base weights; save the adapter "
                                       "with path_initial_model_for_weight_conversion to get a plain LoRA")
    _check_rank_and_alpha(adapter_id, config.get("r", 8), config.get("lora_alpha", 8), "")  # PEFT's defaults
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(adapter_id, f"{key} must be an object")


def _weights_file(adapter_id: str, folder: Path, max_bytes: int) -> Path:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise AdapterError(adapter_id, f"pickled weights are refused ({', '.join(pickled)}); "
                                           "convert to safetensors")
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} not found in its folder")
    size = path.stat().st_size
    if size > max_bytes:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} is {size} bytes, over the limit of {max_bytes} bytes "
                                       "(max_adapter_bytes)")
    return path


def _read_tensors(adapter_id: str, path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers and data
        raise AdapterError(adapter_id, f"cannot read {WEIGHTS_FILE}: {e}") from None
    if not tensors:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} holds no tensors")
    return tensors


# "model.layers.3.self_attn.q_proj" (Llama family) or "transformer.h.3.attn.c_attn" (GPT-2)
_LAYER_MODULE = re.compile(r"(?:^|.*\.)(?:layers|h)\.(?P<layer>\d+)\.(?P<key>.+)")
# a mixture of experts' experts module, where PEFT keeps the LoRA of its stacked parameters, nested once per
# further parameter it targets
_EXPERTS_MODULE = re.compile(r"mlp\.experts(?:\.base_layer)*")
ROUTERS = ("mlp.gate", "block_sparse_moe.gate")  # a mixture of experts' router (Qwen3-MoE and OLMoE's, Mixtral's)
# what follows ".lora_" in a weight name: "A.weight", or "A.default.weight" with an adapter name
_LORA_WEIGHT = re.compile(r"(?P<ab>[AB])(?:\.[\w-]+)?\.weight")


def _group_by_module(adapter_id: str, tensors: dict[str, torch.Tensor],
                     lora_shapes: LoraShapes) -> dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]]:
    """(layer, module key) -> (full module name, {"A": tensor, "B": tensor}) from PEFT tensor names (an experts
    module's key as PEFT nests it: "mlp.experts", "mlp.experts.base_layer")."""
    shapes, num_layers = lora_shapes.modules, lora_shapes.num_layers
    modules: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]] = {}
    # LoRA tensors first: an unsupported target module (lm_head, embeddings) is the reason to report, not the
    # full weights PEFT saves alongside it.
    for tensor_name in sorted(tensors, key=lambda n: ".lora_" not in n):
        tensor = tensors[tensor_name]
        # PEFT names: base_model.model.<module name>.lora_A[.<adapter name>].weight
        name, found, rest = tensor_name.removeprefix("base_model.model.").partition(".lora_")
        if not found:
            raise AdapterError(adapter_id, f"tensor {tensor_name!r} is not a LoRA weight "
                                           "(full or extra module weights are not supported)")
        match = _LAYER_MODULE.fullmatch(name)
        if match is not None and match["key"] in ROUTERS:
            raise AdapterError(adapter_id, f"target module {name!r} is a mixture of experts' router: LoRA on the "
                                           f"router is not supported")
        if match is None or match["key"] not in shapes and not _targets_experts(match["key"], lora_shapes):
            raise AdapterError(adapter_id, f"target module {name!r} is not supported; "
                                           f"supported: {', '.join(sorted(shapes))}")
        layer, key = int(match["layer"]), match["key"]
        if layer >= num_layers:
            raise AdapterError(adapter_id, f"{name} is in layer {layer} but the base model has {num_layers} layers")
        weight = _LORA_WEIGHT.fullmatch(rest)
        if weight is None:
            raise AdapterError(adapter_id, f"tensor {tensor_name!r} is not a lora_A/lora_B weight "
                                           "(DoRA magnitudes, LoRA biases and embedding LoRA are not supported)")
        _, pair = modules.setdefault((layer, key), (name, {}))
        if weight["ab"] in pair:
            raise AdapterError(adapter_id, f"lora_{weight['ab']} of {name} appears twice")
        pair[weight["ab"]] = tensor
    return modules


def _targets_experts(key: str, shapes: LoraShapes) -> bool:
    return bool(shapes.experts) and _EXPERTS_MODULE.fullmatch(key) is not None


def _check_target_parameters(adapter_id: str, config: dict, shapes: LoraShapes) -> None:
    """target_parameters, when set, name only the base's stacked expert parameters (a suffix of a parameter's
    name, as PEFT matches them); the router is refused as in target_modules."""
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(adapter_id, "target_parameters must be a list of parameter names")
    for target in targets:
        if target.endswith(tuple(f"{router}.weight" for router in ROUTERS)):
            raise AdapterError(adapter_id, f"target parameter {target!r} is a mixture of experts' router: LoRA on "
                                           f"the router is not supported")
        if not any(target == key or target.endswith("." + key) for key in shapes.experts):
            supported = ", ".join(sorted(shapes.experts)) or ("none: this server serves no adapters on experts (a "
                                                              "dense base, or expert_lora off)")
            raise AdapterError(adapter_id, f"LoRA on raw parameters (target_parameters) {target!r} is not "
                                           f"supported; supported: {supported}")


def _weights_of(adapter_id: str, config: dict, name: str, pair: dict[str, torch.Tensor], shapes: LoraShapes,
                layer: int, key: str) -> tuple[str, LoRAWeights | ExpertLoRAWeights]:
    """A module's key and weights: a linear's, or an expert parameter's (its key found from its shapes)."""
    if key in shapes.modules:
        return key, _module_weights(adapter_id, config, name, pair, shapes.modules[key])
    return _expert_weights(adapter_id, config, name, pair, shapes, layer)


def _expert_weights(adapter_id: str, config: dict, name: str, pair: dict[str, torch.Tensor], shapes: LoraShapes,
                    layer: int) -> tuple[str, ExpertLoRAWeights]:
    a, b = (_lora_tensor(adapter_id, name, pair, ab) for ab in "AB")
    module = re.sub(r"(\.base_layer)+$", "", name)
    if layer not in shapes.expert_layers:
        raise AdapterError(adapter_id, f"{module} targets experts in layer {layer}, whose MLP is dense")
    rank, alpha, rank_source = _rank_and_alpha(config, module)
    _check_rank_and_alpha(adapter_id, rank, alpha, f" for {module}")
    experts = shapes.num_experts
    if a.shape[0] != experts * rank or b.shape[1] != experts * rank:
        raise AdapterError(adapter_id, f"rank {rank} in {rank_source} over {experts} experts needs lora_A of "
                                       f"{experts * rank} rows and lora_B of as many columns; {module} has "
                                       f"{a.shape[0]} and {b.shape[1]}")
    key = next((k for k, (i, o) in shapes.experts.items() if (a.shape[1], b.shape[0]) == (i, o)), None)
    if key is None:
        raise AdapterError(adapter_id, f"{module} maps {a.shape[1]} -> {b.shape[0]} features per expert, which no "
                                       f"expert parameter of the base model does: the adapter was made for a "
                                       f"different base model")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    lora_a = a.view(experts, rank, a.shape[1]).contiguous()
    lora_b = b.view(b.shape[0], rank, experts).permute(2, 0, 1).contiguous()
    return key, ExpertLoRAWeights(lora_a, lora_b, float(scaling))


def _module_weights(adapter_id: str, config: dict, name: str, pair: dict[str, torch.Tensor],
                    shape: tuple[int, int]) -> LoRAWeights:
    a, b = (_lora_tensor(adapter_id, name, pair, ab) for ab in "AB")
    rank, alpha, rank_source = _rank_and_alpha(config, name)
    _check_rank_and_alpha(adapter_id, rank, alpha, f" for {name}")
    if a.shape[0] != rank:
        raise AdapterError(adapter_id, f"rank {rank} in {rank_source} but lora_A of {name} has {a.shape[0]} rows")
    if b.shape[1] != rank:
        raise AdapterError(adapter_id, f"rank {rank} in {rank_source} but lora_B of {name} has "
                                       f"{b.shape[1]} columns")
    in_features, out_features = shape
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise AdapterError(adapter_id, f"{name} maps {a.shape[1]} -> {b.shape[0]} features but in the base model "
                                       f"it maps {in_features} -> {out_features}: the adapter was made for a "
                                       "different base model")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAWeights(lora_a=a, lora_b=b, scaling=float(scaling))


def _check_rank_and_alpha(adapter_id: str, rank, alpha, where: str) -> None:
    """A rank a positive integer and an alpha a finite number (a NaN alpha would make every logit NaN)."""
    if type(rank) is not int or rank <= 0 or type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise AdapterError(adapter_id, f"r must be a positive integer and lora_alpha a finite number{where}, "
                                       f"got r={rank!r}, lora_alpha={alpha!r}")


def _check_layers(adapter_id: str, config: dict, layers: set[int]) -> None:
    """layers_to_transform, when set, an integer or a list of them, naming every layer that has weights: PEFT would
    leave the others' weights unused, so serving them would not give PEFT's outputs."""
    chosen = config.get("layers_to_transform")
    if chosen is None:
        return
    if not (type(chosen) is int or isinstance(chosen, list) and all(type(i) is int for i in chosen)):
        raise AdapterError(adapter_id, f"layers_to_transform must be an integer or a list of them, got {chosen!r}")
    chosen = {chosen} if type(chosen) is int else set(chosen)
    outside = sorted(layers - chosen)
    if outside:
        raise AdapterError(adapter_id, f"{WEIGHTS_FILE} has weights for layers {outside}, which "
                                       f"layers_to_transform {sorted(chosen)} leaves out")


def _lora_tensor(adapter_id: str, name: str, pair: dict[str, torch.Tensor], ab: str) -> torch.Tensor:
    """lora_A or lora_B of module `name` as a finite 2-D float32 CPU tensor."""
    if ab not in pair:
        raise AdapterError(adapter_id, f"lora_{ab} of {name} is missing")
    tensor = pair[ab]
    if tensor.ndim != 2 or not tensor.is_floating_point():
        raise AdapterError(adapter_id, f"lora_{ab} of {name} must be a 2-D float tensor, "
                                       f"got {tensor.dtype} {list(tensor.shape)}")
    tensor = tensor.to(torch.float32).contiguous()
    if not torch.isfinite(tensor).all():
        raise AdapterError(adapter_id, f"lora_{ab} of {name} holds NaN or infinite values")
    return tensor


def _rank_and_alpha(config: dict, name: str) -> tuple[int, float, str]:
    """The module's rank and alpha (rank_pattern / alpha_pattern over the config-wide r / lora_alpha),
    and where the rank came from, for error messages."""
    rank_key = _pattern_key(config.get("rank_pattern") or {}, name)
    alpha_key = _pattern_key(config.get("alpha_pattern") or {}, name)
    rank = config["rank_pattern"][rank_key] if rank_key else config.get("r", 8)
    alpha = config["alpha_pattern"][alpha_key] if alpha_key else config.get("lora_alpha", 8)
    return rank, alpha, f"rank_pattern[{rank_key!r}]" if rank_key else "config"


def _pattern_key(patterns: dict, module_name: str) -> str | None:
    """PEFT's rule: the first key that matches the end of the module name at a dot boundary wins, whether
    a plain suffix ("q_proj", "model.layers.0.self_attn.q_proj") or a regex."""
    for key in patterns:
        if module_name == key or module_name.endswith("." + key):
            return key
        try:
            if re.fullmatch(rf"(.*\.)?({key})", module_name):
                return key
        except re.error:
            pass  # not a regex after all; only the suffix rule applies
    return None
