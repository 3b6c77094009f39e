// CommandEncoder: records dispatches and barriers for one backend queue, then commits them.
//
// Lifecycle (spec §2.1): dispatches are recorded into the current submission (command buffer);
// nothing runs before a commit, so dropping an encoder never runs its uncommitted work. commit()
// starts the submission and returns at once (the CPU backend runs it on its submission thread, CUDA
// launches it on the encoder's stream, Metal commits the command buffer); the encoder then records
// into a new submission. wait_until_completed() blocks until every committed submission is done
// and raises the first failure among them (CommandBufferError). commit_and_wait() is both.
// Dropping an encoder with committed work in flight waits for that work (its buffers must outlive
// it) and drops any error: call wait_until_completed() to see them.
//
// Streams: an encoder made with EncoderOptions::stream enqueues on the caller's CUDA stream; it
// creates no stream, and only wait_until_completed() waits on the host.
//
// Modes: normal (dispatches go to the queue), capture (dispatches and barriers are recorded as
// CapturedNodes with declared read/write byte ranges and nothing executes), and an optional
// dispatch receipt that records every dispatch while it still executes normally. A receipt cannot
// be opened while capturing, nor capture started while a receipt is open.
//
// Threads: an encoder belongs to one thread at a time. It may move between threads, but a call
// that enters it while another thread is inside it (e.g. a dispatch while another thread's
// commit_and_wait runs) is refused with routemm::Error and changes nothing; it never races.
// Encoders are cheap: give each thread its own. An op that makes several calls holds a
// CommandEncoder::Use across them, so another thread cannot slip in between and leave it half
// encoded.
//
// All or nothing: an op that encodes more than one dispatch holds a CommandEncoder::Transaction
// across them, so a call refused partway (a check of its second dispatch, a pipeline lookup)
// leaves the encoder exactly as it was -- same pending dispatches, captured nodes, receipt and
// barrier tracker, and nothing a later commit would run.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "routemm/backend.h"
#include "routemm/buffer.h"

namespace routemm {

class Pipeline;

// An argument bound to a slot: a buffer at its own byte_offset, a buffer at an explicit offset
// (used verbatim, ignoring the view's offset), or inline bytes.
struct KernelArg {
  enum class Kind : uint8_t { Buffer, BufferWithOffset, Bytes };
  Kind kind = Kind::Bytes;
  Buffer buffer;
  uint64_t offset = 0;
  std::vector<uint8_t> bytes;

  static KernelArg of(const Buffer& buffer);
  static KernelArg at(const Buffer& buffer, uint64_t offset);
  static KernelArg raw(const void* data, size_t size);
  template <class T>
  static KernelArg pod(const T& value) {
    return raw(&value, sizeof(T));
  }
};

struct ByteRange {
  uint64_t start = 0;
  uint64_t end = 0;
  bool operator==(const ByteRange&) const = default;
};

struct EncodedKernelDispatch {
  std::string pipeline_label;
  DispatchKind dispatch_kind = DispatchKind::ThreadGroups;
  std::array<uint64_t, 3> grid{};  // threadgroup count (ThreadGroups) or thread count (Threads)
  std::array<uint64_t, 3> threads_per_threadgroup{};
  std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory;  // (index, bytes)
  bool operator==(const EncodedKernelDispatch&) const = default;
};

struct CapturedBinding {
  uint32_t slot = 0;
  bool is_bytes = false;
  uint64_t address = 0;  // Buffer: base address of the allocation
  uint64_t offset = 0;   // Buffer: bound byte offset
  std::vector<uint8_t> bytes;
};

// What a dispatch does, for graph reordering (spec §2.4): Sdpa and Softmax dispatches are never
// moved, every other kind may be.
enum class OpKind : uint8_t { Other, RmsNorm, ElemMul, ElemAdd, Sdpa, Softmax };
std::string_view to_string(OpKind kind);
OpKind op_kind_from_string(std::string_view name);  // InvalidArgument for an unknown name
bool is_reorderable(OpKind kind);

struct CapturedNode {
  enum class Kind : uint8_t { Dispatch, Barrier };
  Kind kind = Kind::Barrier;
  EncodedKernelDispatch dispatch;  // Dispatch only
  std::vector<CapturedBinding> bindings;
  std::vector<ByteRange> reads;
  std::vector<ByteRange> writes;
  OpKind op_kind = OpKind::Other;
  // Dispatch only: the resolved command, kept (with the storages it binds) so the capture can be
  // replayed (graph.h).
  std::shared_ptr<const QueuedCommand> command;
};

// Process-wide counters, for tests that prove "nothing was encoded" and benches that prove a call
// path free of streams, allocations and host waits (spec §2.1 plus the backends' activity).
struct EncoderCounters {
  uint64_t encoders_created = 0;
  uint64_t command_buffers = 0;  // submissions opened: one per encoder and one after each commit
  uint64_t dispatches = 0;
  uint64_t barriers = 0;
  uint64_t commits = 0;
  uint64_t waits = 0;               // wait_until_completed() calls, commit_and_wait*() included
  uint64_t streams_created = 0;     // note_stream_created()
  uint64_t device_allocations = 0;  // note_device_allocation()
  uint64_t host_waits = 0;          // note_host_wait()
};

struct EncoderOptions {
  // A caller's CUDA stream (QueueOptions::stream); unset: the encoder's own queue.
  std::optional<uint64_t> stream;
  // The automatic-barrier tracker (spec §2.5); unset: ROUTEMM_ENCODER_AUTO_BARRIER.
  std::optional<bool> auto_barrier;
};
EncoderCounters encoder_counters();
uint64_t dispatch_count();
void reset_encoder_counters();

class CommandEncoder {
 public:
  // A thread's hold on the encoder for a scope (see "Threads" above): refused with routemm::Error
  // naming `call` while another thread holds it; nested holds by the same thread are free.
  class [[nodiscard]] Use {
   public:
    Use(const CommandEncoder& encoder, const char* call);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    std::atomic<std::thread::id>& owner_;
    bool outermost_ = false;
  };

