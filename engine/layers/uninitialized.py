"""Linears and embeddings whose weights are allocated but not drawn: a model's every weight is then read from its
checkpoint, or drawn once by load_format "dummy" (engine/models/__init__.py).

Why: nn.Linear and nn.Embedding draw initial weights as they are built (kaiming_uniform_, normal_), and the load
then overwrites all of them. On 2 cores of an AVX2 EPYC that drawing was the whole of building SmolLM2's modules,
about 1.0 s of a 1.8-2.0 s model load in float32, and 18.9 s for a model of Llama-3.2-1B's shape in bf16; built
this way the modules take milliseconds. They are torch's own classes (built on the meta device, then given
uninitialised storage on the device and in the dtype in force), so nothing that checks a module's type changes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init


def linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    return skip_init(nn.Linear, in_features, out_features, bias=bias, device=torch.get_default_device())


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    return skip_init(nn.Embedding, num_embeddings, embedding_dim, device=torch.get_default_device())
