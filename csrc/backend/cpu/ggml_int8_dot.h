// CPU building blocks of the reduced-precision int8-dot routes of the GGML block products (Q4_0 and
// Q8_0 weights; q4_matmul.cpp): each activation row is rounded to 8-bit integers per 32-value
// block, every block pair is an exact integer dot product, and the blocks are scaled and summed in
// F32. The routes are opt-in (GgmlRoutingPolicy::dense_int8_dot); the exact ones stay the default.
//
// NUMERIC CONTRACT (every int8-dot pipeline and every instruction-set clone):
//   1. Activations, per row, per 32-value block: a = max_j |x_j| (taken on the magnitude bits as
//      integers, so NaN > inf > every finite value).
//      - a finite and >= 2^-100: d = a / 127 and r = 1 / d (binary32, each rounded to nearest);
//        q_j = x_j * r rounded to binary32, then to the nearest integer, ties to even. Then
//        |x_j * r| <= 127 (1 + 2^-22), so |q_j| <= 127, and |x_j - d q_j| <= d (1/2 + 2^-15).
//      - a < 2^-100: d = 0 and q_j = 0 (the block contributes nothing; its error is below
//        2^-100 per value).
//      - a not finite: d = NaN and q_j = 0, so every output of the row is NaN.
//      The scale stays binary32 (not ggml's binary16): no block overflows or underflows it.
//   2. Weight values are integers v_j times the block's binary16 scale s widened exactly: Q4_0
//      v_j = nibble - 8 (values 0-15 in the low nibbles, 16-31 in the high ones), Q8_0 the byte.
//   3. Per block b and lane l = 0..7: p_l = sum_{j = 4l .. 4l+3} v_j q_j, an exact integer
//      (|p_l| <= 4 * 128 * 127 < 2^24, so its binary32 conversion is exact too).
//   4. Eight F32 lane accumulators start at +0.0f; acc_l = fma(s_b * d_b, p_l, acc_l) over blocks
//      b in increasing order, s_b * d_b one binary32 multiplication.
//   5. out = simd::reduce_lanes(acc), the exact routes' fixed tree.
// The integer sums are exact whatever the instructions (AVX512_VNNI vpdpbusd, AVX2 vpmaddubsw +
// vpmaddwd, scalar), and every F32 operation is fixed above, so every clone, work split and
// thread count gives the same bits. Error against the exact product, per output:
//   |err| <= sum_i |w_i| d_i (1/2 + 2^-15) + gamma(K/32 + 4) sum_i |w_i| (|x_i| + d_i)
//            + 2^-100 sum_i |w_i|,  gamma(n) = n 2^-24 / (1 - n 2^-24),
// with d_i the scale of x_i's block (tests/python/tolerances.py: int8_dot_bound).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ggml_block_kernels.h"
#include "simd.h"

namespace routemm::cpu::ggml::int8 {

// Magnitude bits of 2^-100: blocks whose largest |x| is below it round to zero.
constexpr uint32_t kTinyMagnitudeBits = (127u - 100u) << 23;
constexpr uint32_t kInfBits = 0x7f800000u;

// One call's activation rows rounded to int8 blocks (contract step 1), in three arrays: q (32
// values per block), d (one scale per block) and, per block, the eight lane sums of q times
// -offset: the term the unsigned-code dot products add back (see Int8Codes::kCodeOffset).
struct QuantizedRows {
  size_t blocks = 0;  // blocks per row
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bias;

  void resize(size_t rows, size_t k) {
    blocks = k / kQK;
    q.resize(rows * blocks * kQK);
    d.resize(rows * blocks);
    bias.resize(rows * blocks * kLanes);
  }
};

// Read-only view of QuantizedRows from some row on (row 0 of the view is that row).
struct QuantizedRowsView {
  const int8_t* q;
  const float* d;
  const int32_t* bias;
  size_t blocks;

  QuantizedRowsView(const QuantizedRows& rows, size_t first_row)
      : q(rows.q.data() + first_row * rows.blocks * kQK),
        d(rows.d.data() + first_row * rows.blocks),
        bias(rows.bias.data() + first_row * rows.blocks * kLanes),
        blocks(rows.blocks) {}

