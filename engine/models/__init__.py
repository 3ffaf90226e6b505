"""Model registry and safetensors weight loading."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.distributed.parallel import TensorParallel
from engine.layers.quantized import quantize_decoder_linears
from engine.lora.provider import LoraShapes
from engine.models.experts import prepare_experts
from engine.models.gpt2 import GPT2LMHeadModel
from engine.models.llama import LlamaForCausalLM, RMSNorm
from engine.models.llama_variants import attention_window
from engine.models.moe import expert_lora_shapes, moe_spec
from engine.models.packing import AsLoaded

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "SmolLM3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "OlmoeForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


LORA_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM, "gemma": LlamaForCausalLM, "gemma2": LlamaForCausalLM,
    "gemma3_text": LlamaForCausalLM, "olmo2": LlamaForCausalLM, "smollm3": LlamaForCausalLM,
    "granite": LlamaForCausalLM, "qwen3_moe": LlamaForCausalLM, "mixtral": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM, "gpt2": GPT2LMHeadModel}


def lora_shapes(hf_config, experts: bool = True, max_rank: int | None = None) -> LoraShapes:
    """The base model's LoRA-capable linears, as its model class declares them, and where it is a mixture of
    experts (unless `experts` is False) its stacked expert parameters: what every adapter must fit, with a rank of
    at most max_rank (the slots': max_lora_rank)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in LORA_MODEL_TYPES:
        raise ValueError(f"unsupported base architecture {model_type!r} for LoRA; "
                         f"supported: {', '.join(LORA_MODEL_TYPES)}")
    layers, spec = hf_config.num_hidden_layers, moe_spec(hf_config)
    modules = LORA_MODEL_TYPES[model_type].lora_shapes(hf_config)
    if spec is None or not experts:
        return LoraShapes(modules, layers, max_rank=max_rank)
    return LoraShapes(modules, layers, expert_lora_shapes(hf_config), spec.num_experts,
                      frozenset(i for i in range(layers) if spec.sparse(i)), max_rank)


def model_class(hf_config) -> type[nn.Module]:
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention: an embedding model, such as "
                         "EmbeddingGemma) is not served: this engine generates text, attending causally")
    for arch in hf_config.architectures or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {hf_config.architectures}; supported: {', '.join(ARCHITECTURES)}")


def check_tensor_parallel(hf_config, world_size: int) -> None:
    """Refuse, naming both numbers, a tensor_parallel_size that this model's heads, KV heads or MLP columns do not
    split evenly (its model class says which sizes must split: engine/distributed/)."""
    model_class(hf_config).check_tensor_parallel(hf_config, world_size)


def context_limit(hf_config, asked: int | None) -> int:
    """The longest context served for this model: `asked` (max_model_len) up to its positions, refused with the
    figures past them, never cut to them. By default the positions, except for a model whose attention slides over a
    window in some layers (Mistral 7B v0.1's 4,096 tokens; Qwen2 with use_sliding_window), whose default is that
    window: within it those layers attend fully, which equals the window, on every path, as vLLM serves such a
    model with its sliding window disabled. Past it the C++ CPU kernel computes the windows exactly, as it does
    Gemma 2's and 3's (which default to their positions); elsewhere such a max_model_len is refused, saying why
    (engine/backends/: bind_model). (A dynamic NTK rotary embedding changes its base only past the positions,
    which bound the context anyway; a longrope one switches to its long factors past its original context, as the
    engine does: engine/layers/rotary.py.)"""
    positions = getattr(hf_config, "max_position_embeddings", None) or hf_config.n_positions
    if asked is not None and asked > positions:
        raise ValueError(f"max_model_len {asked} is past this model's context of {positions} tokens "
                         f"(max_position_embeddings)")
    return asked or min(positions, attention_window(hf_config) or positions)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(path: Path, hf_config, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantization: str = "none", load_format: str = "safetensors", packing: AsLoaded | None = None,
               weight_dtype: torch.dtype | None = None, parallel: TensorParallel | None = None) -> nn.Module:
    """The model in `dtype` on `device`, its linears and experts laid out by `packing`, the step backend's
    (packing.py; None: as loaded). A `weight_dtype` narrower than `dtype` (bf16 weights of a model computing in
    float32, on a CPU without bf16 matrix math): every weight is rounded to it, so the model computes what a
    `weight_dtype` model would in float32, and the linears keep it as their storage where a kernel widens it.
    `parallel` with more than one worker: this rank's tensor-parallel share of the model (engine/distributed/),
    refused before anything loads where its sizes do not split; the full checkpoint is read, then sharded before
    the linears are laid out."""
    cls = model_class(hf_config)
    if quantization != "none" and moe_spec(hf_config) is not None:
        raise ValueError(f"quantization {quantization!r} of a mixture of experts ({hf_config.model_type}) is not "
                         f"supported yet: bitsandbytes would quantize its attention alone, not its experts")
    sharded = parallel is not None and parallel.sharded
    if sharded:
        check_tensor_parallel(hf_config, parallel.world_size)
    with _default_dtype(dtype), torch.device(device):
        model = cls(hf_config, max_positions)
    if load_format == "dummy":
        _random_weights(model)
    else:
        _load_weights(model, path)
    narrow = weight_dtype if weight_dtype not in (None, dtype) else None
    if narrow is not None:
        _round_weights(model, narrow)
    if sharded:
        model.shard(parallel)
    packing = packing or AsLoaded()
    prepare_experts(model, packing, narrow)  # grouped, or linears laid out below
    quantize_decoder_linears(model, quantization, dtype, device)
    packing.pack_linears(model, narrow)  # the linears left in the model dtype
    return model.eval()


