// CPU building blocks of the GGML block-quantised products (Q4_0 and Q8_0; the mat-vec also for
// Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K and Q6_K): the block formats, the mat-vec and the panel
// micro-kernels, shared by the dense projection (q4_matmul.cpp), the expert-ID matmul
// (quantized_matmul_id.cpp) and the other formats' small-m routes (ggml_format_kernels.cpp) so
// that all follow one numerical contract:
//
//   1. Weights are dequantised exactly: w = d * (nibble - 8) (Q4_0) or d * q (Q8_0), with d the
//      block's binary16 scale widened to binary32. An 11-bit significand times an integer of at
//      most 8 bits fits binary32, so no rounding happens (NaN/inf scales propagate as IEEE says).
//      The other formats' values are ggml's to_float's (ggml_formats.cpp): their products are
//      exact too and only a final min / offset addition rounds (K-quants: d1 * q - m1, see
//      "Super-block formats" below).
//   2. Eight lane accumulators start at +0.0f. Lane l visits i = l, l + 8, l + 16, ... < K in
//      increasing order and does acc[l] = fma(w[col, i], x[row, i], acc[l]): one correctly
//      rounded binary32 fused multiply-add per step. K is a multiple of 32: no padding.
//   3. The lanes are summed once, in the fixed tree ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
//      (simd::reduce_lanes).
// Whatever the thread count, work split, tile or instruction set, every output gets these bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/common/q4_0_block.h"
#include "routemm/ggml_formats.h"
#include "simd.h"

#if ROUTEMM_CPU_HAVE_AVX2 || ROUTEMM_CPU_HAVE_AVX512
#include <immintrin.h>
#endif

namespace routemm::cpu::ggml {

using simd::kLanes;

constexpr size_t kQK = 32;                       // values per block (every format here)
constexpr size_t kLanesPerBlock = kQK / kLanes;  // 4 lane vectors per block

inline uint16_t block_scale_bits(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);  // blocks are only 2-byte aligned; GGUF is little endian
  return bits;
}

#if ROUTEMM_CPU_HAVE_AVX2
// The block's scale d times 2^Shift (Shift <= 0, exact: the result is a normal binary32 or d's
// zero, infinity or NaN), in all eight lanes. A normal binary16 value is widened with integer
// operations and broadcast from memory, which keeps the vector units free for the block's values;
// zero, subnormal, infinite and NaN scales take the F16C conversion.
template <int Shift>
ROUTEMM_CPU_AVX2 inline __m256 broadcast_scale(const uint8_t* block) {
  static_assert(Shift <= 0 && Shift > -100);
  const uint32_t h = block_scale_bits(block);
  const uint32_t magnitude = h & 0x7fffu;
  float value;
  if (magnitude - 0x0400u < 0x7800u) [[likely]] {
    const uint32_t bits =
        ((h & 0x8000u) << 16) | ((magnitude << 13) + (static_cast<uint32_t>(112 + Shift) << 23));
    std::memcpy(&value, &bits, 4);
  } else {
    value = _cvtsh_ss(static_cast<unsigned short>(h)) * std::ldexp(1.0f, Shift);
  }
  __m256 v;
  asm("vbroadcastss %1, %0" : "=x"(v) : "m"(value));
  return v;
}
#endif

#if ROUTEMM_CPU_HAVE_AVX512
// A 32-value block of 4-bit codes in 16 bytes (value j < 16 the low nibble of byte j, value 16 + j
// its high nibble) looked up in the 16-entry table low (codes 0-7) : high (codes 8-15): four
// 8-lane vectors, v[s] = values 8s .. 8s+7. vpermt2ps reads only the low four index bits, so the
// low nibble needs no mask. Exact: every value is a table entry.
ROUTEMM_CPU_AVX512 inline void lookup_nibbles_avx512(__m128i bytes, __m256 low, __m256 high,
                                                     __m256 v[kLanesPerBlock]) {
  const __m256i first = _mm256_cvtepu8_epi32(bytes);                      // bytes 0..7
  const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8..15
  v[0] = _mm256_permutex2var_ps(low, first, high);
  v[1] = _mm256_permutex2var_ps(low, second, high);
  v[2] = _mm256_permutex2var_ps(low, _mm256_srli_epi32(first, 4), high);
  v[3] = _mm256_permutex2var_ps(low, _mm256_srli_epi32(second, 4), high);
}
#endif

// ---- Block formats ------------------------------------------------------------------------------
//
//   kBytes                         bytes per 32-value block
//   dequant(block, out)            out[0..32) = the block's exact values (portable)
//   dequant_avx2(block, v)         the same as four 8-lane vectors, v[s] = values 8s .. 8s+7
//   dequant_avx512(block, v)       the same, for the AVX-512 kernels

struct Q4_0Format {
  static constexpr size_t kBytes = kernels::kQ4_0BlockBytes;

  static void dequant(const uint8_t* block, float* out) {
    const float d = simd::widen(simd::Half{block_scale_bits(block)});
    const uint8_t* qs = block + 2;
    for (size_t j = 0; j < kQK / 2; ++j) {
      out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 0x0f) - 8);
      out[j + kQK / 2] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  // Values 0-15 are the low nibbles of bytes 0-15, values 16-31 their high nibbles. Each is the
  // product d * (q - 8) of the portable path (so an infinite scale gives the same infinities).
  //
  // With every byte xor 0x88 a nibble, read as a signed 4-bit integer, is q - 8. One shuffle puts
  // byte j in the top byte of lane j; a shift (low nibble) or a mask (high nibble) leaves the
  // int32 (q - 8) * 2^28, converted exactly, and its product with d * 2^-28 (a power-of-two
  // scaling, exact) is d * (q - 8). Per block: two shuffles and four integer operations where
  // dequant_avx2_lean takes three shuffles and eight.
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = broadcast_scale<-28>(block);
    const __m256i bytes = _mm256_xor_si256(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))),
        _mm256_set1_epi8(static_cast<char>(0x88)));
    const __m256i first = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(-1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7));
    const __m256i second = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(-1, -1, -1, 8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1,
                                -1, -1, 12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xf0000000u));
    const __m256i q[kLanesPerBlock] = {_mm256_slli_epi32(first, 4), _mm256_slli_epi32(second, 4),
                                       _mm256_and_si256(first, high),
                                       _mm256_and_si256(second, high)};
    for (size_t s = 0; s < kLanesPerBlock; ++s) v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[s]), d);
  }

  // The same values with two constant registers instead of four (the mat-vec passes whose
  // accumulators and block leave no more free): zero-extended bytes, masked or shifted, minus 8.
  ROUTEMM_CPU_AVX2 static void dequant_avx2_lean(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i first = _mm256_cvtepu8_epi32(bytes);                      // bytes 0..7
    const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8..15
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256i q[kLanesPerBlock] = {_mm256_and_si256(first, low), _mm256_and_si256(second, low),
                                       _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[s], _mm256_set1_epi32(8))), d);
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  // The same four vectors, looked up in the block's 16-entry table d * (j - 8), j = 0..15, held
  // in two registers (exact products; vpermt2ps reads only the low four index bits, so the low
  // nibble needs no mask). Fewer instructions than converting and scaling each value.
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m256 low = _mm256_mul_ps(d, _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1));
    const __m256 high = _mm256_mul_ps(d, _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    lookup_nibbles_avx512(bytes, low, high, v);
  }
