// CommandEncoder: argument resolution, capture, receipts and process counters.
#include "routemm/encoder.h"

#include <atomic>
#include <cstring>
#include <string>

#include "routemm/error.h"
#include "routemm/registry.h"

namespace routemm {
namespace {

std::atomic<uint64_t> g_encoders{0}, g_dispatches{0}, g_barriers{0}, g_commits{0};

}  // namespace

EncoderCounters encoder_counters() {
  return {g_encoders.load(), g_dispatches.load(), g_barriers.load(), g_commits.load()};
}
uint64_t dispatch_count() { return g_dispatches.load(); }
void reset_encoder_counters() {
  g_encoders = 0;
  g_dispatches = 0;
  g_barriers = 0;
  g_commits = 0;
}

KernelArg KernelArg::of(const Buffer& buffer) {
  KernelArg arg;
  arg.kind = Kind::Buffer;
  arg.buffer = buffer;
  arg.offset = buffer.byte_offset();
  return arg;
}

KernelArg KernelArg::at(const Buffer& buffer, uint64_t offset) {
  KernelArg arg;
  arg.kind = Kind::BufferWithOffset;
  arg.buffer = buffer;
  arg.offset = offset;
  return arg;
}

KernelArg KernelArg::raw(const void* data, size_t size) {
  KernelArg arg;
  arg.kind = Kind::Bytes;
  arg.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
  return arg;
}

CommandEncoder::Use::Use(const CommandEncoder& encoder, const char* call)
    : owner_(encoder.owner_.thread) {
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id holder{};
  if (owner_.compare_exchange_strong(holder, me, std::memory_order_acquire)) {
    outermost_ = true;
  } else if (holder != me) {
    throw Error(std::string("CommandEncoder.") + call +
                ": the encoder is in use by another thread (an encoder belongs to one thread at a "
                "time; give each thread its own)");
  }
}

CommandEncoder::Use::~Use() {
  if (outermost_) owner_.store(std::thread::id{}, std::memory_order_release);
}

CommandEncoder::CommandEncoder(std::shared_ptr<Backend> backend)
    : backend_(std::move(backend)), queue_(backend_->create_queue()) {
  ++g_encoders;
}

CommandEncoder::~CommandEncoder() = default;
CommandEncoder::CommandEncoder(CommandEncoder&&) noexcept = default;
CommandEncoder& CommandEncoder::operator=(CommandEncoder&&) noexcept = default;

uint64_t CommandEncoder::device_registry_id() const { return backend_->registry_id(); }

void CommandEncoder::set_pending_buffer_ranges(std::vector<ByteRange> reads,
                                               std::vector<ByteRange> writes) {
  const Use use(*this, "set_pending_buffer_ranges");
  if (!capturing_) return;
  pending_reads_ = std::move(reads);
  pending_writes_ = std::move(writes);
}

void CommandEncoder::dispatch(const Pipeline& pipeline,
                              std::span<const std::pair<uint32_t, KernelArg>> args, Dim3 grid,
                              Dim3 threads, DispatchKind kind,
                              std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory) {
  const Use use(*this, "dispatch");
  // Check everything before any state changes, so a rejected dispatch leaves no trace.
  const std::string& label = pipeline.label();
  if (pipeline.def().check_args == nullptr)
    throw InvalidArgument("kernel '" + label + "' has no argument contract");
  if (receipt_ && receipt_->dispatches.size() >= receipt_->capacity) {
    throw InvalidArgument("dispatch receipt capacity " + std::to_string(receipt_->capacity) +
                          " exceeded by '" + label + "'");
  }
  QueuedCommand command;
  command.kind = QueuedCommand::Kind::Dispatch;
  command.fn = pipeline.def().fn;
  command.launch.label = label;
  command.launch.kind = kind;
  command.launch.grid = grid;
  command.launch.threads = threads;
  command.launch.threadgroup_memory = std::move(threadgroup_memory);
  command.launch.int_constants = pipeline.int_constants();
  command.inline_bytes.reserve(args.size());
  command.keep_alive.reserve(args.size());
  // Bindings and the encoded record are only kept by a capture or an open receipt: the per-call
  // hot path (plain encoding) skips building them.
  const bool recording = capturing_ || receipt_.has_value();
  std::vector<CapturedBinding> bindings;
  if (capturing_) bindings.reserve(args.size());
  for (const auto& [slot, arg] : args) {
    if (slot >= kMaxKernelSlots) {
      throw InvalidArgument("kernel slot " + std::to_string(slot) + " of '" + label +
                            "' is out of range");
    }
    if (command.launch.args[slot].kind != BoundArg::Kind::Empty) {
      throw InvalidArgument("kernel slot " + std::to_string(slot) + " of '" + label +
                            "' is bound twice");
    }
    BoundArg bound;
    CapturedBinding binding;
    binding.slot = slot;
    if (arg.kind == KernelArg::Kind::Bytes) {
      command.inline_bytes.push_back(arg.bytes);
      bound.kind = BoundArg::Kind::Bytes;
      bound.data = command.inline_bytes.back().data();
      bound.size = command.inline_bytes.back().size();
      if (capturing_) {
        binding.is_bytes = true;
        binding.bytes = arg.bytes;
      }
    } else {
      const Buffer& buffer = arg.buffer;
      if (!buffer.valid())
        throw InvalidArgument("kernel slot of '" + label + "' binds an empty buffer");
      if (buffer.backend() != backend_) {
        throw InvalidArgument("buffer bound to '" + label + "' lives on backend '" +
                              std::string(buffer.backend()->name()) + "', encoder on '" +
                              std::string(backend_->name()) + "'");
      }
      const size_t allocation = buffer.storage()->nbytes();
      if (arg.offset > allocation) {
        throw InvalidArgument("binding offset " + std::to_string(arg.offset) + " of '" + label +
                              "' is past the end of its allocation");
      }
      bound.kind = BoundArg::Kind::Buffer;
      bound.data = static_cast<char*>(buffer.storage()->data()) + arg.offset;
      bound.size = allocation - arg.offset;
      bound.writable = buffer.writable();
      command.keep_alive.push_back(buffer.storage());
      if (capturing_) {
        binding.address = buffer.address();
        binding.offset = arg.offset;
      }
    }
    command.launch.args[slot] = bound;
    if (capturing_) bindings.push_back(std::move(binding));
  }
  pipeline.def().check_args(command.launch);

  ++g_dispatches;
  if (!recording) {
    queue_->submit(std::move(command));
    ++pending_dispatches_;
    return;
  }
  EncodedKernelDispatch encoded{label, kind, grid.array(), threads.array(),
                                command.launch.threadgroup_memory};
  if (capturing_) {
    CapturedNode node;
    node.kind = CapturedNode::Kind::Dispatch;
    node.dispatch = std::move(encoded);
    node.bindings = std::move(bindings);
    node.reads = std::move(pending_reads_);
    node.writes = std::move(pending_writes_);
    pending_reads_.clear();
    pending_writes_.clear();
    captured_.push_back(std::move(node));
    return;
  }
  if (receipt_) receipt_->dispatches.push_back(encoded);
  queue_->submit(std::move(command));
  ++pending_dispatches_;
}

void CommandEncoder::memory_barrier() {
  const Use use(*this, "memory_barrier");
  if (capturing_) {
    CapturedNode node;
    node.kind = CapturedNode::Kind::Barrier;
    captured_.push_back(std::move(node));
    return;
  }
  if (pending_dispatches_ == 0) return;  // nothing to order yet
  ++g_barriers;
  QueuedCommand command;
  command.kind = QueuedCommand::Kind::Barrier;
  queue_->submit(std::move(command));
}

void CommandEncoder::commit_and_wait() {
  const Use use(*this, "commit_and_wait");
  ++g_commits;
  pending_dispatches_ = 0;
  queue_->commit_and_wait();
}

GpuInterval CommandEncoder::commit_wait_with_gpu_time() {
  const Use use(*this, "commit_wait_with_gpu_time");
  ++g_commits;
  pending_dispatches_ = 0;
  return queue_->commit_wait_with_gpu_time();
}

uint64_t CommandEncoder::pending_dispatches() const {
  const Use use(*this, "pending_dispatches");
  return pending_dispatches_;
}

bool CommandEncoder::is_capturing() const {
  const Use use(*this, "is_capturing");
  return capturing_;
}

bool CommandEncoder::has_open_receipt() const {
  const Use use(*this, "has_open_receipt");
  return receipt_.has_value();
}

void CommandEncoder::start_capture() {
  const Use use(*this, "start_capture");
  if (receipt_) throw InvalidArgument("cannot start capture while a dispatch receipt is open");
  if (capturing_) throw InvalidArgument("capture is already active");
  capturing_ = true;
  captured_.clear();
  pending_reads_.clear();
  pending_writes_.clear();
}

std::optional<std::vector<CapturedNode>> CommandEncoder::take_capture() {
  const Use use(*this, "take_capture");
  if (!capturing_) return std::nullopt;
  capturing_ = false;
  pending_reads_.clear();
  pending_writes_.clear();
  return std::exchange(captured_, {});
}

void CommandEncoder::start_encoded_dispatch_receipt(size_t capacity) {
  const Use use(*this, "start_encoded_dispatch_receipt");
  if (capturing_) throw InvalidArgument("dispatch receipt cannot coexist with graph capture");
  if (receipt_) throw InvalidArgument("a dispatch receipt is already open");
  if (capacity == 0) throw InvalidArgument("dispatch receipt capacity must be nonzero");
  receipt_ = Receipt{capacity, {}};
}

size_t CommandEncoder::receipt_slots_left() const {
  const Use use(*this, "receipt_slots_left");
  if (!receipt_) return SIZE_MAX;
  return receipt_->capacity - receipt_->dispatches.size();
}

std::vector<EncodedKernelDispatch> CommandEncoder::take_encoded_dispatch_receipt() {
  const Use use(*this, "take_encoded_dispatch_receipt");
  if (!receipt_) throw InvalidArgument("no dispatch receipt is open");
  auto dispatches = std::move(receipt_->dispatches);
  receipt_.reset();
  return dispatches;
}

}  // namespace routemm
