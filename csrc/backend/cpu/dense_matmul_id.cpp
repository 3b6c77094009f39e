// CPU kernels of the expert-ID matmul (spec §7.4, §7.5): dense_matmul_id_direct_*,
// dense_matmul_id_map_distinct and dense_matmul_id_grouped_*.
//
// NUMERIC CONTRACT (shared by the direct and grouped kernels, which are therefore bit-identical):
// every output out[flat, col] is computed as follows, whatever the thread count, work split,
// micro-kernel tile or instruction set.
//   1. The inner dimension is padded with zeros to kp = round_up(k, 8); a padded position
//      contributes fma(0, 0, acc) (weight and activation both +0). Padding is not a no-op: a
//      lane can hold -0 (a tiny negative product rounds to -0), and fma(0, 0, -0) = +0, so both
//      routes must pad identically.
//   2. Eight lane accumulators start at +0.0f. Lane l visits inner = l, l + 8, l + 16, ... < kp in
//      increasing order and does acc[l] = fma(widen(w[col, inner]), x[row, inner], acc[l]), one
//      correctly rounded F32 fused multiply-add per step (hardware FMA or std::fma).
//   3. The lanes are summed once, in the fixed tree ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
// widen() is exact (f16 and bf16 values, including subnormals, infinities and NaN, are all
// representable in F32). Only NaN payloads are not pinned: when two different NaNs meet, which
// payload survives may depend on operand order. An id >= n_experts yields an all-zero row.
#include "routemm/ops/dense_matmul_id.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "grouped_items.h"
#include "kernels.h"
#include "neon_kernels.h"
#include "routemm/checked.h"
#include "routemm/error.h"
#include "simd.h"
#include "thread_pool.h"

#if ROUTEMM_CPU_HAVE_AVX2
#include <immintrin.h>
#endif

// GCC 12 reports -W(maybe-)uninitialized inside its own AVX-512 intrinsic headers (their
// "undefined vector" idiom in the broadcasts, fixed in GCC 13); no value of this file is read
// uninitialised.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#ifndef ROUTEMM_CPU_DENSE_MATMUL_ID_SHA256
#define ROUTEMM_CPU_DENSE_MATMUL_ID_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::DenseMatmulIdKernelParams;
using simd::BFloat16;
using simd::Half;
using simd::kLanes;

constexpr size_t kLaneMask = kLanes - 1;

