"""Quantized base linears through bitsandbytes: int8 (LLM.int8, row-wise absmax) or 4-bit NF4 (blockwise).

Only the decoder layers' linears are quantized; embeddings, norms and the lm_head keep the model
dtype, which is also the compute dtype. LoRA linears wrap these modules like any other base, so
adapters apply on top in full precision (QLoRA style). bitsandbytes quantizes a weight when it
is moved to its device, on CUDA or on CPU alike. On a CPU with AVX-512 BF16 its NF4 kernel repacks
the weight at the first forward and computes in bf16, whatever the compute dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.config import QUANTIZATIONS

# bitsandbytes logs a warning on every int8 matmul whose input is not fp16 (it casts it): once is enough.
logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
INT8_OUTLIER_THRESHOLD = 6.0  # LLM.int8(): activation columns above this stay in 16-bit


def quantize_decoder_linears(model: nn.Module, method: str, compute_dtype: torch.dtype,
                             device: torch.device) -> None:
    """Replace every nn.Linear inside the model's decoder layers by its bitsandbytes counterpart (in place)."""
    if method == "none":
        return
    for layer in model.decoder_layers:
        _replace(layer, method, compute_dtype, device)


def _replace(module: nn.Module, method: str, compute_dtype: torch.dtype, device: torch.device) -> None:
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, quantize_linear(child, method, compute_dtype, device))
        else:
            _replace(child, method, compute_dtype, device)


@torch.no_grad()
def quantize_linear(linear: nn.Linear, method: str, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    bias = linear.bias is not None
    weight = linear.weight.detach().to("cpu")
    if method == "int8":
        quantized = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=bias, has_fp16_weights=False,
                                        threshold=INT8_OUTLIER_THRESHOLD, device="meta")
        quantized.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    elif method == "nf4":
        # No double quantization of the block scales: it would save 0.4 bit per weight and cost a dequantization.
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=bias, compute_dtype=compute_dtype,
                                      compress_statistics=False, quant_type="nf4", device="meta")
        quantized.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=False, quant_type="nf4")
    else:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if bias:
        quantized.bias = nn.Parameter(linear.bias.detach().to("cpu"), requires_grad=False)
    return quantized.to(device)  # quantizes the weight


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The float32 weight a quantized linear computes with (for references and error measurements)."""
    import bitsandbytes as bnb

    weight = module.weight
    if isinstance(weight, bnb.nn.Params4bit):
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            raise ValueError("this NF4 weight was repacked for the CPU kernel at its first forward; "
                             "dequantize before running the module")
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if isinstance(weight, bnb.nn.Int8Params):  # the row scales move to the module's state at its first forward
        scales = weight.SCB if weight.SCB is not None else module.state.SCB
        return weight.data.float() * scales.float()[:, None] / 127
    return weight.detach().float()
