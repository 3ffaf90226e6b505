"""How each Llama-family architecture departs from Llama's decoder layers, read once from its config.

One decoder serves them all (engine/models/llama.py); what differs is data, not code paths spread over the model:
- Llama, Mistral, SmolLM2: the reference. Mistral 7B v0.1's layers (and Qwen2's past `max_window_layers`, with
  `use_sliding_window`) attend over a window: within it full attention equals it, so the window is the default
  context; a context past it takes Gemma 2's windows below, computed by the C++ kernel alone.
- Qwen2: biases on q, k and v.
- Qwen3: each query and key head RMS-normalized before the rotary embedding.
- Phi-3: q/k/v and gate/up stored fused in its checkpoints (the layout the engine computes in), and its adapters
  target them fused (PEFT modules `qkv_proj` and `gate_up_proj`), so a LoRA linear there has one sub-module.
- SmolLM3: no rotary embedding in some layers (`no_rope_layers`: every fourth layer attends without positions).
- Granite: four scalars: the embeddings times `embedding_multiplier`, each layer's attention and MLP outputs times
  `residual_multiplier` before they join the residual stream, attention scores times `attention_multiplier` in
  place of 1/sqrt(head_dim) (the queries are scaled by it times sqrt(head_dim), so every attention path, the C++
  kernels' included, computes it), and the logits divided by `logits_scaling`.
- Gemma: norms that scale by 1 + weight (the 1 is added in float32 as the weights load, so every norm path, the C++
  decoder stack's included, computes it; the scale stays in float32, and scales the float32 row before its one
  rounding, as transformers does), embeddings times sqrt(hidden_size) rounded to the model dtype, as transformers
  rounds it, and a GELU-gated MLP (its config's activation, so no SiLU-only fused path).
- Gemma 2: Gemma's, with
  - sandwich norms: each layer's attention and MLP outputs normalized before they join the residual stream;
  - attention scores scaled by `query_pre_attn_scalar` ** -0.5 (Granite's mechanism) and soft-capped,
    cap * tanh(score / cap) with cap `attn_logit_softcapping`, before the mask;
  - sliding-window layers (`layer_types`), every other one attending to its last `sliding_window` positions;
  - the logits soft-capped the same way by `final_logit_softcapping`.
  The capped scores and the windows are computed by the C++ CPU attention kernel alone, so such a model attends
  there alone (the other step backends refuse it: engine/backends/).
- Gemma 3 (text, `gemma3_text`): Gemma 2's layers without the soft-capping, with Qwen3's per-head query and key
  norms (scaling by 1 + weight, as Gemma's norms do), and the sliding layers' rotary embedding from a base of their
  own (`rope_parameters` per layer type; five sliding layers to one global in Gemma 3).

- OLMo 2: no norm before attention or the MLP; their outputs are normalized before they join the residual stream
  (`post_attention_layernorm`, `post_feedforward_layernorm`), and the query and key projections are normalized
  whole, over every head at once, before the rotary embedding. Its norms, like Gemma's, scale the float32 row and
  round once.

- Qwen3-MoE, Mixtral, OLMoE: Qwen3's, Mistral's and OLMo 2's attention (OLMoE with the usual norms before
  attention and the MLP, scaling as Llama's), and experts in place of the MLP (engine/models/moe.py): in every
  layer, or in Qwen3-MoE's sparse ones (`decoder_sparse_step`, `mlp_only_layers`). Their adapters target
  attention.

Rotary embeddings over part of each head (`partial_rotary_factor`, Phi-4-mini's) are the rotary table's concern
(engine/layers/rotary.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.models.moe import MoESpec, moe_spec

# The engine's fused linears and the PEFT modules each holds, in output-column order
SPLIT_FUSIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}
FUSED_FUSIONS = {path: (path,) for path in SPLIT_FUSIONS}  # Phi-3: its adapters target the fused linears
WINDOWED = ("gemma2", "gemma3_text")  # sliding-window layers beside global ones, computed exactly


@dataclass(frozen=True)
class LlamaVariant:
    qkv_bias: bool
    o_bias: bool
    # queries and keys normalized before the rotary: "head" (Qwen3, Gemma 3: each head over head_dim) or
    # "projection" (OLMo 2: the query and the key projection each over all its heads); None: not at all
    qk_norm: Literal["head", "projection"] | None
    norm_offset: float  # Gemma's norms scale by 1 + weight: 1.0, added to each norm weight as it loads
    embed_scale: float | None  # Gemma: embeddings times this (sqrt(hidden_size)), rounded to the model dtype
    fused_checkpoint: bool  # Phi-3: qkv_proj and gate_up_proj in the checkpoint and in its adapters
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: whether each layer turns q and k; None: every layer
    embed_multiplier: float | None = None  # Granite's embedding_multiplier (a Python scalar, as transformers uses it)
    residual_multiplier: float | None = None  # Granite: attention and MLP outputs times this before the residual add
    # the attention scale in place of 1/sqrt(head_dim): Granite's attention_multiplier, Gemma 2's
    # query_pre_attn_scalar ** -0.5 (where that differs from head_dim)
    attention_scale: float | None = None
    logits_scaling: float | None = None  # Granite: the logits divided by this
    sandwich_norms: bool = False  # Gemma 2: attention and MLP outputs normalized before the residual add
    attention_softcap: float | None = None  # Gemma 2's attn_logit_softcapping
    final_softcap: float | None = None  # Gemma 2's final_logit_softcapping, on the logits
    post_norms_only: bool = False  # OLMo 2: no input norms; attention and MLP outputs normalized before the add
    float32_norm_scale: bool = False  # Gemma, OLMo 2: norms scale the float32 row by a float32 weight, rounding once
    # Gemma 2 and 3, and Mistral's or Qwen2's past their window: per layer its sliding window, 0 for the whole context
    windows: tuple[int, ...] | None = None
    rope_kinds: tuple[str, ...] | None = None  # Gemma 3: per layer the key of its rotary's rope_parameters
    moe: MoESpec | None = None  # Qwen3-MoE, Mixtral, OLMoE: the experts in place of the MLP (engine/models/moe.py)

    def rotates(self, layer: int) -> bool:
        """Whether the layer applies the rotary embedding to its queries and keys."""
        return self.rope_layers is None or self.rope_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window the layer attends over, computed exactly; None: the whole context."""
        return None if self.windows is None else self.windows[layer] or None

    def rope_kind(self, layer: int) -> str | None:
        """The layer's rotary table: a key of its config's rope_parameters, or None for the one table."""
        return None if self.rope_kinds is None else self.rope_kinds[layer]

    @property
    def lora_fusions(self) -> dict[str, tuple[str, ...]]:
        fusions = FUSED_FUSIONS if self.fused_checkpoint else SPLIT_FUSIONS
        if self.moe is not None:  # a mixture of experts: adapters on attention
            return {path: parts for path, parts in fusions.items() if path.startswith("self_attn.")}
        return fusions

    def lora_shapes(self, c) -> dict[str, tuple[int, int]]:
        """PEFT module key -> (in_features, out_features) of each LoRA-capable linear, from the config alone:
        adapters are validated where no model is loaded (the cache actor)."""
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        q_size = heads * head_dim
        kv_size = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
        hidden, inter = c.hidden_size, c.intermediate_size
        attention = {"self_attn.q_proj": (hidden, q_size), "self_attn.k_proj": (hidden, kv_size),
                     "self_attn.v_proj": (hidden, kv_size), "self_attn.o_proj": (q_size, hidden)}
        if self.moe is not None:  # a mixture of experts: adapters on attention
            return attention
        if self.fused_checkpoint:
            return {"self_attn.qkv_proj": (hidden, q_size + 2 * kv_size), "self_attn.o_proj": (q_size, hidden),
                    "mlp.gate_up_proj": (hidden, 2 * inter), "mlp.down_proj": (inter, hidden)}
        return {**attention, "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
                "mlp.down_proj": (inter, hidden)}


