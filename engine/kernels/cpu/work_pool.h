// The C++ operators' own threads: a parallel loop whose caller waits for the work, not for every thread.
#pragma once

#include <cstdint>
#include <functional>

namespace lora_serve {

// fn(chunk_begin, chunk_end) over [begin, end) in chunks of at least `grain` items, on the calling thread and the
// pool's (at::get_num_threads() in all); returns once every chunk has run (work_pool.cpp says why not OpenMP's).
// With more threads than the pool serves well (work_pool.cpp), at::parallel_for runs it instead.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// The threads parallel_for runs on (the caller included).
int64_t pool_threads();

}  // namespace lora_serve
