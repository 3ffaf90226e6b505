// Linears with vector FMAs for CPUs without AMX: y [M, N] = x [M, K] W^T (+ bias). With AVX-512 (AMD Zen 4 on)
// in bf16 with VDPBF16PS dot products or in float32; with AVX2 and FMA alone (AMD Zen 3, older Intel) in float32.
//
// Why: oneDNN's prepacked linears leave the vector units idle at a decode step's row counts: in bf16 its kernel keeps
// only part of the dot-product units busy, and in float32, with AVX-512 or AVX2, it streams the weights well below
// the rate the memory gives (measurements: docs/cpu_kernels.md). A decode step is a few rows over every weight, so
// the kernel is built around the weight stream: each weight vector loaded is used for 6 rows from registers, and a
// column block's weights, read from memory once for the first 6 rows, serve the others from L2.
//
// A bf16 model on a CPU with AVX2 alone keeps its weights in bf16: its float32 rows multiply weights widened to
// float32 in registers (exactly: a bf16 is the top half of a float32), so a decode step reads half the bytes of
// the same model in float32 and computes as it would (Float32WithBFloat16Weights).
//
// Layout: W [N, K] is packed as [N / C][K / D][C][D] for C columns a block (4 vectors of 16 with AVX-512: 24 of the
// 32 registers hold 6 rows' sums; 2 vectors of 8 with AVX2: 12 of its 16) and D depths per 32-bit lane (bf16: 2,
// the pairs VDPBF16PS multiplies; float32: 1). x is read in place, its D values at (row, depth) broadcast to every
// lane. Products accumulate in float32 registers, the bias is added in float32, and bf16 outputs are rounded once,
// as oneDNN does.