#endif
};

struct Q8_0Format {
  static constexpr size_t kBytes = kernels::kQ8_0BlockBytes;

  static void dequant(const uint8_t* block, float* out) {
    const float d = simd::widen(simd::Half{block_scale_bits(block)});
    const uint8_t* qs = block + 2;
    for (size_t j = 0; j < kQK; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(qs[j]));
  }

#if ROUTEMM_CPU_HAVE_AVX2
  // Value j is the signed byte qs[j] times d (exact).
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = broadcast_scale<0>(block);
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * s));
      v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    dequant_avx2(block, v);
  }
#endif
};

// Q4_1 (d, m, 16 bytes of nibbles): q * d + m, as Q4_0's nibbles. The product q * d (4 + 11
// significant bits) is exact, so only the sum rounds and a fused multiply-add gives the same bits.
struct Q4_1Format {
  static constexpr size_t kBytes = 20;

  static void dequant(const uint8_t* block, float* out) {
    const float d = simd::widen(simd::Half{block_scale_bits(block)});
    const float m = simd::widen(simd::Half{block_scale_bits(block + 2)});
    const uint8_t* qs = block + 4;
    for (size_t j = 0; j < kQK / 2; ++j) {
      out[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
      out[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block + 2)));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m256i first = _mm256_cvtepu8_epi32(bytes);                      // bytes 0..7
    const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8..15
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256i q[kLanesPerBlock] = {_mm256_and_si256(first, low), _mm256_and_si256(second, low),
                                       _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      v[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[s]), d, m);  // exact product: one rounding
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  // Q4_0's table lookup with the table j * d + m.
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block + 2)));
    const __m256 low = _mm256_fmadd_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), d, m);
    const __m256 high = _mm256_fmadd_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), d, m);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    lookup_nibbles_avx512(bytes, low, high, v);
  }
#endif
};

// Q5_0 (d, 32 high bits, 16 bytes of nibbles: (q - 16) * d, exact) and Q5_1 (d, m, high bits,
// nibbles: q * d + m, an exact product and one rounding). Value i's fifth bit is bit i of the
// high-bit word; its low four bits are Q4_0's nibble i.
template <bool kMin>
struct Q5Format {
  static constexpr size_t kHighBits = kMin ? 4 : 2;  // offset of the high-bit word
  static constexpr size_t kBytes = kHighBits + 4 + 16;

  static uint32_t high_bits(const uint8_t* block) {
    uint32_t qh;
    std::memcpy(&qh, block + kHighBits, 4);
    return qh;
  }

  static void dequant(const uint8_t* block, float* out) {
    const float d = simd::widen(simd::Half{block_scale_bits(block)});
    const uint32_t qh = high_bits(block);
    const uint8_t* qs = block + kHighBits + 4;
    for (size_t i = 0; i < kQK; ++i) {
      const int nibble = i < kQK / 2 ? qs[i] & 0x0f : qs[i - kQK / 2] >> 4;
      const int q = nibble | static_cast<int>(((qh >> i) & 1u) << 4);
      if constexpr (kMin) {
        out[i] = static_cast<float>(q) * d + simd::widen(simd::Half{block_scale_bits(block + 2)});
      } else {
        out[i] = static_cast<float>(q - 16) * d;
      }
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m256i qh = _mm256_set1_epi32(static_cast<int>(high_bits(block)));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHighBits + 4));
    const __m256i first = _mm256_cvtepu8_epi32(bytes);
    const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    const __m256i low = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    const __m256i nibble[kLanesPerBlock] = {
        _mm256_and_si256(first, low), _mm256_and_si256(second, low), _mm256_srli_epi32(first, 4),
        _mm256_srli_epi32(second, 4)};
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      const __m256i bit = _mm256_and_si256(
          _mm256_srlv_epi32(qh, _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(8 * s)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
          one);
      const __m256i q = _mm256_or_si256(nibble[s], _mm256_slli_epi32(bit, 4));
      if constexpr (kMin) {
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block + 2)));
        v[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);  // exact product: one rounding
      } else {
        v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))), d);
      }
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    dequant_avx2(block, v);
  }
#endif
};
using Q5_0Format = Q5Format<false>;
using Q5_1Format = Q5Format<true>;

// MXFP4 (an E8M0 exponent e, 16 bytes of E2M1 codes): v * s with v the doubled E2M1 value (an
// integer of at most 12) and s = 2^(e - 128) as ggml computes it (subnormal for e < 2); every
// product is exact (or overflows alike), so a table of the sixteen v * s gives the same bits.
struct Mxfp4Format {
  static constexpr size_t kBytes = 17;
  static constexpr int8_t kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

  static float scale(const uint8_t* block) {
    const uint8_t e = block[0];
    const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
  }

  static void dequant(const uint8_t* block, float* out) {
    const float d = scale(block);
    const uint8_t* qs = block + 1;
    for (size_t j = 0; j < kQK / 2; ++j) {
      out[j] = static_cast<float>(kValues[qs[j] & 0x0f]) * d;
      out[j + kQK / 2] = static_cast<float>(kValues[qs[j] >> 4]) * d;
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  // The codes looked up as signed bytes (one shuffle per sixteen), widened and scaled.
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(scale(block));
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1));
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m128i first = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
    const __m128i second = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    const __m128i q[kLanesPerBlock] = {first, _mm_srli_si128(first, 8), second,
                                       _mm_srli_si128(second, 8)};
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      v[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[s])), d);
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  // Q4_0's table lookup with the table v * s.
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(scale(block));
    const __m256 low = _mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12), d);
    const __m256 high = _mm256_mul_ps(_mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12), d);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 1));
    lookup_nibbles_avx512(bytes, low, high, v);
  }
