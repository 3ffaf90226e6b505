// Reductions over each row of the logits, read in their own dtype (float32, or bf16/fp16 widened as they are
// loaded, exactly): the greedy token, and the log-normalizer that turns logits into log-probabilities.
//
// argmax_rows: PyTorch's argmax over a vocabulary runs a scalar loop. Here each row takes two vectorised passes: its
// maximum, then the first index holding it. A bf16 model's greedy rows are read as the LM head wrote them, not
// widened into a float32 copy first (engine/sampler.py). Ties and NaN follow torch.argmax: the first maximal index
// wins, and a NaN counts as larger than any number.
//
// log_normalizers: each row's logsumexp in float32, so that a token's logprob is its logit minus it. Requests that
// report logprobs (every TGI token carries one) would otherwise have the step widen its logits, index a float32 copy of
// the rows and write a log_softmax of the whole vocabulary, most of whose cost is the page faults of two fresh
// vocabulary-sized tensors. Here two passes a row (its maximum, then the sum of exp(x - max)) write one float a row.
// The exp is ATen's fast one (exp_u20, within 20 ulp: a logprob moves by at most 2.4e-6), faster here than SLEEF's
// (measurements: docs/cpu_kernels.md).

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <cmath>

namespace lora_serve::argmax_detail {

template <typename scalar_t>
float row_max(const scalar_t* x, int64_t n) {
  Vec best(-INFINITY);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, load_float(x + i));  // NaN wins
  float out = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v) || v > out) out = v;
  }
  return out;
}

template <typename scalar_t>
int64_t first_index_of(const scalar_t* x, int64_t n, float value) {
  if (std::isnan(value)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  const Vec target(value);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    if (load_float(x + i).eq(target).zero_mask() != (1 << Vec::size()) - 1) break;  // some lane equals value
  }
  for (; i < n; ++i)
    if (static_cast<float>(x[i]) == value) return i;
  return 0;  // unreachable: value was read from the row
}

// As torch.logsumexp: a row whose maximum is infinite sums around 0 (all -inf gives -inf, a +inf gives +inf), and
// a NaN anywhere gives NaN.
template <typename scalar_t>
float log_normalizer(const scalar_t* x, int64_t n) {
  const float top = row_max(x, n);
  const float shift = std::isinf(top) ? 0.f : top;
  const Vec shift_vec(shift);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) sum = sum + (load_float(x + i) - shift_vec).exp_u20();
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  for (; i < n; ++i) total += std::exp(static_cast<float>(x[i]) - shift);
  return std::log(total) + shift;
}

// reduce(row, vocab) of every row of logits [rows, vocab] into a new [rows] tensor of out_t, on the operators'
// threads; name is the operator's, for its refusals.
template <typename out_t, typename Reduce>
at::Tensor reduce_rows(const at::Tensor& logits, const char* name, at::ScalarType out_type, Reduce reduce) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [rows, vocab]");
  const auto input = logits.contiguous();
  const int64_t rows = input.size(0), n = input.size(1);
  TORCH_CHECK(n > 0, name, " of an empty vocabulary");
  auto out = input.new_empty({rows}, input.options().dtype(out_type));
  out_t* op = out.data_ptr<out_t>();
  lora_serve::dispatch_float_types(input.scalar_type(), name, [&](auto type) {
    const auto* xp = input.data_ptr<decltype(type)>();
    lora_serve::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = reduce(xp + r * n, n);
    });
  });
  return out;
}

}  // namespace lora_serve::argmax_detail

at::Tensor argmax_rows(const at::Tensor& logits) {
  using namespace lora_serve::argmax_detail;
  return reduce_rows<int64_t>(logits, "argmax_rows", at::kLong,
                              [](const auto* x, int64_t n) { return first_index_of(x, n, row_max(x, n)); });
}

at::Tensor log_normalizers(const at::Tensor& logits) {
  using namespace lora_serve::argmax_detail;
  return reduce_rows<float>(logits, "log_normalizers", at::kFloat,
                            [](const auto* x, int64_t n) { return log_normalizer(x, n); });
}
