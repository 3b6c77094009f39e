// Device-side GGML block formats for the exact quantised kernels, one trait per format (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K), read straight from the raw GGUF bytes. Every
// value is the F32 that ggml's to_float (routemm/ggml_formats.h's dequantiser) gives, bit for bit:
// each trait does that dequantiser's F32 operations in the same order with explicitly rounded
// intrinsics (no contraction into fused multiply-adds), codes become floats exactly.
//
// Trait contract:
//   kName             the format's name ("q4_k"), as the pipelines spell it
//   kBytes, kValues   bytes and values per block: 32 values, or 256 for the K-quants (a super-block
//                     of eight 32-value sub-blocks, each with its own scale and, Q4_K / Q5_K, min)
//   (Q4_0 and Q8_0 read their scale as one 2-byte load: the front door keeps their blocks 2-byte
//   aligned. The other formats' blocks may start at any byte: value() reads its fields bytewise,
//   codes16() and the K-quants' lowp() read 16 bytes at a time, as wide as the address allows.)
//   Scale             what one 32-value sub-block's values need besides their codes
//   scale(block, sub)        sub-block sub's Scale (sub < kValues / 32)
//   value(block, sc, sub, l) value sub * 32 + l of the block (l < 32), sc = scale(block, sub)
// and, for the tensor-core route (all but Q4_0 / Q8_0, which have their own tiles):
//   kCodeBias                the code's offset: the value's integer is code - kCodeBias
//   code(block, sc, sub, l)  value l's unsigned code (< 64), so the integer is exact in f16
//   codes16(block, sub, h)   the codes of values 16h .. 16h + 15 of sub-block sub, byte j of the
//                            result (word j / 4, bits 8 (j % 4)..) being code(.., 16h + j): the
//                            same codes from whole-word reads, decoded four at a time
//   lowp(block, sub)         LowpScale {lo, hi, m}: value l is (l < 16 ? lo : hi) * integer + m
//                            but for value()'s roundings (see quantized_matmul_id.cu's
//                            GgmlFormatTiles)
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "backend/common/q4_0_block.h"
#include "routemm/ggml_formats.h"

namespace routemm::cuda::ggml {

__device__ __forceinline__ float block_scale(const uint8_t* block) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(block)));
}

// The F32 value of u - kBias for integers u, kBias < 2^23: u goes into the low mantissa bits of
// 2^23, making the float 2^23 + u, and subtracting 2^23 + kBias (both integers below 2^24, so
// exactly) leaves u - kBias, +0.0 when equal, as a conversion gives it. One logic operation and
// one add instead of an integer-to-float conversion, which issues at a quarter of the FMA rate and
// bound the direct kernel at m = 8 (one conversion per weight).
template <uint32_t kBias>
__device__ __forceinline__ float code_value(uint32_t u) {
  return __fsub_rn(__uint_as_float(0x4B000000u | u), 8388608.0f + static_cast<float>(kBias));
}

// A little-endian binary16 at any byte address, widened to F32 (exact).
__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}

// A little-endian 32-bit word at any byte address.
__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

// 16 bytes from p .. p + 15 at any address, as four little-endian words, read as wide as the
// address allows: one 16-byte load (16-byte aligned), four 4-byte loads (4-byte aligned), eight
// 2-byte loads (even), or at an odd address a byte, seven 2-byte loads and a byte. Never reads a
// byte outside [p, p + 16). The GGML formats' blocks may start at any byte (MXFP4's are 17 bytes,
// Q6_K's 210), and reading their codes bytewise issued 16 to 32 loads per half-row.
__device__ __forceinline__ uint4 bytes16_at(const uint8_t* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if ((address & 15u) == 0) return __ldg(reinterpret_cast<const uint4*>(p));
  if ((address & 3u) == 0) {
    const auto* w = reinterpret_cast<const unsigned int*>(p);
    return make_uint4(__ldg(w), __ldg(w + 1), __ldg(w + 2), __ldg(w + 3));
  }
  if ((address & 1u) == 0) {
    const auto* h = reinterpret_cast<const unsigned short*>(p);
    uint32_t v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __ldg(h + i);
    return make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16),
                      v[6] | (v[7] << 16));
  }
  // Odd: byte 0, the pairs (1, 2) .. (13, 14) at even addresses, byte 15.
  const auto* h = reinterpret_cast<const unsigned short*>(p + 1);
  uint32_t v[7];
