// Attention over the paged KV cache on CPU, reading every block in place: decode tokens and short prompt chunks
// of many sequences in one call.
//
// One work item per (tile of up to TILE consecutive queries of one sequence, KV head): the query heads that
// share the KV head, for every query of the tile, are scored together, so each cached K/V row is read and
// widened once per tile. A sequence's blocks are walked through its block table; in the engine's head-major
// cache ([kv_heads, blocks, block_size, head_dim]) one block of one KV head is a contiguous [block_size,
// head_dim] run. Queries are causal: the query at position p sees keys 0..p, its chunk's own keys included
// (they are written before the call). A decode of up to kTwoPassTokens takes two passes over its blocks: every
// score of its context into a per-thread row, one softmax, then the weighted values (decode_in_two_passes). Longer
// decodes and prompt tiles fold block by block with an online softmax (running max and sum in float32), so nothing
// of size context is materialised. No block is ever copied. With AVX-512 BF16, bf16 keys are scored as they are stored
// (bf16_scores.h); otherwise a block of keys is widened to float32 and transposed once for the tile. Values are
// widened to float32 a block at a time, and each value row is loaded once for the query heads that share it.
// Products and sums are float32 in every dtype. Each block's successor is prefetched while it is scored. Each of
// these choices (the prefetch, scoring in bf16, the heads' values together) makes a decode faster
// (measurements: docs/cpu_kernels.md).
//
// A decode token is a tile of one query, so decodes and short chunks share the call, where attending each
// sequence on its own takes several small ops per sequence and layer. Chunks of 64 tokens or more go to SDPA's
// flash kernel (engine/layers/attention.py): this kernel's float32 FMAs reach only a fraction of its bf16 rate there.
//
// In float32, a decode's keys are scored where they are stored (score_rows) and the values read in place, and the
// accumulation runs in passes over the head dim that keep every accumulator in a register: copying and transposing
// each block for its single query, and spilling a head's accumulators, cost more.
//
// A bf16 model that computes in float32 (a CPU without bf16 matrix math) keeps its cache in bf16: float32 queries
// then read the bf16 keys and values in place, widened as they are loaded (load_float), on the float32 decode path.
// A long-context decode then reads half the bytes of a float32 cache.

#include "bf16_scores.h"
#include "float_types.h"
#include "ops.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace lora_serve::paged_attention_detail {

constexpr int64_t TILE = 16;  // queries per work item

struct Shape {
  int64_t heads;       // query heads
  int64_t q_stride;    // elements between one query token's heads and the next's (q may be a view)
  int64_t group;       // query heads per KV head
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;  // blocks per KV head in the cache
  int64_t table_width; // entries per row of the block table
  float scale;
  float softcap;  // Gemma 2's attention logit soft-capping: scores become softcap * tanh(score / softcap); 0: none
  int64_t window;  // a sliding window (Gemma 2's and 3's local layers): the query at p sees keys p - window + 1 .. p;
                   // 0: every earlier key
  // floats per head in Scratch::probs: the call's longest two-pass decode, in whole blocks, not kTwoPassTokens:
  // every chunk's scratch is zeroed, and rows of kTwoPassTokens make a call of short decodes slower
  int64_t probs_stride;
};

// Per-thread scratch: the tile's scaled queries and accumulators (one row per query and head of the group), one
// block of K widened and transposed ([head_dim, block_size]) and of V widened ([block_size, head_dim]), the scores of
// one query's group of heads for that block.
struct Scratch {
  std::vector<float> query, acc, keys_t, values, rows, scores, best, total;
  std::vector<float> probs;  // a decode's scores, then weights, over its whole context (decode_in_two_passes)
  explicit Scratch(const Shape& s)
      : query(TILE * s.group * s.head_dim), acc(TILE * s.group * s.head_dim), keys_t(s.head_dim * s.block_size),
        values(s.block_size * s.head_dim), rows(s.block_size * s.head_dim), scores(s.group * s.block_size),
        best(TILE * s.group), total(TILE * s.group), probs(s.group * s.probs_stride) {}
};