  const int8_t* q_block(size_t row, size_t b) const { return q + (row * blocks + b) * kQK; }
  float scale(size_t row, size_t b) const { return d[row * blocks + b]; }
  const int32_t* bias_block(size_t row, size_t b) const {
    return bias + (row * blocks + b) * kLanes;
  }
};

// Per-block scale of contract step 1 from the largest magnitude's bits; r is 1 / d or 0.
inline void block_scale(uint32_t max_bits, float& d, float& r) {
  if (max_bits >= kInfBits) {
    d = std::numeric_limits<float>::quiet_NaN();
    r = 0.0f;
  } else if (max_bits < kTinyMagnitudeBits) {
    d = 0.0f;
    r = 0.0f;
  } else {
    d = std::bit_cast<float>(max_bits) / 127.0f;
    r = 1.0f / d;
  }
}

// Rounds row `row` (k values at x) into `out`; `offset` is the weight format's code offset.
inline void quantize_row_portable(const float* x, size_t k, int32_t offset, QuantizedRows& out,
                                  size_t row) {
  for (size_t b = 0; b < k / kQK; ++b) {
    const float* xb = x + b * kQK;
    uint32_t max_bits = 0;
    for (size_t j = 0; j < kQK; ++j) {
      max_bits = std::max(max_bits, std::bit_cast<uint32_t>(xb[j]) & 0x7fffffffu);
    }
    float d, r;
    block_scale(max_bits, d, r);
    int8_t* q = out.q.data() + (row * out.blocks + b) * kQK;
    int32_t* bias = out.bias.data() + (row * out.blocks + b) * kLanes;
    for (size_t j = 0; j < kQK; ++j) {
      // r == 0 gives q = 0 for every finite x; non-finite x only occur with r == 0 and are
      // skipped so that no NaN reaches the integer conversion.
      q[j] = r == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] * r));
    }
    for (size_t l = 0; l < kLanes; ++l) {
      bias[l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    }
    out.d[row * out.blocks + b] = d;
  }
}

#if ROUTEMM_CPU_HAVE_AVX2
// The same rounding with AVX2 (every operation exactly specified: integer max, IEEE division,
// multiplication, round-to-nearest-even), so it gives quantize_row_portable's bytes.
ROUTEMM_CPU_AVX2 inline void quantize_row_avx2(const float* x, size_t k, int32_t offset,
                                               QuantizedRows& out, size_t row) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (size_t b = 0; b < k / kQK; ++b) {
    const float* xb = x + b * kQK;
    __m256 v[kLanesPerBlock];
    __m256i m = _mm256_setzero_si256();
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      v[s] = _mm256_loadu_ps(xb + s * kLanes);
      m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(v[s]), magnitude));
    }
    alignas(32) uint32_t lanes[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    uint32_t max_bits = 0;
    for (uint32_t lane : lanes) max_bits = std::max(max_bits, lane);
    float d, r;
    block_scale(max_bits, d, r);
    const __m256 rv = _mm256_set1_ps(r);
    __m256i qi[kLanesPerBlock];
    for (size_t s = 0; s < kLanesPerBlock; ++s) {
      // r == 0: multiply by zero would turn inf into NaN; the mask keeps those lanes zero.
      const __m256 scaled = r == 0.0f ? _mm256_setzero_ps() : _mm256_mul_ps(v[s], rv);
      qi[s] = _mm256_cvtps_epi32(
          _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int8 in value order (packs interleave 128-bit halves; the permute undoes it).
    const __m256i w01 = _mm256_packs_epi32(qi[0], qi[1]);
    const __m256i w23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    int8_t* q = out.q.data() + (row * out.blocks + b) * kQK;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
    // Lane sums of four values: sign-extend pairs to int16 sums, then pairs of those.
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
    const __m256i sums = _mm256_madd_epi16(pairs, ones16);
    int32_t* bias = out.bias.data() + (row * out.blocks + b) * kLanes;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bias),
                        _mm256_mullo_epi32(sums, _mm256_set1_epi32(-offset)));
    out.d[row * out.blocks + b] = d;
  }
}
#endif

