"""GPT-2 (the course's model) over the paged KV cache: learned positions, LayerNorm, fused c_attn."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import uninitialized
from engine.layers.attention import AttentionMetadata, KVCache, paged_attention
from engine.layers.lora import LoRATarget, fused_targets
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

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        self.wte = uninitialized.embedding(config.vocab_size, config.n_embd)
        self.wpe = uninitialized.embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = uninitialized.linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

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

    def checkpoint_name_to_param(self, name: str) -> tuple[str, int | None]:
        return name.removeprefix("transformer."), None

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.t() if name.endswith(self.conv1d_weights) else tensor
