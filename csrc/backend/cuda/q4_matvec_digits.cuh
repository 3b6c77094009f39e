// The Q4_0 mat-vec's integer numerics ("digits"): the weights enter as their exact nibbles q (u8),
// each activation block (one token, 32 values) as an exact integer multiple of a power of two,
// X = rint(x / s), |X| <= 2^20, written as three signed base-128 digits (s8). One integer MMA
// (mma.sync m16n8k32 u8 x s8 -> s32) per digit multiplies a whole 32-value block for 16 rows x 8
// tokens with no rounding at all; the three products are combined in int32, the -8 offset of the
// nibbles is taken off with the block's precomputed 8 * sum(X), and the exact block sum
// sum((q - 8) * X) is converted to F32 once, scaled by s (a power of two) and by the block's F32
// scale d with one FMA into the accumulator. The only roundings: x to X (|x - s X| <= s / 2 <=
// 2^-20 * max|x| of the block), the int -> F32 conversion (2^-24 relative), and the F32 scale and
// accumulation, which is the split numerics' F32 part. Non-finite activations give a NaN block.
//
// Staged layout of one block (one chunk slot, kDigitBlockHeader + tokens * kDigitTokenBytes bytes):
//   [0, 32)   s of tokens 0..7 (F32; 0 for tokens past m),
//   [32, 64)  8 * sum(X) of tokens 0..7 (int32; 0 past m),
//   then per valid token 96 bytes: digit plane p (0 = most significant) at 32 p, within it lane
//   quarter t's B registers (values 4t..4t+3, then 16+4t..16+4t+3, four s8 digits each) at 8 t.
// The B registers of m16n8k32 (8-bit) for lane (g, t) are exactly those two words of token g, and
// the A registers of rows g and g + 8 are the block's nibble bytes 4t..4t+3 (low nibbles: values
// 4t..4t+3; high nibbles: 16+4t..16+4t+3), so neither side is permuted.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace routemm::cuda {

constexpr int kDigitBlockHeader = 64;
constexpr int kDigitTokenBytes = 96;