// Queries [first, first + count) of one sequence, at positions from `position` on.
struct Tile {
  int64_t seq;
  int64_t first;     // the tile's first query: its row in q and out
  int64_t count;
  int64_t position;  // the first query's position in its sequence
};

// Asks the memory system for n values at p (one request per 64-byte line), without waiting for them: the blocks of a
// sequence are scattered, so the hardware prefetcher cannot guess the next one.
template <typename scalar_t>
inline void prefetch(const scalar_t* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < n * static_cast<int64_t>(sizeof(scalar_t)); offset += 64)
    __builtin_prefetch(bytes + offset);
}

// The first key the query at `position` sees: its sliding window's first, or 0.
inline int64_t first_key(int64_t position, const Shape& s) {
  return s.window > 0 ? std::max<int64_t>(0, position - s.window + 1) : 0;
}

// Scores of the `hidden` keys at a block's front, before a query's window: -inf, like the keys past its position.
inline void hide_front(float* scores, int64_t hidden) {
  for (int64_t t = 0; t < hidden; ++t) scores[t] = -std::numeric_limits<float>::infinity();
}

// Gemma 2's soft-capped scores, cap * tanh(score / cap) as transformers computes them, for the `rows` visible
// tokens (the rest are masked after it); nothing where cap is 0. Scalar: only such models pay for it.
inline void soft_cap(float* scores, int64_t rows, float cap) {
  if (cap == 0.f) return;
  for (int64_t t = 0; t < rows; ++t) scores[t] = std::tanh(scores[t] / cap) * cap;
}

// Scores of query head g against the block's tokens: vectors along the tokens, one FMA per head dimension
// (no horizontal sum per token), in four independent chains; tokens past `rows` score -inf.
inline void score_block(Scratch& w, const Shape& s, int64_t g, int64_t rows, float* scores) {
  const float* q = w.query.data() + g * s.head_dim;
  const float* keys = w.keys_t.data();
  const int64_t width = s.block_size;
  for (int64_t t = 0; t < width; t += Vec::size()) {
    Vec sum[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int64_t i = 0; i < s.head_dim; i += 4)
      for (int64_t j = 0; j < 4; ++j)
        sum[j] = at::vec::fmadd(Vec(q[i + j]), Vec::loadu(keys + (i + j) * width + t), sum[j]);
    ((sum[0] + sum[1]) + (sum[2] + sum[3])).store(scores + t);
  }
  soft_cap(scores, rows, s.softcap);
  for (int64_t t = rows; t < width; ++t) scores[t] = -std::numeric_limits<float>::infinity();
}

// Scores of one query's heads of the group (the first group rows of w.query) against a block's keys as they are
// stored (float32, or bf16/fp16 widened as they are loaded): a dot product per key and head, block_size apart in
// `scores` (-inf past `rows`). A float32 decode scores this way rather than copying and transposing each block for
// a single query.
template <typename cache_t>
inline void score_rows(const Scratch& w, const Shape& s, const cache_t* keys, int64_t rows, float* scores,
                       int64_t head_stride) {
  const int64_t d = s.head_dim, whole = d - d % Vec::size();
  for (int64_t g = 0; g < s.group; ++g) {
    const float* q = w.query.data() + g * d;
    float* out = scores + g * head_stride;
    for (int64_t t = 0; t < rows; t += 4) {  // 4 keys: 4 independent chains of FMAs, each q vector loaded once
      const int64_t n = std::min<int64_t>(4, rows - t);
      Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
      for (int64_t i = 0; i < whole; i += Vec::size()) {
        const Vec qv = Vec::loadu(q + i);
        for (int64_t k = 0; k < n; ++k) acc[k] = at::vec::fmadd(qv, load_float(keys + (t + k) * d + i), acc[k]);
      }
      for (int64_t k = 0; k < n; ++k) {
        float sum = acc[k].reduce_add();
        for (int64_t i = whole; i < d; ++i) sum += q[i] * static_cast<float>(keys[(t + k) * d + i]);
        out[t + k] = sum;
      }
    }
    soft_cap(out, rows, s.softcap);
    for (int64_t t = rows; t < s.block_size; ++t) out[t] = -std::numeric_limits<float>::infinity();
  }
}

