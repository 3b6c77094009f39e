// aarch64 NEON clones of the CPU kernels' exact FMA loops (isa.h: CpuIsa::neon), for
// dense_matmul_id.cpp (expert-ID float kernels), ggml_format_kernels.cpp (the codec table's
// formats) and, through neon_block_kernels.h, the Q4_0 / Q8_0 kernels.
//
// The lane contract is the portable clone's: an accumulator is eight F32 lanes, held as two
// float32x4_t (lanes 0-3, then 4-7); lane l runs one fused multiply-add chain (vfmaq_f32, a
// single rounding, as std::fma) over inner positions l, l + 8, ... in increasing order, and the
// lanes are summed once by simd::reduce_lanes's tree. Only the tiles and the memory order
// differ from the portable clone, never an output's operations, so every bit is the same.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "simd.h"

#if ROUTEMM_CPU_HAVE_NEON

namespace routemm::cpu::neon {

using simd::BFloat16;
using simd::Half;
using simd::kLanes;

// Eight lanes of one accumulator or one operand step.
struct V8 {
  float32x4_t lo, hi;
};

ROUTEMM_CPU_INLINE V8 zero8() { return {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }

// Eight consecutive values widened to F32 exactly (f16: FCVTL; bf16: a 16-bit left shift).
ROUTEMM_CPU_INLINE V8 load8(const float* p) { return {vld1q_f32(p), vld1q_f32(p + 4)}; }
ROUTEMM_CPU_INLINE V8 load8(const Half* p) {
  const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p)));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
ROUTEMM_CPU_INLINE V8 load8(const BFloat16* p) {
  const uint16x8_t b = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16)),
          vreinterpretq_f32_u32(vshll_high_n_u16(b, 16))};
}

ROUTEMM_CPU_INLINE void store8(float* p, V8 v) {
  vst1q_f32(p, v.lo);
  vst1q_f32(p + 4, v.hi);
}

// acc = fma(w, x, acc) lane by lane.
ROUTEMM_CPU_INLINE V8 fma8(V8 acc, V8 w, V8 x) {
  return {vfmaq_f32(acc.lo, w.lo, x.lo), vfmaq_f32(acc.hi, w.hi, x.hi)};
}

ROUTEMM_CPU_INLINE float reduce8(V8 v) { return simd::reduce_lanes(v.lo, v.hi); }

// w[8s .. 8s + 7] of one column of k values, widened, positions >= k as +0: the zero-padded last
// step of the expert-ID contract (dense_matmul_id.cpp, step 1).
template <typename WT>
ROUTEMM_CPU_INLINE V8 tail8(const WT* column, size_t k) {
  alignas(16) float t[kLanes];
  const size_t full = k & ~(kLanes - 1);
  for (size_t l = 0; l < kLanes; ++l) t[l] = full + l < k ? simd::widen(column[full + l]) : 0.0f;
  return load8(t);
}

// acc[r * acc_stride + c * 8 + l] += lane l's steps over positions [0, depth) (a multiple of 8)
// of R activation rows (row r at x[r]) and C decoded weight columns (column c at w + c * ldw):
// the register tile of the panel routes (Q4_0/Q8_0 matrix tiles, the format kernels). R * C
// accumulators of two registers each, C weight steps and one activation step: 26 of the 32
// registers at 3 x 3.
inline constexpr size_t kPanelTileRows = 3, kPanelTileCols = 3;

template <size_t R, size_t C>
ROUTEMM_CPU_INLINE void panel_tile(const float* const* x, const float* w, size_t ldw, size_t depth,
                                   float* acc, size_t acc_stride) {
  V8 a[R][C];
#pragma GCC unroll 4
  for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (size_t c = 0; c < C; ++c) a[r][c] = load8(acc + r * acc_stride + c * kLanes);
  for (size_t i = 0; i < depth; i += kLanes) {
    V8 wv[C];
#pragma GCC unroll 4
    for (size_t c = 0; c < C; ++c) wv[c] = load8(w + c * ldw + i);
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r) {
      const V8 xv = load8(x[r] + i);
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) a[r][c] = fma8(a[r][c], wv[c], xv);
    }
  }
#pragma GCC unroll 4
  for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (size_t c = 0; c < C; ++c) store8(acc + r * acc_stride + c * kLanes, a[r][c]);
}

// The format kernels' micro-kernel (ggml_format_kernels.cpp's PortableIsa::tile): rows x[r] + k0,
// panel columns kPanelDepth floats apart.
template <size_t kPanelDepth>
struct FormatTileIsa {
  static constexpr size_t kTileRows = kPanelTileRows, kTileCols = kPanelTileCols;
  template <size_t R, size_t C>
  static void tile(const float* const* x, size_t k0, const float* w, size_t depth, float* acc,
                   size_t acc_stride) {
    const float* xr[R];
    for (size_t r = 0; r < R; ++r) xr[r] = x[r] + k0;
    panel_tile<R, C>(xr, w, kPanelDepth, depth, acc, acc_stride);
  }
};

