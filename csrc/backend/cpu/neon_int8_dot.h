// aarch64 clone of the int8-dot routes' tile (ggml_int8_dot.h's contract and layout) with the
// dot-product instruction SDOT (vdotq_s32), for CPUs that have it (simd::has_neon_dotprod());
// without it the portable clone runs. Included at the end of ggml_int8_dot.h, which declares
// Int8NeonDot and picks it in clone_for.
//
// The weight codes are the signed values v_j, rearranged as the portable clone does (GroupBlock:
// four values of eight columns per 32 bytes), so no offset is added back. One SDOT multiplies four
// columns' four values by the same four activations (broadcast) and adds each column's sum to its
// 32-bit lane: P_b exactly, as every clone. The F32 step is the contract's
// fma(s_b * d_b, P_b, acc) on four columns per register: the portable clone's bits.
#pragma once

#include <cstring>

#include "ggml_int8_dot.h"
#include "neon_kernels.h"

#if ROUTEMM_CPU_HAVE_NEON

namespace routemm::cpu::ggml::int8 {

// The four activations of a slice as one 32-bit value (broadcast to every lane by vdupq_n_s32).
inline int32_t neon_slice(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

template <class Format>
struct Int8NeonDot {
  static constexpr int32_t kOffset = 0;
  static constexpr size_t kTileRows = 2, kTileGroups = 2, kMatVecTileRows = 4, kStreamRows = 0;

  static void group_block(const uint8_t* const* blocks, GroupBlock& out) {
    Int8Portable<Format>::group_block(blocks, out);
  }

  // Int8Portable::tile's outputs: R rows x G groups of eight columns, two int32x4_t of P_b and two
  // float32x4_t accumulators per (row, group).
  template <size_t R, size_t G>
  ROUTEMM_CPU_NEON_DOTPROD static void tile(const GroupBlock* panel, size_t panel_blocks, size_t j0,
                                            size_t blocks, const QuantizedRowsView& x, size_t row0,
                                            size_t b0, float* acc, size_t acc_stride) {
    neon::V8 f[R][G];
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < G; ++j) {
        f[r][j] = neon::load8(acc + r * acc_stride + (j0 + j) * kGroupCols);
      }
    for (size_t b = 0; b < blocks; ++b) {
      int32x4_t t[R][G][2];
      for (size_t r = 0; r < R; ++r) {
        const int32x4_t bias = vdupq_n_s32(x.block_bias(row0 + r, b0 + b));
        for (size_t j = 0; j < G; ++j) t[r][j][0] = t[r][j][1] = bias;
      }
#pragma GCC unroll 8
      for (size_t g = 0; g < kSlices; ++g) {
        int8x16_t w[G][2];
        for (size_t j = 0; j < G; ++j) {
          const uint8_t* codes = panel[(j0 + j) * panel_blocks + b].codes + g * 32;
          w[j][0] = vreinterpretq_s8_u8(vld1q_u8(codes));       // columns 0-3
          w[j][1] = vreinterpretq_s8_u8(vld1q_u8(codes + 16));  // columns 4-7
        }
        for (size_t r = 0; r < R; ++r) {
          const int8x16_t qb =
              vreinterpretq_s8_s32(vdupq_n_s32(neon_slice(x.q_block(row0 + r, b0 + b) + 4 * g)));
          for (size_t j = 0; j < G; ++j) {
            t[r][j][0] = vdotq_s32(t[r][j][0], w[j][0], qb);
            t[r][j][1] = vdotq_s32(t[r][j][1], w[j][1], qb);
          }
        }
      }
      for (size_t r = 0; r < R; ++r) {
        const float32x4_t d = vdupq_n_f32(x.scale(row0 + r, b0 + b));
        for (size_t j = 0; j < G; ++j) {
          const float* s = panel[(j0 + j) * panel_blocks + b].scales;
          f[r][j].lo = vfmaq_f32(f[r][j].lo, vmulq_f32(vld1q_f32(s), d), vcvtq_f32_s32(t[r][j][0]));
          f[r][j].hi =
              vfmaq_f32(f[r][j].hi, vmulq_f32(vld1q_f32(s + 4), d), vcvtq_f32_s32(t[r][j][1]));
        }
      }
    }
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < G; ++j) {
        neon::store8(acc + r * acc_stride + (j0 + j) * kGroupCols, f[r][j]);
      }
  }
};

}  // namespace routemm::cpu::ggml::int8

#endif  // ROUTEMM_CPU_HAVE_NEON
