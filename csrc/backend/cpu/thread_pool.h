// A fixed pool of worker threads for CPU kernels: parallel_for over an index range, the calling
// thread taking part. One pool per process, sized by ROUTEMM_CPU_THREADS (default: hardware threads),
// alive until the process ends (never destroyed at exit).
//
// Waiting: a worker that finished a job polls for the next one for `spin` before it sleeps on a
// condition variable, and the caller polls for the workers' last chunks for as long before it
// sleeps; a poll yields between its checks, so other runnable threads take the core first. Waking
// a sleeping thread costs a futex round trip, about 20 us on a 2-core VM, which a kernel pays at
// its start (a worker joins late) and at its end (the caller wakes late); a decode step runs
// kernels back to back, so most joins then find the threads polling. The instance's spin is
// ROUTEMM_CPU_SPIN_US, and zero when the pool has more threads than the hardware, where polling
// would take cores from threads with work.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace routemm::cpu {

class ThreadPool {
 public:
  explicit ThreadPool(size_t threads, std::chrono::microseconds spin = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }

  // Calls body(begin, end) on disjoint chunks covering [0, n), at most `size()` chunks at once,
  // each about `grain` long or more. Blocks until all chunks ran; rethrows the first exception.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body);

  static ThreadPool& instance();

 private:
  void worker_loop();
  void run_chunks();

  const std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  // Written under mutex_; atomic so the polling loops may read them without it.
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<size_t> active_{0};
  // Current job (under mutex_).
  const std::function<void(size_t, size_t)>* body_ = nullptr;
  size_t n_ = 0, chunk_ = 0, next_ = 0;
  std::exception_ptr error_;
  std::mutex job_mutex_;  // one parallel_for at a time
};

}  // namespace routemm::cpu
