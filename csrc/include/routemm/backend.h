// The contract between the backend-neutral core and a backend (cpu, cuda, metal).
//
// A backend owns device memory (Storage), executes recorded commands in order on a Queue, and
// supplies kernels by name (KernelDef). It never validates op arguments: op front doors in the core
// do that before anything reaches a backend.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace routemm {

class Backend;

struct Dim3 {
  uint64_t x = 1, y = 1, z = 1;
  std::array<uint64_t, 3> array() const { return {x, y, z}; }
  bool operator==(const Dim3&) const = default;
};

// Which dispatch call a launch corresponds to: a grid of threads, or a grid of threadgroups (blocks).
enum class DispatchKind : uint8_t { Threads, ThreadGroups };

// One allocation on a backend. Shared by every Buffer view of it; freed when the last view goes.
class Storage {
 public:
  // `release` (optional) frees externally owned memory (e.g. a DLPack producer's tensor); when
  // empty, the owning backend frees `data`.
  Storage(std::shared_ptr<Backend> backend, void* data, size_t nbytes, bool writable,
          std::function<void()> release = {}, bool file_backed = false);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  bool writable() const { return writable_; }
  // The memory is a mapping of a file (e.g. a GGUF tensor wrapped without copying).
  bool file_backed() const { return file_backed_; }

 private:
  std::shared_ptr<Backend> backend_;
  void* data_;
  size_t nbytes_;
  bool writable_;
  std::function<void()> release_;
  bool file_backed_;
};

// An argument as a kernel sees it, by slot.
struct BoundArg {
  enum class Kind : uint8_t { Empty, Buffer, Bytes };
  Kind kind = Kind::Empty;
  void* data = nullptr;   // Buffer: device address of the bound byte; Bytes: host copy of the data
  size_t size = 0;        // Buffer: bytes from `data` to the end of the allocation; Bytes: length
  bool writable = false;  // Buffer: the storage may be written (false for read-only mappings)
};

inline constexpr size_t kMaxKernelSlots = 16;

// Everything one kernel invocation needs, after the core has resolved arguments.
struct KernelLaunch {
  std::string label;  // pipeline label, for error messages
  DispatchKind kind = DispatchKind::ThreadGroups;
  Dim3 grid;
  Dim3 threads;
  std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory;  // (index, bytes)
  std::vector<std::pair<uint32_t, int32_t>> int_constants;        // specialisation constants
  std::array<BoundArg, kMaxKernelSlots> args{};
};

// A backend kernel entry point. `queue_native` is the backend's own queue handle (CUDA stream,
// CPU thread pool); kernels must report failures by throwing routemm::Error.
using KernelFn = void (*)(const KernelLaunch& launch, void* queue_native);

// A kernel's argument contract (backend/common/kernel_contracts.h): validates a launch's bindings
// against what the kernel will touch (slot kinds, the byte extents its params imply from each
// bound byte, alignment for each slot's element type, written slots writable), throwing
// InvalidArgument naming the pipeline. CommandEncoder::dispatch runs it before anything is encoded
// or recorded, so even a raw dispatch that no op front door validated cannot reach memory outside
// its bindings. It never reads device memory.
using KernelArgCheck = void (*)(const KernelLaunch& launch);

// A kernel a backend supplies under a pipeline name. The launch fields describe this backend's
// geometry for the pipeline; each op documents what they mean for its pipelines.
struct KernelDef {
  std::string name;
  KernelFn fn = nullptr;
  // Required: a kernel without a contract cannot be registered or dispatched.
  KernelArgCheck check_args = nullptr;
  uint64_t max_threads_per_threadgroup = 1024;
  uint32_t threads_per_group = 1;  // threads per threadgroup / block
  uint32_t tile_x = 1;             // op-specific tile extents used to size the grid
  uint32_t tile_y = 1;
  uint64_t threadgroup_memory_bytes = 0;
  // Nonzero for a persistent kernel: it walks a work list whose tiles the tile fields describe, so
  // the front door encodes grid [min(persistent_groups, number of tiles), 1, 1] instead of the tile
  // grid, and the receipt shows the launch as it happens.
  uint32_t persistent_groups = 0;
  // Nonzero: the kernel may split its reduction dimension across up to `k_split_max` groups along
  // grid.z (groups of one split reduce their partial results in a fixed order, so the split changes
  // no bits run to run). The op front door picks the split from the shape alone, aiming for at least
  // `k_split_target_groups` groups in all; each op documents its formula.
  uint32_t k_split_max = 0;
  uint32_t k_split_target_groups = 0;
  // The function behind the pipeline: the backend's own kernel name. Registering a kernel under
  // another name keeps it, so an identity shows which code a name resolves to. Empty: `name`.
  std::string entry_point;
  std::string origin;  // where the code comes from: "builtin_cpu", "cuda_fatbin", "metallib"
  std::string content_sha256;  // hash over what was compiled (source text or machine image)
};

class GraphExec;

// A recorded command for a queue: one kernel launch, a memory barrier between launches, or the
// launch of an instantiated graph (Backend::instantiate_graph).
struct QueuedCommand {
  enum class Kind : uint8_t { Dispatch, Barrier, Graph };
  Kind kind = Kind::Dispatch;
  KernelFn fn = nullptr;
  KernelLaunch launch;
  std::vector<std::vector<uint8_t>> inline_bytes;    // owns Bytes arguments
  std::vector<std::shared_ptr<Storage>> keep_alive;  // storages referenced by the launch
  std::shared_ptr<const GraphExec> graph;            // Graph only
};

