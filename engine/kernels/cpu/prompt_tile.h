// What both bf16 prompt-attention kernels do the same way (prompt_attention.cpp on AVX-512 BF16,
// prompt_attention_amx.cpp on AMX tiles): a work item is 16 queries (one token each, of one query head), and its
// scores are kept transposed, S^T [32 keys][16 queries], so that every per-query quantity of the online softmax
// (the running max and sum, the rescale factor) is one vector across the 16 queries and every reduction over keys
// is vertical: no horizontal sums. The output is accumulated transposed too, O^T [head_dim][16 queries], from V^T
// packed once per KV head as [step][dim][32 keys] and P^T written as bf16 key pairs per query. The kernels differ
// only in how they multiply: tiles (TDPBF16PS) or vectors (VDPBF16PS, one query dword pair vector times a
// broadcast key or value pair). Include only where the build has AVX-512 BF16.
#pragma once

#include "prompt_attention.h"

#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace lora_serve::prompt_tile {

constexpr int64_t KS = 32;  // keys per step
constexpr int64_t TQ = 16;  // queries per work item: the lanes of a vector

// Denormals flushed to zero (and read as zero) while a thread runs the kernel, its previous mode restored after:
// the clamped 2^-127 of a masked key is a denormal, and arithmetic on denormals takes a slow microcode assist.
struct FlushDenormals {
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved); }
};

struct Tile {  // one work item's queries: TQ tokens of one query head, and their softmax state
  const uint16_t* q;      // the first token's row of this head
  int64_t valid, head, first_position;
  std::vector<uint32_t> qt;      // Q^T as [d / 2 dim pairs][TQ] dwords
  std::vector<float> scores;     // S^T [KS][TQ]
  std::vector<uint32_t> probs;   // P^T as [KS / 2 key pairs][TQ] dwords
  std::vector<float> out;        // O^T [d][TQ]
  __m512 max, sum, alpha;
  __m512i position;              // each column's position; padding columns repeat the last query's

  explicit Tile(int64_t d) : qt(d / 2 * TQ), scores(KS * TQ), probs(KS / 2 * TQ), out(d * TQ) {}
};

// V^T of every KV head, [kv_heads][steps][d][KS], packed by the threads a (head, step) at a time.
std::vector<uint16_t> pack_all_values(const uint16_t* v_cache, const int64_t* table, const PromptShape& s);

// Every KV head's keys as contiguous rows, [kv_heads][steps * KS][d]; keys past the context are 0.
std::vector<uint16_t> pack_all_keys(const uint16_t* k_cache, const int64_t* table, const PromptShape& s);

// Starts a work item: the tile's queries (t0 on, of one head) as Q^T, its positions, an empty softmax state.
void begin_tile(const uint16_t* q, const PromptShape& s, int64_t head, int64_t t0, Tile& w);

// Online softmax of the step's scores (w.scores), column by column in vectors: masks keys after each query's
// position, and leaves P^T as bf16 key pairs. A column's max moves only when the step's exceeds it by more than
// 2^lazy (FlashAttention-4's lazy rescaling, where rescaling is dear); the probabilities are then up to 2^lazy,
// and the largest is no longer exactly 1 in bf16. With lazy 0 the max is exact, as in PyTorch's kernel. Returns
// whether O^T needs rescaling by w.alpha.
bool softmax_step(const PromptShape& s, int64_t step, float lazy, Tile& w);

// O^T / sum, rounded to bf16, written back in [token, head, dim] order.
void write_out(Tile& w, const PromptShape& s, int64_t t0, uint16_t* out);

}  // namespace lora_serve::prompt_tile