#endif
};

// ---- Super-block formats (K-quants) ------------------------------------------------------------
//
// A K-quant row is a run of 256-value super-blocks; its 32-value block b is sub-block b % 8 of
// super-block b / 8, with that sub-block's own scale (and min) derived from the super-block's
// header. Such a format defines
//
//   kSubBlocks, kSuperBytes        sub-blocks per super-block (8) and bytes per super-block
//   Scales                         one super-block's sub-block factors, as ggml's to_float rounds
//                                  them (d * sc and dmin * m, or Q6_K's d * sc per 16 values)
//   load_scales(super, s)          s = the factors of the super-block at `super`
//   dequant(row, b, s, out)        out[0..32) = block b's exact values (portable)
//   dequant_avx2 / dequant_avx512(row, b, s, v)   the same as four 8-lane vectors
//
// and the kernels keep one Scales per weight row they walk, refilled at each super-block's first
// block (load_scales_at). Every value is ggml's d1 * q - m1 (or ds * q): d1 = d * sc has at most
// 11 + 6 significant bits and d1 * q (q < 32) at most 22, ds * q at most 18 + 5, so every product
// is exact and only the subtraction rounds: a fused multiply-subtract gives the same bits, and so
// does a table of the sixteen d1 * j - m1.

template <class F>
concept SuperBlockFormat = requires { F::kSubBlocks; };

struct NoScales {};
template <class F>
struct ScalesTrait {
  using type = NoScales;
};
template <SuperBlockFormat F>
struct ScalesTrait<F> {
  using type = typename F::Scales;
};
// The per-row decode state of format F (empty for the plain 32-value block formats).
template <class F>
using ScalesOf = typename ScalesTrait<F>::type;

// Bytes where block b of a row starts (its super-block's, for a K-quant): prefetch addresses.
template <class F>
inline const uint8_t* block_address(const uint8_t* row, size_t b) {
  if constexpr (SuperBlockFormat<F>) {
    return row + b / F::kSubBlocks * F::kSuperBytes;
  } else {
    return row + b * F::kBytes;
  }
}

// Refills s when block b starts a super-block (nothing for the plain formats). Blocks of a row
// must be visited in increasing order from a super-block's first.
template <class F>
inline void load_scales_at(const uint8_t* row, size_t b, ScalesOf<F>& s) {
  if constexpr (SuperBlockFormat<F>) {
    if (b % F::kSubBlocks == 0) F::load_scales(block_address<F>(row, b), s);
  }
}

template <class F>
inline void dequant_at(const uint8_t* row, size_t b, const ScalesOf<F>& s, float* out) {
  if constexpr (SuperBlockFormat<F>) {
    F::dequant(row, b, s, out);
  } else {
    F::dequant(row + b * F::kBytes, out);
  }
}

#if ROUTEMM_CPU_HAVE_AVX2
// load_scales_at with the format's vector decoder of the factors (the same floats).
template <class F>
ROUTEMM_CPU_AVX2 inline void load_scales_avx2_at(const uint8_t* row, size_t b, ScalesOf<F>& s) {
  if constexpr (SuperBlockFormat<F>) {
    if (b % F::kSubBlocks == 0) F::load_scales_avx2(block_address<F>(row, b), s);
  }
}

template <class F>
ROUTEMM_CPU_AVX2 inline void dequant_avx2_at(const uint8_t* row, size_t b, const ScalesOf<F>& s,
                                             __m256 v[kLanesPerBlock]) {
  if constexpr (SuperBlockFormat<F>) {
    F::dequant_avx2(row, b, s, v);
  } else {
    F::dequant_avx2(row + b * F::kBytes, v);
  }
}
#endif

#if ROUTEMM_CPU_HAVE_AVX512
template <class F>
ROUTEMM_CPU_AVX512 inline void dequant_avx512_at(const uint8_t* row, size_t b, const ScalesOf<F>& s,
                                                 __m256 v[kLanesPerBlock]) {
  if constexpr (SuperBlockFormat<F>) {
    F::dequant_avx512(row, b, s, v);
  } else {
    F::dequant_avx512(row + b * F::kBytes, v);
  }
}
#endif

namespace kquant {

constexpr size_t kSubBlocks = 8;

using ggml_formats::scale_min_k4;

// Q4_K / Q5_K: d1 = d * sc and m1 = dmin * m of each sub-block.
struct MinScales {
  float d[kSubBlocks], m[kSubBlocks];
};

inline void load_min_scales(const uint8_t* super, MinScales& s) {
  const float d = simd::widen(simd::Half{block_scale_bits(super)});
  const float dmin = simd::widen(simd::Half{block_scale_bits(super + 2)});
  for (size_t j = 0; j < kSubBlocks; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, super + 4, sc, m);
    s.d[j] = d * static_cast<float>(sc);
    s.m[j] = dmin * static_cast<float>(m);
  }
}

#if ROUTEMM_CPU_HAVE_AVX2
// Eight unsigned bytes at p, as int32.
ROUTEMM_CPU_AVX2 inline __m256i bytes8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// load_min_scales with scale_min_k4 on 32-bit words (four sub-blocks at a time) and the eight
// products of each kind in one vector.
ROUTEMM_CPU_AVX2 inline void load_min_scales_avx2(const uint8_t* super, MinScales& s) {
  uint32_t a, b, c;
  std::memcpy(&a, super + 4, 4);
  std::memcpy(&b, super + 8, 4);
  std::memcpy(&c, super + 12, 4);
  const uint32_t sc0 = a & 0x3f3f3f3fu, m0 = b & 0x3f3f3f3fu;
  const uint32_t sc1 = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  const uint32_t m1 = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
  const __m128i bytes = _mm_setr_epi32(static_cast<int>(sc0), static_cast<int>(sc1),
                                       static_cast<int>(m0), static_cast<int>(m1));
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(super)));
  const __m256 dmin = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(super + 2)));
  _mm256_storeu_ps(s.d, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))));
  _mm256_storeu_ps(
      s.m, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))));
}
#endif

}  // namespace kquant

// Q4_K (144-byte super-blocks: d, dmin, 12 scale bytes, 128 bytes of nibbles). Sub-block s takes
// the low (s even) or high (s odd) nibbles of bytes 32 (s / 2) .. + 32.
struct Q4_KFormat {
  static constexpr size_t kSubBlocks = kquant::kSubBlocks;
  static constexpr size_t kSuperBytes = 144;
  using Scales = kquant::MinScales;

