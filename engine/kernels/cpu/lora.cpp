// Multi-LoRA on CPU in one call per linear: every token reads its own adapter slot's A and B in place, as the
// Triton kernels do on CUDA (engine/kernels/lora.py), with the same contract: y[t, off_i:off_i + out_i] +=
// (x[t] @ A[slot][:, i * rank:(i + 1) * rank]) @ B_i[slot], summed in float32 with y's value and rounded once to
// y's dtype; tokens of slot -1 (the base model) untouched.
//
// Why: the grouped PyTorch path gathers each segment's weights, pads and batches the tokens, and runs about ten
// small ops a linear (index_select, two bmm per sub-module, cat, index_add), each tens of microseconds on a CPU
// while the math is a few. 64 decodes of 8 rank-8 q,k,v,o adapters on SmolLM2 in bf16 kept 74% of the base
// model's throughput on 2 cores of a Xeon that way.
//
// The math is float32; the slots' weights are float32 or the model's dtype (LoRALinear keeps them in bf16 for a bf16
// model when this kernel runs: half the bytes each token reads). A token's x row is widened once; the shrink is a
// dot product of it with each of A's K = subs * rank columns, which LoRALinear stores K-major on CPU for this
// (along K, 24 or 8 values, vectors would be mostly partial); the expand adds each rank lane's coefficient times
// B's row to a float32 copy of y's row, which is rounded back once. One slot's A and B of
// SmolLM2's fused q,k,v projection take 85 KB: 8 adapters' fit in L2, so tokens are not sorted by slot.
// With bf16 activations and weights and AVX-512 BF16, the shrink takes vdpbf16ps on x and A as stored, 16 columns a
// call (bf16_scores.h); the expand keeps each vector of y in a register across the rank lanes. 64 tokens over 8
// rank-8 slots, bf16, 2 cores of a Xeon: the q,k,v linear 44-48 -> 32 us a call, gate/up 77-82 -> 56 us.

#include "bf16_scores.h"
#include "float_types.h"
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

using lora_serve::Vec;

// sum of a[0:n] * b[0:n] (b widened to float32) in four vector chains, then one value at a time.
template <typename weight_t>
inline float dot(const float* a, const weight_t* b, int64_t n) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t j = 0;
  for (; j + 4 * Vec::size() <= n; j += 4 * Vec::size())
    for (int c = 0; c < 4; ++c)
      acc[c] = at::vec::fmadd(Vec::loadu(a + j + c * Vec::size()), lora_serve::load_float(b + j + c * Vec::size()),
                              acc[c]);
  for (; j + Vec::size() <= n; j += Vec::size())
    acc[0] = at::vec::fmadd(Vec::loadu(a + j), lora_serve::load_float(b + j), acc[0]);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add();
  for (; j < n; ++j) sum += a[j] * static_cast<float>(b[j]);
  return sum;
}

// The slot views LoRALinear keeps on CPU, in float32 or the model's dtype: A [S, in, K] stored K-major (each of
// its K columns a contiguous run over `in`: a dot product per column), and one B [S, rank, out_i] per sub-module
// (rows contiguous).
template <typename weight_t>
struct Weights {
  const weight_t* a;
  int64_t a_slot, a_column;
  std::vector<const weight_t*> b;
  std::vector<int64_t> b_slot, b_row, out, offset;
  int64_t in, k, rank;
};

// shrunk[0:K] = x_row @ A[slot]
template <typename weight_t>
void shrink(const float* x_row, const Weights<weight_t>& w, int64_t slot, float* shrunk) {
  const weight_t* a = w.a + slot * w.a_slot;
  for (int64_t k = 0; k < w.k; ++k) shrunk[k] = dot(x_row, a + k * w.a_column, w.in);
}

// Whether the shrink takes AVX-512 BF16's dot product on the bf16 x row and A as they are stored, 16 columns a
// call (bf16_scores.h): half the instructions of widening both to float32, and no widening of x.
template <typename scalar_t, typename weight_t>
bool shrink_in_bf16(const Weights<weight_t>& w) {
  return lora_serve::kBf16Dot && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<weight_t, c10::BFloat16> &&
         w.in % 32 == 0 && w.a_column == w.in;
}

template <typename scalar_t, typename weight_t>
void shrink_bf16(const scalar_t* x_row, const Weights<weight_t>& w, int64_t slot, float* shrunk) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<weight_t, c10::BFloat16>) {
    const weight_t* a = w.a + slot * w.a_slot;
    for (int64_t k = 0; k < w.k; k += 16)
      lora_serve::bf16_row_dots(x_row, a + k * w.a_column, std::min<int64_t>(16, w.k - k), w.in, shrunk + k);
  }
}