size_t round_up(size_t value, size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// ---- Arguments ----------------------------------------------------------------------------------

// Overflow-checked size arithmetic (routemm/checked.h): the front door and the argument contract
// validated the shapes; this keeps a corrupt launch from turning into an out-of-bounds access.
size_t checked_mul(size_t a, size_t b) {
  return routemm::checked_mul(a, b, "dense_matmul_id cpu kernel size");
}
size_t checked_add(size_t a, size_t b) {
  return routemm::checked_add(a, b, "dense_matmul_id cpu kernel size");
}

// The host pointer of a bound argument holding at least `need` bytes.
void* arg_data(const KernelLaunch& launch, size_t slot, size_t need, const char* what) {
  return kernels::launch_arg(launch, slot, what, need).data;
}

DenseMatmulIdKernelParams read_params(const KernelLaunch& launch) {
  const auto params = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  if (params.m == 0 || params.n == 0 || params.k == 0 || params.top_k == 0 ||
      params.n_experts == 0) {
    throw Error(std::string(launch.label) + ": params have a zero extent");
  }
  return params;
}

size_t total_rows(const DenseMatmulIdKernelParams& p) { return size_t{p.m} * p.top_k; }

// Bytes from the weight view's start to the end of the last expert matrix.
size_t weight_bytes(const DenseMatmulIdKernelParams& p, size_t elem_size) {
  const size_t matrix = checked_mul(checked_mul(p.n, p.k), elem_size);
  return checked_add(checked_mul(p.n_experts - 1, p.expert_stride_bytes), matrix);
}

// Bytes from the input view's start to the end of the last row read.
size_t input_bytes(const DenseMatmulIdKernelParams& p) {
  const size_t last = checked_add(checked_mul(p.m - 1, p.input_token_stride_bytes),
                                  checked_mul(p.top_k - 1, p.input_slot_stride_bytes));
  return checked_add(last, checked_mul(p.k, sizeof(float)));
}

// Pointers every compute kernel shares. Rows are addressed by flat = token * top_k + slot.
struct Operands {
  const unsigned char* weights;
  const unsigned char* input;
  float* output;
  size_t n, k, top_k;
  size_t expert_stride, token_stride, slot_stride;

  const float* input_row(size_t flat) const {
    const size_t token = flat / top_k, slot = flat - token * top_k;
    return reinterpret_cast<const float*>(input + token * token_stride + slot * slot_stride);
  }
  template <typename WT>
  const WT* expert(uint32_t id) const {
    return reinterpret_cast<const WT*>(weights + size_t{id} * expert_stride);
  }
  float* output_row(size_t flat) const { return output + flat * n; }
};

Operands make_operands(const DenseMatmulIdKernelParams& p, const void* weights, const void* input,
                       void* output) {
  return Operands{static_cast<const unsigned char*>(weights),
                  static_cast<const unsigned char*>(input),
                  static_cast<float*>(output),
                  p.n,
                  p.k,
                  p.top_k,
                  p.expert_stride_bytes,
                  p.input_token_stride_bytes,
                  p.input_slot_stride_bytes};
}

// ---- Micro-kernels ------------------------------------------------------------------------------
//
// Three implementations of the same two primitives, selected once per launch: PortableIsa (plain
// loops, any target), Avx2Isa and Avx512Isa (x86-64 intrinsics). Each follows the contract
// exactly, so the choice never changes a bit. Both read the weights where they are stored (column
// c of an expert at w + c * k, widened on the fly) and compute every output over the full inner
// dimension in registers.
//
//   direct_block(x, w, k, cols, out)  out[c] for c < cols: one output row
//   pair_rows(pairs, xp, steps, w, k, cols, out)
//                                     out[r][c] for r < 2 * pairs (rows whose pointer is null
//                                     are skipped), c < cols: up to kMaxPairs packed row pairs
//                                     (layout at pack_row_pairs), each weight step loaded and
//                                     widened once for all of them

// Output columns the direct route computes together, sharing each activation load. They are
// taken from kDirectCols equal segments of the block's columns: column j of every
// segment at once, then column j + 1, so each of the kDirectCols weight streams walks its segment's
// columns back to back, one long sequential read, instead of eight columns side by side whose
// streams end at every column (a column of 2048 bf16 weights is one 4 KB page). The order of the
// accumulation per output is the contract's either way; only the memory order changes. Measured
// on the 2-core Zen 4 (Qwen3 expert shape, m = 1, one thread): long streams read at 30-35 GB/s,
// eight column-long ones at 22-26.
constexpr size_t kDirectCols = 8;
// Floats of one row pair's inner step in the packed layout: the first row's 8, then the second's.
constexpr size_t kPairStep = 2 * kLanes;

// w[8s .. 8s + 7] of one weight column of k values, widened, positions >= k as +0 (contract
// step 1): the last, partial step of a column whose k is not a multiple of 8.
template <typename WT>
void widen_tail_step(const WT* column, size_t k, float* dst) {
  const size_t full = k & ~kLaneMask;
  for (size_t l = 0; l < kLanes; ++l) dst[l] = full + l < k ? simd::widen(column[full + l]) : 0.0f;
}

struct PortableIsa {
  static constexpr size_t kMaxPairs = 1;

  template <size_t C, typename WT>
  static void direct_columns(const float* x, const WT* w, size_t k, float* out) {
    float acc[C][kLanes] = {};
    const size_t k_full = k & ~kLaneMask;
    for (size_t i = 0; i < k_full; i += kLanes) {
      for (size_t c = 0; c < C; ++c) {
        const WT* wc = w + c * k + i;
        for (size_t l = 0; l < kLanes; ++l) {
          acc[c][l] = std::fma(simd::widen(wc[l]), x[i + l], acc[c][l]);
        }
      }
    }
    if (k_full < k) {  // zero-padded tail block (contract step 1)
      const size_t rest = k - k_full;
      float xt[kLanes] = {};
      for (size_t l = 0; l < rest; ++l) xt[l] = x[k_full + l];
      for (size_t c = 0; c < C; ++c) {
        float wt[kLanes] = {};
        for (size_t l = 0; l < rest; ++l) wt[l] = simd::widen(w[c * k + k_full + l]);
        for (size_t l = 0; l < kLanes; ++l) acc[c][l] = std::fma(wt[l], xt[l], acc[c][l]);
      }
    }
    for (size_t c = 0; c < C; ++c) out[c] = simd::reduce_lanes(acc[c]);
  }

  template <typename WT>
  static void direct_block(const float* x, const WT* w, size_t k, size_t cols, float* out) {
    size_t c = 0;
    for (; c + kDirectCols <= cols; c += kDirectCols) {
      direct_columns<kDirectCols>(x, w + c * k, k, out + c);
    }
    for (; c < cols; ++c) direct_columns<1>(x, w + c * k, k, out + c);
  }

  template <typename WT>
  static void pair_rows(size_t /*pairs: always 1*/, const float* xp, size_t steps, const WT* w,
                        size_t k, size_t cols, float* const* out) {
    const size_t full = k / kLanes;
    for (size_t c = 0; c < cols; ++c) {
      const WT* column = w + c * k;
      float acc[2][kLanes] = {};
      float wt[kLanes];
      for (size_t s = 0; s < steps; ++s) {
        if (s < full) {
          for (size_t l = 0; l < kLanes; ++l) wt[l] = simd::widen(column[s * kLanes + l]);
        } else {
          widen_tail_step(column, k, wt);
        }
        for (size_t h = 0; h < 2; ++h) {
          const float* x = xp + s * kPairStep + h * kLanes;
          for (size_t l = 0; l < kLanes; ++l) acc[h][l] = std::fma(wt[l], x[l], acc[h][l]);
        }
      }
      for (size_t h = 0; h < 2; ++h) {
        if (out[h] != nullptr) out[h][c] = simd::reduce_lanes(acc[h]);
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
struct Avx2Isa {
  // Eight consecutive weights widened to f32 (exact: F16C conversion, bf16 shift).
  ROUTEMM_CPU_AVX2 static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  ROUTEMM_CPU_AVX2 static __m256 load8(const Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ROUTEMM_CPU_AVX2 static __m256 load8(const BFloat16* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }

  // The contract's lane tree, in registers.
  ROUTEMM_CPU_AVX2 static float reduce(__m256 v) { return simd::reduce_lanes(v); }

  // C columns `stride` columns apart (column c at w + c * stride * k, its output at
  // out[c * stride]) over the full inner dimension.
  template <size_t C, typename WT>
  ROUTEMM_CPU_AVX2 static void direct_columns(const float* x, const WT* w, size_t k, float* out,
                                              size_t stride = 1) {
    __m256 acc[C];
#pragma GCC unroll 16
    for (size_t c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    const size_t k_full = k & ~kLaneMask;
    const size_t wstep = stride * k;
    for (size_t i = 0; i < k_full; i += kLanes) {
      const __m256 xv = _mm256_loadu_ps(x + i);
#pragma GCC unroll 16
      for (size_t c = 0; c < C; ++c) {
        acc[c] = _mm256_fmadd_ps(load8(w + c * wstep + i), xv, acc[c]);
      }
    }
    if (k_full < k) {  // zero-padded tail block (contract step 1)
      const size_t rest = k - k_full;
      alignas(32) float xt[kLanes] = {};
      std::copy(x + k_full, x + k, xt);
      const __m256 xv = _mm256_load_ps(xt);
      for (size_t c = 0; c < C; ++c) {
        alignas(32) float wt[kLanes] = {};
        for (size_t l = 0; l < rest; ++l) wt[l] = simd::widen(w[c * wstep + k_full + l]);
        acc[c] = _mm256_fmadd_ps(_mm256_load_ps(wt), xv, acc[c]);
      }
    }
    for (size_t c = 0; c < C; ++c) out[c * stride] = reduce(acc[c]);
  }

  template <typename WT>
  ROUTEMM_CPU_AVX2 static void direct_block(const float* x, const WT* w, size_t k, size_t cols,
                                            float* out) {
    const size_t seg = cols / kDirectCols;  // see kDirectCols
    for (size_t j = 0; j < seg; ++j) {
      direct_columns<kDirectCols>(x, w + j * k, k, out + j, seg);
    }
    for (size_t c = seg * kDirectCols; c < cols; ++c) direct_columns<1>(x, w + c * k, k, out + c);
  }

  // One packed row pair x C columns: 2C accumulators, each weight step loaded and widened once for
  // both rows.
  // Columns `stride` apart (column c at w + c * stride * k, stored at out[h][col + c * stride]).
  template <size_t C, typename WT>
  ROUTEMM_CPU_AVX2 static void pair_tile(const float* xp, size_t steps, const WT* w, size_t k,
                                         float* const* out, size_t col, size_t stride = 1) {
    const size_t wstep = stride * k;
    __m256 acc[2][C];
#pragma GCC unroll 16
    for (size_t c = 0; c < C; ++c) acc[0][c] = acc[1][c] = _mm256_setzero_ps();
    const size_t full = k / kLanes;
    for (size_t s = 0; s < full; ++s) {
      const __m256 x0 = _mm256_loadu_ps(xp + s * kPairStep);
      const __m256 x1 = _mm256_loadu_ps(xp + s * kPairStep + kLanes);
#pragma GCC unroll 16
      for (size_t c = 0; c < C; ++c) {
        const __m256 wv = load8(w + c * wstep + s * kLanes);
        acc[0][c] = _mm256_fmadd_ps(wv, x0, acc[0][c]);
        acc[1][c] = _mm256_fmadd_ps(wv, x1, acc[1][c]);
      }
    }
    if (full < steps) {  // zero-padded tail step (contract step 1)
      const __m256 x0 = _mm256_loadu_ps(xp + full * kPairStep);
      const __m256 x1 = _mm256_loadu_ps(xp + full * kPairStep + kLanes);
      for (size_t c = 0; c < C; ++c) {
        alignas(32) float wt[kLanes];
        widen_tail_step(w + c * wstep, k, wt);
        const __m256 wv = _mm256_load_ps(wt);
        acc[0][c] = _mm256_fmadd_ps(wv, x0, acc[0][c]);
        acc[1][c] = _mm256_fmadd_ps(wv, x1, acc[1][c]);
      }
    }
    for (size_t h = 0; h < 2; ++h) {
      if (out[h] == nullptr) continue;
      for (size_t c = 0; c < C; ++c) out[h][col + c * stride] = reduce(acc[h][c]);
    }
  }

  static constexpr size_t kMaxPairs = 1;
  static constexpr size_t kPairCols = 6;  // 12 accumulators, 2 activations, 1 weight: 15 of 16

  template <typename WT>
  ROUTEMM_CPU_AVX2 static void pair_rows(size_t /*pairs: always 1*/, const float* xp, size_t steps,
                                         const WT* w, size_t k, size_t cols, float* const* out) {
    const size_t seg = cols / kPairCols;  // one column of each segment per tile (kDirectCols)
    for (size_t j = 0; j < seg; ++j) pair_tile<kPairCols>(xp, steps, w + j * k, k, out, j, seg);
    for (size_t c = seg * kPairCols; c < cols; ++c) pair_tile<1>(xp, steps, w + c * k, k, out, c);
  }
};

// AVX-512 clone. A 512-bit register holds two columns' eight-lane accumulators side by side
// (column c in the low half, c + 1 in the high half), so every lane still runs the contract's
// one FMA chain per (column, inner mod 8) and the bits equal the other clones'. Odd column
// counts finish on the AVX2 primitives, which the AVX-512 target includes.
struct Avx512Isa {
  // Columns c and c + 1 at the same eight inner positions, widened exactly: [p0[0..8) | p1[0..8)].
  ROUTEMM_CPU_AVX512 static __m512 load_pair8(const float* p0, const float* p1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0)), _mm256_loadu_ps(p1), 1);
  }
  ROUTEMM_CPU_AVX512 static __m256i load_pair8_bits(const void* p0, const void* p1) {
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(p0))),
        _mm_loadu_si128(static_cast<const __m128i*>(p1)), 1);
  }
  ROUTEMM_CPU_AVX512 static __m512 load_pair8(const Half* p0, const Half* p1) {
    return _mm512_cvtph_ps(load_pair8_bits(p0, p1));
  }
  ROUTEMM_CPU_AVX512 static __m512 load_pair8(const BFloat16* p0, const BFloat16* p1) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(load_pair8_bits(p0, p1)), 16));
  }

  // Both halves reduced with the contract's tree: out[0] from the low half, out[1] the high.
  // In registers (simd::reduce_lanes(__m256) says why).
  ROUTEMM_CPU_AVX512 static void reduce_pair(__m512 v, float* out0, float* out1) {
    *out0 = simd::reduce_lanes(_mm512_castps512_ps256(v));
    *out1 = simd::reduce_lanes(_mm512_extractf32x8_ps(v, 1));
  }

  // Word indices of the bf16 fast path: output dword j of block b takes the weight from word
  // 8b + j of the first column (j < 8) or of the second (j >= 8, source words 32..63), into the
  // high half; the low half is zeroed by the mask, which makes the dword the exact f32 value.
  ROUTEMM_CPU_AVX512 static __m512i bf16_pair_index(size_t b) {
    alignas(64) uint16_t idx[32];
    for (size_t j = 0; j < 16; ++j) {
      idx[2 * j] = 0;
      idx[2 * j + 1] = static_cast<uint16_t>(j < 8 ? 8 * b + j : 32 + 8 * b + (j - 8));
    }
    return _mm512_load_si512(idx);
  }

  // P column pairs of one output row over the full inner dimension: 2P columns `stride` columns
  // apart (column c at w + c * stride * k, its output at out[c * stride]).
  template <size_t P, typename WT>
  ROUTEMM_CPU_AVX512 static void direct_pairs(const float* x, const WT* w, size_t k, float* out,
                                              size_t stride = 1) {
    const size_t wstep = stride * k;
    __m512 acc[P];
#pragma GCC unroll 8
    for (size_t p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
    size_t i = 0;
    if constexpr (std::is_same_v<WT, BFloat16>) {
      // 32 inner positions per step: two 64-byte loads and four masked word permutes per pair.
      const __m512i idx[4] = {bf16_pair_index(0), bf16_pair_index(1), bf16_pair_index(2),
                              bf16_pair_index(3)};
      constexpr __mmask32 kHighWords = 0xAAAAAAAAu;
      for (; i + 32 <= k; i += 32) {
        __m512 xv[4];
#pragma GCC unroll 4
        for (size_t b = 0; b < 4; ++b)
          xv[b] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i + 8 * b));
#pragma GCC unroll 8
        for (size_t p = 0; p < P; ++p) {
          const __m512i a = _mm512_loadu_si512(w + 2 * p * wstep + i);
          const __m512i c = _mm512_loadu_si512(w + (2 * p + 1) * wstep + i);
#pragma GCC unroll 4
          for (size_t b = 0; b < 4; ++b) {
            const __m512 wv =
                _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi16(kHighWords, a, idx[b], c));
            acc[p] = _mm512_fmadd_ps(wv, xv[b], acc[p]);
          }
        }
      }
    }
    const size_t k_full = k & ~kLaneMask;
    for (; i < k_full; i += kLanes) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i));
