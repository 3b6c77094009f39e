// One Q4_0 block of the mat-vec's split numerics for one warp (16 weight rows), in two column
// layouts. matvec_split_columns_block (the library mat-vec for m <= 4): B column 2j holds token j's
// hi parts and column 2j + 1 its lo parts, so one pair of mma.sync m16n8k16 (low / high nibbles)
// covers four tokens. matvec_split_block (the library mat-vec for m > 4, and the TMA experiment
// under bench/lab): 8 tokens of hi parts and 8 of lo, four MMAs. Both compute, per token and row,
// the same bits: the hi parts' MMA pair (low nibbles, then high nibbles) from zero, the lo parts'
// pair likewise, hi + lo, then one FMA with the block's scale. So a token's block sums do not depend
// on how many tokens share the launch, and the library and the lab compute the same bits.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "q4_nibbles.cuh"
#include "warp_mma.cuh"

namespace routemm::cuda {

// The lane's A registers of block b (low and high nibbles, rows g and g + 8, as bf16 q - 8) and the
// two rows' F32 scales, from a stage whose row runs start 16-byte aligned (`top` / `bottom`: rows g
// and g + 8).
__device__ __forceinline__ void matvec_block_weights(const uint8_t* top, const uint8_t* bottom,
                                                     int b, int t, uint32_t (&a_lo)[4],
                                                     uint32_t (&a_hi)[4], float& d_top,
                                                     float& d_bottom) {
  // Blocks are 18 bytes, so the 4 nibble bytes 4t..4t+3 of odd blocks are 4-byte aligned and those
  // of even blocks 2-byte aligned. The parity is tested as b & 1, not b % 2 == 1: b's sign is
  // unknown to the compiler, so b % 2 costs a run-time test in every block even where the
  // unrolled loop fixes the parity of b.
  const int nib = b * 18 + 2 + 4 * t;
  const auto nibble_bytes = [&](const uint8_t* row) -> uint32_t {
    if (b & 1) return *reinterpret_cast<const uint32_t*>(row + nib);
    return uint32_t{*reinterpret_cast<const uint16_t*>(row + nib)} |
           (uint32_t{*reinterpret_cast<const uint16_t*>(row + nib + 2)} << 16);
  };
  const uint32_t v_top = nibble_bytes(top), v_bottom = nibble_bytes(bottom);
  d_top = __half2float(*reinterpret_cast<const __half*>(top + b * 18));
  d_bottom = __half2float(*reinterpret_cast<const __half*>(bottom + b * 18));
  // a0 row g, a1 row g+8 (values 4t, 4t+1); a2 row g, a3 row g+8 (values 4t+2, 4t+3).
  nibble_pairs<0x4140>(v_top, a_lo[0], a_hi[0]);
  nibble_pairs<0x4140>(v_bottom, a_lo[1], a_hi[1]);
  nibble_pairs<0x4342>(v_top, a_lo[2], a_hi[2]);
  nibble_pairs<0x4342>(v_bottom, a_lo[3], a_hi[3]);
}

// Block b for up to four tokens: `bq` is the lane's B quad (lane (g, t): token g / 2, its hi parts
// for even g, lo parts for odd g). acc_top / acc_bottom: rows g / g + 8, token t (the hi and lo
// columns of the MMA added before the scale FMA).
__device__ __forceinline__ void matvec_split_columns_block(const uint8_t* top,
                                                           const uint8_t* bottom, int b, int t,
                                                           uint4 bq, float& acc_top,
                                                           float& acc_bottom) {
  uint32_t a_lo[4], a_hi[4];
  float d_top, d_bottom;
  matvec_block_weights(top, bottom, b, t, a_lo, a_hi, d_top, d_bottom);
  float block_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16_16816(block_sum, a_lo, bq.x, bq.y);
  mma_bf16_16816(block_sum, a_hi, bq.z, bq.w);
  acc_top = fmaf(d_top, block_sum[0] + block_sum[1], acc_top);
  acc_bottom = fmaf(d_bottom, block_sum[2] + block_sum[3], acc_bottom);
}

// Block b of a stage whose row runs start 16-byte aligned: `top` / `bottom` point at the runs of
// rows g and g + 8 (lane g = lane / 4, t = lane % 4), `bh` / `bl` are the lane's hi and lo B quads
// (split_activation_pairs). acc[0..1]: row g, tokens 2t, 2t + 1; acc[2..3]: row g + 8. The hi and
// lo parts run as two independent chains of two MMAs (the latency of two MMAs per block, as in
// matvec_split_columns_block, instead of one chain of four), added before the scale FMA.
__device__ __forceinline__ void matvec_split_block(const uint8_t* top, const uint8_t* bottom, int b,
                                                   int t, uint4 bh, uint4 bl, float (&acc)[4]) {
  uint32_t a_lo[4], a_hi[4];
  float d_top, d_bottom;
  matvec_block_weights(top, bottom, b, t, a_lo, a_hi, d_top, d_bottom);
  float hi_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float lo_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  mma_bf16_16816(hi_sum, a_lo, bh.x, bh.y);
  mma_bf16_16816(lo_sum, a_lo, bl.x, bl.y);
  mma_bf16_16816(hi_sum, a_hi, bh.z, bh.w);
  mma_bf16_16816(lo_sum, a_hi, bl.z, bl.w);
  acc[0] = fmaf(d_top, hi_sum[0] + lo_sum[0], acc[0]);
  acc[1] = fmaf(d_top, hi_sum[1] + lo_sum[1], acc[1]);
  acc[2] = fmaf(d_bottom, hi_sum[2] + lo_sum[2], acc[2]);
  acc[3] = fmaf(d_bottom, hi_sum[3] + lo_sum[3], acc[3]);
}

}  // namespace routemm::cuda
