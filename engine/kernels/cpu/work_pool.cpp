// The C++ operators' parallel loop, on threads of their own instead of OpenMP's.
//
// Why: an OpenMP loop ends at a barrier that every thread of the team must reach. On a 2-core machine shared with a
// serving stack (Ray's processes wake thousands of times a second), a wake-up that preempts one of the engine's two
// threads stalls the other at that barrier for the whole time slice, whatever work is left: the engine loses more
// throughput than the core taken (benchmarks/serve/run_contention), where one thread alone loses just that core.
// Here the loop is done when its chunks are: each thread takes chunks from the front of a range of its own, and a
// thread that has run out takes them from the back of another's. The caller waits only for chunks that a thread
// holds, so a thread preempted before it took any (or between chunks) costs nothing but its core, and the caller
// never waits for a thread to arrive. Chunks are small (about 16 a thread) so that one held by a preempted thread
// is short.
//
// The pool's threads spin for a millisecond after their last loop, so that a step's next operator finds them
// awake, then sleep on a condition variable; after a few tens of microseconds of spinning they yield the core at
// each turn, so that OpenMP's threads (torch's own ops: a long prompt's attention in float32) run first. Spinning
// for as long as Intel OpenMP's block time without yielding slows a long prefill well past OpenMP's loops; spinning
// briefly, then yielding, keeps it close to them. A process forked with the pool running has no pool threads in the
// child; its loops then run on the caller alone, as they would anyway.
//
// Only up to kOwnLoopThreads threads: with more, the loop is ATen's (OpenMP's), which is faster there. With many
// threads two pools share the cores: GNU OpenMP's threads spin after each of torch's own ops while this pool's need
// the cores, and the reverse. Each thread counts its chunks once a loop, on a cache line of its own, away from the
// words the idle threads poll; even so ATen's loop is faster from 4 threads up, while at 2 the two are even
// (measurements: docs/cpu_kernels.md).

#include "work_pool.h"

#include "ops.h"

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace lora_serve::work_pool_detail {

constexpr int64_t kChunksPerThread = 16;
constexpr auto kSpin = std::chrono::milliseconds(1);  // then sleep
constexpr int kMaxThreads = 256;
constexpr int kPauses = 4096;  // a few tens of microseconds of pauses, then spinning yields the core
constexpr int kOwnLoopThreads = 2;  // better than OpenMP's loop on 2 busy cores; slower with more threads

// Chunks [begin, end) of one thread, with the loop's generation: one 64-bit word, so a take is one compare-and-swap
// and a take of a finished loop's generation fails.
class alignas(64) Range {
 public:
  void reset(uint64_t generation, int64_t begin, int64_t end) {
    word_.store(pack(generation, begin, end), std::memory_order_release);
  }
  // A chunk from the front (the owner) or the back (another thread) while the loop is `generation`; -1 if none.
  int64_t take(uint64_t generation, bool front) {
    uint64_t seen = word_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t begin = static_cast<int64_t>((seen >> 24) & kMask), end = static_cast<int64_t>(seen & kMask);
      if ((seen >> 48) != (generation & 0xffff) || begin >= end) return -1;
      const uint64_t next = front ? pack(generation, begin + 1, end) : pack(generation, begin, end - 1);
      if (word_.compare_exchange_weak(seen, next, std::memory_order_acq_rel)) return front ? begin : end - 1;
    }
  }

 private:
  static constexpr uint64_t kMask = (1ull << 24) - 1;
  static uint64_t pack(uint64_t generation, int64_t begin, int64_t end) {
    return ((generation & 0xffff) << 48) | (static_cast<uint64_t>(begin) << 24) | static_cast<uint64_t>(end);
  }
  std::atomic<uint64_t> word_{0};
};

// The running loop; a thread reads it only while it holds one of the loop's chunks.
struct Loop {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
};

class Pool {
 public:
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void work(int64_t own, uint64_t generation);
  void run_chunk(int64_t chunk);
  int64_t run_range(Range& range, uint64_t generation, bool front);
  void ensure_threads(int64_t count);
  void serve(int64_t own);
  void sleep_until_changed(uint64_t seen);

  std::mutex caller_;  // one loop at a time; a loop started while one runs (another thread's) runs inline
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  // Written by the caller once a loop and read by every thread: a line apart from the count the threads write.
  alignas(64) std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> threads_{1};  // of the latest loop: a thread numbered beyond it sits that loop out
  Loop loop_;
  alignas(64) std::atomic<int64_t> remaining_{0};  // chunks not yet run; each thread subtracts its own once
  alignas(64) std::mutex error_lock_;
  std::exception_ptr error_;
  Range ranges_[kMaxThreads];
  int64_t started_ = 1;  // threads, the caller included
};

