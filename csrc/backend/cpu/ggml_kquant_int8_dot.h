// CPU building blocks of the reduced-precision int8-dot routes of the K-quants (Q4_K, Q5_K and Q6_K
// weights; ggml_format_kernels.cpp): each activation row is rounded to 8-bit integers per 256-value
// super-block (the block of ggml's Q8_K), every super-block pair is an exact integer sum, and the
// super-blocks are scaled and summed in F32. The routes are opt-in, as Q4_0's and Q8_0's
// (ggml_int8_dot.h): GgmlRoutingPolicy::dense_int8_dot and the expert-ID routes direct_int8_dot /
// grouped_int8_dot.
//
// NUMERIC CONTRACT (every K-quant int8-dot pipeline and every instruction-set clone):
//   1. Activations, per row, per 256-value block: ggml_int8_dot.h's step 1 over 256 values instead
//      of 32 (a = max |x_j| on the magnitude bits; d = a / 127, r = 1 / d in binary32; q_j = x_j * r
//      rounded to binary32, then to the nearest integer, ties to even; d = 0 below 2^-100, d = NaN
//      and q = 0 for a non-finite a). |q_j| <= 127 and |x_j - d q_j| <= d (1/2 + 2^-15).
//   2. Weights as integers of the super-block: Q4_K and Q5_K value j of 32-value sub-block b is
//      d_w sc_b u_j - dmin m_b (u_j the 4- or 5-bit code, sc_b and m_b the 6-bit scale and min);
//      Q6_K value j of 16-value sub-block b is d_w sc_b (u_j - 32) (u_j the 6-bit code, sc_b the
//      int8 scale); d_w and dmin are the block's binary16 scales widened exactly.
//   3. Per super-block, exact int32 sums: Q4_K / Q5_K S = sum_b sc_b sum_{j in b} u_j q_j and
//      M = sum_b m_b sum_{j in b} q_j; Q6_K S = sum_b sc_b sum_{j in b} (u_j - 32) q_j.
//      (|S| <= 8 * 63 * 32 * 31 * 127 and 16 * 128 * 16 * 32 * 127 < 2^31.)
//   4. One F32 accumulator per output, from +0.0f, over super-blocks in increasing order:
//      Q4_K / Q5_K  acc = fma(d_x * d_w, float(S), acc); acc = fma(-(d_x * dmin), float(M), acc)
//      Q6_K         acc = fma(d_x * d_w, float(S), acc)
//      each product one binary32 multiplication, float() the round-to-nearest conversion (exact
//      below 2^24); out = acc.
// The integer sums are exact whatever the instructions (vpmaddubsw + vpmaddwd, scalar) and their
// order, and every F32 operation is fixed above, so every clone, route, work split and thread count
// gives the same bits. Error against the exact product of the dequantised weights w, per output:
//   |err| <= sum_i |w_i| d_i (1/2 + 2^-15) + gamma(2 K/256 + 3) sum_i W_i (|x_i| + d_i)
//            + 2^-100 sum_i |w_i|,  gamma(n) = n 2^-24 / (1 - n 2^-24),
// with d_i the scale of x_i's block and W_i = |d_w| sc_b u_i + |dmin| m_b (Q4_K, Q5_K) or |w_i|
// (Q6_K) the magnitude the integer sums carry (tests/python/tolerances.py: kquant_int8_dot_bound;
// the extra gamma step covers the dequantiser's own rounding of d1 * u - m1).
//
// Layout: each weight super-block is decoded once per item into Decoded (unsigned codes and the
// sub-block scales as int16), then every activation row of the item takes its sums from it. An
// item of one activation row (decode: one token per expert) skips Decoded: the AVX2 / AVX-512
// clones decode each block in registers for its one use (row_sums, row_cols8).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_int8_dot.h"
#include "routemm/ggml_formats.h"
#include "simd.h"

namespace routemm::cpu::ggml::kint8 {

constexpr size_t kQK_K = 256;           // values per super-block and per activation block
constexpr size_t kGroups = kQK_K / 16;  // 16-value groups per super-block

enum class KFormat { q4_k, q5_k, q6_k };

// One call's activation rows rounded per 256-value block (contract step 1): q (256 values per
// block), d (one scale per block) and bsums (sum of q per 16 values).
struct Rows {
  size_t blocks = 0;  // per row
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;