#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)  // Vec's width: cpu_ops.vector_flags

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace lora_serve::simd_linear_detail {

// Vec (float_types.h) is 16 lanes with AVX-512 and 8 with AVX2: 6 rows x kVectors sums + kVectors weights + 1
// broadcast fit the registers (32 with AVX-512, 16 with AVX2).
constexpr int64_t kVectors = Vec::size() >= 16 ? 4 : 2;
constexpr int64_t kCols = Vec::size() * kVectors;  // output columns per packed block
// The registers' own type, for every value of a row block's loop: with Vec (ATen's Vectorized<float>, a class)
// for its 24 sums, GCC keeps all but one in memory, a load and a store around each dot product, and the kernel runs
// at the stores' pace, behind oneDNN; as RawVec they stay in registers.
#if defined(CPU_CAPABILITY_AVX512)
using RawVec = __m512;
inline RawVec raw_zero() { return _mm512_setzero_ps(); }
inline RawVec raw_load(const float* p) { return _mm512_loadu_ps(p); }
inline RawVec raw_add(RawVec a, RawVec b) { return _mm512_add_ps(a, b); }
inline RawVec raw_broadcast(float x) { return _mm512_set1_ps(x); }
inline RawVec raw_fmadd(RawVec a, RawVec b, RawVec acc) { return _mm512_fmadd_ps(a, b, acc); }
inline void raw_store(float* p, RawVec v) { _mm512_storeu_ps(p, v); }
#else
using RawVec = __m256;
inline RawVec raw_zero() { return _mm256_setzero_ps(); }
inline RawVec raw_load(const float* p) { return _mm256_loadu_ps(p); }
inline RawVec raw_add(RawVec a, RawVec b) { return _mm256_add_ps(a, b); }
inline RawVec raw_broadcast(float x) { return _mm256_set1_ps(x); }
inline RawVec raw_fmadd(RawVec a, RawVec b, RawVec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline void raw_store(float* p, RawVec v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kRows = 6;                           // rows per register block
constexpr int64_t kPrefetchAhead = 4096;           // bytes ahead in the stream of the block's first pass

// float32: one depth a lane, fused multiply-add, on the raw registers (see RawVec).
struct Float32 {
  using value_t = float;
  using weight_t = float;
  using vector_t = RawVec;
  static constexpr int64_t kDepth = 1;
  static RawVec load(const float* p) { return raw_load(p); }
  static RawVec broadcast(const float* p) { return raw_broadcast(*p); }
  static RawVec madd(RawVec acc, RawVec a, RawVec b) { return raw_fmadd(a, b, acc); }
  static void store(float* p, RawVec v) { raw_store(p, v); }
  // The block's kVectors weight vectors at one depth.
  static void load_depth(const float* w, RawVec (&b)[kVectors]) {
    for (int v = 0; v < kVectors; ++v) b[v] = load(w + Vec::size() * v);
  }
};

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
// bf16: a pair of depths a lane, VDPBF16PS.
struct BFloat16 {
  using value_t = uint16_t;
  using weight_t = uint16_t;
  using vector_t = __m512bh;
  static constexpr int64_t kDepth = 2;
  static vector_t load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static void load_depth(const uint16_t* w, vector_t (&b)[kVectors]) {
    for (int v = 0; v < kVectors; ++v) b[v] = load(w + Vec::size() * kDepth * v);
  }
  static vector_t broadcast(const uint16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 madd(__m512 acc, vector_t a, vector_t b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

#if !defined(CPU_CAPABILITY_AVX512)
#define LORA_SERVE_WIDENS_BF16 1
// AVX2: float32 rows, bf16 weights. The pack (simd_pack_linear_weight) puts the block's two vectors of a depth in
// one: each 32-bit word holds a column of vector 0 in its low half and the same column of vector 1 in its high
// half, so one load and two integer operations give both as float32 (the low half shifted up, the high half
// masked), exactly. Widening each vector from its own 8 bf16 values (a zero-extending load, then a shift) makes a few
// rows slower than float32; this way a few rows, where the weight stream sets the pace, run faster than float32, and
// many rows, where the FMAs set it, about as fast.
struct Float32WithBFloat16Weights : Float32 {
  using weight_t = uint16_t;
  static void load_depth(const uint16_t* w, RawVec (&b)[kVectors]) {
    static_assert(kVectors == 2, "AVX2's block is two vectors");
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    b[0] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    b[1] = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
#endif

template <typename F>
struct Problem {
  const typename F::value_t* x;
  const typename F::weight_t* w;
  const float* bias;  // float32 [N], or null
  typename F::value_t* y;
  int64_t m, n, k;
};

// Rows [row0, row0 + R) of x against column block `block`; `first` marks the pass that streams the block from
// memory, which prefetches ahead of itself. A pass given `next` (a later column block's weights) also fetches
// that block into L2, a step of depths for each of its own.
template <typename F, int R, bool first>
void row_block(const Problem<F>& p, int64_t block, int64_t row0, const typename F::weight_t* next) {
  constexpr int64_t step = kCols * F::kDepth;  // weights of the block at one lane's depths
  constexpr int64_t step_bytes = step * static_cast<int64_t>(sizeof(typename F::weight_t));
  constexpr int64_t ahead = kPrefetchAhead / sizeof(typename F::weight_t);
  RawVec acc[R][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) acc[r][v] = raw_zero();
  const auto* w = p.w + block * p.k * kCols;
  const auto* x = p.x + row0 * p.k;
  for (int64_t depth = 0; depth < p.k; depth += F::kDepth, w += step) {
    if (first) {
      for (int64_t byte = 0; byte < step_bytes; byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + ahead) + byte, _MM_HINT_T0);
    } else if (next != nullptr) {
      for (int64_t byte = 0; byte < step_bytes; byte += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + depth * kCols) + byte, _MM_HINT_T1);
    }
    typename F::vector_t b[kVectors];
    F::load_depth(w, b);
    for (int r = 0; r < R; ++r) {
      const auto a = F::broadcast(x + r * p.k + depth);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = F::madd(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < kVectors; ++v) {
    const int64_t col = block * kCols + Vec::size() * v;
    const RawVec bias = p.bias != nullptr ? raw_load(p.bias + col) : raw_zero();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) F::store(p.y + (row0 + r) * p.n + col, raw_add(acc[r][v], bias));
  }
}

template <typename F, bool first>
void rows(const Problem<F>& p, int64_t block, int64_t row0, int count, const typename F::weight_t* next) {
  switch (count) {
    case 1: return row_block<F, 1, first>(p, block, row0, next);
    case 2: return row_block<F, 2, first>(p, block, row0, next);
    case 3: return row_block<F, 3, first>(p, block, row0, next);
    case 4: return row_block<F, 4, first>(p, block, row0, next);
    case 5: return row_block<F, 5, first>(p, block, row0, next);
    default: return row_block<F, kRows, first>(p, block, row0, next);
  }
}

// Each thread takes chunks of column blocks from the front of a contiguous range (work_pool.cpp): one weight stream
// a thread. A block's first pass over the rows reads it from memory, at the memory's pace; later passes read it
// from L2. So the second pass also fetches the next block into L2 (the thread's own next, unless another thread
// took it), and that block's first pass then runs at the FMAs' pace. At one register block of rows or fewer a step
// is the weight stream alone, and the fetch changes nothing. Spreading the next block's fetch over every later pass
// is no faster.
//
// Where the column blocks do not divide evenly among the threads (SmolLM2's 576 outputs are 9 blocks: 5 for one
// thread of 2, 4 for the other, which then waits a ninth of the call), each block's rows are cut into parts, one
// item each, so the items divide evenly; a thread's consecutive items are parts of one block, which it reads from
// memory once.
template <typename F>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias32, at::Tensor& y) {
  using value_t = typename F::value_t;
  using weight_t = typename F::weight_t;
  const Problem<F> p{reinterpret_cast<const value_t*>(x.data_ptr()),
                     reinterpret_cast<const weight_t*>(packed.data_ptr()),
                     bias32.defined() ? bias32.data_ptr<float>() : nullptr, reinterpret_cast<value_t*>(y.data_ptr()),
                     x.size(0), y.size(1), x.size(1)};
  const int64_t blocks = p.n / kCols, row_blocks = (p.m + kRows - 1) / kRows, threads = lora_serve::pool_threads();
  const int64_t parts = std::min(row_blocks, threads / std::gcd(blocks, threads));  // row parts a block
  lora_serve::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {  // a thread's next chunk follows this one (work_pool.cpp)
      const int64_t block = item / parts, part = item % parts;
      const int64_t first_row = row_blocks * part / parts * kRows, last_row = row_blocks * (part + 1) / parts * kRows;
      const weight_t* next = part + 1 == parts && block + 1 < blocks ? p.w + (block + 1) * p.k * kCols : nullptr;
      for (int64_t row0 = first_row; row0 < std::min(p.m, last_row); row0 += kRows) {
        const int count = static_cast<int>(std::min<int64_t>(kRows, p.m - row0));
        if (row0 == first_row) rows<F, true>(p, block, row0, count, nullptr);
        else rows<F, false>(p, block, row0, count, row0 == first_row + kRows ? next : nullptr);
      }
    }
  });
}

// A mixture's experts in one call: x's rows sorted by expert, expert e's rows [offsets[e], offsets[e + 1]) against
// its own weight packed[e]. Each item is one column block of one expert that has rows, so a thread streams a
// contiguous run of the experts' weights (work_pool.cpp), and an expert no row chose is never read. A loop over
// the experts in Python, a linear each, costs several calls an expert, most of a layer's time.
template <typename F>
void run_grouped(const at::Tensor& x, const at::Tensor& packed, const int64_t* offsets, at::Tensor& y) {
  using value_t = typename F::value_t;
  using weight_t = typename F::weight_t;
  const int64_t k = x.size(1), n = y.size(1), blocks = n / kCols, per_expert = packed[0].numel();
  std::vector<int64_t> active;  // the experts with rows
  for (int64_t e = 0; e < packed.size(0); ++e)
    if (offsets[e + 1] > offsets[e]) active.push_back(e);
  const auto* xs = reinterpret_cast<const value_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const weight_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<value_t*>(y.data_ptr());
  lora_serve::parallel_for(0, static_cast<int64_t>(active.size()) * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t expert = active[item / blocks], block = item % blocks, row = offsets[expert];
      const Problem<F> p{xs + row * k, ws + expert * per_expert, nullptr, ys + row * n, offsets[expert + 1] - row,
                         n, k};
      const weight_t* next = block + 1 < blocks ? p.w + (block + 1) * k * kCols : nullptr;
      for (int64_t row0 = 0; row0 < p.m; row0 += kRows) {
        const int count = static_cast<int>(std::min<int64_t>(kRows, p.m - row0));
        if (row0 == 0) rows<F, true>(p, block, row0, count, nullptr);
        else rows<F, false>(p, block, row0, count, row0 == kRows ? next : nullptr);
      }
    }
  });
}

// Depths a 32-bit lane holds for a weight of this dtype; 0 where this build has no kernel for it.
int64_t depth_of(at::ScalarType dtype) {
  if (dtype == at::kFloat) return Float32::kDepth;
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  if (dtype == at::kBFloat16) return BFloat16::kDepth;
#elif defined(LORA_SERVE_WIDENS_BF16)
  if (dtype == at::kBFloat16) return Float32WithBFloat16Weights::kDepth;
#endif
  return 0;
}

// The dtype of the rows a packed weight of this dtype multiplies: its own, or float32 for bf16 weights widened.
at::ScalarType rows_dtype(at::ScalarType weight_dtype) {
#if defined(LORA_SERVE_WIDENS_BF16)
  if (weight_dtype == at::kBFloat16) return at::kFloat;
#endif
  return weight_dtype;
}

// fn(kind) with the kernel kind (its struct, default-constructed) for rows of x against a weight packed as `packed`.
template <typename Fn>
void with_kind(const at::Tensor& x, const at::Tensor& packed, Fn&& fn) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  if (x.scalar_type() == at::kBFloat16) return fn(BFloat16{});
#elif defined(LORA_SERVE_WIDENS_BF16)
  if (packed.scalar_type() == at::kBFloat16) return fn(Float32WithBFloat16Weights{});
#endif
  fn(Float32{});
}

}  // namespace lora_serve::simd_linear_detail

