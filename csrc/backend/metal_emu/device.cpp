// The metal_emu backend: the Metal backend's pipeline table and KernelDefs (csrc/backend/metal/
// kernels.cpp, the same geometry and bindings), executed by the CPU model of runtime.h running
// metal/*.metal. A test backend: built only with ROUTEMM_METAL_EMU=ON, never the default device.
//
// Memory: every allocation sits in the middle of a reservation of inaccessible pages, so that an
// access outside a buffer lands in memory the model recognises (and that faults, should any access
// escape the checks). Queue: commands run in order at commit, each dispatch to completion, so every
// barrier is implied.
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backend/metal/kernels.h"
#include "backend/metal_emu/backend.h"
#include "backend/metal_emu/runtime.h"
#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::metal_emu {

namespace {

constexpr size_t kPage = 4096;
constexpr size_t kGuardBytes = size_t{16} << 20;  // reserved, inaccessible, on each side

class Allocations final : public AllocationLookup {
 public:
  struct Entry {
    uintptr_t reservation = 0;
    size_t reservation_bytes = 0;
    AllocationInfo info;
  };

  void* allocate(size_t nbytes) {
    const size_t usable = ((nbytes == 0 ? 1 : nbytes) + kPage - 1) / kPage * kPage;
    const size_t total = usable + 2 * kGuardBytes;
    void* base =
        mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
      throw Error("metal_emu backend: cannot reserve " + std::to_string(total) + " bytes");
    char* data = static_cast<char*>(base) + kGuardBytes;
    if (mprotect(data, usable, PROT_READ | PROT_WRITE) != 0) {
      munmap(base, total);
      throw Error("metal_emu backend: cannot allocate " + std::to_string(nbytes) + " bytes");
    }
    std::lock_guard lock(mutex_);
    entries_[reinterpret_cast<uintptr_t>(base)] =
        Entry{reinterpret_cast<uintptr_t>(base), total,
              AllocationInfo{reinterpret_cast<uintptr_t>(data), nbytes}};
    return data;
  }

  void deallocate(void* data) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = entries_.find(reinterpret_cast<uintptr_t>(data) - kGuardBytes);
    if (it == entries_.end()) return;
    munmap(reinterpret_cast<void*>(it->second.reservation), it->second.reservation_bytes);
    entries_.erase(it);
  }

  std::optional<AllocationInfo> find(uintptr_t address) const override {
    std::lock_guard lock(mutex_);
    auto it = entries_.upper_bound(address);
    if (it == entries_.begin()) return std::nullopt;
    --it;
    if (address - it->second.reservation >= it->second.reservation_bytes) return std::nullopt;
    return it->second.info;
  }

 private:
  mutable std::mutex mutex_;
  std::map<uintptr_t, Entry> entries_;  // by reservation start
};

class EmuBackend;

class EmuQueue final : public Queue, public metal::MetalLaunchTarget {
 public:
  explicit EmuQueue(std::shared_ptr<EmuBackend> backend) : backend_(std::move(backend)) {}

  void submit(QueuedCommand command) override { commands_.push_back(std::move(command)); }
  // The model executes a submission on the committing thread; its failure is reported by the
  // next wait(), as a device queue would.
  void commit(const std::string&, bool timed) override {
    const auto start = std::chrono::steady_clock::now();
    try {
      run();
    } catch (...) {
      if (!error_) error_ = std::current_exception();
    }
    const auto end = std::chrono::steady_clock::now();
    const auto seconds = [](auto t) {
      return std::chrono::duration<double>(t.time_since_epoch()).count();
    };
    if (timed) interval_ = {seconds(start), seconds(end)};
    committed_ = true;
  }
  GpuInterval wait() override {
    if (committed_) note_host_wait();
    committed_ = false;
    const GpuInterval interval = interval_;
    interval_ = {};
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    return interval;
  }

  void encode(std::string_view function, const KernelLaunch& launch) override;

 private:
  void run() {
    auto commands = std::move(commands_);
    commands_.clear();
    for (const auto& command : commands) {
      if (command.kind != QueuedCommand::Kind::Dispatch) continue;
      try {
        command.fn(command.launch, static_cast<metal::MetalLaunchTarget*>(this));
      } catch (const CommandBufferError&) {
        throw;
      } catch (const Error& e) {
        throw CommandBufferError(e.what(), command.launch.label);
      }
    }
  }

