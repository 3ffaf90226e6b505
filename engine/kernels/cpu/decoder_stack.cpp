// A Llama-family decoder's layers in one call: the step thread runs every operator of every layer from C++, without
// the GIL and with no Python between operators.
//
// Why: a decode step of SmolLM2 runs about 300 operators (9 a layer over 30 layers, plus views). Called from
// Python, each returns to the interpreter, takes the GIL back, and goes through a module's __call__ before the next
// starts; in that time the operators' other thread (work_pool.cpp) has nothing to do. Offline the step thread spent
// 12% of its time outside the operators' loops; in a serving replica 25%, because there the GIL is also taken by
// the replica's event loops and Ray's threads (5% of the step thread's time went to waiting for it), and a
// wake-up of the serving stack that preempts the step thread in that time stalls both cores. Here the same
// operators run in the same order on the same tensors, so the results are the same bits as the modules' path
// (tests/test_decoder_stack.py checks it).
//
// It takes what the modules' path runs on the C++ operators alone: every token attends through the in-place
// kernel (decodes and short prompt chunks), every linear is on one of the engine's own kernels, and adapters add
// their deltas through lora_add_ as the LoRA linears do (engine/models/decoder_stack.py decides, per step).

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <optional>
#include <vector>

namespace lora_serve::decoder_stack_detail {

// One layer's tensors, in the order engine/models/decoder_stack.py lays them out.
// kQNorm and kKNorm: Qwen3's per-head query and key norms, empty tensors for a model without them.
enum Weight {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kPerLayer
};

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
  double query_scale;  // Granite: the turned queries times this (its attention scale times sqrt(head_dim)); 0: none
  double residual_multiplier;  // Granite: attention and MLP outputs times this before the residual add; 0: none
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

// Whether a layer turns its queries and keys (SmolLM3 leaves some layers without positions; empty: every layer).
bool rotates(const at::Tensor& rope_layers, int64_t layer) {
  return rope_layers.numel() == 0 || rope_layers.data_ptr<int64_t>()[layer] != 0;
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

// The queries and keys [tokens, heads + kv_heads, head_dim] as the attention reads them: Qwen3's per-head norms
// (each head over its head_dim, queries and keys with their own weights, as LlamaAttention._head_norms), then the
// rotary embedding (in a layer without it, the heads made contiguous as the rotary's output is). Rotary and norms
// work row by row, so turning the two parts apart gives the bits of turning them together.
struct QueriesKeys {
  at::Tensor q, k;
};

QueriesKeys queries_keys(const at::Tensor& qk, const at::Tensor* w, const at::Tensor& cos, const at::Tensor& sin,
                         bool rope, const Shapes& s) {
  if (w[kQNorm].numel() == 0) {
    const at::Tensor rotated = rope ? rotary(qk, cos, sin) : qk.contiguous();
    return {rotated.narrow(1, 0, s.heads), rotated.narrow(1, s.heads, s.kv_heads)};
  }
  const at::Tensor q = rms_norm(qk.narrow(1, 0, s.heads), w[kQNorm], s.eps);
  const at::Tensor k = rms_norm(qk.narrow(1, s.heads, s.kv_heads), w[kKNorm], s.eps);
  if (!rope) return {q, k};
  return {rotary(q, cos, sin), rotary(k, cos, sin)};
}

// Attention of one layer, as LlamaAttention.forward and paged_attention run it: fused projection, the queries and
// keys normed (Qwen3) and turned, the new keys and values into the cache, the in-place kernel, the output
// projection.
at::Tensor attention(const at::Tensor& x, const at::Tensor* w, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& cos, const at::Tensor& sin, bool rope, const Metadata& meta, const Shapes& s,
                     bool amx, const Adapters& adapters) {
  const at::Tensor qkv = linear(x, w[kQkv], w[kQkvBias], amx, adapters, kQkvLinear);
  const int64_t q_size = s.heads * s.head_dim, kv_size = s.kv_heads * s.head_dim;
  const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({s.tokens, s.heads + s.kv_heads, s.head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({s.tokens, s.kv_heads, s.head_dim});
  const auto [turned_q, k] = queries_keys(qk, w, cos, sin, rope, s);
  const at::Tensor q = scaled(turned_q, s.query_scale);
  write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping);
  at::Tensor out = q.new_empty({s.tokens, s.heads, s.head_dim});
  paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_starts, meta.query_lens,
                  out, /*softcap=*/0.0, /*window=*/0);  // Gemma 2 and 3 (capped, windowed) run as modules
  return linear(out.view({s.tokens, q_size}), w[kO], w[kOBias], amx, adapters, kOLinear);
}

at::Tensor mlp(const at::Tensor& x, const at::Tensor* w, bool amx, const Adapters& adapters) {
  const at::Tensor gate_up = linear(x, w[kGateUp], w[kGateUpBias], amx, adapters, kGateUpLinear);
  return linear(silu_and_mul(gate_up), w[kDown], w[kDownBias], amx, adapters, kDownLinear);
}

}  // namespace lora_serve::decoder_stack_detail

at::Tensor decoder_stack(at::Tensor& h, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t heads,
                         int64_t kv_heads, int64_t amx, double eps, const std::vector<at::Tensor>& loras,
                         const at::Tensor& token_slots, int64_t rank, const at::Tensor& rope_layers,
                         double query_scale, double residual_multiplier) {
  using namespace lora_serve::decoder_stack_detail;
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  TORCH_CHECK(layers > 0 && caches.size() % 2 == 0, "caches must be a key and a value cache per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer + 1, "weights must be ", kPerLayer,
              " tensors per layer and the final norm's: ", layers * kPerLayer + 1, ", not ", weights.size());
  TORCH_CHECK(loras.empty() || static_cast<int64_t>(loras.size()) == layers * kLoraPerLayer, "loras must be none or ",
              kLoraPerLayer, " tensors per layer: ", layers * kLoraPerLayer, ", not ", loras.size());
  TORCH_CHECK(rope_layers.numel() == 0 || (rope_layers.dim() == 1 && rope_layers.size(0) == layers &&
                                          rope_layers.scalar_type() == at::kLong && rope_layers.is_contiguous()),
              "rope_layers must be empty or one int64 flag per layer: ", layers, ", not ", rope_layers.numel());
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be a contiguous [tokens, hidden]");
  // head_dim from the cache: cos may turn part of each head
  const Shapes shapes{h.size(0), heads, kv_heads, caches[0].size(-1), eps, query_scale, residual_multiplier};
  const Metadata meta{slot_mapping, block_tables, context_lens, query_starts, query_lens};
  at::Tensor delta;  // the previous layer's MLP output, added into h by the next norm
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor* w = weights.data() + layer * kPerLayer;
    at::Tensor k_cache = caches[2 * layer], v_cache = caches[2 * layer + 1];
    const at::Tensor x = layer == 0 ? rms_norm(h, w[kInputNorm], eps) : add_rms_norm(delta, h, w[kInputNorm], eps);
    const Adapters adapters{token_slots, loras.empty() ? nullptr : loras.data() + layer * kLoraPerLayer, rank};
    const at::Tensor attn = scaled(attention(x, w, k_cache, v_cache, cos, sin, rotates(rope_layers, layer), meta,
                                             shapes, amx != 0, adapters), residual_multiplier);
    delta = scaled(mlp(add_rms_norm(attn, h, w[kPostNorm], eps), w, amx != 0, adapters), residual_multiplier);
  }
  return add_rms_norm(delta, h, weights.back(), eps);
}