#pragma GCC unroll 8
      for (size_t p = 0; p < P; ++p) {
        acc[p] = _mm512_fmadd_ps(load_pair8(w + 2 * p * wstep + i, w + (2 * p + 1) * wstep + i), xv,
                                 acc[p]);
      }
    }
    if (k_full < k) {  // zero-padded tail block (contract step 1)
      const size_t rest = k - k_full;
      alignas(32) float xt[kLanes] = {};
      std::copy(x + k_full, x + k, xt);
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_load_ps(xt));
      for (size_t p = 0; p < P; ++p) {
        alignas(64) float wt[2 * kLanes] = {};
        for (size_t l = 0; l < rest; ++l) {
          wt[l] = simd::widen(w[2 * p * wstep + k_full + l]);
          wt[kLanes + l] = simd::widen(w[(2 * p + 1) * wstep + k_full + l]);
        }
        acc[p] = _mm512_fmadd_ps(_mm512_load_ps(wt), xv, acc[p]);
      }
    }
    for (size_t p = 0; p < P; ++p) {
      reduce_pair(acc[p], out + 2 * p * stride, out + (2 * p + 1) * stride);
    }
  }

  template <typename WT>
  ROUTEMM_CPU_AVX512 static void direct_block(const float* x, const WT* w, size_t k, size_t cols,
                                              float* out) {
    const size_t seg = cols / kDirectCols;  // see kDirectCols
    for (size_t j = 0; j < seg; ++j) {
      direct_pairs<kDirectCols / 2>(x, w + j * k, k, out + j, seg);
    }
    size_t c = seg * kDirectCols;
    for (; c + 2 <= cols; c += 2) direct_pairs<1>(x, w + c * k, k, out + c);
    if (c < cols) Avx2Isa::direct_columns<1>(x, w + c * k, k, out + c);
  }

  // ---- Grouped: row pairs. A register holds one column's accumulators of two routed rows (the
  // pair's first row low, second high); the weight step is broadcast to both halves.

  // w[0 .. 8) widened exactly into both 256-bit halves.
  ROUTEMM_CPU_AVX512 static __m512 broadcast8(const float* p) {
    return _mm512_broadcast_f32x8(_mm256_loadu_ps(p));
  }
  ROUTEMM_CPU_AVX512 static __m512 broadcast8(const Half* p) {
    return _mm512_cvtph_ps(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  ROUTEMM_CPU_AVX512 static __m512 broadcast8(const BFloat16* p) {
    // Every 128-bit block holds the 8 words; dword j of a block takes word j (blocks 0, 2) or
    // j + 4 (blocks 1, 3) into its high half, the low half zeroed: the exact f32 value.
    const __m512i spread =
        _mm512_set_epi32(0x0f0e8080, 0x0d0c8080, 0x0b0a8080, 0x09088080, 0x07068080, 0x05048080,
                         0x03028080, 0x01008080, 0x0f0e8080, 0x0d0c8080, 0x0b0a8080, 0x09088080,
                         0x07068080, 0x05048080, 0x03028080, 0x01008080);
    return _mm512_castsi512_ps(_mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), spread));
  }

  // Both halves of v summed by the contract's tree, operand for operand: the low half's sum in
  // lane 0, the high half's in lane 8.
  ROUTEMM_CPU_AVX512 static __m512 reduce_halves(__m512 v) {
    const __m512 s = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512 t = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  }

  // Q packed row pairs x C columns: Q * C accumulators; each weight step is loaded and widened
  // once for the 2Q rows, each activation step once for the C columns.
  // Columns `stride` apart (column c at w + c * stride * k, stored at col + c * stride).
  template <size_t Q, size_t C, typename WT>
  ROUTEMM_CPU_AVX512 static void pair_tile(const float* xp, size_t steps, const WT* w, size_t k,
                                           float* const* out, size_t col, size_t stride = 1) {
    const size_t wstep = stride * k;
    __m512 acc[Q][C];
#pragma GCC unroll 16
    for (size_t q = 0; q < Q; ++q)
#pragma GCC unroll 16
      for (size_t c = 0; c < C; ++c) acc[q][c] = _mm512_setzero_ps();
    const size_t full = k / kLanes;
    for (size_t s = 0; s < full; ++s) {
      __m512 xv[Q];
#pragma GCC unroll 16
      for (size_t q = 0; q < Q; ++q) xv[q] = _mm512_loadu_ps(xp + (q * steps + s) * kPairStep);
#pragma GCC unroll 16
      for (size_t c = 0; c < C; ++c) {
        const __m512 wv = broadcast8(w + c * wstep + s * kLanes);
#pragma GCC unroll 16
        for (size_t q = 0; q < Q; ++q) acc[q][c] = _mm512_fmadd_ps(wv, xv[q], acc[q][c]);
      }
    }
    if (full < steps) {  // zero-padded tail step (contract step 1)
      for (size_t c = 0; c < C; ++c) {
        alignas(32) float wt[kLanes];
        widen_tail_step(w + c * wstep, k, wt);
        const __m512 wv = broadcast8(wt);
        for (size_t q = 0; q < Q; ++q) {
          const __m512 xv = _mm512_loadu_ps(xp + (q * steps + full) * kPairStep);
          acc[q][c] = _mm512_fmadd_ps(wv, xv, acc[q][c]);
        }
      }
    }
    for (size_t q = 0; q < Q; ++q) {
      float* lo = out[2 * q];
      float* hi = out[2 * q + 1];
      for (size_t c = 0; c < C; ++c) {
        const __m512 r = reduce_halves(acc[q][c]);
        if (lo != nullptr) lo[col + c * stride] = _mm512_cvtss_f32(r);
        if (hi != nullptr) hi[col + c * stride] = _mm_cvtss_f32(_mm512_extractf32x4_ps(r, 2));
      }
    }
  }

  template <size_t Q, size_t C, typename WT>
  ROUTEMM_CPU_AVX512 static void pair_columns(const float* xp, size_t steps, const WT* w, size_t k,
                                              size_t cols, float* const* out) {
    const size_t seg = cols / C;  // one column of each segment per tile (kDirectCols)
    for (size_t j = 0; j < seg; ++j) pair_tile<Q, C>(xp, steps, w + j * k, k, out, j, seg);
    for (size_t c = seg * C; c < cols; ++c) pair_tile<Q, 1>(xp, steps, w + c * k, k, out, c);
  }

  // Tiles of 24 accumulators (16 for a lone pair) of the 32 registers; the column counts divide
  // kBlockCols.
  static constexpr size_t kMaxPairs = 4;

  template <typename WT>
  ROUTEMM_CPU_AVX512 static void pair_rows(size_t pairs, const float* xp, size_t steps, const WT* w,
                                           size_t k, size_t cols, float* const* out) {
    switch (pairs) {
      case 1: pair_columns<1, 16>(xp, steps, w, k, cols, out); break;
      case 2: pair_columns<2, 12>(xp, steps, w, k, cols, out); break;
      case 3: pair_columns<3, 8>(xp, steps, w, k, cols, out); break;
      default: pair_columns<4, 6>(xp, steps, w, k, cols, out); break;
    }
  }
};
#endif

