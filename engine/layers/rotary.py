"""Rotary position embedding with a precomputed cos/sin table, indexed by each token's position."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rotary_dim(config, head_dim: int) -> int:
    """The dimensions of each head that the rotary embedding turns, its first ones: all of them, or the share that
    `partial_rotary_factor` names (Phi-4-mini's 0.75), as transformers counts them."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return head_dim if factor is None else int(head_dim * factor)


def inverse_frequencies(config, head_dim: int, kind: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling, as transformers computes them for this config's rope type (over the rotary
    dimensions only, where they are part of each head); kind: the kind of layer whose parameters to take, where the
    config has them per kind (Gemma 3's `sliding_attention` and `full_attention`)."""
    params = getattr(config, "rope_parameters", None) or {}
    if kind is not None:
        params = params[kind]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = rotary_dim(config, head_dim)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=kind)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, kind: str | None = None):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim, kind)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)
        self.fused_ops = None  # the fused operators' row gather (set by use_fused_ops; engine/layers/embedding.py)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [tokens, 1, head_dim], computed once per step and shared by all layers."""
        if self.fused_ops is None:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return (self.fused_ops.gather_rows(self.cos, positions).unsqueeze(1),
                self.fused_ops.gather_rows(self.sin, positions).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; a cos/sin narrower than the heads turns their first dimensions and passes the
    rest through, as transformers does for a partial rotary embedding."""
    turned = cos.shape[-1]
    if turned < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
