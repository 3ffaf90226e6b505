// Multi-LoRA on CPU in one call per linear: every token reads its own adapter slot's A and B in place, as the
// Triton kernels do on CUDA (engine/lora/triton_kernels.py), with the same contract: y[t, off_i:off_i + out_i] +=
// (x[t] @ A[slot][:, i * rank:(i + 1) * rank]) @ B_i[slot], summed in float32 with y's value and rounded once to
// y's dtype; tokens of slot -1 (the base model) untouched.
//
// Why: the grouped PyTorch path gathers each segment's weights, pads and batches the tokens, and runs about ten
// small ops a linear (index_select, two bmm per sub-module, cat, index_add), each costing more on a CPU than its
// math, and a batch of adapted decodes loses much of the base model's throughput that way.
//
// The math is float32; the slots' weights are float32 or the model's dtype (LoRALinear keeps them in bf16 for a bf16
// model when this kernel runs: half the bytes each token reads). A token's x row is widened once; the shrink is a
// dot product of it with each of A's K = subs * rank columns, which LoRALinear stores K-major on CPU for this
// (along K, 24 or 8 values, vectors would be mostly partial); the expand adds each rank lane's coefficient times
// B's row to a float32 copy of y's row, which is rounded back once. Tokens are sorted by slot (a counting sort) and
// taken in groups of up to 4 of one slot: the slot's A stays in L1 from token to token, each row of B is widened
// once for the group, and each vector of the group's y rows stays in a register across the rank lanes. With bf16
// activations and weights and AVX-512 BF16, the shrink takes vdpbf16ps on x and A as stored, 16 columns a call
// (bf16_scores.h). The dot products, y in registers and the groups each make a call faster
// (measurements: docs/cpu_kernels.md).

#include "bf16_scores.h"
#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace lora_serve::lora_detail {

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

constexpr int64_t kGroup = 4;  // tokens of one slot expanded together: each row of B is read once for all of them

// Rows y[g][0:out] += sum over r of coefficients[g][r] * B[r][0:out] for the G tokens of a group (B's rows b_row
// apart), the terms added in order of r: each vector of B is widened once for the G tokens, and each vector of y
// stays in a register across the rank lanes.
template <int G, typename weight_t>
void add_rows(float* const* y, const weight_t* b, int64_t b_row, const float* const* coefficients, int64_t rank,
              int64_t out) {
  int64_t j = 0;
  for (; j + Vec::size() <= out; j += Vec::size()) {
    Vec acc[G];
    for (int g = 0; g < G; ++g) acc[g] = Vec::loadu(y[g] + j);
    for (int64_t r = 0; r < rank; ++r) {
      const Vec row = lora_serve::load_float(b + r * b_row + j);
      for (int g = 0; g < G; ++g) acc[g] = at::vec::fmadd(Vec(coefficients[g][r]), row, acc[g]);
    }
    for (int g = 0; g < G; ++g) acc[g].store(y[g] + j);
  }
  for (; j < out; ++j)
    for (int g = 0; g < G; ++g)
      for (int64_t r = 0; r < rank; ++r) y[g][j] += coefficients[g][r] * static_cast<float>(b[r * b_row + j]);
}

// The group's y rows [off_i:off_i + out_i] += shrunk rows [i * rank:(i + 1) * rank] @ B_i[slot], per sub-module i.
template <typename weight_t>
void expand(int64_t count, float* const* y_rows, const float* const* shrunk, const Weights<weight_t>& w,
            int64_t slot) {
  for (size_t i = 0; i < w.b.size(); ++i) {
    const weight_t* b = w.b[i] + slot * w.b_slot[i];
    float* y[kGroup];
    const float* coefficients[kGroup];
    for (int64_t g = 0; g < count; ++g) {
      y[g] = y_rows[g] + w.offset[i];
      coefficients[g] = shrunk[g] + i * w.rank;
    }
    switch (count) {
      case 1: add_rows<1>(y, b, w.b_row[i], coefficients, w.rank, w.out[i]); break;
      case 2: add_rows<2>(y, b, w.b_row[i], coefficients, w.rank, w.out[i]); break;
      case 3: add_rows<3>(y, b, w.b_row[i], coefficients, w.rank, w.out[i]); break;
      default: add_rows<kGroup>(y, b, w.b_row[i], coefficients, w.rank, w.out[i]); break;
    }
  }
}

