// The greedy token of every row of float32 logits: PyTorch's argmax over a 49,152-token vocabulary runs a scalar
// loop (about 2-3.7 ms for 64 rows on 2 cores, a tenth of a bf16 decode step of 64 sequences). Here each row
// takes two vectorised passes: its maximum, then the first index holding it; about 0.1 ms for the same rows.
//
// Ties and NaN follow torch.argmax: the first maximal index wins, and a NaN counts as larger than any number.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <cmath>

namespace lora_serve::argmax_detail {

float row_max(const float* x, int64_t n) {
  Vec best(-INFINITY);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(x + i));  // NaN wins
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; i < n; ++i)
    if (std::isnan(x[i]) || x[i] > out) out = x[i];
  return out;
}

int64_t first_index_of(const float* x, int64_t n, float value) {
  if (std::isnan(value)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  const Vec target(value);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    if (Vec::loadu(x + i).eq(target).zero_mask() != (1 << Vec::size()) - 1) break;  // some lane equals value
  }
  for (; i < n; ++i)
    if (x[i] == value) return i;
  return 0;  // unreachable: value was read from the row
}

}  // namespace lora_serve::argmax_detail

at::Tensor argmax_rows(const at::Tensor& logits) {
  using namespace lora_serve::argmax_detail;
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be float32 [rows, vocab]");
  const auto input = logits.contiguous();
  const int64_t rows = input.size(0), n = input.size(1);
  TORCH_CHECK(n > 0, "argmax_rows of an empty vocabulary");
  auto out = input.new_empty({rows}, input.options().dtype(at::kLong));
  const float* xp = input.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  lora_serve::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = first_index_of(xp + r * n, n, row_max(xp + r * n, n));
  });
  return out;
}
