// bf16 linears of a few rows on AMX tiles (TDPBF16PS): decode steps, y [M, N] = x [M, K] W^T (+ bias), for CPUs
// with AMX (Xeon 4th generation on).
//
// Why: a decode step's linears read every weight once for a few rows of activations, so they should stream the
// weights at the memory's rate. oneDNN's prepacked bf16 linear (its AMX kernel) does not: its tile loads wait on
// memory, and its stream slows as the rows grow, far below the tiles' rate (measurements: docs/cpu_kernels.md).
// Here the weights are packed once into the order this kernel reads them, so each thread reads one
// contiguous stream that it prefetches a few KB ahead, and every weight tile is used for up to 32 rows while it
// is in registers (the rows beyond 32 reuse it from L2).
//
// Layout: W [N, K] is packed as [N / 32][K / 32][2][16][32] bf16: for each 32 output columns (two 16-column
// blocks, the B operands of two products) and each 32-deep slice of K, two 1 KB tiles whose row r holds, for each
// of the 16 columns, the pair of weights at depths 2r and 2r + 1 (the pairs TDPBF16PS takes). x is read in place
// as 16-row A tiles (rows past M zero-padded in a copy). Products accumulate in float32 tiles, the bias is added
// in float32, and y is rounded to bf16 once, as oneDNN does.

#include "ops.h"
#include "work_pool.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include "amx.h"
#include "float_types.h"

#include <cstring>
#include <vector>

namespace lora_serve::amx_linear_detail {

constexpr int64_t kCols = 32;          // output columns per packed group: two 16-column B tiles
constexpr int64_t kDepth = 32;         // K per tile: 16 rows of bf16 pairs
constexpr int64_t kGroupSlice = 1024;  // bf16 values of one group's two tiles at one K slice (2 KB)
constexpr int64_t kPrefetchAhead = 4 * kGroupSlice;  // 8 KB: about a DRAM latency's worth of one core's stream
// tile registers: gcc's tile intrinsics paste their number into the instruction, so they must be literals
#define ACC00 0  // rows 0-15 x columns 0-15 of the pass
#define ACC01 1  // rows 0-15 x columns 16-31
#define ACC10 2  // rows 16-31 x columns 0-15
#define ACC11 3  // rows 16-31 x columns 16-31
#define WEIGHT0 4
#define WEIGHT1 5
#define ROWS0 6
#define ROWS1 7

struct Problem {
  const uint16_t* x;  // [rows, k], rows a multiple of 16
  const uint16_t* w;  // packed
  const float* bias;  // [n] or nullptr
  uint16_t* y;        // [m, n]
  int64_t m, rows, n, k, slices;
};

void prefetch_slice(const uint16_t* p) {
  for (int64_t line = 0; line < kGroupSlice * 2; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + line, _MM_HINT_T0);
  }
}

// 16 float32 sums (+ bias) rounded to bf16 at out.
void store_row(const float* sums, const float* bias, uint16_t* out) {
  __m512 v = _mm512_loadu_ps(sums);
  if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
  __m256bh rounded = _mm512_cvtneps_pbh(v);
  std::memcpy(out, &rounded, 32);
}

// Rows [row0, row0 + 16 * tiles) of y at the 32 columns of group g, from the accumulators' float32 tiles.
void store_group(const Problem& p, int64_t g, int64_t row0, int tiles, float (*acc)[256]) {
  for (int t = 0; t < tiles; ++t) {
    for (int64_t r = 0; r < 16 && row0 + 16 * t + r < p.m; ++r) {
      for (int half = 0; half < 2; ++half) {
        const int64_t col = g * kCols + 16 * half;
        store_row(acc[2 * t + half] + r * 16, p.bias ? p.bias + col : nullptr, p.y + (row0 + 16 * t + r) * p.n + col);
      }
    }
  }
}

