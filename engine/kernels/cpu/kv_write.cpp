// Writes a step's new keys and values into one layer's paged cache in one call. The eager version is two
// index_copy_ calls a layer on a transposed view of the new tokens, a visible share of a decode step
// (measurements: docs/cpu_kernels.md); here each (token, KV head) row is one memcpy of head_dim values. A float32
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

// Each (token, KV head) row of x into its slot: copy_row(x's offset of the row, the cache's offset of its slot), in
// elements.
template <typename CopyRow>
void for_each_row(const at::Tensor& cache, const at::Tensor& x, const int64_t* slots, const CopyRow& copy_row) {
  const int64_t heads = x.size(1), dim = x.size(2), slots_per_head = cache.size(1) * cache.size(2);
  lora_serve::parallel_for(0, x.size(0) * heads, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      copy_row(t * x.stride(0) + h * x.stride(1), (h * slots_per_head + slots[t]) * dim);
    }
  });
}

// A row is one memcpy where x and the cache share a dtype, else float32 rounded to the cache's.
void write(at::Tensor& cache, const at::Tensor& x, const int64_t* slots) {
  const int64_t dim = x.size(2);
  if (x.scalar_type() == cache.scalar_type()) {
    auto* dst = static_cast<char*>(cache.data_ptr());
    const auto* src = static_cast<const char*>(x.data_ptr());
    const int64_t item = x.element_size();
    for_each_row(cache, x, slots, [&](int64_t from, int64_t to) {
      std::memcpy(dst + to * item, src + from * item, dim * item);
    });
    return;
  }
  lora_serve::dispatch_float_types(cache.scalar_type(), "write_kv_cache", [&](auto type) {
    auto* dst = cache.data_ptr<decltype(type)>();
    const float* src = x.data_ptr<float>();
    for_each_row(cache, x, slots, [&](int64_t from, int64_t to) { lora_serve::narrow(src + from, dst + to, dim); });
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
