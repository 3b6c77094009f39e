// One Q4_0 block of the earlier mat-vec's split numerics for one warp (16 weight rows x 8 tokens),
// kept for the TMA mat-vec experiment (q4_matvec_tma_kernel.cuh): the four mma.sync m16n8k16 of the
// block (low / high nibbles x the hi / lo bf16 parts of the activations) summed in F32 from zero,
// then one FMA with the block's scale. The library mat-vec now runs the digits numerics
// (csrc/backend/cuda/q4_matvec_digits.cuh).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "q4_nibbles.cuh"
#include "warp_mma.cuh"

namespace routemm::cuda {

// The split numerics' B registers (the mat-vec) of lane quarter t for one token and
// block: v = x[4t..4t+3], x[16+4t..16+4t+3] of the block's 32 values; hi = the top 16 bits of each value (bf16 truncation, so x - hi is exact),
// lo = bf16(x - hi), which leaves |x - hi - lo| <= 2^-16 |x|. Pairs as v: (v0, v1), ..., (v6, v7).
__device__ __forceinline__ void split_activation_pairs(const float (&v)[8], uint32_t (&hi)[4],
                                                       uint32_t (&lo)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t x0 = __float_as_uint(v[2 * q]), x1 = __float_as_uint(v[2 * q + 1]);
    hi[q] = __byte_perm(x0, x1, 0x7632);
    lo[q] = bits_of(__floats2bfloat162_rn(v[2 * q] - __uint_as_float(x0 & 0xFFFF0000u),
                                          v[2 * q + 1] - __uint_as_float(x1 & 0xFFFF0000u)));
  }
}


// Block b of a stage whose row runs start 16-byte aligned: `top` / `bottom` point at the runs of
// rows g and g + 8 (lane g = lane / 4, t = lane % 4), `bh` / `bl` are the lane's hi and lo B quads
// (split_activation_pairs). acc[0..1]: row g, tokens 2t, 2t + 1; acc[2..3]: row g + 8.
__device__ __forceinline__ void matvec_split_block(const uint8_t* top, const uint8_t* bottom, int b,
                                                   int t, uint4 bh, uint4 bl, float (&acc)[4]) {
  // Blocks are 18 bytes, so the 4 nibble bytes 4t..4t+3 of odd blocks are 4-byte aligned and those
  // of even blocks 2-byte aligned.
  const int nib = b * 18 + 2 + 4 * t;
  const auto nibble_bytes = [&](const uint8_t* row) -> uint32_t {
    if (b % 2 == 1) return *reinterpret_cast<const uint32_t*>(row + nib);
    return uint32_t{*reinterpret_cast<const uint16_t*>(row + nib)} |
           (uint32_t{*reinterpret_cast<const uint16_t*>(row + nib + 2)} << 16);
  };
  const uint32_t v_top = nibble_bytes(top), v_bottom = nibble_bytes(bottom);
  const float d_top = __half2float(*reinterpret_cast<const __half*>(top + b * 18));
  const float d_bottom = __half2float(*reinterpret_cast<const __half*>(bottom + b * 18));
  // a0 row g, a1 row g+8 (values 4t, 4t+1); a2 row g, a3 row g+8 (values 4t+2, 4t+3).
  uint32_t a_lo[4], a_hi[4];
  nibble_pairs<0x4140>(v_top, a_lo[0], a_hi[0]);
  nibble_pairs<0x4140>(v_bottom, a_lo[1], a_hi[1]);
  nibble_pairs<0x4342>(v_top, a_lo[2], a_hi[2]);
  nibble_pairs<0x4342>(v_bottom, a_lo[3], a_hi[3]);
  float block_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16_16816(block_sum, a_lo, bh.x, bh.y);
  mma_bf16_16816(block_sum, a_lo, bl.x, bl.y);
  mma_bf16_16816(block_sum, a_hi, bh.z, bh.w);
  mma_bf16_16816(block_sum, a_hi, bl.z, bl.w);
  acc[0] = fmaf(d_top, block_sum[0], acc[0]);
  acc[1] = fmaf(d_top, block_sum[1], acc[1]);
  acc[2] = fmaf(d_bottom, block_sum[2], acc[2]);
  acc[3] = fmaf(d_bottom, block_sum[3], acc[3]);
}

}  // namespace routemm::cuda
