"""GPT-2 (the course's model) over the paged KV cache: learned positions, LayerNorm, fused c_attn.

Tensor parallelism (engine/distributed/): `GPT2LMHeadModel.shard` keeps one rank's share, as Megatron-LM splits it:
its heads of c_attn's q, k and v and c_proj's matching input rows, its columns of c_fc and the MLP's c_proj rows,
and its vocabulary rows of the tied embedding and LM head; the learned positions stay whole on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.linears import RowParallelLinear, column_parallel
from engine.distributed.parallel import TensorParallel
from engine.distributed.shards import check_divides
from engine.layers import uninitialized
from engine.layers.attention import AttentionMetadata, KVCache, paged_attention
from engine.layers.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from engine.lora.linear import LoRATarget, fused_targets
from engine.models.activations import activation


class GPT2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            raise NotImplementedError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
        self.num_heads = self.num_kv_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = uninitialized.linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = uninitialized.linear(config.n_embd, config.n_embd)

    def shard(self, parallel: TensorParallel) -> None:
        """This rank's heads of q, k and v (each split apart in c_attn) and c_proj's matching input rows."""
        width = self.num_heads * self.head_dim
        self.c_attn = column_parallel(self.c_attn, [width] * 3, parallel)
        self.c_proj = RowParallelLinear(self.c_proj, parallel)
        self.num_heads = self.num_kv_heads = self.num_heads // parallel.world_size

    def forward(self, x, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(paged_attention(q, k, v, cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = uninitialized.linear(config.n_embd, inner)
        self.c_proj = uninitialized.linear(inner, config.n_embd)
        self.act = activation(config.activation_function)

    def shard(self, parallel: TensorParallel) -> None:
        self.c_fc = column_parallel(self.c_fc, [self.c_fc.out_features], parallel)
        self.c_proj = RowParallelLinear(self.c_proj, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, h, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h), cache, meta)
        return h + self.mlp(self.ln_2(h))


class GPT2LMHeadModel(nn.Module):
    # HF GPT-2 stores these as Conv1D, [in, out]: transpose into nn.Linear's [out, in].
    conv1d_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    kernel_only_attention = None  # its attention runs on every path (engine/models/llama.py: Gemma 2's does not)
    long_rope_rows = None  # learned positions: one row per position
    kv_window = None  # every key stays in reach
    decode_graphs = True  # its decode steps are captured in CUDA graphs

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.wte = uninitialized.embedding(config.vocab_size, config.n_embd)
        self.wpe = uninitialized.embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = uninitialized.linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.tensor_parallel: TensorParallel | None = None  # set by shard(): this rank's share of every layer

    @staticmethod
    def check_tensor_parallel(c, world_size: int) -> None:
        """Refuse a tensor_parallel_size that splits the heads or the MLP's columns unevenly (the vocabulary is
        padded instead)."""
        check_divides(world_size, {"n_head": c.n_head, "n_inner": c.n_inner or 4 * c.n_embd})

    def shard(self, parallel: TensorParallel) -> None:
        self.check_tensor_parallel(self.config, parallel.world_size)
        self.wte = VocabParallelEmbedding(self.wte, parallel)
        self.lm_head = VocabParallelHead(self.lm_head, parallel, self.wte.weight)
        for block in self.h:
            block.attn.shard(parallel)
            block.mlp.shard(parallel)
        self.tensor_parallel = parallel

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.h

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        attn = self.h[0].attn
        return len(self.h), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        h = self.wte(input_ids) + self.wpe(positions)
        for block, cache in zip(self.h, kv_caches):
            h = block(h, cache, meta)
        return self.ln_f(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @staticmethod
    def lora_shapes(c) -> dict[str, tuple[int, int]]:
        """PEFT module key -> (in_features, out_features) of each LoRA-capable linear (none fused)."""
        n, inner = c.n_embd, c.n_inner or 4 * c.n_embd
        return {"attn.c_attn": (n, 3 * n), "attn.c_proj": (n, n), "mlp.c_fc": (n, inner), "mlp.c_proj": (inner, n)}

    def lora_targets(self) -> list[dict[str, LoRATarget]]:
        shapes = self.lora_shapes(self.config)
        return [fused_targets(shapes, {key: (key,) for key in shapes})] * len(self.h)

    def column_parts(self, path: str) -> tuple[int, ...]:
        """The full output sizes of the parts a column-parallel linear stacks (c_attn: q, k and v)."""
        c = self.config
        return (c.n_embd,) * 3 if path == "attn.c_attn" else (c.n_inner or 4 * c.n_embd,)

    def checkpoint_name_to_param(self, name: str) -> tuple[str, int | None]:
        return name.removeprefix("transformer."), None

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if name.endswith(self.conv1d_weights) else tensor
