// What every C++ CPU operator shares: the dtypes it takes and loading them as float32 vectors.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <optional>
#include <tuple>
#include <type_traits>

namespace lora_serve {

using Vec = at::vec::Vectorized<float>;

// A linear's bias as contiguous float32 [n], undefined without one; `op` names the linear in the error.
inline at::Tensor float32_bias(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, op, ": bias of ", bias->numel(), " values for ", n, " outputs");
  return bias->to(at::kFloat).contiguous();
}

// Vec::size() values at p as float32 (bf16/fp16 widened, fp32 loaded as they are).
template <typename scalar_t>
inline Vec load_float(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<scalar_t>(p, out);
    return out;
  }
}

// n values widened to float32 (fp32 ones copied as they are).
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) load_float(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// x rounded to scalar_t and back: where transformers' ops round an intermediate to the model dtype.
template <typename scalar_t>
inline float round_to(float x) { return static_cast<float>(static_cast<scalar_t>(x)); }

// 2 * Vec::size() float32 values a, b rounded to the reduced type scalar_t, to nearest even. For bf16 on a CPU
// with AVX-512 BF16 that is one instruction (vcvtne2ps2bf16) instead of ATen's dozen integer ones, which are a
// large share of silu_and_mul's time in bf16. The instruction reads float32 denormals (below 1.2e-38) as 0, where
// ATen rounds them to bf16 denormals; everything else is bitwise the same.
template <typename scalar_t>
inline at::vec::Vectorized<scalar_t> narrow_pair(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return at::vec::Vectorized<scalar_t>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  }
#endif
  return at::vec::convert_from_float<scalar_t>(a, b);
}

// 2 * Vec::size() values as float32 vectors a, b, rounded to scalar_t and back in place (ATen's vector
// conversions round to nearest even, as the scalar ones do; float32 stays as it is).
template <typename scalar_t>
inline void round_pair(Vec& a, Vec& b) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    std::tie(a, b) = at::vec::convert_to_float<scalar_t>(narrow_pair<scalar_t>(a, b));
  }
}

// a, b stored as 2 * Vec::size() scalar_t values at out, rounded to nearest even.
template <typename scalar_t>
inline void store_pair(const Vec& a, const Vec& b, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    a.store(out);
    b.store(out + Vec::size());
  } else {
    narrow_pair<scalar_t>(a, b).store(out);
  }
}

// n float32 values rounded to scalar_t (to nearest even) at dst: pairs of vectors, then one value at a time.
template <typename scalar_t>
inline void narrow(const float* src, scalar_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size())
    store_pair(Vec::loadu(src + i), Vec::loadu(src + i + Vec::size()), dst + i);
  for (; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

// Calls run(scalar_t{}) with the C++ type of `type`: float32, bfloat16 or float16; refuses any other by name.
template <typename F>
void dispatch_float_types(at::ScalarType type, const char* op, F&& run) {
  switch (type) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, op, " takes float32, bfloat16 or float16, not ", type);
  }
}

}  // namespace lora_serve