  static void load_scales(const uint8_t* super, Scales& s) { kquant::load_min_scales(super, s); }
#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void load_scales_avx2(const uint8_t* super, Scales& s) {
    kquant::load_min_scales_avx2(super, s);
  }
#endif

  static const uint8_t* codes(const uint8_t* row, size_t b) {
    return block_address<Q4_KFormat>(row, b) + 16 + 32 * (b % kSubBlocks / 2);
  }

  static void dequant(const uint8_t* row, size_t b, const Scales& s, float* out) {
    const uint8_t* q = codes(row, b);
    const size_t j = b % kSubBlocks;
    const int shift = 4 * static_cast<int>(b & 1);
    for (size_t l = 0; l < kQK; ++l) {
      out[l] = s.d[j] * static_cast<float>((q[l] >> shift) & 0xF) - s.m[j];
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* row, size_t b, const Scales& s,
                                            __m256 v[kLanesPerBlock]) {
    const uint8_t* q = codes(row, b);
    const size_t j = b % kSubBlocks;
    const __m256 d1 = _mm256_broadcast_ss(&s.d[j]), m1 = _mm256_broadcast_ss(&s.m[j]);
    const __m128i shift = _mm_cvtsi32_si128(4 * static_cast<int>(b & 1));
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (size_t i = 0; i < kLanesPerBlock; ++i) {
      const __m256i u =
          _mm256_and_si256(_mm256_srl_epi32(kquant::bytes8(q + i * kLanes), shift), low);
      v[i] = _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(u), m1);  // exact product: one rounding
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  // Looked up in the sub-block's table d1 * j - m1, j = 0..15, held in two registers (vpermt2ps
  // reads only the low four index bits, so the low nibble needs no mask).
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* row, size_t b, const Scales& s,
                                                __m256 v[kLanesPerBlock]) {
    const uint8_t* q = codes(row, b);
    const size_t j = b % kSubBlocks;
    const __m256 d1 = _mm256_broadcast_ss(&s.d[j]), m1 = _mm256_broadcast_ss(&s.m[j]);
    const __m256 low = _mm256_fmsub_ps(d1, _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), m1);
    const __m256 high = _mm256_fmsub_ps(d1, _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), m1);
    // Odd sub-blocks take the high nibbles; even ones need no shift (nor a mask).
    if (b & 1) {
      for (size_t i = 0; i < kLanesPerBlock; ++i) {
        const __m256i u = _mm256_srli_epi32(kquant::bytes8(q + i * kLanes), 4);
        v[i] = _mm256_permutex2var_ps(low, u, high);
      }
    } else {
      for (size_t i = 0; i < kLanesPerBlock; ++i) {
        v[i] = _mm256_permutex2var_ps(low, kquant::bytes8(q + i * kLanes), high);
      }
    }
  }
#endif
};

// Q5_K (176-byte super-blocks: d, dmin, 12 scale bytes, 32 bytes of high bits, 128 bytes of
// nibbles). Sub-block s: Q4_K's nibbles plus 16 where bit s of high-bit byte l is set.
struct Q5_KFormat {
  static constexpr size_t kSubBlocks = kquant::kSubBlocks;
  static constexpr size_t kSuperBytes = 176;
  using Scales = kquant::MinScales;

  static void load_scales(const uint8_t* super, Scales& s) { kquant::load_min_scales(super, s); }
#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void load_scales_avx2(const uint8_t* super, Scales& s) {
    kquant::load_min_scales_avx2(super, s);
  }
#endif

  static void dequant(const uint8_t* row, size_t b, const Scales& s, float* out) {
    const uint8_t* super = block_address<Q5_KFormat>(row, b);
    const size_t j = b % kSubBlocks;
    const uint8_t* ql = super + 48 + 32 * (j / 2);
    const uint8_t* qh = super + 16;
    const int shift = 4 * static_cast<int>(j & 1);
    for (size_t l = 0; l < kQK; ++l) {
      const int q = ((ql[l] >> shift) & 0xF) + (((qh[l] >> j) & 1) << 4);
      out[l] = s.d[j] * static_cast<float>(q) - s.m[j];
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* row, size_t b, const Scales& s,
                                            __m256 v[kLanesPerBlock]) {
    const uint8_t* super = block_address<Q5_KFormat>(row, b);
    const size_t j = b % kSubBlocks;
    const uint8_t* ql = super + 48 + 32 * (j / 2);
    const uint8_t* qh = super + 16;
    const __m256 d1 = _mm256_broadcast_ss(&s.d[j]), m1 = _mm256_broadcast_ss(&s.m[j]);
    const __m128i shift = _mm_cvtsi32_si128(4 * static_cast<int>(j & 1));
    const __m128i high_shift = _mm_cvtsi32_si128(static_cast<int>(j));
    const __m256i low = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    for (size_t i = 0; i < kLanesPerBlock; ++i) {
      const __m256i nib =
          _mm256_and_si256(_mm256_srl_epi32(kquant::bytes8(ql + i * kLanes), shift), low);
      const __m256i hi =
          _mm256_and_si256(_mm256_srl_epi32(kquant::bytes8(qh + i * kLanes), high_shift), one);
      const __m256i u = _mm256_or_si256(nib, _mm256_slli_epi32(hi, 4));
      v[i] = _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(u), m1);  // exact product: one rounding
    }
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* row, size_t b, const Scales& s,
                                                __m256 v[kLanesPerBlock]) {
    dequant_avx2(row, b, s, v);
  }
#endif
};

// Q6_K (210-byte super-blocks: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8
// scales, d). Sub-block s = 4 n + t (n: which 128-value half, t: which 32 values of it): low
// nibbles (t < 2) or high nibbles (t >= 2) of ql[64 n + 32 (t & 1) + l], bits 2t, 2t + 1 of
// qh[32 n + l] as bits 4 and 5, minus 32; values 0-15 scaled by sc[2 s], 16-31 by sc[2 s + 1].
struct Q6_KFormat {
  static constexpr size_t kSubBlocks = kquant::kSubBlocks;
  static constexpr size_t kSuperBytes = 210;
  struct Scales {
    float ds[2 * kSubBlocks];  // d * sc[i], ggml's first rounding
  };

