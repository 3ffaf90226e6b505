"""Rotary position embedding with a precomputed cos/sin table, indexed by each token's row: its position.

A longrope rotary embedding (Phi-3's and Phi-4-mini's long-context models) turns a sequence with its short factors
while the sequence fits in the original context, and with its long ones once it is longer: transformers' Phi-3
then drops the cache and computes the whole sequence again with the long factors. The table holds both: rows
[0, max_positions) the short factors, rows [max_positions, 2 max_positions) the long ones, so that a token's row is
its position, or its position plus max_positions in a sequence past the switch; the scheduler recomputes a
sequence that grows past it (engine/scheduler.py), as transformers does. The second set doubles the table: for
Phi-3.5-mini's 131,072 positions and heads of 96, cos and sin take 96 MiB in bf16 instead of 48.
"""

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


def long_rope_switch(config) -> int | None:
    """The length past which a longrope rotary embedding turns a sequence with its long factors
    (original_max_position_embeddings); None for any other rotary embedding."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    return (params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            or config.max_position_embeddings)


def runs_long(switch: int | None, length: int) -> bool:
    """Whether a sequence of this length runs on a longrope model's long factors (switch: long_rope_switch)."""
    return switch is not None and length > switch


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


def _angles(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
    return torch.cat((freqs, freqs), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, kind: str | None = None):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim, kind)
        emb = _angles(inv_freq, max_positions)
        switch = long_rope_switch(config) if kind is None else None
        if switch is not None:  # the long factors' rows after the short ones' (their attention scaling is the same)
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=switch + 1)
            emb = torch.cat((emb, _angles(long_inv_freq, max_positions)))
        self.long_rows = max_positions if switch is not None else None  # where the long factors' rows start
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)
        self.fused_ops = None  # the fused operators' row gather (set by use_fused_ops; engine/layers/embedding.py)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [tokens, 1, head_dim] at each token's row, computed once per step and shared by all
        layers."""
        if self.fused_ops is None:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return (self.fused_ops.gather_rows(self.cos, positions).unsqueeze(1),
                self.fused_ops.gather_rows(self.sin, positions).unsqueeze(1))