// Rounds `rows` rows of width k (row stride k) into `out`, rows [begin, end).
inline void quantize_rows(const float* x, size_t k, int32_t offset, QuantizedRows& out,
                          size_t begin, size_t end) {
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) {
    for (size_t r = begin; r < end; ++r) quantize_row_avx2(x + r * k, k, offset, out, r);
    return;
  }
#endif
  for (size_t r = begin; r < end; ++r) quantize_row_portable(x + r * k, k, offset, out, r);
}

// ---- Weight codes -------------------------------------------------------------------------------
//
// Per format: kCodeOffset o, such that the unsigned code u_j = v_j + o of contract step 2 is a
// byte (Q4_0: the nibble, o = 8; Q8_0: the byte xor 0x80, o = 128); an unsigned-by-signed dot
// product of the codes then needs sum_j o q_j subtracted, which QuantizedRows::bias holds per lane.

template <class Format>
struct Int8Codes;

template <>
struct Int8Codes<Q4_0Format> {
  static constexpr int32_t kCodeOffset = 8;
  static int value(const uint8_t* block, size_t j) {
    const uint8_t byte = block[2 + j % (kQK / 2)];
    return static_cast<int>(j < kQK / 2 ? byte & 0x0f : byte >> 4) - 8;
  }
#if ROUTEMM_CPU_HAVE_AVX2
  // The 32 nibbles in value order: the low nibbles of bytes 0-15, then their high nibbles.
  ROUTEMM_CPU_AVX2 static __m256i unsigned_codes(const uint8_t* block) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low),
                            _mm_and_si128(bytes, low));
  }
#endif
};

template <>
struct Int8Codes<Q8_0Format> {
  static constexpr int32_t kCodeOffset = 128;
  static int value(const uint8_t* block, size_t j) { return static_cast<int8_t>(block[2 + j]); }
#if ROUTEMM_CPU_HAVE_AVX2
  ROUTEMM_CPU_AVX2 static __m256i signed_values(const uint8_t* block) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  }
  ROUTEMM_CPU_AVX2 static __m256i unsigned_codes(const uint8_t* block) {
    return _mm256_xor_si256(signed_values(block), _mm256_set1_epi8(static_cast<char>(0x80)));
  }
#endif
};

// ---- Products -----------------------------------------------------------------------------------
//
// Three clones of one pair of primitives (selected once per launch, isa.h):
//   mv_columns<R, C>(ops, x, col, out_rows)   outputs of rows 0..R, columns col..col+C, full K
//   mm_tile(...)                              the matrix routes' register tile over one panel of
//                                             pre-arranged weight blocks (see Int8Panel)
// Int8Portable (plain loops), Int8Avx2 (vpmaddubsw + vpmaddwd; Q8_0 multiplies |v| by q with v's
// sign, Q4_0 the nibbles by q minus the bias) and Int8Vnni (AVX512_VNNI vpdpbusd on 256-bit
// vectors: the codes times q, accumulated onto the bias).

// Weight blocks of one matrix panel, rearranged once per panel: per column and block, the 32 codes
// the clone's dot product reads and the block's widened scale.
struct Int8Panel {
  std::vector<uint8_t> codes;  // [column][block][32]
  std::vector<float> scales;   // [column][block]
};

