// CommandEncoder: argument resolution, capture, receipts and process counters.
#include "routemm/encoder.h"

#include <atomic>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>

#include "routemm/env.h"
#include "routemm/error.h"
#include "routemm/registry.h"

namespace routemm {
namespace {

std::atomic<uint64_t> g_encoders{0}, g_command_buffers{0}, g_dispatches{0}, g_barriers{0},
    g_commits{0}, g_waits{0}, g_streams{0}, g_allocations{0}, g_host_waits{0};

constexpr size_t kMaxCommitLabel = 256;

void check_label(std::string_view label) {
  bool printable = !label.empty() && label.size() <= kMaxCommitLabel;
  for (const char c : label) printable = printable && c >= 0x20 && c < 0x7f;
  if (!printable) {
    throw InvalidArgument("commit label must be 1 to " + std::to_string(kMaxCommitLabel) +
                          " printable ASCII characters");
  }
}

bool overlaps(const ByteRange& a, const ByteRange& b) { return a.start < b.end && b.start < a.end; }

bool any_overlap(std::span<const ByteRange> a, std::span<const ByteRange> b) {
  for (const auto& x : a) {
    for (const auto& y : b) {
      if (overlaps(x, y)) return true;
    }
  }
  return false;
}

std::vector<ByteRange> logical_ranges(std::span<const Buffer> buffers, const char* what) {
  std::vector<ByteRange> out;
  out.reserve(buffers.size());
  for (const Buffer& b : buffers) {
    if (!b.valid())
      throw InvalidArgument(std::string("dispatch_tracked: an empty buffer among ") + what);
    const auto [start, end] = b.logical_range();
    out.push_back({start, end});
  }
  return out;
}

}  // namespace

void note_stream_created() { ++g_streams; }
void note_device_allocation() { ++g_allocations; }
void note_host_wait() { ++g_host_waits; }

EncoderCounters encoder_counters() {
  return {g_encoders.load(), g_command_buffers.load(), g_dispatches.load(),
          g_barriers.load(), g_commits.load(),         g_waits.load(),
          g_streams.load(),  g_allocations.load(),     g_host_waits.load()};
}
uint64_t dispatch_count() { return g_dispatches.load(); }
void reset_encoder_counters() {
  for (auto* c : {&g_encoders, &g_command_buffers, &g_dispatches, &g_barriers, &g_commits, &g_waits,
                  &g_streams, &g_allocations, &g_host_waits})
    c->store(0);
}

std::string_view to_string(OpKind kind) {
  switch (kind) {
    case OpKind::Other: return "other";
    case OpKind::RmsNorm: return "rms_norm";
    case OpKind::ElemMul: return "elem_mul";
    case OpKind::ElemAdd: return "elem_add";
    case OpKind::Sdpa: return "sdpa";
    case OpKind::Softmax: return "softmax";
  }
  return "other";
}

OpKind op_kind_from_string(std::string_view name) {
  for (const OpKind kind : {OpKind::Other, OpKind::RmsNorm, OpKind::ElemMul, OpKind::ElemAdd,
                            OpKind::Sdpa, OpKind::Softmax}) {
    if (to_string(kind) == name) return kind;
  }
  throw InvalidArgument("unknown op kind '" + std::string(name) +
                        "' (other, rms_norm, elem_mul, elem_add, sdpa, softmax)");
}

bool is_reorderable(OpKind kind) { return kind != OpKind::Sdpa && kind != OpKind::Softmax; }

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

CommandEncoder::Transaction::Transaction(CommandEncoder& encoder, const char* call)
    : encoder_(encoder), use_(encoder, call) {
  CommandEncoder& e = encoder_;
  outermost_ = e.transaction_depth_ == 0;
  saved_ = Saved{
      e.staged_.size(),      e.captured_.size(), e.receipt_ ? e.receipt_->dispatches.size() : 0,
      e.pending_dispatches_, e.held_dispatches_, e.held_barriers_,
      e.pending_op_kind_,    e.pending_reads_,   e.pending_writes_,
      e.tracked_reads_,      e.tracked_writes_,  e.tracked_unknown_};
  ++e.transaction_depth_;
}

CommandEncoder::Transaction::~Transaction() {
  if (!open_) return;
  // Refused partway: drop what was encoded since this transaction opened. Capture and receipts
  // cannot start or end inside it, so truncating to the saved sizes restores them.
  CommandEncoder& e = encoder_;
  --e.transaction_depth_;
  e.staged_.erase(e.staged_.begin() + static_cast<std::ptrdiff_t>(saved_.staged), e.staged_.end());
  e.captured_.erase(e.captured_.begin() + static_cast<std::ptrdiff_t>(saved_.captured),
                    e.captured_.end());
  if (e.receipt_) {
    auto& d = e.receipt_->dispatches;
    d.erase(d.begin() + static_cast<std::ptrdiff_t>(saved_.receipt), d.end());
  }
  e.pending_dispatches_ = saved_.pending_dispatches;
  e.held_dispatches_ = saved_.held_dispatches;
  e.held_barriers_ = saved_.held_barriers;
  e.pending_op_kind_ = saved_.op_kind;
  e.pending_reads_ = std::move(saved_.pending_reads);
  e.pending_writes_ = std::move(saved_.pending_writes);
  e.tracked_reads_ = std::move(saved_.tracked_reads);
  e.tracked_writes_ = std::move(saved_.tracked_writes);
  e.tracked_unknown_ = saved_.tracked_unknown;
}

void CommandEncoder::Transaction::commit() {
  if (!open_) throw Error("CommandEncoder transaction committed twice");
  open_ = false;
  CommandEncoder& e = encoder_;
  if (--e.transaction_depth_ != 0) return;  // an inner one: the outermost submits
  g_dispatches += std::exchange(e.held_dispatches_, 0);
  g_barriers += std::exchange(e.held_barriers_, 0);
  // Submitting cannot be refused; a backend failure here surfaces as from dispatch().
  struct Clear {
    std::vector<QueuedCommand>& staged;
    ~Clear() { staged.clear(); }
  } clear{e.staged_};
  for (QueuedCommand& command : e.staged_) e.queue_->submit(std::move(command));
}

void CommandEncoder::enqueue(QueuedCommand command) {
  if (transaction_depth_ != 0) {
    staged_.push_back(std::move(command));
  } else {
    queue_->submit(std::move(command));
  }
}

void CommandEncoder::count(std::atomic<uint64_t>& counter, uint64_t& held, uint64_t n) {
  if (transaction_depth_ != 0) {
    held += n;
  } else {
    counter += n;
  }
}

void CommandEncoder::refuse_in_transaction(const char* call) const {
  if (transaction_depth_ != 0) {
    throw Error(std::string("CommandEncoder.") + call +
                ": refused inside an all-or-nothing encoding (an open transaction)");
  }
}

CommandEncoder::CommandEncoder(std::shared_ptr<Backend> backend, EncoderOptions options)
    : backend_(std::move(backend)),
      queue_(backend_->create_queue(QueueOptions{options.stream})),
      auto_barrier_(options.auto_barrier.value_or(env::encoder_auto_barrier())) {
  ++g_encoders;
  ++g_command_buffers;
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
  Prepared prepared = prepare(pipeline, args, grid, threads, kind, std::move(threadgroup_memory));
  // With the tracker on, a dispatch without ranges is ordered after everything tracked, and
  // everything after it is ordered after it.
  const bool track = auto_barrier_ && !capturing_;
  if (track && (tracked_unknown_ || !tracked_reads_.empty() || !tracked_writes_.empty()))
    barrier_unlocked();
  submit_dispatch(std::move(prepared.command), std::move(prepared.node), prepared.recording);
  if (track) tracked_unknown_ = true;
}

CommandEncoder::Prepared CommandEncoder::prepare(
    const Pipeline& pipeline, std::span<const std::pair<uint32_t, KernelArg>> args, Dim3 grid,
    Dim3 threads, DispatchKind kind,
    std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory) {
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

  CapturedNode node;
  if (recording) {
    node.kind = CapturedNode::Kind::Dispatch;
    node.dispatch = EncodedKernelDispatch{label, kind, grid.array(), threads.array(),
                                          command.launch.threadgroup_memory};
    node.bindings = std::move(bindings);
  }
  return Prepared{std::move(command), std::move(node), recording};
}

void CommandEncoder::submit_dispatch(QueuedCommand command, CapturedNode node, bool recording) {
  count(g_dispatches, held_dispatches_, 1);
  const OpKind op_kind = std::exchange(pending_op_kind_, OpKind::Other);
  if (capturing_) {
    node.op_kind = op_kind;
    node.reads = std::exchange(pending_reads_, {});
    node.writes = std::exchange(pending_writes_, {});
    node.command = std::make_shared<const QueuedCommand>(std::move(command));
    captured_.push_back(std::move(node));
    return;
  }
  if (recording && receipt_) receipt_->dispatches.push_back(std::move(node.dispatch));
  enqueue(std::move(command));
  ++pending_dispatches_;
}

void CommandEncoder::dispatch_tracked(const Pipeline& pipeline,
                                      std::span<const std::pair<uint32_t, KernelArg>> args,
                                      Dim3 grid, Dim3 threads, DispatchKind kind,
                                      std::vector<std::pair<uint64_t, uint64_t>> threadgroup_memory,
                                      std::span<const Buffer> reads,
                                      std::span<const Buffer> writes) {
  const Use use(*this, "dispatch_tracked");
  std::vector<ByteRange> read_ranges = logical_ranges(reads, "reads");
  std::vector<ByteRange> write_ranges = logical_ranges(writes, "writes");
  Prepared prepared = prepare(pipeline, args, grid, threads, kind, std::move(threadgroup_memory));
  if (capturing_) {
    pending_reads_ = std::move(read_ranges);
    pending_writes_ = std::move(write_ranges);
  } else if (auto_barrier_) {
    const bool conflict = tracked_unknown_ || any_overlap(read_ranges, tracked_writes_) ||
                          any_overlap(write_ranges, tracked_writes_) ||
                          any_overlap(write_ranges, tracked_reads_);
    if (conflict) barrier_unlocked();
    tracked_unknown_ = write_ranges.empty();
    tracked_reads_.insert(tracked_reads_.end(), read_ranges.begin(), read_ranges.end());
    tracked_writes_.insert(tracked_writes_.end(), write_ranges.begin(), write_ranges.end());
  }
  submit_dispatch(std::move(prepared.command), std::move(prepared.node), prepared.recording);
}

bool CommandEncoder::auto_barrier() const {
  const Use use(*this, "auto_barrier");
  return auto_barrier_;
}

void CommandEncoder::set_auto_barrier(bool on) {
  const Use use(*this, "set_auto_barrier");
  refuse_in_transaction("set_auto_barrier");
  auto_barrier_ = on;
  tracked_reads_.clear();
  tracked_writes_.clear();
  tracked_unknown_ = false;
}

void CommandEncoder::force_barrier_and_reset_tracker() {
  const Use use(*this, "force_barrier_and_reset_tracker");
  barrier_unlocked();
}

void CommandEncoder::set_op_kind(OpKind kind) {
  const Use use(*this, "set_op_kind");
  pending_op_kind_ = kind;
}

void CommandEncoder::encode_graph(std::shared_ptr<const GraphExec> graph,
                                  std::vector<std::shared_ptr<Storage>> keep_alive) {
  const Use use(*this, "encode_graph");
  if (graph == nullptr) throw InvalidArgument("encode_graph: no graph");
  if (capturing_) throw InvalidArgument("encode_graph: an instantiated graph cannot be captured");
  if (receipt_) throw InvalidArgument("encode_graph: an instantiated graph cannot enter a receipt");
  for (const auto& storage : keep_alive) {
    if (storage->backend() != backend_) {
      throw InvalidArgument("encode_graph: the graph binds memory of backend '" +
                            std::string(storage->backend()->name()) + "', encoder on '" +
                            std::string(backend_->name()) + "'");
    }
  }
  QueuedCommand command;
  command.kind = QueuedCommand::Kind::Graph;
  command.graph = std::move(graph);
  command.keep_alive = std::move(keep_alive);
  count(g_dispatches, held_dispatches_, command.graph->node_count());
  enqueue(std::move(command));
  pending_dispatches_ += 1;
}

void CommandEncoder::encode_captured(const CapturedNode& node) {
  const Use use(*this, "encode_captured");
  if (node.kind == CapturedNode::Kind::Barrier) {
    barrier_unlocked();
    return;
  }
  if (node.command == nullptr) {
    throw InvalidArgument("encode_captured: node '" + node.dispatch.pipeline_label +
                          "' carries no command (only nodes taken from a capture replay)");
  }
  for (const auto& storage : node.command->keep_alive) {
    if (storage->backend() != backend_) {
      throw InvalidArgument("encode_captured: node '" + node.dispatch.pipeline_label +
                            "' was captured on backend '" +
                            std::string(storage->backend()->name()) + "', encoder on '" +
                            std::string(backend_->name()) + "'");
    }
  }
  if (receipt_ && receipt_->dispatches.size() >= receipt_->capacity) {
    throw InvalidArgument("dispatch receipt capacity " + std::to_string(receipt_->capacity) +
                          " exceeded by '" + node.dispatch.pipeline_label + "'");
  }
  CapturedNode copy;
  const bool recording = capturing_ || receipt_.has_value();
  if (recording) {
    copy = node;
    copy.command.reset();
    if (capturing_) {
      pending_reads_ = node.reads;
      pending_writes_ = node.writes;
      pending_op_kind_ = node.op_kind;
    }
  }
  submit_dispatch(*node.command, std::move(copy), recording);
}

void CommandEncoder::memory_barrier() {
  const Use use(*this, "memory_barrier");
  barrier_unlocked();
}

void CommandEncoder::barrier_unlocked() {
  tracked_reads_.clear();
  tracked_writes_.clear();
  tracked_unknown_ = false;
  if (capturing_) {
    CapturedNode node;
    node.kind = CapturedNode::Kind::Barrier;
    captured_.push_back(std::move(node));
    return;
  }
  if (pending_dispatches_ == 0) return;  // nothing to order yet
  count(g_barriers, held_barriers_, 1);
  QueuedCommand command;
  command.kind = QueuedCommand::Kind::Barrier;
  enqueue(std::move(command));
}

void CommandEncoder::commit_unlocked(std::string_view label, bool timed) {
  refuse_in_transaction("commit");
  queue_->commit(std::string(label), timed);
  ++g_commits;
  ++g_command_buffers;
  pending_dispatches_ = 0;
  tracked_reads_.clear();
  tracked_writes_.clear();
  tracked_unknown_ = false;
}

void CommandEncoder::commit() {
  const Use use(*this, "commit");
  commit_unlocked({}, false);
}

void CommandEncoder::commit_labeled(std::string_view label) {
  const Use use(*this, "commit_labeled");
  check_label(label);
  commit_unlocked(label, false);
}

void CommandEncoder::wait_until_completed() {
  const Use use(*this, "wait_until_completed");
  ++g_waits;
  queue_->wait();
}

void CommandEncoder::commit_and_wait() {
  const Use use(*this, "commit_and_wait");
  commit_unlocked({}, false);
  ++g_waits;
  queue_->wait();
}

void CommandEncoder::commit_and_wait_labeled(std::string_view label) {
  const Use use(*this, "commit_and_wait_labeled");
  check_label(label);
  commit_unlocked(label, false);
  ++g_waits;
  queue_->wait();
}

GpuInterval CommandEncoder::commit_wait_with_gpu_time() {
  const Use use(*this, "commit_wait_with_gpu_time");
  commit_unlocked({}, true);
  ++g_waits;
  return queue_->wait();
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
  refuse_in_transaction("start_capture");
  if (receipt_) throw InvalidArgument("cannot start capture while a dispatch receipt is open");
  if (capturing_) throw InvalidArgument("capture is already active");
  capturing_ = true;
  captured_.clear();
  pending_reads_.clear();
  pending_writes_.clear();
}

std::optional<std::vector<CapturedNode>> CommandEncoder::take_capture() {
  const Use use(*this, "take_capture");
  refuse_in_transaction("take_capture");
  if (!capturing_) return std::nullopt;
  capturing_ = false;
  pending_reads_.clear();
  pending_writes_.clear();
  return std::exchange(captured_, {});
}

void CommandEncoder::start_encoded_dispatch_receipt(size_t capacity) {
  const Use use(*this, "start_encoded_dispatch_receipt");
  refuse_in_transaction("start_encoded_dispatch_receipt");
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
  refuse_in_transaction("take_encoded_dispatch_receipt");
  if (!receipt_) throw InvalidArgument("no dispatch receipt is open");
  auto dispatches = std::move(receipt_->dispatches);
  receipt_.reset();
  return dispatches;
}

}  // namespace routemm
