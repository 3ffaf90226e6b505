// Rotary position embedding in one pass over a step's query and key heads, for the batch-1 step where the eager
// version's concatenation, negation, two products and sum cost more than their arithmetic
// (measurements: docs/cpu_kernels.md).
//
// Rounding follows transformers' apply_rotary_pos_emb exactly: x * cos and rotate_half(x) * sin are each rounded
// to the model dtype, then added and rounded again (for fp32 every step rounds as PyTorch does). cos and sin
// narrower than the head turn its first dimensions and copy the rest, as transformers does for a partial rotary
// embedding (Phi-4-mini's 96 of 128).

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

namespace lora_serve::rotary_detail {

template <typename scalar_t>
void rotate_scalar(const scalar_t* in, const scalar_t* cos, const scalar_t* sin, scalar_t* o, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -static_cast<float>(in[i + half]) : static_cast<float>(in[i - half]);
    const float a = lora_serve::round_to<scalar_t>(static_cast<float>(in[i]) * static_cast<float>(cos[i]));
    const float b = lora_serve::round_to<scalar_t>(rotated * static_cast<float>(sin[i]));
    o[i] = static_cast<scalar_t>(a + b);
  }
}

// The same rounding in vectors, 2 * Vec::size() outputs a step (each half of the head a whole number of steps),
// faster than the scalar loop on a long prompt.
template <typename scalar_t>
void rotate_vector(const scalar_t* in, const scalar_t* cos, const scalar_t* sin, scalar_t* o, int64_t d) {
  constexpr int64_t step = 2 * lora_serve::Vec::size();
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; i += step) {
    using lora_serve::load_float;
    const int64_t partner = i < half ? i + half : i - half;
    const lora_serve::Vec sign(i < half ? -1.f : 1.f);
    lora_serve::Vec a0 = load_float(in + i) * load_float(cos + i);
    lora_serve::Vec a1 = load_float(in + i + step / 2) * load_float(cos + i + step / 2);
    lora_serve::Vec b0 = load_float(in + partner) * sign * load_float(sin + i);
    lora_serve::Vec b1 = load_float(in + partner + step / 2) * sign * load_float(sin + i + step / 2);
    lora_serve::round_pair<scalar_t>(a0, a1);
    lora_serve::round_pair<scalar_t>(b0, b1);
    lora_serve::store_pair(a0 + b0, a1 + b1, o + i);
  }
}

// Each head's first `turned` dimensions turned, the rest of its d copied.
template <typename scalar_t>
void rotate_token(const scalar_t* x, int64_t head_stride, const scalar_t* cos, const scalar_t* sin,
                  scalar_t* out, int64_t heads, int64_t d, int64_t turned) {
  const bool vector = (turned / 2) % (2 * lora_serve::Vec::size()) == 0;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* in = x + h * head_stride;
    if (vector) rotate_vector(in, cos, sin, out + h * d, turned);
    else rotate_scalar(in, cos, sin, out + h * d, turned);
    for (int64_t i = turned; i < d; ++i) out[h * d + i] = in[i];
  }
}

template <typename scalar_t>
void run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out, int64_t turned) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  lora_serve::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rotate_token(xp + t * token_stride, head_stride, cp + t * turned, sp + t * turned, op + t * heads * d, heads, d,
                   turned);
  });
}

}  // namespace lora_serve::rotary_detail

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using namespace lora_serve::rotary_detail;
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with unit stride in its last "
              "dimension");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  const int64_t turned = x.size(0) > 0 ? cos.numel() / x.size(0) : x.size(2);
  TORCH_CHECK(cos.numel() == x.size(0) * turned && sin.numel() == cos.numel() && turned % 2 == 0 &&
              turned <= x.size(2), "cos and sin must hold [tokens, rotary dims] values, an even number of "
              "dimensions up to head_dim");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "x, cos and sin must share a dtype");
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = x.new_empty({x.size(0), x.size(1), x.size(2)});
  lora_serve::dispatch_float_types(x.scalar_type(), "rotary", [&](auto type) {
    run<decltype(type)>(x, c, s, out, turned);
  });
  return out;
}
