// aarch64 NEON clone of the Q4_0 / Q8_0 micro-kernels (ggml_block_kernels.h's primitives and
// contract; isa.h: CpuIsa::neon). Included at the end of ggml_block_kernels.h, which declares
// NeonIsa and picks it in mv_range_for / mm_item_for.
//
// Blocks are dequantised in registers to the portable clone's exact values (d * (q - 8), d * q:
// exact products), every output runs the contract's eight FMA chains as two float32x4_t
// (neon_kernels.h) and the lane tree of simd::reduce_lanes: the portable clone's bits.
#pragma once

#include <type_traits>

#include "ggml_block_kernels.h"
#include "neon_kernels.h"

#if ROUTEMM_CPU_HAVE_NEON

namespace routemm::cpu::ggml {

namespace neon_detail {

using neon::V8;

// Eight signed integers times d, as the portable d * float(q).
ROUTEMM_CPU_INLINE V8 scale8(int8x8_t q, float32x4_t d) {
  const int16x8_t w = vmovl_s8(q);
  return {vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)))),
          vmulq_f32(d, vcvtq_f32_s32(vmovl_high_s16(w)))};
}

// The block's 32 values as four eight-value steps, v[s] = values 8s .. 8s + 7.
template <class Format>
ROUTEMM_CPU_INLINE void dequant(const uint8_t* block, V8 v[kLanesPerBlock]) {
  const float32x4_t d = vdupq_n_f32(simd::widen(simd::Half{block_scale_bits(block)}));
  if constexpr (std::is_same_v<Format, Q4_0Format>) {
    // Values 0-15: the low nibbles of bytes 0-15; values 16-31: their high nibbles; minus 8.
    const uint8x16_t bytes = vld1q_u8(block + 2);
    const int8x16_t eight = vdupq_n_s8(8);
    const int8x16_t low = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(bytes, vdupq_n_u8(0x0f))), eight);
    const int8x16_t high = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4)), eight);
    v[0] = scale8(vget_low_s8(low), d);
    v[1] = scale8(vget_high_s8(low), d);
    v[2] = scale8(vget_low_s8(high), d);
    v[3] = scale8(vget_high_s8(high), d);
  } else {
    static_assert(std::is_same_v<Format, Q8_0Format>);
    const int8x16_t first = vld1q_s8(reinterpret_cast<const int8_t*>(block + 2));
    const int8x16_t second = vld1q_s8(reinterpret_cast<const int8_t*>(block + 18));
    v[0] = scale8(vget_low_s8(first), d);
    v[1] = scale8(vget_high_s8(first), d);
    v[2] = scale8(vget_low_s8(second), d);
    v[3] = scale8(vget_high_s8(second), d);
  }
}

// Block b of a row: Q4_0 / Q8_0 in registers; the other formats through their portable
// dequantiser (the same exact values).
template <class Format>
ROUTEMM_CPU_INLINE void dequant_at(const uint8_t* row, size_t b, const ScalesOf<Format>& s,
                                   V8 v[kLanesPerBlock]) {
  if constexpr (std::is_same_v<Format, Q4_0Format> || std::is_same_v<Format, Q8_0Format>) {
    dequant<Format>(row + b * Format::kBytes, v);
  } else {
    float values[kQK];
    ggml::dequant_at<Format>(row, b, s, values);
    for (size_t i = 0; i < kLanesPerBlock; ++i) v[i] = neon::load8(values + i * kLanes);
  }
}

}  // namespace neon_detail

template <class Format>
struct NeonIsa {
  static constexpr size_t kTileRows = neon::kPanelTileRows;
  static constexpr size_t kTileCols = neon::kPanelTileCols;

  template <size_t R>
  static constexpr bool mv_chunked() {
    return false;  // every row count runs mv_columns passes
  }

  // R * C accumulators (two registers each) beside one dequantised block (eight registers).
  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R <= 2 ? 4 : R <= 4 ? 2 : 1;
  }

  static void dequant_block(const uint8_t* block, float* out) {
    neon::V8 v[kLanesPerBlock];
    neon_detail::dequant<Format>(block, v);
    for (size_t s = 0; s < kLanesPerBlock; ++s) neon::store8(out + s * kLanes, v[s]);
  }

  template <size_t R, size_t C>
  static void mv_columns(const Operands& ops, size_t col, float* const* out_rows,
                         size_t stride = 1) {
    neon::V8 acc[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[r][c] = neon::zero8();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c * stride);
    ScalesOf<Format> scales[C];
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        neon::V8 w[kLanesPerBlock];
        load_scales_at<Format>(rows[c], b, scales[c]);
        neon_detail::dequant_at<Format>(rows[c], b, scales[c], w);
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const float* x = ops.input_row(r) + b * kQK;
#pragma GCC unroll 4
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            acc[r][c] = neon::fma8(acc[r][c], w[s], neon::load8(x + s * kLanes));
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c * stride] = neon::reduce8(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw, size_t depth,
                      float* acc, size_t acc_stride) {
    const float* xr[R];
    for (size_t r = 0; r < R; ++r) xr[r] = x + r * ldx;
    neon::panel_tile<R, C>(xr, w, ldw, depth, acc, acc_stride);
  }
};

}  // namespace routemm::cpu::ggml

#endif  // ROUTEMM_CPU_HAVE_NEON