def variant_of(config, max_positions: int | None = None) -> LlamaVariant:
    """The variant a config describes, serving up to max_positions (None: only the config's shapes matter)."""
    kind = config.model_type
    bias = bool(getattr(config, "attention_bias", False))
    gemma = kind in ("gemma", *WINDOWED)
    olmo2 = kind == "olmo2"
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"{kind}'s clip_qkv ({config.clip_qkv}) is not supported: queries, keys and values are not "
                         f"clamped")
    return LlamaVariant(qkv_bias=kind == "qwen2" or bias, o_bias=kind != "qwen2" and bias,
                        qk_norm=_qk_norm(kind),
                        post_norms_only=olmo2, float32_norm_scale=gemma or olmo2,
                        norm_offset=1.0 if gemma else 0.0,
                        embed_scale=config.hidden_size ** 0.5 if gemma else None,
                        fused_checkpoint=kind == "phi3", rope_layers=_rope_layers(config),
                        **_granite_scalars(config), **_windowed_gemma_departures(config),
                        moe=moe_spec(config), **_context_windows(config, max_positions))


def _qk_norm(kind: str) -> Literal["head", "projection"] | None:
    """Where the architecture normalizes its queries and keys (LlamaVariant.qk_norm)."""
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        return "head"
    return "projection" if kind in ("olmo2", "olmoe") else None


