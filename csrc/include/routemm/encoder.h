// CommandEncoder: records dispatches and barriers for one backend queue, then commits them.
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
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
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

struct CapturedNode {
  enum class Kind : uint8_t { Dispatch, Barrier };
  Kind kind = Kind::Barrier;
  EncodedKernelDispatch dispatch;  // Dispatch only
  std::vector<CapturedBinding> bindings;
  std::vector<ByteRange> reads;
  std::vector<ByteRange> writes;
};

// Process-wide counters, for tests that prove "nothing was encoded".
struct EncoderCounters {
  uint64_t encoders_created = 0;
  uint64_t dispatches = 0;
  uint64_t barriers = 0;
  uint64_t commits = 0;
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

  explicit CommandEncoder(std::shared_ptr<Backend> backend);
  ~CommandEncoder();
  CommandEncoder(CommandEncoder&&) noexcept;
  CommandEncoder& operator=(CommandEncoder&&) noexcept;

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  uint64_t device_registry_id() const;

  // Ranges attached to the next captured dispatch, then cleared. Ignored outside capture mode.
  void set_pending_buffer_ranges(std::vector<ByteRange> reads, std::vector<ByteRange> writes);

  // Encode one dispatch. Arguments must live on this encoder's backend, and satisfy the kernel's
  // argument contract (KernelDef::check_args), checked before anything is encoded.
  void dispatch(const Pipeline& pipeline, std::span<const std::pair<uint32_t, KernelArg>> args,
                Dim3 grid, Dim3 threads, DispatchKind kind = DispatchKind::ThreadGroups,
                std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory = {});
  // Orders every later dispatch after every earlier one. A no-op before the first dispatch of a
  // submission; always recorded in capture mode.
  void memory_barrier();

  // Runs everything encoded so far and blocks until it completes.
  void commit_and_wait();
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

  std::shared_ptr<Backend> backend_;
  std::unique_ptr<Queue> queue_;
  mutable Owner owner_;
  bool capturing_ = false;
  std::vector<CapturedNode> captured_;
  std::vector<ByteRange> pending_reads_, pending_writes_;
  struct Receipt {
    size_t capacity = 0;
    std::vector<EncodedKernelDispatch> dispatches;
  };
  std::optional<Receipt> receipt_;
  uint64_t pending_dispatches_ = 0;
};

}  // namespace routemm
