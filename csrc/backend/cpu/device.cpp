// The CPU backend: host memory, an in-order queue executed at commit on the thread pool.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels.h"
#include "routemm/backend.h"
#include "routemm/checked.h"
#include "routemm/error.h"
#include "thread_pool.h"

namespace routemm::cpu {
namespace {

// 64-byte alignment keeps vector loads of whole buffers aligned.
constexpr size_t kAlignment = 64;

class CpuQueue final : public Queue {
 public:
  void submit(QueuedCommand command) override { commands_.push_back(std::move(command)); }

  void commit_and_wait() override { run(); }

  GpuInterval commit_wait_with_gpu_time() override {
    const auto start = std::chrono::steady_clock::now();
    run();
    const auto end = std::chrono::steady_clock::now();
    const auto seconds = [](auto t) {
      return std::chrono::duration<double>(t.time_since_epoch()).count();
    };
    return {seconds(start), seconds(end)};
  }

 private:
  void run() {
    // Commands run one after another, each internally parallel: every barrier is implied.
    auto commands = std::move(commands_);
    commands_.clear();
    for (const auto& command : commands) {
      if (command.kind != QueuedCommand::Kind::Dispatch) continue;
      try {
        command.fn(command.launch, &ThreadPool::instance());
      } catch (const CommandBufferError&) {
        throw;
      } catch (const Error& e) {
        throw CommandBufferError(e.what(), command.launch.label);
      }
    }
  }

  std::vector<QueuedCommand> commands_;
};

class CpuBackend final : public Backend {
 public:
  CpuBackend() {
    add_dense_matmul_id_kernels(kernels_);
    add_q4_matmul_kernels(kernels_);
    add_quantized_matmul_id_kernels(kernels_);
    add_moe_kernels(kernels_);
    add_calibration_kernels(kernels_);
  }

  std::string_view name() const override { return "cpu"; }
  std::string device_name() const override { return "cpu"; }
  uint64_t registry_id() const override { return 0; }
  std::map<std::string, std::string> properties() const override {
    return {{"threads", std::to_string(ThreadPool::instance().size())}};
  }
  bool host_accessible() const override { return true; }
  int32_t dlpack_device_type() const override { return 1; }

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    const uint64_t rounded = checked_round_up(nbytes, kAlignment, "cpu backend allocation");
    void* data = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (data == nullptr)
      throw OutOfMemory("cpu backend: cannot allocate " + std::to_string(nbytes) + " bytes");
    return std::make_shared<Storage>(shared_from_this(), data, nbytes, true);
  }
  void deallocate(void* data, size_t) noexcept override { std::free(data); }
  void copy_from_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }

  std::unique_ptr<Queue> create_queue() override { return std::make_unique<CpuQueue>(); }
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