  void resize(size_t rows, size_t k) {
    blocks = k / kQK_K;
    q.resize(rows * blocks * kQK_K);
    d.resize(rows * blocks);
    bsums.resize(rows * blocks * kGroups);
  }
  const int8_t* q_block(size_t row, size_t b) const {
    return q.data() + (row * blocks + b) * kQK_K;
  }
  float scale(size_t row, size_t b) const { return d[row * blocks + b]; }
  const int16_t* bsum(size_t row, size_t b) const {
    return bsums.data() + (row * blocks + b) * kGroups;
  }
};

// Rounds one row of k values at x into row `row` of `out` (sized for it). Scalar: every operation
// exactly specified, so no clone is needed for the bits; the row is O(k) against the products'
// O(k n).
inline void quantize_row(const float* x, size_t k, Rows& out, size_t row) {
  for (size_t b = 0; b < k / kQK_K; ++b) {
    const float* xb = x + b * kQK_K;
    uint32_t max_bits = 0;
    for (size_t j = 0; j < kQK_K; ++j) {
      max_bits = std::max(max_bits, std::bit_cast<uint32_t>(xb[j]) & 0x7fffffffu);
    }
    float d, r;
    int8::block_scale(max_bits, d, r);
    int8_t* q = out.q.data() + (row * out.blocks + b) * kQK_K;
    int16_t* sums = out.bsums.data() + (row * out.blocks + b) * kGroups;
    for (size_t g = 0; g < kGroups; ++g) {
      int sum = 0;
      for (size_t j = g * 16; j < g * 16 + 16; ++j) {
        // r == 0: every q is 0 (a non-finite x only occurs there and never reaches the conversion).
        q[j] = r == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] * r));
        sum += q[j];
      }
      sums[g] = static_cast<int16_t>(sum);
    }
    out.d[row * out.blocks + b] = d;
  }
}

// ---- Decoded super-blocks -----------------------------------------------------------------------

// One weight super-block as the integer sums take it: codes[i] the unsigned code u_i; pair[i / 2]
// the scale of values i and i + 1 (the operand of a pairwise multiply-add); group_min[g] the
// integer the sum of q over 16-value group g is multiplied by (Q4_K / Q5_K: m_b, the second sum
// M; Q6_K: 32 sc_b, subtracted from S for the code offset); d = d_w, dmin (0 for Q6_K).
struct alignas(64) Decoded {
  uint8_t codes[kQK_K];
  int16_t pair[kQK_K / 2];
  int16_t group_min[kGroups];
  float d, dmin;
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return simd::widen(simd::Half{bits});
}

// The scales of a super-block (codes aside): pair, group_min, d, dmin.
template <KFormat F>
void decode_scales(const uint8_t* block, Decoded& out) {
  int16_t group_scale[kGroups];
  if constexpr (F == KFormat::q6_k) {
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (size_t g = 0; g < kGroups; ++g) {
      group_scale[g] = sc[g];
      out.group_min[g] = static_cast<int16_t>(32 * sc[g]);
    }
    out.d = half_to_float(block + 208);
    out.dmin = 0.0f;
  } else {
    for (size_t b = 0; b < 8; ++b) {
      uint8_t sc, m;
      ggml_formats::scale_min_k4(b, block + 4, sc, m);
      group_scale[2 * b] = group_scale[2 * b + 1] = static_cast<int16_t>(sc);
      out.group_min[2 * b] = out.group_min[2 * b + 1] = static_cast<int16_t>(m);
    }
    out.d = half_to_float(block);
    out.dmin = half_to_float(block + 2);
  }
  for (size_t i = 0; i < kQK_K / 2; ++i) out.pair[i] = group_scale[i / 8];
}