// D = A * B for one m16n8k32 tile: u8 weights (row-major A), s8 digits (column-major B), s32.
__device__ __forceinline__ void mma_u8s8_16832(int (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

__device__ __forceinline__ float pow2f(int e) {  // 2^e for e in [-126, 127]
  return __int_as_float((e + 127) << 23);
}

// Converts one token's block: lane c = lane % 8 of each aligned group of 8 lanes holds values
// 4c..4c+3 in `v` (all 32 lanes of the warp call it; groups are independent; lanes with nothing to
// convert pass zeros and store nothing). Writes the lane's three digit words into `token_digits`
// (this token's 96 bytes) and, from lane c == 0, the block's s and 8 * sum(X) into `scale` /
// `offset`.
__device__ __forceinline__ void stage_activation_digits(const float (&v)[4], bool store,
                                                        uint8_t* token_digits, float* scale,
                                                        int32_t* offset) {
  uint32_t amax = 0;  // largest |x| as bits: integer order is float order, NaN above infinity
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = max(amax, __float_as_uint(v[i]) & 0x7FFFFFFFu);
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  const bool finite = amax < 0x7F800000u;
  // eb: the biased exponent of max|x| (0 for subnormals), so max|x| < 2^(eb - 126). X = x * 2^(146
  // - eb) keeps |X| < 2^20 (+ rounding: <= 2^20) with >= 19 bits for the largest value; s =
  // 2^(eb - 146) is a normal or subnormal F32 for every eb, and X s represents any subnormal x
  // exactly. The multiplier goes in two steps, each a representable power of two.
  const int eb = finite ? static_cast<int>(amax >> 23) : 0;
  const int shift = 146 - eb, first = shift / 2;
  const float m1 = pow2f(first), m2 = pow2f(shift - first);
  uint32_t planes[3] = {0, 0, 0};
  int sum = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int x = finite ? __float2int_rn(v[i] * m1 * m2) : 0;
    sum += x;
    const int d2 = ((x + 64) & 127) - 64;  // balanced base-128 digits, each in [-64, 64]
    const int y = (x - d2) >> 7;
    const int d1 = ((y + 64) & 127) - 64;
    const int d0 = (y - d1) >> 7;
    planes[0] |= uint32_t(d0 & 0xFF) << (8 * i);
    planes[1] |= uint32_t(d1 & 0xFF) << (8 * i);
    planes[2] |= uint32_t(d2 & 0xFF) << (8 * i);
  }
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
  if (!store) return;
  const int c = static_cast<int>(threadIdx.x & 31) & 7;
  const int word = (c & 3) * 8 + (c >> 2) * 4;
#pragma unroll
  for (int p = 0; p < 3; ++p)
    *reinterpret_cast<uint32_t*>(token_digits + 32 * p + word) = planes[p];
  if (c == 0) {
    *scale = !finite    ? __int_as_float(0x7FC00000)
             : eb >= 20 ? pow2f(eb - 146)
                        : __int_as_float(1 << (eb + 3));
    *offset = 8 * sum;
  }
}

// Block b of a stage whose row runs start 16-byte aligned, for one warp (16 weight rows x 8
// tokens): `top` / `bottom` point at the runs of rows g and g + 8 (g = lane / 4, t = lane % 4),
// `block` at the block's staged activations and `lane_digits` at lane (g, t)'s digit words in it
// (token g's, or a valid token's for lanes past m). acc[0..1]: row g, tokens 2t, 2t + 1; acc[2..3]:
// row g + 8.
__device__ __forceinline__ void matvec_digit_block(const uint8_t* top, const uint8_t* bottom, int b,
                                                   int t, const uint8_t* block,
                                                   const uint8_t* lane_digits, float (&acc)[4]) {
  // Blocks are 18 bytes, so the 4 nibble bytes 4t..4t+3 of odd blocks are 4-byte aligned and those
  // of even blocks 2-byte aligned.
  const int nib = b * 18 + 2 + 4 * t;
  const auto nibble_bytes = [&](const uint8_t* row) -> uint32_t {
    if (b % 2 == 1) return *reinterpret_cast<const uint32_t*>(row + nib);
    return uint32_t{*reinterpret_cast<const uint16_t*>(row + nib)} |
           (uint32_t{*reinterpret_cast<const uint16_t*>(row + nib + 2)} << 16);
  };
  const uint32_t v_top = nibble_bytes(top), v_bottom = nibble_bytes(bottom);
  const uint32_t a[4] = {v_top & 0x0F0F0F0Fu, v_bottom & 0x0F0F0F0Fu, (v_top >> 4) & 0x0F0F0F0Fu,
                         (v_bottom >> 4) & 0x0F0F0F0Fu};
  int p[3][4];
#pragma unroll
  for (int d = 0; d < 3; ++d) {
    const uint2 digits = *reinterpret_cast<const uint2*>(lane_digits + 32 * d);
    mma_u8s8_16832(p[d], a, digits.x, digits.y);
  }
  const float2 s = *reinterpret_cast<const float2*>(block + 8 * t);
  const int2 offset = *reinterpret_cast<const int2*>(block + 32 + 8 * t);
  const float d_top = __half2float(*reinterpret_cast<const __half*>(top + b * 18));
  const float d_bottom = __half2float(*reinterpret_cast<const __half*>(bottom + b * 18));
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    // sum(q X) <= 32 * 15 * 2^20 and |sum((q - 8) X)| <= 2^28: exact in int32.
    const int exact = (((p[0][e] << 7) + p[1][e]) << 7) + p[2][e] - (e & 1 ? offset.y : offset.x);
    const float block_sum = __int2float_rn(exact) * (e & 1 ? s.y : s.x);
    acc[e] = fmaf(e >= 2 ? d_bottom : d_top, block_sum, acc[e]);
  }
}

}  // namespace routemm::cuda