  // Holds the encoder (as Use) and makes everything encoded until commit() one unit: dispatches,
  // barriers and graphs are held back and reach the queue (and the process counters) when the
  // outermost transaction commits; one destroyed without commit() -- its op refused partway --
  // removes what was encoded since it opened and restores the encoder's state. Transactions of
  // one thread nest: an inner one joins the outermost. Inside one, commit, capture and receipt
  // start/take and set_auto_barrier are refused (they would split the unit).
  class [[nodiscard]] Transaction {
   public:
    Transaction(CommandEncoder& encoder, const char* call);
    ~Transaction();
    Transaction(const Transaction&) = delete;
    Transaction& operator=(const Transaction&) = delete;
    void commit();

   private:
    CommandEncoder& encoder_;
    Use use_;
    struct Saved {
      size_t staged = 0, captured = 0, receipt = 0;
      uint64_t pending_dispatches = 0, held_dispatches = 0, held_barriers = 0;
      OpKind op_kind = OpKind::Other;
      std::vector<ByteRange> pending_reads, pending_writes, tracked_reads, tracked_writes;
      bool tracked_unknown = false;
    } saved_;
    bool outermost_ = false;
    bool open_ = true;
  };

  explicit CommandEncoder(std::shared_ptr<Backend> backend, EncoderOptions options = {});
  ~CommandEncoder();
  CommandEncoder(CommandEncoder&&) noexcept;
  CommandEncoder& operator=(CommandEncoder&&) noexcept;

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  uint64_t device_registry_id() const;

  // Ranges attached to the next captured dispatch, then cleared. Ignored outside capture mode.
  void set_pending_buffer_ranges(std::vector<ByteRange> reads, std::vector<ByteRange> writes);
  // Tags the next dispatch (captured nodes carry it), then resets to Other.
  void set_op_kind(OpKind kind);

  // Encode one dispatch. Arguments must live on this encoder's backend, and satisfy the kernel's
  // argument contract (KernelDef::check_args), checked before anything is encoded.
  void dispatch(const Pipeline& pipeline, std::span<const std::pair<uint32_t, KernelArg>> args,
                Dim3 grid, Dim3 threads, DispatchKind kind = DispatchKind::ThreadGroups,
                std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory = {});
  // dispatch() with the buffers the kernel reads and writes (spec §2.3), as their logical ranges:
  // in capture mode they become the node's ranges; otherwise, with the automatic-barrier tracker
  // on, a barrier goes before the dispatch when its ranges conflict with those tracked since the
  // last barrier (a read of a tracked write, or a write of anything tracked), and the tracker
  // restarts from this dispatch.
  void dispatch_tracked(const Pipeline& pipeline,
                        std::span<const std::pair<uint32_t, KernelArg>> args, Dim3 grid,
                        Dim3 threads, DispatchKind kind,
                        std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory,
                        std::span<const Buffer> reads, std::span<const Buffer> writes);
  // Orders every later dispatch after every earlier one. A no-op before the first dispatch of a
  // submission; always recorded in capture mode.
  void memory_barrier();
  // The automatic-barrier tracker (spec §2.5). While it is on, a dispatch without tracked ranges
  // is ordered after everything before it and before everything after it.
  bool auto_barrier() const;
  void set_auto_barrier(bool on);
  // A barrier (as memory_barrier) and an empty tracker.
  void force_barrier_and_reset_tracker();
  // Records one instantiated graph (CapturedGraph::instantiate) as a single command of the current
  // submission; `keep_alive` are the storages its dispatches bind.
  void encode_graph(std::shared_ptr<const GraphExec> graph,
                    std::vector<std::shared_ptr<Storage>> keep_alive);
  // Records a captured dispatch again (graph replay): as a node when capturing, else submitted.
  void encode_captured(const CapturedNode& node);