// y[0:out] += sum over r of coefficients[r] * B[r][0:out] (B's rows b_row apart), the terms added in order of r:
// each vector of y is loaded and stored once, not once per rank lane.
template <typename weight_t>
void add_rows(float* y, const weight_t* b, int64_t b_row, const float* coefficients, int64_t rank, int64_t out) {
  int64_t j = 0;
  for (; j + Vec::size() <= out; j += Vec::size()) {
    Vec acc = Vec::loadu(y + j);
    for (int64_t r = 0; r < rank; ++r)
      acc = at::vec::fmadd(Vec(coefficients[r]), lora_serve::load_float(b + r * b_row + j), acc);
    acc.store(y + j);
  }
  for (; j < out; ++j)
    for (int64_t r = 0; r < rank; ++r) y[j] += coefficients[r] * static_cast<float>(b[r * b_row + j]);
}

// y_row[off_i:off_i + out_i] += shrunk[i * rank:(i + 1) * rank] @ B_i[slot], for every sub-module i.
template <typename weight_t>
void expand(const float* shrunk, const Weights<weight_t>& w, int64_t slot, float* y_row) {
  for (size_t i = 0; i < w.b.size(); ++i)
    add_rows(y_row + w.offset[i], w.b[i] + slot * w.b_slot[i], w.b_row[i], shrunk + i * w.rank, w.rank, w.out[i]);
}

template <typename scalar_t, typename weight_t>
void run(at::Tensor& y, const at::Tensor& x, const int64_t* slots, const Weights<weight_t>& w) {
  const int64_t tokens = x.size(0), n = y.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const bool bf16_shrink = shrink_in_bf16<scalar_t, weight_t>(w);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> x_row(w.in), y_row(n), shrunk(w.k);
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      lora_serve::widen(yp + t * y_stride, y_row.data(), n);
      if (bf16_shrink) {
        shrink_bf16(xp + t * x_stride, w, slots[t], shrunk.data());
      } else {
        lora_serve::widen(xp + t * x_stride, x_row.data(), w.in);
        shrink(x_row.data(), w, slots[t], shrunk.data());
      }
      expand(shrunk.data(), w, slots[t], y_row.data());
      lora_serve::narrow(y_row.data(), yp + t * y_stride, n);
    }
  });
}

template <typename weight_t>
Weights<weight_t> weights(const at::Tensor& a_slots, const std::vector<at::Tensor>& b_slots, int64_t rank) {
  Weights<weight_t> w{a_slots.data_ptr<weight_t>(), a_slots.stride(0), a_slots.stride(2), {}, {}, {}, {}, {},
                      a_slots.size(1), a_slots.size(2), rank};
  int64_t offset = 0;
  for (const auto& b : b_slots) {
    w.b.push_back(b.data_ptr<weight_t>());
    w.b_slot.push_back(b.stride(0));
    w.b_row.push_back(b.stride(1));
    w.out.push_back(b.size(2));
    w.offset.push_back(offset);
    offset += b.size(2);
  }
  return w;
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a_slots, const std::vector<at::Tensor>& b_slots,
           const at::Tensor& slots, int64_t rank) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "x and y must be [T, in] and [T, out] with unit stride in their last dimension");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong &&
              slots.is_contiguous(), "slots must be int64 [T]");
  const auto weight_type = a_slots.scalar_type();
  TORCH_CHECK(weight_type == at::kFloat || weight_type == x.scalar_type(),
              "the slots' weights must be float32 or x's dtype");
  TORCH_CHECK(a_slots.dim() == 3 && a_slots.stride(1) == 1 && a_slots.size(1) == x.size(1) &&
              a_slots.size(2) == rank * static_cast<int64_t>(b_slots.size()),
              "a_slots must be [S, in, subs * rank], K-major (unit stride along in)");
  int64_t out = 0;
  for (const auto& b : b_slots) {
    TORCH_CHECK(b.dim() == 3 && b.scalar_type() == weight_type && b.stride(2) == 1 && b.size(0) == a_slots.size(0) &&
                b.size(1) == rank, "each of b_slots must be [S, rank, out_i] in A's dtype with unit stride in its "
                "last dimension");
    out += b.size(2);
  }
  TORCH_CHECK(out == y.size(1), "the sub-modules' outputs must add up to y's columns");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] < a_slots.size(0), "slot ", sp[t], " is outside the ", a_slots.size(0), " slots");
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_slots, const std::vector<at::Tensor>& b_slots,
               const at::Tensor& slots, int64_t rank) {
  check(y, x, a_slots, b_slots, slots, rank);
  lora_serve::dispatch_float_types(x.scalar_type(), "lora_add_", [&](auto type) {
    using scalar_t = decltype(type);
    if (a_slots.scalar_type() == at::kFloat)
      run<scalar_t>(y, x, slots.data_ptr<int64_t>(), weights<float>(a_slots, b_slots, rank));
    else
      run<scalar_t>(y, x, slots.data_ptr<int64_t>(), weights<scalar_t>(a_slots, b_slots, rank));
  });
}
