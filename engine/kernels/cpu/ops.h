// The engine's C++ CPU operators, one extension module (bindings.cpp); built by engine/kernels/cpu_ops.py.
#pragma once

#include <ATen/ATen.h>

// Decode attention reading the paged KV cache in place (paged_attention.cpp).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens);

// Floats per vector register of this build: a block size the attention kernel takes is a multiple of it.
int64_t vector_width();

// weight * rms_norm(x) for rows of x, normalised in float32 and rounded as transformers rounds (norm.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// residual += delta in place (rounded to the dtype), then rms_norm(residual) as above (norm.cpp).
at::Tensor add_rms_norm(const at::Tensor& delta, at::Tensor& residual, const at::Tensor& weight, double eps);

// silu(gate) * up for x = [gate | up] of [tokens, 2 * width] -> [tokens, width], rounded as transformers' SiLU and
// product round (activation.cpp).
at::Tensor silu_and_mul(const at::Tensor& x);

// Rotary embedding of x [tokens, heads, D] (any token and head strides) with cos/sin [tokens, (1,) D], rounded as
// transformers rounds; returns a contiguous [tokens, heads, D] (rotary.cpp).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
