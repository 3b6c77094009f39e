// The execution model (runtime.h): threadgroup scheduling on fibers, simdgroup exchanges,
// barriers, and the memory checks behind the compiler's access hooks.
#include "backend/metal_emu/runtime.h"

#include <link.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>

#include "backend/cpu/thread_pool.h"
#include "backend/metal_emu/fiber.h"
#include "routemm/error.h"

namespace routemm::metal_emu {

void ShaderLibrary::add(ShaderKernel kernel) {
  const std::string name = kernel.name;
  if (!kernels_.emplace(name, std::move(kernel)).second)
    throw Error("metal_emu: kernel '" + name + "' is defined by two shader files");
}

const ShaderKernel* ShaderLibrary::find(const std::string& name) const {
  const auto it = kernels_.find(name);
  return it == kernels_.end() ? nullptr : &it->second;
}

namespace {

constexpr size_t kStackBytes = 64 * 1024;  // per thread; shader frames are small
constexpr size_t kPageBytes = 4096;        // guard page below every stack
constexpr uint32_t kMaxThreads = 1024;     // Apple GPUs' threads per threadgroup
// What one dispatch may ask of the model: a GPU runs billions of empty threads in milliseconds,
// the model runs each as a fiber, so a larger launch is refused (an Error at commit) instead of
// running for hours.
constexpr uint64_t kMaxModelGroups = uint64_t{1} << 24;
constexpr uint64_t kMaxModelThreads = uint64_t{1} << 28;
constexpr uint64_t kMaxThreadgroupMemory = 32 * 1024;
constexpr size_t kThreadgroupGap = 256;  // unowned bytes between [[threadgroup(i)]] blocks
constexpr uint8_t kThreadgroupPoison = 0xFF;
constexpr uint16_t kManyReaders = 0xFFFF;

struct Site {
  const char* op = "";
  const char* file = "";
  uint32_t line = 0;
  uint32_t column = 0;
  bool operator==(const Site& o) const {
    return line == o.line && column == o.column && std::strcmp(file, o.file) == 0 &&
           std::strcmp(op, o.op) == 0;
  }
};

std::string where(const Site& s) {
  const char* slash = std::strrchr(s.file, '/');
  return std::string(s.op) + " at " + (slash ? slash + 1 : s.file) + ":" + std::to_string(s.line);
}

Site site_of(const char* op, const std::source_location& at) {
  return Site{op, at.file_name(), at.line(), at.column()};
}

// A bound range of device or constant memory.
struct Range {
  uintptr_t begin = 0;
  size_t size = 0;
  uint32_t slot = 0;
  bool read_only = false;  // inline bytes
};

struct ThreadgroupBlock {
  uint32_t index = 0;
  uint64_t bytes = 0;
  size_t offset = 0;  // in the worker's arena
};

// Everything shared by the threads of one dispatch (read-only while it runs).
struct DispatchState {
  const ShaderKernel* kernel = nullptr;
  const KernelLaunch* launch = nullptr;
  const AllocationLookup* allocations = nullptr;
  std::vector<Range> ranges;
  std::array<void*, kMaxKernelSlots> buffers{};
  std::vector<ThreadgroupBlock> threadgroup;
  size_t arena_bytes = 0;
  std::array<uint32_t, 3> groups{};         // threadgroups per grid
  std::array<uint32_t, 3> group_threads{};  // threads per (full) threadgroup
  std::array<uint32_t, 3> grid_threads{};   // threads per grid
};

enum class LaneState : uint8_t { Runnable, AtThreadgroupBarrier, AtSimd, Exited, Failed };
enum class SimdKind : uint8_t { Exchange, Uniform, Barrier };

struct Worker;

}  // namespace

// One thread of one dispatch: its positions, its fiber and what it waits for.
struct Invocation {
  Worker* worker = nullptr;
  uint32_t tid = 0, simdgroup = 0, lane = 0;
  std::array<std::array<uint32_t, 3>, 12> positions{};
  Fiber fiber;
  LaneState state = LaneState::Runnable;
  Site site;
  SimdKind simd_kind = SimdKind::Exchange;
  ExchangeRule rule = ExchangeRule::ActiveLanes;
  uint32_t source = 0;
  uint32_t mem_flags = 0;
  // At a threadgroup-wide step: a barrier (orders threadgroup memory, a new race epoch) or the
  // entry into a tensor op of threadgroup scope (orders nothing).
  bool orders_memory = true;
  alignas(16) unsigned char value[kExchangeSlotBytes];
  Exchange result;
};

namespace {

struct ShadowByte {
  uint32_t write_epoch = 0, read_epoch = 0;
  uint32_t writer_sync = 0, reader_sync = 0;  // the accessor's simdgroup-barrier count then
  uint16_t writer = 0, reader = 0;
};

struct Simdgroup {
  uint32_t first = 0, count = 0;  // lanes [first, first + count) of the threadgroup
  uint32_t sync = 0;              // simdgroup barriers with threadgroup memory ordering so far
  alignas(16) unsigned char snapshot[kSimdWidth * kExchangeSlotBytes];
};

// A host thread's model state, reused across threadgroups and dispatches.
struct Worker {
  const DispatchState* dispatch = nullptr;
  std::array<uint32_t, 3> group{};
  std::vector<Invocation> lanes;
  std::vector<Simdgroup> simdgroups;
  Fiber scheduler;
  // Fiber stacks: one mapping, a guard page below each stack.
  char* stacks = nullptr;
  size_t stack_lanes = 0;
  uintptr_t stack_lo = 0, stack_span = 0;
  // Threadgroup memory and its shadow.
  std::vector<unsigned char> arena;
  std::vector<ShadowByte> shadow;
  uintptr_t arena_lo = 0, arena_span = 0;
  uint32_t epoch = 0;
  // The first error of the running threadgroup.
  std::string error;

