"""Linears and embeddings whose weights are allocated but not drawn: a model's every weight is then read from its
checkpoint, or drawn once by load_format "dummy" (engine/models/__init__.py).

Why: nn.Linear and nn.Embedding draw initial weights as they are built (kaiming_uniform_, normal_), and the load
then overwrites all of them. Drawing was most of a small model's load, and building a model of Llama-3.2-1B's
shape in bf16 took far longer with it than without. They
stay torch's classes, so nothing that checks a module's type changes (an embedding is engine/layers/embedding.py's
subclass, whose lookup takes the fused operators' row gather): a linear is built on the meta device
(nothing drawn) and given fresh parameters; an embedding takes its weight as built. Both land on the device and in
the dtype in force (`torch.device(...)`, the default dtype), as torch's modules do. Not `torch.nn.utils.skip_init`:
its `to_empty`, and an embedding's init on the meta device, go through torch's Python reference ops, whose first use
imported torch._dynamo and cost as much as the drawing saved.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.embedding import Embedding


def linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    layer.weight = nn.Parameter(torch.empty(out_features, in_features))
    if bias:
        layer.bias = nn.Parameter(torch.empty(out_features))
    return layer


def embedding(num_embeddings: int, embedding_dim: int) -> Embedding:
    return Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
