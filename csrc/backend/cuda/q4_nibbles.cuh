// Q4_0 nibble decoding into bf16 MMA operands (and the split numerics' activation pairs), shared by
// the warp-MMA kernels (q4_matmul.cu), the Hopper kernel (q4_matmul_wgmma.cu) and the mat-vec
// experiments under bench/lab, so all of them dequantise with the same instructions and roundings.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace routemm::cuda {

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 v) {
  uint32_t out;
  memcpy(&out, &v, 4);
  return out;
}
__device__ __forceinline__ __nv_bfloat162 bf162_of(uint32_t bits) {
  __nv_bfloat162 out;
  memcpy(&out, &bits, 4);
  return out;
}

// (x & 0x000F000F) | 0x43004300 as one LOP3 (with both masks immediate the compiler emits two): the
// two nibbles at bits 0 and 16 as the bf16 pair (128 + q0, 128 + q1).
__device__ __forceinline__ uint32_t nibbles_plus_128(uint32_t x) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "n"(0x000F000F), "r"(0x43004300u));
  return r;
}

// (nibble - 8) as bf16x2 for the low (`low`) and high (`high`) nibbles of two bytes of `bytes`
// (kSelect 0x4140: bytes 0 and 1; 0x4342: bytes 2 and 3), the first byte in the lower half:
// 0x4300 | q is the bf16 of 128 + q, and subtracting 136 is exact.
template <uint32_t kSelect = 0x4140>
__device__ __forceinline__ void nibble_pairs(uint32_t bytes, uint32_t& low, uint32_t& high) {
  static_assert(kSelect == 0x4140 || kSelect == 0x4342);
  const __nv_bfloat162 bias = bf162_of(0x43084308u);  // bf16 136.0 twice, as bits: no conversion
  const uint32_t spread = __byte_perm(bytes, 0, kSelect);  // [b0, 0, b1, 0]
  low = bits_of(__hsub2(bf162_of(nibbles_plus_128(spread)), bias));
  high = bits_of(__hsub2(bf162_of(nibbles_plus_128(spread >> 4)), bias));
}

// The bf16 numerics' weight pair: bf16(d) * (q - 8), rounded to bf16 (`d2` = bf16(d) twice).
__device__ __forceinline__ uint32_t scale_pair(uint32_t q_minus_8, __nv_bfloat162 d2) {
  return bits_of(__hmul2(bf162_of(q_minus_8), d2));
}

// The split numerics' B registers (the mat-vec) of lane quarter t for one token and block: v =
// x[4t..4t+3], x[16+4t..16+4t+3] of the block's 32 values (or, kValues = 4, one of those runs);
// hi = the top 16 bits of each value (bf16 truncation, so x - hi is exact), lo = bf16(x - hi),
// which leaves |x - hi - lo| <= 2^-16 |x|. Pairs as v: (v0, v1), (v2, v3), ... Each value's hi and
// lo depend on that value alone, so a run split on its own gives the bits of the same run inside
// the eight-value split.
template <int kValues>
__device__ __forceinline__ void split_activation_pairs(const float (&v)[kValues],
                                                       uint32_t (&hi)[kValues / 2],
                                                       uint32_t (&lo)[kValues / 2]) {
  static_assert(kValues == 4 || kValues == 8);
#pragma unroll
  for (int q = 0; q < kValues / 2; ++q) {
    const uint32_t x0 = __float_as_uint(v[2 * q]), x1 = __float_as_uint(v[2 * q + 1]);
    hi[q] = __byte_perm(x0, x1, 0x7632);
    lo[q] = bits_of(__floats2bfloat162_rn(v[2 * q] - __uint_as_float(x0 & 0xFFFF0000u),
                                          v[2 * q + 1] - __uint_as_float(x1 & 0xFFFF0000u)));
  }
}

}  // namespace routemm::cuda