// The codes of a super-block, one value at a time (ggml's value order).
template <KFormat F>
void decode_codes_portable(const uint8_t* block, uint8_t* codes) {
  if constexpr (F == KFormat::q4_k) {
    const uint8_t* qs = block + 16;
    for (size_t c = 0; c < 4; ++c)
      for (size_t l = 0; l < 32; ++l) {
        codes[64 * c + l] = qs[32 * c + l] & 0x0f;
        codes[64 * c + 32 + l] = qs[32 * c + l] >> 4;
      }
  } else if constexpr (F == KFormat::q5_k) {
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    for (size_t c = 0; c < 4; ++c)
      for (size_t l = 0; l < 32; ++l) {
        codes[64 * c + l] = (qs[32 * c + l] & 0x0f) | (((qh[l] >> (2 * c)) & 1) << 4);
        codes[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
      }
  } else {
    for (size_t h = 0; h < 2; ++h) {
      const uint8_t* ql = block + 64 * h;
      const uint8_t* qh = block + 128 + 32 * h;
      for (size_t l = 0; l < 32; ++l) {
        uint8_t* c = codes + 128 * h + l;
        c[0] = (ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4);
        c[32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
        c[64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        c[96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    }
  }
}

// Contract step 4 for one super-block's sums (m: M, or Q6_K's code-offset term) with the weight
// block's d and dmin.
template <KFormat F>
inline float accumulate(float acc, float d, float dmin, float dx, int32_t s, int32_t m) {
  if constexpr (F == KFormat::q6_k) {
    return std::fma(dx * d, static_cast<float>(s - m), acc);
  } else {
    acc = std::fma(dx * d, static_cast<float>(s), acc);
    return std::fma(-(dx * dmin), static_cast<float>(m), acc);
  }
}

template <KFormat F>
inline float accumulate(float acc, const Decoded& w, float dx, int32_t s, int32_t m) {
  return accumulate<F>(acc, w.d, w.dmin, dx, s, m);
}

// Three clones of
//   decode(block, out)             Decoded of one super-block
//   sums(w, q, bsum, s, m)         contract step 3: s = sum_i pair[i / 2] codes[i] q[i] and
//                                  m = sum_g group_min[g] bsum[g]
// and, where kFusedRow (the AVX2 and AVX-512 clones), the one-row item's steps straight from the
// raw blocks: row_sums (one column) and row_cols8 (eight columns, step 4 included).
// Portable: plain loops. Avx2: vpmaddubsw (code times q, pairs to int16: |.| <= 2 * 63 * 127)
// then vpmaddwd with the pair scales; the 6-bit scales unpacked in 32-bit words. Avx512: the
// same sums on 64 values per instruction.
template <KFormat F>
struct KPortable {
  static constexpr bool kRows8 = false;
  static constexpr bool kFusedRow = false;
  using Vec = int;  // no eight-row step
  static void decode(const uint8_t* block, Decoded& out) {
    decode_scales<F>(block, out);
    decode_codes_portable<F>(block, out.codes);
  }
  static void sums(const Decoded& w, const int8_t* q, const int16_t* bsum, int32_t& s, int32_t& m) {
    s = 0;
    for (size_t i = 0; i < kQK_K; i += 2) {
      s += int32_t{w.pair[i / 2]} * (w.codes[i] * q[i] + w.codes[i + 1] * q[i + 1]);
    }
    m = 0;
    for (size_t g = 0; g < kGroups; ++g) m += int32_t{w.group_min[g]} * bsum[g];
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
ROUTEMM_CPU_AVX2 inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
ROUTEMM_CPU_AVX2 inline void store32(uint8_t* p, __m256i v) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(p), v);
}

// The codes of values 64c .. 64c + 31 (v0) and 64c + 32 .. 64c + 63 (v1) of a super-block, one
// per byte, decoded in registers (c < 4).
template <KFormat F>
ROUTEMM_CPU_AVX2 inline void codes64_avx2(const uint8_t* block, size_t c, __m256i& v0,
                                          __m256i& v1) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (F == KFormat::q4_k) {
    const __m256i v = load32(block + 16 + 32 * c);
    v0 = _mm256_and_si256(v, low4);
    v1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  } else if constexpr (F == KFormat::q5_k) {
    const __m256i qh = load32(block + 16);
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i v = load32(block + 48 + 32 * c);
    // Bit 2c (2c + 1) of qh moved to bit 4 of its byte: a shift within 16-bit lanes by at most
    // 4, then the mask keeps bit 4 of every byte.
    const __m256i h0 = _mm256_and_si256(
        c <= 2 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(4 - 2 * c)))
               : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * c - 4))),
        bit4);
    const __m256i h1 = _mm256_and_si256(
        c <= 1 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(3 - 2 * c)))
               : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(2 * c - 3))),
        bit4);
    v0 = _mm256_or_si256(_mm256_and_si256(v, low4), h0);
    v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), h1);
  } else {
    // Half h = c / 2 of 128 values: bits 2t, 2t + 1 of qh are bits 4 and 5 of value 32t + l's
    // code; c even takes the low nibbles of ql (t = 0, 1), c odd the high ones (t = 2, 3).
    const size_t h = c / 2;
    const __m256i l0 = load32(block + 64 * h), l1 = load32(block + 64 * h + 32);
    const __m256i qh = load32(block + 128 + 32 * h);
    const __m256i bits2 = _mm256_set1_epi8(0x30);
    if (c % 2 == 0) {
      v0 = _mm256_or_si256(_mm256_and_si256(l0, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits2));
      v1 = _mm256_or_si256(_mm256_and_si256(l1, low4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits2));
    } else {
      v0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                           _mm256_and_si256(qh, bits2));
      v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits2));
    }
  }
}