bool simd_linear_usable(const at::Tensor& weight) {
  using namespace lora_serve::simd_linear_detail;
  const int64_t depth = depth_of(weight.scalar_type());
  return weight.dim() == 2 && depth > 0 && weight.size(0) % kCols == 0 && weight.size(1) % depth == 0;
}

bool simd_linear_widens_bf16() {
#if defined(LORA_SERVE_WIDENS_BF16)
  return true;
#else
  return false;
#endif
}

at::Tensor simd_pack_linear_weight(const at::Tensor& weight) {
  using namespace lora_serve::simd_linear_detail;
  TORCH_CHECK(simd_linear_usable(weight), "simd_pack_linear_weight takes a 2-D weight [out, in] in float32 or "
              "bf16 with out a multiple of ", kCols, " and in a multiple of its depths per lane, not ", weight.sizes(),
              " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), depth = depth_of(weight.scalar_type());
  if (weight.scalar_type() == at::kBFloat16 && simd_linear_widens_bf16()) {
    // Float32WithBFloat16Weights' order, a column's two vectors in one word: [n / C, 2, lanes, k] ->
    // [n / C, k, lanes, 2], viewed as [n / C, k, C, 1]
    return weight.reshape({n / kCols, 2, kCols / 2, k}).permute({0, 3, 2, 1}).contiguous()
        .reshape({n / kCols, k, kCols, 1});
  }
  // [n / C, C, k / depth, depth] -> [n / C, k / depth, C, depth]
  return weight.reshape({n / kCols, kCols, k / depth, depth}).transpose(1, 2).contiguous();
}

at::Tensor simd_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  using namespace lora_serve::simd_linear_detail;
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kCols
              && x.scalar_type() == rows_dtype(packed.scalar_type())
              && depth_of(packed.scalar_type()) == packed.size(3),
              "simd_linear takes 2-D x and a weight from simd_pack_linear_weight, x in the weight's dtype (float32 "
              "for a bf16 weight where the build has no bf16 dot products), not ", x.scalar_type(), " x against a ",
              packed.scalar_type(), " weight");
  TORCH_CHECK(packed.size(1) * packed.size(3) == x.size(1), "simd_linear: x has ", x.size(1),
              " features, the packed weight takes ", packed.size(1) * packed.size(3));
  const int64_t n = packed.size(0) * kCols;
  const at::Tensor bias32 = lora_serve::float32_bias(bias, n, "simd_linear");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = x.new_empty({x.size(0), n});
  with_kind(x, packed, [&](auto kind) { run<decltype(kind)>(xc, packed, bias32, y); });
  return y;
}

