// Dynamic shared memory beyond 48 KiB must be opted into per kernel and per device. The persistent
// tensor-core kernels size theirs by expert count, so they raise the limit once per device to the
// size their largest supported expert count needs, and check it again only when a launch asks for
// more than was set.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "routemm/error.h"

namespace routemm::cuda {

inline constexpr int kMaxOptInDevices = 64;

// Makes sure `Kernel` may launch with `needed` bytes of dynamic shared memory on the current
// device, raising its limit to `cap` (>= needed) the first time. Throws a routemm::Error naming
// `label` when there is no current device or the driver refuses.
template <auto Kernel>
void opt_in_dynamic_smem(const std::string& label, uint64_t needed, uint64_t cap) {
  static std::atomic<uint64_t> raised[kMaxOptInDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxOptInDevices) {
    throw Error("'" + label + "': no current CUDA device");
  }
  if (raised[device].load(std::memory_order_acquire) >= needed) return;
  if (const cudaError_t e = cudaFuncSetAttribute(
          Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cap));
      e != cudaSuccess) {
    throw Error("'" + label + "': cannot raise shared memory: " + cudaGetErrorString(e));
  }
  raised[device].store(cap, std::memory_order_release);
}

}  // namespace routemm::cuda
