// Copies of raw GGUF block rows from global into shared memory at the widest size a view's
// alignment allows, shared by the Q4_0 and Q8_0 dense kernels (blocks of 18 and 34 bytes are only
// 2-byte aligned, and a weight view may start at any byte).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "warp_mma.cuh"

namespace routemm::cuda {

// Copies `grain` bytes global -> shared (grain and both addresses are multiples of `grain`); 16, 8
// and 4 as cp.async, 2 and 1 as plain loads and stores (visible to the warp after a __syncwarp).
__device__ __forceinline__ void copy_grain(uint8_t* dst, const uint8_t* src, int grain) {
  switch (grain) {
    case 16: cp_async_16(smem_addr(dst), src, true); break;
    case 8: cp_async_8(smem_addr(dst), src); break;
    case 4: cp_async_4(smem_addr(dst), src); break;
    case 2: *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src); break;
    default: *dst = *src; break;
  }
}

// Largest copy size in {16, 8, 4, 2, 1} that divides the view's address and every listed byte
// offset or length (row stride, stage length, tail stage length...), so that every copy a kernel
// issues from those is naturally aligned on both sides.
inline int copy_grain_for(const void* base, std::initializer_list<uint64_t> offsets) {
  const auto address = reinterpret_cast<uintptr_t>(base);
  for (int grain : {16, 8, 4, 2}) {
    bool divides = address % grain == 0;
    for (const uint64_t offset : offsets) divides = divides && offset % grain == 0;
    if (divides) return grain;
  }
  return 1;
}

}  // namespace routemm::cuda