template <KFormat F>
ROUTEMM_CPU_AVX2 inline void decode_codes_avx2(const uint8_t* block, uint8_t* codes) {
#pragma GCC unroll 4
  for (size_t c = 0; c < kQK_K / 64; ++c) {
    __m256i v0, v1;
    codes64_avx2<F>(block, c, v0, v1);
    store32(codes + 64 * c, v0);
    store32(codes + 64 * c + 32, v1);
  }
}

// The sixteen int8 group scales and the group mins of a super-block as vectors: Q4_K / Q5_K's
// 6-bit scales and mins unpacked from their 12 bytes four at a time (scale_min_k4 on 32-bit
// words), each repeated for the two groups of its sub-block; Q6_K's int8 scales as stored.
// A binary16 scale widened by the F16C instruction (exact; every clone with AVX2 has it): the
// software conversion's bit tests cost a third of a one-token item.
ROUTEMM_CPU_AVX2 inline float half_to_float_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Q4_K / Q5_K's eight 6-bit scales (sc[0] the low 4, sc[1] the high 4, one per byte) and mins
// from their 12 bytes, four at a time: scale_min_k4 on 32-bit words.
inline void k4_scale_words(const uint8_t* block, uint32_t sc[2], uint32_t m[2]) {
  uint32_t a, b, c;
  std::memcpy(&a, block + 4, 4);
  std::memcpy(&b, block + 8, 4);
  std::memcpy(&c, block + 12, 4);
  sc[0] = a & 0x3f3f3f3fu;
  m[0] = b & 0x3f3f3f3fu;
  sc[1] = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  m[1] = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
}

// A super-block's scales in registers: `scales` the int8 scale of group g (16 values) in byte g,
// `mins` the int16 group_min (Decoded's), d and dmin.
template <KFormat F>
ROUTEMM_CPU_AVX2 inline void scales_avx2(const uint8_t* block, __m128i& scales, __m256i& mins,
                                         float& d, float& dmin) {
  if constexpr (F == KFormat::q6_k) {
    scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5);
    d = half_to_float_f16c(block + 208);
    dmin = 0.0f;
  } else {
    uint32_t sc[2], m[2];
    k4_scale_words(block, sc, m);
    const __m128i sc8 = _mm_setr_epi32(static_cast<int>(sc[0]), static_cast<int>(sc[1]), 0, 0);
    const __m128i m8 = _mm_setr_epi32(static_cast<int>(m[0]), static_cast<int>(m[1]), 0, 0);
    scales = _mm_unpacklo_epi8(sc8, sc8);
    mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
    d = half_to_float_f16c(block);
    dmin = half_to_float_f16c(block + 2);
  }
}

// The int16 scale of each value pair of values 32c .. 32c + 31 (Decoded::pair's 16 entries from
// 16c): pairs 0-7 take group 2c's scale, pairs 8-15 group 2c + 1's.
ROUTEMM_CPU_AVX2 inline __m256i pair_scales(__m128i scales, int c) {
  const __m128i first = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i pick = _mm_add_epi8(first, _mm_set1_epi8(static_cast<char>(2 * c)));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
}

template <KFormat F>
ROUTEMM_CPU_AVX2 inline void decode_scales_avx2(const uint8_t* block, Decoded& out) {
  __m128i scales;
  __m256i mins;
  scales_avx2<F>(block, scales, mins, out.d, out.dmin);
  _mm256_store_si256(reinterpret_cast<__m256i*>(out.group_min), mins);
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.pair + 16 * c), pair_scales(scales, c));
  }
}

ROUTEMM_CPU_AVX2 inline __m256i min_sums_avx2(const Decoded& w, const int16_t* bsum) {
  return _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.group_min)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
}

// The lane sums of s and m (eight int32 lanes each).
ROUTEMM_CPU_AVX2 inline void hsum2(__m256i s, __m256i m, int32_t& s_out, int32_t& m_out) {
  const __m256i h = _mm256_hadd_epi32(s, m);  // s01 s23 m01 m23 | s45 s67 m45 m67
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  t = _mm_hadd_epi32(t, t);  // s, m, s, m
  s_out = _mm_cvtsi128_si32(t);
  m_out = _mm_extract_epi32(t, 1);
}