#pragma unroll
  for (int i = 0; i < 7; ++i) v[i] = __ldg(h + i);
  const uint32_t first = __ldg(p), last = __ldg(p + 15);
  return make_uint4(first | (v[0] << 8) | (v[1] << 24), (v[1] >> 8) | (v[2] << 8) | (v[3] << 24),
                    (v[3] >> 8) | (v[4] << 8) | (v[5] << 24),
                    (v[5] >> 8) | (v[6] << 8) | (last << 24));
}

// A little-endian 32-bit word at any address, as wide as the address allows (Q5_0 / Q5_1's qh).
__device__ __forceinline__ uint32_t word_at(const uint8_t* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if ((address & 3u) == 0) return __ldg(reinterpret_cast<const unsigned int*>(p));
  if ((address & 1u) == 0) {
    const auto* h = reinterpret_cast<const unsigned short*>(p);
    return uint32_t{__ldg(h)} | (uint32_t{__ldg(h + 1)} << 16);
  }
  return u32_at(p);
}

// Byte i (< 16, any index) of four little-endian words.
__device__ __forceinline__ uint32_t byte_of(const uint4& v, uint32_t i) {
  const uint32_t word = i < 8 ? (i < 4 ? v.x : v.y) : (i < 12 ? v.z : v.w);
  return (word >> (8 * (i & 3u))) & 0xFFu;
}

// (v >> shift) & mask in each word: four bytes at a time, `mask` repeated per byte.
__device__ __forceinline__ uint4 bytes_shift_mask(const uint4& v, uint32_t shift, uint32_t mask) {
  return make_uint4((v.x >> shift) & mask, (v.y >> shift) & mask, (v.z >> shift) & mask,
                    (v.w >> shift) & mask);
}

// v << shift in each word, for bytes whose shifted bits stay in their byte.
__device__ __forceinline__ uint4 bytes_shl(const uint4& v, uint32_t shift) {
  return make_uint4(v.x << shift, v.y << shift, v.z << shift, v.w << shift);
}

__device__ __forceinline__ uint4 bytes_or(const uint4& a, const uint4& b) {
  return make_uint4(a.x | b.x, a.y | b.y, a.z | b.z, a.w | b.w);
}

// The nibbles of 16 bytes: the low ones (high = false) or the high ones.
__device__ __forceinline__ uint4 nibbles16(const uint4& bytes, bool high) {
  return bytes_shift_mask(bytes, high ? 4u : 0u, 0x0F0F0F0Fu);
}

// Bits 0..15 of `bits` as bit 4 of bytes 0..15 (Q5_0 / Q5_1's fifth bit). Multiplying four bits
// by 1 + 2^7 + 2^14 + 2^21 puts bit j at bit 8j (the other copies land on bits the mask drops,
// and no two overlap, so nothing carries).
__device__ __forceinline__ uint4 high_bits16(uint32_t bits) {
  auto spread = [](uint32_t four) { return ((four * 0x00204081u) & 0x01010101u) << 4; };
  return make_uint4(spread(bits & 15u), spread((bits >> 4) & 15u), spread((bits >> 8) & 15u),
                    spread((bits >> 12) & 15u));
}

// The low (l < 16) or high (l >= 16) nibble of qs[l % 16]: value l of a 32-value nibble block.
__device__ __forceinline__ uint32_t nibble(const uint8_t* qs, uint32_t l) {
  const uint32_t byte = qs[l & 15u];
  return l < 16 ? (byte & 0x0fu) : (byte >> 4);
}

