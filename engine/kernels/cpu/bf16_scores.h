// Dot products of one bf16 row against up to 16 bf16 rows with AVX-512 BF16's dot product (vdpbf16ps), read as they
// are stored, with no widening to float32 and no transpose: attention scores of a query against a cache block of 16
// keys (paged_attention.cpp), and the LoRA shrink of a token against its slot's A columns (lora.cpp).
//
// Each product of two bf16 values is exact in float32 and vdpbf16ps adds them in float32, as the widened path
// does (only the order of the additions differs). Per token the dot products leave a vector of 16 partial sums;
// the 16 tokens' vectors are then summed lane-wise into one vector of 16 scores by a transpose-and-add tree
// (45 instructions for the 16 tokens). In the paged attention kernel this takes the place of widening and
// transposing each block to float32 and 64 FMAs per query head (measurements: docs/cpu_kernels.md).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace lora_serve {

constexpr bool kBf16Dot = true;

// out[i] = sum of the 16 lanes of v[i], for i < 16.
inline __m512 sum_lanes_16(const __m512 v[16]) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of each of 4 vectors
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// out[i] = dot(x, rows[i]) for i < count <= 16: x and each row hold d bf16 values (d % 32 == 0), rows d apart.
inline void bf16_row_dots(const c10::BFloat16* x, const c10::BFloat16* rows, int64_t count, int64_t d, float* out) {
  __m512 sums[16];
  for (int t = 0; t < 16; ++t) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; t < count && c < d; c += 32) {
      const __m512i xv = _mm512_loadu_si512(x + c);
      const __m512i rv = _mm512_loadu_si512(rows + t * d + c);
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(xv), reinterpret_cast<const __m512bh&>(rv));
    }
    sums[t] = acc;
  }
  alignas(64) float all[16];
  _mm512_store_ps(all, sum_lanes_16(sums));
  for (int64_t t = 0; t < count; ++t) out[t] = all[t];
}

// scores[t] = scale * dot(q, keys[t]) for the block's 16 tokens; q and each key row hold d values, d % 32 == 0.
inline void bf16_block_scores(const c10::BFloat16* q, const c10::BFloat16* keys, int64_t d, float scale,
                              float* scores) {
  bf16_row_dots(q, keys, 16, d, scores);
  _mm512_storeu_ps(scores, _mm512_mul_ps(_mm512_loadu_ps(scores), _mm512_set1_ps(scale)));
}

}  // namespace lora_serve

#else

namespace lora_serve {

constexpr bool kBf16Dot = false;

inline void bf16_row_dots(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, float*) {}

inline void bf16_block_scores(const c10::BFloat16*, const c10::BFloat16*, int64_t, float, float*) {}

}  // namespace lora_serve

#endif
