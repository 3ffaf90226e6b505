// A Llama-family decoder's layers in one call: the step thread runs every operator of every layer from C++, without
// the GIL and with no Python between operators.
//
// Why: a decode step runs about 9 operators a layer, plus views. Called from Python, each returns to the
// interpreter, takes the GIL back, and goes through a module's __call__ before the next starts; in that time the
// operators' other thread (work_pool.cpp) has nothing to do. In a serving replica that time is longer, because there
// the GIL is also taken by the replica's event loops and Ray's threads, and a wake-up of the serving stack that
// preempts the step thread in that time stalls both cores (measurements: docs/cpu_kernels.md). Here the same
// operators run in the same order on the same tensors, so the results are the same bits as the modules' path
// (tests/test_decoder_stack.py checks it).
//
// It takes what the modules' path runs on the C++ operators alone: every token attends through the in-place
// kernel (decodes and short prompt chunks), every linear is on one of the engine's own kernels, and adapters add
// their deltas through lora_add_ as the LoRA linears do (engine/models/decoder_stack.py decides, per step). The
// layers' shapes it knows are the Llama family's as engine/models/llama.py runs them: a norm before attention and
// before the MLP (Llama), also after each (Gemma 2 and 3), or only after each (OLMo 2); q/k norms per head (Qwen3,
// Gemma 3) or over each projection (OLMo 2); SiLU or GELU; soft-capped scores (Gemma 2), sliding windows and a
// rotary table per kind of layer (Gemma 3).

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <optional>
#include <vector>

namespace lora_serve::decoder_stack_detail {

// One layer's tensors, in the order engine/models/decoder_stack.py lays them out; an empty tensor where the layer
// has none. kQNorm and kKNorm: the query and key norms (per head, or over each projection). kInputNorm and
// kPreFeedforwardNorm: the norms of the attention's and the MLP's inputs (Llama's input_layernorm and
// post_attention_layernorm; OLMo 2 has neither); kPostAttentionNorm and kPostFeedforwardNorm: the norms of their
// outputs before they join the residual stream (Gemma 2's and 3's sandwich, OLMo 2's).
enum Weight {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostAttentionNorm, kPreFeedforwardNorm,
  kPostFeedforwardNorm, kGateUp, kGateUpBias, kDown, kDownBias, kPerLayer
};

// The MLP's activation of the gate, as transformers names it: silu; gelu (erf); gelu_pytorch_tanh (Gemma's).
enum Activation { kSilu, kGelu, kGeluTanh };

// Where queries and keys are normalized: nowhere, per head over head_dim (Qwen3, Gemma 3), or over each whole
// projection (OLMo 2).
enum QkNorm { kNoQkNorm, kHeadNorm, kProjectionNorm };

// Each linear's LoRA slots, in the order of a layer's linears: A, then up to kMaxSubs B (one per sub-module fused
// into the linear: q, k, v), empty tensors past its own and for a linear no resident adapter targets.
enum Linear { kQkvLinear, kOLinear, kGateUpLinear, kDownLinear, kLinears };
constexpr int64_t kMaxSubs = 3, kPerLinear = 1 + kMaxSubs, kLoraPerLayer = kLinears * kPerLinear;

// This step's adapters: the token slots (-1: the base model) and one layer's LoRA slots; none when no token has one.
struct Adapters {
  const at::Tensor& token_slots;
  const at::Tensor* slots;  // kLoraPerLayer tensors, or nullptr
  int64_t rank;
};

struct Shapes {
  int64_t tokens, heads, kv_heads, head_dim;
  double eps;  // every norm's, the per-head ones' included
  double query_scale;  // Granite's and Gemma's: the turned queries times this (the attention scale times
  // sqrt(head_dim)); 0: none
  double residual_multiplier;  // Granite: attention and MLP outputs times this before the residual add; 0: none
  double softcap;  // Gemma 2: scores soft-capped; 0: none
  Activation activation;
  QkNorm qk_norm;
};

// x times a scalar into a new tensor, as PyTorch multiplies a tensor by a Python float: the product in float32
// (the scalar rounded to float32), rounded once to x's dtype. The same bits, so the stack stays the modules' path.
at::Tensor scaled(const at::Tensor& x, double factor) {
  if (factor == 0.0) return x;
  const at::Tensor input = x.contiguous();
  at::Tensor out = input.new_empty(input.sizes());
  const float f = static_cast<float>(factor);
  lora_serve::dispatch_float_types(input.scalar_type(), "scaled", [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t* in = input.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    lora_serve::parallel_for(0, input.numel(), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = static_cast<scalar_t>(static_cast<float>(in[i]) * f);
    });
  });
  return out;
}

