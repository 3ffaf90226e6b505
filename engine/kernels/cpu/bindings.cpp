// Python bindings of the engine's C++ CPU operators (ops.h).
// torch's pybind11 casters for at::Tensor only: torch/extension.h (the whole C++ frontend) made this file 20.5 of
// the build's 50 CPU seconds, this header 7.5
#include <pybind11/stl.h>  // lists of tensors
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "causal attention of decodes and prompt chunks, reading the paged KV cache in place (CPU)");
  m.def("prompt_attention", &prompt_attention,
        "causal attention of one sequence's bf16 prompt chunk over the paged cache, flash-style (CPU, AVX-512 BF16)");
  m.def("bf16_prompt_attention", &bf16_prompt_attention, "whether this build has prompt_attention");
  m.def("amx_prompt_attention", &amx_prompt_attention, "whether prompt_attention runs on AMX (16-token blocks)");
  m.def("vector_width", &vector_width, "floats per vector register: the attention block size is a multiple of it");
  m.def("rotary", &rotary, "rotary position embedding, transformers' rounding (CPU)");
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x), float32 inside, transformers' rounding (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then weight * rms_norm(residual) (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of x = [gate | up], transformers' rounding (CPU)");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum, as torch.argmax(-1) (CPU)");
  m.def("lora_add_", &lora_add_, "multi-LoRA delta of one linear, each token reading its slot in place (CPU)");
  m.def("amx_linear_usable", &amx_linear_usable, "whether amx_linear takes a weight of [out, in] (AMX, multiples of 32)");
  m.def("amx_pack_linear_weight", &amx_pack_linear_weight, "a bf16 weight [out, in] in amx_linear's tile order");
  m.def("amx_linear", &amx_linear, "x W^T (+ bias) in bf16 on AMX tiles, for a decode step's few rows (CPU)");
  m.def("simd_linear_usable", &simd_linear_usable, "whether simd_linear takes this weight [out, in]");
  m.def("simd_linear_widens_bf16", &simd_linear_widens_bf16,
        "whether simd_linear takes bf16 weights with float32 rows (no AVX-512 BF16 in this build)");
  m.def("simd_pack_linear_weight", &simd_pack_linear_weight, "a weight [out, in] in simd_linear's order");
  m.def("simd_linear", &simd_linear, "x W^T (+ bias) with AVX-512 (bf16, float32) or AVX2 (float32), without AMX");
  m.def("parallel_for_count_", &parallel_for_count_, "the operators' parallel loop, counting the runs of each item");
  m.def("write_kv_cache", &write_kv_cache, "a step's new keys and values into their cache slots (CPU)");
}
