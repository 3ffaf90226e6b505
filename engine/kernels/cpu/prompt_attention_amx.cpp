// Causal prompt attention in bf16 on AMX tiles (TDPBF16PS), for CPUs with AMX (Xeon 4th generation on): the
// contract of prompt_attention.cpp, which calls it.
//
// Why: PyTorch's flash kernel for CPU runs its products on AMX there, but a chunk after cached tokens took it two
// calls, a gather of the cached blocks and a merge of the two halves by their log-sum-exps, and its softmax works
// row by row. A 2,000-token SmolLM2 prompt spent 56% of its prefill in attention on 2 cores of a Xeon.
//
// Layout: the scores are computed transposed, S^T = K Q^T, 32 keys (two 16-row tiles) by 16 queries (one token
// each, of one query head), so that every per-query quantity of the online softmax (the running max and sum, the
// rescale factor) is one vector across 16 queries and every reduction over keys is vertical: no horizontal sums.
// K tiles are read straight from the cache, 16 keys of a block being 16 rows of head_dim; Q^T is packed once per
// work item as the dim pairs TDPBF16PS takes for its second operand. The output is accumulated transposed too,
// O^T += V^T P^T, with V^T packed once per KV head as [step][dim][32 keys] and P^T written as key pairs per query.
// O^T [head_dim][16 queries] stays in four tile registers from step to step at head dim 64 (in fp32 memory at
// 128), and goes through memory only to be rescaled, which the lazy running max makes rare. Probabilities are
// rounded to bf16 for the second product, as PyTorch's kernel rounds them.
//
// One layer of SmolLM2 (9 query heads, 3 KV heads, head dim 64), 2 cores of a Xeon, against SDPA's flash kernel
// as the engine called it: a fresh 2,000-token prompt 4.1-5.0 ms against 7.7-8.8; 1,000 tokens after 1,000
// cached 3.0-3.6 against 7.9-10.0; 512 tokens 0.40-0.45 against 0.8-0.9. The exponentials, ATen's exp_u20 at
// first, were a third of the time; without any, about 4 ms remain at 2,000 tokens, mostly the steps' chain of tile
// latencies (score, store, softmax, store, product) that one work item cannot overlap.

#include "prompt_attention.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include "amx.h"
#include "float_types.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace lora_serve::prompt_amx_detail {

constexpr int64_t KS = 32;  // keys per step: two score tiles
constexpr int64_t TQ = 16;  // queries per work item: the columns of a score tile
// tile registers: gcc's tile intrinsics paste their number into the instruction, so they must be literals
#define SCORE0 0
#define SCORE1 1
#define LEFT 2
#define RIGHT 3
#define OUT0 4
#define OUT1 5
#define OUT2 6
#define OUT3 7

// One step of one KV head's values as V^T, [d][KS] bf16; keys past the context are 0 (their probabilities are 0,
// and a cache slot never written may hold a NaN).
void pack_values(const uint16_t* v_head, const int64_t* table, const PromptShape& s, int64_t step, uint16_t* vt) {
  std::fill(vt, vt + s.d * KS, uint16_t{0});
  for (int64_t key = step * KS; key < std::min(s.context, step * KS + KS); ++key) {
    const uint16_t* row = v_head + (table[key / s.block_size] * s.block_size + key % s.block_size) * s.d;
    for (int64_t c = 0; c < s.d; ++c) vt[c * KS + key % KS] = row[c];
  }
}

// 2^x, x clamped at -127: a degree-4 polynomial for 2^fraction (relative error 2.6e-6, as small as ATen's
// exp_u20) scaled by 2^floor with one instruction; about half exp_u20's instructions, and the exponentials were a
// third of the kernel's time. A clamped 2^-127 is a denormal, flushed to 0 (FlushDenormals): masked keys weigh
// nothing.
inline __m512 exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f));
  const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, whole);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.013534166f), _mm512_set1_ps(0.052011471f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24144274f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.69300383f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0000026f));
  return _mm512_scalef_ps(p, whole);
}

// Denormals flushed to zero (and read as zero) while a thread runs the kernel, its previous mode restored after:
// the clamped 2^-127 of a masked key is a denormal, and arithmetic on denormals takes a microcode assist that
// made 512-token prompts a third slower.
struct FlushDenormals {
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

struct Tile {  // one work item's queries: TQ tokens of one query head, and their softmax state
  const uint16_t* q;      // the first token's row of this head
  int64_t valid, head, first_position;
  std::vector<uint32_t> qt;      // Q^T as [d / 32][16 dim pairs][TQ] dwords
  std::vector<float> scores;     // S^T [KS][TQ]
  std::vector<uint32_t> probs;   // P^T as [KS / 2 key pairs][TQ] dwords
  std::vector<float> out;        // O^T [d][TQ]
  __m512 max, sum, alpha;
  __m512i position;              // each column's position; padding columns repeat the last query's