def _granite_scalars(config) -> dict[str, float]:
    """Granite's multipliers, by the variant's field names; none for another architecture."""
    if config.model_type != "granite":
        return {}
    return {"embed_multiplier": config.embedding_multiplier, "residual_multiplier": config.residual_multiplier,
            "attention_scale": config.attention_multiplier, "logits_scaling": config.logits_scaling}


def computes_windows(config) -> bool:
    """Whether the engine always computes this model's sliding windows exactly (Gemma 2 and 3), rather than
    defaulting the context to its window (engine/models/__init__.py context_limit)."""
    return getattr(config, "model_type", None) in WINDOWED


def attention_window(config) -> int | None:
    """The sliding window that is the default context of a model whose attention slides over it in some layers
    (Mistral 7B v0.1, Qwen2 with use_sliding_window); None: every layer attends to the whole context, or the engine
    always computes the windows (Gemma 2 and 3)."""
    if computes_windows(config):
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # transformers' per-layer kinds, where the config has them
        return window if "sliding_attention" in layer_types else None
    return window if getattr(config, "use_sliding_window", True) else None


def _context_windows(config, max_positions: int | None) -> dict:
    """The windows of a model whose window is only its default context (attention_window), by the variant's field
    name, where the served context runs past it: then the C++ kernel computes them exactly; within it, none (full
    attention equals them there, on every path)."""
    window = attention_window(config)
    if window is None or max_positions is None or max_positions <= window:
        return {}
    kinds = getattr(config, "layer_types", None) or ("sliding_attention",) * config.num_hidden_layers
    return {"windows": _layer_windows(kinds, window)}


def _layer_windows(kinds, window: int) -> tuple[int, ...]:
    """Per layer of these kinds (transformers' layer_types), its sliding window, 0 for the whole context."""
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


def _windowed_gemma_departures(config) -> dict:
    """Gemma 2's and 3's sandwich norms, attention scale, soft-capping, windows and rotary tables, by the
    variant's field names; none for another architecture."""
    if not computes_windows(config):
        return {}
    scale = config.query_pre_attn_scalar ** -0.5
    kinds = tuple(config.layer_types)
    per_kind = set(kinds) <= set(getattr(config, "rope_parameters", None) or {})  # Gemma 3's tables per kind
    return {"sandwich_norms": True, "attention_scale": None if scale == config.head_dim ** -0.5 else scale,
            "attention_softcap": config.attn_logit_softcapping, "final_softcap": config.final_logit_softcapping,
            "windows": _layer_windows(kinds, config.sliding_window),
            "rope_kinds": kinds if per_kind else None}


def _rope_layers(config) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers`: 1 where a layer uses the rotary embedding, 0 where it does not."""
    flags = getattr(config, "no_rope_layers", None)
    return None if flags is None else tuple(bool(flag) for flag in flags)
