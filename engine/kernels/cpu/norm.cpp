// RMSNorm in one pass per row, for the batch-1 step where each of the eager version's ~8 small ops costs more
// than its arithmetic (measurements: docs/cpu_kernels.md). add_rms_norm first adds a sublayer's output
// into the residual stream, in place, in the same pass: the decoder's two residual additions a layer are then no
// ops of their own.
//
// Rounding follows transformers' LlamaRMSNorm exactly: the row is normalised in float32, rounded to the model
// dtype, then multiplied by the weight in float32 and rounded again (for fp32 both roundings are exact). A float32
// weight beside a bf16/fp16 row is a Gemma norm's 1 + w: transformers' GemmaRMSNorm scales the float32 row by it and
// rounds once.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <cmath>
#include <type_traits>

namespace lora_serve::norm_detail {

template <typename scalar_t, typename weight_t>
void norm_row(const scalar_t* x, const weight_t* w, scalar_t* out, int64_t d, float eps) {
  Vec squares(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) {
    const Vec v = lora_serve::load_float(x + i);
    squares = at::vec::fmadd(v, v, squares);
  }
  float sum = squares.reduce_add();
  for (; i < d; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) {
    if constexpr (std::is_same_v<scalar_t, weight_t>) {
      const float normed = lora_serve::round_to<scalar_t>(static_cast<float>(x[j]) * inv);
      out[j] = static_cast<scalar_t>(static_cast<float>(w[j]) * normed);
    } else {
      out[j] = static_cast<scalar_t>(static_cast<float>(x[j]) * inv * w[j]);
    }
  }
}

// residual += delta, rounded to the dtype as PyTorch's addition rounds it
template <typename scalar_t>
void add_row(scalar_t* residual, const scalar_t* delta, int64_t d) {
  for (int64_t j = 0; j < d; ++j)
    residual[j] = static_cast<scalar_t>(static_cast<float>(residual[j]) + static_cast<float>(delta[j]));
}

// delta: nullptr for a plain norm of x; else x (the residual) += delta first, in place
template <typename scalar_t, typename weight_t>
void run(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t d = x.size(-1), rows = x.numel() / d;
  scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* dp = delta == nullptr ? nullptr : delta->data_ptr<scalar_t>();
  const weight_t* wp = w.data_ptr<weight_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  // chunks of 16 rows: within a step the pool's threads are awake from the operator before, so splitting pays even
  // for a few dozen rows; one chunk of 16 rows or fewer runs inline
  lora_serve::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (dp != nullptr) add_row(xp + r * d, dp + r * d, d);
      norm_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps));
    }
  });
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must share x's dtype, or be float32 (a Gemma norm's 1 + w)");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight must be [hidden] for x [..., hidden]");
}

// run<x's dtype, the weight's>: the same, or float32 weights beside bf16/fp16 rows
void dispatch(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, at::Tensor& out, double eps,
              const char* name) {
  lora_serve::dispatch_float_types(x.scalar_type(), name, [&](auto type) {
    using scalar_t = decltype(type);
    if (w.scalar_type() == x.scalar_type()) run<scalar_t, scalar_t>(x, delta, w, out, eps);
    else run<scalar_t, float>(x, delta, w, out, eps);
  });
}

}  // namespace lora_serve::norm_detail

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  using namespace lora_serve::norm_detail;
  check_weight(x, weight);
  const auto input = x.contiguous();
  const auto w = weight.contiguous();
  auto out = input.new_empty(input.sizes());
  dispatch(input, nullptr, w, out, eps, "rms_norm");
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& delta, at::Tensor& residual, const at::Tensor& weight, double eps) {
  using namespace lora_serve::norm_detail;
  check_weight(residual, weight);
  TORCH_CHECK(residual.is_contiguous(), "the residual is updated in place: it must be contiguous");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta and residual must share a shape and a dtype");
  const auto d = delta.contiguous();
  const auto w = weight.contiguous();
  auto out = residual.new_empty(residual.sizes());
  dispatch(residual, &d, w, out, eps, "add_rms_norm");
  return out;
}
