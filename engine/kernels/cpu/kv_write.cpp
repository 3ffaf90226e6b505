// Writes a step's new keys and values into one layer's paged cache in one call. The eager version is two
// index_copy_ calls a layer on a transposed view of the new tokens, about 30 us each for a 64-sequence decode
// step on 2 cores (4% of a bf16 step); here each (token, KV head) row is one memcpy of head_dim values. A float32
// model over a bf16 cache (bf16 weights computed in float32 on a CPU without bf16 matrix math) rounds each row to
// bf16 as it writes it, to nearest even as torch's conversion does.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <cstring>

namespace lora_serve::kv_write_detail {

void check(const at::Tensor& cache, const at::Tensor& x, const at::Tensor& slots, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), name, " cache must be contiguous [kv_heads, blocks, "
              "block_size, head_dim]");
  TORCH_CHECK(x.dim() == 3 && x.size(0) == slots.size(0) && x.size(1) == cache.size(0) && x.size(2) == cache.size(3),
              name, " must be [tokens, kv_heads, head_dim] matching the cache and the slot mapping");
  TORCH_CHECK(x.scalar_type() == cache.scalar_type() || x.scalar_type() == at::kFloat, name,
              " and its cache must share a dtype, unless ", name, " is float32 (rounded to the cache's)");
  TORCH_CHECK(x.stride(2) == 1, name, "'s head_dim must be contiguous");
}

// x's rows rounded to the cache's cache_t (float32 x).
template <typename cache_t>
void write_rounded(at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), slots_per_head = cache.size(1) * cache.size(2);
  auto* dst = cache.data_ptr<cache_t>();
  const float* src = x.data_ptr<float>();
  lora_serve::parallel_for(0, tokens * heads, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      lora_serve::narrow(src + t * x.stride(0) + h * x.stride(1), dst + (h * slots_per_head + slots[t]) * dim, dim);
    }
  });
}

void write(at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  if (x.scalar_type() != cache.scalar_type()) {
    lora_serve::dispatch_float_types(cache.scalar_type(), "write_kv_cache", [&](auto type) {
      write_rounded<decltype(type)>(cache, x, slots);
    });
    return;
  }
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t slots_per_head = cache.size(1) * cache.size(2), bytes = dim * x.element_size();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  const int64_t item = x.element_size();
  lora_serve::parallel_for(0, tokens * heads, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      std::memcpy(dst + ((h * slots_per_head + slots[t]) * dim) * item,
                  src + (t * token_stride + h * head_stride) * item, bytes);
    }
  });
}

}  // namespace lora_serve::kv_write_detail

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  using namespace lora_serve::kv_write_detail;
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64 [tokens]");
  check(k_cache, k, slot_mapping, "k");
  check(v_cache, v, slot_mapping, "v");
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "slot ", sp[t], " is outside the cache's ", capacity, " slots");
  write(k_cache, k, sp);
  write(v_cache, v, sp);
}