  static void load_scales(const uint8_t* super, Scales& s) {
    const float d = simd::widen(simd::Half{block_scale_bits(super + 208)});
    const auto* sc = reinterpret_cast<const int8_t*>(super + 192);
    for (size_t i = 0; i < 2 * kSubBlocks; ++i) s.ds[i] = d * static_cast<float>(sc[i]);
  }
#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static void load_scales_avx2(const uint8_t* super, Scales& s) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(super + 208)));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 192));
    _mm256_storeu_ps(s.ds, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(
        s.ds + 8,
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
#endif

  static void dequant(const uint8_t* row, size_t b, const Scales& s, float* out) {
    const uint8_t* super = block_address<Q6_KFormat>(row, b);
    const size_t j = b % kSubBlocks, n = j / 4, t = j % 4;
    const uint8_t* ql = super + 64 * n + 32 * (t & 1);
    const uint8_t* qh = super + 128 + 32 * n;
    const int shift = 4 * static_cast<int>(t / 2);
    for (size_t l = 0; l < kQK; ++l) {
      const int q = (((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
      out[l] = s.ds[2 * j + l / 16] * static_cast<float>(q);
    }
  }

#if ROUTEMM_CPU_HAVE_AVX2
  // The 32 codes as signed bytes q - 32, widened eight at a time.
  ROUTEMM_CPU_AVX2 static void dequant_avx2(const uint8_t* row, size_t b, const Scales& s,
                                            __m256 v[kLanesPerBlock]) {
    const uint8_t* super = block_address<Q6_KFormat>(row, b);
    const size_t j = b % kSubBlocks, n = j / 4, t = j % 4;
    const __m256i ql =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 64 * n + 32 * (t & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + 128 + 32 * n));
    const __m256i nib =
        _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * static_cast<int>(t / 2))),
                         _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * static_cast<int>(t))),
                         _mm256_set1_epi8(0x03)),
        4);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, hi), _mm256_set1_epi8(32));
    const __m128i first = _mm256_castsi256_si128(q), second = _mm256_extracti128_si256(q, 1);
    const __m256 ds0 = _mm256_broadcast_ss(&s.ds[2 * j]);
    const __m256 ds1 = _mm256_broadcast_ss(&s.ds[2 * j + 1]);
    v[0] = _mm256_mul_ps(ds0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)));
    v[1] = _mm256_mul_ps(ds0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))));
    v[2] = _mm256_mul_ps(ds1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)));
    v[3] = _mm256_mul_ps(ds1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))));
  }
#endif

#if ROUTEMM_CPU_HAVE_AVX512
  ROUTEMM_CPU_AVX512 static void dequant_avx512(const uint8_t* row, size_t b, const Scales& s,
                                                __m256 v[kLanesPerBlock]) {
    dequant_avx2(row, b, s, v);
  }
#endif
};

// Pointers and extents of one [m, k] x [n, k]^T product. Weight rows are n rows of k / 32 blocks.
struct Operands {
  const uint8_t* weight;
  const float* input;
  float* output;
  size_t m, n, k;
  size_t row_bytes;  // bytes of one weight row
  // The mat-vec's output rows: output_rows[r] when set (rows gathered from anywhere, as the
  // expert-ID grouped route's are), else output + r * n.
  float* const* output_rows = nullptr;

  const uint8_t* weight_row(size_t col) const { return weight + col * row_bytes; }
  const float* input_row(size_t row) const { return input + row * k; }
  float* output_row(size_t row) const {
    return output_rows != nullptr ? output_rows[row] : output + row * n;
  }
};

// ---- Micro-kernels ------------------------------------------------------------------------------
//
// Three implementations of the same primitives, selected once per launch (isa.h): PortableIsa
// (plain loops, any target), Avx2Isa (x86-64 AVX2 + FMA + F16C, 16 vector registers) and Avx512Isa
// (AVX-512 F/BW/VL/DQ: 32 registers, so larger register tiles, and table-lookup dequantisation).
// Every one follows the contract exactly; they differ in tile sizes, never in the order of any
// output's operations.
//
//   dequant_block(block, out)          out[0..32) = the block's exact values
//   mv_columns<R, C>(ops, col, out)    out rows 0..R, columns col..col+C, over the full K,
//                                      dequantising each block in registers
//   mm_tile<R, C>(x, ldx, w, ldw, depth, acc, acc_stride)
//                                      acc[r][c][lane] += positions [0, depth) (a multiple of 8)
//                                      for R input rows x C panel columns
//   mv_columns_for_rows<R>()           C for an R-row mat-vec pass: enough independent
//                                      accumulator chains (R * C) to hide FMA latency, few
//                                      enough to stay in registers next to the dequantised block
//   mv_chunked<R>() (optional)         true where R rows run mv_range_chunked<R>(ops, col0,
//                                      col_end, out_rows) instead of mv_columns passes
//   kTileRows, kTileCols               the matrix routes' register tile (kTileRows x kTileCols
//                                      eight-lane accumulators)

