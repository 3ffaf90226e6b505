// The work-item steps both bf16 prompt-attention kernels share (prompt_tile.h says what a tile is).

#if defined(__AVX512BF16__) && defined(__AVX512F__)

#include "prompt_tile.h"
#include "work_pool.h"

#include <algorithm>

namespace lora_serve::prompt_tile_detail {

using namespace lora_serve::prompt_tile;

// 2^x, x clamped at -127: a degree-4 polynomial for 2^fraction (relative error 2.6e-6, as small as ATen's
// exp_u20) scaled by 2^floor(x), which vscalefps takes from x itself; the fraction is one vreduceps. It takes far fewer
// instructions than exp_u20, and the exponentials are a large share of the AMX kernel's time. A clamped 2^-127
// is a denormal, flushed to 0 (FlushDenormals): masked keys weigh nothing.
inline __m512 exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // x - floor(x)
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.013534166f), _mm512_set1_ps(0.052011471f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24144274f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.69300383f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0000026f));
  return _mm512_scalef_ps(p, x);
}

// One step of one KV head's values as V^T, [d][KS] bf16; keys past the context are 0 (their probabilities are 0,
// and a cache slot never written may hold a NaN).
void pack_values(const uint16_t* v_head, const int64_t* table, const PromptShape& s, int64_t step, uint16_t* vt) {
  std::fill(vt, vt + s.d * KS, uint16_t{0});
  for (int64_t key = step * KS; key < std::min(s.context, step * KS + KS); ++key) {
    const uint16_t* row = v_head + cache_row(s, table, key);
    for (int64_t c = 0; c < s.d; ++c) vt[c * KS + key % KS] = row[c];
  }
}

// One step of one KV head's keys as rows, [KS][d] bf16; keys past the context are 0.
void pack_keys(const uint16_t* k_head, const int64_t* table, const PromptShape& s, int64_t step, uint16_t* rows) {
  std::fill(rows, rows + KS * s.d, uint16_t{0});
  for (int64_t key = step * KS; key < std::min(s.context, step * KS + KS); ++key) {
    const uint16_t* row = k_head + cache_row(s, table, key);
    std::copy(row, row + s.d, rows + (key % KS) * s.d);
  }
}

// pack(cache head, table, shape, step, out) for every (KV head, step) by the threads, into [kv_heads][steps][d * KS]:
// (head, step) items balance the threads where a few heads would not.
template <typename Pack>
std::vector<uint16_t> pack_all(const uint16_t* cache, const int64_t* table, const PromptShape& s, Pack pack) {
  const int64_t step_size = s.d * KS, head_size = s.steps * step_size;
  std::vector<uint16_t> packed(s.kv_heads * head_size);
  lora_serve::parallel_for(0, s.kv_heads * s.steps, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / s.steps, step = i % s.steps;
      pack(cache + h * s.blocks * s.block_size * s.d, table, s, step, packed.data() + h * head_size + step * step_size);
    }
  });
  return packed;
}

}  // namespace lora_serve::prompt_tile_detail

namespace lora_serve::prompt_tile {

std::vector<uint16_t> pack_all_values(const uint16_t* v_cache, const int64_t* table, const PromptShape& s) {
  return prompt_tile_detail::pack_all(v_cache, table, s, prompt_tile_detail::pack_values);
}

std::vector<uint16_t> pack_all_keys(const uint16_t* k_cache, const int64_t* table, const PromptShape& s) {
  return prompt_tile_detail::pack_all(k_cache, table, s, prompt_tile_detail::pack_keys);
}

void begin_tile(const uint16_t* q, const PromptShape& s, int64_t head, int64_t t0, Tile& w) {
  w.q = q + t0 * s.q_stride + head * s.d;
  w.head = head;
  w.valid = std::min(TQ, s.t - t0);
  w.first_position = s.context - s.t + t0;
  const __m512i column = _mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(w.valid - 1)));
  w.position = _mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(w.first_position)));
  w.max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  w.sum = _mm512_setzero_ps();
  std::fill(w.out.begin(), w.out.end(), 0.0f);
  std::fill(w.qt.begin(), w.qt.end(), 0u);
  for (int64_t i = 0; i < w.valid; ++i) {
    const auto* src = reinterpret_cast<const uint32_t*>(w.q + i * s.q_stride);
    for (int64_t p = 0; p < s.pairs; ++p) w.qt[p * TQ + i] = src[p];
  }
}

bool softmax_step(const PromptShape& s, int64_t step, float lazy, Tile& w) {
  const float inf = std::numeric_limits<float>::infinity();
  const bool masked = step * KS + KS - 1 > w.first_position;
  __m512 x[KS];
  __m512 top = _mm512_set1_ps(-inf);
  const float* scores = w.scores.data();
  for (int64_t k = 0; k < KS; ++k) {
    x[k] = _mm512_loadu_ps(scores + k * TQ);
    if (masked) {
      const __mmask16 later = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(step * KS + k), w.position);
      x[k] = _mm512_mask_mov_ps(x[k], later, _mm512_set1_ps(-inf));
    }
    top = _mm512_max_ps(top, x[k]);
  }
  const __m512 scale = _mm512_set1_ps(s.scale * 1.442695041f);  // log2(e): exponents in powers of 2
  const __mmask16 grown = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(top, w.max), scale),
                                             _mm512_set1_ps(lazy), _CMP_GT_OQ);
  if (grown) {
    const __m512 new_max = _mm512_mask_mov_ps(w.max, grown, top);
    w.alpha = prompt_tile_detail::exp2(_mm512_mul_ps(_mm512_sub_ps(w.max, new_max), scale));  // 1 where unchanged
    w.sum = _mm512_mul_ps(w.sum, w.alpha);
    w.max = new_max;
  }
  const __m512 shift = _mm512_mul_ps(w.max, scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t k = 0; k < KS; ++k) {
    x[k] = prompt_tile_detail::exp2(_mm512_fmsub_ps(x[k], scale, shift));
    total = _mm512_add_ps(total, x[k]);
  }
  w.sum = _mm512_add_ps(w.sum, total);
  // key pair (2j, 2j + 1) of query i is dword i of row j: bf16 of both, interleaved
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t j = 0; j < KS / 2; ++j) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(x[2 * j + 1], x[2 * j]);
    _mm512_storeu_si512(w.probs.data() + j * TQ,
                        _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(pair)));
  }
  return grown && step > 0;  // at the first step O^T is still 0
}

void write_out(Tile& w, const PromptShape& s, int64_t t0, uint16_t* out) {
  const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), w.sum);
  auto* rounded = reinterpret_cast<uint16_t*>(w.qt.data());  // Q^T is done with: d x TQ bf16 fit in its place
  for (int64_t c = 0; c < s.d; ++c) {
    const __m256bh row = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.out.data() + c * TQ), inverse));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + c * TQ), reinterpret_cast<const __m256i&>(row));
  }
  for (int64_t i = 0; i < w.valid; ++i) {
    uint16_t* dst = out + ((t0 + i) * s.heads + w.head) * s.d;
    for (int64_t c = 0; c < s.d; ++c) dst[c] = rounded[c * TQ + i];
  }
}

}  // namespace lora_serve::prompt_tile

#endif