// Columns [0, CHUNKS vectors) of acc rows [N, d] (d apart) = acc * rescale + sum over the block's tokens of p[row][t]
// * V[t] (V's rows d apart, float32 or widened as loaded): each V vector is loaded once for the N query heads that
// share it; the accumulators stay in registers.
template <int CHUNKS, int N, typename value_t>
inline void accumulate_rows(float* acc, const float* rescale, const float* p, int64_t p_stride, const value_t* values,
                            int64_t rows, int64_t d) {
  Vec out[N][CHUNKS];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < CHUNKS; ++c) out[n][c] = Vec::loadu(acc + n * d + c * Vec::size()) * Vec(rescale[n]);
  for (int64_t t = 0; t < rows; ++t) {
    Vec v[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) v[c] = load_float(values + t * d + c * Vec::size());
    for (int n = 0; n < N; ++n) {
      const Vec weight(p[n * p_stride + t]);
      for (int c = 0; c < CHUNKS; ++c) out[n][c] = at::vec::fmadd(weight, v[c], out[n][c]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < CHUNKS; ++c) out[n][c].store(acc + n * d + c * Vec::size());
}

// One row: acc[0:d] = acc * rescale + sum over the block's rows of p[t] * V[t].
template <typename value_t>
inline void accumulate_any(float* acc, float rescale, const float* p, const value_t* values, int64_t rows,
                           int64_t d) {
  switch (d / Vec::size()) {
    case 2: return accumulate_rows<2, 1>(acc, &rescale, p, 0, values, rows, d);
    case 4: return accumulate_rows<4, 1>(acc, &rescale, p, 0, values, rows, d);
    case 8: return accumulate_rows<8, 1>(acc, &rescale, p, 0, values, rows, d);
    case 16: return accumulate_rows<16, 1>(acc, &rescale, p, 0, values, rows, d);
  }
  for (int64_t i = 0; i < d; ++i) {  // other head dims: scalar
    float out = acc[i] * rescale;
    for (int64_t t = 0; t < rows; ++t) out += p[t] * static_cast<float>(values[t * d + i]);
    acc[i] = out;
  }
}

// Vectors of the head dim that one pass of accumulate_group keeps per row: up to 4 rows' accumulators must fit in the
// registers beside the pass's V vectors: 32 of them with AVX-512, 16 with AVX2 (where a whole 64-dim head, 8 vectors
// a row, would spill).
constexpr int kPassVectors = Vec::size() >= 16 ? 4 : 2;

// The n rows' accumulate_rows in passes of CHUNKS vectors over the head dim (d a multiple of CHUNKS vectors).
template <int CHUNKS, typename value_t>
inline bool accumulate_group(float* acc, const float* rescale, const float* p, int64_t p_stride, const value_t* values,
                             int64_t rows, int64_t n, int64_t d) {
  if (n < 1 || n > 4) return false;
  for (int64_t col = 0; col < d; col += CHUNKS * Vec::size()) {
    switch (n) {
      case 1: accumulate_rows<CHUNKS, 1>(acc + col, rescale, p, p_stride, values + col, rows, d); break;
      case 2: accumulate_rows<CHUNKS, 2>(acc + col, rescale, p, p_stride, values + col, rows, d); break;
      case 3: accumulate_rows<CHUNKS, 3>(acc + col, rescale, p, p_stride, values + col, rows, d); break;
      default: accumulate_rows<CHUNKS, 4>(acc + col, rescale, p, p_stride, values + col, rows, d); break;
    }
  }
  return true;
}

// Folds one block into rows first .. first + n - 1 (one query's heads of the group, each seeing `rows` tokens), whose
// scores are in w.scores, block_size apart (-inf past `rows`): running max and sum, then the weighted values (the
// block's [block_size, head_dim] values: float32, or bf16/fp16 widened as they are read).
template <typename value_t>
inline void fold_scores(Scratch& w, const Shape& s, int64_t first, int64_t n, int64_t rows,
                        const value_t* values) {
  float rescale[64];
  for (int64_t i = 0; i < n; ++i) {
    float* scores = w.scores.data() + i * s.block_size;
    const int64_t g = first + i;
    Vec top(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < s.block_size; t += Vec::size()) top = at::vec::maximum(top, Vec::loadu(scores + t));
    const float best = std::max(w.best[g], top.reduce_max());
    Vec sum(0.f);
    for (int64_t t = 0; t < s.block_size; t += Vec::size()) {
      const Vec p = (Vec::loadu(scores + t) - Vec(best)).exp_u20();
      p.store(scores + t);
      sum = sum + p;
    }
    rescale[i] = std::exp(w.best[g] - best);  // exp(-inf) = 0 on the first block
    w.total[g] = w.total[g] * rescale[i] + sum.reduce_add();
    w.best[g] = best;
  }
  float* acc = w.acc.data() + first * s.head_dim;
  const float* p = w.scores.data();
  if (s.head_dim % (kPassVectors * Vec::size()) == 0 &&
      accumulate_group<kPassVectors>(acc, rescale, p, s.block_size, values, rows, n, s.head_dim))
    return;
  for (int64_t i = 0; i < n; ++i)
    accumulate_any(acc + i * s.head_dim, rescale[i], p + i * s.block_size, values, rows, s.head_dim);
}

// Whether bf16 keys are scored straight from the cache (bf16_scores.h): AVX-512 BF16, blocks of 16 tokens, head
// dims of whole 32-value vectors.
template <typename q_t, typename cache_t>
inline bool scores_in_bf16(const Shape& s) {
  return lora_serve::kBf16Dot && std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
         s.block_size == 16 && s.head_dim % 32 == 0;
}

// Scores of row g (query t of the tile, head g % group) against one block, into `scores`.
template <typename q_t, typename cache_t>
inline void score_row(Scratch& w, const Shape& s, const q_t* q_row, const cache_t* k_block, int64_t g,
                      int64_t rows, bool bf16_scores, float* scores) {
  if (bf16_scores) {
    if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)
      lora_serve::bf16_block_scores(q_row, k_block, s.head_dim, s.scale, scores);
    soft_cap(scores, rows, s.softcap);
    for (int64_t t = rows; t < s.block_size; ++t) scores[t] = -std::numeric_limits<float>::infinity();
  } else {
    score_block(w, s, g, rows, scores);
  }
}