// Lane r of the result: the sum of v[r]'s lanes (integer adds: exact in any order).
ROUTEMM_CPU_AVX2 inline __m256i reduce8(const __m256i v[8]) {
  const __m256i b0 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b1 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                          _mm256_permute2x128_si256(b0, b1, 0x31));
}

// Contract step 4 on eight lanes at once, lane by lane the scalar accumulate's operations: lane j
// takes activation scale dx[j], weight scales d[j], dmin[j] and sums s[j], m[j].
template <KFormat F>
ROUTEMM_CPU_AVX2 inline __m256 step4_lanes(__m256 acc, __m256 dx, __m256 d, __m256 dmin, __m256i s,
                                           __m256i m) {
  if constexpr (F == KFormat::q6_k) {
    return _mm256_fmadd_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(_mm256_sub_epi32(s, m)), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(s), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dx, dmin), _mm256_cvtepi32_ps(m), acc);
  }
}

// Contract step 4 for eight rows of one column at once (lane r: row r).
template <KFormat F>
ROUTEMM_CPU_AVX2 inline void accumulate8(float* acc, const Decoded& w, const float* dx, __m256i s,
                                         __m256i m) {
  _mm256_storeu_ps(acc, step4_lanes<F>(_mm256_loadu_ps(acc), _mm256_loadu_ps(dx),
                                       _mm256_set1_ps(w.d), _mm256_set1_ps(w.dmin), s, m));
}

// Contract step 3 for one activation row straight from a raw super-block, decoded in registers:
// the eight int32 lanes whose sum is S (`sums`) and those whose sum is M (`mins`), and the
// block's d, dmin.
template <KFormat F>
ROUTEMM_CPU_AVX2 inline void block_lanes(const uint8_t* block, const int8_t* q, const int16_t* bsum,
                                         __m256i& sums, __m256i& mins, float& d, float& dmin) {
  __m128i scales;
  __m256i group_mins;
  scales_avx2<F>(block, scales, group_mins, d, dmin);
  __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (size_t c = 0; c < kQK_K / 64; ++c) {
    __m256i v0, v1;
    codes64_avx2<F>(block, c, v0, v1);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(v0, x0),
                                                  pair_scales(scales, static_cast<int>(2 * c))));
    acc =
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(v1, x1),
                                                pair_scales(scales, static_cast<int>(2 * c + 1))));
  }
  sums = acc;
  mins = _mm256_madd_epi16(group_mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
}