#if ROUTEMM_CPU_HAVE_NEON
// aarch64 clone (neon_kernels.h), the same tiles' memory order as this file's.
using NeonIsa = neon::DenseMatmulIdIsa;
static_assert(NeonIsa::kDirectCols == kDirectCols && NeonIsa::kPairStep == kPairStep);
#endif

// ---- Direct -------------------------------------------------------------------------------------

struct DirectJob {
  Operands ops;
  const uint32_t* ids;
  uint32_t n_experts;
  size_t chunk;  // output columns per work item (kernels::direct_item_columns)
  size_t chunks_per_row;
};

// Work items [begin, end) of the direct kernel; item = row * chunks_per_row + column chunk.
template <typename Isa, typename WT>
void direct_items(const DirectJob& job, size_t begin, size_t end) {
  const Operands& ops = job.ops;
  for (size_t item = begin; item < end; ++item) {
    const size_t flat = item / job.chunks_per_row;
    const size_t col0 = (item - flat * job.chunks_per_row) * job.chunk;
    const size_t cols = std::min(ops.n - col0, job.chunk);
    float* out = ops.output_row(flat) + col0;
    const uint32_t id = job.ids[flat];
    if (id >= job.n_experts) {  // invalid id: zero row, no weight address formed
      std::fill(out, out + cols, 0.0f);
      continue;
    }
    Isa::direct_block(ops.input_row(flat), ops.expert<WT>(id) + col0 * ops.k, ops.k, cols, out);
  }
}

