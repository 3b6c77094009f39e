// The CUDA backend: device 0, cudaMalloc'd storage, and queues on streams.
//
// Queue model: submit() only records (a dropped encoder's uncommitted work never runs); commit()
// launches the submission's commands in order on the queue's stream (one in-order stream, so
// memory barriers are no-ops) and returns; wait() synchronises and reports any asynchronous failure
// as CommandBufferError naming the pipelines of the submissions it waited for.
//
// A queue either owns a blocking stream (ordered after the legacy default stream, where DLPack
// producers are asked to order their pending writes) and keeps the storages and inline argument
// bytes of committed commands alive until wait(), or enqueues on a caller's stream: then it creates
// no stream and no event unless a timed commit asks for them, never waits on the host except in
// wait(), and lets go of committed commands once they are launched. Memory bound to work on a
// caller's stream follows that stream's order, as the caller's framework allocator expects
// (PyTorch's and CuPy's caching allocators reuse a block on the stream that freed it only after the
// work queued before); routemm's own allocations are released with cudaFree, which waits for the
// device.
#include <cuda_runtime.h>

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define ROUTEMM_HAVE_NVTX 1
#endif

#include <algorithm>
#include <atomic>
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

// __cuda_array_interface__ / DLPack conventions: 0 or 1 the legacy default stream, 2 the
// per-thread default stream, anything else a cudaStream_t.
cudaStream_t stream_of(uint64_t handle) {
  return handle <= 1   ? cudaStreamLegacy
         : handle == 2 ? cudaStreamPerThread
                       : reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(handle));
}

// Appends each distinct pipeline label of `commands` to `labels`.
void collect_labels(const std::vector<QueuedCommand>& commands, std::string& labels) {
  for (const auto& c : commands) {
    if (c.kind != QueuedCommand::Kind::Dispatch) continue;
    if (labels.find(c.launch.label) == std::string::npos)
      labels += (labels.empty() ? "" : ", ") + c.launch.label;
  }
}

// A CUDA graph instantiated from dispatches and their ordering edges (see instantiate_graph).
class CudaGraphExec final : public GraphExec {
 public:
  CudaGraphExec(cudaGraphExec_t exec, size_t nodes, size_t edges, std::string labels)
      : exec_(exec), nodes_(nodes), edges_(edges), labels_(std::move(labels)) {}
  ~CudaGraphExec() override { (void)cudaGraphExecDestroy(exec_); }
  size_t node_count() const override { return nodes_; }
  size_t edge_count() const override { return edges_; }
  cudaGraphExec_t exec() const { return exec_; }
  const std::string& labels() const { return labels_; }

 private:
  cudaGraphExec_t exec_;
  size_t nodes_, edges_;
  std::string labels_;
};

class CudaQueue final : public Queue {
 public:
  explicit CudaQueue(const QueueOptions& options) {
    if (options.stream) {
      stream_ = stream_of(*options.stream);
      return;
    }
    check(cudaSetDevice(0), "cudaSetDevice(0)");
    // A blocking stream: it waits for work on the legacy default stream, which is where DLPack
    // producers are asked (stream=1) to order their pending writes before handing a tensor over.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreateWithFlags");
    owns_stream_ = true;
    note_stream_created();
  }
  ~CudaQueue() override {
    // Work still in flight must finish before its storages are released.
    if (owns_stream_ || !committed_.empty()) (void)cudaStreamSynchronize(stream_);
    committed_.clear();
    if (start_ != nullptr) (void)cudaEventDestroy(start_);
    if (end_ != nullptr) (void)cudaEventDestroy(end_);
    if (owns_stream_) (void)cudaStreamDestroy(stream_);
  }

  void submit(QueuedCommand command) override {
    if (command.kind == QueuedCommand::Kind::Barrier) return;  // one in-order stream
    pending_.push_back(std::move(command));
  }