  ~Worker() {
    if (stacks != nullptr) munmap(stacks, stack_lanes * (kStackBytes + kPageBytes));
  }

  void reserve_stacks(size_t n) {
    if (n <= stack_lanes) return;
    if (stacks != nullptr) munmap(stacks, stack_lanes * (kStackBytes + kPageBytes));
    const size_t bytes = n * (kStackBytes + kPageBytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw Error("metal_emu: cannot map fiber stacks");
    stacks = static_cast<char*>(p);
    stack_lanes = n;
    for (size_t i = 0; i < n; ++i)
      mprotect(stacks + i * (kStackBytes + kPageBytes), kPageBytes, PROT_NONE);
    stack_lo = reinterpret_cast<uintptr_t>(stacks);
    stack_span = bytes;
  }
  void* stack(size_t i) { return stacks + i * (kStackBytes + kPageBytes) + kPageBytes; }
};

thread_local Worker* tls_worker = nullptr;
// The running shader thread on this host thread; null outside shader code. The default (dynamic)
// TLS model: an initial-exec variable would mark the whole extension STATIC_TLS, and a module loaded
// after others have used up the static TLS surplus (PyTorch's, say) then fails to load.
thread_local Invocation* tls_lane = nullptr;

Worker& this_worker() {
  static thread_local std::unique_ptr<Worker> worker;
  if (!worker) worker = std::make_unique<Worker>();
  tls_worker = worker.get();
  return *worker;
}

std::string hex(uintptr_t a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

std::string triple(const std::array<uint32_t, 3>& v) {
  return "(" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", " + std::to_string(v[2]) +
         ")";
}

std::string thread_name(const Worker& w, const Invocation& lane) {
  return "thread " +
         triple(lane.positions[static_cast<int>(Position::thread_position_in_threadgroup)]) +
         " (index " + std::to_string(lane.tid) + ", simdgroup " + std::to_string(lane.simdgroup) +
         " lane " + std::to_string(lane.lane) + ") of threadgroup " + triple(w.group);
}

std::string kernel_prefix(const Worker& w) {
  return "metal_emu: kernel " + w.dispatch->kernel->name + " (" + w.dispatch->launch->label + "): ";
}

// Stops the calling shader thread for good with `message` as the threadgroup's error.
[[noreturn]] void fail_lane(std::string message) {
  Invocation& lane = *tls_lane;
  Worker& w = *lane.worker;
  if (w.error.empty()) w.error = std::move(message);
  lane.state = LaneState::Failed;
  tls_lane = nullptr;
  Fiber::switch_to(lane.fiber, w.scheduler);
  __builtin_unreachable();
}

[[noreturn]] void fail_access(const char* check, uintptr_t address, size_t size, bool write,
                              const std::string& detail) {
  Invocation& lane = *tls_lane;
  Worker& w = *lane.worker;
  fail_lane(kernel_prefix(w) + check + ": " + thread_name(w, lane) +
            (write ? " writes " : " reads ") + std::to_string(size) + " byte(s) at " +
            hex(address) + ", " + detail);
}

// ---- Threadgroup memory ----------------------------------------------------------------------------

std::string threadgroup_place(const Worker& w, uintptr_t address) {
  const size_t offset = address - w.arena_lo;
  for (const ThreadgroupBlock& b : w.dispatch->threadgroup) {
    if (offset >= b.offset && offset < b.offset + b.bytes)
      return "byte " + std::to_string(offset - b.offset) + " of [[threadgroup(" +
             std::to_string(b.index) + ")]]";
  }
  return {};
}

void threadgroup_access(Invocation& lane, uintptr_t address, size_t size, bool write) {
  Worker& w = *lane.worker;
  const size_t offset = address - w.arena_lo;
  const ThreadgroupBlock* block = nullptr;
  for (const ThreadgroupBlock& b : w.dispatch->threadgroup) {
    if (offset >= b.offset && offset < b.offset + b.bytes) block = &b;
  }
  if (block == nullptr || offset + size > block->offset + block->bytes) {
    std::string lengths;
    for (const ThreadgroupBlock& b : w.dispatch->threadgroup)
      lengths += (lengths.empty() ? "" : ", ") + ("[[threadgroup(" + std::to_string(b.index) +
                                                  ")]] of " + std::to_string(b.bytes) + " bytes");
    fail_access("threadgroup memory out of extent", address, size, write,
                "outside the encoded threadgroup memory (" + lengths + ")");
  }
  const uint32_t sync = w.simdgroups[lane.simdgroup].sync;
  const auto ordered = [&](uint16_t other, uint32_t other_sync) {
    // Same thread, or same simdgroup with a simdgroup barrier in between.
    if (other == lane.tid) return true;
    return w.lanes[other].simdgroup == lane.simdgroup && other_sync != sync;
  };
  for (size_t i = 0; i < size; ++i) {
    ShadowByte& s = w.shadow[offset + i];
    const bool written = s.write_epoch == w.epoch && !ordered(s.writer, s.writer_sync);
    bool read = false;
    if (write && s.read_epoch == w.epoch)
      read = s.reader == kManyReaders || !ordered(s.reader, s.reader_sync);
    if (written || read) {
      const uint16_t other = written ? s.writer : s.reader;
      const std::string with = other == kManyReaders ? std::string("several other threads")
                                                     : thread_name(w, w.lanes[other]);
      fail_access("threadgroup memory race", address + i, 1, write,
                  threadgroup_place(w, address + i) + ", which " + with +
                      (written ? " wrote" : " read") +
                      " since the last threadgroup barrier (no barrier orders the two accesses)");
    }
    if (write) {
      s.write_epoch = w.epoch;
      s.writer = static_cast<uint16_t>(lane.tid);
      s.writer_sync = sync;
    } else if (s.read_epoch != w.epoch) {
      s.read_epoch = w.epoch;
      s.reader = static_cast<uint16_t>(lane.tid);
      s.reader_sync = sync;
    } else if (s.reader != lane.tid) {
      s.reader = kManyReaders;
    }
  }
}

// ---- Device and constant memory ------------------------------------------------------------------

std::string describe_range(const Range& r, uintptr_t address) {
  const long long offset = static_cast<long long>(address) - static_cast<long long>(r.begin);
  return "offset " + std::to_string(offset) + " from [[buffer(" + std::to_string(r.slot) + ")]] (" +
         (r.read_only ? "inline bytes" : "bound at " + hex(r.begin)) + ", extent " +
         std::to_string(r.size) + " bytes)";
}

[[noreturn]] void outside_bound_memory(Invocation& lane, uintptr_t address, size_t size,
                                       bool write) {
  const Worker& w = *lane.worker;
  const DispatchState& d = *w.dispatch;
  // Past or before a bound range: name the nearest slot.
  const Range* nearest = nullptr;
  uintptr_t distance = std::numeric_limits<uintptr_t>::max();
  for (const Range& r : d.ranges) {
    const uintptr_t gap = address < r.begin ? r.begin - address : address - (r.begin + r.size);
    if (address + size > r.begin && address < r.begin + r.size) {
      nearest = &r;
      distance = 0;
      break;
    }
    if (gap < distance) {
      distance = gap;
      nearest = &r;
    }
  }
  std::optional<AllocationInfo> allocation;
  if (d.allocations != nullptr) allocation = d.allocations->find(address);
  auto describe = [&](const Range& r) { return describe_range(r, address); };
  if (nearest != nullptr && distance == 0)
    fail_access("buffer out of extent", address, size, write, describe(*nearest));
  if (allocation) {
    // Inside a reservation: which bound slot (if any) owns that allocation?
    for (const Range& r : d.ranges) {
      if (r.begin >= allocation->begin && r.begin <= allocation->begin + allocation->size)
        fail_access("buffer out of extent", address, size, write, describe(r));
    }
    fail_access("unbound buffer", address, size, write,
                "memory of an allocation at " + hex(allocation->begin) + " (" +
                    std::to_string(allocation->size) + " bytes) that this dispatch does not bind");
  }
  fail_access("buffer out of extent", address, size, write,
              "outside every buffer this dispatch binds");
}

// The loaded segments of the binary holding the model (and the shaders, linked with it): their
// static data (constant tables, function constants) is the only other memory shaders may read.
struct Segment {
  uintptr_t begin = 0, end = 0;
};
const std::vector<Segment>& program_segments() {
  static const std::vector<Segment> segments = [] {
    struct Search {
      uintptr_t anchor;
      std::vector<Segment> found;
    } search{reinterpret_cast<uintptr_t>(&program_segments), {}};
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* data) {
          auto& s = *static_cast<Search*>(data);
          std::vector<Segment> loaded;
          bool mine = false;
          for (int i = 0; i < info->dlpi_phnum; ++i) {
            const auto& h = info->dlpi_phdr[i];
            if (h.p_type != PT_LOAD) continue;
            const Segment seg{info->dlpi_addr + h.p_vaddr, info->dlpi_addr + h.p_vaddr + h.p_memsz};
            mine = mine || (s.anchor >= seg.begin && s.anchor < seg.end);
            loaded.push_back(seg);
          }
          if (!mine) return 0;
          s.found = std::move(loaded);
          return 1;
        },
        &search);
    return search.found;
  }();
  return segments;
}

inline void on_access(const void* p, size_t size, bool write) {
  Invocation* lane = tls_lane;
  if (lane == nullptr) return;
  const auto address = reinterpret_cast<uintptr_t>(p);
  Worker& w = *lane->worker;
  if (address - w.stack_lo < w.stack_span) return;  // thread-private memory
  if (address - w.arena_lo < w.arena_span) return threadgroup_access(*lane, address, size, write);
  for (const Range& r : w.dispatch->ranges) {
    if (address - r.begin < r.size) {
      if (address + size > r.begin + r.size) outside_bound_memory(*lane, address, size, write);
      if (write && r.read_only)
        fail_access("write to constant memory", address, size, write,
                    "inline bytes of [[buffer(" + std::to_string(r.slot) + ")]]");
      return;
    }
  }
  // Not stack, threadgroup or bound memory: the program's static data, or an error.
  for (const Segment& seg : program_segments()) {
    if (address >= seg.begin && address + size <= seg.end) return;
  }
  outside_bound_memory(*lane, address, size, write);
}

// ---- Scheduling -------------------------------------------------------------------------------

void block(Invocation& lane) {
  Worker& w = *lane.worker;
  tls_lane = nullptr;
  Fiber::switch_to(lane.fiber, w.scheduler);
  tls_lane = &lane;
}

void lane_main(void* argument) {
  auto& lane = *static_cast<Invocation*>(argument);
  tls_lane = &lane;
  lane.worker->dispatch->kernel->entry(lane);
  tls_lane = nullptr;
  lane.state = LaneState::Exited;
  Fiber::switch_to(lane.fiber, lane.worker->scheduler);
  __builtin_unreachable();
}

std::string lane_list(uint32_t mask) {
  std::string out;
  for (uint32_t l = 0; l < kSimdWidth; ++l) {
    if ((mask >> l) & 1u) out += (out.empty() ? "" : ",") + std::to_string(l);
  }
  return out.empty() ? "none" : out;
}

std::string lane_activity(const Worker& w, const Invocation& lane) {
  switch (lane.state) {
    case LaneState::Exited: return "returned";
    case LaneState::AtThreadgroupBarrier: return "waits at " + where(lane.site);
    case LaneState::AtSimd: return "waits at " + where(lane.site);
    default: return "runs";
  }
  (void)w;
}

// Resolves at most one simdgroup step per simdgroup; false when none was waiting.
bool resolve_simdgroups(Worker& w) {
  bool progress = false;
  for (uint32_t g = 0; g < w.simdgroups.size(); ++g) {
    Simdgroup& sg = w.simdgroups[g];
    Invocation* first = nullptr;
    for (uint32_t i = sg.first; i < sg.first + sg.count; ++i) {
      if (w.lanes[i].state == LaneState::AtSimd) {
        first = &w.lanes[i];
        break;
      }
    }
    if (first == nullptr) continue;
    uint32_t active = 0;
    const Invocation* outsider = nullptr;
    for (uint32_t i = sg.first; i < sg.first + sg.count; ++i) {
      const Invocation& l = w.lanes[i];
      if (l.state == LaneState::AtSimd && l.site == first->site) {
        active |= 1u << l.lane;
      } else if (outsider == nullptr) {
        outsider = &l;
      }
    }
    const bool partial = first->simd_kind == SimdKind::Uniform && sg.count != kSimdWidth;
    if (first->simd_kind != SimdKind::Exchange && (outsider != nullptr || partial)) {
      w.error =
          kernel_prefix(w) + "simdgroup op under divergent control flow: " + where(first->site) +
          " in simdgroup " + std::to_string(g) + " of threadgroup " + triple(w.group) +
          " is executed by lanes " + lane_list(active) + " only" +
          (outsider != nullptr
               ? "; lane " + std::to_string(outsider->lane) + " " + lane_activity(w, *outsider)
               : "; the simdgroup has only " + std::to_string(sg.count) + " lanes") +
          " (Metal requires all 32 lanes to execute it together)";
      return false;
    }
    for (uint32_t i = sg.first; i < sg.first + sg.count; ++i) {
      Invocation& l = w.lanes[i];
      if (!((active >> l.lane) & 1u) || l.state != LaneState::AtSimd) continue;
      std::memcpy(sg.snapshot + l.lane * kExchangeSlotBytes, l.value, kExchangeSlotBytes);
    }
    for (uint32_t i = sg.first; i < sg.first + sg.count; ++i) {
      Invocation& l = w.lanes[i];
      if (!((active >> l.lane) & 1u) || l.state != LaneState::AtSimd) continue;
      if (l.simd_kind == SimdKind::Exchange && l.rule != ExchangeRule::ActiveLanes) {
        const bool source_active = l.source < kSimdWidth && ((active >> l.source) & 1u);
        const bool uniform = l.rule != ExchangeRule::UniformSource || l.source == first->source;
        if (!source_active || !uniform) {
          w.error =
              kernel_prefix(w) + "simdgroup op under divergent control flow: " + where(l.site) +
              ": " + thread_name(w, l) + " reads lane " + std::to_string(l.source) +
              (source_active ? ", but lane " + std::to_string(first->lane) + " reads lane " +
                                   std::to_string(first->source) + " (the lane must be uniform)"
                             : ", which is not active at this call (active lanes: " +
                                   lane_list(active) + ")") +
              "; Metal leaves the result undefined";
          return false;
        }
      }
      l.result = Exchange{active, l.lane, sg.snapshot};
      l.state = LaneState::Runnable;
    }
    if (first->simd_kind == SimdKind::Barrier && (first->mem_flags & 2u)) ++sg.sync;
    progress = true;
  }
  return progress;
}

// All threads wait at one threadgroup barrier: start the next epoch. Otherwise record the error.
bool resolve_threadgroup_barrier(Worker& w) {
  const Invocation* waiting = nullptr;
  for (const Invocation& l : w.lanes) {
    if (l.state == LaneState::AtThreadgroupBarrier) {
      waiting = &l;
      break;
    }
  }
  if (waiting == nullptr) {
    w.error = kernel_prefix(w) + "the threadgroup " + triple(w.group) + " cannot progress";
    return false;
  }
  for (const Invocation& l : w.lanes) {
    if (l.state == LaneState::AtThreadgroupBarrier && l.site == waiting->site) continue;
    w.error = kernel_prefix(w) +
              (waiting->orders_memory
                   ? "barrier not reached by every thread: "
                   : "tensor op not entered by every thread of its execution scope: ") +
              where(waiting->site) + " waits for " + thread_name(w, l) + ", which " +
              lane_activity(w, l) + " (first waiting: " + thread_name(w, *waiting) + ")";
    return false;
  }
  if (waiting->orders_memory) ++w.epoch;
  for (Invocation& l : w.lanes) l.state = LaneState::Runnable;
  return true;
}

std::array<uint32_t, 3> narrow3(const Dim3& d) {
  return {static_cast<uint32_t>(d.x), static_cast<uint32_t>(d.y), static_cast<uint32_t>(d.z)};
}

// Runs threadgroup `group`; returns its error ("" when it completed).
std::string run_group(Worker& w, const DispatchState& d, const std::array<uint32_t, 3>& group) {
  w.dispatch = &d;
  w.group = group;
  w.error.clear();
  // The threads of this group: a Threads dispatch trims its edge groups to the grid.
  std::array<uint32_t, 3> size = d.group_threads;
  if (d.launch->kind == DispatchKind::Threads) {
    for (int i = 0; i < 3; ++i)
      size[i] = std::min(size[i], d.grid_threads[i] - group[i] * d.group_threads[i]);
  }
  const uint32_t n = size[0] * size[1] * size[2];
  w.reserve_stacks(n);
  w.lanes.assign(n, Invocation{});
  const uint32_t simdgroups = (n + kSimdWidth - 1) / kSimdWidth;
  w.simdgroups.resize(simdgroups);
  for (uint32_t g = 0; g < simdgroups; ++g) {
    w.simdgroups[g].first = g * kSimdWidth;
    w.simdgroups[g].count = std::min(kSimdWidth, n - g * kSimdWidth);
    w.simdgroups[g].sync = 0;
  }
  for (uint32_t t = 0; t < n; ++t) {
    Invocation& l = w.lanes[t];
    l.worker = &w;
    l.tid = t;
    l.simdgroup = t / kSimdWidth;
    l.lane = t % kSimdWidth;
    const std::array<uint32_t, 3> local = {t % size[0], (t / size[0]) % size[1],
                                           t / (size[0] * size[1])};
    auto set = [&](Position p, std::array<uint32_t, 3> v) { l.positions[static_cast<int>(p)] = v; };
    std::array<uint32_t, 3> global{};
    for (int i = 0; i < 3; ++i) global[i] = group[i] * d.group_threads[i] + local[i];
    set(Position::thread_position_in_grid, global);
    set(Position::thread_position_in_threadgroup, local);
    set(Position::thread_index_in_threadgroup, {t, 0, 0});
    set(Position::threadgroup_position_in_grid, group);
    set(Position::threads_per_threadgroup, size);
    set(Position::dispatch_threads_per_threadgroup, d.group_threads);
    set(Position::threadgroups_per_grid, d.groups);
    set(Position::threads_per_grid, d.grid_threads);
    set(Position::simdgroup_index_in_threadgroup, {l.simdgroup, 0, 0});
    set(Position::thread_index_in_simdgroup, {l.lane, 0, 0});
    set(Position::threads_per_simdgroup, {kSimdWidth, 0, 0});
    set(Position::simdgroups_per_threadgroup, {simdgroups, 0, 0});
    l.fiber.prepare(w.stack(t), kStackBytes, &lane_main, &l);
  }
  // Threadgroup memory: contents undefined (poisoned); a new epoch for the race shadow.
  if (w.arena.size() < d.arena_bytes) {
    w.arena.assign(d.arena_bytes, 0);
    w.shadow.assign(d.arena_bytes, ShadowByte{});
    w.epoch = 0;
  }
  w.arena_lo = reinterpret_cast<uintptr_t>(w.arena.data());
  w.arena_span = d.arena_bytes;
  std::memset(w.arena.data(), kThreadgroupPoison, d.arena_bytes);
  if (w.epoch > std::numeric_limits<uint32_t>::max() - 1024) {
    std::fill(w.shadow.begin(), w.shadow.end(), ShadowByte{});
    w.epoch = 0;
  }
  ++w.epoch;

  for (;;) {
    bool any_alive = false;
    for (Invocation& l : w.lanes) {
      if (l.state == LaneState::Runnable) Fiber::switch_to(w.scheduler, l.fiber);
      if (!w.error.empty()) return w.error;
      any_alive = any_alive || l.state != LaneState::Exited;
    }
    if (!any_alive) return {};
    if (resolve_simdgroups(w)) continue;
    if (!w.error.empty()) return w.error;
    if (!resolve_threadgroup_barrier(w)) return w.error;
  }
}

}  // namespace

// ---- Calls from shader code -------------------------------------------------------------------------

Exchange exchange(const char* op, const void* value, size_t size, ExchangeRule rule,
                  uint32_t source, const std::source_location& at) {
  Invocation& lane = *tls_lane;
  lane.site = site_of(op, at);
  lane.simd_kind = SimdKind::Exchange;
  lane.rule = rule;
  lane.source = source;
  std::memset(lane.value, 0, sizeof lane.value);
  std::memcpy(lane.value, value, size);
  lane.state = LaneState::AtSimd;
  block(lane);
  return lane.result;
}

void barrier(BarrierScope scope, uint32_t mem_flags, const std::source_location& at) {
  Invocation& lane = *tls_lane;
  if (scope == BarrierScope::Threadgroup) {
    lane.site = site_of("threadgroup_barrier", at);
    lane.orders_memory = true;
    lane.state = LaneState::AtThreadgroupBarrier;
  } else {
    lane.site = site_of("simdgroup_barrier", at);
    lane.simd_kind = SimdKind::Barrier;
    lane.mem_flags = mem_flags;
    lane.state = LaneState::AtSimd;
  }
  block(lane);
}

void simdgroup_uniform(const char* op, const std::source_location& at) {
  Invocation& lane = *tls_lane;
  lane.site = site_of(op, at);
  lane.simd_kind = SimdKind::Uniform;
  lane.state = LaneState::AtSimd;
  block(lane);
}

uint32_t current_lane() { return tls_lane->lane; }

uint32_t current_thread_index() { return tls_lane->tid; }

void shader_error(const std::string& message) {
  Invocation& lane = *tls_lane;
  fail_lane(kernel_prefix(*lane.worker) + thread_name(*lane.worker, lane) + ": " + message);
}

void threadgroup_scope(const char* op, uint32_t simdgroups, const std::source_location& at) {
  Invocation& lane = *tls_lane;
  Worker& w = *lane.worker;
  const Site site = site_of(op, at);
  if (w.lanes.size() != size_t{simdgroups} * kSimdWidth)
    fail_lane(kernel_prefix(w) + "tensor op execution scope mismatch: " + where(site) +
              " runs on execution_simdgroups<" + std::to_string(simdgroups) + "> (" +
              std::to_string(simdgroups * kSimdWidth) + " threads), but threadgroup " +
              triple(w.group) + " has " + std::to_string(w.lanes.size()) +
              " threads (Metal leaves this undefined)");
  lane.site = site;
  lane.orders_memory = false;
  lane.state = LaneState::AtThreadgroupBarrier;
  block(lane);
}

void check_tensor_view(const void* first, size_t bytes, const std::source_location& at) {
  Invocation* lane = tls_lane;
  if (lane == nullptr || bytes == 0) return;
  Worker& w = *lane->worker;
  const auto a = reinterpret_cast<uintptr_t>(first);
  const std::string head = kernel_prefix(w) +
                           "tensor view out of extent: " + thread_name(w, *lane) +
                           " makes a view of " + std::to_string(bytes) + " byte(s) at " + hex(a) +
                           " (" + where(site_of("tensor", at)) + "), ";
  if (a - w.stack_lo < w.stack_span) return;  // thread-private memory
  if (a - w.arena_lo < w.arena_span) {
    const size_t offset = a - w.arena_lo;
    for (const ThreadgroupBlock& b : w.dispatch->threadgroup) {
      if (offset < b.offset || offset >= b.offset + b.bytes) continue;
      if (offset + bytes <= b.offset + b.bytes) return;
      fail_lane(head + "from " + threadgroup_place(w, a) + ", which holds " +
                std::to_string(b.bytes) + " bytes");
    }
    fail_lane(head + "outside the encoded threadgroup memory");
  }
  for (const Range& r : w.dispatch->ranges) {
    if (a - r.begin >= r.size) continue;
    if (a + bytes <= r.begin + r.size) return;
    fail_lane(head + "from " + describe_range(r, a) + ": it ends " +
              std::to_string(a + bytes - (r.begin + r.size)) + " byte(s) past the buffer");
  }
  fail_lane(head + "outside every buffer this dispatch binds");
}

void check_atomic(const void* address, size_t size) {
  Invocation* lane = tls_lane;
  if (lane == nullptr) return;
  const auto a = reinterpret_cast<uintptr_t>(address);
  Worker& w = *lane->worker;
  if (a - w.arena_lo < w.arena_span) {
    // Bounds only: atomics are never races.
    const size_t offset = a - w.arena_lo;
    for (const ThreadgroupBlock& b : w.dispatch->threadgroup) {
      if (offset >= b.offset && offset + size <= b.offset + b.bytes) return;
    }
    fail_access("threadgroup memory out of extent", a, size, true,
                "an atomic outside every [[threadgroup(i)]] block");
  }
  on_access(address, size, true);
}

void* bound_buffer(const Invocation& invocation, uint32_t index) {
  return invocation.worker->dispatch->buffers[index];
}

void* bound_threadgroup(const Invocation& invocation, uint32_t index) {
  const Worker& w = *invocation.worker;
  for (const ThreadgroupBlock& b : w.dispatch->threadgroup) {
    if (b.index == index) return const_cast<unsigned char*>(w.arena.data()) + b.offset;
  }
  return nullptr;  // checked at dispatch
}

const uint32_t* position(const Invocation& invocation, Position which) {
  return invocation.positions[static_cast<int>(which)].data();
}

int32_t function_constant(const Invocation& invocation, uint32_t index, const char* name) {
  const KernelLaunch& launch = *invocation.worker->dispatch->launch;
  for (const auto& [i, value] : launch.int_constants) {
    if (i == index) return value;
  }
  throw Error("metal_emu: kernel " + invocation.worker->dispatch->kernel->name + " (" +
              launch.label + "): function constant '" + std::string(name) +
              "' [[function_constant(" + std::to_string(index) +
              ")]] has no value in the pipeline's specialisation constants");
}

// ---- Dispatch --------------------------------------------------------------------------------

void run_dispatch(const ShaderKernel& kernel, const KernelLaunch& launch,
                  const AllocationLookup* allocations) {
  const std::string prefix = "metal_emu: kernel " + kernel.name + " (" + launch.label + "): ";
  DispatchState d;
  d.kernel = &kernel;
  d.launch = &launch;
  d.allocations = allocations;
  // Bindings: every declared slot bound as the shader needs it; nothing else is reachable.
  for (const KernelParam& p : kernel.params) {
    if (p.kind == KernelParam::Kind::Buffer) {
      if (p.index >= kMaxKernelSlots)
        throw Error(prefix + "[[buffer(" + std::to_string(p.index) +
                    ")]] is beyond the slots a launch binds");
      const BoundArg& arg = launch.args[p.index];
      if (arg.kind == BoundArg::Kind::Empty || arg.data == nullptr)
        throw Error(prefix + "[[buffer(" + std::to_string(p.index) + ")]] (" + p.text +
                    ") is not bound");
      if (arg.size < p.min_bytes)
        throw Error(prefix + "[[buffer(" + std::to_string(p.index) + ")]] (" + p.text + ") holds " +
                    std::to_string(arg.size) + " bytes; the kernel reads " +
                    std::to_string(p.min_bytes));
      d.buffers[p.index] = arg.data;
      d.ranges.push_back(Range{reinterpret_cast<uintptr_t>(arg.data), arg.size, p.index,
                               arg.kind == BoundArg::Kind::Bytes});
    } else if (p.kind == KernelParam::Kind::Threadgroup) {
      const auto it =
          std::find_if(launch.threadgroup_memory.begin(), launch.threadgroup_memory.end(),
                       [&](const auto& m) { return m.first == p.index; });
      if (it == launch.threadgroup_memory.end() || it->second == 0)
        throw Error(prefix + "[[threadgroup(" + std::to_string(p.index) + ")]] (" + p.text +
                    ") has no threadgroup memory length encoded");
    }
  }
  uint64_t total = 0;
  for (const auto& [index, bytes] : launch.threadgroup_memory) {
    if (bytes % 16 != 0)
      throw Error(prefix + "threadgroup memory index " + std::to_string(index) + " has " +
                  std::to_string(bytes) + " bytes; Metal needs a multiple of 16");
    d.threadgroup.push_back(
        ThreadgroupBlock{static_cast<uint32_t>(index), bytes, static_cast<size_t>(total)});
    total += bytes + kThreadgroupGap;
    if (total - kThreadgroupGap * d.threadgroup.size() > kMaxThreadgroupMemory)
      throw Error(prefix + "threadgroup memory exceeds " + std::to_string(kMaxThreadgroupMemory) +
                  " bytes");
  }
  d.arena_bytes = static_cast<size_t>(total);
  const uint64_t threads = launch.threads.x * launch.threads.y * launch.threads.z;
  if (threads == 0 || threads > kMaxThreads)
    throw Error(prefix + "threads per threadgroup " + triple(narrow3(launch.threads)) +
                " must be 1.." + std::to_string(kMaxThreads));
  d.group_threads = narrow3(launch.threads);
  if (launch.kind == DispatchKind::Threads) {
    d.grid_threads = narrow3(launch.grid);
    for (int i = 0; i < 3; ++i)
      d.groups[i] = (d.grid_threads[i] + d.group_threads[i] - 1) / d.group_threads[i];
  } else {
    d.groups = narrow3(launch.grid);
    for (int i = 0; i < 3; ++i) d.grid_threads[i] = d.groups[i] * d.group_threads[i];
  }
  const uint64_t n_groups = uint64_t{d.groups[0]} * d.groups[1] * d.groups[2];
  if (n_groups == 0) return;
  if (n_groups > kMaxModelGroups || n_groups * threads > kMaxModelThreads)
    throw Error(prefix + "a launch of " + std::to_string(n_groups) + " threadgroups of " +
                std::to_string(threads) + " threads is more than the CPU model runs (at most " +
                std::to_string(kMaxModelGroups) + " threadgroups and " +
                std::to_string(kMaxModelThreads) + " threads)");

  // Function constants live in the shader's static data: one dispatch runs at a time.
  static std::mutex dispatch_mutex;
  std::lock_guard dispatch_lock(dispatch_mutex);
  if (kernel.set_constants != nullptr) {
    Worker& w = this_worker();
    w.dispatch = &d;
    Invocation probe;
    probe.worker = &w;
    kernel.set_constants(probe);
  }

  // Threadgroups in linear order, chunks over the pool; the lowest failing group's error wins.
  std::mutex mutex;
  uint64_t failed_group = std::numeric_limits<uint64_t>::max();
  std::string failure;
  std::atomic<bool> stop{false};
  auto body = [&](size_t begin, size_t end) {
    Worker& w = this_worker();
    for (size_t i = begin; i < end && !stop.load(std::memory_order_relaxed); ++i) {
      const std::array<uint32_t, 3> group = {
          static_cast<uint32_t>(i % d.groups[0]),
          static_cast<uint32_t>((i / d.groups[0]) % d.groups[1]),
          static_cast<uint32_t>(i / (uint64_t{d.groups[0]} * d.groups[1]))};
      const std::string error = run_group(w, d, group);
      if (!error.empty()) {
        std::lock_guard lock(mutex);
        if (i < failed_group) {
          failed_group = i;
          failure = error;
        }
        stop = true;
        return;
      }
    }
  };
  cpu::ThreadPool::instance().parallel_for(static_cast<size_t>(n_groups), 1, body);
  if (!failure.empty()) throw Error(failure);
}

}  // namespace routemm::metal_emu