struct Q4_0Blocks {
  static constexpr const char* kName = "q4_0";
  static constexpr uint32_t kBytes = kernels::kQ4_0BlockBytes;
  static constexpr uint32_t kValues = 32;
  using Scale = float;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    return block_scale(block);
  }
  // d * (q - 8), q the nibble (code_value: exact).
  static __device__ __forceinline__ float value(const uint8_t* block, float d, uint32_t,
                                                uint32_t l) {
    return __fmul_rn(d, code_value<8>(nibble(block + 2, l)));
  }
};

// The exact F32 value of the signed byte `byte` (0..3) of `word`, given `flipped` = word ^
// 0x80808080 (computed once per word): flipping the sign bit makes the byte u = q + 128, unsigned;
// placed in the low mantissa bits of 2^23 it is the float 2^23 + u, and subtracting 2^23 + 128
// (both integers below 2^24, so the difference is exact) leaves q. A byte permute and one add,
// cheaper than a conversion instruction.
__device__ __forceinline__ float int8_value(uint32_t flipped, uint32_t byte) {
  const float biased = __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7650u | byte));
  return __fsub_rn(biased, 8388736.0f);  // 2^23 + 128
}

struct Q8_0Blocks {
  static constexpr const char* kName = "q8_0";
  static constexpr uint32_t kBytes = kernels::kQ8_0BlockBytes;
  static constexpr uint32_t kValues = 32;
  using Scale = float;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    return block_scale(block);
  }
  static __device__ __forceinline__ float value(const uint8_t* block, float d, uint32_t,
                                                uint32_t l) {
    return __fmul_rn(d, int8_value(block[2 + l] ^ 0x80u, 0));
  }
};

// A scale and a min: Q4_1 / Q5_1 (y = q * d + m) and the K-quants Q4_K / Q5_K (y = d1 * q - m1).
struct ScaleMin {
  float d, m;
};

// The tensor-core route's view of a 32-value sub-block: value l is (l < 16 ? lo : hi) * (code -
// kCodeBias) + m, up to the roundings of the F32 dequantiser.
struct LowpScale {
  float lo, hi, m;
};

// Q4_1: d, m (binary16), 16 bytes of nibbles; y = q * d + m.
struct Q4_1Blocks {
  static constexpr const char* kName = "q4_1";
  static constexpr uint32_t kBytes = 20;
  static constexpr uint32_t kValues = 32;
  using Scale = ScaleMin;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    return {half_at(block), half_at(block + 2)};
  }
  static constexpr uint32_t kCodeBias = 0;
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale, uint32_t,
                                                  uint32_t l) {
    return nibble(block + 4, l);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t, uint32_t h) {
    return nibbles16(bytes16_at(block + 4), h != 0);
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fadd_rn(__fmul_rn(code_value<0>(code(block, s, sub, l)), s.d), s.m);
  }
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t sub) {
    const Scale s = scale(block, sub);
    return {s.d, s.d, s.m};
  }
};

// Q5_0 / Q5_1: the fifth bit of value l is bit l of the 32-bit qh (read once per block, with the
// scale).
struct Q5Scale {
  float d, m;
  uint32_t qh;
};

// Q5_0: d, qh, 16 bytes of low nibbles; y = (q - 16) * d.
struct Q5_0Blocks {
  static constexpr const char* kName = "q5_0";
  static constexpr uint32_t kBytes = 22;
  static constexpr uint32_t kValues = 32;
  using Scale = Q5Scale;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    return {half_at(block), 0.0f, u32_at(block + 2)};
  }
  static constexpr uint32_t kCodeBias = 16;
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale s, uint32_t,
                                                  uint32_t l) {
    return nibble(block + 6, l) | (((s.qh >> l) & 1u) << 4);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t, uint32_t h) {
    return bytes_or(nibbles16(bytes16_at(block + 6), h != 0),
                    high_bits16(word_at(block + 2) >> (16 * h)));
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fmul_rn(code_value<16>(code(block, s, sub, l)), s.d);
  }
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t) {
    const float d = half_at(block);
    return {d, d, 0.0f};
  }
};

