"""Llama-family decoder (Llama, Mistral, SmolLM2/3, Qwen2, Qwen3, Phi-3, Gemma 1-3, Granite, OLMo 2, and the
mixtures of experts Qwen3-MoE, Mixtral and OLMoE, whose MLPs are engine/models/moe.py's) over the paged KV cache; how each architecture departs from Llama's layers is data read from its config
(engine/models/llama_variants.py).

q/k/v and gate/up projections are fused into one matmul each; HF checkpoints are mapped onto
the fused weights at load time.

Tensor parallelism (engine/distributed/): `LlamaForCausalLM.shard` keeps one rank's share of a loaded model, as
Megatron-LM splits it: each attention its query heads and the KV heads they read (q, k and v sharded apart in the
fused projection) and o_proj by input rows, each MLP its gate/up columns and down_proj's input rows, the embedding
and LM head their vocabulary rows; o_proj and down_proj sum over the ranks (one all-reduce each). A sharded model
runs the modules' path layer by layer: not the C++ decoder stack (engine/models/decoder_stack.py) and not CUDA
graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.linears import RowParallelLinear, column_parallel
from engine.distributed.parallel import TensorParallel
from engine.distributed.shards import check_divides
from engine.kernels.torch_rotary import apply_rotary
from engine.layers import uninitialized
from engine.layers.attention import AttentionMetadata, KVCache, paged_attention
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from engine.lora.linear import LoRATarget, fused_targets
from engine.models.activations import activation
from engine.models.llama_variants import LlamaVariant, variant_of
from engine.models.moe import SparseMoeBlock, expert_checkpoint_param, expert_rows

ONE_TABLE = "shared"  # the key of the rotary table every layer shares (all but Gemma 3's)
# the MLP activations the fused operators compute with the product (transformers' names): SiLU, and GELU exact or
# tanh-approximated (Gemma's), which eager runs on ATen's threads beside the operators' own (cpu/activation.cpp)
FUSED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, float32_scale: bool = False):
        super().__init__()
        # float32_scale: Gemma's norms, whose 1 + w transformers adds and multiplies by in float32, rounding the
        # scaled row once (OLMo 2's multiply by w so); kept in float32 whatever the model dtype. In bf16, with
        # 1 + w rounded to bf16 and the normalised row rounded before the scale, random Gemma 2 and 3 models of
        # head_dim 256 kept transformers' float32 tokens for fewer tokens (up to each sequence's first difference)
        # than scaled in float32, which kept them longer than transformers' own bf16 run did
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32 if float32_scale else None))
        self.float32_scale = float32_scale
        self.eps = eps
        # The fused operators (set by use_fused_ops: the C++ ones on CPU, Triton on CUDA): one call with the same
        # rounding instead of ~8 small ops, each with a call's overhead on CPU
        self.fused_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 and scale in the model dtype, as transformers does: F.rms_norm on a bf16 input
        # lost enough precision here to turn SmolLM2's "Paris" into nonsense.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.weight.dtype != x.dtype:  # a Gemma norm's float32 1 + w: scaled in float32, rounded once
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place, rounded as `residual + delta` rounds), then its norm: one call of the fused
        operators instead of an addition and a norm."""
        if self.fused_ops is not None:
            return self.fused_ops.add_rms_norm(delta, residual, self.weight, self.eps)
        return self(residual.add_(delta))


def _norm(size: int, config, variant: LlamaVariant) -> RMSNorm:
    """A norm of the variant's kind: Gemma's (1 + w, added as the weights load) and OLMo 2's scale in float32."""
    return RMSNorm(size, config.rms_norm_eps, float32_scale=variant.float32_norm_scale)