// ---- Expert-ID float kernels (dense_matmul_id.cpp's primitives) --------------------------------
//
//   direct_block(x, w, k, cols, out)   out[c] for c < cols over the full inner dimension
//   pair_rows(pairs, xp, steps, w, k, cols, out)
//                                      one packed row pair (pairs is always 1 here) x cols
// kDirectCols and kPairStep are dense_matmul_id.cpp's (it checks that they match).
struct DenseMatmulIdIsa {
  static constexpr size_t kDirectCols = 8;
  static constexpr size_t kPairStep = 2 * kLanes;
  static constexpr size_t kMaxPairs = 1;
  static constexpr size_t kPairCols = 6;  // 12 accumulators, 2 activations, 1 weight step

  // C columns `stride` columns apart (column c at w + c * stride * k, its output at
  // out[c * stride]).
  template <size_t C, typename WT>
  static void direct_columns(const float* x, const WT* w, size_t k, float* out, size_t stride = 1) {
    V8 acc[C];
#pragma GCC unroll 8
    for (size_t c = 0; c < C; ++c) acc[c] = zero8();
    const size_t k_full = k & ~(kLanes - 1);
    const size_t wstep = stride * k;
    for (size_t i = 0; i < k_full; i += kLanes) {
      const V8 xv = load8(x + i);
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[c] = fma8(acc[c], load8(w + c * wstep + i), xv);
    }
    if (k_full < k) {  // zero-padded tail block
      alignas(16) float xt[kLanes] = {};
      std::copy(x + k_full, x + k, xt);
      const V8 xv = load8(xt);
      for (size_t c = 0; c < C; ++c) acc[c] = fma8(acc[c], tail8(w + c * wstep, k), xv);
    }
    for (size_t c = 0; c < C; ++c) out[c * stride] = reduce8(acc[c]);
  }

  template <typename WT>
  static void direct_block(const float* x, const WT* w, size_t k, size_t cols, float* out) {
    const size_t seg = cols / kDirectCols;  // one long weight stream per segment
    for (size_t j = 0; j < seg; ++j) {
      direct_columns<kDirectCols>(x, w + j * k, k, out + j, seg);
    }
    for (size_t c = seg * kDirectCols; c < cols; ++c) direct_columns<1>(x, w + c * k, k, out + c);
  }

  // One packed row pair x C columns `stride` apart (column c at w + c * stride * k, stored at
  // out[h][col + c * stride]); each weight step loaded and widened once for both rows.
  template <size_t C, typename WT>
  static void pair_tile(const float* xp, size_t steps, const WT* w, size_t k, float* const* out,
                        size_t col, size_t stride = 1) {
    const size_t wstep = stride * k;
    V8 acc[2][C];
#pragma GCC unroll 8
    for (size_t c = 0; c < C; ++c) acc[0][c] = acc[1][c] = zero8();
    const size_t full = k / kLanes;
    for (size_t s = 0; s < full; ++s) {
      const V8 x0 = load8(xp + s * kPairStep);
      const V8 x1 = load8(xp + s * kPairStep + kLanes);
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        const V8 wv = load8(w + c * wstep + s * kLanes);
        acc[0][c] = fma8(acc[0][c], wv, x0);
        acc[1][c] = fma8(acc[1][c], wv, x1);
      }
    }
    if (full < steps) {  // zero-padded tail step
      const V8 x0 = load8(xp + full * kPairStep);
      const V8 x1 = load8(xp + full * kPairStep + kLanes);
      for (size_t c = 0; c < C; ++c) {
        const V8 wv = tail8(w + c * wstep, k);
        acc[0][c] = fma8(acc[0][c], wv, x0);
        acc[1][c] = fma8(acc[1][c], wv, x1);
      }
    }
    for (size_t h = 0; h < 2; ++h) {
      if (out[h] == nullptr) continue;
      for (size_t c = 0; c < C; ++c) out[h][col + c * stride] = reduce8(acc[h][c]);
    }
  }

  template <typename WT>
  static void pair_rows(size_t /*pairs: always 1*/, const float* xp, size_t steps, const WT* w,
                        size_t k, size_t cols, float* const* out) {
    const size_t seg = cols / kPairCols;
    for (size_t j = 0; j < seg; ++j) pair_tile<kPairCols>(xp, steps, w + j * k, k, out, j, seg);
    for (size_t c = seg * kPairCols; c < cols; ++c) pair_tile<1>(xp, steps, w + c * k, k, out, c);
  }
};

}  // namespace routemm::cpu::neon

#endif  // ROUTEMM_CPU_HAVE_NEON