// Contexts up to which a decode takes two passes; longer ones fold block by block (attend).
constexpr int64_t kTwoPassTokens = 4096;

inline bool in_two_passes(const Tile& tile) { return tile.count == 1 && tile.position < kTwoPassTokens; }

// p[0:n] (n a multiple of the vector width) = exp(p - max p); returns their sum.
inline float softmax_in_place(float* p, int64_t n) {
  Vec top(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += Vec::size()) top = at::vec::maximum(top, Vec::loadu(p + t));
  const Vec best(top.reduce_max());
  Vec sum(0.f);
  for (int64_t t = 0; t < n; t += Vec::size()) {
    const Vec e = (Vec::loadu(p + t) - best).exp_u20();
    e.store(p + t);
    sum = sum + e;
  }
  return sum.reduce_add();
}

// One decode (a tile of one query) in two passes over its context: every block's scores for the group's heads into
// w.probs (each head's row s.probs_stride long), one softmax per head over the whole context, then the weighted
// values of every block, read where they are stored. Folding block by block instead rescales every accumulator and
// takes a max, an exp and two horizontal sums per head and block, and (in bf16) widens each block of values to
// float32 first, which is slower for short and long decodes alike. The passes stay in this one function:
// with the second in a function of its own, GCC inlines differently and short decodes are slower.
template <typename q_t, typename cache_t>
void decode_in_two_passes(const q_t* q, const cache_t* k_head, const cache_t* v_head, const int64_t* table,
                          int64_t context, q_t* out, const Shape& s, Scratch& w) {
  const int64_t d = s.head_dim, run = s.block_size * d, blocks = (context + s.block_size - 1) / s.block_size;
  // A sliding window starts the passes at its first block, w.probs' columns counting from that block's first key
  const int64_t seen = first_key(context - 1, s), first = seen / s.block_size, offset = first * s.block_size;
  const bool bf16_scores = scores_in_bf16<q_t, cache_t>(s);
  if (!bf16_scores)
    for (int64_t i = 0; i < s.group * d; ++i) w.query[i] = static_cast<float>(q[i]) * s.scale;
  for (int64_t b = first; b < blocks; ++b) {  // scores
    const int64_t start = b * s.block_size, rows = std::min(s.block_size, context - start);
    if (b + 1 < blocks) {
      prefetch(k_head + table[b + 1] * run, run);
      prefetch(v_head + table[b + 1] * run, run);  // for the second pass
    }
    const cache_t* k_block = k_head + table[b] * run;
    if constexpr (std::is_same_v<q_t, float>) {
      score_rows(w, s, k_block, rows, w.probs.data() + start - offset, s.probs_stride);
    } else {
      if (!bf16_scores) {
        lora_serve::widen(k_block, w.rows.data(), rows * d);
        at::vec::transpose_mxn<float>(w.rows.data(), d, w.keys_t.data(), s.block_size, rows, d);
      }
      for (int64_t g = 0; g < s.group; ++g)
        score_row(w, s, q + g * d, k_block, g, rows, bf16_scores,
                  w.probs.data() + g * s.probs_stride + start - offset);
    }
  }
  const int64_t padded = (blocks - first) * s.block_size;  // past the context: -inf, from the last block's scoring
  float rescale[64], inverse[64];  // rescale: none (accumulate_group's factors on the accumulators)
  for (int64_t g = 0; g < s.group; ++g) {
    hide_front(w.probs.data() + g * s.probs_stride, seen - offset);
    inverse[g] = 1.f / softmax_in_place(w.probs.data() + g * s.probs_stride, padded);
    rescale[g] = 1.f;
  }
  std::fill(w.acc.begin(), w.acc.begin() + s.group * d, 0.f);
  const bool grouped = s.head_dim % (kPassVectors * Vec::size()) == 0 && s.group <= 4;
  for (int64_t b = first; b < blocks; ++b) {  // weighted values
    const int64_t start = b * s.block_size, rows = std::min(s.block_size, context - start);
    if (b + 1 < blocks) prefetch(v_head + table[b + 1] * run, run);
    const cache_t* v_block = v_head + table[b] * run;
    const float* p = w.probs.data() + start - offset;
    if (grouped) {
      accumulate_group<kPassVectors>(w.acc.data(), rescale, p, s.probs_stride, v_block, rows, s.group, d);
    } else {
      for (int64_t g = 0; g < s.group; ++g)
        accumulate_any(w.acc.data() + g * d, 1.f, p + g * s.probs_stride, v_block, rows, d);
    }
  }
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<q_t>(w.acc[g * d + i] * inverse[g]);
}

