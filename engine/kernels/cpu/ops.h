// The engine's C++ CPU operators, one extension module (bindings.cpp); built by engine/kernels/cpu_ops.py.
#pragma once

// Only the Tensor class: ATen/ATen.h (every operator's header) slows each file's build, and even ATen/ops/empty.h
// adds much to a file's parsing, so outputs come from Tensor::new_empty.
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// Causal attention reading the paged KV cache in place, into out [T, heads, D]: sequence i's queries are rows
// [query_starts[i], + query_lens[i]) of q, the last of its context_lens[i] positions, its blocks row i of
// block_tables (paged_attention.cpp). softcap > 0: scores soft-capped to (-softcap, softcap) by tanh (Gemma 2);
// window > 0: each query sees only the last `window` positions, its own included (Gemma 2's and 3's local layers).
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, at::Tensor& out, double softcap, int64_t window);

// Causal attention of one sequence's prompt chunk, bf16: q [T, heads, D] are the last T of its context_len
// positions, whose keys and values are in the paged cache under block_table [blocks] (prompt_attention.cpp).
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, int64_t context_len);

// Whether this build has prompt_attention (compiled for a CPU with AVX-512 BF16).
bool bf16_prompt_attention();

// Whether prompt_attention runs on AMX tiles for caches of 16-token blocks (prompt_attention_amx.cpp).
bool amx_prompt_attention();

// Floats per vector register of this build: a block size the attention kernel takes is a multiple of it.
int64_t vector_width();

// weight * rms_norm(x) for rows of x, normalised in float32 and rounded as transformers rounds (norm.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// residual += delta in place (rounded to the dtype), then rms_norm(residual) as above (norm.cpp).
at::Tensor add_rms_norm(const at::Tensor& delta, at::Tensor& residual, const at::Tensor& weight, double eps);

// silu(gate) * up for x = [gate | up] of [tokens, 2 * width] -> [tokens, width], rounded as transformers' SiLU and
// product round (activation.cpp).
at::Tensor silu_and_mul(const at::Tensor& x);

// gelu(gate) * up likewise, GELU as ATen computes it: the tanh approximation where tanh is 1 (transformers'
// gelu_pytorch_tanh, Gemma's), else the exact one (activation.cpp).
at::Tensor gelu_and_mul(const at::Tensor& x, int64_t tanh);

// Rotary embedding of x [tokens, heads, D] (any token and head strides) with cos/sin [tokens, (1,) D], rounded as
// transformers rounds; returns a contiguous [tokens, heads, D] (rotary.cpp).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The first index of each row's maximum in logits [rows, vocab] (float32, bf16 or fp16), as torch.argmax(-1)
// gives it (argmax.cpp).
at::Tensor argmax_rows(const at::Tensor& logits);

// Each row's logsumexp in float32 over logits [rows, vocab] (float32, bf16 or fp16), as torch.logsumexp(-1) of the
// float32 logits gives it: a row's log-probabilities are its logits minus it (argmax.cpp).
at::Tensor log_normalizers(const at::Tensor& logits);

// The rows table[index[i]] of a 2-D table (unit stride along its width), copied in order into a new [n, width]
// tensor; an index outside the table is refused (gather.cpp).
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index);

// out = x widened to float32, in place of out (contiguous, x's shape; x float32, bf16 or fp16) (widen.cpp).
void widen_(at::Tensor& out, const at::Tensor& x);

// k, v [tokens, kv_heads, head_dim] (head_dim contiguous) into their slots of one layer's caches [kv_heads, blocks,
// block_size, head_dim]; slot = block * block_size + offset (kv_write.cpp).
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping);

// Multi-LoRA for one linear, in place: y[t] += (x[t] @ A[slot]) @ B_i[slot] per sub-module i at its columns, for
// each token t of slot slots[t] >= 0; weights [S, in, subs * rank] (K-major) and [S, rank, out_i] in float32 or
// x's dtype, float32 sums, y rounded once (lora.cpp).
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_slots, const std::vector<at::Tensor>& b_slots,
               const at::Tensor& slots, int64_t rank);

// Whether amx_linear takes a weight of [n, k]: this build and process have AMX tiles, and n and k are multiples of
// 32 (amx_linear.cpp).
bool amx_linear_usable(int64_t n, int64_t k);

