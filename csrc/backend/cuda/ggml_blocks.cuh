// Device-side GGML block formats (Q4_0, Q8_0) for the exact quantised kernels: value j of a
// 32-value block, dequantised exactly (an 11-bit scale significand times an integer of at most 8
// bits fits binary32), read straight from the raw, 2-byte aligned GGUF bytes.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/common/q4_0_block.h"

namespace routemm::cuda::ggml {

__device__ __forceinline__ float block_scale(const uint8_t* block) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(block)));
}

struct Q4_0Blocks {
  static constexpr uint32_t kBytes = kernels::kQ4_0BlockBytes;
  // Value j: the low nibble of qs[j] (j < 16) or the high nibble of qs[j - 16], minus 8. The
  // nibble q goes into the low mantissa bits of 2^23, making the float 2^23 + q; subtracting
  // 2^23 + 8 (both integers below 2^24, so exactly) leaves q - 8. One logic operation and one add
  // instead of an integer-to-float conversion, which issues at a quarter of the FMA rate and bound
  // the direct kernel at m = 8 (one conversion per weight).
  static __device__ __forceinline__ float value(const uint8_t* block, float d, uint32_t j) {
    const uint32_t byte = block[2 + (j & 15u)];
    const uint32_t q = j < 16 ? (byte & 0x0fu) : (byte >> 4);
    return __fmul_rn(d, __fsub_rn(__uint_as_float(0x4B000000u | q), 8388616.0f));  // 2^23 + 8
  }
};

// The exact F32 value of the signed byte `byte` (0..3) of `word`, given `flipped` = word ^
// 0x80808080 (computed once per word): flipping the sign bit makes the byte u = q + 128, unsigned;
// placed in the low mantissa bits of 2^23 it is the float 2^23 + u, and subtracting 2^23 + 128
// (both integers below 2^24, so the difference is exact) leaves q. A byte permute and one add,
// cheaper than a conversion instruction.
__device__ __forceinline__ float int8_value(uint32_t flipped, uint32_t byte) {
  const float biased = __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7650u | byte));
  return __fsub_rn(biased, 8388736.0f);  // 2^23 + 128
}

struct Q8_0Blocks {
  static constexpr uint32_t kBytes = kernels::kQ8_0BlockBytes;
  static __device__ __forceinline__ float value(const uint8_t* block, float d, uint32_t j) {
    return __fmul_rn(d, int8_value(block[2 + j] ^ 0x80u, 0));
  }
};

// The CPU oracle's lane contract on eight threads (lane = threadIdx % 8): lane l accumulates
// positions i = l, l + 8, ... < k with one FMA each, in increasing order, for R input rows;
// `sum8` then adds the eight lanes in the oracle's fixed tree ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)),
// so every output is bit-identical to the CPU backend's.
template <class F, int R>
__device__ __forceinline__ void lane_dot(const uint8_t* __restrict__ row, uint32_t k,
                                         const float* const (&x)[R], uint32_t lane,
                                         float (&acc)[R]) {
  for (uint32_t b = 0; b < k / 32; ++b) {
    const uint8_t* block = row + size_t{b} * F::kBytes;
    const float d = block_scale(block);
#pragma unroll
    for (uint32_t s = 0; s < 4; ++s) {
      const uint32_t j = s * 8 + lane;
      const float w = F::value(block, d, j);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = __fmaf_rn(w, x[r][b * 32 + j], acc[r]);
    }
  }
}

// Sum over the eight lanes of an aligned group of eight threads; every lane gets the total.
__device__ __forceinline__ float sum8(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
}

}  // namespace routemm::cuda::ggml