// ---- The compiler's access hooks ------------------------------------------------------------------
// Shader translation units are compiled with -fsanitize=thread: the compiler calls these before
// every memory access it keeps. No ThreadSanitizer runtime is linked; these are the model's.
#define ROUTEMM_EMU_HOOK extern "C" __attribute__((visibility("hidden")))
#define ROUTEMM_EMU_ACCESS(n)                                                                   \
  ROUTEMM_EMU_HOOK void __tsan_read##n(void* p) { routemm::metal_emu::on_access(p, n, false); } \
  ROUTEMM_EMU_HOOK void __tsan_write##n(void* p) { routemm::metal_emu::on_access(p, n, true); } \
  ROUTEMM_EMU_HOOK void __tsan_unaligned_read##n(void* p) {                                     \
    routemm::metal_emu::on_access(p, n, false);                                                 \
  }                                                                                             \
  ROUTEMM_EMU_HOOK void __tsan_unaligned_write##n(void* p) {                                    \
    routemm::metal_emu::on_access(p, n, true);                                                  \
  }                                                                                             \
  ROUTEMM_EMU_HOOK void __tsan_volatile_read##n(void* p) {                                      \
    routemm::metal_emu::on_access(p, n, false);                                                 \
  }                                                                                             \
  ROUTEMM_EMU_HOOK void __tsan_volatile_write##n(void* p) {                                     \
    routemm::metal_emu::on_access(p, n, true);                                                  \
  }
