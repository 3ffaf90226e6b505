"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE): a router picks each token's top-k experts, and the experts
run as grouped matrix products over the tokens sorted by expert.

- **Routing, as transformers routes**: the router's logits in the model dtype, their softmax in float32, the top k,
  renormalized to sum to 1 where the model does (Mixtral always; Qwen3-MoE and OLMoE by `norm_topk_prob`). Qwen3-MoE
  and OLMoE round the weights to the model dtype before the combine; Mixtral combines in float32 and rounds the
  weighted output (transformers' order, which bf16 results follow).
- **Grouped experts**: the (token, expert) pairs are sorted by expert once, so each expert's tokens are one
  contiguous block. On CPU one C++ call (grouped_simd_linear, engine/kernels/cpu/simd_linear.cpp) multiplies every
  expert's block by its gate/up weight and one more by its down weight, each expert's weights packed once for the
  engine's own linear kernel, and the outputs, times their router weights, are summed back into their tokens' rows
  in one index_add. No work is done per token, and experts no token chose are never read. Where that kernel does not
  serve (CUDA, the C++ operators off, shapes it does not tile), each expert's two linears are linears of their own,
  prepacked as a dense model's, run expert by expert.
- **Checkpoints in either layout**: transformers 5's fused expert tensors (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) and the per-expert one its save_pretrained writes and the Hub's checkpoints hold
  (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` /
  `w2`). The stacked weights are stored flat while they load ([E * 2I, H] and [E * H, I]), so that a per-expert
  tensor is a run of rows, loaded as a fused weight's parts are (engine/models/__init__.py); then the stacked weights
  are packed for the grouped kernel, or each expert's rows become its own linears (`prepare_experts`), before the
  model's linears are prepacked.

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


class Experts(nn.Module):
    """The experts' weights: stacked and stored flat while the checkpoint loads (the module docstring says why),
    then either packed for the grouped kernel (`pack`) or one linear per expert and projection (`split`), which the
    linears' prepacking puts on the engine's own kernels like any other linear."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = spec.num_experts, hidden, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts * 2 * spec.intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts * hidden, spec.intermediate_size))
        self.gate_up: nn.ModuleList | None = None  # per expert, once split
        self.down: nn.ModuleList | None = None
        self.ops = None  # the C++ operators, once packed for their grouped kernel

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded weights, [E, 2I, H] and [E, H, I] (views)."""
        return (self.gate_up_proj.detach().view(self.num_experts, 2 * self.intermediate, self.hidden),
                self.down_proj.detach().view(self.num_experts, self.hidden, self.intermediate))

    def split(self) -> None:
        """One linear per expert over its rows of the stacked weights (views: nothing is copied here)."""
        gate_up, down = self.stacked()
        self.gate_up = nn.ModuleList(_linear(weight) for weight in gate_up)
        self.down = nn.ModuleList(_linear(weight) for weight in down)
        del self.gate_up_proj, self.down_proj

    def pack(self, cpu_ops, storage: torch.dtype) -> None:
        """Every expert's weights in grouped_simd_linear's order, stored in `storage` (bf16 where the kernel widens
        bf16 weights for float32 rows)."""
        gate_up, down = self.stacked()
        self.register_buffer("packed_gate_up", _packed(cpu_ops, gate_up, storage))
        self.register_buffer("packed_down", _packed(cpu_ops, down, storage))
        self.ops = cpu_ops
        del self.gate_up_proj, self.down_proj

    def grouped(self, rows: torch.Tensor, offsets: torch.Tensor, activate) -> torch.Tensor:
        """rows sorted by expert (expert e's rows offsets[e]..offsets[e + 1]) through their experts, packed: the
        gate/up product, activate (act(gate) * up), the down product."""
        gate_up = self.ops.grouped_simd_linear(rows, self.packed_gate_up, offsets)
        return self.ops.grouped_simd_linear(activate(gate_up), self.packed_down, offsets)


def _packed(cpu_ops, weights: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """[E, out, in] packed expert by expert into one tensor (no second copy of all the experts at once)."""
    first = cpu_ops.simd_pack_linear_weight(weights[0].to(storage))
    packed = first.new_empty((weights.shape[0], *first.shape))
    for expert, weight in enumerate(weights):
        packed[expert].copy_(cpu_ops.simd_pack_linear_weight(weight.to(storage)))
    return packed


def grouped_storage(cpu_ops, weights: torch.Tensor, storage_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype grouped_simd_linear keeps these experts' weights [E, out, in] in, for rows of their dtype: theirs,
    or bf16 for float32 rows (storage_dtype bf16) where it widens bf16; None where it does not take them."""
    if cpu_ops is None:
        return None
    widens = cpu_ops.simd_linear_widens_bf16()
    if weights.dtype == torch.bfloat16 and widens:
        return None  # bf16 rows: this build's kernel takes bf16 weights for float32 rows only
    storage = torch.bfloat16 if storage_dtype == torch.bfloat16 and widens else weights.dtype
    return storage if cpu_ops.simd_linear_usable(weights[0].to(storage)) else None


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def prepare_experts(model: nn.Module, cpu_ops=None, storage_dtype: torch.dtype | None = None) -> None:
    """Every Experts module of a loaded model packed for the grouped kernel of `cpu_ops` where it takes both its
    weights, else split into per-expert linears (before the model's linears are prepacked). storage_dtype: as
    prepack_linears' (bf16 values held in float32 weights, kept as bf16 where the kernel widens them)."""
    for module in model.modules():
        if isinstance(module, Experts):
            storages = {grouped_storage(cpu_ops, weights, storage_dtype) for weights in module.stacked()}
            storage = storages.pop() if len(storages) == 1 else None
            if storage is not None:
                module.pack(cpu_ops, storage)
            else:
                module.split()


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
        self.experts = Experts(config.hidden_size, spec)
        self.act = activation(config.hidden_act)
        self.activation_name = config.hidden_act
        self.fused_ops = None  # the fused operators (set by use_fused_ops): act(gate) * up in one call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = self.route(x)
        if self.experts.ops is not None:
            return self._grouped(x, routes)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(routes.counts.tolist()):
            if count:
                rows = slice(start, start + count)
                out.index_add_(0, routes.tokens[rows], self._expert(x, routes, rows, expert))
                start += count
        return out

    def _grouped(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        """Every expert at once on the grouped kernel, the pairs' outputs weighted and summed into their tokens in
        expert order, as the per-expert path sums them."""
        rows = self.experts.ops.gather_rows(x, routes.tokens)
        out = self.experts.grouped(rows, routes.offsets(), self._activated) * routes.weights
        return torch.zeros_like(x).index_add_(0, routes.tokens, out.to(x.dtype))

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
        return Routes(tokens, experts.flatten()[order], weights.flatten()[order].unsqueeze(1), counts)


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
