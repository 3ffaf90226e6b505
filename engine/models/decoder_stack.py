"""A Llama-family model's decoder layers in one call of the C++ operators (engine/kernels/cpu/decoder_stack.cpp).

The modules' path calls the C++ operators one at a time from Python: about 300 calls a decode step of SmolLM2, each
back through the interpreter and the GIL before the next starts, while the operators' other thread waits. The
stack runs the same operators in the same order from C++ with the GIL released for the whole pass, so the results
are the same bits. It serves a step when the modules' path would run on the C++ operators alone:
- every token attends through the in-place kernel (decodes and prompt chunks shorter than IN_PLACE_CHUNK); a
  longer chunk takes the prompt kernel or SDPA, per sequence, in Python;
- adapters' tokens, if any, take their deltas from the C++ operators' `lora_add_`, as the LoRA linears do on CPU;
- every linear is on one of the engine's own kernels (not oneDNN's, not bitsandbytes'), within the rows that
  kernel takes.
It runs every layer shape engine/models/llama.py does: Llama's norms, Gemma 2's and 3's sandwich and OLMo 2's post
norms, q/k norms per head or per projection, SiLU or GELU, Gemma 2's capped scores, sliding windows and Gemma 3's
two rotary tables. On random models of SmolLM2's shape in bf16 (Gemma 2, Gemma 3, OLMo 2) the stack served more
tokens/s than the modules.

On SmolLM2 bf16, the offline engine with and without the stack in one process, the stack served more tokens/s at
one stream, at 8 and at 32, and the step thread spent more of its time inside the operators' loops; so it did with
four rank-16 adapters on every projection, each request on one of them or the base.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata, InPlaceAttention
from engine.layers.linear import OwnKernel, PrepackedLinear
from engine.lora.backends import LoRAStepState, TokenSlots
from engine.lora.linear import LoRALinear
from engine.models.llama import FUSED_ACTIVATIONS, LlamaForCausalLM

NO_TENSOR = torch.empty(0)  # the stack's stand-in for a linear without a bias, or for LoRA slots it lacks
MAX_SUBS = 3  # B matrices a linear's LoRA slots hold at most (q, k, v fused), as decoder_stack.cpp lays them out
ACTIVATIONS = FUSED_ACTIVATIONS  # the MLP activations the stack runs, in its numbering
QK_NORMS = (None, "head", "projection")  # LlamaAttention.qk_norm, in the stack's numbering


@dataclass
class DecoderStack:
    """The tensors and shapes one call needs, gathered once: per layer [input norm, qkv, qkv bias, q norm, k norm,
    o, o bias, post-attention norm, pre-feedforward norm, post-feedforward norm, gate_up, gate_up bias, down, down
    bias] (NO_TENSOR where the layer has none: Llama's MLP input norm is the pre-feedforward one), then the final
    norm; a key and a value cache per layer."""
    ops: object  # the C++ operators' module
    weights: list[torch.Tensor]
    caches: list[torch.Tensor]
    heads: int
    kv_heads: int
    kernel: OwnKernel  # every linear's: amx_linear or simd_linear
    eps: float
    lora_state: LoRAStepState
    loras: list[LoRALinear]  # per layer its qkv, o, gate_up and down LoRA linears; none without LoRA
    max_rank: int
    rope_keys: list[str]  # the model's rotary tables, in the order the stack numbers them
    rope_tables: torch.Tensor  # int64, per layer the index of its table in rope_keys, -1 where it has no rotary
    # embedding (SmolLM3's); empty where every layer takes the first
    windows: torch.Tensor  # int64, per layer its sliding window, 0 for none; empty where no layer has one
    query_scale: float  # Granite's and Gemma's: the turned queries times it; 0: none
    residual_multiplier: float  # Granite's: attention and MLP outputs times it before the residual add; 0: none
    softcap: float  # Gemma 2's attention scores capped; 0: none
    activation: int  # the MLP's: ACTIVATIONS' index
    qk_norm: int  # QK_NORMS' index

    def takes(self, meta: AttentionMetadata, h: torch.Tensor) -> bool:
        """Whether this step's layers can run in the stack, with the results of the modules' path."""
        step = self.lora_state.step
        return (isinstance(meta, InPlaceAttention) and meta.in_place is not None and not meta.prefills
                and meta.kv_write is not None
                and self.kernel.takes(h) and (step is None or isinstance(step, TokenSlots)))

    def run(self, h: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor:
        """The final norm of the residual stream h after every layer (h is updated in place); tables: each rotary
        table's cos and sin at this step's positions."""
        q = meta.in_place
        step = self.lora_state.step
        token_slots = None if step is None else step.slots
        loras = [] if token_slots is None else [t for lora in self.loras for t in _lora_slots(lora)]
        cos, sin = [tables[key][0] for key in self.rope_keys], [tables[key][1] for key in self.rope_keys]
        return self.ops.decoder_stack(h, self.weights, self.caches, cos, sin, meta.slot_mapping, q.block_tables,
                                      q.context_lens, q.query_starts, q.query_lens, self.heads, self.kv_heads,
                                      int(self.kernel.name == "amx"), self.eps, loras,
                                      NO_TENSOR if token_slots is None else token_slots, self.max_rank,
                                      self.rope_tables, self.windows, self.query_scale, self.residual_multiplier,
                                      self.softcap, self.activation, self.qk_norm)


def build_decoder_stack(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cpu_ops,
                        lora_state: LoRAStepState) -> DecoderStack | None:
    """The stack of a loaded Llama-family model whose every decoder linear is on one own kernel (after the LoRA
    wrappers and any move of the weights); None where the modules' path must stay, as for a tensor-parallel shard
    (engine/distributed/), whose o and down projections sum over the ranks between the stack's operators."""
    if not isinstance(model, LlamaForCausalLM) or model.tensor_parallel is not None:
        return None
    if model.variant.moe is not None:  # experts in place of the MLP: the stack's layers are dense
        return None
    attn = model.layers[0].self_attn
    linears = [_base(linear) for layer in model.layers for linear in _linears(layer)]
    if not all(isinstance(lin, PrepackedLinear) and lin.kernel is not None for lin in linears):
        return None
    kernels = {lin.kernel for lin in linears}
    activation = model.layers[0].mlp.activation_name
    if len(kernels) != 1 or activation not in ACTIVATIONS:
        return None
    weights = [tensor for layer in model.layers for tensor in _layer_weights(layer)] + [model.norm.weight]
    loras = [linear for layer in model.layers for linear in _linears(layer) if isinstance(linear, LoRALinear)]
    if loras and (len(loras) != len(linears) or any(len(lora.b_slots) > MAX_SUBS for lora in loras)):
        return None
    keys = list(model.rotary)
    rope = [keys.index(layer.self_attn.rope_table) if layer.self_attn.use_rope else -1 for layer in model.layers]
    windows = [layer.self_attn.window or 0 for layer in model.layers]
    return DecoderStack(cpu_ops, weights, [cache for pair in kv_caches for cache in pair], attn.num_heads,
                        attn.num_kv_heads, kernels.pop(), model.norm.eps, lora_state, loras,
                        loras[0].max_rank if loras else 0, keys, _per_layer(rope), _per_layer(windows),
                        attn.query_scale or 0.0, model.variant.residual_multiplier or 0.0, attn.softcap or 0.0,
                        ACTIVATIONS.index(activation), QK_NORMS.index(attn.qk_norm))


def _per_layer(values: list[int]) -> torch.Tensor:
    """A per-layer int64 table for the stack, or NO_TENSOR where every layer has 0 (the first rotary table, no
    window), as the stack reads an empty table."""
    return NO_TENSOR if not any(values) else torch.tensor(values, dtype=torch.long)


def _lora_slots(lora: LoRALinear) -> list[torch.Tensor]:
    """A linear's LoRA slots as the stack reads them: A and its B matrices, padded to MAX_SUBS; nothing for a
    linear that no resident adapter targets (its LoRA linear adds nothing either)."""
    if not lora.slots_with_weights:
        return [NO_TENSOR] * (1 + MAX_SUBS)
    return [lora.a_slots, *lora.b_slots] + [NO_TENSOR] * (MAX_SUBS - len(lora.b_slots))


def _linears(layer: nn.Module) -> list[nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _base(linear: nn.Module) -> nn.Module:
    return linear.base if isinstance(linear, LoRALinear) else linear


def _packed(linear: nn.Module) -> list[torch.Tensor]:
    base = _base(linear)
    return [base.own_weight, NO_TENSOR if base.own_bias is None else base.own_bias]


def _layer_weights(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's tensors in the stack's order. LlamaDecoderLayer keeps the checkpoints' names: Llama's
    post_attention_layernorm normalizes the MLP's input, Gemma 2's and OLMo 2's the attention's output."""
    attn, mlp = layer.self_attn, layer.mlp
    qk_norms = [attn.q_norm.weight, attn.k_norm.weight] if attn.qk_norm else [NO_TENSOR, NO_TENSOR]
    post_attention = layer.post_attention_layernorm.weight
    if layer.sandwich:
        norms = [post_attention, layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight]
    elif layer.post_norms_only:
        norms = [post_attention, NO_TENSOR, layer.post_feedforward_layernorm.weight]
    else:
        norms = [NO_TENSOR, post_attention, NO_TENSOR]
    input_norm = NO_TENSOR if layer.post_norms_only else layer.input_layernorm.weight
    return [input_norm, *_packed(attn.qkv_proj), *qk_norms, *_packed(attn.o_proj), *norms, *_packed(mlp.gate_up_proj),
            *_packed(mlp.down_proj)]