// A layer's entry in a per-layer int64 table, or `otherwise` where the table is empty.
int64_t per_layer(const at::Tensor& table, int64_t layer, int64_t otherwise) {
  return table.numel() == 0 ? otherwise : table.data_ptr<int64_t>()[layer];
}

// A layer's rotary table: the cos and sin of its kind of layer (Gemma 3's sliding layers turn by a base of their
// own), or none (SmolLM3 leaves some layers without positions).
struct Rotary {
  const at::Tensor* cos;  // nullptr: the layer leaves queries and keys as projected
  const at::Tensor* sin;
};

Rotary rotary_of(const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                 const at::Tensor& rope_tables, int64_t layer) {
  const int64_t table = per_layer(rope_tables, layer, 0);
  if (table < 0) return {nullptr, nullptr};
  return {&cos[table], &sin[table]};
}

// The attention metadata of the in-place kernel (engine/layers/attention.py, InPlaceQueries).
struct Metadata {
  const at::Tensor& slot_mapping;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
  const at::Tensor& query_starts;
  const at::Tensor& query_lens;
};

std::optional<at::Tensor> bias_of(const at::Tensor& bias) {
  if (!bias.defined() || bias.numel() == 0) return std::nullopt;  // an empty tensor stands for no bias
  return bias;
}

// x W^T (+ bias), then the adapters' deltas in place where this linear has any (LoRALinear.forward's order).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, bool amx,
                  const Adapters& adapters, Linear which) {
  at::Tensor y = amx ? amx_linear(x, packed, bias_of(bias)) : simd_linear(x, packed, bias_of(bias));
  const at::Tensor* lora = adapters.slots == nullptr ? nullptr : adapters.slots + which * kPerLinear;
  if (lora == nullptr || lora[0].numel() == 0) return y;
  std::vector<at::Tensor> b_slots;
  for (int64_t sub = 1; sub <= kMaxSubs && lora[sub].numel() > 0; ++sub) b_slots.push_back(lora[sub]);
  lora_add_(y, x, lora[0], b_slots, adapters.token_slots, adapters.rank);
  return y;
}

// The queries and keys [tokens, heads + kv_heads, head_dim] as the attention reads them, from the fused
// projection's first q_size + kv_size columns: normalized per head (each head over its head_dim, queries and keys
// with their own weights, as LlamaAttention._head_norms) or per projection (OLMo 2's, into one tensor as
// LlamaAttention._projection_norms concatenates them), then turned by the rotary embedding (in a layer without
// it, the heads made contiguous as the rotary's output is). Rotary and norms work row by row, so turning the two
// parts apart gives the bits of turning them together.
struct QueriesKeys {
  at::Tensor q, k;
};

QueriesKeys turned(const at::Tensor& qk, const Rotary& rope, const Shapes& s) {
  const at::Tensor rotated = rope.cos != nullptr ? rotary(qk, *rope.cos, *rope.sin) : qk.contiguous();
  return {rotated.narrow(1, 0, s.heads), rotated.narrow(1, s.heads, s.kv_heads)};
}

