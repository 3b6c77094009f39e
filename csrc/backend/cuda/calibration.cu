// CUDA kernels of the route-calibration proof (backend/common/calibration_params.h):
// routemm_calibration_poison_f32 and routemm_calibration_compare_f32. Threads dispatches: the
// launch's grid.x is the number of guarded elements, threads.x the block size (<= 1024).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/calibration_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "kernels.h"
#include "routemm/error.h"

#ifndef ROUTEMM_CUDA_CALIBRATION_SHA256
#define ROUTEMM_CUDA_CALIBRATION_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::CalibrationKernelParams;

__global__ void poison_kernel(uint32_t* __restrict__ control, uint32_t* __restrict__ candidate,
                              uint64_t guarded) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t t = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < guarded; t += stride) {
    control[t] = kernels::kCalibrationPoisonBits;
    candidate[t] = kernels::kCalibrationPoisonBits;
  }
}

__global__ void compare_kernel(const uint32_t* __restrict__ control,
                               const uint32_t* __restrict__ candidate,
                               uint32_t* __restrict__ statuses, uint64_t logical, uint64_t guarded,
                               uint32_t status_index) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  uint32_t bits = 0;
  for (uint64_t t = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < guarded; t += stride) {
    bits |= kernels::calibration_element_status(control[t], candidate[t], t < logical);
  }
  // One atomic per warp: OR-reduce the lanes first.
  for (int offset = 16; offset > 0; offset >>= 1)
    bits |= __shfl_xor_sync(0xFFFFFFFFu, bits, offset);
  if ((threadIdx.x & 31u) == 0 && bits != 0) atomicOr(statuses + status_index, bits);
}

CalibrationKernelParams params_of(const KernelLaunch& launch, size_t slot) {
  const auto p = kernels::launch_params<CalibrationKernelParams>(launch, slot);
  if (p.logical_elements > p.guarded_elements)
    throw Error(launch.label + ": logical elements exceed guarded");
  return p;
}

uint32_t* words(const KernelLaunch& launch, size_t slot, const char* what, uint64_t elements) {
  const BoundArg& a = kernels::launch_arg(launch, slot, what, elements * 4);
  if (a.kind != BoundArg::Kind::Buffer)
    throw Error(launch.label + ": " + what + " must be a buffer");
  return static_cast<uint32_t*>(a.data);
}

// Blocks for `guarded` elements at `threads` per block; a grid-stride loop covers the rest.
void launch_shape(const KernelLaunch& launch, uint64_t guarded, unsigned& blocks,
                  unsigned& threads) {
  uint64_t t = launch.threads.x * launch.threads.y * launch.threads.z;
  if (t == 0 || t > 1024) throw Error(launch.label + ": threads per block must be in 1..=1024");
  t = (t + 31) / 32 * 32;  // whole warps: the compare kernel's shuffle needs full warps
  if (t > 1024) t = 1024;
  uint64_t b = (guarded + t - 1) / t;
  if (b == 0) b = 1;
  if (b > 65535ull * 16) b = 65535ull * 16;
  blocks = static_cast<unsigned>(b);
  threads = static_cast<unsigned>(t);
}

void check_launch(const KernelLaunch& launch) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(launch.label + ": launch failed: " + cudaGetErrorString(err));
}

void launch_poison(const KernelLaunch& launch, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const CalibrationKernelParams p = params_of(launch, 2);
  uint32_t* control = words(launch, 0, "control output", p.guarded_elements);
  uint32_t* candidate = words(launch, 1, "candidate output", p.guarded_elements);
  if (p.guarded_elements == 0) return;
  unsigned blocks = 0, threads = 0;
  launch_shape(launch, p.guarded_elements, blocks, threads);
  poison_kernel<<<blocks, threads, 0, stream>>>(control, candidate, p.guarded_elements);
  check_launch(launch);
}

void launch_compare(const KernelLaunch& launch, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const CalibrationKernelParams p = params_of(launch, 3);
  const uint32_t* control = words(launch, 0, "control output", p.guarded_elements);
  const uint32_t* candidate = words(launch, 1, "candidate output", p.guarded_elements);
  uint32_t* statuses = words(launch, 2, "statuses", uint64_t{p.status_index} + 1);
  if (p.guarded_elements == 0) return;
  unsigned blocks = 0, threads = 0;
  launch_shape(launch, p.guarded_elements, blocks, threads);
  compare_kernel<<<blocks, threads, 0, stream>>>(control, candidate, statuses, p.logical_elements,
                                                 p.guarded_elements, p.status_index);
  check_launch(launch);
}

KernelDef def(std::string_view name, KernelFn fn) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.check_args = kernels::kernel_arg_contract(name);
  d.max_threads_per_threadgroup = 1024;
  d.threads_per_group = 256;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_CALIBRATION_SHA256;
  return d;
}

}  // namespace

void add_calibration_kernels(std::vector<KernelDef>& out) {
  out.push_back(def("routemm_calibration_poison_f32", launch_poison));
  out.push_back(def("routemm_calibration_compare_f32", launch_compare));
}

}  // namespace routemm::cuda
