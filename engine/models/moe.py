"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top-k experts, and the experts
run as grouped matrix products over the tokens sorted by expert.

- **Routing, as transformers routes**: the router's logits in the model dtype, their softmax in float32, the top k,
  renormalized to sum to 1 where the model does (Mixtral always; Qwen3-MoE and OLMoE by `norm_topk_prob`). Qwen3-MoE
  and OLMoE round the weights to the model dtype before the combine; Mixtral combines in float32 and rounds the
  weighted output (transformers' order, which bf16 results follow).
- **Grouped experts**: the (token, expert) pairs are sorted by expert once, so each expert's tokens are one
  contiguous block. One call of the device's grouped kernel (engine/models/experts.py: C++ on CPU, Triton on CUDA
  where chosen) multiplies every expert's block by its gate/up weight, the fused operator computes act(gate) * up, and one more
  call multiplies by the down weights; the outputs, times their router weights, are summed back into their tokens'
  rows in one index_add. No work is done per token, and experts no token chose are never read. Where no grouped
  kernel serves, each expert's two linears are linears of their own, run expert by expert.
- **Adapters on the experts** (PEFT's target_parameters): each product takes its pairs' deltas
  (engine/lora/expert_linear.py), each pair reading its token's adapter slot's weights for its expert.
- **Checkpoints in either layout**: transformers 5's fused expert tensors (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) and the per-expert one its save_pretrained writes and the Hub's checkpoints hold
  (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` /
  `w2`). The stacked weights are stored flat while they load ([E * 2I, H] and [E * H, I]), so that a per-expert
  tensor is a run of rows, loaded as a fused weight's parts are (engine/models/__init__.py); then the grouped kernel
  takes the stacked weights, or each expert's rows become its own linears (engine/models/experts.py), before the
  model's linears are prepacked.

Shared experts (Qwen2-MoE's) and other MoE architectures are refused by name (engine/models/__init__.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import uninitialized
from engine.lora.backends import LoRAStepState, TorchLoRA
from engine.lora.expert_linear import ExpertLoRA
from engine.lora.provider import LoraShapes
from engine.models.activations import activation
from engine.models.experts import Experts

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe")
# the stacked expert parameters adapters may target (PEFT's target_parameters), as transformers 5 names them
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
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


def expert_lora_shapes(config) -> dict[str, tuple[int, int]]:
    """Each expert's (in_features, out_features) of the parameters adapters may target: gate/up fused, as
    transformers 5 stacks them ([E, 2I, H]), and down ([E, H, I])."""
    spec = moe_spec(config)
    return {GATE_UP: (config.hidden_size, 2 * spec.intermediate_size), DOWN: (spec.intermediate_size,
                                                                               config.hidden_size)}


def _dense_layers(config) -> frozenset[int]:
    if config.model_type != "qwen3_moe":
        return frozenset()
    step = config.decoder_sparse_step
    return frozenset(i for i in range(config.num_hidden_layers)
                     if i in config.mlp_only_layers or config.num_experts == 0 or (i + 1) % step != 0)


@dataclass(frozen=True)
class Routes:
    """A step's (token, expert) pairs sorted by expert: each expert's tokens one contiguous run."""
    tokens: torch.Tensor  # [pairs] the token of each pair
    experts: torch.Tensor  # [pairs] its expert, ascending
    weights: torch.Tensor  # [pairs, 1] its router weight
    counts: torch.Tensor  # [experts] pairs per expert, in expert order

    def offsets(self) -> torch.Tensor:
        """[experts + 1]: expert e's pairs are offsets[e]..offsets[e + 1]."""
        return torch.nn.functional.pad(self.counts.cumsum(0), (1, 0))


class SparseMoeBlock(nn.Module):
    def __init__(self, config, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.gate = uninitialized.linear(config.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = Experts(spec.num_experts, config.hidden_size, spec.intermediate_size)
        self.act = activation(config.hidden_act)
        self.activation_name = config.hidden_act
        self.fused_ops = None  # the fused operators (set by use_fused_ops): act(gate) * up in one call
        self.lora: ExpertLoRA | None = None  # adapters on the experts (wrap_expert_loras)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = self.route(x)
        slots = self.lora.pair_slots(routes.tokens, routes.experts) if self.lora is not None else None
        if self.experts.kernel is not None:
            return self._grouped(x, routes, slots)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(routes.counts.tolist()):
            if count:
                rows = slice(start, start + count)
                out.index_add_(0, routes.tokens[rows], self._expert(x, routes, rows, expert, slots))
                start += count
        return out

    def _grouped(self, x: torch.Tensor, routes: Routes, slots: torch.Tensor | None) -> torch.Tensor:
        """Every expert at once on the grouped kernel, the pairs' outputs weighted and summed into their tokens in
        expert order, as the per-expert path sums them."""
        offsets = routes.offsets()
        out = self._mlp(self.experts.kernel.gather(x, routes.tokens), slots,
                        lambda rows: self.experts.grouped_gate_up(rows, offsets),
                        lambda rows: self.experts.grouped_down(rows, offsets))
        return torch.zeros_like(x).index_add_(0, routes.tokens, (out * routes.weights).to(x.dtype))

    def _expert(self, x: torch.Tensor, routes: Routes, rows: slice, expert: int,
                slots: torch.Tensor | None) -> torch.Tensor:
        """One expert over its block of tokens, times their router weights, in the model dtype."""
        out = self._mlp(x[routes.tokens[rows]], None if slots is None else slots[rows],
                        self.experts.gate_up[expert], self.experts.down[expert])
        return (out * routes.weights[rows]).to(x.dtype)

    def _mlp(self, rows: torch.Tensor, slots: torch.Tensor | None, gate_up, down) -> torch.Tensor:
        """The experts' MLP over pairs' rows, each product with its pairs' adapter deltas (slots: None, none)."""
        hidden = gate_up(rows)
        if slots is not None:
            self.lora.add_(GATE_UP, hidden, rows, slots)
        activated = self._activated(hidden)
        out = down(activated)
        if slots is not None:
            self.lora.add_(DOWN, out, activated, slots)
        return out

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
        return Routes(tokens, experts.flatten()[order], weights.flatten()[order].unsqueeze(1), counts)


def wrap_expert_loras(model: nn.Module, shapes: LoraShapes, state: LoRAStepState, max_loras: int, max_rank: int,
                      dtype: torch.dtype, backend: TorchLoRA) -> list[ExpertLoRA | None]:
    """Adapter slots on every layer's experts (None for a dense layer), in layer order; none for a dense model."""
    if not shapes.experts:
        return []
    loras: list[ExpertLoRA | None] = []
    for layer in model.decoder_layers:
        block = next((m for m in layer.modules() if isinstance(m, SparseMoeBlock)), None)
        if block is not None:
            block.lora = ExpertLoRA(dict(shapes.experts), shapes.num_experts, state, max_loras, max_rank, dtype,
                                    backend)
        loras.append(None if block is None else block.lora)
    return loras


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
