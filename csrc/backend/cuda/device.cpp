// The CUDA backend: device 0, cudaMalloc'd storage, one blocking stream per encoder (ordered after the legacy default stream).
//
// Queue model: submit() launches at once on the encoder's stream (one in-order stream, so memory
// barriers are no-ops); commit_and_wait() synchronises the stream and reports any asynchronous
// failure as CommandBufferError naming the pipelines of the submission. Storages and inline
// argument bytes of submitted commands are kept alive until that commit.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"
#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::cuda {
namespace {

std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw Error("cuda backend: " + what + " failed (" + cuda_error_text(e) + ")");
}

std::string version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

class CudaQueue final : public Queue {
 public:
  CudaQueue() {
    check(cudaSetDevice(0), "cudaSetDevice(0)");
    // A blocking stream: it waits for work on the legacy default stream, which is where DLPack
    // producers are asked (stream=1) to order their pending writes before handing a tensor over.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreateWithFlags");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&end_), "cudaEventCreate");
  }
  ~CudaQueue() override {
    // Work still in flight must finish before its storages are released.
    (void)cudaStreamSynchronize(stream_);
    pending_.clear();
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(end_);
    (void)cudaStreamDestroy(stream_);
  }

  void submit(QueuedCommand command) override {
    if (command.kind == QueuedCommand::Kind::Barrier) return;  // one in-order stream
    const std::string& label = command.launch.label;
    const cudaError_t stale = cudaGetLastError();
    if (stale != cudaSuccess) {
      throw CommandBufferError("cuda backend: CUDA error pending before launching '" + label +
                                   "': " + cuda_error_text(stale),
                               label);
    }
    if (!started_) {
      const cudaError_t e = cudaEventRecord(start_, stream_);
      if (e != cudaSuccess) {
        throw CommandBufferError(
            "cuda backend: cudaEventRecord before '" + label + "' failed: " + cuda_error_text(e),
            label);
      }
      started_ = true;
    }
    try {
      command.fn(command.launch, static_cast<void*>(stream_));
    } catch (const CommandBufferError&) {
      throw;
    } catch (const Error& e) {
      throw CommandBufferError(e.what(), label);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      throw CommandBufferError(
          "cuda backend: launch of '" + label + "' failed: " + cuda_error_text(e), label);
    }
    pending_.push_back(std::move(command));
  }

  void commit_and_wait() override { finish(nullptr); }

  GpuInterval commit_wait_with_gpu_time() override {
    float ms = 0;
    finish(&ms);
    return {0.0, static_cast<double>(ms) / 1e3};
  }