QueriesKeys queries_keys(const at::Tensor& projected, const at::Tensor* w, const Rotary& rope, const Shapes& s) {
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const int64_t heads = s.heads + s.kv_heads;
  if (s.qk_norm == kProjectionNorm) {
    at::Tensor normed = projected.new_empty({s.tokens, q_size + kv_size});
    normed.narrow(1, 0, q_size).copy_(rms_norm(projected.narrow(1, 0, q_size), w[kQNorm], s.eps));
    normed.narrow(1, q_size, kv_size).copy_(rms_norm(projected.narrow(1, q_size, kv_size), w[kKNorm], s.eps));
    return turned(normed.view({s.tokens, heads, s.head_dim}), rope, s);
  }
  const at::Tensor qk = projected.view({s.tokens, heads, s.head_dim});
  if (s.qk_norm == kNoQkNorm) return turned(qk, rope, s);
  const at::Tensor q = rms_norm(qk.narrow(1, 0, s.heads), w[kQNorm], s.eps);
  const at::Tensor k = rms_norm(qk.narrow(1, s.heads, s.kv_heads), w[kKNorm], s.eps);
  if (rope.cos == nullptr) return {q, k};
  return {rotary(q, *rope.cos, *rope.sin), rotary(k, *rope.cos, *rope.sin)};
}

// Attention of one layer, as LlamaAttention.forward and paged_attention run it: fused projection, the queries and
// keys normed and turned, the new keys and values into the cache, the in-place kernel (its scores capped, its
// window this layer's: 0 for none), the output projection.
at::Tensor attention(const at::Tensor& x, const at::Tensor* w, at::Tensor& k_cache, at::Tensor& v_cache,
                     const Rotary& rope, int64_t window, const Metadata& meta, const Shapes& s, bool amx,
                     const Adapters& adapters) {
  const at::Tensor qkv = linear(x, w[kQkv], w[kQkvBias], amx, adapters, kQkvLinear);
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({s.tokens, s.kv_heads, s.head_dim});
  const auto [turned_q, k] = queries_keys(qkv.narrow(1, 0, q_size + kv_size), w, rope, s);
  const at::Tensor q = scaled(turned_q, s.query_scale);
  write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping);
  at::Tensor out = q.new_empty({s.tokens, s.heads, s.head_dim});
  paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_starts, meta.query_lens,
                  out, s.softcap, window);
  return linear(out.view({s.tokens, q_size}), w[kO], w[kOBias], amx, adapters, kOLinear);
}

// act(gate) * up for gate_up = [gate | up], on the operators LlamaMLP runs.
at::Tensor activated(const at::Tensor& gate_up, Activation activation) {
  return activation == kSilu ? silu_and_mul(gate_up) : gelu_and_mul(gate_up, activation == kGeluTanh);
}

at::Tensor mlp(const at::Tensor& x, const at::Tensor* w, bool amx, const Adapters& adapters, const Shapes& s) {
  const at::Tensor gate_up = linear(x, w[kGateUp], w[kGateUpBias], amx, adapters, kGateUpLinear);
  return linear(activated(gate_up, s.activation), w[kDown], w[kDownBias], amx, adapters, kDownLinear);
}

// A sublayer's input: the residual stream h with the previous sublayer's output (if any) added in place, through
// `norm` where the layer has one (add_rms_norm: the addition inside the norm), else the stream as it is (OLMo 2).
at::Tensor sublayer_input(const at::Tensor& delta, at::Tensor& h, const at::Tensor& norm, double eps) {
  if (norm.numel() == 0) {
    if (delta.defined()) h.add_(delta);
    return h;
  }
  return delta.defined() ? add_rms_norm(delta, h, norm, eps) : rms_norm(h, norm, eps);
}

// A sublayer's output as it joins the residual stream: through its post norm where the layer has one (Gemma 2's
// and 3's, OLMo 2's), else times Granite's residual multiplier (0: none).
at::Tensor sublayer_output(const at::Tensor& out, const at::Tensor& norm, const Shapes& s) {
  return norm.numel() == 0 ? scaled(out, s.residual_multiplier) : rms_norm(out, norm, s.eps);
}

}  // namespace lora_serve::decoder_stack_detail