thread_local bool in_loop = false;

// A spin-wait's pause: it frees the core's shared resources to its sibling hyperthread.
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

void Pool::run_chunk(int64_t chunk) {
  const int64_t first = loop_.begin + chunk * loop_.chunk;
  try {
    (*loop_.fn)(first, std::min(loop_.end, first + loop_.chunk));
  } catch (...) {  // raised on the caller's thread once the loop is done, as at::parallel_for raises it
    std::lock_guard<std::mutex> guard(error_lock_);
    if (!error_) error_ = std::current_exception();
  }
}

// Own chunks from the front, then others' from the back. A successful take orders after the loop's set-up (the
// range's reset is a release store after it), and the loop cannot end while a chunk is held, so loop_ is this
// generation's for as long as a chunk is.
void Pool::work(int64_t own, uint64_t generation) {
  const int64_t threads = threads_.load(std::memory_order_acquire);
  if (own >= threads) return;
  int64_t done = run_range(ranges_[own], generation, true);
  for (int64_t step = 1; step < threads; ++step) done += run_range(ranges_[(own + step) % threads], generation, false);
  if (done) remaining_.fetch_sub(done, std::memory_order_acq_rel);  // after the last chunk: loop_ is left alone
}

int64_t Pool::run_range(Range& range, uint64_t generation, bool front) {
  int64_t done = 0;
  for (int64_t chunk = range.take(generation, front); chunk >= 0; chunk = range.take(generation, front), ++done)
    run_chunk(chunk);
  return done;
}

void Pool::run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), kMaxThreads);
  if (threads > kOwnLoopThreads) return at::parallel_for(begin, end, grain, fn);
  const int64_t chunk = std::max<int64_t>({grain, 1, (end - begin + threads * kChunksPerThread - 1)
                                                         / (threads * kChunksPerThread)});
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
  if (threads <= 1 || chunks <= 1 || in_loop || !lock.owns_lock()) {
    if (begin < end) fn(begin, end);
    return;
  }
  ensure_threads(threads);
  in_loop = true;
  const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
  loop_ = Loop{&fn, begin, end, chunk};
  threads_.store(threads, std::memory_order_relaxed);
  remaining_.store(chunks, std::memory_order_relaxed);
  for (int64_t t = 0; t < threads; ++t) ranges_[t].reset(generation, chunks * t / threads, chunks * (t + 1) / threads);
  generation_.store(generation, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> guard(sleep_);
    wake_.notify_all();
  }
  work(0, generation);
  while (remaining_.load(std::memory_order_acquire) > 0) relax();
  in_loop = false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void Pool::ensure_threads(int64_t count) {
  for (; started_ < count; ++started_) std::thread([this, own = started_] { serve(own); }).detach();
}

void Pool::serve(int64_t own) {
  in_loop = true;  // a loop inside a chunk runs inline
  uint64_t seen = generation_.load(std::memory_order_acquire);
  for (;;) {
    const auto since = std::chrono::steady_clock::now();
    uint64_t now = generation_.load(std::memory_order_acquire);
    for (int spins = 0; now == seen; now = generation_.load(std::memory_order_acquire)) {
      if (spins < kPauses) relax();
      else std::this_thread::yield();  // a runnable thread on this core (OpenMP's, in torch's own ops) goes first
      if (++spins % 1024 == 0 && std::chrono::steady_clock::now() - since > kSpin) {
        sleep_until_changed(seen);
        spins = 0;
      }
    }
    seen = now;
    work(own, seen);
  }
}

void Pool::sleep_until_changed(uint64_t seen) {
  std::unique_lock<std::mutex> lock(sleep_);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
  sleepers_.fetch_sub(1, std::memory_order_seq_cst);
}

// One pool a process, made on first use and never destroyed: its threads are detached, and a static destructor
// would pull it from under them at exit.
Pool& pool() {
  static Pool* instance = new Pool();
  return *instance;
}

}  // namespace lora_serve::work_pool_detail

namespace lora_serve {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  work_pool_detail::pool().run(begin, end, grain, fn);
}

int64_t pool_threads() { return std::max(1, at::get_num_threads()); }

}  // namespace lora_serve

void parallel_for_count_(at::Tensor& counts, int64_t grain, int64_t fail_item) {
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kInt && counts.is_contiguous(),
              "counts must be a contiguous int32 [items]");
  int32_t* count = counts.data_ptr<int32_t>();
  lora_serve::parallel_for(0, counts.size(0), grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      TORCH_CHECK(item != fail_item, "item ", item, " failed");
      __atomic_fetch_add(count + item, 1, __ATOMIC_RELAXED);
    }
  });
}
