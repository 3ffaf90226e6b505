"""The MLP activation a model's config names, computed as transformers computes it.

SiLU, the Llama family's, is torch's F.silu, as transformers' own SiLU module is. Any other comes from transformers'
ACT2FN, imported at first use: transformers.activations brings its hub-kernel integration and torch.distributed.tensor
with it, a noticeable part of every replica's start.
"""

from __future__ import annotations

from torch import nn


def activation(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]