// Runs run_items(job, begin, end) over the direct launch's work items (row x column chunk).
template <typename WT>
void run_direct_launch(const KernelLaunch& launch, void* queue_native,
                       void (*run_items)(const DirectJob&, size_t, size_t)) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const size_t rows = total_rows(p);
  const void* weights = arg_data(launch, 1, weight_bytes(p, sizeof(WT)), "weights");
  const void* input = arg_data(launch, 2, input_bytes(p), "input");
  const auto* ids =
      static_cast<const uint32_t*>(arg_data(launch, 3, checked_mul(rows, 4), "expert ids"));
  void* output = arg_data(launch, 4, checked_mul(checked_mul(rows, p.n), 4), "output");

  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t chunk = direct_item_columns(rows, p.n, pool == nullptr ? 1 : pool->size());
  const DirectJob job{make_operands(p, weights, input, output), ids, p.n_experts, chunk,
                      (size_t{p.n} + chunk - 1) / chunk};
  const size_t items = rows * job.chunks_per_row;
  if (pool == nullptr) {
    run_items(job, 0, items);
    return;
  }
  pool->parallel_for(items, 1, [&](size_t begin, size_t end) { run_items(job, begin, end); });
}

template <typename WT>
void direct_kernel(const KernelLaunch& launch, void* queue_native) {
  void (*run)(const DirectJob&, size_t, size_t) = direct_items<PortableIsa, WT>;
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx512()) {
    run = direct_items<Avx512Isa, WT>;
  } else if (simd::has_avx2_fma()) {
    run = direct_items<Avx2Isa, WT>;
  }
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon()) run = direct_items<NeonIsa, WT>;
#endif
  run_direct_launch<WT>(launch, queue_native, run);
}

// ---- Map ----------------------------------------------------------------------------------------

// Routes every flat row with a valid id, repeated ids included: expert e's rows form the segment
// routed[start(e), start(e) + counts[e]) of one list ordered by expert (start(e) = the counts of
// the experts before e), each segment in flat-row order. The list holds at most m * top_k rows,
// which fits the scratch's n_experts * m entries whenever top_k <= n_experts (the capability's
// rule for the grouped route). Rows with invalid ids are zero-filled here (the grouped kernel
// never sees them).
void map_distinct_kernel(const KernelLaunch& launch, void* /*queue_native*/) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const size_t rows = total_rows(p);
  const size_t experts = p.n_experts;
  const auto* ids =
      static_cast<const uint32_t*>(arg_data(launch, 1, checked_mul(rows, 4), "expert ids"));
  auto* counts =
      static_cast<uint32_t*>(arg_data(launch, 2, checked_mul(experts, 4), "expert counts"));
  auto* output =
      static_cast<float*>(arg_data(launch, 4, checked_mul(checked_mul(rows, p.n), 4), "output"));

  // Count first, so that a routed-rows binding too small for the list fails before any write.
  std::vector<uint32_t> next(experts, 0u);  // counts, then each segment's next free entry
  size_t routed_total = 0;
  for (size_t flat = 0; flat < rows; ++flat) {
    if (ids[flat] < experts) {
      ++next[ids[flat]];
      ++routed_total;
    }
  }
  auto* routed =
      static_cast<uint32_t*>(arg_data(launch, 3, checked_mul(routed_total, 4), "routed rows"));
  uint32_t start = 0;
  for (size_t e = 0; e < experts; ++e) {
    counts[e] = next[e];
    next[e] = start;
    start += counts[e];
  }
  for (size_t flat = 0; flat < rows; ++flat) {
    const uint32_t id = ids[flat];
    if (id < experts) {
      routed[next[id]++] = static_cast<uint32_t>(flat);
    } else {
      std::fill(output + flat * p.n, output + (flat + 1) * p.n, 0.0f);
    }
  }
}

// ---- Grouped ------------------------------------------------------------------------------------

// Work item extents: routed rows x columns of one expert. The columns are a multiple of every
// clone's tile width, so only a matrix whose n is not ends on narrower tiles.
constexpr size_t kBlockRows = 64;
constexpr size_t kBlockCols = 48;
static_assert(kBlockRows % 2 == 0 && kBlockCols % 48 == 0);