  // Starts everything encoded so far and returns without waiting. `label` (commit_labeled) names
  // the submission in the backend's profiler: 1 to 256 printable ASCII characters.
  void commit();
  void commit_labeled(std::string_view label);
  // Blocks until every committed submission completed; the first failure among them is raised.
  void wait_until_completed();
  // commit() then wait_until_completed().
  void commit_and_wait();
  void commit_and_wait_labeled(std::string_view label);
  // Same, returning the GPU start/end of the submission in seconds.
  GpuInterval commit_wait_with_gpu_time();
  // Dispatches encoded since the last commit.
  uint64_t pending_dispatches() const;

  void start_capture();
  bool is_capturing() const;
  // The recorded nodes, ending capture; nullopt when not capturing.
  std::optional<std::vector<CapturedNode>> take_capture();

  // Opens a receipt that records up to `capacity` dispatches (capacity > 0).
  void start_encoded_dispatch_receipt(size_t capacity);
  bool has_open_receipt() const;
  // Dispatches the open receipt can still record (SIZE_MAX when none is open). Op front doors check
  // this before encoding so an over-full receipt fails before anything is encoded.
  size_t receipt_slots_left() const;
  // Closes the receipt and returns its dispatches; an error when none is open.
  std::vector<EncodedKernelDispatch> take_encoded_dispatch_receipt();

 private:
  // The thread holding the encoder (no thread: free). Every call holds it for its duration. Moving
  // an encoder gives the new one a free owner: an encoder in use is not being moved by another.
  struct Owner {
    Owner() = default;
    Owner(Owner&&) noexcept {}
    Owner& operator=(Owner&&) noexcept { return *this; }
    std::atomic<std::thread::id> thread{};
  };

  // A dispatch checked and resolved, not yet encoded: everything that can refuse it has run.
  struct Prepared {
    QueuedCommand command;
    CapturedNode node;  // filled when recording (capture or receipt)
    bool recording = false;
  };
  Prepared prepare(const Pipeline& pipeline, std::span<const std::pair<uint32_t, KernelArg>> args,
                   Dim3 grid, Dim3 threads, DispatchKind kind,
                   std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory);
  void submit_dispatch(QueuedCommand command, CapturedNode node, bool recording);
  // To the queue, or held back while a transaction is open; the counters likewise.
  void enqueue(QueuedCommand command);
  void count(std::atomic<uint64_t>& counter, uint64_t& held, uint64_t n);
  void refuse_in_transaction(const char* call) const;
  void barrier_unlocked();
  void commit_unlocked(std::string_view label, bool timed);

  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Queue> queue_;
  mutable Owner owner_;
  OpKind pending_op_kind_ = OpKind::Other;
  bool auto_barrier_ = false;
  // Ranges read and written since the last barrier (tracker on); `tracked_unknown_`: a dispatch
  // without ranges was encoded since, so the next one conflicts.
  std::vector<ByteRange> tracked_reads_, tracked_writes_;
  bool tracked_unknown_ = false;
  bool capturing_ = false;
  std::vector<CapturedNode> captured_;
  std::vector<ByteRange> pending_reads_, pending_writes_;
  struct Receipt {
    size_t capacity = 0;
    std::vector<EncodedKernelDispatch> dispatches;
  };
  std::optional<Receipt> receipt_;
  uint64_t pending_dispatches_ = 0;
  // Open transactions and what they hold back (see Transaction).
  uint32_t transaction_depth_ = 0;
  std::vector<QueuedCommand> staged_;
  uint64_t held_dispatches_ = 0, held_barriers_ = 0;
};

}  // namespace routemm
