// A CPU model of the Metal compute execution model, running metal/*.metal compiled by the host
// compiler against msl.h (the kernels' bindings come from bind_shaders.py).
//
// Execution: a dispatch's threadgroups run one after another on each host worker thread (several
// workers at once); the threads of one threadgroup are fibers on one host thread, switched only
// where Metal synchronises them (barriers, simdgroup functions, simdgroup-matrix steps), so a
// threadgroup runs deterministically. Thread t of a threadgroup is lane t % 32 of simdgroup t / 32.
//
// Synchronisation rules (what the model runs, and what it reports as an error):
//   * threadgroup_barrier: every thread of the threadgroup that has not returned waits at the same
//     barrier; a thread that returned, or that waits at another barrier, while others wait is an
//     error ("barrier not reached by every thread").
//   * simd_sum, simd_max, scans and the like combine the lanes that reach the call together (the
//     active lanes; lanes that returned or wait elsewhere are inactive, as Metal defines).
//   * simd_shuffle*, simd_broadcast: the lane read must be active at the call, and simd_broadcast's
//     lane the same for every active lane; otherwise Metal leaves the result undefined: an error.
//   * simdgroup_barrier and simdgroup-matrix operations: all 32 lanes of the simdgroup execute them
//     together; under divergent control flow (a lane returned or is elsewhere) they are undefined
//     in Metal: an error.
//
// Memory checks, on every access the compiler instruments in shader code:
//   * device and constant memory: an access must lie inside the extent of a bound buffer (from the
//     bound address to the end of its allocation); inline constant bytes are read-only. Any other
//     address (past a buffer, in an allocation the dispatch did not bind, anywhere else) is an
//     error, except the program's own static data (the shaders' constant tables).
//   * threadgroup memory: [[threadgroup(i)]] gets exactly the length encoded at index i (poisoned
//     with 0xFF bytes, as its contents are undefined); an access past it is an error, and so is a
//     race: two threads touching one byte between two threadgroup barriers, at least one writing
//     (lanes of one simdgroup are also ordered by a simdgroup_barrier between the accesses).
//     Atomics are never races.
// Every error names the kernel, the threadgroup and thread (and simdgroup, lane), and the address
// with what it belongs to; a dispatch stops at its first error and reports it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backend/metal_emu/runtime_api.h"
#include "routemm/backend.h"

namespace routemm::metal_emu {

// One parameter of a kernel, as bind_shaders.py read it from the source.
struct KernelParam {
  enum class Kind : uint8_t { Buffer, Threadgroup, Position };
  Kind kind = Kind::Buffer;
  uint32_t index = 0;     // [[buffer(i)]] / [[threadgroup(i)]]; Position: the attribute
  size_t min_bytes = 0;   // Buffer by reference (`constant T&`): sizeof(T)
  const char* text = "";  // the parameter as written, for messages
};

using EntryFn = void (*)(const Invocation&);
// Sets the file's function constants (and checks each is given) before a dispatch.
using ConstantsFn = void (*)(const Invocation&);

struct ShaderKernel {
  std::string name;
  std::string file;           // the .metal file
  std::string source_sha256;  // of that file's text
  EntryFn entry = nullptr;
  ConstantsFn set_constants = nullptr;
  std::vector<KernelParam> params;
  std::vector<std::pair<uint32_t, std::string>> function_constants;  // (index, name) of the file
};

// The kernels of one set of shader files, by name.
class ShaderLibrary {
 public:
  void add(ShaderKernel kernel);
  const ShaderKernel* find(const std::string& name) const;
  const std::map<std::string, ShaderKernel>& kernels() const { return kernels_; }

 private:
  std::map<std::string, ShaderKernel> kernels_;
};

// Where an address lies among a backend's allocations (the model asks only about addresses outside
// every bound range). An allocation is [begin, begin + size), inside a reservation whose remainder
// no one may touch.
struct AllocationInfo {
  uintptr_t begin = 0;
  size_t size = 0;
};
class AllocationLookup {
 public:
  virtual std::optional<AllocationInfo> find(uintptr_t address) const = 0;

 protected:
  ~AllocationLookup() = default;
};

// Runs one launch of `kernel` to completion, threadgroups spread over the CPU backend's thread
// pool (one dispatch at a time per process: function constants are the shader's static data). Throws routemm::Error naming the kernel, thread and address of the first violation (the
// one in the lowest threadgroup, whatever the scheduling).
void run_dispatch(const ShaderKernel& kernel, const KernelLaunch& launch,
                  const AllocationLookup* allocations);

}  // namespace routemm::metal_emu