// Q5_1: d, m, qh, 16 bytes of low nibbles; y = q * d + m.
struct Q5_1Blocks {
  static constexpr const char* kName = "q5_1";
  static constexpr uint32_t kBytes = 24;
  static constexpr uint32_t kValues = 32;
  using Scale = Q5Scale;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    return {half_at(block), half_at(block + 2), u32_at(block + 4)};
  }
  static constexpr uint32_t kCodeBias = 0;
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale s, uint32_t,
                                                  uint32_t l) {
    return nibble(block + 8, l) | (((s.qh >> l) & 1u) << 4);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t, uint32_t h) {
    return bytes_or(nibbles16(bytes16_at(block + 8), h != 0),
                    high_bits16(word_at(block + 4) >> (16 * h)));
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fadd_rn(__fmul_rn(code_value<0>(code(block, s, sub, l)), s.d), s.m);
  }
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t) {
    const float d = half_at(block);
    return {d, d, half_at(block + 2)};
  }
};

// MXFP4: an E8M0 exponent e, 16 bytes of E2M1 codes. ggml doubles the E2M1 values (integers 0, 1,
// 2, 3, 4, 6, 8, 12 and their negatives; code 8, "-0", is +0) and halves the scale: 2^(e - 128),
// subnormal for e < 2.
struct Mxfp4Blocks {
  static constexpr const char* kName = "mxfp4";
  static constexpr uint32_t kBytes = 17;
  static constexpr uint32_t kValues = 32;
  using Scale = float;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t) {
    const uint32_t e = block[0];
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
  }
  static constexpr uint32_t kCodeBias = 16;
  // The doubled E2M1 value plus 16: the magnitude's byte of {0, 1, 2, 3, 4, 6, 8, 12}, then 16 +-
  // it.
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, float, uint32_t,
                                                  uint32_t l) {
    const uint32_t fp4 = nibble(block + 1, l);
    const uint32_t mag = __byte_perm(0x03020100u, 0x0C080604u, fp4 & 7u) & 0xffu;
    return fp4 & 8u ? 16u - mag : 16u + mag;
  }
  // Four codes per word: the low three bits of each E2M1 nibble, packed into a byte_perm selector,
  // pick 16 + mag and 16 - mag from two byte tables; the sign bit picks between them per byte.
  static __device__ __forceinline__ uint32_t codes4(uint32_t fp4s) {
    const uint32_t idx = fp4s & 0x07070707u;
    const uint32_t packed = idx | (idx >> 4);  // selector nibbles at bits 0-7 and 16-23
    const uint32_t sel = (packed & 0xFFu) | ((packed >> 8) & 0xFF00u);
    const uint32_t plus = __byte_perm(0x13121110u, 0x1C181614u, sel);   // 16 + {0,1,2,3,4,6,8,12}
    const uint32_t minus = __byte_perm(0x0D0E0F10u, 0x04080A0Cu, sel);  // 16 - the same
    const uint32_t negative = ((fp4s >> 3) & 0x01010101u) * 0xFFu;
    return (plus & ~negative) | (minus & negative);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t, uint32_t h) {
    const uint4 fp4 = nibbles16(bytes16_at(block + 1), h != 0);
    return make_uint4(codes4(fp4.x), codes4(fp4.y), codes4(fp4.z), codes4(fp4.w));
  }
  static __device__ __forceinline__ float value(const uint8_t* block, float d, uint32_t sub,
                                                uint32_t l) {
    return __fmul_rn(code_value<16>(code(block, d, sub, l)), d);
  }
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t sub) {
    const float d = scale(block, sub);
    return {d, d, 0.0f};
  }
};