// q_t: the queries' and the output's dtype; cache_t: the cache's, the same or (float32 queries) bf16/fp16.
template <typename q_t, typename cache_t>
void attend(const q_t* q, const cache_t* k_head, const cache_t* v_head, const int64_t* table,
            const Tile& tile, q_t* out, const Shape& s, Scratch& w) {
  const int64_t d = s.head_dim, run = s.block_size * d, width = s.group * d, stride = s.heads * d;
  if (in_two_passes(tile))
    return decode_in_two_passes(q, k_head, v_head, table, tile.position + 1, out, s, w);
  const bool bf16_scores = scores_in_bf16<q_t, cache_t>(s);
  const int64_t rows_used = tile.count * s.group, context = tile.position + tile.count;
  if (!bf16_scores)  // the float32 path scores scaled, widened queries; the bf16 one reads q as it is
    for (int64_t t = 0; t < tile.count; ++t)
      for (int64_t i = 0; i < width; ++i) w.query[t * width + i] = static_cast<float>(q[t * s.q_stride + i]) * s.scale;
  std::fill(w.acc.begin(), w.acc.begin() + rows_used * d, 0.f);
  std::fill(w.best.begin(), w.best.begin() + rows_used, -std::numeric_limits<float>::infinity());
  std::fill(w.total.begin(), w.total.begin() + rows_used, 0.f);
  const int64_t seen = first_key(tile.position, s);  // the first key of the tile's earliest window
  const int64_t first = seen / s.block_size;
  for (int64_t start = first * s.block_size, b = first; start < context; start += s.block_size, ++b) {
    const int64_t rows = std::min(s.block_size, context - start);
    if (start + s.block_size < context) {  // the next block is elsewhere in memory: ask for it while this one runs
      prefetch(k_head + table[b + 1] * run, run);
      prefetch(v_head + table[b + 1] * run, run);
    }
    const cache_t* k_block = k_head + table[b] * run;
    const cache_t* v_block = v_head + table[b] * run;
    // A float32 tile of one query (a decode) scores each key where it is stored and reads the values in place,
    // widening a bf16 cache's as it loads them; a longer tile shares one transposed copy of each block among its
    // queries.
    if constexpr (std::is_same_v<q_t, float>) {
      if (tile.count == 1) {
        score_rows(w, s, k_block, rows, w.scores.data(), s.block_size);
        for (int64_t g = 0; g < s.group; ++g)
          hide_front(w.scores.data() + g * s.block_size, seen - start);
        fold_scores(w, s, 0, s.group, rows, v_block);
        continue;
      }
    }
    if (!bf16_scores) {
      lora_serve::widen(k_block, w.rows.data(), rows * d);
      at::vec::transpose_mxn<float>(w.rows.data(), d, w.keys_t.data(), s.block_size, rows, d);
    }
    lora_serve::widen(v_block, w.values.data(), rows * d);
    for (int64_t t = 0; t < tile.count; ++t) {
      const int64_t visible = std::min(rows, tile.position + t + 1 - start);  // causal: keys up to the query
      const int64_t hidden = first_key(tile.position + t, s) - start;  // and from its window's first
      if (visible <= 0 || hidden >= visible) continue;
      for (int64_t g = 0; g < s.group; ++g) {
        score_row(w, s, q + t * s.q_stride + g * d, k_block, t * s.group + g, visible, bf16_scores,
                  w.scores.data() + g * s.block_size);
        hide_front(w.scores.data() + g * s.block_size, hidden);
      }
      fold_scores(w, s, t * s.group, s.group, visible, w.values.data());
    }
  }
  for (int64_t t = 0; t < tile.count; ++t)
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t row = t * s.group + g;
      const float inv = 1.f / w.total[row];
      for (int64_t i = 0; i < d; ++i) out[t * stride + g * d + i] = static_cast<q_t>(w.acc[row * d + i] * inv);
    }
}

