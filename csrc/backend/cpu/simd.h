// Small portable helpers for the CPU kernels: exact fp16/bf16 -> f32 widening, the fixed lane
// reduction of the expert-ID matmul contract, and the multiversioning attribute.
//
// Everything here is plain scalar C++ that the compiler can vectorise; nothing depends on the
// instruction set, so every build (and every function clone) produces the same bits.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

// Forces inlining so that templated helpers are compiled inside each clone of their caller
// (and therefore with that clone's instruction set).
#if defined(__GNUC__) || defined(__clang__)
#define ROUTEMM_CPU_INLINE inline __attribute__((always_inline))
#else
#define ROUTEMM_CPU_INLINE inline
#endif

// Hot entry points get an AVX2+FMA clone next to the baseline one on x86-64 ELF targets; the
// loader picks one at startup. Both clones give identical results: the kernels only use
// operations with exactly specified rounding (fma, add, int<->float conversions).
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define ROUTEMM_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ROUTEMM_CPU_CLONES
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
  // Inf / NaN: keep the payload, saturate the exponent.
  const uint32_t special = (magnitude << 13) | 0x7f800000u;
  uint32_t bits = magnitude < 0x0400u ? subnormal : normal;
  bits = magnitude >= 0x7c00u ? special : bits;
  return std::bit_cast<float>(bits | sign);
}

// Lanes of the per-output accumulator (see the contract in dense_matmul_id.cpp).
inline constexpr size_t kLanes = 8;

// The one lane reduction every route uses: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
ROUTEMM_CPU_INLINE float reduce_lanes(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

}  // namespace routemm::cpu::simd
