// Causal attention of one sequence's prompt chunk in bf16, flash-style, with AVX-512 BF16 dot products (vdpbf16ps):
// the chunk's queries are the last T of the sequence's positions, its keys and values are read from the paged cache
// (this step's already written), so a chunk after cached tokens is one call like a fresh prompt.
//
// Why: on a CPU with AVX-512 BF16 but no AMX (AMD EPYC Zen 4), PyTorch's flash kernel for CPU runs far below the rate
// a bf16 matmul reaches on the same cores, and a long prompt's attention is then a large share of its prefill
// (measurements: docs/cpu_kernels.md). Where AMX exists PyTorch's kernel uses it, and prompt_attention runs the AMX
// kernel (prompt_attention_amx.cpp), which is faster still.
//
// Layout: the work items and the online softmax are those of the AMX kernel (prompt_tile.h): 16 queries of one
// query head in the vector lanes, scores and output transposed, so the softmax runs down the columns with no
// horizontal sums. Each product is vdpbf16ps of one 16-query vector (Q^T's dim pair, or P^T's key pair) and one
// key's dim pair or one dim's value pair, broadcast. Keys are first packed per KV head as contiguous rows, values
// as V^T. A work item takes up to 3 query heads of one KV head: each broadcast then feeds 3 products, which keeps
// the load ports under the dot-product units' rate (with one head, 17 loads per 16 products). Where the item has
// one head the pair is broadcast inside the product instruction (gcc emits a separate broadcast for the
// intrinsic). The steps past the tile's last position are not read; items are dealt to the threads alternately
// from both ends of the prompt, since causal tiles near the end cost the most.
//
// The running max is exact (lazy 0), and a moved max rescales O^T as it is loaded for the next product. The AMX
// kernel's lazy max (2^8) gains little here and makes the largest error on peaked softmaxes against float32 larger
// (the top probability is then not exactly 1 in bf16); with the exact max the errors are PyTorch's flash kernel's.
//
// A row-wise layout (a row per query, softmax by horizontal sums, ATen's exp) is slower than this one. On a CPU with
// AMX this kernel is slower than the AMX kernel, which takes that CPU's work.

#include "ops.h"
#include "work_pool.h"
#include "prompt_attention.h"

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include "prompt_tile.h"

namespace lora_serve::prompt_attention_detail {

using namespace lora_serve::prompt_tile;

constexpr int64_t MAX_NT = 3;  // tiles (query heads of one KV head) that share a work item's broadcasts

// acc += a's bf16 pairs times the pair at b, broadcast from memory inside the instruction ({1to16}): gcc loads
// a broadcast intrinsic into a register first, one more instruction per product.
inline __m512 dot(__m512 acc, __m512i a, const uint32_t* b) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*b));
  return acc;
}

inline __m512 dot(__m512 acc, __m512i a, __m512i b) {  // acc += a's bf16 pairs times b's
  return _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(a), reinterpret_cast<const __m512bh&>(b));
}

// NT 16-lane vectors (one per tile, at vectors[n] + offset) times NB broadcast pairs (at pairs + j * stride), into
// acc[n][j]. With one tile each pair is broadcast inside its product; with more, once into a register for all.
template <int64_t NT, int64_t NB>
inline void products(__m512 (&acc)[NT][NB], const uint32_t* const* vectors, int64_t offset, const uint32_t* pairs,
                     int64_t stride) {
  __m512i v[NT];
  for (int64_t n = 0; n < NT; ++n) v[n] = _mm512_loadu_si512(vectors[n] + offset);
  for (int64_t j = 0; j < NB; ++j) {
    if constexpr (NT == 1) {
      acc[0][j] = dot(acc[0][j], v[0], pairs + j * stride);
    } else {
      const __m512i b = _mm512_set1_epi32(static_cast<int>(pairs[j * stride]));
      for (int64_t n = 0; n < NT; ++n) acc[n][j] = dot(acc[n][j], v[n], b);
    }
  }
}

// S^T of each of NT tiles for the step's KS keys (rows of PAIRS dwords), NB keys a pass: each dim pair's Q^T
// vector (16 queries) meets each key's pair broadcast. NB keeps 16 or more accumulators in flight.
template <int64_t NT, int64_t PAIRS>
void score_step(const uint32_t* keys, Tile* const* w) {
  constexpr int64_t NB = NT == 1 ? 16 : 8;
  const uint32_t* qt[NT];
  for (int64_t n = 0; n < NT; ++n) qt[n] = w[n]->qt.data();
  for (int64_t k0 = 0; k0 < KS; k0 += NB) {
    __m512 acc[NT][NB];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t p = 0; p < PAIRS; ++p) products<NT, NB>(acc, qt, p * TQ, keys + k0 * PAIRS + p, PAIRS);
    for (int64_t n = 0; n < NT; ++n)
      for (int64_t j = 0; j < NB; ++j) _mm512_storeu_ps(w[n]->scores.data() + (k0 + j) * TQ, acc[n][j]);
  }
}