template <class Format>
struct Int8Portable {
  static constexpr size_t kTileRows = 4, kTileCols = 3;
  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return 1;
  }

  static float weight_scale(const uint8_t* block) {
    return simd::widen(simd::Half{block_scale_bits(block)});
  }
  // Panel codes: the signed values as bytes.
  static void panel_codes(const uint8_t* block, uint8_t* out) {
    for (size_t j = 0; j < kQK; ++j) {
      out[j] = static_cast<uint8_t>(static_cast<int8_t>(Int8Codes<Format>::value(block, j)));
    }
  }
  static void block_step(const int8_t* v, const int8_t* q, float scale, float* acc) {
    for (size_t l = 0; l < kLanes; ++l) {
      int32_t p = 0;
      for (size_t j = 4 * l; j < 4 * l + 4; ++j) p += int32_t{v[j]} * int32_t{q[j]};
      acc[l] = std::fma(scale, static_cast<float>(p), acc[l]);
    }
  }

  template <size_t R, size_t C>
  static void mv_columns(const Operands& ops, const QuantizedRowsView& x, size_t col,
                         float* const* out_rows) {
    float acc[R][C][kLanes] = {};
    int8_t v[kQK];
    for (size_t b = 0; b < x.blocks; ++b) {
      for (size_t c = 0; c < C; ++c) {
        const uint8_t* block = ops.weight_row(col + c) + b * Format::kBytes;
        for (size_t j = 0; j < kQK; ++j) v[j] = Int8Codes<Format>::value(block, j);
        const float s = weight_scale(block);
        for (size_t r = 0; r < R; ++r) {
          block_step(v, x.q_block(r, b), s * x.scale(r, b), acc[r][c]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c] = simd::reduce_lanes(acc[r][c]);
    }
  }

  // acc[r][c] (eight lanes, stride acc_stride per row) += panel blocks [0, blocks) of R rows
  // (x rows row0.., block b0..) x C panel columns starting at code column c0.
  template <size_t R, size_t C>
  static void mm_tile(const QuantizedRowsView& x, size_t row0, size_t b0, const Int8Panel& panel,
                      size_t panel_blocks, size_t c0, size_t blocks, float* acc,
                      size_t acc_stride) {
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) {
        float* a = acc + r * acc_stride + c * kLanes;
        for (size_t b = 0; b < blocks; ++b) {
          const size_t at = (c0 + c) * panel_blocks + b;
          const auto* v = reinterpret_cast<const int8_t*>(panel.codes.data() + at * kQK);
          block_step(v, x.q_block(row0 + r, b0 + b), panel.scales[at] * x.scale(row0 + r, b0 + b),
                     a);
        }
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
// The integer lanes p_l of one block pair, with AVX2 (contract step 3).
template <class Format>
ROUTEMM_CPU_AVX2 inline __m256i avx2_lanes(__m256i codes, const int8_t* q, const int32_t* bias) {
  const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i ones16 = _mm256_set1_epi16(1);
  if constexpr (Int8Codes<Format>::kCodeOffset == 8) {
    // Nibbles (<= 15) times q (|q| <= 127): every int16 pair sum fits; then the bias -8 sum q.
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, qv), ones16);
    return _mm256_add_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
  } else {
    // Signed bytes: |v| (unsigned, <= 128) times q with v's sign (|q| <= 127, never negated out of
    // range); an int16 pair sum is at most 2 * 128 * 127 < 2^15.
    const __m256i sums = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(qv, codes)), ones16);
    return sums;
  }
}