template <KFormat F>
struct KAvx2 {
  static constexpr bool kRows8 = true;
  static constexpr bool kFusedRow = true;
  using Vec = __m256i;
  // Contract step 3 for one activation row straight from the raw super-block, decoded in
  // registers (no Decoded stored and read back: a row streamed alone uses each block once), and
  // the block's d, dmin.
  ROUTEMM_CPU_AVX2 static void row_sums(const uint8_t* block, const int8_t* q, const int16_t* bsum,
                                        int32_t& s, int32_t& m, float& d, float& dmin) {
    __m256i sums, mins;
    block_lanes<F>(block, q, bsum, sums, mins, d, dmin);
    hsum2(sums, mins, s, m);
  }
  ROUTEMM_CPU_AVX2 static void accumulate_rows8(float* acc, const Decoded& w, const float* dx,
                                                __m256i s, __m256i m) {
    accumulate8<F>(acc, w, dx, s, m);
  }
  ROUTEMM_CPU_AVX2 static void decode(const uint8_t* block, Decoded& out) {
    decode_scales_avx2<F>(block, out);
    decode_codes_avx2<F>(block, out.codes);
  }
  ROUTEMM_CPU_AVX2 static void sums(const Decoded& w, const int8_t* q, const int16_t* bsum,
                                    int32_t& s, int32_t& m) {
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (size_t c = 0; c < kQK_K / 32; ++c) {
      const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.codes + 32 * c));
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.pair + 16 * c));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), p));
    }
    hsum2(acc, min_sums_avx2(w, bsum), s, m);
  }
  // One activation row against eight weight rows (columns) at once. Each column streams its row
  // (up to kChunk super-blocks at a time) keeping its sums as vectors; then contract step 4 runs
  // for the eight columns together, lane j column j's accumulator, lane by lane the scalar
  // operations: the eight columns' horizontal sums share one reduction (reduce8), and the F32
  // steps are vector operations. (Visiting the eight rows super-block by super-block instead
  // defeats the hardware prefetchers: three times the time from DRAM on a Zen 4.)
  ROUTEMM_CPU_AVX2 static void row_cols8(const uint8_t* wrow, size_t row_bytes, size_t block_bytes,
                                         const Rows& rows, size_t x, size_t blocks, float* out) {
    constexpr size_t kChunk = 16;
    alignas(32) int32_t sv[8][kChunk][8], mv[8][kChunk][8];
    alignas(32) float d[kChunk][8], dmin[kChunk][8];
    __m256 acc8 = _mm256_setzero_ps();
    for (size_t b0 = 0; b0 < blocks; b0 += kChunk) {
      const size_t nb = std::min(kChunk, blocks - b0);
      for (size_t j = 0; j < 8; ++j) {
        const uint8_t* row = wrow + j * row_bytes;
        for (size_t i = 0; i < nb; ++i) {
          __m256i sums, mins;
          block_lanes<F>(row + (b0 + i) * block_bytes, rows.q_block(x, b0 + i),
                         rows.bsum(x, b0 + i), sums, mins, d[i][j], dmin[i][j]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(sv[j][i]), sums);
          _mm256_store_si256(reinterpret_cast<__m256i*>(mv[j][i]), mins);
        }
      }
      for (size_t i = 0; i < nb; ++i) {
        __m256i s8[8], m8[8];
        for (size_t j = 0; j < 8; ++j) {
          s8[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(sv[j][i]));
          m8[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(mv[j][i]));
        }
        acc8 = step4_lanes<F>(acc8, _mm256_set1_ps(rows.scale(x, b0 + i)), _mm256_load_ps(d[i]),
                              _mm256_load_ps(dmin[i]), reduce8(s8), reduce8(m8));
      }
    }
    _mm256_storeu_ps(out, acc8);
  }
  // sums for eight rows (q[r], bsum[r]) at once: lane r of s and m.
  ROUTEMM_CPU_AVX2 static void sums8(const Decoded& w, const int8_t* const* q,
                                     const int16_t* const* bsum, __m256i& s, __m256i& m) {
    __m256i sv[8], mv[8];
    for (size_t r = 0; r < 8; ++r) {
      __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (size_t c = 0; c < kQK_K / 32; ++c) {
        const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.codes + 32 * c));
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32 * c));
        const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.pair + 16 * c));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), p));
      }
      sv[r] = acc;
      mv[r] = min_sums_avx2(w, bsum[r]);
    }
    s = reduce8(sv);
    m = reduce8(mv);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX512
// 64 bytes of a Decoded written by 32-byte stores, read as those two halves: a 64-byte load of
// data still in the store buffer cannot take it from two stores and waits for them instead.
ROUTEMM_CPU_AVX512 inline __m512i load_halves(const void* p) {
  const auto* h = static_cast<const __m256i*>(p);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(h)), _mm256_load_si256(h + 1),
                            1);
}

// The AVX2 clone's decode and accumulation, with 64-byte integer dot products.
template <KFormat F>
struct KAvx512 : KAvx2<F> {
  ROUTEMM_CPU_AVX512 static void sums(const Decoded& w, const int8_t* q, const int16_t* bsum,
                                      int32_t& s, int32_t& m) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (size_t c = 0; c < kQK_K / 64; ++c) {
      const __m512i u = load_halves(w.codes + 64 * c);
      const __m512i x = _mm512_loadu_si512(q + 64 * c);
      const __m512i p = load_halves(w.pair + 32 * c);
      acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), p));
    }
    const __m256i acc8 =
        _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    hsum2(acc8, min_sums_avx2(w, bsum), s, m);
  }
  ROUTEMM_CPU_AVX512 static void sums8(const Decoded& w, const int8_t* const* q,
                                       const int16_t* const* bsum, __m256i& s, __m256i& m) {
    __m512i u[4], p[4];
    for (size_t c = 0; c < 4; ++c) {
      u[c] = load_halves(w.codes + 64 * c);
      p[c] = load_halves(w.pair + 32 * c);
    }
    __m256i sv[8], mv[8];
#pragma GCC unroll 8
    for (size_t r = 0; r < 8; ++r) {
      __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (size_t c = 0; c < 4; ++c) {
        const __m512i x = _mm512_loadu_si512(q[r] + 64 * c);
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], x), p[c]));
      }
      sv[r] = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
      mv[r] = min_sums_avx2(w, bsum[r]);
    }
    s = reduce8(sv);
    m = reduce8(mv);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX2
