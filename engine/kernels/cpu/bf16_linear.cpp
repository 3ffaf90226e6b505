// bf16 linears of a decode step's rows with AVX-512 BF16 (VDPBF16PS), for CPUs that have it and no AMX (AMD Zen 4
// on): y [M, N] = x [M, K] W^T (+ bias).
//
// Why: oneDNN's prepacked bf16 linear (its avx512_core_bf16 kernel) used 48-63% of the dot-product units at 32-64
// rows on 2 cores of an AMD EPYC (SmolLM2's 30 layers of weights: 14.0 ms at 32 rows, 21.4 at 64; the units do
// 500 GFLOP/s a core), although the weights fit the caches it reuses them from. A decode step is a few rows over
// every weight, so the kernel is built around the weight stream: each weight vector loaded is used for 6 rows
// from registers, and a column block's weights, read from memory once for the first 6 rows, serve the others
// from L2.
//
// Layout: W [N, K] is packed as [N / 64][K / 2][64][2] bf16: for each 64 output columns and each pair of depths,
// four vectors of 16 columns whose 32-bit lanes hold one column's weights at depths 2p and 2p + 1 (the pairs
// VDPBF16PS multiplies). x is read in place, its pair at (row, 2p) broadcast to every lane. Products accumulate in
// float32 registers (6 rows x 64 columns: 24 of the 32), the bias is added in float32, and y is rounded to bf16
// once, as oneDNN does.

#include "ops.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace lora_serve::bf16_linear_detail {

constexpr int64_t kVectors = 4;                   // 16-column vectors per block
constexpr int64_t kCols = 16 * kVectors;          // output columns per packed block
constexpr int64_t kPairValues = 2 * kCols;        // bf16 values of one block at one depth pair (256 bytes)
constexpr int kRows = 6;                          // rows per register block: 24 accumulators
constexpr int64_t kPrefetchAhead = 8 * kPairValues;  // 4 KB ahead in the stream of the block's first pass

struct Problem {
  const uint16_t* x;
  const uint16_t* w;
  const float* bias;  // float32 [N], or null
  uint16_t* y;
  int64_t m, n, k;
};

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Rows [row0, row0 + R) of x against column block `block`; `first` marks the pass that streams the block from
// memory, which prefetches ahead of itself.
template <int R, bool first>
void row_block(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* w = p.w + block * (p.k / 2) * kPairValues;
  const uint16_t* x = p.x + row0 * p.k;
  for (int64_t pair = 0; pair < p.k / 2; ++pair, w += kPairValues) {
    if (first) {
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead + 32 * line),
                                                        _MM_HINT_T0);
    }
    __m512bh b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = (__m512bh)_mm512_loadu_si512(w + 32 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = broadcast_pair(x + r * p.k + 2 * pair);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int64_t col = block * kCols + 16 * v;
    const __m512 bias = p.bias != nullptr ? _mm512_loadu_ps(p.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], bias));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.y + (row0 + r) * p.n + col), (__m256i)out);
    }
  }
}

template <bool first>
void rows(const Problem& p, int64_t block, int64_t row0, int count) {
  switch (count) {
    case 1: return row_block<1, first>(p, block, row0);
    case 2: return row_block<2, first>(p, block, row0);
    case 3: return row_block<3, first>(p, block, row0);
    case 4: return row_block<4, first>(p, block, row0);
    case 5: return row_block<5, first>(p, block, row0);
    default: return row_block<kRows, first>(p, block, row0);
  }
}

void column_block(const Problem& p, int64_t block) {
  for (int64_t row0 = 0; row0 < p.m; row0 += kRows) {
    const int count = static_cast<int>(std::min<int64_t>(kRows, p.m - row0));
    if (row0 == 0) rows<true>(p, block, row0, count);
    else rows<false>(p, block, row0, count);
  }
}

}  // namespace lora_serve::bf16_linear_detail

bool bf16_linear_usable(int64_t n, int64_t k) {
  using namespace lora_serve::bf16_linear_detail;
  return n % kCols == 0 && k % 2 == 0;
}

at::Tensor bf16_pack_linear_weight(const at::Tensor& weight) {
  using namespace lora_serve::bf16_linear_detail;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack_linear_weight takes a 2-D "
              "bf16 weight [out, in], not ", weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(bf16_linear_usable(n, k), "bf16_pack_linear_weight: out (", n, ") must be a multiple of 64 and in (",
              k, ") even");
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  at::Tensor packed = weight.new_empty({n / kCols, k / 2, kCols, 2});
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      for (int64_t pair = 0; pair < k / 2; ++pair)
        for (int64_t c = 0; c < kCols; ++c) {
          uint16_t* out = dst + (block * (k / 2) + pair) * kPairValues + 2 * c;
          const uint16_t* row = src + (block * kCols + c) * k + 2 * pair;
          out[0] = row[0];
          out[1] = row[1];
        }
  });
  return packed;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  using namespace lora_serve::bf16_linear_detail;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_linear takes 2-D bf16 x and a weight from bf16_pack_linear_weight");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1), "bf16_linear: x has ", x.size(1),
              " features, the packed weight takes ", packed.size(1) * 2);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kCols;
  const at::Tensor xc = x.contiguous();
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bf16_linear: bias of ", bias->numel(), " values for ", n, " outputs");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = x.new_empty({m, n});
  const Problem p{reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  m, n, k};
  at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {  // contiguous blocks: one stream a thread
    for (int64_t block = begin; block < end; ++block) column_block(p, block);
  });
  return y;
}

#else

bool bf16_linear_usable(int64_t, int64_t) { return false; }

at::Tensor bf16_pack_linear_weight(const at::Tensor&) { TORCH_CHECK(false, "this build has no AVX-512 BF16"); }

at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this build has no AVX-512 BF16");
}

#endif
