// Small portable helpers for the CPU kernels: exact fp16/bf16 -> f32 widening, the fixed lane
// reduction of the expert-ID matmul contract, and the x86 AVX2 / AVX-512 and aarch64 NEON dispatch
// switches.
//
// The helpers are plain scalar C++ that the compiler can vectorise; nothing depends on the
// instruction set, so every build produces the same bits. Which clone runs is isa.h's choice.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "isa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ROUTEMM_CPU_PORTABLE_ONLY)
#include <immintrin.h>
#endif
#if ROUTEMM_CPU_HAVE_NEON
#include <arm_neon.h>
#if defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif
// The int8-dot routes' dot-product instructions (SDOT), on the CPUs that have them
// (has_neon_dotprod()).
#define ROUTEMM_CPU_NEON_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

// Forces inlining of small helpers into the hot loops.
#if defined(__GNUC__) || defined(__clang__)
#define ROUTEMM_CPU_INLINE inline __attribute__((always_inline))
#else
#define ROUTEMM_CPU_INLINE inline
#endif

// x86-64 kernels compiled for AVX2 + FMA + F16C (and AVX-512 F/BW/VL/DQ) next to the portable
// ones; callers pick one at run time with has_avx2_fma() / has_avx512(). The exact kernels give
// identical bits on every clone: they only use operations with exactly specified results (fma,
// add, exact conversions). ROUTEMM_CPU_AVX512_BF16 and ROUTEMM_CPU_AVX512_VNNI add the dot-product
// instructions of the reduced-precision bf16 and int8 routes.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ROUTEMM_CPU_PORTABLE_ONLY)
#define ROUTEMM_CPU_HAVE_AVX2 1
#define ROUTEMM_CPU_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ROUTEMM_CPU_AVX512_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define ROUTEMM_CPU_AVX512_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#else
#define ROUTEMM_CPU_HAVE_AVX2 0
#endif

namespace routemm::cpu::simd {

// Raw 16-bit storage types, so templates can tell the weight formats apart.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2);

ROUTEMM_CPU_INLINE float widen(float value) { return value; }

// bf16 is the top half of an f32: exact for every value, NaN payloads included.
ROUTEMM_CPU_INLINE float widen(BFloat16 value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value.bits) << 16);
}

// IEEE binary16 -> binary32, exact for every value. Branch-free so that it vectorises. The
// subnormal case goes through an int->float conversion and a multiply whose result is a
// normal f32, so a caller's flush-to-zero / denormals-are-zero mode cannot change it.
ROUTEMM_CPU_INLINE float widen(Half value) {
  const uint32_t h = value.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  // Normal: rebias the exponent from 15 to 127 (112 << 23).
  const uint32_t normal = (magnitude << 13) + (112u << 23);
  // Subnormal (and zero): magnitude * 2^-24.
  const uint32_t subnormal =
      std::bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(magnitude)) * 0x1p-24f);
  // Inf / NaN: saturate the exponent, keep the payload, and quiet a signalling NaN as an IEEE
  // conversion (and x86 VCVTPH2PS) does.
  const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude > 0x7c00u);
  const uint32_t special = (magnitude << 13) | 0x7f800000u | (0x00400000u & is_nan);
  // Mask selects rather than ?: so compilers keep the loop branch-free.
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(magnitude < 0x0400u);
  const uint32_t is_special = 0u - static_cast<uint32_t>(magnitude >= 0x7c00u);
  uint32_t bits = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  bits = (special & is_special) | (bits & ~is_special);
  return std::bit_cast<float>(bits | sign);
}

// dst[i] = widen(src[i]) for i < count; a plain loop that vectorises.
template <typename WT>
ROUTEMM_CPU_INLINE void widen_block(const WT* src, float* dst, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = widen(src[i]);
}

// True when the ROUTEMM_CPU_AVX2 kernels may run: the CPU (and OS) support them and ROUTEMM_CPU_ISA
// does not cap the kernels below them (isa.h).
inline bool has_avx2_fma() {
#if ROUTEMM_CPU_HAVE_AVX2
  return cpu_isa_allows(CpuIsa::avx2);
#else
  return false;
#endif
}

// True when the ROUTEMM_CPU_AVX512 kernels (isa.h) may run.
inline bool has_avx512() {
#if ROUTEMM_CPU_HAVE_AVX512
  return cpu_isa_allows(CpuIsa::avx512);
#else
  return false;
#endif
}

// AVX512_BF16 (VDPBF16PS) on top of the AVX-512 clone: the reduced-precision bf16 routes.
inline bool has_avx512_bf16() {
#if ROUTEMM_CPU_HAVE_AVX512
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported && has_avx512();
#else
  return false;
#endif
}

// AVX512_VNNI (VPDPBUSD) on top of the AVX-512 clone: the int8-dot routes' fastest clone.
inline bool has_avx512_vnni() {
#if ROUTEMM_CPU_HAVE_AVX512
  static const bool supported = __builtin_cpu_supports("avx512vnni");
  return supported && has_avx512();
#else
  return false;
#endif
}

// True when the aarch64 NEON kernels (neon_kernels.h) may run: always on aarch64 unless
// ROUTEMM_CPU_ISA=portable.
inline bool has_neon() {
#if ROUTEMM_CPU_HAVE_NEON
  return cpu_isa_allows(CpuIsa::neon);
#else
  return false;
#endif
}

// The dot-product instructions (FEAT_DotProd: SDOT) on top of the NEON clone: the int8-dot routes'
// NEON clone (neon_int8_dot.h). Linux reports them in AT_HWCAP; every Apple Silicon core has them.
inline bool has_neon_dotprod() {
#if ROUTEMM_CPU_HAVE_NEON && defined(__linux__)
  static const bool supported = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  return supported && has_neon();
#elif ROUTEMM_CPU_HAVE_NEON && defined(__APPLE__)
  return has_neon();
#else
  return false;
#endif
}

// Lanes of the per-output accumulator (see the contract in dense_matmul_id.cpp).
inline constexpr size_t kLanes = 8;

// The one lane reduction every route uses: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
ROUTEMM_CPU_INLINE float reduce_lanes(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

#if ROUTEMM_CPU_HAVE_AVX2
// The same reduction of eight lanes held in a register, operand for operand, without a round
// trip through memory: when a kernel reduced its accumulators through a stack array, GCC kept
// that array current inside the loop producing them (one store per accumulator and step).
ROUTEMM_CPU_AVX2 inline float reduce_lanes(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1))));
}
#endif

#if ROUTEMM_CPU_HAVE_NEON
// The same reduction of eight lanes held as two NEON registers (lanes 0-3 in lo, 4-7 in hi),
// operand for operand: s = lo + hi, then (s0 + s2) + (s1 + s3).
ROUTEMM_CPU_INLINE float reduce_lanes(float32x4_t lo, float32x4_t hi) {
  const float32x4_t s = vaddq_f32(lo, hi);
  const float32x2_t t = vadd_f32(vget_low_f32(s), vget_high_f32(s));
  return vget_lane_f32(t, 0) + vget_lane_f32(t, 1);
}
#endif

}  // namespace routemm::cpu::simd
