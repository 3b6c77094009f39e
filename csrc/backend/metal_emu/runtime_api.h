// The calls shader code makes into the execution model (runtime.cpp), through msl.h and the
// generated entry points (bind_shaders.py). Plain C++: no MSL types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <source_location>
#include <string>

namespace routemm::metal_emu {

inline constexpr uint32_t kSimdWidth = 32;
inline constexpr size_t kExchangeSlotBytes = 64;  // the largest value one lane can exchange

enum class BarrierScope : uint8_t { Threadgroup, Simdgroup };

// Which lanes a simdgroup exchange needs (runtime.h states the rules):
//   ActiveLanes   the lanes that reach this call together; the others are inactive for it;
//   ReadsLane     as ActiveLanes, and the calling lane reads lane `source`, which must be active;
//   UniformSource as ReadsLane, and every active lane names the same `source`.
enum class ExchangeRule : uint8_t { ActiveLanes, ReadsLane, UniformSource };

// What an exchange returns to each lane: the active lanes (bit l = lane l) and every active
// lane's deposited value, kExchangeSlotBytes apart, valid until the lane's next model call.
struct Exchange {
  uint32_t active = 0;
  uint32_t lane = 0;  // the calling lane
  const unsigned char* values = nullptr;
};

Exchange exchange(const char* op, const void* value, size_t size, ExchangeRule rule,
                  uint32_t source, const std::source_location& at);
void barrier(BarrierScope scope, uint32_t mem_flags, const std::source_location& at);
// A step every lane of the simdgroup must execute together (simdgroup-matrix operations).
void simdgroup_uniform(const char* op, const std::source_location& at);
uint32_t current_lane();
uint32_t current_thread_index();  // thread_index_in_threadgroup
// Checks an atomic access (bounds, binding); atomics never count as races.
void check_atomic(const void* address, size_t size);

// ---- Tensor operations (msl_tensor.h) ----------------------------------------------------------
// A tensor view of `bytes` from `first` must lie inside one bound buffer or one threadgroup block.
void check_tensor_view(const void* first, size_t bytes, const std::source_location& at);
// Entry into a tensor op whose execution scope is the whole threadgroup of `simdgroups`
// simdgroups: every thread of the threadgroup enters the same call together (like a threadgroup
// barrier, but ordering no memory); a threadgroup of another size is an error.
void threadgroup_scope(const char* op, uint32_t simdgroups, const std::source_location& at);
// Stops the calling thread with an error naming the kernel and thread, followed by `message`.
[[noreturn]] void shader_error(const std::string& message);

// ---- Binding (used by the generated entry points) --------------------------------------------------

// The built-in position attributes a kernel parameter can carry.
enum class Position : uint8_t {
  thread_position_in_grid,
  thread_position_in_threadgroup,
  thread_index_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  dispatch_threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  simdgroup_index_in_threadgroup,
  thread_index_in_simdgroup,
  threads_per_simdgroup,
  simdgroups_per_threadgroup,
};

struct Invocation;  // one thread of one dispatch (runtime.cpp)

// The address bound at [[buffer(index)]] / [[threadgroup(index)]] (checked at dispatch).
void* bound_buffer(const Invocation& invocation, uint32_t index);
void* bound_threadgroup(const Invocation& invocation, uint32_t index);
// The attribute's three components (scalars use the first).
const uint32_t* position(const Invocation& invocation, Position which);
// The value of [[function_constant(index)]] from the pipeline label's specialisation constants.
int32_t function_constant(const Invocation& invocation, uint32_t index, const char* name);

}  // namespace routemm::metal_emu