// A bf16 weight [n, k] packed once into the tile order amx_linear reads (amx_linear.cpp).
at::Tensor amx_pack_linear_weight(const at::Tensor& weight);

// y [m, n] = x [m, k] W^T (+ bias) in bf16 on AMX tiles, float32 sums rounded once: the linear of a decode step's few
// rows, streaming the packed weight at the memory's rate (amx_linear.cpp).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);

// Whether simd_linear takes this weight [n, k]: this build has AVX-512 or AVX2 with FMA, the weight is float32 or
// bf16 (multiplying bf16 rows with AVX-512 BF16, else float32 rows), n is a multiple of a column block (64 with
// AVX-512, 16 with AVX2) and k of the depths a lane holds (bf16 with AVX-512 BF16: 2) (simd_linear.cpp).
bool simd_linear_usable(const at::Tensor& weight);

// Whether simd_linear takes a bf16 weight with float32 rows, widening the weight (a build without AVX-512 BF16).
bool simd_linear_widens_bf16();

// A weight [n, k] packed once into the order simd_linear reads: depths of column blocks.
at::Tensor simd_pack_linear_weight(const at::Tensor& weight);

// y [m, n] = x [m, k] W^T (+ bias) in x's dtype (bf16 with AVX-512 BF16 dot products, or float32 with FMAs, the
// weight float32 or bf16 widened), float32 sums rounded once: the linears of a CPU without AMX (simd_linear.cpp).
at::Tensor simd_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);

// A mixture's experts as one grouped product (simd_linear.cpp): x's rows sorted by expert, expert e's rows
// [offsets[e], offsets[e + 1]) times its weight packed[e] (packed: [E, ...], each simd_pack_linear_weight's), into
// y [rows, out]; offsets int64 [E + 1] from 0 to x's rows. Each row's sums are simd_linear's.
at::Tensor grouped_simd_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets);

// A Llama-family decoder's layers over the residual stream h [tokens, hidden] (updated in place), every token
// attending through paged_attention in place: per layer the weights [input norm, qkv, qkv bias, q norm, k norm, o,
// o bias, post-attention norm, pre-feedforward norm, post-feedforward norm, gate_up, gate_up bias, down, down bias]
// (linears packed for simd_linear, or amx_linear where amx is 1; an empty tensor where the layer has no such bias or
// norm: Llama's MLP input norm is its pre-feedforward norm), then the final norm's weight; a key and a value cache
// per layer. With adapters, loras holds per layer and linear (qkv, o, gate_up, down) its slots' A and up to 3 B
// (lora_add_'s weights; empty tensors past its own, and for a linear without adapter weights), token_slots each
// token's slot; no adapters: loras empty. cos and sin: one per rotary table; rope_tables: int64 [layers], the table
// a layer turns its queries and keys by, -1 for none (SmolLM3's), or an empty tensor where every layer takes table
// 0; windows: int64 [layers], a layer's sliding window (0: none), or empty for none. query_scale: the queries times
// it after the rotary (Granite's and Gemma's attention scale times sqrt(head_dim)); residual_multiplier: Granite's
// attention and MLP outputs times it before the residual add; softcap: Gemma 2's score cap (each 0: none).
// activation: 0 silu, 1 gelu, 2 gelu (tanh); qk_norm: 0 none, 1 per head, 2 per projection. Returns the final norm
// of h, the same bits as the modules' path (decoder_stack.cpp).
at::Tensor decoder_stack(at::Tensor& h, const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& caches,
                         const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, const at::Tensor& query_starts, const at::Tensor& query_lens,
                         int64_t heads, int64_t kv_heads, int64_t amx, double eps,
                         const std::vector<at::Tensor>& loras, const at::Tensor& token_slots, int64_t rank,
                         const at::Tensor& rope_tables, const at::Tensor& windows, double query_scale,
                         double residual_multiplier, double softcap, int64_t activation, int64_t qk_norm);

// The operators' parallel loop (work_pool.cpp) over the items of counts (int32 [items]), adding 1 to each item it
// runs; the item fail_item raises instead. For the loop's own tests.
void parallel_for_count_(at::Tensor& counts, int64_t grain, int64_t fail_item);