// O^T += V^T P^T for each of NT tiles (V^T as [D][KS / 2] key-pair dwords), NB dims a pass: each key pair's P^T
// vector (16 queries) meets each dim's value pair broadcast. A tile whose max moved has its O^T rescaled by
// alpha as it is loaded.
template <int64_t NT, int64_t D>
void accumulate(const uint32_t* vt_step, Tile* const* w, const bool* rescaled) {
  constexpr int64_t NB = NT == 1 ? 16 : 8;
  const uint32_t* probs[NT];
  for (int64_t n = 0; n < NT; ++n) probs[n] = w[n]->probs.data();
  for (int64_t c0 = 0; c0 < D; c0 += NB) {
    __m512 acc[NT][NB];
    for (int64_t n = 0; n < NT; ++n) {
      for (int64_t j = 0; j < NB; ++j) acc[n][j] = _mm512_loadu_ps(w[n]->out.data() + (c0 + j) * TQ);
      if (rescaled[n])
        for (int64_t j = 0; j < NB; ++j) acc[n][j] = _mm512_mul_ps(acc[n][j], w[n]->alpha);
    }
    for (int64_t kp = 0; kp < KS / 2; ++kp)
      products<NT, NB>(acc, probs, kp * TQ, vt_step + c0 * (KS / 2) + kp, KS / 2);
    for (int64_t n = 0; n < NT; ++n)
      for (int64_t j = 0; j < NB; ++j) _mm512_storeu_ps(w[n]->out.data() + (c0 + j) * TQ, acc[n][j]);
  }
}

// Query heads first_head.. first_head + NT - 1 (one KV head's) for the 16 tokens from t0.
template <int64_t NT, int64_t D>
void attend(const uint16_t* q, const uint32_t* keys, const uint32_t* vt, const PromptShape& s, int64_t first_head,
            int64_t t0, Tile* const* w, uint16_t* out) {
  for (int64_t n = 0; n < NT; ++n) begin_tile(q, s, first_head + n, t0, *w[n]);
  const int64_t last = w[0]->first_position + w[0]->valid - 1;
  for (int64_t step = 0; step * KS <= last; ++step) {
    score_step<NT, D / 2>(keys + step * KS * (D / 2), w);
    bool rescaled[NT];  // the exact max (lazy 0): a rescale costs one multiply per output vector loaded anyway
    for (int64_t n = 0; n < NT; ++n) rescaled[n] = softmax_step(s, step, 0.0f, *w[n]);
    accumulate<NT, D>(vt + step * D * (KS / 2), w, rescaled);
  }
  for (int64_t n = 0; n < NT; ++n) write_out(*w[n], s, t0, out);
}

template <int64_t D>
void attend_heads(const uint16_t* q, const uint32_t* keys, const uint32_t* vt, const PromptShape& s,
                  int64_t first_head, int64_t count, int64_t t0, Tile* const* w, uint16_t* out) {
  if (count == 3) attend<3, D>(q, keys, vt, s, first_head, t0, w, out);
  else if (count == 2) attend<2, D>(q, keys, vt, s, first_head, t0, w, out);
  else attend<1, D>(q, keys, vt, s, first_head, t0, w, out);
}

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* table,
         const PromptShape& s, at::Tensor& out) {
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const std::vector<uint16_t> keys = pack_all_keys(reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), table, s);
  const std::vector<uint16_t> vt = pack_all_values(vc, table, s);
  const int64_t k_size = s.steps * KS * s.pairs, v_size = s.steps * (KS / 2) * s.d;  // dwords per KV head
  const auto* k32 = reinterpret_cast<const uint32_t*>(keys.data());
  const auto* v32 = reinterpret_cast<const uint32_t*>(vt.data());
  const int64_t tiles = (s.t + TQ - 1) / TQ;
  const int64_t chunks = (s.group + MAX_NT - 1) / MAX_NT;  // a KV head's query heads in chunks of up to 3
  const int64_t per_token_tile = s.kv_heads * chunks;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  lora_serve::parallel_for(0, tiles * per_token_tile, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<Tile> tiles_of_item(MAX_NT, Tile(s.d));
    Tile* w[MAX_NT];
    for (int64_t n = 0; n < MAX_NT; ++n) w[n] = &tiles_of_item[n];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t z = item / per_token_tile, h = item % per_token_tile / chunks, c = item % chunks;
      const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;  // both ends in turn: balanced halves
      const int64_t from = c * s.group / chunks, to = (c + 1) * s.group / chunks;  // chunks as even as can be
      if (s.d == 64) attend_heads<64>(qp, k32 + h * k_size, v32 + h * v_size, s, h * s.group + from, to - from,
                                      tile * TQ, w, op);
      else attend_heads<128>(qp, k32 + h * k_size, v32 + h * v_size, s, h * s.group + from, to - from,
                             tile * TQ, w, op);
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
