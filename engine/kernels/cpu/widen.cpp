// A step's logits widened to float32 into a buffer kept from step to step (Sampler._float in engine/sampler.py),
// on the operators' own threads.
//
// Why: torch's copy_ runs on OpenMP's threads, which sleep while the rest of a decode step runs on the operators'
// pool (work_pool.cpp). Waking one onto a core that the caller or a pool thread holds stalls the copy for a time
// slice now and then, which costs single-stream decode a noticeable share of its step
// (measurements: docs/cpu_kernels.md).

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <algorithm>

namespace lora_serve::widen_detail {

constexpr int64_t kChunk = 8192;  // values a work item widens (16-32 KB in, 32 KB out)

}  // namespace lora_serve::widen_detail

void widen_(at::Tensor& out, const at::Tensor& x) {
  using namespace lora_serve::widen_detail;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && x.is_contiguous() && out.sizes() == x.sizes(),
              "widen_ takes a contiguous float32 out of x's shape and a contiguous x");
  const int64_t n = x.numel();
  float* op = out.data_ptr<float>();
  lora_serve::dispatch_float_types(x.scalar_type(), "widen_", [&](auto type) {
    using scalar_t = decltype(type);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    lora_serve::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t first = c * kChunk;
        lora_serve::widen(xp + first, op + first, std::min(kChunk, n - first));
      }
    });
  });
}