// The tokens with an adapter in order of slot (a counting sort, stable), cut into groups of up to kGroup tokens of
// one slot: group i is order[starts[i]:starts[i + 1]].
struct SlotGroups {
  std::vector<int64_t> order, starts;
};

SlotGroups group_by_slot(const int64_t* slots, int64_t tokens, int64_t num_slots) {
  std::vector<int64_t> next(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++next[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) next[s + 1] += next[s];
  SlotGroups groups{std::vector<int64_t>(next[num_slots]), {}};
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) groups.order[next[slots[t]]++] = t;
  for (int64_t i = 0; i < static_cast<int64_t>(groups.order.size()); ++i)
    if (i == 0 || slots[groups.order[i]] != slots[groups.order[i - 1]] || i - groups.starts.back() == kGroup)
      groups.starts.push_back(i);
  groups.starts.push_back(groups.order.size());
  return groups;
}

template <typename scalar_t, typename weight_t>
void run(at::Tensor& y, const at::Tensor& x, const int64_t* slots, const Weights<weight_t>& w, int64_t num_slots) {
  const int64_t n = y.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  const bool bf16_shrink = shrink_in_bf16<scalar_t, weight_t>(w);
  const SlotGroups groups = group_by_slot(slots, x.size(0), num_slots);
  const int64_t count = static_cast<int64_t>(groups.starts.size()) - 1;
  lora_serve::parallel_for(0, count, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> x_row(w.in), y_buffer(kGroup * n), shrunk_buffer(kGroup * w.k);
    float* y_rows[kGroup];
    const float* shrunk[kGroup];
    for (int64_t g = 0; g < kGroup; ++g) {
      y_rows[g] = y_buffer.data() + g * n;
      shrunk[g] = shrunk_buffer.data() + g * w.k;
    }
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first = groups.starts[group], size = groups.starts[group + 1] - first;
      const int64_t slot = slots[groups.order[first]];
      for (int64_t g = 0; g < size; ++g) {  // one slot's A stays in L1 from token to token
        const int64_t t = groups.order[first + g];
        lora_serve::widen(yp + t * y_stride, y_rows[g], n);
        if (bf16_shrink) {
          shrink_bf16(xp + t * x_stride, w, slot, shrunk_buffer.data() + g * w.k);
        } else {
          lora_serve::widen(xp + t * x_stride, x_row.data(), w.in);
          shrink(x_row.data(), w, slot, shrunk_buffer.data() + g * w.k);
        }
      }
      expand(size, y_rows, shrunk, w, slot);
      for (int64_t g = 0; g < size; ++g) lora_serve::narrow(y_rows[g], yp + groups.order[first + g] * y_stride, n);
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

}  // namespace lora_serve::lora_detail

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_slots, const std::vector<at::Tensor>& b_slots,
               const at::Tensor& slots, int64_t rank) {
  using namespace lora_serve::lora_detail;
  check(y, x, a_slots, b_slots, slots, rank);
  lora_serve::dispatch_float_types(x.scalar_type(), "lora_add_", [&](auto type) {
    using scalar_t = decltype(type);
    if (a_slots.scalar_type() == at::kFloat)
      run<scalar_t>(y, x, slots.data_ptr<int64_t>(), weights<float>(a_slots, b_slots, rank), a_slots.size(0));
    else
      run<scalar_t>(y, x, slots.data_ptr<int64_t>(), weights<scalar_t>(a_slots, b_slots, rank), a_slots.size(0));
  });
}