struct GroupedJob {
  Operands ops;
  const uint32_t* routed;  // the map's list: each expert's flat rows, expert after expert
  uint64_t launch;         // unique per launch: keys the per-thread packed rows
};

// Per-thread buffers, reused across items and launches. The packed rows belong to the item
// block (launch, row0): the items of one block differ only in their columns, and a thread that
// takes several of them packs the rows once.
struct GroupedScratch {
  uint64_t launch = 0;
  uint32_t row0 = 0;
  std::vector<float> xp;
  std::vector<float*> out;
};
GroupedScratch& grouped_scratch() {
  thread_local GroupedScratch scratch;
  return scratch;
}

// Packs routed rows flats[0 .. rows) two at a time: pair q's inner step s (positions 8s .. 8s+7)
// is kPairStep floats at xp + (q * steps + s) * kPairStep, the pair's first row's 8 then its
// second's. Positions >= k and the absent second row of an odd count are +0 (contract step 1).
void pack_row_pairs(const Operands& ops, const uint32_t* flats, size_t rows, size_t steps,
                    float* xp) {
  const size_t k = ops.k, full = k / kLanes, rest = k - full * kLanes;
  for (size_t r = 0; r < round_up(rows, 2); ++r) {
    float* dst = xp + (r / 2) * steps * kPairStep + (r % 2) * kLanes;
    if (r == rows) {
      for (size_t s = 0; s < steps; ++s) std::fill_n(dst + s * kPairStep, kLanes, 0.0f);
      continue;
    }
    const float* src = ops.input_row(flats[r]);
    for (size_t s = 0; s < full; ++s) std::memcpy(dst + s * kPairStep, src + s * kLanes, 32);
    if (rest != 0) {
      float* tail = dst + full * kPairStep;
      std::copy_n(src + full * kLanes, rest, tail);
      std::fill(tail + rest, tail + kLanes, 0.0f);
    }
  }
}

// One item: its rows packed (or reused), then the row pairs in groups of at most Isa::kMaxPairs,
// as even as possible (5 pairs run as 3 + 2, not 4 + 1, so every group fills its tile), each
// group reading the item's weight columns once.
template <typename Isa, typename WT>
void grouped_item(const GroupedJob& job, const GroupedItem& item) {
  const Operands& ops = job.ops;
  const size_t k = ops.k, steps = round_up(k, kLanes) / kLanes;
  const size_t cols = std::min(kBlockCols, ops.n - item.col0);
  const size_t pairs = (size_t{item.rows} + 1) / 2;
  const uint32_t* flats = job.routed + item.row0;

  GroupedScratch& s = grouped_scratch();
  if (s.launch != job.launch || s.row0 != item.row0) {
    s.xp.resize(std::max(s.xp.size(), pairs * steps * kPairStep));
    pack_row_pairs(ops, flats, item.rows, steps, s.xp.data());
    s.launch = job.launch;
    s.row0 = item.row0;
  }
  s.out.resize(std::max(s.out.size(), 2 * pairs));
  for (size_t r = 0; r < 2 * pairs; ++r) {
    s.out[r] = r < item.rows ? ops.output_row(flats[r]) + item.col0 : nullptr;
  }

  const WT* w = ops.expert<WT>(item.expert) + size_t{item.col0} * k;
  const size_t groups = (pairs + Isa::kMaxPairs - 1) / Isa::kMaxPairs;
  for (size_t g = 0, q = 0; g < groups; ++g) {
    const size_t group = pairs / groups + (g < pairs % groups ? 1 : 0);
    Isa::pair_rows(group, s.xp.data() + q * steps * kPairStep, steps, w, k, cols,
                   s.out.data() + 2 * q);
    q += group;
  }
}

// Reads and checks a grouped launch (the map's counts and routed rows, which a stale or foreign
// scratch could make index out of bounds), lists its work items, largest first, and runs
// run_item(job, item) over them on the pool. Shared by the exact and the bf16-dot grouped kernels.
template <typename WT>
void run_grouped_launch(const KernelLaunch& launch, void* queue_native,
                        void (*run_item)(const GroupedJob&, const GroupedItem&)) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const size_t rows = total_rows(p);
  const size_t experts = p.n_experts;
  const void* weights = arg_data(launch, 1, weight_bytes(p, sizeof(WT)), "weights");
  const void* input = arg_data(launch, 2, input_bytes(p), "input");
  const auto* counts =
      static_cast<const uint32_t*>(arg_data(launch, 3, checked_mul(experts, 4), "expert counts"));
  void* output = arg_data(launch, 5, checked_mul(checked_mul(rows, p.n), 4), "output");

  // The segments together hold at most every flat row once.
  size_t routed_total = 0;
  for (size_t e = 0; e < experts; ++e) {
    routed_total += counts[e];
    if (routed_total > rows) {
      throw Error(std::string(launch.label) + ": expert counts exceed the flat rows");
    }
  }
  const auto* routed = static_cast<const uint32_t*>(
      arg_data(launch, 4, checked_mul(routed_total, 4), "routed rows"));
  for (size_t i = 0; i < routed_total; ++i) {
    if (routed[i] >= rows) throw Error(std::string(launch.label) + ": routed row out of range");
  }
  std::vector<GroupedItem> items;
  size_t start = 0;
  for (size_t e = 0; e < experts; ++e) {
    const size_t count = counts[e];
    for (size_t row0 = 0; row0 < count; row0 += kBlockRows) {
      const auto block_rows = static_cast<uint32_t>(std::min(kBlockRows, count - row0));
      for (size_t col0 = 0; col0 < p.n; col0 += kBlockCols) {
        items.push_back({static_cast<uint32_t>(e), static_cast<uint32_t>(start + row0), block_rows,
                         static_cast<uint32_t>(col0)});
      }
    }
    start += count;
  }
  if (items.empty()) return;
  // Largest items first, handed out one at a time: balances uneven expert counts.
  std::stable_sort(items.begin(), items.end(),
                   [](const GroupedItem& a, const GroupedItem& b) { return a.rows > b.rows; });

  const GroupedJob job{make_operands(p, weights, input, output), routed, next_launch_number()};
  run_grouped_items(queue_native, items, [&](const GroupedItem& item) { run_item(job, item); });
}

template <typename WT>
void grouped_kernel(const KernelLaunch& launch, void* queue_native) {
  void (*run)(const GroupedJob&, const GroupedItem&) = grouped_item<PortableIsa, WT>;
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx512()) {
    run = grouped_item<Avx512Isa, WT>;
  } else if (simd::has_avx2_fma()) {
    run = grouped_item<Avx2Isa, WT>;
  }
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon()) run = grouped_item<NeonIsa, WT>;
#endif
  run_grouped_launch<WT>(launch, queue_native, run);
}