template <class Format>
struct PortableIsa {
  static constexpr size_t kTileRows = 4;
  static constexpr size_t kTileCols = 3;

  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R <= 2 ? 4 : R <= 4 ? 2 : 1;
  }

  static void dequant_block(const uint8_t* block, float* out) { Format::dequant(block, out); }

  template <size_t R, size_t C>
  static void mv_columns(const Operands& ops, size_t col, float* const* out_rows,
                         size_t stride = 1) {
    float acc[R][C][kLanes] = {};
    float w[kQK];
    ScalesOf<Format> scales[C];
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
      for (size_t c = 0; c < C; ++c) {
        const uint8_t* row = ops.weight_row(col + c * stride);
        load_scales_at<Format>(row, b, scales[c]);
        dequant_at<Format>(row, b, scales[c], w);
        for (size_t r = 0; r < R; ++r) {
          const float* x = ops.input_row(r) + b * kQK;
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            for (size_t l = 0; l < kLanes; ++l) {
              acc[r][c][l] = std::fma(w[s * kLanes + l], x[s * kLanes + l], acc[r][c][l]);
            }
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c * stride] = simd::reduce_lanes(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw, size_t depth,
                      float* acc, size_t acc_stride) {
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) {
        float a[kLanes];
        float* dst = acc + r * acc_stride + c * kLanes;
        std::copy(dst, dst + kLanes, a);
        for (size_t i = 0; i < depth; i += kLanes) {
          for (size_t l = 0; l < kLanes; ++l) {
            a[l] = std::fma(w[c * ldw + i + l], x[r * ldx + i + l], a[l]);
          }
        }
        std::copy(a, a + kLanes, dst);
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
template <class Format>
struct Avx2Isa {
  // 12 of the 16 registers hold accumulators.
  static constexpr size_t kTileRows = 4;
  static constexpr size_t kTileCols = 3;

  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R == 1 ? 8 : R <= 2 ? 4 : R <= 4 ? 2 : 1;
  }

  ROUTEMM_CPU_AVX2 static void dequant_block(const uint8_t* block, float* out) {
    __m256 v[kLanesPerBlock];
    Format::dequant_avx2(block, v);
    // Stored straight from the registers (see Avx512Isa::keep_in_register).
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      asm("" : "+x"(v[s]));
      _mm256_storeu_ps(out + s * kLanes, v[s]);
    }
  }

  ROUTEMM_CPU_AVX2 static float reduce(__m256 v) { return simd::reduce_lanes(v); }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mv_columns(const Operands& ops, size_t col, float* const* out_rows,
                                          size_t stride = 1) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c * stride);
    ScalesOf<Format> scales[C];
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        __m256 w[kLanesPerBlock];
        load_scales_avx2_at<Format>(rows[c], b, scales[c]);
        // Three or four rows: 8 accumulators and the block take 12 registers.
        if constexpr (R >= 3 && requires { Format::dequant_avx2_lean(nullptr, w); }) {
          Format::dequant_avx2_lean(rows[c] + b * Format::kBytes, w);
        } else {
          dequant_avx2_at<Format>(rows[c], b, scales[c], w);
        }
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const float* x = ops.input_row(r) + b * kQK;
#pragma GCC unroll 4
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            acc[r][c] = _mm256_fmadd_ps(w[s], _mm256_loadu_ps(x + s * kLanes), acc[r][c]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c * stride] = reduce(acc[r][c]);
    }
  }

  // R rows run over K in chunks (mv_range_chunked) rather than column by column.
  template <size_t R>
  static constexpr bool mv_chunked() {
    return R > 4;
  }

  // Columns [col0, col_end) of R (5 to 8) rows. Sixteen registers hold one column's R
  // accumulators next to its dequantised block, so a pass takes one column, and reading the R
  // rows' activations (1 KiB a block) column after column would stream them from L2 for every
  // column. Instead the range runs over K in chunks of kChunkBlocks blocks, whose activations stay
  // in L1 while every column of the range takes the chunk; the accumulators wait in L1 between
  // chunks. Each accumulator still takes its steps in increasing i. The chunk's activations are
  // copied to a small buffer first: rows K floats apart are often a multiple of 4 KiB apart, and
  // then all R rows of a chunk fall into the same L1 sets and evict each other (and the weights).
  template <size_t R>
  ROUTEMM_CPU_AVX2 static void mv_range_chunked(const Operands& ops, size_t col0, size_t col_end,
                                                float* const* out_rows) {
    constexpr size_t kChunkBlocks = 8, kMaxCols = 64;
    // Bytes of a chunk of one row (K-quants: whole super-blocks, so each chunk's scales start
    // fresh).
    constexpr size_t kChunkBytes = [] {
      if constexpr (SuperBlockFormat<Format>) {
        static_assert(kChunkBlocks % Format::kSubBlocks == 0);
        return kChunkBlocks / Format::kSubBlocks * Format::kSuperBytes;
      } else {
        return kChunkBlocks * Format::kBytes;
      }
    }();
    const size_t blocks = ops.k / kQK;
    const float* x[R];
    for (size_t r = 0; r < R; ++r) x[r] = ops.input_row(r);
    alignas(32) __m256 acc[kMaxCols][R];
    // 64 bytes of padding per row: consecutive rows start in different L1 sets.
    constexpr size_t kChunkStride = kChunkBlocks * kQK + 16;
    alignas(64) float chunk[R][kChunkStride];
    for (size_t c0 = col0; c0 < col_end; c0 += kMaxCols) {
      const size_t cols = std::min(kMaxCols, col_end - c0);
      for (size_t c = 0; c < cols; ++c)
        for (size_t r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
      for (size_t b0 = 0; b0 < blocks; b0 += kChunkBlocks) {
        const size_t b1 = std::min(blocks, b0 + kChunkBlocks);
        for (size_t r = 0; r < R; ++r) {
          std::memcpy(chunk[r], x[r] + b0 * kQK, (b1 - b0) * kQK * sizeof(float));
        }
        for (size_t c = 0; c < cols; ++c) {
          const uint8_t* row = ops.weight_row(c0 + c);
          // The next chunk of this row, which the prefetchers do not predict from a stride.
          if (b1 < blocks) {
            const uint8_t* next = block_address<Format>(row, b1);
            for (size_t off = 0; off < kChunkBytes; off += 64) __builtin_prefetch(next + off);
          }
          __m256 a[R];
#pragma GCC unroll 8
          for (size_t r = 0; r < R; ++r) a[r] = acc[c][r];
          ScalesOf<Format> scales;
          for (size_t b = b0; b < b1; ++b) {
            __m256 w[kLanesPerBlock];
            load_scales_avx2_at<Format>(row, b, scales);
            dequant_avx2_at<Format>(row, b, scales, w);
#pragma GCC unroll 4
            for (size_t s = 0; s < kLanesPerBlock; ++s) {
#pragma GCC unroll 8
              for (size_t r = 0; r < R; ++r) {
                const float* xv = chunk[r] + (b - b0) * kQK + s * kLanes;
                a[r] = _mm256_fmadd_ps(w[s], _mm256_load_ps(xv), a[r]);
              }
            }
          }
#pragma GCC unroll 8
          for (size_t r = 0; r < R; ++r) acc[c][r] = a[r];
        }
      }
      for (size_t c = 0; c < cols; ++c)
        for (size_t r = 0; r < R; ++r) out_rows[r][c0 + c] = reduce(acc[c][r]);
    }
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw,
                                       size_t depth, float* acc, size_t acc_stride) {
    __m256 a[R][C];
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    for (size_t i = 0; i < depth; i += kLanes) {
      __m256 wv[C];
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + i);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 4
        for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
      }
    }
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX512
// The AVX2 algorithm with the AVX-512 register file: eight-lane (ymm) accumulators still, since
// a lane's steps are serial, but 32 registers, so larger register tiles; blocks are dequantised
// by table lookups (vpermt2ps) instead of conversions and multiplies.
template <class Format>
struct Avx512Isa {
  // 24 of the 32 registers hold accumulators.
  static constexpr size_t kTileRows = 4;
  static constexpr size_t kTileCols = 6;

