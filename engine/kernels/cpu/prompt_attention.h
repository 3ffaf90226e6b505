// What the two bf16 prompt-attention kernels share: one sequence's chunk shape, and the AMX kernel's entry
// (prompt_attention_amx.cpp), which prompt_attention.cpp calls where the build has AMX and the blocks tile it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace lora_serve {

struct PromptShape {
  int64_t t, heads, kv_heads, group, d, pairs, context, steps, block_size, blocks, q_stride;
  float scale;
};

// Where key `key` of the sequence sits in one KV head's cache [blocks, block_size, d]: its row's first value.
inline int64_t cache_row(const PromptShape& s, const int64_t* table, int64_t key) {
  return (table[key / s.block_size] * s.block_size + key % s.block_size) * s.d;
}

// Whether this build has the AMX kernel: compiled for AMX-BF16, and the OS grants this process the tile state.
bool amx_prompt_tiles();

// Whether a chunk runs on AMX tiles: amx_prompt_tiles(), and the cache's blocks hold whole 16-key tiles.
inline bool amx_prompt_usable(const PromptShape& s) { return s.block_size % 16 == 0 && amx_prompt_tiles(); }

// out [t, heads, d] = causal attention of q's rows over the paged cache, on AMX tiles (prompt_attention_amx.cpp).
void amx_prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const int64_t* table, const PromptShape& s, at::Tensor& out);

}  // namespace lora_serve
