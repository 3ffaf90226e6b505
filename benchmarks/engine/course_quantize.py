"""The quantization lesson's own scheme, for comparison only (not a serving path).

The course maps each whole tensor onto 0..255 with one scale and one zero point: scale =
(max - min) / 255, zero point = min, q = uint8((w - min) / scale) (the cast truncates), and back
w' = q * scale + min. One outlier stretches the scale for every weight of the tensor, which is why
bitsandbytes scales per row (LLM.int8) or per block of 64 weights (NF4) instead.
"""

from __future__ import annotations

import torch


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-tensor zero-point uint8, exactly as in the course: (uint8 tensor, (scale, zero point))."""
    min_val, max_val = t.min(), t.max()
    scale = (max_val - min_val) / 255
    zero_point = min_val
    quantized = torch.clamp((t - zero_point) / scale, min=0, max=255).to(torch.uint8)
    return quantized, (scale, zero_point)


def dequantize(quantized: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    scale, zero_point = state
    return quantized.to(torch.float32) * scale + zero_point


def course_roundtrip(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(reconstructed weight, bytes stored: the uint8 tensor plus its two fp32 numbers)."""
    quantized, state = quantize(weight.float())
    return dequantize(quantized, state), quantized.numel() + 2 * 4


def bnb_roundtrip(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, int]:
    """(reconstructed weight, bytes stored) through the serving path's own quantization (engine.layers)."""
    from torch import nn

    from engine.layers.quantized import dequantized_weight, quantize_linear
    from engine.memory import weight_bytes

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    module = quantize_linear(linear, method, torch.float32, torch.device("cpu"))
    return dequantized_weight(module), sum(weight_bytes(module).values())


def errors(weight: torch.Tensor, reconstructed: torch.Tensor) -> dict:
    diff = (weight.float() - reconstructed).abs()
    return {"mean_abs": diff.mean().item(), "max_abs": diff.max().item(),
            "relative_rms": (diff.pow(2).mean().sqrt() / weight.float().pow(2).mean().sqrt()).item()}