at::Tensor decoder_stack(at::Tensor& h, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
                         const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, const at::Tensor& query_starts, const at::Tensor& query_lens,
                         int64_t heads, int64_t kv_heads, int64_t amx, double eps,
                         const std::vector<at::Tensor>& loras, const at::Tensor& token_slots, int64_t rank,
                         const at::Tensor& rope_tables, const at::Tensor& windows, double query_scale,
                         double residual_multiplier, double softcap, int64_t activation, int64_t qk_norm) {
  using namespace lora_serve::decoder_stack_detail;
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers > 0 && caches.size() % 2 == 0, "caches must be a key and a value cache per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer + 1, "weights must be ", kPerLayer,
              " tensors per layer and the final norm's: ", layers * kPerLayer + 1, ", not ", weights.size());
  TORCH_CHECK(loras.empty() || static_cast<int64_t>(loras.size()) == layers * kLoraPerLayer, "loras must be none or ",
              kLoraPerLayer, " tensors per layer: ", layers * kLoraPerLayer, ", not ", loras.size());
  const auto check_table = [&](const at::Tensor& table, const char* name) {
    TORCH_CHECK(table.numel() == 0 || (table.dim() == 1 && table.size(0) == layers &&
                                       table.scalar_type() == at::kLong && table.is_contiguous()),
                name, " must be empty or one int64 per layer: ", layers, ", not ", table.numel());
  };
  check_table(rope_tables, "rope_tables");
  check_table(windows, "windows");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "cos and sin must be one tensor each per rotary table");
  for (int64_t layer = 0; layer < (rope_tables.numel() == 0 ? 0 : layers); ++layer) {
    const int64_t table = rope_tables.data_ptr<int64_t>()[layer];
    TORCH_CHECK(table >= -1 && table < static_cast<int64_t>(cos.size()), "rope_tables: layer ", layer,
                " names table ", table, " of ", cos.size(), " (-1: no rotary)");
  }
  TORCH_CHECK(activation >= kSilu && activation <= kGeluTanh, "activation must be 0 (silu), 1 (gelu) or 2 (gelu "
              "tanh), not ", activation);
  TORCH_CHECK(qk_norm >= kNoQkNorm && qk_norm <= kProjectionNorm, "qk_norm must be 0 (none), 1 (per head) or 2 "
              "(per projection), not ", qk_norm);
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [tokens, hidden]");
  // head_dim from the cache: cos may turn part of each head
  const Shapes shapes{h.size(0), heads, kv_heads, caches[0].size(-1), eps, query_scale, residual_multiplier, softcap,
                      static_cast<Activation>(activation), static_cast<QkNorm>(qk_norm)};
  const Metadata meta{slot_mapping, block_tables, context_lens, query_starts, query_lens};
  at::Tensor delta;  // the previous layer's MLP output, added into h by the next layer's input
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kPerLayer;
    at::Tensor k_cache = caches[2 * layer], v_cache = caches[2 * layer + 1];
    const Adapters adapters{token_slots, loras.empty() ? nullptr : loras.data() + layer * kLoraPerLayer, rank};
    const at::Tensor x = sublayer_input(delta, h, w[kInputNorm], eps);
    const at::Tensor attn = attention(x, w, k_cache, v_cache, rotary_of(cos, sin, rope_tables, layer),
                                      per_layer(windows, layer, 0), meta, shapes, amx != 0, adapters);
    const at::Tensor y = sublayer_input(sublayer_output(attn, w[kPostAttentionNorm], shapes), h,
                                        w[kPreFeedforwardNorm], eps);
    delta = sublayer_output(mlp(y, w, amx != 0, adapters, shapes), w[kPostFeedforwardNorm], shapes);
  }
  return add_rms_norm(delta, h, weights.back(), eps);
}