// ---- bf16-dot routes (reduced precision) ---------------------------------------------------------
//
// NUMERIC CONTRACT of direct_bf16_dot and grouped_bf16_dot (BF16 weights only), shared by both, so
// they are bit-identical to each other whatever the thread count or work split:
//   1. Each activation row is rounded to bf16 (round to nearest even; a subnormal rounds to a
//      signed zero) and zero-padded to kp = round_up(k, 32). Weights are used as stored; a padded
//      position contributes a zero product.
//   2. Sixteen F32 lanes start at +0.0f. Step s (32 inner positions 32s .. 32s + 31, in increasing
//      s) adds to lane j the bf16 products of positions 32s + 2j and 32s + 2j + 1, with one
//      VDPBF16PS (AVX512_BF16): products are exact, each addition rounds to nearest even, and
//      subnormal inputs and results are flushed to zero.
//   3. The lanes are summed once: the halves lane-wise (j + 8j' for j < 8), then the eight-lane
//      tree of simd::reduce_lanes.
// Error against the float64 product of the stored weights and the F32 activations:
// |err| <= 2^-8 * sum_i |w_i * x_i| + k * 2^-126 (the activation rounding, 2^-9 relative, plus
// F32 accumulation over at most kp / 32 + 4 roundings per lane, plus flushed subnormals); stated
// in docs/numerics.md and checked by tests/python/test_dense_matmul_id_bf16_dot.py.
#if ROUTEMM_CPU_HAVE_AVX2

constexpr size_t kBf16Step = 32;  // inner positions per VDPBF16PS

// Activation rows rounded to bf16, zero-padded to a whole step; per thread, reused.
std::vector<uint16_t>& bf16_rows_scratch() {
  thread_local std::vector<uint16_t> rows;
  return rows;
}

