// Decode attention over the paged KV cache on CPU, reading every block in place.
//
// One work item per (sequence, KV head): the query heads that share the KV head are scored together, so
// each cached K/V row is read once per group. A sequence's blocks are walked through its block table;
// in the engine's head-major cache ([kv_heads, blocks, block_size, head_dim]) one block of one KV head is a
// contiguous [block_size, head_dim] run. Softmax is online (running max and sum in float32), so nothing
// of size context is ever materialised and no block is copied. bf16 rows are widened to float32 one
// block at a time; products and sums are float32 in every dtype.

#include "float_types.h"
#include "ops.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Shape {
  int64_t group;       // query heads per KV head
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;  // blocks per KV head in the cache
  int64_t table_width; // entries per row of the block table
  float scale;
};

using lora_serve::Vec;

// Per-thread scratch: the group's scaled queries and accumulators, one block of K widened and transposed
// ([head_dim, block_size]) and of V widened ([block_size, head_dim]), the group's scores for that block.
struct Scratch {
  std::vector<float> query, acc, keys_t, values, rows, scores, best, total;
  explicit Scratch(const Shape& s)
      : query(s.group * s.head_dim), acc(s.group * s.head_dim), keys_t(s.head_dim * s.block_size),
        values(s.block_size * s.head_dim), rows(s.block_size * s.head_dim), scores(s.block_size),
        best(s.group), total(s.group) {}
};

// n cached values widened to float32 (fp32 ones copied as they are).
template <typename scalar_t>
inline void widen(const scalar_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) lora_serve::load_float(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Scores of query head g against the block's tokens: vectors along the tokens, one FMA per head dimension
// (no horizontal sum per token), in four independent chains; tokens past `rows` score -inf.
inline void score_block(Scratch& w, const Shape& s, int64_t g, int64_t rows) {
  const float* q = w.query.data() + g * s.head_dim;
  const float* keys = w.keys_t.data();
  const int64_t width = s.block_size;
  for (int64_t t = 0; t < width; t += Vec::size()) {
    Vec sum[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int64_t i = 0; i < s.head_dim; i += 4)
      for (int64_t j = 0; j < 4; ++j)
        sum[j] = at::vec::fmadd(Vec(q[i + j]), Vec::loadu(keys + (i + j) * width + t), sum[j]);
    ((sum[0] + sum[1]) + (sum[2] + sum[3])).store(w.scores.data() + t);
  }
  for (int64_t t = rows; t < width; ++t) w.scores[t] = -std::numeric_limits<float>::infinity();
}

// acc[0:CHUNKS vectors] = acc * rescale + sum over the block's rows of p[t] * V[t]; the accumulators stay in
// registers, one independent chain per vector of the head dimension.
template <int CHUNKS>
inline void accumulate(float* acc, float rescale, const float* p, const float* values, int64_t rows) {
  Vec out[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) out[c] = Vec::loadu(acc + c * Vec::size()) * Vec(rescale);
  for (int64_t t = 0; t < rows; ++t) {
    const Vec weight(p[t]);
    for (int c = 0; c < CHUNKS; ++c)
      out[c] = at::vec::fmadd(weight, Vec::loadu(values + t * CHUNKS * Vec::size() + c * Vec::size()), out[c]);
  }
  for (int c = 0; c < CHUNKS; ++c) out[c].store(acc + c * Vec::size());
}

inline void accumulate_any(float* acc, float rescale, const float* p, const float* values, int64_t rows,
                           int64_t d) {
  switch (d / Vec::size()) {
    case 2: return accumulate<2>(acc, rescale, p, values, rows);
    case 4: return accumulate<4>(acc, rescale, p, values, rows);
    case 8: return accumulate<8>(acc, rescale, p, values, rows);
    case 16: return accumulate<16>(acc, rescale, p, values, rows);
  }
  for (int64_t i = 0; i < d; ++i) {  // other head dims: scalar
    float out = acc[i] * rescale;
    for (int64_t t = 0; t < rows; ++t) out += p[t] * values[t * d + i];
    acc[i] = out;
  }
}

// Folds one block of `rows` tokens into query head g's running softmax and accumulator.
inline void fold_block(Scratch& w, const Shape& s, int64_t g, int64_t rows) {
  score_block(w, s, g, rows);
  float* scores = w.scores.data();
  const float best = std::max(w.best[g], *std::max_element(scores, scores + rows));
  Vec sum(0.f);
  for (int64_t t = 0; t < s.block_size; t += Vec::size()) {
    const Vec p = (Vec::loadu(scores + t) - Vec(best)).exp_u20();
    p.store(scores + t);
    sum = sum + p;
  }
  const float rescale = std::exp(w.best[g] - best);  // exp(-inf) = 0 on the first block
  w.total[g] = w.total[g] * rescale + sum.reduce_add();
  w.best[g] = best;
  accumulate_any(w.acc.data() + g * s.head_dim, rescale, scores, w.values.data(), rows, s.head_dim);
}

template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_head, const scalar_t* v_head, const int64_t* table,
            int64_t context, scalar_t* out, const Shape& s, Scratch& w) {
  const int64_t d = s.head_dim, run = s.block_size * d;
  for (int64_t i = 0; i < s.group * d; ++i) w.query[i] = static_cast<float>(q[i]) * s.scale;
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.best.begin(), w.best.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.total.begin(), w.total.end(), 0.f);
  for (int64_t start = 0, b = 0; start < context; start += s.block_size, ++b) {
    const int64_t rows = std::min(s.block_size, context - start);
    widen(k_head + table[b] * run, w.rows.data(), rows * d);
    at::vec::transpose_mxn<float>(w.rows.data(), d, w.keys_t.data(), s.block_size, rows, d);
    widen(v_head + table[b] * run, w.values.data(), rows * d);
    for (int64_t g = 0; g < s.group; ++g) fold_block(w, s, g, rows);
  }
  for (int64_t g = 0; g < s.group; ++g) {
    const float inv = 1.f / w.total[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<scalar_t>(w.acc[g * d + i] * inv);
  }
}

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const at::Tensor& lens, at::Tensor& out, const Shape& s) {
  const int64_t kv_heads = k_cache.size(0), items = q.size(0) * kv_heads;
  const int64_t head_run = s.num_blocks * s.block_size * s.head_dim;  // one KV head's share of the cache
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* context = lens.data_ptr<int64_t>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  int64_t tokens = 0;  // a small step runs on the calling thread: waking the pool costs more than it saves
  for (int64_t b = 0; b < q.size(0); ++b) tokens += context[b];
  const int64_t grain = tokens * kv_heads < 8192 ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch w(s);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t offset = (b * kv_heads + h) * s.group * s.head_dim;  // q and out are [B, heads, D]
      attend(qp + offset, kp + h * head_run, vp + h * head_run, table + b * s.table_width, context[b],
             op + offset, s, w);
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, heads, D] and the cache [kv_heads, blocks, "
              "block_size, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the cache must share a dtype");
  TORCH_CHECK(k_cache.size(2) % Vec::size() == 0 && q.size(2) % 4 == 0,
              "block size must be a multiple of ", Vec::size(), " and head dim of 4");
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t kv_heads = k_cache.size(0), head_dim = q.size(2);
  Shape s{q.size(1) / kv_heads, head_dim, k_cache.size(2), k_cache.size(1), tables.size(1),
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)))};
  auto out = at::empty_like(q);
  lora_serve::dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto type) {
    run<decltype(type)>(q, k_cache, v_cache, tables, lens, out, s);
  });
  return out;
}

int64_t vector_width() { return static_cast<int64_t>(Vec::size()); }