// The exact routes' dequantiser of one super-block with AVX2 (ggml_format_kernels.cpp): the
// codec table's F32 operations in its order, each exactly specified (no contraction), so the
// same floats. Q4_K / Q5_K value = (d * sc) * u - dmin * m; Q6_K value = (d * sc) * (u - 32).
template <KFormat F>
ROUTEMM_CPU_AVX2 void dequantize_avx2(const uint8_t* block, float* y) {
  // The scales straight from the block's bytes (not through Decoded's vectors, which a scalar
  // read right after their store would wait for).
  alignas(32) uint8_t codes[kQK_K];
  decode_codes_avx2<F>(block, codes);
  if constexpr (F == KFormat::q6_k) {
    const __m256i offset = _mm256_set1_epi32(32);
    const float d = half_to_float_f16c(block + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (size_t g = 0; g < kGroups; ++g) {
      const __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[g]));
      for (size_t h = 0; h < 16; h += 8) {
        const __m256i u = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * g + h)));
        _mm256_storeu_ps(y + 16 * g + h,
                         _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_sub_epi32(u, offset))));
      }
    }
  } else {
    const float d = half_to_float_f16c(block), dmin = half_to_float_f16c(block + 2);
    uint32_t sc[2], m[2];
    k4_scale_words(block, sc, m);
    for (size_t c = 0; c < kQK_K / 32; ++c) {
      const uint32_t shift = 8 * (c % 4);
      const __m256 d1 = _mm256_set1_ps(d * static_cast<float>((sc[c / 4] >> shift) & 0xffu));
      const __m256 m1 = _mm256_set1_ps(dmin * static_cast<float>((m[c / 4] >> shift) & 0xffu));
      for (size_t h = 0; h < 32; h += 8) {
        const __m256i u = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 32 * c + h)));
        _mm256_storeu_ps(y + 32 * c + h,
                         _mm256_sub_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(u)), m1));
      }
    }
  }
}
#endif

// ---- Items --------------------------------------------------------------------------------------

// Activation rows x[r] (indices into `rows`, r < count <= kMaxItemRows) times weight rows
// [col0, col0 + cols <= kMaxItemCols) (row_bytes apart from `weight`, block_bytes per
// super-block), written to out[r][col0 + c]. Few rows: column by column along K (each weight row
// streams once, the accumulators in registers). More: super-block by super-block, each column's
// block decoded once for all rows while their 256-value blocks stay in L1. Either way every
// output's steps run over super-blocks in increasing order (contract step 4).
constexpr size_t kMaxItemRows = 64, kMaxItemCols = 64, kStreamRows = 4;

