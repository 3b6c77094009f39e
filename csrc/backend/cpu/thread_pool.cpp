// Thread pool behind every CPU kernel.
#include "thread_pool.h"

#include <algorithm>

#include "routemm/env.h"

namespace routemm::cpu {
namespace {

// One polling step: a yield, so a runnable thread of another pool (a framework's own threads
// beside ours) takes the core first, and an idle core returns at once. Measured against a pause
// loop: the same gains alone; a loop alternating routemm kernels with torch's threaded matmuls lost
// 0.7 and 2.6% to polling with yields, -8.3 to +4.4% with pauses
// (bench/lab/records/logs/cpu-spin-2026-12-05.md).
inline void relax() { std::this_thread::yield(); }

// Polls done() for up to `spin`; true when it turned true.
template <class Done>
bool poll_for(std::chrono::microseconds spin, Done done) {
  if (spin.count() <= 0) return done();
  const auto until = std::chrono::steady_clock::now() + spin;
  for (unsigned i = 0;; ++i) {
    if (done()) return true;
    // The clock every 8 steps: a yield to an idle core costs about as much as a clock read.
    if (i % 8 == 7 && std::chrono::steady_clock::now() >= until) return done();
    relax();
  }
}

}  // namespace

ThreadPool::ThreadPool(size_t threads, std::chrono::microseconds spin) : spin_(spin) {
  const size_t extra = threads > 1 ? threads - 1 : 0;
  workers_.reserve(extra);
  for (size_t i = 0; i < extra; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

ThreadPool& ThreadPool::instance() {
  // Never destroyed: at process exit a thread that is still inside a kernel (e.g. a daemon thread
  // of an embedding interpreter) may still be using the pool while static destructors run, and
  // joining workers then could deadlock. The OS reclaims the threads with the process.
  static ThreadPool* const pool = [] {
    const size_t hardware = std::max<size_t>(1, std::thread::hardware_concurrency());
    const int64_t configured = env::cpu_threads();
    const size_t threads = configured > 0 ? static_cast<size_t>(configured) : hardware;
    const std::chrono::microseconds spin{threads <= hardware ? env::cpu_spin_us() : 0};
    return new ThreadPool(threads, spin);
  }();
  return *pool;
}

void ThreadPool::run_chunks() {
  for (;;) {
    size_t begin;
    {
      std::lock_guard lock(mutex_);
      if (next_ >= n_ || error_) return;
      begin = next_;
      next_ = std::min(n_, next_ + chunk_);
    }
    try {
      (*body_)(begin, std::min(n_, begin + chunk_));
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    poll_for(spin_, [&] { return stop_.load() || generation_.load() != seen; });
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++active_;
    }
    run_chunks();
    {
      std::lock_guard lock(mutex_);
      --active_;
    }
    done_.notify_all();
  }
}

void ThreadPool::parallel_for(size_t n, size_t grain,
                              const std::function<void(size_t, size_t)>& body) {
  if (n == 0) return;
  grain = std::max<size_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    body(0, n);
    return;
  }
  std::lock_guard job(job_mutex_);
  {
    std::lock_guard lock(mutex_);
    body_ = &body;
    n_ = n;
    // Several chunks per thread balance uneven work without a chunk per index.
    const size_t target_chunks = size() * 4;
    chunk_ = std::max(grain, (n + target_chunks - 1) / target_chunks);
    next_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  run_chunks();
  poll_for(spin_, [&] { return active_.load() == 0; });  // then the locked check below decides
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return active_ == 0 && (next_ >= n_ || error_); });
    error = error_;
    body_ = nullptr;
    n_ = 0;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace routemm::cpu
