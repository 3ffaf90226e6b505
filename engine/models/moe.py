"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top-k experts, and the experts
run as grouped matrix products over the tokens sorted by expert.

- **Routing, as transformers routes**: the router's logits in the model dtype, their softmax in float32, the top k,
  renormalized to sum to 1 where the model does (Mixtral always; Qwen3-MoE and OLMoE by `norm_topk_prob`). Qwen3-MoE
  and OLMoE round the weights to the model dtype before the combine; Mixtral combines in float32 and rounds the
  weighted output (transformers' order, which bf16 results follow).
- **Grouped experts**: the (token, expert) pairs are sorted by expert once, so each expert's tokens are one
  contiguous block; each expert with tokens runs one gate/up product and one down product over its whole block
  (each expert's two linears prepacked on the engine's own kernels, as a dense model's), and the outputs, times
  their router weights, are summed back into their tokens' rows in one index_add. No work is done per token, and
  experts no token chose are skipped.
- **Checkpoints in either layout**: transformers 5's fused expert tensors (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) and the per-expert one its save_pretrained writes and the Hub's checkpoints hold
  (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` /
  `w2`). The stacked weights are stored flat while they load ([E * 2I, H] and [E * H, I]), so that a per-expert
  tensor is a run of rows, loaded as a fused weight's parts are (engine/models/__init__.py); then each expert's rows
  become its own linears (`split_experts`), before the linears are prepacked.

Shared experts (Qwen2-MoE's) and other MoE architectures are refused by name (engine/models/__init__.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import uninitialized
from engine.models.activations import activation

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe")
# a per-expert checkpoint tensor: its layer path, expert index and projection (Mixtral's w1/w3/w2 or the others')
EXPERT_TENSOR = re.compile(r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
PROJECTIONS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}  # -> gate, up, down


@dataclass(frozen=True)
class MoESpec:
    """A model's experts, read from its config."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top k weights divided by their sum
    float32_combine: bool  # Mixtral: weights kept in float32 for the combine
    dense_layers: frozenset[int]  # Qwen3-MoE's mlp_only_layers and layers off its decoder_sparse_step: a dense MLP

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


def moe_spec(config) -> MoESpec | None:
    """The experts of a Qwen3-MoE, Mixtral or OLMoE config; None for a dense model."""
    kind = config.model_type
    if kind not in MOE_MODEL_TYPES:
        return None
    mixtral = kind == "mixtral"
    experts = config.num_local_experts if mixtral else config.num_experts
    inter = config.moe_intermediate_size if kind == "qwen3_moe" else config.intermediate_size
    return MoESpec(experts, config.num_experts_per_tok, inter, renormalize=mixtral or bool(config.norm_topk_prob),
                   float32_combine=mixtral, dense_layers=_dense_layers(config))


def _dense_layers(config) -> frozenset[int]:
    if config.model_type != "qwen3_moe":
        return frozenset()
    step = config.decoder_sparse_step
    return frozenset(i for i in range(config.num_hidden_layers)
                     if i in config.mlp_only_layers or config.num_experts == 0 or (i + 1) % step != 0)


class Experts(nn.Module):
    """The experts' weights: stacked and stored flat while the checkpoint loads (the module docstring says why),
    then one linear per expert and projection (`split`), which the linears' prepacking puts on the engine's own
    kernels like any other linear."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = spec.num_experts, hidden, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts * 2 * spec.intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts * hidden, spec.intermediate_size))
        self.gate_up: nn.ModuleList | None = None  # per expert, once split
        self.down: nn.ModuleList | None = None

    def split(self) -> None:
        """One linear per expert over its rows of the stacked weights (views: nothing is copied here)."""
        gate_up = self.gate_up_proj.detach().view(self.num_experts, 2 * self.intermediate, self.hidden)
        down = self.down_proj.detach().view(self.num_experts, self.hidden, self.intermediate)
        self.gate_up = nn.ModuleList(_linear(weight) for weight in gate_up)
        self.down = nn.ModuleList(_linear(weight) for weight in down)
        del self.gate_up_proj, self.down_proj


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def split_experts(model: nn.Module) -> None:
    """Every Experts module of a loaded model split into per-expert linears (before its linears are prepacked)."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.split()


@dataclass(frozen=True)
class Routes:
    """A step's (token, expert) pairs sorted by expert: each expert's tokens one contiguous run."""
    tokens: torch.Tensor  # [pairs] the token of each pair
    weights: torch.Tensor  # [pairs, 1] its router weight
    counts: list[int]  # pairs per expert, in expert order


class SparseMoeBlock(nn.Module):
    def __init__(self, config, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.gate = uninitialized.linear(config.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = Experts(config.hidden_size, spec)
        self.act = activation(config.hidden_act)
        self.activation_name = config.hidden_act
        self.fused_ops = None  # the fused operators (set by use_fused_ops): act(gate) * up in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = self.route(x)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(routes.counts):
            if count:
                rows = slice(start, start + count)
                out.index_add_(0, routes.tokens[rows], self._expert(x, routes, rows, expert))
                start += count
        return out

    def _expert(self, x: torch.Tensor, routes: Routes, rows: slice, expert: int) -> torch.Tensor:
        """One expert over its block of tokens, times their router weights, in the model dtype."""
        gate_up = self.experts.gate_up[expert](x[routes.tokens[rows]])
        out = self.experts.down[expert](self._activated(gate_up)) * routes.weights[rows]
        return out.to(x.dtype)

    def _activated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None and self.activation_name == "silu":
            return self.fused_ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def route(self, x: torch.Tensor) -> Routes:
        """Each token's top-k experts and weights (transformers' routing), as pairs sorted by expert."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.spec.float32_combine:
            weights = weights.to(x.dtype)
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.spec.num_experts)
        tokens = order // self.spec.top_k
        return Routes(tokens, weights.flatten()[order].unsqueeze(1), counts.tolist())


def expert_checkpoint_param(name: str) -> tuple[str, int, int] | None:
    """A per-expert checkpoint tensor's (stacked parameter, expert, part: 0 gate, 1 up, 2 down), or None."""
    match = EXPERT_TENSOR.match(name)
    if match is None or match.group(3) not in PROJECTIONS:
        return None
    layer, expert, part = match.group(1), int(match.group(2)), PROJECTIONS[match.group(3)]
    param = "down_proj" if part == 2 else "gate_up_proj"
    return f"{layer}.mlp.experts.{param}", expert, part


def expert_rows(spec: MoESpec, hidden: int, expert: int, part: int) -> int:
    """First row of one expert's part inside the flat stacked weight."""
    if part == 2:
        return expert * hidden
    return (2 * expert + part) * spec.intermediate_size