  std::shared_ptr<EmuBackend> backend_;
  std::vector<QueuedCommand> commands_;
  std::exception_ptr error_;
  GpuInterval interval_;
  bool committed_ = false;
};

class EmuBackend final : public Backend {
 public:
  // `complete`: the library binds every metal/*.metal file (the registered backend), so every
  // pipeline of the table must have its kernel; a test library binding one seeded file registers
  // the pipelines it has. The tensor-API pipelines run on the model's tensor API (msl_tensor.h):
  // the probe reports them available whenever their kernels are bound.
  EmuBackend(const ShaderLibrary& library, bool complete) : library_(library) {
    std::string missing_tensor;
    for (const metal::MetalPipelineSpec& spec : metal::metal_pipeline_specs()) {
      const ShaderKernel* kernel = library.find(std::string(spec.name));
      if (kernel == nullptr) {
        if (!complete) {
          if (spec.library == metal::MetalLibrary::Tensor)
            missing_tensor += (missing_tensor.empty() ? "" : ", ") + std::string(spec.name);
          continue;
        }
        throw Error("metal_emu backend: no kernel '" + std::string(spec.name) +
                    "' in metal/*.metal");
      }
      kernels_.push_back(metal::metal_kernel_def(spec, kMaxThreadsPerThreadgroup, "metal_emu",
                                                 kernel->source_sha256));
    }
    tensor_status_ = missing_tensor.empty()
                         ? std::string("available (executed by the CPU model)")
                         : "unavailable: the bound shader library lacks " + missing_tensor;
  }

  std::string_view name() const override { return "metal_emu"; }
  std::string device_name() const override { return "Metal execution model (CPU)"; }
  uint64_t registry_id() const override { return 0x6d746c656d75ull; }
  std::map<std::string, std::string> properties() const override {
    return {{"tensor_api", tensor_status_},
            {"simd_width", std::to_string(kSimdWidth)},
            {"max_threadgroup_memory_bytes", "32768"},
            {"unified_memory", "true"}};
  }
  bool host_accessible() const override { return true; }
  int32_t dlpack_device_type() const override { return 8; }  // it stands in for a Metal device

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    note_device_allocation();
    return std::make_shared<Storage>(shared_from_this(), allocations_.allocate(nbytes), nbytes,
                                     true);
  }
  void deallocate(void* data, size_t) noexcept override { allocations_.deallocate(data); }
  void copy_from_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes) std::memcpy(dst, src, nbytes);
  }

  std::unique_ptr<Queue> create_queue(const QueueOptions& options) override {
    if (options.stream) {
      throw InvalidArgument(
          "metal_emu backend: command_encoder(stream=...) needs a backend with streams (cuda)");
    }
    return std::make_unique<EmuQueue>(std::static_pointer_cast<EmuBackend>(shared_from_this()));
  }
  const std::vector<KernelDef>& kernels() const override { return kernels_; }

  const Allocations& allocations() const { return allocations_; }
  const ShaderLibrary& library() const { return library_; }

 private:
  const ShaderLibrary& library_;
  static constexpr uint64_t kMaxThreadsPerThreadgroup = 1024;
  std::vector<KernelDef> kernels_;
  std::string tensor_status_;
  Allocations allocations_;
};

void EmuQueue::encode(std::string_view function, const KernelLaunch& launch) {
  const ShaderKernel* kernel = backend_->library().find(std::string(function));
  if (kernel == nullptr)
    throw Error("metal_emu backend: no kernel '" + std::string(function) + "'");
  run_dispatch(*kernel, launch, &backend_->allocations());
}

}  // namespace

std::shared_ptr<Backend> make_metal_emu_backend(const ShaderLibrary& library, bool complete) {
  return std::make_shared<EmuBackend>(library, complete);
}

void register_metal_emu_backend() {
  // Lowest priority: a test backend is used only when named.
  register_backend(BackendEntry{"metal_emu", -10, [] { return std::string(); },
                                []() -> std::shared_ptr<Backend> {
                                  static std::mutex mutex;
                                  static std::shared_ptr<Backend> backend;
                                  std::lock_guard lock(mutex);
                                  if (!backend)
                                    backend = make_metal_emu_backend(library_base(), true);
                                  return backend;
                                }});
}

}  // namespace routemm::metal_emu