template <class Format>
struct Int8Avx2 {
  static constexpr size_t kTileRows = 2, kTileCols = 4;
  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R <= 2 ? 4 : R <= 4 ? 2 : 1;
  }

  // Q4_0: the nibbles; Q8_0: the signed bytes (avx2_lanes takes their magnitude and sign).
  ROUTEMM_CPU_AVX2 static __m256i codes(const uint8_t* block) {
    if constexpr (Int8Codes<Format>::kCodeOffset == 8) {
      return Int8Codes<Format>::unsigned_codes(block);
    } else {
      return Int8Codes<Format>::signed_values(block);
    }
  }
  ROUTEMM_CPU_AVX2 static void panel_codes(const uint8_t* block, uint8_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), codes(block));
  }
  static float weight_scale(const uint8_t* block) {
    return simd::widen(simd::Half{block_scale_bits(block)});
  }
  ROUTEMM_CPU_AVX2 static float reduce(__m256 v) {
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, v);
    return simd::reduce_lanes(lanes);
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mv_columns(const Operands& ops, const QuantizedRowsView& x,
                                          size_t col, float* const* out_rows) {
    __m256 acc[R][C];
    for (size_t r = 0; r < R; ++r)
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c);
    for (size_t b = 0; b < x.blocks; ++b) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        const uint8_t* block = rows[c] + b * Format::kBytes;
        const __m256i w = codes(block);
        const float s = _cvtsh_ss(block_scale_bits(block));
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const __m256i p = avx2_lanes<Format>(w, x.q_block(r, b), x.bias_block(r, b));
          acc[r][c] =
              _mm256_fmadd_ps(_mm256_set1_ps(s * x.scale(r, b)), _mm256_cvtepi32_ps(p), acc[r][c]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c] = reduce(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mm_tile(const QuantizedRowsView& x, size_t row0, size_t b0,
                                       const Int8Panel& panel, size_t panel_blocks, size_t c0,
                                       size_t blocks, float* acc, size_t acc_stride) {
    __m256 a[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    for (size_t b = 0; b < blocks; ++b) {
      __m256i w[C];
      float s[C];
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        const size_t at = (c0 + c) * panel_blocks + b;
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel.codes.data() + at * kQK));
        s[c] = panel.scales[at];
      }
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const int8_t* q = x.q_block(row0 + r, b0 + b);
        const int32_t* bias = x.bias_block(row0 + r, b0 + b);
        const float d = x.scale(row0 + r, b0 + b);
#pragma GCC unroll 8
        for (size_t c = 0; c < C; ++c) {
          a[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[c] * d),
                                    _mm256_cvtepi32_ps(avx2_lanes<Format>(w[c], q, bias)), a[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX512
template <class Format>
struct Int8Vnni {
  static constexpr size_t kTileRows = 4, kTileCols = 4;
  template <size_t R>
  static constexpr size_t mv_columns_for_rows() {
    return R == 1 ? 8 : R <= 3 ? 4 : R == 4 ? 3 : 2;
  }

  // Unsigned codes (value + kCodeOffset) for vpdpbusd.
  ROUTEMM_CPU_AVX512_VNNI static __m256i codes(const uint8_t* block) {
    return Int8Codes<Format>::unsigned_codes(block);
  }
  ROUTEMM_CPU_AVX512_VNNI static void panel_codes(const uint8_t* block, uint8_t* out) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), codes(block));
  }
  static float weight_scale(const uint8_t* block) {
    return simd::widen(simd::Half{block_scale_bits(block)});
  }
  // Lanes p_l: the bias (-o sum q) plus the codes times q.
  ROUTEMM_CPU_AVX512_VNNI static __m256i lanes(__m256i w, const int8_t* q, const int32_t* bias) {
    return _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)), w,
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  }
  ROUTEMM_CPU_AVX512_VNNI static float reduce(__m256 v) {
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, v);
    return simd::reduce_lanes(lanes);
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX512_VNNI static void mv_columns(const Operands& ops, const QuantizedRowsView& x,
                                                 size_t col, float* const* out_rows) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c);
    for (size_t b = 0; b < x.blocks; ++b) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        const uint8_t* block = rows[c] + b * Format::kBytes;
        const __m256i w = codes(block);
        const float s = _cvtsh_ss(block_scale_bits(block));
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const __m256i p = lanes(w, x.q_block(r, b), x.bias_block(r, b));
          acc[r][c] =
              _mm256_fmadd_ps(_mm256_set1_ps(s * x.scale(r, b)), _mm256_cvtepi32_ps(p), acc[r][c]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c] = reduce(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX512_VNNI static void mm_tile(const QuantizedRowsView& x, size_t row0, size_t b0,
                                              const Int8Panel& panel, size_t panel_blocks,
                                              size_t c0, size_t blocks, float* acc,
                                              size_t acc_stride) {
    __m256 a[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    for (size_t b = 0; b < blocks; ++b) {
      __m256i w[C];
      float s[C];
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        const size_t at = (c0 + c) * panel_blocks + b;
        w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel.codes.data() + at * kQK));
        s[c] = panel.scales[at];
      }
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const int8_t* q = x.q_block(row0 + r, b0 + b);
        const int32_t* bias = x.bias_block(row0 + r, b0 + b);
        const float d = x.scale(row0 + r, b0 + b);
#pragma GCC unroll 8
        for (size_t c = 0; c < C; ++c) {
          a[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[c] * d),
                                    _mm256_cvtepi32_ps(lanes(w[c], q, bias)), a[r][c]);
        }
      }
    }
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

// ---- Mat-vec ------------------------------------------------------------------------------------