// d1 = d * sc and m1 = dmin * m of sub-block sub, as ggml forms them, from the block at `block`
// (shared or global memory; sc, m by routemm/ggml_formats.h's scale_min_k4_of).
__device__ __forceinline__ ScaleMin k4_scale(const uint8_t* block, uint32_t sub) {
  uint32_t sc, m;
  ggml_formats::scale_min_k4_of(
      sub, [block](uint32_t i) -> uint32_t { return block[4 + i]; }, sc, m);
  return {__fmul_rn(half_at(block), code_value<0>(sc)),
          __fmul_rn(half_at(block + 2), code_value<0>(m))};
}

// The same from the block's first 16 bytes already in registers (d, dmin, the 12 scale bytes).
__device__ __forceinline__ ScaleMin k4_scale(const uint4& head, uint32_t sub) {
  uint32_t sc, m;
  ggml_formats::scale_min_k4_of(
      sub, [&head](uint32_t i) -> uint32_t { return byte_of(head, 4 + i); }, sc, m);
  const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x & 0xFFFFu)));
  const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x >> 16)));
  return {__fmul_rn(d, code_value<0>(sc)), __fmul_rn(dmin, code_value<0>(m))};
}

// Q4_K: d, dmin (binary16), 12 scale bytes, 128 bytes of nibbles: sub-blocks 2c and 2c + 1 are the
// low and high nibbles of bytes 32c .. 32c + 31; y = d1 * q - m1.
struct Q4_KBlocks {
  static constexpr const char* kName = "q4_k";
  static constexpr uint32_t kBytes = 144;
  static constexpr uint32_t kValues = 256;
  using Scale = ScaleMin;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t sub) {
    return k4_scale(block, sub);
  }
  static constexpr uint32_t kCodeBias = 0;
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale, uint32_t sub,
                                                  uint32_t l) {
    const uint32_t byte = block[16 + (sub >> 1) * 32 + l];
    return sub & 1u ? byte >> 4 : byte & 0xFu;
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t sub, uint32_t h) {
    return nibbles16(bytes16_at(block + 16 + (sub >> 1) * 32 + 16 * h), (sub & 1u) != 0);
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fsub_rn(__fmul_rn(s.d, code_value<0>(code(block, s, sub, l))), s.m);
  }
  // The header (d, dmin, scales) in one 16-byte read.
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t sub) {
    const Scale s = k4_scale(bytes16_at(block), sub);
    return {s.d, s.d, -s.m};
  }
};

// Q5_K: d, dmin, 12 scale bytes, 32 bytes of high bits (bit sub of byte l), 128 bytes of low
// nibbles laid out as Q4_K's; y = d1 * q - m1.
struct Q5_KBlocks {
  static constexpr const char* kName = "q5_k";
  static constexpr uint32_t kBytes = 176;
  static constexpr uint32_t kValues = 256;
  using Scale = ScaleMin;
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t sub) {
    return k4_scale(block, sub);
  }
  static constexpr uint32_t kCodeBias = 0;
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale, uint32_t sub,
                                                  uint32_t l) {
    const uint32_t byte = block[48 + (sub >> 1) * 32 + l];
    const uint32_t low = sub & 1u ? byte >> 4 : byte & 0xFu;
    return low | (((block[16 + l] >> sub) & 1u) << 4);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t sub, uint32_t h) {
    const uint4 low = nibbles16(bytes16_at(block + 48 + (sub >> 1) * 32 + 16 * h), (sub & 1u) != 0);
    const uint4 high = bytes_shift_mask(bytes16_at(block + 16 + 16 * h), sub, 0x01010101u);
    return bytes_or(low, bytes_shl(high, 4));
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fsub_rn(__fmul_rn(s.d, code_value<0>(code(block, s, sub, l))), s.m);
  }
  // The header (d, dmin, scales) in one 16-byte read.
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t sub) {
    const Scale s = k4_scale(bytes16_at(block), sub);
    return {s.d, s.d, -s.m};
  }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d (binary16).
// Sub-block sub = 4h + t is quarter t of half h (128 values); every 16 values have their own
// scale, so a sub-block's Scale holds two products d * sc: for l < 16 and for l >= 16.
// y = (d * sc) * q.
struct Q6Scale {
  float lo, hi;
};

