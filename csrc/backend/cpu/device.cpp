// The CPU backend: host memory, and queues whose submissions run asynchronously, in commit order,
// on one process-wide submission thread that drives the kernel thread pool.
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "isa.h"
#include "kernels.h"
#include "routemm/backend.h"
#include "routemm/checked.h"
#include "routemm/env.h"
#include "routemm/error.h"
#include "thread_pool.h"

namespace routemm::cpu {
namespace {

// 64-byte alignment keeps vector loads of whole buffers aligned.
constexpr size_t kAlignment = 64;

// Host memory of the backend's buffers. On Linux, buffers of 2 MiB or more are mapped on 2 MiB
// boundaries and advised MADV_HUGEPAGE (unless ROUTEMM_CPU_HUGE_PAGES=0): where transparent huge
// pages are given only on request (the "madvise" mode), a kernel streaming weights then takes a
// TLB miss per 2 MiB instead of per 4 KiB. Measured on a 2-core Zen 4 VM (madvise mode): the
// bf16-dot decode pattern over 25 MB of weights ran 2-13% faster from huge pages, the m = 1 bf16
// expert-ID routes 0-7% (docs/backends.md). The advice is only advice; where the kernel declines
// it, the buffer is plain pages. Smaller buffers, and every buffer elsewhere, come from
// aligned_alloc.
class HostMemory {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;

  static void* allocate(size_t nbytes) {
    const uint64_t rounded = checked_round_up(nbytes, kAlignment, "cpu backend allocation");
    void* data = mapped(nbytes)
                     ? map_huge(nbytes)
                     : std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (data == nullptr)
      throw OutOfMemory("cpu backend: cannot allocate " + std::to_string(nbytes) + " bytes");
    return data;
  }

  static void release(void* data, size_t nbytes) noexcept {
#if defined(__linux__)
    if (mapped(nbytes)) {
      munmap(data, huge_span(nbytes));
      return;
    }
#endif
    std::free(data);
  }

 private:
  // The same answer for a buffer's allocation and release (the knob is read once per process).
  static bool mapped(size_t nbytes) {
#if defined(__linux__)
    return nbytes >= kHugePage && env::cpu_huge_pages();
#else
    (void)nbytes;
    return false;
#endif
  }

  static size_t huge_span(size_t nbytes) {
    return static_cast<size_t>(checked_round_up(nbytes, kHugePage, "cpu backend allocation"));
  }

  // An anonymous mapping of huge_span(nbytes) bytes starting on a 2 MiB boundary: one more huge
  // page is mapped, and the unaligned head and the tail past the span are unmapped again.
  static void* map_huge(size_t nbytes) {
#if defined(__linux__)
    const size_t span = huge_span(nbytes);
    const size_t padded =
        static_cast<size_t>(checked_add(span, kHugePage, "cpu backend allocation"));
    void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const auto base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (base + kHugePage - 1) & ~uintptr_t{kHugePage - 1};
    if (start > base) munmap(raw, start - base);
    if (base + padded > start + span) {
      munmap(reinterpret_cast<void*>(start + span), base + padded - (start + span));
    }
    (void)madvise(reinterpret_cast<void*>(start), span, MADV_HUGEPAGE);
    return reinterpret_cast<void*>(start);
#else
    (void)nbytes;
    return nullptr;
#endif
  }
};

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One committed submission: its commands (owned here until the queue's wait() drops them on the
// waiting thread, so no storage is released on the submission thread) and its outcome.
struct Submission {
  std::vector<QueuedCommand> commands;
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::exception_ptr error;
  GpuInterval interval;

  // Commands run one after another, each internally parallel: every barrier is implied. The
  // first failure ends the submission.
  void execute() noexcept {
    const double start = seconds_now();
    for (const auto& command : commands) {
      if (command.kind == QueuedCommand::Kind::Barrier) continue;
      try {
        if (command.kind == QueuedCommand::Kind::Graph)
          throw Error("cpu backend: graph commands are not supported (no graph objects)");
        command.fn(command.launch, &ThreadPool::instance());
      } catch (const CommandBufferError&) {
        error = std::current_exception();
      } catch (const Error& e) {
        error = std::make_exception_ptr(CommandBufferError(e.what(), command.launch.label));
      } catch (...) {
        error = std::current_exception();
      }
      if (error) break;
    }
    interval = {start, seconds_now()};
  }

  // Publishes the outcome. The waiting queue holds a reference until it has seen `done`, so the
  // submission thread lets go of its own before calling this: the commands (and the storages they
  // keep, some of which release Python objects) are always destroyed by the queue's thread.
  void finish() {
    const std::lock_guard lock(mutex);
    done = true;
    done_cv.notify_all();
  }

  void wait() {
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [&] { return done; });
  }
};

// Runs submissions one at a time in the order they were posted (the CPU's single in-order
// device queue). Never destroyed, like the thread pool: a submission may still run at exit.
// A thread that waits for a submission still at the head of the line, with nothing running, runs it
// itself (run_if_next): a commit followed at once by a wait then costs no hand-off to this thread
// and back, two thread wake-ups that cost tens of microseconds each on a busy machine.
class SubmissionThread {
 public:
  static SubmissionThread& instance() {
    static SubmissionThread* const thread = new SubmissionThread();
    return *thread;
  }

