// Rows of a 2-D tensor picked by index, on the operators' own threads: a step's token embeddings (the rows of the
// embedding table) and the hidden rows whose logits it samples.
//
// Why: torch's embedding and indexing run on OpenMP's threads once a copy passes 32,768 values (57 or more rows of
// SmolLM2's 576), and an OpenMP thread spins for milliseconds after its loop. In a step whose other work runs on
// the operators' pool (work_pool.cpp), that spinning takes a core from the pool, and the linears and the LM head
// that follow are slower (measurements: docs/cpu_kernels.md).

#include "ops.h"
#include "work_pool.h"

#include <cstring>

at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index) {
  TORCH_CHECK(table.dim() == 2 && table.stride(1) == 1, "gather_rows takes a table [rows, width] with unit stride "
              "along its width, not ", table.sizes(), " with strides ", table.strides());
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "gather_rows takes an int64 index [n], not ",
              index.scalar_type(), " ", index.sizes());
  const at::Tensor rows = index.contiguous();
  const int64_t n = rows.size(0), width = table.size(1), count = table.size(0);
  const int64_t* ip = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < count, "gather_rows: index ", ip[i], " is outside the table's ", count,
                " rows");
  at::Tensor out = table.new_empty({n, width});
  const int64_t bytes = width * static_cast<int64_t>(table.element_size());
  const char* src = static_cast<const char*>(table.data_ptr());
  const int64_t src_row = table.stride(0) * static_cast<int64_t>(table.element_size());
  char* dst = static_cast<char*>(out.data_ptr());
  lora_serve::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(dst + i * bytes, src + ip[i] * src_row, bytes);
  });
  return out;
}
