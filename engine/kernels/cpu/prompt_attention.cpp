// Causal attention of one sequence's prompt chunk in bf16, flash-style, with AVX-512 BF16 dot products (vdpbf16ps):
// the chunk's queries are the last T of the sequence's positions, its keys and values are read from the paged cache
// (this step's already written), so a chunk after cached tokens is one call like a fresh prompt.
//
// Why: on a CPU with AVX-512 BF16 but no AMX (AMD EPYC Zen 4), PyTorch's flash kernel for CPU took 39-40 ms for one
// layer of a 2,000-token SmolLM2 prompt (about 0.12 TFLOP/s of the 0.41 a bf16 matmul reaches on the same 2
// cores), 54% of the prompt's prefill. Where AMX exists its kernel uses it (9 ms), and the engine keeps it there.
//
// Layout: each KV head's keys are first packed, 32 keys a step, as [step][dim pair][key] dwords (a dword = two bf16
// of one key's adjacent dims), and its values as [step][key pair][dim] dwords (a dword = one dim of two adjacent
// keys): the pairs vdpbf16ps multiplies and adds. Scores of a query row for 32 keys are then 2 vectors accumulated
// over the dim pairs, each query dword broadcast; the row's output accumulates over key pairs the same way, with its
// probabilities (rounded to bf16, as PyTorch's kernel rounds them for its second matmul) broadcast. No horizontal
// sums, no transposes inside the loops. A work item is (KV head, tile of 16 queries): the query heads that share
// the KV head are its rows (48 for SmolLM2), scored against each packed step once; softmax is online in float32
// (running max and sum per row), and only the steps up to the tile's last position are read. Tiles are dealt to the
// threads alternately from both ends of the prompt, since causal tiles near the end cost the most.

#include "float_types.h"
#include "ops.h"
#include "prompt_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace lora_serve::prompt_attention_detail {

constexpr int64_t KS = 32;     // keys per step: two vectors of scores
constexpr int64_t TQ = 16;     // queries per work item
constexpr int64_t ROWS = 8;    // query rows scored together: 16 accumulators (one layer of a 2,000-token prompt on an
                               // AMD EPYC: 9.5 ms against 10.3 with 4 rows)
constexpr int64_t AROWS = 4;   // rows whose outputs accumulate together (their accumulators stay in registers)

using Shape = lora_serve::PromptShape;

inline __m512 dot(__m512 acc, __m512i a, uint32_t b) {
  const __m512i bb = _mm512_set1_epi32(static_cast<int>(b));
  return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(a), reinterpret_cast<const __m512bh&>(bb));
}

// One KV head's keys as [step][pair][KS] and values as [step][KS / 2][d] dwords; positions past the context are 0.
void pack(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, const Shape& s, int64_t h,
          uint32_t* kp, uint32_t* vp) {
  std::fill(kp, kp + s.steps * s.pairs * KS, 0u);
  std::fill(vp, vp + s.steps * KS / 2 * s.d, 0u);
  for (int64_t key = 0; key < s.context; ++key) {
    const int64_t row = ((h * s.blocks + table[key / s.block_size]) * s.block_size + key % s.block_size) * s.d;
    const auto* k32 = reinterpret_cast<const uint32_t*>(k_cache + row);
    uint32_t* kdst = kp + (key / KS) * s.pairs * KS + key % KS;
    for (int64_t p = 0; p < s.pairs; ++p) kdst[p * KS] = k32[p];
    auto* vdst = reinterpret_cast<uint16_t*>(vp + (key / KS) * (KS / 2) * s.d + (key % KS / 2) * s.d) + key % 2;
    for (int64_t c = 0; c < s.d; ++c) vdst[2 * c] = v_cache[row + c];
  }
}

