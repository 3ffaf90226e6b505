"""The rotary embedding's turn in plain PyTorch: the reference that the C++ and Triton operators are held to, and
what they fall back to where they do not apply (a partial rotary on CUDA). A kernel-level function, so that every
backend reaches it without importing the layers above it."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; a cos/sin narrower than the heads turns their first dimensions and passes the
    rest through, as transformers does for a partial rotary embedding."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
