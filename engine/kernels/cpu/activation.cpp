// SiLU and the product with the up projection in one pass over the fused gate_up output, for the MLP of every
// Llama-family layer: the eager version splits, runs silu into a new tensor and multiplies into another (about
// 9 us a layer at batch 1 on 2 cores, most of it per-op cost).
//
// Rounding follows PyTorch's: silu is computed in float32 and rounded to the model dtype; the product is taken in
// float32 and rounded again. In fp32, silu is ATen's own vectorised formula, x / (1 + exp(-x)), so the result is
// bitwise PyTorch's. In bf16 and fp16 it takes a fast exp and reciprocal (reduced_silu): 64 rows of SmolLM2 in
// bf16 on 2 cores of Zen 4 took 60 us with the exact formula, and 31 with these and bf16 rounding in one
// instruction (float_types.h); over 99% of elements are still bitwise PyTorch's, the rest a unit or two away.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <cmath>
#include <limits>

namespace lora_serve::activation_detail {

template <typename scalar_t>
float silu_scalar(scalar_t x) {
  const float v = static_cast<float>(x);
  return v / (1.f + std::exp(-v));
}

// 1 / x for x >= 1 to about a float32 ulp: the hardware's 12- or 14-bit estimate, then one Newton step, which
// squares its error (an infinite x keeps the estimate's 0, which the step would turn into NaN). A division costs
// several times as much (vdivps).
inline Vec approx_reciprocal(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
  const Vec r(_mm512_rcp14_ps(x));
#else
  const Vec r(_mm256_rcp_ps(x));
#endif
  return Vec::blendv(r * (Vec(2.f) - x * r), r, x == Vec(std::numeric_limits<float>::infinity()));
#else
  return Vec(1.f) / x;
#endif
}

// silu in float32 for a bf16 or fp16 model. Its result is rounded to 8 or 11 mantissa bits next, which hides the
// last float32 bits that ATen's exact formula (SLEEF's exp, a division) spends most of its time on, so it takes
// ATen's fast exp (exp_u20, at most 20 ulp) and an approximate reciprocal instead.
inline Vec reduced_silu(const Vec& g) {
  return g * approx_reciprocal(Vec(1.f) + g.neg().exp_u20());
}

// silu(gate) rounded to scalar_t, times up, rounded again, for one step of 2 float vectors: bitwise PyTorch's in
// float32, within a unit of the last place of scalar_t otherwise. Inlined into the row loop, so the constants of
// exp and of the rounding are loaded once a row, not once a step.
template <typename scalar_t>
[[gnu::always_inline]] inline void silu_mul_step(const scalar_t* gate, const scalar_t* up, scalar_t* out) {
  const Vec g0 = lora_serve::load_float(gate), g1 = lora_serve::load_float(gate + Vec::size());
  Vec s0, s1;
  if constexpr (std::is_same_v<scalar_t, float>) {
    s0 = g0 / (Vec(1.f) + g0.neg().exp()), s1 = g1 / (Vec(1.f) + g1.neg().exp());
  } else {
    s0 = reduced_silu(g0), s1 = reduced_silu(g1);
  }
  lora_serve::round_pair<scalar_t>(s0, s1);
  lora_serve::store_pair(s0 * lora_serve::load_float(up), s1 * lora_serve::load_float(up + Vec::size()), out);
}

// Two vectors a step and the rest one element at a time, as ATen's vectorised loop splits a row: its vector
// exp (SLEEF) and the scalar std::exp can differ in the last bit, so the same elements must take the same one.
// The step is vectorised through the product too: a scalar product made the op 60% of the time of the gate_up
// projection before it (2,000 tokens of SmolLM2 in bf16, 2 cores of a Xeon: 1.3 -> 1.0 ms, the projection 2.1).
template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t width) {
  constexpr int64_t step = 2 * Vec::size();
  int64_t i = 0;
  for (; i + step <= width; i += step) silu_mul_step(gate + i, up + i, out + i);
  for (; i < width; ++i)
    out[i] = static_cast<scalar_t>(lora_serve::round_to<scalar_t>(silu_scalar(gate[i])) * static_cast<float>(up[i]));
}

template <typename scalar_t>
void run(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  lora_serve::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(xp + r * 2 * width, xp + r * 2 * width + width, op + r * width, width);
  });
}

}  // namespace lora_serve::activation_detail

at::Tensor silu_and_mul(const at::Tensor& x) {
  using namespace lora_serve::activation_detail;
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [tokens, 2 * width]: gate then up");
  const auto input = x.contiguous();
  auto out = x.new_empty({x.size(0), x.size(1) / 2});
  lora_serve::dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto type) {
    run<decltype(type)>(input, out);
  });
  return out;
}