  void commit(const std::string& label, bool timed) override {
    auto commands = std::move(pending_);
    pending_.clear();
#ifdef ROUTEMM_HAVE_NVTX
    if (!label.empty()) nvtxRangePushA(label.c_str());
    struct RangeEnd {
      bool on;
      ~RangeEnd() {
        if (on) nvtxRangePop();
      }
    } range_end{!label.empty()};
#else
    (void)label;
#endif
    if (timed) {
      ensure_events();
      record(start_, "before the submission");
    }
    collect_labels(commands, unwaited_labels_);
    if (owns_stream_) {
      // Kept before launching: a launch that fails part-way leaves earlier launches in flight,
      // and their storages must outlive them.
      const size_t first = committed_.size();
      for (auto& command : commands) committed_.push_back(std::move(command));
      for (size_t i = first; i < committed_.size(); ++i) launch(committed_[i]);
    } else {
      for (const auto& command : commands) launch(command);
    }
    if (timed) {
      record(end_, "after the submission");
      timed_pending_ = true;
    }
  }

  GpuInterval wait() override {
    note_host_wait();
    const cudaError_t sync = cudaStreamSynchronize(stream_);
    cudaError_t e = sync;
    float ms = 0;
    const bool timed = timed_pending_;
    timed_pending_ = false;
    if (e == cudaSuccess && timed) e = cudaEventElapsedTime(&ms, start_, end_);
    std::string labels = std::move(unwaited_labels_);
    unwaited_labels_.clear();
    committed_.clear();
    if (e != cudaSuccess) {
      throw CommandBufferError("cuda backend: command buffer failed: " + cuda_error_text(e) +
                               (labels.empty() ? std::string() : " (pipelines: " + labels + ")"));
    }
    return {0.0, timed ? static_cast<double>(ms) / 1e3 : 0.0};
  }

 private:
  void ensure_events() {
    if (start_ == nullptr) check(cudaEventCreate(&start_), "cudaEventCreate");
    if (end_ == nullptr) check(cudaEventCreate(&end_), "cudaEventCreate");
  }

  void record(cudaEvent_t event, const char* where) {
    if (const cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
      throw CommandBufferError(
          std::string("cuda backend: cudaEventRecord ") + where + " failed: " + cuda_error_text(e),
          "");
    }
  }