 private:
  void finish(float* elapsed_ms) {
    const bool timed = elapsed_ms != nullptr && started_;
    cudaError_t e = cudaSuccess;
    if (timed) e = cudaEventRecord(end_, stream_);
    const cudaError_t sync = cudaStreamSynchronize(stream_);
    if (e == cudaSuccess) e = sync;
    if (e == cudaSuccess && timed) e = cudaEventElapsedTime(elapsed_ms, start_, end_);
    std::string labels;
    for (const auto& c : pending_) {
      if (labels.find(c.launch.label) == std::string::npos)
        labels += (labels.empty() ? "" : ", ") + c.launch.label;
    }
    pending_.clear();
    started_ = false;
    if (e != cudaSuccess) {
      throw CommandBufferError("cuda backend: command buffer failed: " + cuda_error_text(e) +
                               (labels.empty() ? std::string() : " (pipelines: " + labels + ")"));
    }
  }

  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t end_ = nullptr;
  bool started_ = false;
  std::vector<QueuedCommand> pending_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    check(cudaSetDevice(0), "cudaSetDevice(0)");
    check(cudaGetDeviceProperties(&prop_, 0), "cudaGetDeviceProperties");
    check(cudaDriverGetVersion(&driver_version_), "cudaDriverGetVersion");
    check(cudaRuntimeGetVersion(&runtime_version_), "cudaRuntimeGetVersion");
    // Stable identity: FNV-1a over the device UUID (the same physical GPU in every process).
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(prop_.uuid.bytes); ++i) {
      h ^= static_cast<uint8_t>(prop_.uuid.bytes[i]);
      h *= 1099511628211ull;
    }
    registry_id_ = h;
    add_dense_matmul_id_kernels(kernels_);
    add_dense_matmul_id_tensor_kernels(kernels_);
    add_q4_matmul_kernels(kernels_);
    add_quantized_matmul_id_kernels(kernels_);
    add_moe_kernels(kernels_);
    add_calibration_kernels(kernels_);
  }

  std::string_view name() const override { return "cuda"; }
  std::string device_name() const override { return prop_.name; }
  uint64_t registry_id() const override { return registry_id_; }
  std::map<std::string, std::string> properties() const override {
    char pci[32];
    std::snprintf(pci, sizeof pci, "%04x:%02x:%02x.0", prop_.pciDomainID, prop_.pciBusID,
                  prop_.pciDeviceID);
    char uuid[40];
    char* p = uuid;
    for (size_t i = 0; i < 16; ++i)
      p += std::snprintf(p, 3, "%02x", static_cast<uint8_t>(prop_.uuid.bytes[i]));
    return {{"driver_version", version_text(driver_version_)},
            {"runtime_version", version_text(runtime_version_)},
            {"compute_capability", std::to_string(prop_.major) + "." + std::to_string(prop_.minor)},
            {"sm_count", std::to_string(prop_.multiProcessorCount)},
            {"l2_bytes", std::to_string(prop_.l2CacheSize)},
            {"global_memory_bytes", std::to_string(prop_.totalGlobalMem)},
            {"pci_bus_id", pci},
            {"uuid", uuid}};
  }
  bool host_accessible() const override { return false; }
  int32_t dlpack_device_type() const override { return 2; }
  int32_t device_ordinal() const override { return 0; }

  void wait_for_external_stream(uint64_t stream) override {
    // __cuda_array_interface__ / DLPack conventions: 1 legacy default stream, 2 per-thread default.
    cudaStream_t s = stream <= 1   ? cudaStreamLegacy
                     : stream == 2 ? cudaStreamPerThread
                                   : reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize(external stream)");
  }

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    void* data = nullptr;
    const cudaError_t e = cudaMalloc(&data, nbytes == 0 ? 1 : nbytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
      const std::string message = "cuda backend: cannot allocate " + std::to_string(nbytes) +
                                  " bytes (" + cuda_error_text(e) + ")";
      if (e == cudaErrorMemoryAllocation) throw OutOfMemory(message);
      throw Error(message);
    }
    return std::make_shared<Storage>(shared_from_this(), data, nbytes, true);
  }
  void deallocate(void* data, size_t) noexcept override { (void)cudaFree(data); }
  void copy_from_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes == 0) return;
    check(cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
    // A pageable host-to-device cudaMemcpy may return before its DMA lands; kernels run on other
    // streams, so wait for the legacy stream that carried the copy.
    check(cudaStreamSynchronize(cudaStreamLegacy),
          "cudaStreamSynchronize after host to device copy");
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes == 0) return;
    check(cudaMemcpy(dst, src, nbytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }

  std::unique_ptr<Queue> create_queue() override { return std::make_unique<CudaQueue>(); }
  const std::vector<KernelDef>& kernels() const override { return kernels_; }

 private:
  cudaDeviceProp prop_{};
  int driver_version_ = 0;
  int runtime_version_ = 0;
  uint64_t registry_id_ = 0;
  std::vector<KernelDef> kernels_;
};

// Why no device can be opened, in the user's terms. Without an NVIDIA driver the runtime reports
// cudaErrorInsufficientDriver ("driver version is insufficient"), which reads as if an older driver
// were installed: a driver version of 0 means none is, and that is what the reason says.
std::string probe() {
  try {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      int driver = 0;
      const bool no_driver = cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0;
      (void)cudaGetLastError();
      if (no_driver) return "no NVIDIA GPU or driver found (no NVIDIA driver is loaded)";
      if (e == cudaErrorNoDevice)
        return "no NVIDIA GPU or driver found (" + std::string(cudaGetErrorString(e)) + ")";
      return "no CUDA device: " + std::string(cudaGetErrorString(e));
    }
    if (count <= 0) return "no NVIDIA GPU or driver found (cudaGetDeviceCount returned 0)";
    return std::string();
  } catch (const std::exception& ex) {
    return std::string("no CUDA device: ") + ex.what();
  } catch (...) {
    return "no CUDA device: unknown error";
  }
}

}  // namespace

void register_cuda_backend() {
  register_backend(BackendEntry{"cuda", 20, probe, []() -> std::shared_ptr<Backend> {
                                  // Process-wide, for device 0; a failed open is retried next time.
                                  static std::mutex mutex;
                                  static std::shared_ptr<Backend> backend;
                                  std::lock_guard<std::mutex> lock(mutex);
                                  if (!backend) backend = std::make_shared<CudaBackend>();
                                  return backend;
                                }});
}

}  // namespace routemm::cuda