// Columns [col0, col_end) of ops.m (<= kMaxMvRows) rows of x.
template <class Isa, size_t R>
void mv_range(const Operands& ops, const QuantizedRowsView& x, size_t col0, size_t col_end) {
  constexpr size_t C = Isa::template mv_columns_for_rows<R>();
  float* out_rows[R];
  for (size_t r = 0; r < R; ++r) out_rows[r] = ops.output + r * ops.n;
  size_t col = col0;
  for (; col + C <= col_end; col += C) Isa::template mv_columns<R, C>(ops, x, col, out_rows);
  for (; col < col_end; ++col) Isa::template mv_columns<R, 1>(ops, x, col, out_rows);
}

using MvRange = void (*)(const Operands&, const QuantizedRowsView&, size_t, size_t);

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

template <class Format>
MvRange mv_range_for(size_t rows) {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512_vnni()) return mv_range_for_rows<Int8Vnni<Format>>(rows);
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return mv_range_for_rows<Int8Avx2<Format>>(rows);
#endif
  return mv_range_for_rows<Int8Portable<Format>>(rows);
}

// ---- Matrix items -------------------------------------------------------------------------------

// Blocks per matrix panel: a 64-column panel of codes is 16 KiB, next to the tile's rows of q.
constexpr size_t kPanelBlocks = 8;

template <class Isa, size_t R = Isa::kTileRows>
void mm_tile_rows(size_t rows, const QuantizedRowsView& x, size_t row0, size_t b0,
                  const Int8Panel& panel, size_t c0, size_t blocks, float* acc, size_t acc_stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      mm_tile_rows<Isa, R - 1>(rows, x, row0, b0, panel, c0, blocks, acc, acc_stride);
      return;
    }
  }
  Isa::template mm_tile<R, Isa::kTileCols>(x, row0, b0, panel, kPanelBlocks, c0, blocks, acc,
                                           acc_stride);
}

// Rows [row0, row0 + rows) x outputs [col0, col0 + cols <= kMmOutputTile): each panel of
// kPanelBlocks weight blocks is rearranged once (codes and scales) and the register tiles run over
// it; padded columns get zero codes and scales and are never stored.
template <class Isa, class Format>
void mm_item(const Operands& ops, const QuantizedRowsView& x, size_t row0, size_t rows, size_t col0,
             size_t cols, float* const* out_rows) {
  constexpr size_t kTileCols = Isa::kTileCols, kTileRows = Isa::kTileRows;
  constexpr size_t kCols = (kMmOutputTile + kTileCols - 1) / kTileCols * kTileCols;
  thread_local Int8Panel panel;
  thread_local std::vector<float> acc_scratch;
  panel.codes.assign(kCols * kPanelBlocks * kQK, 0);
  panel.scales.assign(kCols * kPanelBlocks, 0.0f);
  const size_t acc_stride = kCols * kLanes;
  acc_scratch.assign(rows * acc_stride, 0.0f);
  float* acc = acc_scratch.data();
  const size_t cols_pad = (cols + kTileCols - 1) / kTileCols * kTileCols;
  for (size_t b0 = 0; b0 < x.blocks; b0 += kPanelBlocks) {
    const size_t blocks = std::min(kPanelBlocks, x.blocks - b0);
    for (size_t c = 0; c < cols; ++c) {
      const uint8_t* w = ops.weight_row(col0 + c) + b0 * Format::kBytes;
      for (size_t b = 0; b < blocks; ++b) {
        Isa::panel_codes(w + b * Format::kBytes, panel.codes.data() + (c * kPanelBlocks + b) * kQK);
        panel.scales[c * kPanelBlocks + b] = Isa::weight_scale(w + b * Format::kBytes);
      }
    }
    for (size_t c = 0; c < cols_pad; c += kTileCols) {
      for (size_t r = 0; r < rows; r += kTileRows) {
        mm_tile_rows<Isa>(std::min(kTileRows, rows - r), x, row0 + r, b0, panel, c, blocks,
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

using MmItem = void (*)(const Operands&, const QuantizedRowsView&, size_t, size_t, size_t, size_t,
                        float* const*);

template <class Format>
MmItem mm_item_for() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512_vnni()) return mm_item<Int8Vnni<Format>, Format>;
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return mm_item<Int8Avx2<Format>, Format>;
#endif
  return mm_item<Int8Portable<Format>, Format>;
}

}  // namespace routemm::cpu::ggml::int8