  void launch(const QueuedCommand& command) {
    const std::string& label = command.kind == QueuedCommand::Kind::Graph
                                   ? static_cast<const CudaGraphExec&>(*command.graph).labels()
                                   : command.launch.label;
    const cudaError_t stale = cudaGetLastError();
    if (stale != cudaSuccess) {
      throw CommandBufferError("cuda backend: CUDA error pending before launching '" + label +
                                   "': " + cuda_error_text(stale),
                               label);
    }
    if (command.kind == QueuedCommand::Kind::Graph) {
      const auto& graph = static_cast<const CudaGraphExec&>(*command.graph);
      if (const cudaError_t e = cudaGraphLaunch(graph.exec(), stream_); e != cudaSuccess) {
        throw CommandBufferError(
            "cuda backend: launch of the graph of '" + label + "' failed: " + cuda_error_text(e),
            label);
      }
      return;
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
  }

  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t end_ = nullptr;
  bool timed_pending_ = false;
  std::vector<QueuedCommand> pending_;    // submitted, not yet committed
  std::vector<QueuedCommand> committed_;  // launched on an owned stream, kept until wait()
  std::string unwaited_labels_;           // pipelines committed since the last wait()
};

// Captures `dispatches` into one CUDA graph whose edges are exactly their `after` lists: each
// dispatch is captured on a stream whose last dispatch it must follow anyway (or on a stream of its
// own), after waiting on the events of the others it must follow, so stream order adds no edge.
std::shared_ptr<const GraphExec> capture_graph(const std::vector<GraphDispatch>& dispatches) {
  check(cudaSetDevice(0), "cudaSetDevice(0)");
  struct Resources {
    std::vector<cudaStream_t> streams;
    std::vector<cudaEvent_t> events;
    cudaGraph_t graph = nullptr;
    ~Resources() {
      for (auto e : events) (void)cudaEventDestroy(e);
      for (auto s : streams) (void)cudaStreamDestroy(s);
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
    }
    cudaStream_t new_stream() {
      cudaStream_t s = nullptr;
      check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      note_stream_created();
      streams.push_back(s);
      return s;
    }
    cudaEvent_t new_event() {
      cudaEvent_t e = nullptr;
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      events.push_back(e);
      return e;
    }
  } r;
  const cudaStream_t origin = r.new_stream();
  const cudaEvent_t fork = r.new_event();
  std::vector<cudaEvent_t> done(dispatches.size());
  std::vector<size_t> tail;  // per capture stream (index into r.streams - 1): its last dispatch
  std::vector<cudaStream_t> lanes;
  std::string labels;
  size_t edges = 0;
  check(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  cudaError_t failure = cudaSuccess;
  std::string failed;
  try {
    check(cudaEventRecord(fork, origin), "cudaEventRecord(fork)");
    for (size_t i = 0; i < dispatches.size(); ++i) {
      const GraphDispatch& d = dispatches[i];
      edges += d.after.size();
      // A lane whose last dispatch this one follows anyway: reuse it, the stream order is an edge.
      size_t lane = lanes.size();
      for (size_t l = 0; l < lanes.size() && lane == lanes.size(); ++l) {
        if (std::find(d.after.begin(), d.after.end(), tail[l]) != d.after.end()) lane = l;
      }
      if (lane == lanes.size()) {
        lanes.push_back(r.new_stream());
        tail.push_back(SIZE_MAX);
        check(cudaStreamWaitEvent(lanes.back(), fork, 0), "cudaStreamWaitEvent(fork)");
      }
      const cudaStream_t s = lanes[lane];
      for (const size_t before : d.after) {
        if (before >= i)
          throw InvalidArgument("graph dispatch " + std::to_string(i) +
                                " is ordered after a later one");
        if (before != tail[lane])
          check(cudaStreamWaitEvent(s, done[before], 0), "cudaStreamWaitEvent");
      }
      d.command->fn(d.command->launch, static_cast<void*>(s));
      check(cudaGetLastError(), "launch of '" + d.command->launch.label + "' during graph capture");
      done[i] = r.new_event();
      check(cudaEventRecord(done[i], s), "cudaEventRecord");
      tail[lane] = i;
      if (labels.find(d.command->launch.label) == std::string::npos)
        labels += (labels.empty() ? "" : ", ") + d.command->launch.label;
    }
    for (size_t l = 0; l < lanes.size(); ++l) {
      if (tail[l] != SIZE_MAX) check(cudaStreamWaitEvent(origin, done[tail[l]], 0), "join");
    }
  } catch (const std::exception& e) {
    failed = e.what();
    failure = cudaErrorUnknown;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(origin, &graph);
  r.graph = graph;
  if (failure != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("cuda backend: capturing a graph failed: " + failed);
  }
  check(end, "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  return std::make_shared<CudaGraphExec>(exec, dispatches.size(), edges, labels);
}

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
    add_q8_matmul_kernels(kernels_);
    add_quantized_matmul_id_kernels(kernels_);
    add_moe_kernels(kernels_);
    add_moe_fused_kernels(kernels_);
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
    note_host_wait();
    check(cudaStreamSynchronize(stream_of(stream)), "cudaStreamSynchronize(external stream)");
  }

  std::shared_ptr<Storage> allocate(size_t nbytes) override {
    void* data = nullptr;
    note_device_allocation();
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
    note_host_wait();
    check(cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
    // A pageable host-to-device cudaMemcpy may return before its DMA lands; kernels run on other
    // streams, so wait for the legacy stream that carried the copy.
    check(cudaStreamSynchronize(cudaStreamLegacy),
          "cudaStreamSynchronize after host to device copy");
  }
  void copy_to_host(void* dst, const void* src, size_t nbytes) override {
    if (nbytes == 0) return;
    note_host_wait();
    check(cudaMemcpy(dst, src, nbytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
  }

  std::unique_ptr<Queue> create_queue(const QueueOptions& options) override {
    return std::make_unique<CudaQueue>(options);
  }
  std::shared_ptr<const GraphExec> instantiate_graph(
      const std::vector<GraphDispatch>& dispatches) override {
    return capture_graph(dispatches);
  }
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