  explicit Tile(int64_t d) : qt(d / 2 * TQ), scores(KS * TQ), probs(KS / 2 * TQ), out(d * TQ) {}
};

void pack_queries(Tile& w, const PromptShape& s) {
  std::fill(w.qt.begin(), w.qt.end(), 0u);
  for (int64_t i = 0; i < w.valid; ++i) {
    const auto* src = reinterpret_cast<const uint32_t*>(w.q + i * s.q_stride);
    for (int64_t p = 0; p < s.pairs; ++p) w.qt[(p / 16) * 16 * TQ + (p % 16) * TQ + i] = src[p];
  }
}

// S^T for the step's 32 keys into w.scores; a second block past the context is left out (masked later).
void score_step(const uint16_t* k_head, const int64_t* table, const PromptShape& s, int64_t step, Tile& w) {
  const int64_t key = step * KS;
  const uint16_t* first = k_head + (table[key / s.block_size] * s.block_size + key % s.block_size) * s.d;
  const bool second_in = key + 16 < s.context;
  const uint16_t* second = second_in ? k_head + (table[(key + 16) / s.block_size] * s.block_size +
                                                 (key + 16) % s.block_size) * s.d : first;
  _tile_zero(SCORE0);
  _tile_zero(SCORE1);
  for (int64_t c = 0; c < s.d / 32; ++c) {
    _tile_loadd(RIGHT, w.qt.data() + c * 16 * TQ, TQ * 4);
    _tile_loadd(LEFT, first + c * 32, s.d * 2);
    _tile_dpbf16ps(SCORE0, LEFT, RIGHT);
    if (!second_in) continue;
    _tile_loadd(LEFT, second + c * 32, s.d * 2);
    _tile_dpbf16ps(SCORE1, LEFT, RIGHT);
  }
  _tile_stored(SCORE0, w.scores.data(), TQ * 4);
  _tile_stored(SCORE1, w.scores.data() + 16 * TQ, TQ * 4);
}

// Online softmax of the step's scores, column by column in vectors: masks keys after each query's position, and
// leaves P^T as bf16 key pairs. A column's max moves only when the step's exceeds it by more than kLazy (in
// powers of 2), as FlashAttention-4 does: the probabilities are then up to 2^kLazy, harmless in fp32
// sums and bf16 products, and the O^T rescale (alpha < 1) becomes rare after the first step. Returns whether
// any column needs it; its factors are in w.alpha.
bool softmax_step(const PromptShape& s, int64_t step, Tile& w) {
  constexpr float kLazy = 8.0f;
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
                                             _mm512_set1_ps(kLazy), _CMP_GT_OQ);
  if (grown) {
    const __m512 new_max = _mm512_mask_mov_ps(w.max, grown, top);
    w.alpha = exp2(_mm512_mul_ps(_mm512_sub_ps(w.max, new_max), scale));  // 1 where unchanged
    w.sum = _mm512_mul_ps(w.sum, w.alpha);
    w.max = new_max;
  }
  const __m512 shift = _mm512_mul_ps(w.max, scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t k = 0; k < KS; ++k) {
    x[k] = exp2(_mm512_fmsub_ps(x[k], scale, shift));
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

void rescale(const PromptShape& s, Tile& w) {
  for (int64_t c = 0; c < s.d; ++c)
    _mm512_storeu_ps(w.out.data() + c * TQ, _mm512_mul_ps(_mm512_loadu_ps(w.out.data() + c * TQ), w.alpha));
}

// The four O^T tiles of a 64-dim head, kept in tile registers from step to step.
void store_out(Tile& w) {
  _tile_stored(OUT0, w.out.data(), TQ * 4);
  _tile_stored(OUT1, w.out.data() + 16 * TQ, TQ * 4);
  _tile_stored(OUT2, w.out.data() + 32 * TQ, TQ * 4);
  _tile_stored(OUT3, w.out.data() + 48 * TQ, TQ * 4);
}

void load_out(Tile& w) {
  _tile_loadd(OUT0, w.out.data(), TQ * 4);
  _tile_loadd(OUT1, w.out.data() + 16 * TQ, TQ * 4);
  _tile_loadd(OUT2, w.out.data() + 32 * TQ, TQ * 4);
  _tile_loadd(OUT3, w.out.data() + 48 * TQ, TQ * 4);
}

// O^T += V^T P^T for the step, head dim 64: into the resident tiles.
void accumulate_resident(const uint16_t* vt_step, Tile& w) {
  _tile_loadd(RIGHT, w.probs.data(), TQ * 4);
  _tile_loadd(LEFT, vt_step, KS * 2);
  _tile_dpbf16ps(OUT0, LEFT, RIGHT);
  _tile_loadd(LEFT, vt_step + 16 * KS, KS * 2);
  _tile_dpbf16ps(OUT1, LEFT, RIGHT);
  _tile_loadd(LEFT, vt_step + 32 * KS, KS * 2);
  _tile_dpbf16ps(OUT2, LEFT, RIGHT);
  _tile_loadd(LEFT, vt_step + 48 * KS, KS * 2);
  _tile_dpbf16ps(OUT3, LEFT, RIGHT);
}

// O^T += V^T P^T for the step, any head dim: through memory, 16 dims a tile.
void accumulate_in_memory(const uint16_t* vt_step, const PromptShape& s, Tile& w) {
  _tile_loadd(RIGHT, w.probs.data(), TQ * 4);
  for (int64_t c = 0; c < s.d; c += 16) {
    _tile_loadd(OUT0, w.out.data() + c * TQ, TQ * 4);
    _tile_loadd(LEFT, vt_step + c * KS, KS * 2);
    _tile_dpbf16ps(OUT0, LEFT, RIGHT);
    _tile_stored(OUT0, w.out.data() + c * TQ, TQ * 4);
  }
}

// O^T / sum, rounded to bf16 a row of 16 queries at a time, then written back in [token, head, dim] order.
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

void attend(const uint16_t* q, const uint16_t* k_head, const uint16_t* vt, const int64_t* table,
            const PromptShape& s, int64_t head, int64_t t0, Tile& w, uint16_t* out) {
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
  pack_queries(w, s);
  const bool resident = s.d == 64;
  if (resident) load_out(w);
  const int64_t last = w.first_position + w.valid - 1;
  for (int64_t step = 0; step * KS <= last; ++step) {
    score_step(k_head, table, s, step, w);
    const bool rescaled = softmax_step(s, step, w);
    if (rescaled && resident) store_out(w);
    if (rescaled) rescale(s, w);
    if (rescaled && resident) load_out(w);
    if (resident) accumulate_resident(vt + step * s.d * KS, w);
    else accumulate_in_memory(vt + step * s.d * KS, s, w);
  }
  if (resident) store_out(w);
  write_out(w, s, t0, out);
}

}  // namespace lora_serve::prompt_amx_detail

namespace lora_serve {

bool amx_prompt_tiles() { return tiles_granted(); }

void amx_prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const int64_t* table, const PromptShape& s, at::Tensor& out) {
  using namespace prompt_amx_detail;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t v_size = s.steps * s.d * KS;
  std::vector<uint16_t> vt(s.kv_heads * v_size);
  at::parallel_for(0, s.kv_heads * s.steps, 8, [&](int64_t begin, int64_t end) {  // (head, step): balanced
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / s.steps, step = i % s.steps;
      pack_values(vc + h * s.blocks * s.block_size * s.d, table, s, step, vt.data() + h * v_size + step * s.d * KS);
    }
  });
  const int64_t tiles = (s.t + TQ - 1) / TQ;
  at::parallel_for(0, tiles * s.heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    configure_tiles(OUT3 + 1);
    Tile w(s.d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t z = item / s.heads, head = item % s.heads, h = head / s.group;
      const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;  // both ends in turn: balanced halves
      attend(qp, kc + h * s.blocks * s.block_size * s.d, vt.data() + h * v_size, table, s, head, tile * TQ, w, op);
    }
    _tile_release();
  });
}

}  // namespace lora_serve

#undef SCORE0
#undef SCORE1
#undef LEFT
#undef RIGHT
#undef OUT0
#undef OUT1
#undef OUT2
#undef OUT3

#else

namespace lora_serve {

bool amx_prompt_tiles() { return false; }

void amx_prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int64_t*,
                          const PromptShape&, at::Tensor&) {
  TORCH_CHECK(false, "this build has no AMX");
}

}  // namespace lora_serve

#endif