struct Q6_KBlocks {
  static constexpr const char* kName = "q6_k";
  static constexpr uint32_t kBytes = 210;
  static constexpr uint32_t kValues = 256;
  using Scale = Q6Scale;
  static __device__ __forceinline__ float scale_at(const uint8_t* block, float d, uint32_t i) {
    const uint32_t u = block[192 + i] ^ 0x80u;  // the int8 scale plus 128
    return __fmul_rn(d, code_value<128>(u));
  }
  static __device__ __forceinline__ Scale scale(const uint8_t* block, uint32_t sub) {
    const float d = half_at(block + 208);
    const uint32_t h = sub >> 2, t = sub & 3u;
    return {scale_at(block, d, 8 * h + 2 * t), scale_at(block, d, 8 * h + 2 * t + 1)};
  }
  static constexpr uint32_t kCodeBias = 32;
  // ggml: quarter t of half h reads ql[64h + 32 * (t & 1) + l], its low nibble for t < 2 and its
  // high nibble for t >= 2, with bits 2t, 2t + 1 of qh[32h + l] above; q = that 6-bit code - 32.
  static __device__ __forceinline__ uint32_t code(const uint8_t* block, Scale, uint32_t sub,
                                                  uint32_t l) {
    const uint32_t h = sub >> 2, t = sub & 3u;
    const uint32_t byte = block[64 * h + 32 * (t & 1u) + l];
    const uint32_t low = t < 2 ? byte & 0xFu : byte >> 4;
    return low | (((block[128 + 32 * h + l] >> (2 * t)) & 3u) << 4);
  }
  static __device__ __forceinline__ uint4 codes16(const uint8_t* block, uint32_t sub, uint32_t h) {
    const uint32_t half = sub >> 2, t = sub & 3u;
    const uint4 low = nibbles16(bytes16_at(block + 64 * half + 32 * (t & 1u) + 16 * h), t >= 2);
    const uint4 high =
        bytes_shift_mask(bytes16_at(block + 128 + 32 * half + 16 * h), 2 * t, 0x03030303u);
    return bytes_or(low, bytes_shl(high, 4));
  }
  static __device__ __forceinline__ float value(const uint8_t* block, Scale s, uint32_t sub,
                                                uint32_t l) {
    return __fmul_rn(l < 16 ? s.lo : s.hi, code_value<32>(code(block, s, sub, l)));
  }
  static __device__ __forceinline__ LowpScale lowp(const uint8_t* block, uint32_t sub) {
    const Scale s = scale(block, sub);
    return {s.lo, s.hi, 0.0f};
  }
};

// The CPU oracle's lane contract on eight threads (lane = threadIdx % 8): lane l accumulates
// positions i = l, l + 8, ... < k with one FMA each, in increasing order, for R input rows;
// `sum8` then adds the eight lanes in the oracle's fixed tree ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)),
// so every output is bit-identical to the CPU backend's. `row` holds k / F::kValues blocks.
template <class F, int R>
__device__ __forceinline__ void lane_dot(const uint8_t* __restrict__ row, uint32_t k,
                                         const float* const (&x)[R], uint32_t lane,
                                         float (&acc)[R]) {
  for (uint32_t b = 0; b < k / F::kValues; ++b) {
    const uint8_t* block = row + size_t{b} * F::kBytes;
#pragma unroll
    for (uint32_t sub = 0; sub < F::kValues / 32; ++sub) {
      const typename F::Scale sc = F::scale(block, sub);
#pragma unroll
      for (uint32_t s = 0; s < 4; ++s) {
        const uint32_t l = s * 8 + lane;
        const float w = F::value(block, sc, sub, l);
        const uint32_t i = b * F::kValues + sub * 32 + l;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = __fmaf_rn(w, x[r][i], acc[r]);
      }
    }
  }
}

// Sum over the eight lanes of an aligned group of eight threads; every lane gets the total.
__device__ __forceinline__ float sum8(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
}

}  // namespace routemm::cuda::ggml