  // One row: eight columns, each dequantised and consumed in turn. More rows: the columns of a
  // block are dequantised first and every activation load serves all of them.
  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R == 1 ? 8 : R <= 3 ? 4 : R == 4 ? 3 : 2;
  }

  // Pins a vector to a register where the compiler would otherwise pick a worse form: folding
  // an activation load into each FMA that uses it (one load per FMA would make the loads, not
  // the FMAs, the limit), or copying a block's values through the stack.
  ROUTEMM_CPU_AVX512 static void keep_in_register(__m256& v) { asm("" : "+v"(v)); }

  ROUTEMM_CPU_AVX512 static void dequant_block(const uint8_t* block, float* out) {
    __m256 v[kLanesPerBlock];
    Format::dequant_avx512(block, v);
    // Stored straight from the registers (GCC otherwise copies them through the stack as two
    // 64-byte loads of four 32-byte stores, a store-forwarding stall per block).
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      keep_in_register(v[s]);
      _mm256_storeu_ps(out + s * kLanes, v[s]);
    }
  }

  ROUTEMM_CPU_AVX512 static float reduce(__m256 v) { return simd::reduce_lanes(v); }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX512 static void mv_columns(const Operands& ops, size_t col, float* const* out_rows,
                                            size_t stride = 1) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c * stride);
    ScalesOf<Format> scales[C];
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
      if constexpr (R == 1) {
        const float* x = ops.input_row(0) + b * kQK;
#pragma GCC unroll 8
        for (size_t c = 0; c < C; ++c) {
          __m256 w[kLanesPerBlock];
          load_scales_avx2_at<Format>(rows[c], b, scales[c]);
          dequant_avx512_at<Format>(rows[c], b, scales[c], w);
#pragma GCC unroll 4
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            acc[0][c] = _mm256_fmadd_ps(w[s], _mm256_loadu_ps(x + s * kLanes), acc[0][c]);
          }
        }
      } else {
        __m256 w[C][kLanesPerBlock];
#pragma GCC unroll 8
        for (size_t c = 0; c < C; ++c) {
          load_scales_avx2_at<Format>(rows[c], b, scales[c]);
          dequant_avx512_at<Format>(rows[c], b, scales[c], w[c]);
        }
#pragma GCC unroll 4
        for (size_t s = 0; s < kLanesPerBlock; ++s) {
#pragma GCC unroll 8
          for (size_t r = 0; r < R; ++r) {
            __m256 xv = _mm256_loadu_ps(ops.input_row(r) + b * kQK + s * kLanes);
            keep_in_register(xv);
#pragma GCC unroll 8
            for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(w[c][s], xv, acc[r][c]);
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c * stride] = reduce(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX512 static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw,
                                         size_t depth, float* acc, size_t acc_stride) {
    __m256 a[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    for (size_t i = 0; i < depth; i += kLanes) {
      __m256 wv[C];
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + i);
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 8
        for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
      }
    }
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_NEON
// aarch64 clone, defined in neon_block_kernels.h (included at the end of this file).
template <class Format>
struct NeonIsa;
#endif

// ---- Mat-vec ------------------------------------------------------------------------------------

// Output columns per work item: enough to amortise an item, small enough that a 4096-wide decode
// step still spreads over every thread.
constexpr size_t kMvChunk = 64;
// Rows one mat-vec pass computes together (the mat-vec pipeline's M <= 8 regime).
constexpr size_t kMaxMvRows = 8;

// Whether Isa runs R-row mat-vecs as mv_range_chunked (false where it does not say).
template <class Isa, size_t R>
constexpr bool mv_chunked() {
  if constexpr (requires { Isa::template mv_chunked<R>(); }) {
    return Isa::template mv_chunked<R>();
  } else {
    return false;
  }
}

// Columns [col0, col_end) of ops.m (<= 8) rows, written to ops.output_row(r).
template <class Isa, size_t R>
void mv_range(const Operands& ops, size_t col0, size_t col_end) {
  constexpr size_t C = Isa::template mv_columns_for_rows<R>();
  float* out_rows[R];
  for (size_t r = 0; r < R; ++r) out_rows[r] = ops.output_row(r);
  if constexpr (mv_chunked<Isa, R>()) {
    Isa::template mv_range_chunked<R>(ops, col0, col_end, out_rows);
    return;
  }
  // Each pass takes column j of C equal segments of the range, so the C weight streams each walk
  // their segment's rows back to back (long sequential reads) instead of C neighbouring rows that
  // end together; every output's operations are the same either way.
  const size_t seg = (col_end - col0) / C;
  for (size_t j = 0; j < seg; ++j) Isa::template mv_columns<R, C>(ops, col0 + j, out_rows, seg);
  for (size_t col = col0 + seg * C; col < col_end; ++col) {
    Isa::template mv_columns<R, 1>(ops, col, out_rows);
  }
}

using MvRange = void (*)(const Operands&, size_t, size_t);

template <class Isa>
MvRange mv_range_for_rows(size_t rows) {
  switch (rows) {
    case 1: return mv_range<Isa, 1>;
    case 2: return mv_range<Isa, 2>;
    case 3: return mv_range<Isa, 3>;
    case 4: return mv_range<Isa, 4>;
    case 5: return mv_range<Isa, 5>;
    case 6: return mv_range<Isa, 6>;
    case 7: return mv_range<Isa, 7>;
    default: return mv_range<Isa, 8>;
  }
}

// The mat-vec implementation of `Format` for `rows` (<= 8) input rows that this process runs
// (the fastest the CPU has, capped by ROUTEMM_CPU_ISA).
template <class Format>
MvRange mv_range_for(size_t rows) {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512()) return mv_range_for_rows<Avx512Isa<Format>>(rows);
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return mv_range_for_rows<Avx2Isa<Format>>(rows);
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon()) return mv_range_for_rows<NeonIsa<Format>>(rows);
#endif
  return mv_range_for_rows<PortableIsa<Format>>(rows);
}

// ---- Matrix tiles -------------------------------------------------------------------------------