// One group's 32 columns for rows [row0, row0 + 32) (or 16 when only one row tile is left).
void group_pass(const Problem& p, int64_t g, int64_t row0, float (*acc)[256]) {
  const bool two = row0 + 16 < p.rows;
  const uint16_t* w = p.w + g * p.slices * kGroupSlice;
  const uint16_t* a0 = p.x + row0 * p.k;
  const uint16_t* a1 = a0 + 16 * p.k;
  const int64_t stride = p.k * 2;
  _tile_zero(ACC00);
  _tile_zero(ACC01);
  _tile_zero(ACC10);
  _tile_zero(ACC11);
  for (int64_t s = 0; s < p.slices; ++s) {
    const uint16_t* slice = w + s * kGroupSlice;
    if (row0 == 0) prefetch_slice(slice + kPrefetchAhead);  // later passes find the group in L2
    _tile_loadd(WEIGHT0, slice, 64);
    _tile_loadd(WEIGHT1, slice + kGroupSlice / 2, 64);
    _tile_loadd(ROWS0, a0 + s * kDepth, stride);
    _tile_dpbf16ps(ACC00, ROWS0, WEIGHT0);
    _tile_dpbf16ps(ACC01, ROWS0, WEIGHT1);
    if (two) {
      _tile_loadd(ROWS1, a1 + s * kDepth, stride);
      _tile_dpbf16ps(ACC10, ROWS1, WEIGHT0);
      _tile_dpbf16ps(ACC11, ROWS1, WEIGHT1);
    }
  }
  _tile_stored(ACC00, acc[0], 64);
  _tile_stored(ACC01, acc[1], 64);
  if (two) {
    _tile_stored(ACC10, acc[2], 64);
    _tile_stored(ACC11, acc[3], 64);
  }
  store_group(p, g, row0, two ? 2 : 1, acc);
}

}  // namespace lora_serve::amx_linear_detail

bool amx_linear_usable(int64_t n, int64_t k) {
  using namespace lora_serve::amx_linear_detail;
  return n % kCols == 0 && k % kDepth == 0 && lora_serve::tiles_granted();
}

at::Tensor amx_pack_linear_weight(const at::Tensor& weight) {
  using namespace lora_serve::amx_linear_detail;
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "amx_pack_linear_weight takes a 2-D bf16 "
              "weight [out, in], not ", weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kDepth == 0, "amx_pack_linear_weight: out (", n, ") must be a multiple of 32 and "
              "in (", k, ") a multiple of 32");
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  at::Tensor packed = weight.new_empty({n / kCols, k / kDepth, 2, 16, kDepth});
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  lora_serve::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t s = 0; s < k / kDepth; ++s) {
        uint16_t* tile = dst + (g * (k / kDepth) + s) * kGroupSlice;
        for (int64_t half = 0; half < 2; ++half) {
          for (int64_t r = 0; r < 16; ++r) {
            for (int64_t c = 0; c < 16; ++c) {
              const uint16_t* row = src + (g * kCols + half * 16 + c) * k + s * kDepth + 2 * r;
              tile[half * 512 + r * 32 + 2 * c] = row[0];
              tile[half * 512 + r * 32 + 2 * c + 1] = row[1];
            }
          }
        }
      }
    }
  });
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  using namespace lora_serve::amx_linear_detail;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear takes 2-D bf16 x and a weight from amx_pack_linear_weight");
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) * kDepth == x.size(1), "amx_linear: x has ", x.size(1),
              " features, the packed weight takes ", packed.size(1) * kDepth);
  TORCH_CHECK(lora_serve::tiles_granted(), "amx_linear: the OS does not grant this process the AMX tile state");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * kCols, rows = (m + 15) / 16 * 16;
  at::Tensor xc = x.contiguous();
  std::vector<uint16_t> padded;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  if (rows != m) {  // whole 16-row tiles; the padding rows' results are never stored
    padded.assign(rows * k, 0);
    std::memcpy(padded.data(), xp, m * k * sizeof(uint16_t));
    xp = padded.data();
  }
  const at::Tensor bias32 = lora_serve::float32_bias(bias, n, "amx_linear");
  at::Tensor y = x.new_empty({m, n});
  const Problem p{xp, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  bias32.defined() ? bias32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  m, rows, n, k, k / kDepth};
  lora_serve::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {  // contiguous groups: one stream a thread
    lora_serve::configure_tiles(ROWS1 + 1);
    alignas(64) float acc[4][256];
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t row0 = 0; row0 < rows; row0 += 32) group_pass(p, g, row0, acc);
    }
    _tile_release();
  });
  return y;
}

#undef ACC00
#undef ACC01
#undef ACC10
#undef ACC11
#undef WEIGHT0
#undef WEIGHT1
#undef ROWS0
#undef ROWS1

#else

bool amx_linear_usable(int64_t, int64_t) { return false; }

at::Tensor amx_pack_linear_weight(const at::Tensor&) { TORCH_CHECK(false, "this build has no AMX"); }

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this build has no AMX");
}

#endif
