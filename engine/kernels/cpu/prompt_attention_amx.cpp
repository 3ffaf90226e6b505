// Causal prompt attention in bf16 on AMX tiles (TDPBF16PS), for CPUs with AMX (Xeon 4th generation on): the
// contract of prompt_attention.cpp, which calls it.
//
// Why: PyTorch's flash kernel for CPU runs its products on AMX there, but a chunk after cached tokens takes it two
// calls, a gather of the cached blocks and a merge of the two halves by their log-sum-exps, and its softmax works
// row by row; a long prompt's attention is then a large share of its prefill (measurements: docs/cpu_kernels.md).
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
// The exponentials are a polynomial 2^x of the kernel's own (prompt_tile.cpp): with ATen's exp_u20 they are a large
// share of the time. The rest is mostly the steps' chain of tile latencies (score, store, softmax, store, product),
// which one work item cannot overlap. The work item, its softmax and the packing of V^T are shared with the AVX-512
// kernel (prompt_tile.h).

#include "prompt_attention.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include "amx.h"
#include "prompt_tile.h"
#include "work_pool.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace lora_serve::prompt_amx_detail {

using namespace lora_serve::prompt_tile;  // KS keys per step: two score tiles; TQ queries: a tile's columns

// Powers of 2 a column's max may grow before O^T is rescaled: a rescale stores and reloads the output tiles.
constexpr float kLazy = 8.0f;

// tile registers: gcc's tile intrinsics paste their number into the instruction, so they must be literals
#define SCORE0 0
#define SCORE1 1
#define LEFT 2
#define RIGHT 3
#define OUT0 4
#define OUT1 5
#define OUT2 6
#define OUT3 7

// S^T for the step's 32 keys into w.scores; a second block past the context is left out (masked later).
void score_step(const uint16_t* k_head, const int64_t* table, const PromptShape& s, int64_t step, Tile& w) {
  const int64_t key = step * KS;
  const uint16_t* first = k_head + cache_row(s, table, key);
  const bool second_in = key + 16 < s.context;
  const uint16_t* second = second_in ? k_head + cache_row(s, table, key + 16) : first;
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

// O^T *= alpha, column by column.
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

void attend(const uint16_t* q, const uint16_t* k_head, const uint16_t* vt, const int64_t* table,
            const PromptShape& s, int64_t head, int64_t t0, Tile& w, uint16_t* out) {
  begin_tile(q, s, head, t0, w);
  const bool resident = s.d == 64;
  if (resident) load_out(w);
  const int64_t last = w.first_position + w.valid - 1;
  for (int64_t step = 0; step * KS <= last; ++step) {
    score_step(k_head, table, s, step, w);
    const bool rescaled = softmax_step(s, step, kLazy, w);
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
  const std::vector<uint16_t> vt = pack_all_values(vc, table, s);
  const int64_t tiles = (s.t + TQ - 1) / TQ;
  lora_serve::parallel_for(0, tiles * s.heads, 1, [&](int64_t begin, int64_t end) {
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