  void post(std::shared_ptr<Submission> submission) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(submission));
    }
    wake_.notify_one();
  }

  // Runs `submission` on the calling thread and returns true when it is next in line and no
  // submission is running; otherwise returns false and leaves it to this thread. The caller keeps
  // its own reference, so the commands are released on the caller's thread either way.
  bool run_if_next(const Submission* submission) {
    std::shared_ptr<Submission> next;
    {
      std::lock_guard lock(mutex_);
      if (busy_ || queue_.empty() || queue_.front().get() != submission) return false;
      next = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    run(std::move(next));
    return true;
  }

 private:
  SubmissionThread() {
    std::thread([this] { loop(); }).detach();
  }

  void loop() {
    for (;;) {
      std::shared_ptr<Submission> next;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return !queue_.empty() && !busy_; });
        next = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      run(std::move(next));
    }
  }

  // Executes a submission taken off the line (busy_ set), then lets the next one start and
  // publishes the outcome. The reference taken off the line is dropped first: the waiting queue's
  // own reference is the last, so the commands (and the storages they keep, some of which release
  // Python objects) are always destroyed by the queue's thread.
  void run(std::shared_ptr<Submission> next) {
    next->execute();
    Submission* const finished = next.get();
    next.reset();
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
    }
    wake_.notify_one();
    finished->finish();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Submission>> queue_;
  bool busy_ = false;  // a submission is executing (on this thread or on a waiter's)
};

class CpuQueue final : public Queue {
 public:
  ~CpuQueue() override {
    for (const auto& s : in_flight_) complete(*s);
  }

  void submit(QueuedCommand command) override { commands_.push_back(std::move(command)); }

  void commit(const std::string&, bool timed) override {
    auto submission = std::make_shared<Submission>();
    submission->commands = std::move(commands_);
    commands_.clear();
    timed_.push_back(timed);
    in_flight_.push_back(submission);
    SubmissionThread::instance().post(std::move(submission));
  }

  GpuInterval wait() override {
    if (!in_flight_.empty()) note_host_wait();
    std::exception_ptr first;
    GpuInterval interval;
    for (size_t i = 0; i < in_flight_.size(); ++i) {
      complete(*in_flight_[i]);
      if (!first) first = in_flight_[i]->error;
      if (timed_[i]) interval = in_flight_[i]->interval;
    }
    in_flight_.clear();  // the commands and the storages they hold go here, on this thread
    timed_.clear();
    if (first) std::rethrow_exception(first);
    return interval;
  }

 private:
  // Returns once `s` has run: on this thread when it is next in line and nothing runs, else on the
  // submission thread.
  static void complete(Submission& s) {
    if (!SubmissionThread::instance().run_if_next(&s)) s.wait();
  }

  std::vector<QueuedCommand> commands_;
  std::vector<std::shared_ptr<Submission>> in_flight_;
  std::vector<bool> timed_;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend() {
    add_dense_matmul_id_kernels(kernels_);
    add_dense_matmul_id_bf16_dot_kernels(kernels_);
    add_q4_matmul_kernels(kernels_);
    add_quantized_matmul_id_kernels(kernels_);
    add_ggml_format_kernels(kernels_);
    add_moe_kernels(kernels_);
    add_moe_fused_kernels(kernels_);
    add_calibration_kernels(kernels_);
    // A pipeline's identity names the clone its kernels run in this process (the same name as
    // properties()["isa"]): receipts' labels, dispatch traces and plan build fingerprints then say
    // which code ran, and a plan timed under one clone does not pass for another's.
    const std::string origin = "builtin_cpu:" + std::string(cpu_isa_name(cpu_isa()));
    for (KernelDef& def : kernels_) def.origin = origin;
  }

  std::string_view name() const override { return "cpu"; }
  std::string device_name() const override { return "cpu"; }
  uint64_t registry_id() const override { return 0; }
  std::map<std::string, std::string> properties() const override {
    return {{"threads", std::to_string(ThreadPool::instance().size())},
            {"isa", std::string(cpu_isa_name(cpu_isa()))}};
  }
  bool host_accessible() const override { return true; }
  int32_t dlpack_device_type() const override { return 1; }

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    note_device_allocation();
    void* data = HostMemory::allocate(nbytes);
    try {
      return std::make_shared<Storage>(shared_from_this(), data, nbytes, true);
    } catch (...) {
      HostMemory::release(data, nbytes);
      throw;
    }
  }
  void deallocate(void* data, size_t nbytes) noexcept override {
    HostMemory::release(data, nbytes);
  }
  void copy_from_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }

  std::unique_ptr<Queue> create_queue(const QueueOptions& options) override {
    if (options.stream) {
      throw InvalidArgument(
          "cpu backend: command_encoder(stream=...) needs a backend with streams "
          "(cuda); the cpu backend has none");
    }
    return std::make_unique<CpuQueue>();
  }
  const std::vector<KernelDef>& kernels() const override { return kernels_; }

 private:
  std::vector<KernelDef> kernels_;
};

}  // namespace

void register_cpu_backend() {
  register_backend(BackendEntry{"cpu", 0, [] { return std::string(); },
                                [] {
                                  static std::shared_ptr<Backend> backend =
                                      std::make_shared<CpuBackend>();
                                  return backend;
                                }});
}

}  // namespace routemm::cpu