// GPU start/end timestamps of one submission, in seconds on the backend's own clock.
struct GpuInterval {
  double start_s = 0;
  double end_s = 0;
};

// Where a queue puts its work. `stream` names a caller's CUDA stream (a cudaStream_t as an integer;
// 0 and 1 the legacy default stream, 2 the per-thread default stream): the queue then enqueues
// there, creates no stream and never waits on the host unless asked to. Unset: the queue's own.
// Backends without streams refuse a stream.
struct QueueOptions {
  std::optional<uint64_t> stream;
};

// An ordered stream of work, in submissions (command buffers).
//
// submit() only records: nothing runs before commit(), so a queue dropped with uncommitted work
// never runs it. commit() starts everything submitted since the previous commit as one submission
// and returns without waiting; submissions complete in commit order and the queue is ready for the
// next one at once. wait() blocks until every committed submission has completed and reports the
// first failure among them as CommandBufferError; it returns the GPU interval of the last
// submission committed with `timed` (zeros when none was). A queue destroyed with committed work
// in flight waits for it first (its storages must outlive the work) and drops any error.
class Queue {
 public:
  virtual ~Queue() = default;
  virtual void submit(QueuedCommand command) = 0;
  // `label` (may be empty) names the submission in the backend's profiler: an NVTX range on CUDA,
  // the command buffer's label on Metal.
  virtual void commit(const std::string& label, bool timed) = 0;
  virtual GpuInterval wait() = 0;
};

// A graph of dispatches instantiated by a backend (a CUDA graph): launched as one command.
class GraphExec {
 public:
  virtual ~GraphExec() = default;
  virtual size_t node_count() const = 0;
  virtual size_t edge_count() const = 0;
};

// One dispatch of a graph to instantiate, with the dispatches (by index, all earlier) it must run
// after. Dispatches with no path between them may run concurrently.
struct GraphDispatch {
  const QueuedCommand* command = nullptr;
  std::vector<size_t> after;
};

class Backend : public std::enable_shared_from_this<Backend> {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  virtual std::string device_name() const = 0;
  // Stable across processes for the same physical device (PCI location, UUID, Metal registryID).
  virtual uint64_t registry_id() const = 0;
  // Extra facts for receipts and plan validators (driver/runtime versions, capability).
  virtual std::map<std::string, std::string> properties() const { return {}; }
  // True when host code may dereference Storage::data() directly.
  virtual bool host_accessible() const = 0;
  // DLPack device type (1 cpu, 2 cuda, 8 metal) and ordinal of this backend's device.
  virtual int32_t dlpack_device_type() const = 0;
  virtual int32_t device_ordinal() const { return 0; }
  // Makes later work on this backend's queues wait for work a producer queued on its own stream
  // (a CUDA stream handle; 0 or absent for backends without streams).
  virtual void wait_for_external_stream(uint64_t stream) { (void)stream; }

  virtual std::shared_ptr<Storage> allocate(size_t nbytes) = 0;
  // Frees memory this backend allocated; called by Storage's destructor.
  virtual void deallocate(void* data, size_t nbytes) noexcept = 0;
  virtual void copy_from_host(void* device_dst, const void* host_src, size_t nbytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* device_src, size_t nbytes) = 0;

  virtual std::unique_ptr<Queue> create_queue(const QueueOptions& options) = 0;
  // A graph of the given dispatches whose only orderings are their `after` edges, launched as one
  // command (QueuedCommand::Kind::Graph) on this backend's queues; nullptr where the backend has no
  // graph object (callers then replay the dispatches through a queue with barriers).
  virtual std::shared_ptr<const GraphExec> instantiate_graph(
      const std::vector<GraphDispatch>& dispatches) {
    (void)dispatches;
    return nullptr;
  }
  // Every kernel this backend supplies; registries start from this list.
  virtual const std::vector<KernelDef>& kernels() const = 0;
  // Compiles kernel source text into a kernel registered as `name` (the function of that name in
  // `source`). Only backends with a run-time compiler do; the default refuses with a message
  // naming the backend, and so do the CPU and CUDA backends, whose kernels are built in.
  virtual KernelDef compile_kernel_source(const std::string& name, const std::string& source);
};

// ---- Activity counters --------------------------------------------------------------------------

// Backends report their costly actions here (process-wide, read through encoder_counters()), so a
// test or bench can show that a call path creates no stream, allocates no device memory and never
// blocks the host: a stream created by a queue, a device allocation (cudaMalloc, aligned_alloc), a
// host wait for device work (a queue's wait, a stream synchronisation, a blocking copy).
void note_stream_created();
void note_device_allocation();
void note_host_wait();

// ---- Backend discovery -------------------------------------------------------------------------

struct BackendEntry {
  std::string name;
  int priority = 0;  // higher wins when no backend is named
  // Empty string when the backend can open a device here, else why not ("not built", "no device").
  std::function<std::string()> probe;
  std::function<std::shared_ptr<Backend>()> open;
};

void register_backend(BackendEntry entry);
const std::vector<BackendEntry>& backend_entries();

}  // namespace routemm