// The item body, instantiated once per clone with that clone's target (so that its sums inline).
#define ROUTEMM_KINT8_ITEM_BODY                                                                  \
  Decoded w;                                                                                     \
  if constexpr (Isa::kFusedRow) {                                                                \
    if (count == 1) {                                                                            \
      size_t c = col0;                                                                           \
      for (; c + 8 <= col0 + cols; c += 8) {                                                     \
        Isa::row_cols8(weight + c * row_bytes, row_bytes, block_bytes, rows, x[0], rows.blocks,  \
                       out[0] + c);                                                              \
      }                                                                                          \
      for (; c < col0 + cols; ++c) {                                                             \
        const uint8_t* wrow = weight + c * row_bytes;                                            \
        float acc = 0.0f;                                                                        \
        for (size_t b = 0; b < rows.blocks; ++b) {                                               \
          int32_t s, m;                                                                          \
          float d, dmin;                                                                         \
          Isa::row_sums(wrow + b * block_bytes, rows.q_block(x[0], b), rows.bsum(x[0], b), s, m, \
                        d, dmin);                                                                \
          acc = accumulate<F>(acc, d, dmin, rows.scale(x[0], b), s, m);                          \
        }                                                                                        \
        out[0][c] = acc;                                                                         \
      }                                                                                          \
      return;                                                                                    \
    }                                                                                            \
  }                                                                                              \
  if (count <= kStreamRows) {                                                                    \
    for (size_t c = col0; c < col0 + cols; ++c) {                                                \
      const uint8_t* wrow = weight + c * row_bytes;                                              \
      float acc[kStreamRows] = {};                                                               \
      for (size_t b = 0; b < rows.blocks; ++b) {                                                 \
        Isa::decode(wrow + b * block_bytes, w);                                                  \
        for (size_t r = 0; r < count; ++r) {                                                     \
          int32_t s, m;                                                                          \
          Isa::sums(w, rows.q_block(x[r], b), rows.bsum(x[r], b), s, m);                         \
          acc[r] = accumulate<F>(acc[r], w, rows.scale(x[r], b), s, m);                          \
        }                                                                                        \
      }                                                                                          \
      for (size_t r = 0; r < count; ++r) out[r][c] = acc[r];                                     \
    }                                                                                            \
    return;                                                                                      \
  }                                                                                              \
  float acc[kMaxItemRows * kMaxItemCols]; /* acc[c * kMaxItemRows + r] */                        \
  std::fill(acc, acc + cols * kMaxItemRows, 0.0f);                                               \
  alignas(32) float dx[kMaxItemRows];                                                            \
  const int8_t* qb[kMaxItemRows];                                                                \
  const int16_t* sb[kMaxItemRows];                                                               \
  for (size_t b = 0; b < rows.blocks; ++b) {                                                     \
    for (size_t r = 0; r < count; ++r) {                                                         \
      dx[r] = rows.scale(x[r], b);                                                               \
      qb[r] = rows.q_block(x[r], b);                                                             \
      sb[r] = rows.bsum(x[r], b);                                                                \
    }                                                                                            \
    for (size_t c = 0; c < cols; ++c) {                                                          \
      Isa::decode(weight + (col0 + c) * row_bytes + b * block_bytes, w);                         \
      /* The block two columns on (or the next super-block's): 64 rows' short segments, */       \
      /* which the hardware prefetchers do not predict, arrive while this column's run. */       \
      {                                                                                          \
        const size_t ahead = c + 2 < cols ? b : b + 1;                                           \
        const size_t pc = c + 2 < cols ? c + 2 : c + 2 - cols;                                   \
        if (ahead < rows.blocks && pc < cols) {                                                  \
          const uint8_t* next = weight + (col0 + pc) * row_bytes + ahead * block_bytes;          \
          for (size_t off = 0; off < block_bytes; off += 64) __builtin_prefetch(next + off);     \
          __builtin_prefetch(next + block_bytes - 1);                                            \
        }                                                                                        \
      }                                                                                          \
      float* acc_c = acc + c * kMaxItemRows;                                                     \
      size_t r = 0;                                                                              \
      if constexpr (Isa::kRows8) {                                                               \
        for (; r + 8 <= count; r += 8) {                                                         \
          typename Isa::Vec s, m;                                                                \
          Isa::sums8(w, qb + r, sb + r, s, m);                                                   \
          Isa::accumulate_rows8(acc_c + r, w, dx + r, s, m);                                     \
        }                                                                                        \
      }                                                                                          \
      for (; r < count; ++r) {                                                                   \
        int32_t s, m;                                                                            \
        Isa::sums(w, qb[r], sb[r], s, m);                                                        \
        acc_c[r] = accumulate<F>(acc_c[r], w, dx[r], s, m);                                      \
      }                                                                                          \
    }                                                                                            \
  }                                                                                              \
  for (size_t r = 0; r < count; ++r)                                                             \
    for (size_t c = 0; c < cols; ++c) out[r][col0 + c] = acc[c * kMaxItemRows + r];

template <class Isa, KFormat F>
void item_portable(const uint8_t* weight, size_t row_bytes, size_t block_bytes, const Rows& rows,
                   const size_t* x, size_t count, float* const* out, size_t col0, size_t cols) {
  ROUTEMM_KINT8_ITEM_BODY
}
#if ROUTEMM_CPU_HAVE_AVX2
template <class Isa, KFormat F>
ROUTEMM_CPU_AVX2 void item_avx2(const uint8_t* weight, size_t row_bytes, size_t block_bytes,
                                const Rows& rows, const size_t* x, size_t count, float* const* out,
                                size_t col0, size_t cols) {
  ROUTEMM_KINT8_ITEM_BODY
}
#endif
#if ROUTEMM_CPU_HAVE_AVX512
template <class Isa, KFormat F>
ROUTEMM_CPU_AVX512 void item_avx512(const uint8_t* weight, size_t row_bytes, size_t block_bytes,
                                    const Rows& rows, const size_t* x, size_t count,
                                    float* const* out, size_t col0, size_t cols) {
  ROUTEMM_KINT8_ITEM_BODY
}
#endif
#undef ROUTEMM_KINT8_ITEM_BODY

using Item = void (*)(const uint8_t*, size_t, size_t, const Rows&, const size_t*, size_t,
                      float* const*, size_t, size_t);

// The clone this process runs (the best the CPU has, capped by ROUTEMM_CPU_ISA; aarch64 runs the
// portable clone).
template <KFormat F>
Item item_for_isa() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512()) return item_avx512<KAvx512<F>, F>;
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return item_avx2<KAvx2<F>, F>;
#endif
  return item_portable<KPortable<F>, F>;
}

}  // namespace routemm::cpu::ggml::kint8