// Every sequence's queries cut into tiles of at most TILE.
std::vector<Tile> make_tiles(const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& contexts) {
  std::vector<Tile> tiles;
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* cp = contexts.data_ptr<int64_t>();
  for (int64_t seq = 0; seq < starts.size(0); ++seq)
    for (int64_t done = 0; done < lp[seq]; done += TILE)
      tiles.push_back({seq, sp[seq] + done, std::min(TILE, lp[seq] - done), cp[seq] - lp[seq] + done});
  return tiles;
}

// Blocks of the next work item asked for while one runs. attend prefetches each block's successor, so only an
// item's first block would wait on memory, and a short decode has only a few blocks. Prefetching the first one
// makes a call of short decodes faster; prefetching more is no faster.
constexpr int64_t kAheadBlocks = 1;

template <typename q_t, typename cache_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const std::vector<Tile>& tiles, int64_t work, at::Tensor& out, const Shape& s) {
  const int64_t kv_heads = k_cache.size(0), items = static_cast<int64_t>(tiles.size()) * kv_heads;
  const int64_t head_run = s.num_blocks * s.block_size * s.head_dim;  // one KV head's share of the cache
  const int64_t* table = tables.data_ptr<int64_t>();
  const q_t* qp = q.data_ptr<q_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  q_t* op = out.data_ptr<q_t>();
  // only a tiny call stays on the calling thread, where waking the pool costs more than it saves; a step of short
  // decodes already runs faster on the pool's threads
  const int64_t grain = work * kv_heads < 1024 ? items : 1;
  lora_serve::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t item = begin; item < end; ++item) {
      const Tile& tile = tiles[item / kv_heads];
      const int64_t h = item % kv_heads;
      if (item + 1 < end) {  // the next item's first blocks, while this one runs (kAheadBlocks)
        const Tile& next = tiles[(item + 1) / kv_heads];
        const int64_t next_head = (item + 1) % kv_heads * head_run, run_size = s.block_size * s.head_dim;
        const int64_t ahead = std::min(kAheadBlocks, (next.position + next.count + s.block_size - 1) / s.block_size);
        for (int64_t b = 0; b < ahead; ++b) {
          const int64_t at = table[next.seq * s.table_width + b] * run_size;
          prefetch(kp + next_head + at, run_size);
          prefetch(vp + next_head + at, run_size);
        }
      }
      const int64_t head = h * s.group * s.head_dim;
      attend(qp + tile.first * s.q_stride + head, kp + h * head_run, vp + h * head_run,
             table + tile.seq * s.table_width, tile, op + tile.first * s.heads * s.head_dim + head, s, w);
    }
  });
}

}  // namespace lora_serve::paged_attention_detail

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, at::Tensor& out, double softcap, int64_t window) {
  using namespace lora_serve::paged_attention_detail;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [T, heads, D] and the cache [kv_heads, blocks, "
              "block_size, D]");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "out and the caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous within a token");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(), "out must be shaped like q");
  for (const auto* t : {&block_tables, &context_lens, &query_starts, &query_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, "block tables, lengths and query starts must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
              (q.scalar_type() == k_cache.scalar_type() || q.scalar_type() == at::kFloat),
              "q and the cache must share a dtype, unless q is float32 (over a float32, bf16 or fp16 cache)");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= 64,
              "query heads must be a multiple of the KV heads, at most 64 per KV head");
  TORCH_CHECK(k_cache.size(2) % lora_serve::Vec::size() == 0 && q.size(2) % 4 == 0,
              "block size must be a multiple of ", lora_serve::Vec::size(), " and head dim of 4");
  TORCH_CHECK(softcap >= 0, "softcap must be positive, or 0 for none");
  TORCH_CHECK(window >= 0, "window must be positive, or 0 for none");
  const auto tables = block_tables.contiguous();
  const auto contexts = context_lens.contiguous();
  const auto tiles = make_tiles(query_starts.contiguous(), query_lens.contiguous(), contexts);
  const int64_t kv_heads = k_cache.size(0), head_dim = q.size(2);
  int64_t work = 0, longest = 0;  // keys read over all tiles (a measure of the call's size); the longest two-pass
  for (const Tile& tile : tiles) {  // decode's context
    work += tile.position + tile.count;
    if (in_two_passes(tile)) longest = std::max(longest, tile.position + 1);
  }
  const int64_t block_size = k_cache.size(2);
  Shape s{q.size(1), q.stride(0), q.size(1) / kv_heads, head_dim, block_size, k_cache.size(1), tables.size(1),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))), static_cast<float>(softcap), window,
          (longest + block_size - 1) / block_size * block_size};
  if (q.scalar_type() != k_cache.scalar_type()) {  // float32 queries over a bf16/fp16 cache
    lora_serve::dispatch_float_types(k_cache.scalar_type(), "paged_attention", [&](auto type) {
      run<float, decltype(type)>(q, k_cache, v_cache, tables, tiles, work, out, s);
    });
    return;
  }
  lora_serve::dispatch_float_types(q.scalar_type(), "paged_attention", [&](auto type) {
    run<decltype(type), decltype(type)>(q, k_cache, v_cache, tables, tiles, work, out, s);
  });
}

int64_t vector_width() { return static_cast<int64_t>(lora_serve::Vec::size()); }