at::Tensor grouped_simd_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets) {
  using namespace lora_serve::simd_linear_detail;
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 5 && packed.size(3) == kCols
              && x.scalar_type() == rows_dtype(packed.scalar_type())
              && depth_of(packed.scalar_type()) == packed.size(4)
              && packed.size(2) * packed.size(4) == x.size(1),
              "grouped_simd_linear takes 2-D x and experts' weights [E, ...] each from simd_pack_linear_weight, x "
              "in the weights' dtype with their features, not ", x.sizes(), " ", x.scalar_type(), " x against ",
              packed.sizes(), " ", packed.scalar_type());
  const int64_t experts = packed.size(0);
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == experts + 1 && offsets.scalar_type() == at::kLong
              && offsets.is_contiguous(), "grouped_simd_linear: offsets are int64 [experts + 1], not ",
              offsets.sizes(), " ", offsets.scalar_type());
  const int64_t* bounds = offsets.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] == 0 && bounds[experts] == x.size(0) && std::is_sorted(bounds, bounds + experts + 1),
              "grouped_simd_linear: offsets must rise from 0 to x's ", x.size(0), " rows");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = x.new_empty({x.size(0), packed.size(1) * kCols});
  with_kind(x, packed, [&](auto kind) { run_grouped<decltype(kind)>(xc, packed, bounds, y); });
  return y;
}

#else

bool simd_linear_usable(const at::Tensor&) { return false; }

bool simd_linear_widens_bf16() { return false; }

at::Tensor simd_pack_linear_weight(const at::Tensor&) { TORCH_CHECK(false, "this build has neither AVX-512 nor AVX2"); }

at::Tensor simd_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "this build has neither AVX-512 nor AVX2");
}

at::Tensor grouped_simd_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "this build has neither AVX-512 nor AVX2");
}

#endif

#undef LORA_SERVE_WIDENS_BF16