// dst[0 .. round_up(k, 32)) = bf16(x[0 .. k)), then zeros (contract step 1).
ROUTEMM_CPU_AVX512_BF16 void round_row_to_bf16(const float* x, size_t k, uint16_t* dst) {
  for (size_t i = 0; i < k; i += kBf16Step) {
    const size_t rest = std::min(kBf16Step, k - i);
    const __mmask16 lo = rest >= 16 ? __mmask16(0xffff) : __mmask16((1u << rest) - 1);
    const __mmask16 hi = rest <= 16   ? __mmask16(0)
                         : rest >= 32 ? __mmask16(0xffff)
                                      : __mmask16((1u << (rest - 16)) - 1);
    const __m512 a = _mm512_maskz_loadu_ps(lo, x + i);
    const __m512 b = _mm512_maskz_loadu_ps(hi, x + i + 16);
    _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

// half[l] = lanes[l] + lanes[l + 8], then the contract's lane tree, all in registers.
ROUTEMM_CPU_AVX512_BF16 float reduce_bf16_lanes(__m512 v) {
  return simd::reduce_lanes(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

// R activation rows (bf16, padded, at x[r] ) x C weight columns (bf16, k each, col_stride
// columns apart: column c at w + c * col_stride * k): out[r * out_stride + c * col_stride] for
// every pair, over the full inner dimension.
template <size_t R, size_t C>
ROUTEMM_CPU_AVX512_BF16 void bf16_dot_tile(const uint16_t* const* x, const BFloat16* w, size_t k,
                                           float* out, size_t out_stride, size_t col_stride = 1) {
  const size_t wstep = col_stride * k;
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (size_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const size_t k_full = k / kBf16Step * kBf16Step;
  for (size_t i = 0; i < k; i += kBf16Step) {
    // The last step loads only the weights inside the row (zeros beyond it).
    const __mmask32 mask =
        i < k_full ? ~__mmask32(0) : __mmask32((uint64_t{1} << (k - k_full)) - 1);
    __m512bh wv[C];
#pragma GCC unroll 16
    for (size_t c = 0; c < C; ++c) {
      wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c * wstep + i);
    }
#pragma GCC unroll 16
    for (size_t r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + i);
#pragma GCC unroll 16
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (size_t r = 0; r < R; ++r)
    for (size_t c = 0; c < C; ++c) {
      out[r * out_stride + c * col_stride] = reduce_bf16_lanes(acc[r][c]);
    }
}

// Columns [0, cols) of `rows` (<= kBf16TileRows) activation rows against one expert's columns.
constexpr size_t kBf16TileRows = 4;
constexpr size_t kBf16TileCols = 4;

template <size_t R>
ROUTEMM_CPU_AVX512_BF16 void bf16_dot_rows(const uint16_t* const* x, const BFloat16* w, size_t k,
                                           size_t cols, float* out, size_t out_stride) {
  // One column from each of kBf16TileCols equal segments per tile: long weight streams (see
  // kDirectCols).
  const size_t seg = cols / kBf16TileCols;
  for (size_t j = 0; j < seg; ++j) {
    bf16_dot_tile<R, kBf16TileCols>(x, w + j * k, k, out + j, out_stride, seg);
  }
  for (size_t c = seg * kBf16TileCols; c < cols; ++c) {
    bf16_dot_tile<R, 1>(x, w + c * k, k, out + c, out_stride);
  }
}

// Weight streams of the bf16_dot direct route: a tile takes one column from each of this many
// equal segments of the item's columns, each segment read front to back. Fewer streams than the
// exact route's eight: one VDPBF16PS consumes a whole cache line per column, so two chains already
// outrun the memory, and two streams per thread read faster than eight. Measured on the 2-core
// Zen 4 (Qwen3 expert shape, m = 1, both threads, alternating within one process): 8 segments
// 632-685 us per call, 4: 526-601, 2: 512-568, 1: 552-591.
constexpr size_t kBf16DirectSegments = 2;

// The direct route: one activation row per work item, kBf16DirectSegments columns per tile (one
// from each of the item's column segments), so each activation step is loaded once for both dot
// products.
ROUTEMM_CPU_AVX512_BF16 void bf16_dot_direct_items(const DirectJob& job, size_t begin, size_t end) {
  const Operands& ops = job.ops;
  const size_t kp = round_up(ops.k, kBf16Step);
  std::vector<uint16_t>& xs = bf16_rows_scratch();
  xs.resize(std::max(xs.size(), kp));
  size_t rounded_flat = SIZE_MAX;
  for (size_t item = begin; item < end; ++item) {
    const size_t flat = item / job.chunks_per_row;
    const size_t col0 = (item - flat * job.chunks_per_row) * job.chunk;
    const size_t cols = std::min(ops.n - col0, job.chunk);
    float* out = ops.output_row(flat) + col0;
    const uint32_t id = job.ids[flat];
    if (id >= job.n_experts) {  // invalid id: zero row, no weight address formed
      std::fill(out, out + cols, 0.0f);
      continue;
    }
    if (rounded_flat != flat) {  // consecutive items of one row share its rounding
      round_row_to_bf16(ops.input_row(flat), ops.k, xs.data());
      rounded_flat = flat;
    }
    const uint16_t* x[1] = {xs.data()};
    const BFloat16* w = ops.expert<BFloat16>(id) + col0 * ops.k;
    const size_t seg = cols / kBf16DirectSegments;  // long weight streams
    for (size_t j = 0; j < seg; ++j) {
      bf16_dot_tile<1, kBf16DirectSegments>(x, w + j * ops.k, ops.k, out + j, 0, seg);
    }
    const size_t c = seg * kBf16DirectSegments;
    bf16_dot_rows<1>(x, w + c * ops.k, ops.k, cols - c, out + c, 0);
  }
}

// The grouped route: an item's routed rows are rounded once, then every kBf16TileRows x
// kBf16TileCols tile reads its weight columns straight from the expert (bf16 needs no widening).
ROUTEMM_CPU_AVX512_BF16 void bf16_dot_grouped_item(const GroupedJob& job, const GroupedItem& item) {
  const Operands& ops = job.ops;
  const size_t k = ops.k, kp = round_up(k, kBf16Step);
  const size_t cols = std::min(kBlockCols, ops.n - item.col0);
  const uint32_t* flats = job.routed + item.row0;
  std::vector<uint16_t>& xs = bf16_rows_scratch();
  xs.resize(std::max(xs.size(), size_t{item.rows} * kp));
  for (size_t r = 0; r < item.rows; ++r) {
    round_row_to_bf16(ops.input_row(flats[r]), k, xs.data() + r * kp);
  }
  const BFloat16* w = ops.expert<BFloat16>(item.expert) + size_t{item.col0} * k;
  float tile[kBf16TileRows * kBlockCols];
  for (size_t r = 0; r < item.rows; r += kBf16TileRows) {
    const size_t rows = std::min(kBf16TileRows, item.rows - r);
    const uint16_t* x[kBf16TileRows];
    for (size_t i = 0; i < rows; ++i) x[i] = xs.data() + (r + i) * kp;
    switch (rows) {
      case 1: bf16_dot_rows<1>(x, w, k, cols, tile, kBlockCols); break;
      case 2: bf16_dot_rows<2>(x, w, k, cols, tile, kBlockCols); break;
      case 3: bf16_dot_rows<3>(x, w, k, cols, tile, kBlockCols); break;
      default: bf16_dot_rows<4>(x, w, k, cols, tile, kBlockCols); break;
    }
    for (size_t i = 0; i < rows; ++i) {
      std::copy(tile + i * kBlockCols, tile + i * kBlockCols + cols,
                ops.output_row(flats[r + i]) + item.col0);
    }
  }
}

void bf16_dot_direct_kernel(const KernelLaunch& launch, void* queue_native) {
  run_direct_launch<BFloat16>(launch, queue_native, bf16_dot_direct_items);
}

void bf16_dot_grouped_kernel(const KernelLaunch& launch, void* queue_native) {
  run_grouped_launch<BFloat16>(launch, queue_native, bf16_dot_grouped_item);
}

#endif

// ---- Registration -------------------------------------------------------------------------------

KernelDef make_def(std::string_view name, KernelFn fn) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.origin = "builtin_cpu";
  def.content_sha256 = ROUTEMM_CPU_DENSE_MATMUL_ID_SHA256;
  return def;
}

// Geometry of spec §7.4 (the front door sizes grids from it; the CPU kernels ignore the grid).
KernelDef direct_def(std::string_view name, KernelFn fn) {
  KernelDef def = make_def(name, fn);
  def.threads_per_group = 64;
  def.tile_x = 8;  // output columns per group
  def.tile_y = 1;
  def.threadgroup_memory_bytes = 0;
  return def;
}

KernelDef grouped_def(std::string_view name, KernelFn fn) {
  KernelDef def = make_def(name, fn);
  def.threads_per_group = 256;
  def.tile_x = 8;  // routed rows per group
  def.tile_y = 8;  // columns per group
  def.threadgroup_memory_bytes = 4096;
  return def;
}

}  // namespace

void add_dense_matmul_id_bf16_dot_kernels(std::vector<KernelDef>& out) {
#if ROUTEMM_CPU_HAVE_AVX2
  if (!simd::has_avx512_bf16()) return;  // no pipeline: a call fails before encoding
  constexpr auto names = kDenseMatmulIdBf16DotPipelineNames;
  out.push_back(direct_def(names[0], bf16_dot_direct_kernel));
  out.push_back(grouped_def(names[1], bf16_dot_grouped_kernel));
#else
  (void)out;
#endif
}

void add_dense_matmul_id_kernels(std::vector<KernelDef>& out) {
  // The order of kDenseMatmulIdPipelineNames is relied on below.
  constexpr auto names = kDenseMatmulIdPipelineNames;
  static_assert(names.size() == 7 && names[0] == "dense_matmul_id_direct_f32_f32" &&
                names[1] == "dense_matmul_id_direct_f16_f32" &&
                names[2] == "dense_matmul_id_direct_bf16_f32" &&
                names[3] == "dense_matmul_id_map_distinct" &&
                names[4] == "dense_matmul_id_grouped_f32_f32" &&
                names[5] == "dense_matmul_id_grouped_f16_f32" &&
                names[6] == "dense_matmul_id_grouped_bf16_f32");
  out.push_back(direct_def(names[0], direct_kernel<float>));
  out.push_back(direct_def(names[1], direct_kernel<Half>));
  out.push_back(direct_def(names[2], direct_kernel<BFloat16>));
  KernelDef map = make_def(names[3], map_distinct_kernel);
  map.threads_per_group = 0;  // the front door launches n_experts threads
  out.push_back(map);
  out.push_back(grouped_def(names[4], grouped_kernel<float>));
  out.push_back(grouped_def(names[5], grouped_kernel<Half>));
  out.push_back(grouped_def(names[6], grouped_kernel<BFloat16>));
}

}  // namespace routemm::cpu