// Scores of `rows` (<= ROWS) query rows against one packed step: scores[r][KS], scaled.
template <int64_t R>
void score(const uint32_t* const* q32, const uint32_t* ks, const Shape& s, float* scores) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < s.pairs; ++p) {
    const __m512i k0 = _mm512_loadu_si512(ks + p * KS), k1 = _mm512_loadu_si512(ks + p * KS + 16);
    for (int64_t r = 0; r < R; ++r) {
      acc[r][0] = dot(acc[r][0], k0, q32[r][p]);
      acc[r][1] = dot(acc[r][1], k1, q32[r][p]);
    }
  }
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t r = 0; r < R; ++r) {
    _mm512_storeu_ps(scores + r * KS, _mm512_mul_ps(acc[r][0], scale));
    _mm512_storeu_ps(scores + r * KS + 16, _mm512_mul_ps(acc[r][1], scale));
  }
}

// out rows += probabilities (bf16 pairs, [r][KS / 2]) x one packed step of values; out [r][d] float32.
template <int64_t R, int64_t DV>
void accumulate(const uint32_t* probs, const uint32_t* vs, float* out) {
  __m512 acc[R][DV];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < DV; ++j) acc[r][j] = _mm512_loadu_ps(out + r * DV * 16 + j * 16);
  for (int64_t kp = 0; kp < KS / 2; ++kp) {
    for (int64_t j = 0; j < DV; ++j) {
      const __m512i v = _mm512_loadu_si512(vs + kp * DV * 16 + j * 16);
      for (int64_t r = 0; r < R; ++r) acc[r][j] = dot(acc[r][j], v, probs[r * KS / 2 + kp]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < DV; ++j) _mm512_storeu_ps(out + r * DV * 16 + j * 16, acc[r][j]);
}

struct Rows {  // a tile's per-row state, in scratch memory kept across the thread's items
  std::vector<const uint32_t*> q;
  std::vector<int64_t> position;
  std::vector<float> max, sum, scores, out;
  std::vector<uint32_t> probs;
};

// Online softmax of one row's scores for the step at `first` key: masks keys past the row's position, rescales the
// row's output and sum, and leaves the probabilities as bf16 pairs.
void softmax_row(float* scores, int64_t first, int64_t position, float& max, float& sum, float* out, int64_t d,
                 uint32_t* probs) {
  for (int64_t j = std::max<int64_t>(0, position + 1 - first); j < KS; ++j)
    scores[j] = -std::numeric_limits<float>::infinity();
  const __m512 s0 = _mm512_loadu_ps(scores), s1 = _mm512_loadu_ps(scores + 16);
  const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  const float new_max = std::max(max, step_max);
  const __m512 m = _mm512_set1_ps(new_max);
  const __m512 e0 = at::vec::Vectorized<float>(_mm512_sub_ps(s0, m)).exp_u20();
  const __m512 e1 = at::vec::Vectorized<float>(_mm512_sub_ps(s1, m)).exp_u20();
  const float alpha = std::exp(max - new_max);  // 0 at the first step (max = -inf)
  sum = sum * alpha + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
  max = new_max;
  if (alpha != 1.0f) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(out + c), a));
  }
  // bf16 of e0 (keys 0..15) and e1 (16..31), interleaved back into key order as pairs
  const __m512bh packed = _mm512_cvtne2ps_pbh(e1, e0);  // low 256 bits: e0's 16 keys, high: e1's
  _mm512_storeu_si512(probs, reinterpret_cast<const __m512i&>(packed));
}

