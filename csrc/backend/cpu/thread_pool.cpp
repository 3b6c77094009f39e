// Thread pool behind every CPU kernel.
#include "thread_pool.h"

#include <algorithm>
#include <atomic>

#include "routemm/env.h"

namespace routemm::cpu {

ThreadPool::ThreadPool(size_t threads) {
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
  static ThreadPool* const pool = new ThreadPool([] {
    const int64_t configured = env::cpu_threads();
    if (configured > 0) return static_cast<size_t>(configured);
    return std::max<size_t>(1, std::thread::hardware_concurrency());
  }());
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