ROUTEMM_EMU_ACCESS(1)
ROUTEMM_EMU_ACCESS(2)
ROUTEMM_EMU_ACCESS(4)
ROUTEMM_EMU_ACCESS(8)
ROUTEMM_EMU_ACCESS(16)
ROUTEMM_EMU_HOOK void __tsan_read_range(void* p, unsigned long size) {
  if (size != 0) routemm::metal_emu::on_access(p, size, false);
}
ROUTEMM_EMU_HOOK void __tsan_write_range(void* p, unsigned long size) {
  if (size != 0) routemm::metal_emu::on_access(p, size, true);
}
ROUTEMM_EMU_HOOK void __tsan_init() {}
ROUTEMM_EMU_HOOK void __tsan_func_entry(void*) {}
ROUTEMM_EMU_HOOK void __tsan_func_exit() {}
ROUTEMM_EMU_HOOK void __tsan_vptr_update(void**, void*) {}
ROUTEMM_EMU_HOOK void __tsan_vptr_read(void**) {}

// Atomics the compiler itself emits in instrumented code (guards of function-local statics and
// the like; MSL atomics go through msl.h, which checks them): performed, sequentially consistent.
#define ROUTEMM_EMU_ATOMIC(bits, type)                                                          \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_load(const volatile type* a, int) {               \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                \
  }                                                                                             \
  ROUTEMM_EMU_HOOK void __tsan_atomic##bits##_store(volatile type* a, type v, int) {            \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                   \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_exchange(volatile type* a, type v, int) {         \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                         \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_fetch_add(volatile type* a, type v, int) {        \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_fetch_sub(volatile type* a, type v, int) {        \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_fetch_and(volatile type* a, type v, int) {        \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_fetch_or(volatile type* a, type v, int) {         \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                           \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_fetch_xor(volatile type* a, type v, int) {        \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                             \
  ROUTEMM_EMU_HOOK int __tsan_atomic##bits##_compare_exchange_strong(volatile type* a, type* c, \
                                                                     type v, int, int) {        \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
  }                                                                                             \
  ROUTEMM_EMU_HOOK int __tsan_atomic##bits##_compare_exchange_weak(volatile type* a, type* c,   \
                                                                   type v, int, int) {          \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);     \
  }                                                                                             \
  ROUTEMM_EMU_HOOK type __tsan_atomic##bits##_compare_exchange_val(volatile type* a, type c,    \
                                                                   type v, int, int) {          \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);           \
    return c;                                                                                   \
  }
ROUTEMM_EMU_ATOMIC(8, uint8_t)
ROUTEMM_EMU_ATOMIC(16, uint16_t)
ROUTEMM_EMU_ATOMIC(32, uint32_t)
ROUTEMM_EMU_ATOMIC(64, uint64_t)
ROUTEMM_EMU_HOOK void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
ROUTEMM_EMU_HOOK void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
