// SiLU or GELU and the product with the up projection in one pass over the fused gate_up output, for the MLP of
// every Llama-family layer: the eager version splits, runs the activation into a new tensor and multiplies into
// another, and at batch 1 its per-op cost outweighs the arithmetic. For GELU (Gemma's) the eager version also runs
// on ATen's OpenMP threads beside the operators' own (work_pool.cpp), which spin or sleep apart and cost a served
// model much of its throughput (measurements: docs/cpu_kernels.md).
//
// GELU is ATen's own formula (ATen/native/cpu/Gelu.h: erf, or the tanh approximation, in float32, SLEEF's tanh),
// vectorised and scalar as ATen splits a row; rounded to the model dtype, then the product rounded again, as the
// eager `act(gate) * up` rounds.
//
// Rounding follows PyTorch's: silu is computed in float32 and rounded to the model dtype; the product is taken in
// float32 and rounded again. In fp32, silu is ATen's own vectorised formula, x / (1 + exp(-x)), so the result is
// bitwise PyTorch's. In bf16 and fp16 it takes a fast exp and reciprocal (reduced_silu) and rounds to bf16 in one
// instruction (float_types.h), faster than the exact formula; nearly every element is still bitwise PyTorch's, the
// rest a unit or two away.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <ATen/native/cpu/Gelu.h>

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
// The step is vectorised through the product too: a scalar product makes the op a large fraction of the time of
// the gate_up projection that feeds it.
template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t width) {
  constexpr int64_t step = 2 * Vec::size();
  int64_t i = 0;
  for (; i + step <= width; i += step) silu_mul_step(gate + i, up + i, out + i);
  for (; i < width; ++i)
    out[i] = static_cast<scalar_t>(lora_serve::round_to<scalar_t>(silu_scalar(gate[i])) * static_cast<float>(up[i]));
}

// GELU in float32 as ATen computes it, a vector or one element at a time: the exact one (erf) or the tanh
// approximation (transformers' gelu_pytorch_tanh, Gemma's).
template <bool kTanh>
struct Gelu {
  static Vec vec(const Vec& x) {
    if constexpr (kTanh) {
      return at::native::vectorized_gelu_approximated_with_tanh(x);
    } else {
      return at::native::vectorized_gelu(x);
    }
  }
  static float scalar(float x) {
    if constexpr (kTanh) {
      return at::native::scalar_gelu_approximated_with_tanh(x);
    } else {
      return at::native::scalar_gelu(x);
    }
  }
};

// gelu(gate) rounded to scalar_t, times up, rounded again. ATen's loop takes two vectors of scalar_t a step (64
// bf16 elements on AVX-512, 32 floats) and the rest one element at a time, and its vector and scalar erf differ in
// the last bits, so the same elements take the same one here.
template <typename Act, typename scalar_t>
void gelu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t width) {
  constexpr int64_t step = 2 * at::vec::Vectorized<scalar_t>::size(), pair = 2 * Vec::size();
  int64_t i = 0;
  for (; i + step <= width; i += step) {
    for (int64_t j = i; j < i + step; j += pair) {
      Vec g0 = Act::vec(lora_serve::load_float(gate + j));
      Vec g1 = Act::vec(lora_serve::load_float(gate + j + Vec::size()));
      lora_serve::round_pair<scalar_t>(g0, g1);
      lora_serve::store_pair(g0 * lora_serve::load_float(up + j), g1 * lora_serve::load_float(up + j + Vec::size()),
                             out + j);
    }
  }
  for (; i < width; ++i) {
    const float g = lora_serve::round_to<scalar_t>(Act::scalar(static_cast<float>(gate[i])));
    out[i] = static_cast<scalar_t>(g * static_cast<float>(up[i]));
  }
}

// Every row of x = [gate | up] through row_fn(gate, up, out, width), rows shared by the operators' threads.
template <typename scalar_t, typename RowFn>
void run(const at::Tensor& x, at::Tensor& out, RowFn row_fn) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  lora_serve::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_fn(xp + r * 2 * width, xp + r * 2 * width + width, op + r * width, width);
  });
}

// The output [tokens, width] of x = [gate | up] [tokens, 2 * width], and x contiguous.
struct GateUp {
  at::Tensor input, out;
};

GateUp gate_up(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [tokens, 2 * width]: gate then up");
  return {x.contiguous(), x.new_empty({x.size(0), x.size(1) / 2})};
}

}  // namespace lora_serve::activation_detail

at::Tensor silu_and_mul(const at::Tensor& x) {
  using namespace lora_serve::activation_detail;
  auto [input, out] = gate_up(x);
  lora_serve::dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto type) {
    using scalar_t = decltype(type);
    run<scalar_t>(input, out, silu_mul_row<scalar_t>);
  });
  return out;
}

at::Tensor gelu_and_mul(const at::Tensor& x, int64_t tanh) {
  using namespace lora_serve::activation_detail;
  auto [input, out] = gate_up(x);
  lora_serve::dispatch_float_types(x.scalar_type(), "gelu_and_mul", [&](auto type) {
    using scalar_t = decltype(type);
    if (tanh != 0) {
      run<scalar_t>(input, out, gelu_mul_row<Gelu<true>, scalar_t>);
    } else {
      run<scalar_t>(input, out, gelu_mul_row<Gelu<false>, scalar_t>);
    }
  });
  return out;
}