class LlamaAttention(nn.Module):
    def __init__(self, config, variant: LlamaVariant, layer: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = uninitialized.linear(config.hidden_size, q_size + 2 * kv_size, bias=variant.qkv_bias)
        self.o_proj = uninitialized.linear(q_size, config.hidden_size, bias=variant.o_bias)
        # Qwen3 and Gemma 3 normalize each head's query and key (RMSNorm over head_dim) before the rotary embedding,
        # OLMo 2 the query and key projections whole
        self.qk_norm = variant.qk_norm
        self.use_rope = variant.rotates(layer)  # SmolLM3's layers without positions leave q and k as projected
        # Granite's and Gemma 2's and 3's attention scale in place of 1/sqrt(head_dim): the queries times it and
        # sqrt(head_dim), so that every attention path, which divides by sqrt(head_dim), scores with it
        scale = variant.attention_scale
        self.query_scale = None if scale is None else scale * self.head_dim ** 0.5
        self.softcap = variant.attention_softcap  # Gemma 2: scores soft-capped before the softmax
        self.window = variant.window(layer)  # Gemma 2 and 3, Mistral past its window: a window, computed exactly
        # the key of its rotary table in the model's: Gemma 3's sliding layers turn by a base of their own
        self.rope_table = variant.rope_kind(layer) or ONE_TABLE
        if self.qk_norm:
            q_width, k_width = (q_size, kv_size) if self.qk_norm == "projection" else (self.head_dim, self.head_dim)
            self.q_norm = _norm(q_width, config, variant)
            self.k_norm = _norm(k_width, config, variant)
        self.fused_ops = None  # the fused operators (set by use_fused_ops): rotary in one call

    def shard(self, parallel: TensorParallel) -> None:
        """Keep this rank's query heads and the KV heads they read (q, k and v each split by heads in the fused
        projection), o_proj's matching input rows, summed over the ranks; the head counts become the rank's."""
        n = parallel.world_size
        self.qkv_proj = column_parallel(self.qkv_proj, self.split_sizes, parallel)
        self.o_proj = RowParallelLinear(self.o_proj, parallel)
        self.num_heads, self.num_kv_heads = self.num_heads // n, self.num_kv_heads // n
        self.split_sizes = [size // n for size in self.split_sizes]

    def forward(self, x, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q_size, kv_size, _ = self.split_sizes
        qk, v = self.qkv_proj(x).split([q_size + kv_size, kv_size], dim=-1)
        if self.qk_norm == "projection":
            qk = self._projection_norms(qk)
        qk = qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = self._head_norms(qk)
        qk = self._rotate(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.query_scale is not None:
            q = q * self.query_scale
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.softcap, self.window))

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding on every query and key head, in one fused call (over the first dimensions of each
        head that cos and sin cover: Phi-4-mini's 3/4); a layer without it gets its heads as one contiguous tensor,
        as the rotary's output is."""
        if not self.use_rope:
            return qk.contiguous()
        if self.fused_ops is not None:
            return self.fused_ops.rotary(qk, cos, sin)
        return apply_rotary(qk, cos, sin)

    def _projection_norms(self, qk: torch.Tensor) -> torch.Tensor:
        """OLMo 2's norms of the query projection and of the key projection, each over all its heads."""
        q, k = qk.split(self.split_sizes[:2], dim=-1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)

    def _head_norms(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's norms of each query head and each key head, over the head's dimensions."""
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = uninitialized.linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = uninitialized.linear(config.intermediate_size, config.hidden_size, bias=bias)
        name = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma 2 names it so
        self.act = activation(name)
        self.activation_name = name
        self.fused_ops = None  # the fused operators (set by use_fused_ops): act(gate) * up in one call

    def shard(self, parallel: TensorParallel) -> None:
        """Keep this rank's intermediate columns of gate and of up, and down_proj's matching input rows, summed
        over the ranks."""
        self.gate_up_proj = column_parallel(self.gate_up_proj, [self.intermediate_size] * 2, parallel)
        self.down_proj = RowParallelLinear(self.down_proj, parallel)
        self.intermediate_size //= parallel.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_ops is not None and self.activation_name in FUSED_ACTIVATIONS:
            return self.down_proj(self._fused(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def _fused(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation_name == "silu":
            return self.fused_ops.silu_and_mul(gate_up)
        return self.fused_ops.gelu_and_mul(gate_up, int(self.activation_name == "gelu_pytorch_tanh"))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, variant: LlamaVariant, layer: int):
        super().__init__()
        self.post_norms_only = variant.post_norms_only  # OLMo 2: no input_layernorm
        if not self.post_norms_only:
            self.input_layernorm = _norm(config.hidden_size, config, variant)
        self.self_attn = LlamaAttention(config, variant, layer)
        self.post_attention_layernorm = _norm(config.hidden_size, config, variant)
        moe = variant.moe  # Qwen3-MoE, Mixtral, OLMoE: experts in place of the MLP (Qwen3-MoE: not in every layer)
        self.mlp = SparseMoeBlock(config, moe) if moe is not None and moe.sparse(layer) else LlamaMLP(config)
        self.residual_multiplier = variant.residual_multiplier  # Granite: each output times it before the add
        # Gemma 2's sandwich, under its checkpoint's names: post_attention_layernorm normalizes the attention
        # output, pre_feedforward_layernorm the MLP's input (Llama's post_attention_layernorm), and
        # post_feedforward_layernorm the MLP's output; OLMo 2's has no input norms
        self.sandwich = variant.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config.hidden_size, config, variant)
        if self.sandwich or self.post_norms_only:
            self.post_feedforward_layernorm = _norm(config.hidden_size, config, variant)

    def forward(self, h, delta, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """h: the residual stream, updated in place; delta: the previous layer's MLP output, not yet added to it
        (None in the first layer). Returns this layer's MLP output, for the next norm to add: each residual
        addition then runs inside a norm (RMSNorm.add_and_norm), as vLLM's fused add-norm does."""
        if self.post_norms_only:
            return self._forward_post_norms(h, delta, cos, sin, cache, meta)
        x = self.input_layernorm(h) if delta is None else self.input_layernorm.add_and_norm(delta, h)
        attn = self._scaled(self.self_attn(x, cos, sin, cache, meta))
        if self.sandwich:
            x = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn), h)
            return self.post_feedforward_layernorm(self.mlp(x))
        return self._scaled(self.mlp(self.post_attention_layernorm.add_and_norm(attn, h)))

    def _forward_post_norms(self, h, delta, cos, sin, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """OLMo 2's layer: attention and MLP read the residual stream as it is, and their outputs are normalized
        before they join it."""
        if delta is not None:
            h.add_(delta)
        h.add_(self.post_attention_layernorm(self.self_attn(h, cos, sin, cache, meta)))
        return self.post_feedforward_layernorm(self.mlp(h))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: times Granite's residual multiplier."""
        return out if self.residual_multiplier is None else out * self.residual_multiplier


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (fused parameter fragment, shard index)
    fused_shards = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.variant = variant_of(config, max_positions)
        self.embed_tokens = uninitialized.embedding(config.vocab_size, config.hidden_size)
        # Gemma's embedding scale, rounded to the model dtype as transformers rounds it (sqrt(2048) is 45.25 in bf16)
        scale = self.variant.embed_scale
        self.register_buffer("embed_scale", None if scale is None else torch.tensor(scale, dtype=torch.float32).to(
            torch.get_default_dtype()), persistent=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, self.variant, i) for i in range(config.num_hidden_layers))
        self.norm = _norm(config.hidden_size, config, self.variant)
        self.lm_head = uninitialized.linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        head_dim = self.layers[0].self_attn.head_dim
        # one rotary table, or one per kind of layer (Gemma 3's sliding and global layers)
        keys = dict.fromkeys(layer.self_attn.rope_table for layer in self.layers)
        self.rotary = nn.ModuleDict({key: RotaryEmbedding(config, head_dim, max_positions, torch.get_default_dtype(),
                                                          None if key == ONE_TABLE else key) for key in keys})
        # a longrope model's long factors: a token of a sequence past the switch reads its position + this row
        self.long_rope_rows = next((r.long_rows for r in self.rotary.values() if r.long_rows is not None), None)
        # the layers in one C++ call where a step allows it (engine/models/decoder_stack.py), set by the runner once
        # the weights and caches are in place
        self.decoder_stack = None
        self.tensor_parallel: TensorParallel | None = None  # set by shard(): this rank's share of every layer

    @staticmethod
    def check_tensor_parallel(c, world_size: int) -> None:
        """Refuse a tensor_parallel_size that splits a head or the MLP's columns unevenly (the vocabulary is
        padded instead), or OLMo 2's query and key norms over whole projections, which would need the ranks'
        squares summed."""
        variant = variant_of(c)
        if variant.moe is not None:
            raise ValueError(f"tensor parallelism does not split {c.model_type}'s experts yet (tensor_parallel_size "
                             f"{world_size})")
        if variant.qk_norm == "projection":
            raise ValueError(f"tensor parallelism does not split {c.model_type}'s query and key norms over whole "
                             f"projections (tensor_parallel_size {world_size})")
        check_divides(world_size, {"num_attention_heads": c.num_attention_heads,
                                   "num_key_value_heads": c.num_key_value_heads,
                                   "intermediate_size": c.intermediate_size})

    def shard(self, parallel: TensorParallel) -> None:
        """Keep this rank's share of every layer (the module docstring says which); a tied LM head shares the
        embedding's vocabulary shard."""
        self.check_tensor_parallel(self.config, parallel.world_size)
        tied = self.lm_head.weight is self.embed_tokens.weight
        self.embed_tokens = VocabParallelEmbedding(self.embed_tokens, parallel)
        self.lm_head = VocabParallelHead(self.lm_head, parallel, self.embed_tokens.weight if tied else None)
        for layer in self.layers:
            layer.self_attn.shard(parallel)
            layer.mlp.shard(parallel)
        self.tensor_parallel = parallel

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the KV cache this model needs."""
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # a new tensor: the residual stream the layers add into in place
        if self.embed_scale is not None:
            h.mul_(self.embed_scale)
        if self.variant.embed_multiplier is not None:  # Granite's, a Python scalar as transformers multiplies by it
            h.mul_(self.variant.embed_multiplier)
        delta = None
        tables = {key: rotary.lookup(positions) for key, rotary in self.rotary.items()}
        if self.decoder_stack is not None and self.decoder_stack.takes(meta, h):
            return self.decoder_stack.run(h, tables, meta)
        for layer, cache in zip(self.layers, kv_caches):
            cos, sin = tables[layer.self_attn.rope_table]
            delta = layer(h, delta, cos, sin, cache, meta)
        return self.norm.add_and_norm(delta, h)

    @property
    def kernel_only_attention(self) -> str | None:
        """What this model's attention computes that only the C++ CPU attention kernel does (Gemma 2's capped
        scores, sliding windows: Gemma 2's and 3's, Mistral's and Qwen2's past their window), or None."""
        variant = self.variant
        if variant.attention_softcap is not None:
            return f"soft-capped attention scores (attn_logit_softcapping {variant.attention_softcap})"
        windows = {layer.self_attn.window for layer in self.layers} - {None}
        return f"sliding-window layers ({min(windows)} tokens)" if windows else None

    @property
    def decode_graphs(self) -> bool:
        """Whether a decode step may be captured in a CUDA graph: not a mixture of experts, whose routing reads
        each step's expert counts back to the host."""
        return self.variant.moe is None

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends over (Mistral's, and an all-sliding Qwen2's, past their default context),
        or None where any layer attends further back: then no key older than it is read again."""
        windows = {layer.self_attn.window for layer in self.layers}
        return windows.pop() if len(windows) == 1 else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.variant.logits_scaling is not None:  # Granite
            logits = logits / self.variant.logits_scaling
        cap = self.variant.final_softcap  # Gemma 2
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @staticmethod
    def lora_shapes(c) -> dict[str, tuple[int, int]]:
        """PEFT module key -> (in_features, out_features) of each LoRA-capable linear, from the config alone."""
        return variant_of(c).lora_shapes(c)

    def lora_targets(self) -> list[dict[str, LoRATarget]]:
        """Per layer: linear path -> its LoRA target (the PEFT modules fused into it)."""
        targets = fused_targets(self.variant.lora_shapes(self.config), self.variant.lora_fusions)
        return [targets] * len(self.layers)

    def column_parts(self, path: str) -> tuple[int, ...]:
        """The full output sizes of the parts a column-parallel linear stacks, each split over the ranks on its
        own (engine/lora/shards.py cuts LoRA B as they are cut)."""
        if path == "self_attn.qkv_proj":
            n = self.tensor_parallel.world_size if self.tensor_parallel is not None else 1
            return tuple(size * n for size in self.layers[0].self_attn.split_sizes)
        return (self.config.intermediate_size,) * 2  # mlp.gate_up_proj

    def shard_offset(self, param_name: str, shard: int) -> int:
        """First row of shard `shard` inside a fused weight or bias (in the experts' stacked weights, shard
        3 * expert + part: engine/models/moe.py)."""
        if ".mlp.experts." in param_name:
            return expert_rows(self.variant.moe, self.config.hidden_size, *divmod(shard, 3))
        if "qkv_proj" in param_name:
            sizes = self.layers[0].self_attn.split_sizes
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard])

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Gemma's norm weights w as the 1 + w they scale by, added in float32 as transformers adds it; transformers
        5's stacked expert tensors flat, as the model stores them."""
        if self.variant.norm_offset and name.endswith("norm.weight"):
            return tensor.float() + self.variant.norm_offset
        if ".mlp.experts." in name and tensor.dim() == 3:
            return tensor.flatten(0, 1)
        return tensor

    def checkpoint_name_to_param(self, name: str) -> tuple[str, int | None]:
        """Map an HF tensor name to (our parameter name, shard index within a fused weight or None)."""
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MoE blocks
        expert = expert_checkpoint_param(name)
        if expert is not None:
            param, index, part = expert
            return param, 3 * index + part
        for fragment, (fused, shard) in self.fused_shards.items():
            if f".{fragment}." in name:
                return name.replace(f".{fragment}.", f".{fused}."), shard
        return name, None