template <int64_t DV>
void attend_tile(const uint16_t* q, const uint32_t* kp, const uint32_t* vp, int64_t h, int64_t t0, int64_t t1,
                 const Shape& s, Rows& w, uint16_t* out) {
  const int64_t rows = (t1 - t0) * s.group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / s.group, head = h * s.group + r % s.group;
    w.q[r] = reinterpret_cast<const uint32_t*>(q + t * s.q_stride + head * s.d);
    w.position[r] = s.context - s.t + t;
    w.max[r] = -std::numeric_limits<float>::infinity();
    w.sum[r] = 0.0f;
  }
  std::fill(w.out.begin(), w.out.begin() + rows * s.d, 0.0f);
  const int64_t last = w.position[rows - 1];
  for (int64_t step = 0; step * KS <= last; ++step) {
    const uint32_t* ks = kp + step * s.pairs * KS;
    int64_t r = 0;
    for (; r + ROWS <= rows; r += ROWS) score<ROWS>(w.q.data() + r, ks, s, w.scores.data() + r * KS);
    for (; r < rows; ++r) score<1>(w.q.data() + r, ks, s, w.scores.data() + r * KS);
    for (r = 0; r < rows; ++r)
      softmax_row(w.scores.data() + r * KS, step * KS, w.position[r], w.max[r], w.sum[r], w.out.data() + r * s.d,
                  s.d, w.probs.data() + r * KS / 2);
    const uint32_t* vs = vp + step * (KS / 2) * s.d;
    for (r = 0; r + AROWS <= rows; r += AROWS)
      accumulate<AROWS, DV>(w.probs.data() + r * KS / 2, vs, w.out.data() + r * s.d);
    for (; r < rows; ++r) accumulate<1, DV>(w.probs.data() + r * KS / 2, vs, w.out.data() + r * s.d);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / s.group, head = h * s.group + r % s.group;
    const float inv = 1.0f / w.sum[r];
    const float* o = w.out.data() + r * s.d;
    uint16_t* dst = out + (t * s.heads + head) * s.d;
    for (int64_t c = 0; c < s.d; ++c) dst[c] = c10::BFloat16(o[c] * inv).x;
  }
}

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
         const Shape& s, at::Tensor& out) {
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t k_size = s.steps * s.pairs * KS, v_size = s.steps * (KS / 2) * s.d;
  std::vector<uint32_t> kp(s.kv_heads * k_size), vp(s.kv_heads * v_size);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) pack(kc, vc, table, s, h, kp.data() + h * k_size, vp.data() + h * v_size);
  });
  const int64_t tiles = (s.t + TQ - 1) / TQ;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, tiles * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Rows w;
    const int64_t rows = TQ * s.group;
    w.q.resize(rows);
    w.position.resize(rows);
    w.max.resize(rows);
    w.sum.resize(rows);
    w.scores.resize(rows * KS);
    w.out.resize(rows * s.d);
    w.probs.resize(rows * KS / 2);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t z = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;  // both ends in turn: balanced halves
      const int64_t t0 = tile * TQ, t1 = std::min(s.t, t0 + TQ);
      const uint32_t* kh = kp.data() + h * k_size;
      const uint32_t* vh = vp.data() + h * v_size;
      if (s.d == 64) attend_tile<4>(qp, kh, vh, h, t0, t1, s, w, op);
      else attend_tile<8>(qp, kh, vh, h, t0, t1, s, w, op);
    }
  });
}

}  // namespace lora_serve::prompt_attention_detail

bool bf16_prompt_attention() { return true; }

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, int64_t context_len) {
  using namespace lora_serve::prompt_attention_detail;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be [T, heads, D] and the caches [kv_heads, blocks, block_size, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "prompt_attention takes bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous within a token");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "head dim must be 64 or 128");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of the KV heads");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong, "block_table must be int64 [blocks]");
  TORCH_CHECK(context_len >= q.size(0) && context_len <= block_table.size(0) * k_cache.size(2),
              "context_len must cover the queries and fit the block table");
  const auto table = block_table.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t blocks_used = (context_len + k_cache.size(2) - 1) / k_cache.size(2);
  for (int64_t b = 0; b < blocks_used; ++b)
    TORCH_CHECK(tp[b] >= 0 && tp[b] < k_cache.size(1), "block ", tp[b], " is outside the cache");
  lora_serve::PromptShape s{q.size(0), q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), q.size(2),
                            q.size(2) / 2, context_len,
          (context_len + KS - 1) / KS, k_cache.size(2), k_cache.size(1), q.stride(0),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.size(2))))};
  auto out = q.new_empty({q.size(0), q.size(1), q.size(2)});
  if (lora_serve::amx_prompt_usable(s)) lora_serve::amx_prompt_attention(q, k_cache, v_cache, tp, s, out);
  else run(q, k_cache, v_cache, tp, s, out);
  return out;
}

#else

bool bf16_prompt_attention() { return false; }

at::Tensor prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "prompt_attention needs AVX-512 BF16, which this build lacks");
}

#endif

// prompt_attention_amx.cpp's answer in either build: without AVX-512 BF16 it is false there too.
bool amx_prompt_attention() { return lora_serve::amx_prompt_tiles(); }
