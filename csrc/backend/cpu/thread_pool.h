// A fixed pool of worker threads for CPU kernels: parallel_for over an index range, the calling
// thread taking part. One pool per process, sized by ROUTEMM_CPU_THREADS (default: hardware threads),
// alive until the process ends (never destroyed at exit).
#pragma once

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
  explicit ThreadPool(size_t threads);
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

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  // Current job.
  const std::function<void(size_t, size_t)>* body_ = nullptr;
  size_t n_ = 0, chunk_ = 0, next_ = 0, active_ = 0;
  std::exception_ptr error_;
  std::mutex job_mutex_;  // one parallel_for at a time
};

}  // namespace routemm::cpu