def use_fused_ops(model: nn.Module, ops) -> None:
    """Hand a set of fused operators (the C++ CPU operators, engine/kernels/cpu_ops.py, or the Triton ones on CUDA,
    engine/kernels/cuda_ops.py: the same calls) to every module with a fused path (RMSNorm and its residual
    addition, rotary in attention, SiLU times up in the MLP, the embeddings' row gather)."""
    for module in model.modules():
        if hasattr(module, "fused_ops"):
            module.fused_ops = ops


@torch.no_grad()
def _random_weights(model: nn.Module, std: float = 0.02) -> None:
    """load_format "dummy": matrices drawn from N(0, std), linears' biases zero (the model's linears and embeddings
    are built with their storage unfilled, engine/layers/uninitialized.py), norm scales as built; the model's shapes
    and speed without a checkpoint (as vLLM's dummy format)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    for param in model.parameters():
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=generator)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()


@torch.no_grad()
def _round_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter rounded to `dtype`'s values, kept in its own dtype; not Gemma's norm scales, whose
    1 + w a `dtype` model keeps in float32 too (engine/models/llama.py)."""
    exact = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm) and m.float32_scale}
    for param in model.parameters():
        if param.is_floating_point() and id(param) not in exact:
            param.copy_(param.to(dtype))


def _load_weights(model: nn.Module, path: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    shard_rows: dict[str, int] = {}  # rows copied into each fused weight: the model's storage starts unfilled
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for ckpt_name in f.keys():
                name, shard = model.checkpoint_name_to_param(ckpt_name)
                if name not in params:
                    continue  # e.g. GPT-2's causal-mask buffers
                tensor = f.get_tensor(ckpt_name)
                if hasattr(model, "transform_checkpoint_tensor"):
                    tensor = model.transform_checkpoint_tensor(name, tensor)
                offset = None if shard is None else model.shard_offset(name, shard)
                _copy_into(params[name], tensor, offset, ckpt_name)
                loaded.add(name)
                if shard is not None:
                    shard_rows[name] = shard_rows.get(name, 0) + tensor.shape[0]
    tied = {n for n, p in params.items() if any(p is params[m] for m in loaded)}
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ValueError(f"checkpoint in {path} lacks weights for: {_first_names(missing)}")
    partial = sorted(name for name, rows in shard_rows.items() if rows != params[name].shape[0])
    if partial:
        raise ValueError(f"checkpoint in {path} lacks part of the fused weights (q/k/v or gate/up) for: "
                         f"{_first_names(partial)}")


def _first_names(names: list[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (" ..." if len(names) > shown else "")


@torch.no_grad()
def _copy_into(param: torch.Tensor, tensor: torch.Tensor, row_offset: int | None, ckpt_name: str) -> None:
    """Copy a checkpoint tensor into a parameter, or into its rows of a fused (stacked) parameter."""
    target = param if row_offset is None else param.narrow(0, row_offset, tensor.shape[0])
    if target.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {ckpt_name}: checkpoint {tuple(tensor.shape)}, "
                         f"model {tuple(target.shape)}")
    target.copy_(tensor)