// Inner positions per panel: each micro-kernel call runs 32 FMA steps per accumulator load, and a
// register tile's weight columns (6 KiB) and a token tile's activation panel stay near the core.
constexpr size_t kPanelDepth = 256;
static_assert(kPanelDepth % kQK == 0);
constexpr size_t kMmOutputTile = 64;  // outputs per matrix tile
// Panel columns: the output tile rounded up to whole register tiles of every implementation.
constexpr size_t kPanelCols = 66;
static_assert(kPanelCols >= kMmOutputTile && kPanelCols % 3 == 0 && kPanelCols % 6 == 0);
// Floats between consecutive rows of a packed activation panel: 64 bytes more than the panel, so
// the rows of a panel do not all fall into the same L1 sets (an unpacked row stride of K floats
// is often a multiple of 4 KiB, and then they do).
constexpr size_t kPackedRowStride = kPanelDepth + 16;

// Activation rows packed for the matrix tiles, once per call (or per gathered group): panel p
// (positions [p * kPanelDepth, min(k, (p + 1) * kPanelDepth))) of row r is contiguous at
// panel_row(p, r), so a tile's rows of one panel are one dense block.
struct PackedRows {
  float* data;
  size_t rows;  // rows in the packing

  static size_t panels(size_t k) { return (k + kPanelDepth - 1) / kPanelDepth; }
  // Floats a packing of `rows` rows of width k needs (the caller checks the product for
  // overflow against its own, already validated, activation extent: it is at most
  // rows * k * (1 + 16 / kPanelDepth) + rows * kPackedRowStride).
  static size_t floats(size_t rows, size_t k) { return panels(k) * rows * kPackedRowStride; }

  float* panel_row(size_t panel, size_t row) const {
    return data + (panel * rows + row) * kPackedRowStride;
  }
  // Copies row `row` (k floats at src) into the packing.
  void pack(size_t row, const float* src, size_t k) const {
    for (size_t p = 0, k0 = 0; k0 < k; ++p, k0 += kPanelDepth) {
      std::memcpy(panel_row(p, row), src + k0, std::min(kPanelDepth, k - k0) * sizeof(float));
    }
  }
};

struct MmScratch {
  std::vector<float> panel, acc;
};
inline MmScratch& mm_scratch() {
  thread_local MmScratch scratch;
  return scratch;
}

template <class Isa, size_t R = Isa::kTileRows>
void mm_tile_rows(size_t rows, const float* x, size_t ldx, const float* w, size_t ldw, size_t depth,
                  float* acc, size_t acc_stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      mm_tile_rows<Isa, R - 1>(rows, x, ldx, w, ldw, depth, acc, acc_stride);
      return;
    }
  }
  Isa::template mm_tile<R, Isa::kTileCols>(x, ldx, w, ldw, depth, acc, acc_stride);
}

// One matrix tile: packed rows [row0, row0 + rows) of x x outputs [col0, col0 + cols <= 64) of
// the weights in ops, written to out_rows[r][col0 + c]. Dequantises a 64 x kPanelDepth weight
// panel into thread-local scratch once for all the rows and runs the register-blocked
// micro-kernel over it, weight columns outside, rows inside.
template <class Isa, class Format>
void mm_item(const Operands& ops, const PackedRows& x, size_t row0, size_t rows, size_t col0,
             size_t cols, float* const* out_rows) {
  constexpr size_t kTileRows = Isa::kTileRows, kTileCols = Isa::kTileCols;
  static_assert(kPanelCols % kTileCols == 0);
  MmScratch& s = mm_scratch();
  const size_t acc_stride = kPanelCols * kLanes;
  s.panel.resize(kPanelCols * kPanelDepth);
  s.acc.resize(std::max(s.acc.size(), rows * acc_stride));
  float* panel = s.panel.data();
  float* acc = s.acc.data();
  std::fill(acc, acc + rows * acc_stride, 0.0f);
  const size_t cols_pad = (cols + kTileCols - 1) / kTileCols * kTileCols;

  for (size_t p = 0, k0 = 0; k0 < ops.k; ++p, k0 += kPanelDepth) {
    const size_t depth = std::min(kPanelDepth, ops.k - k0);
    // Dequantise the panel; padded columns are zero weights whose results are never stored.
    for (size_t c = 0; c < cols; ++c) {
      const uint8_t* blocks = ops.weight_row(col0 + c) + k0 / kQK * Format::kBytes;
      for (size_t b = 0; b < depth / kQK; ++b) {
        Isa::dequant_block(blocks + b * Format::kBytes, panel + c * kPanelDepth + b * kQK);
      }
    }
    for (size_t c = cols; c < cols_pad; ++c) {
      std::fill(panel + c * kPanelDepth, panel + c * kPanelDepth + depth, 0.0f);
    }
    // Ask for the next panel's weight bytes now: one short segment of every weight row, which
    // the hardware prefetchers do not predict, arrives while this panel's FMAs run.
    if (k0 + kPanelDepth < ops.k) {
      const size_t next_bytes =
          std::min(kPanelDepth, ops.k - k0 - kPanelDepth) / kQK * Format::kBytes;
      for (size_t c = 0; c < cols; ++c) {
        const uint8_t* next = ops.weight_row(col0 + c) + (k0 + kPanelDepth) / kQK * Format::kBytes;
        for (size_t off = 0; off < next_bytes; off += 64) __builtin_prefetch(next + off);
      }
    }
    const float* x_panel = x.panel_row(p, row0);
    for (size_t c = 0; c < cols_pad; c += kTileCols) {
      for (size_t r = 0; r < rows; r += kTileRows) {
        mm_tile_rows<Isa>(std::min(kTileRows, rows - r), x_panel + r * kPackedRowStride,
                          kPackedRowStride, panel + c * kPanelDepth, kPanelDepth, depth,
                          acc + r * acc_stride + c * kLanes, acc_stride);
      }
    }
  }
  for (size_t r = 0; r < rows; ++r) {
    float* out = out_rows[r] + col0;
    for (size_t c = 0; c < cols; ++c)
      out[c] = simd::reduce_lanes(acc + r * acc_stride + c * kLanes);
  }
}

using MmItem = void (*)(const Operands&, const PackedRows&, size_t, size_t, size_t, size_t,
                        float* const*);

// The matrix-tile implementation of `Format` that this process runs.
template <class Format>
MmItem mm_item_for() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512()) return mm_item<Avx512Isa<Format>, Format>;
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return mm_item<Avx2Isa<Format>, Format>;
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon()) return mm_item<NeonIsa<Format>, Format>;
#endif
  return mm_item<PortableIsa<Format>, Format>;
}

}  // namespace routemm::cpu::ggml

#if ROUTEMM_CPU_HAVE_NEON
#include "neon_block_kernels.h"
#endif
