// CPU building blocks of the reduced-precision int8-dot routes of the GGML block products (Q4_0 and
// Q8_0 weights; q4_matmul.cpp): each activation row is rounded to 8-bit integers per 32-value
// block, every block pair is an exact integer dot product, and the blocks are scaled and summed in
// F32. The routes are opt-in (GgmlRoutingPolicy::dense_int8_dot, and the expert-ID routes
// direct_int8_dot / grouped_int8_dot of quantized_matmul_id.cpp); the exact ones stay the default.
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
//   3. Per block b: P_b = sum_j v_j q_j, an exact integer (|P_b| <= 32 * 128 * 127 < 2^24, so its
//      binary32 conversion is exact too).
//   4. One F32 accumulator per output, from +0.0f: acc = fma(s_b * d_b, P_b, acc) over blocks b in
//      increasing order, s_b * d_b one binary32 multiplication; out = acc.
// The integer sums are exact whatever the instructions (AVX512_VNNI vpdpbusd, AVX2 vpmaddubsw +
// vpmaddwd, NEON sdot, scalar) and whatever order they add in, and every F32 operation is fixed above, so
// every clone, work split and thread count gives the same bits. Error against the exact product,
// per output:
//   |err| <= sum_i |w_i| d_i (1/2 + 2^-15) + gamma(K/32 + 1) sum_i |w_i| (|x_i| + d_i)
//            + 2^-100 sum_i |w_i|,  gamma(n) = n 2^-24 / (1 - n 2^-24),
// with d_i the scale of x_i's block (tests/python/tolerances.py: int8_dot_bound).
//
// Layout: the F32 steps run on eight output columns at once. The matrix routes rearrange each
// panel of weight blocks in groups of eight columns (GroupBlock): four-value slice g of column c
// sits in 32-bit lane c of vector g, so one instruction multiplies eight columns' slices by the
// same four activations (broadcast) and lane c accumulates column c's P_b. The mat-vec streams
// eight columns along K instead (stream_group): each column's block is multiplied as loaded and
// its lanes summed (sum_lanes8), nothing goes through memory.
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
// values per block), d (one scale per block) and, per block, -offset * sum_j q_j: the term an
// unsigned-code dot product adds back (the clone's kCodeOffset; see Int8Codes).
struct QuantizedRows {
  size_t blocks = 0;  // blocks per row
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bias;

  void resize(size_t rows, size_t k) {
    blocks = k / kQK;
    q.resize(rows * blocks * kQK);
    d.resize(rows * blocks);
    bias.resize(rows * blocks);
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
        bias(rows.bias.data() + first_row * rows.blocks),
        blocks(rows.blocks) {}

  const int8_t* q_block(size_t row, size_t b) const { return q + (row * blocks + b) * kQK; }
  float scale(size_t row, size_t b) const { return d[row * blocks + b]; }
  int32_t block_bias(size_t row, size_t b) const { return bias[row * blocks + b]; }
  // The view from row `row` of this one on.
  QuantizedRowsView from(size_t row) const {
    QuantizedRowsView v = *this;
    v.q += row * blocks * kQK;
    v.d += row * blocks;
    v.bias += row * blocks;
    return v;
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
    int32_t sum = 0;
    for (size_t j = 0; j < kQK; ++j) {
      // r == 0 gives q = 0 for every finite x; non-finite x only occur with r == 0 and are
      // skipped so that no NaN reaches the integer conversion.
      q[j] = r == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(xb[j] * r));
      sum += q[j];
    }
    out.bias[row * out.blocks + b] = -offset * sum;
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
    // The sum of q: pairs to int16, pairs of those to int32 lanes, then the lanes.
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes);
    alignas(32) int32_t sums[kLanes];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_madd_epi16(pairs, ones16));
    int32_t sum = 0;
    for (int32_t lane : sums) sum += lane;
    out.bias[row * out.blocks + b] = -offset * sum;
    out.d[row * out.blocks + b] = d;
  }
}
#endif

// Rounds one row of k values at x into row `row` of `out` (sized for it).
inline void quantize_row(const float* x, size_t k, int32_t offset, QuantizedRows& out, size_t row) {
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) {
    quantize_row_avx2(x, k, offset, out, row);
    return;
  }
#endif
  quantize_row_portable(x, k, offset, out, row);
}

// Rounds `rows` rows of width k (row stride k) into `out`, rows [begin, end).
inline void quantize_rows(const float* x, size_t k, int32_t offset, QuantizedRows& out,
                          size_t begin, size_t end) {
  for (size_t r = begin; r < end; ++r) quantize_row(x + r * k, k, offset, out, r);
}

// ---- Weight codes -------------------------------------------------------------------------------
//
// Per format: the weight integers v_j of contract step 2 (value), and the unsigned codes
// u_j = v_j + kCodeOffset that an unsigned-by-signed dot product takes (Q4_0: the nibble, offset
// 8; Q8_0: the byte xor 0x80, offset 128); such a product then needs -offset * sum_j q_j added,
// which QuantizedRows::bias holds per block.

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
  // The 32 nibbles in value order: the low nibbles of bytes 0-15, then their high nibbles. The 16
  // bytes are loaded into both halves, the upper half's 32-bit lanes shift right by 4, and the
  // mask keeps each byte's low four bits: in a lane shifted by 4, byte j's low bits are byte j's
  // high nibble. Two vector operations besides the load (the 128-bit split, shift and insert took
  // four), 1.12x on the int8-dot Q4_0 mat-vecs, which these operations bound.
  ROUTEMM_CPU_AVX2 static __m256i unsigned_codes(const uint8_t* block) {
    const __m256i both =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
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

// ---- Column groups ------------------------------------------------------------------------------

constexpr size_t kGroupCols = 8;  // output columns per group: one 32-bit lane each
constexpr size_t kSlices = kQK / 4;

// One weight block of kGroupCols columns, rearranged: codes[32 g + 4 c + i] = code of value
// 4g + i of column c (the clone's codes: see each clone's group_block); scales[c] = column c's
// widened block scale. A column past the matrix has zero codes and a zero scale.
struct alignas(32) GroupBlock {
  uint8_t codes[kSlices * kGroupCols * 4];
  float scales[kGroupCols];
};
static_assert(sizeof(GroupBlock) == kQK * kGroupCols + 4 * kGroupCols);

// The widened scale of one column's block; zero for a column past the matrix (nullptr).
inline float group_scale(const uint8_t* block) {
  return block == nullptr ? 0.0f : simd::widen(simd::Half{block_scale_bits(block)});
}

// Three clones (selected once per launch, isa.h) of
//   group_block(blocks, out)   rearranges one block of kGroupCols columns (GroupBlock)
//   tile<R, G>(...)            R rows x G groups over a panel of group blocks: the integer P_b of
//                              every output, then contract step 4 on eight outputs per vector
//   stream_group<R>(...)       the mat-vec of R <= kStreamRows rows for one group of columns
//                              straight from the weight rows (vector clones only)
// and kOffset, the code offset its dot product needs added back (QuantizedRows::bias).
// Int8Portable: signed values, plain loops. Int8Avx2: vpmaddubsw + vpmaddwd (Q4_0 nibbles times q;
// Q8_0 |v| times q with v's sign). Int8Vnni: AVX512_VNNI vpdpbusd on unsigned codes.

template <class Format>
struct Int8Portable {
  static constexpr int32_t kOffset = 0;
  static constexpr size_t kTileRows = 2, kTileGroups = 1, kMatVecTileRows = 2, kStreamRows = 0;

  static void group_block(const uint8_t* const* blocks, GroupBlock& out) {
    for (size_t c = 0; c < kGroupCols; ++c) {
      for (size_t j = 0; j < kQK; ++j) {
        const int v = blocks[c] == nullptr ? 0 : Int8Codes<Format>::value(blocks[c], j);
        out.codes[(j / 4) * kGroupCols * 4 + c * 4 + j % 4] =
            static_cast<uint8_t>(static_cast<int8_t>(v));
      }
      out.scales[c] = group_scale(blocks[c]);
    }
  }

  // acc[r * acc_stride + 8 j + c] (output column c of group j0 + j) over panel blocks [0, blocks)
  // of rows row0.. (activation blocks b0..); panel[j * panel_blocks + b] is group j's block b.
  template <size_t R, size_t G>
  static void tile(const GroupBlock* panel, size_t panel_blocks, size_t j0, size_t blocks,
                   const QuantizedRowsView& x, size_t row0, size_t b0, float* acc,
                   size_t acc_stride) {
    for (size_t r = 0; r < R; ++r) {
      for (size_t j = 0; j < G; ++j) {
        float* out = acc + r * acc_stride + (j0 + j) * kGroupCols;
        for (size_t b = 0; b < blocks; ++b) {
          const GroupBlock& w = panel[(j0 + j) * panel_blocks + b];
          const int8_t* q = x.q_block(row0 + r, b0 + b);
          const float d = x.scale(row0 + r, b0 + b);
          for (size_t c = 0; c < kGroupCols; ++c) {
            int32_t p = x.block_bias(row0 + r, b0 + b);
            for (size_t jj = 0; jj < kQK; ++jj) {
              p += int32_t{static_cast<int8_t>(
                       w.codes[(jj / 4) * kGroupCols * 4 + c * 4 + jj % 4])} *
                   int32_t{q[jj]};
            }
            out[c] = std::fma(w.scales[c] * d, static_cast<float>(p), out[c]);
          }
        }
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
// Eight 32-bit lanes of eight vectors transposed: out[g] lane c = in[c] lane g.
ROUTEMM_CPU_AVX2 inline void transpose8x32(const __m256i in[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (size_t i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (size_t i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (size_t i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// group_block for the vector clones: Codes(block) gives a column's 32 codes in value order.
template <class Format, __m256i (*Codes)(const uint8_t*)>
ROUTEMM_CPU_AVX2 inline void group_block_avx2(const uint8_t* const* blocks, GroupBlock& out) {
  __m256i columns[kGroupCols], slices[kSlices];
  alignas(16) uint16_t scale_bits[kGroupCols];
  for (size_t c = 0; c < kGroupCols; ++c) {
    columns[c] = blocks[c] == nullptr ? _mm256_setzero_si256() : Codes(blocks[c]);
    scale_bits[c] = blocks[c] == nullptr ? 0 : block_scale_bits(blocks[c]);
  }
  // F16C widening is exact, as simd::widen (NaN payloads aside).
  _mm256_store_ps(out.scales,
                  _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scale_bits))));
  transpose8x32(columns, slices);
  for (size_t g = 0; g < kSlices; ++g) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.codes + g * 32), slices[g]);
  }
}

inline int32_t load_slice(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

// Lane c of the result = the sum of the eight lanes of t[c] (exact integer additions).
ROUTEMM_CPU_AVX2 inline __m256i sum_lanes8(const __m256i t[8]) {
  const __m256i h0123 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
  const __m256i h4567 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// The eight widened scales of blocks[c] (exact, as simd::widen; NaN payloads aside).
ROUTEMM_CPU_AVX2 inline __m256 group_scales(const uint8_t* const* blocks) {
  return _mm256_cvtph_ps(_mm_setr_epi16(static_cast<short>(block_scale_bits(blocks[0])),
                                        static_cast<short>(block_scale_bits(blocks[1])),
                                        static_cast<short>(block_scale_bits(blocks[2])),
                                        static_cast<short>(block_scale_bits(blocks[3])),
                                        static_cast<short>(block_scale_bits(blocks[4])),
                                        static_cast<short>(block_scale_bits(blocks[5])),
                                        static_cast<short>(block_scale_bits(blocks[6])),
                                        static_cast<short>(block_scale_bits(blocks[7]))));
}

// A zero weight block (zero scale) that stands in for the columns past the matrix.
alignas(64) inline constexpr uint8_t kZeroBlock[64] = {};

template <class Format>
struct Int8Avx2 {
  // Q4_0: nibbles (offset 8); Q8_0: the signed bytes (no offset: sign trick).
  static constexpr bool kSigned = Int8Codes<Format>::kCodeOffset != 8;
  static constexpr int32_t kOffset = kSigned ? 0 : 8;
  static constexpr size_t kTileRows = 2, kTileGroups = 2, kMatVecTileRows = 4, kStreamRows = 2;

  ROUTEMM_CPU_AVX2 static __m256i codes(const uint8_t* block) {
    if constexpr (kSigned) {
      return Int8Codes<Format>::signed_values(block);
    } else {
      return Int8Codes<Format>::unsigned_codes(block);
    }
  }
  ROUTEMM_CPU_AVX2 static void group_block(const uint8_t* const* blocks, GroupBlock& out) {
    group_block_avx2<Format, codes>(blocks, out);
  }

  // The mat-vec for few rows (R <= kStreamRows): eight columns stream along all of K with their
  // accumulators in registers; each block's eight columns are multiplied as they load and their
  // lanes summed per column (sum_lanes8), so nothing is rearranged through memory.
  template <size_t R>
  ROUTEMM_CPU_AVX2 static void stream_group(const Operands& ops, const QuantizedRowsView& x,
                                            size_t col, size_t cols, float* const* out_rows,
                                            size_t stride) {
    const uint8_t* rows[kGroupCols];
    for (size_t c = 0; c < kGroupCols; ++c) {
      rows[c] = c < cols ? ops.weight_row(col + c * stride) : kZeroBlock;
    }
    __m256 f[R];
    for (size_t r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
    for (size_t b = 0; b < x.blocks; ++b) {
      const uint8_t* blocks[kGroupCols];
      __m256i w[kGroupCols];
#pragma GCC unroll 8
      for (size_t c = 0; c < kGroupCols; ++c) {
        blocks[c] = c < cols ? rows[c] + b * Format::kBytes : kZeroBlock;
        w[c] = codes(blocks[c]);
      }
      const __m256 s = group_scales(blocks);
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q_block(r, b)));
        const __m256i ones16 = _mm256_set1_epi16(1);
        __m256i t[kGroupCols];
#pragma GCC unroll 8
        for (size_t c = 0; c < kGroupCols; ++c)
          t[c] = kSigned ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w[c]),
                                                                  _mm256_sign_epi8(q, w[c])),
                                             ones16)
                         : _mm256_madd_epi16(_mm256_maddubs_epi16(w[c], q), ones16);
        const __m256i p = _mm256_add_epi32(sum_lanes8(t), _mm256_set1_epi32(x.block_bias(r, b)));
        f[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(x.scale(r, b))),
                               _mm256_cvtepi32_ps(p), f[r]);
      }
    }
    for (size_t r = 0; r < R; ++r) {
      alignas(32) float out[kGroupCols];
      _mm256_store_ps(out, f[r]);
      for (size_t c = 0; c < cols; ++c) out_rows[r][col + c * stride] = out[c];
    }
  }

  template <size_t R, size_t G>
  ROUTEMM_CPU_AVX2 static void tile(const GroupBlock* panel, size_t panel_blocks, size_t j0,
                                    size_t blocks, const QuantizedRowsView& x, size_t row0,
                                    size_t b0, float* acc, size_t acc_stride) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 f[R][G];
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < G; ++j) {
        f[r][j] = _mm256_loadu_ps(acc + r * acc_stride + (j0 + j) * kGroupCols);
      }
    for (size_t b = 0; b < blocks; ++b) {
      __m256i t[R][G];
      for (size_t r = 0; r < R; ++r) {
        const __m256i bias = _mm256_set1_epi32(x.block_bias(row0 + r, b0 + b));
        for (size_t j = 0; j < G; ++j) t[r][j] = bias;
      }
#pragma GCC unroll 8
      for (size_t g = 0; g < kSlices; ++g) {
        __m256i w[G], magnitude[G];
        for (size_t j = 0; j < G; ++j) {
          w[j] = _mm256_load_si256(
              reinterpret_cast<const __m256i*>(panel[(j0 + j) * panel_blocks + b].codes + g * 32));
          if constexpr (kSigned) magnitude[j] = _mm256_abs_epi8(w[j]);
        }
        for (size_t r = 0; r < R; ++r) {
          const __m256i qb = _mm256_set1_epi32(load_slice(x.q_block(row0 + r, b0 + b) + 4 * g));
          for (size_t j = 0; j < G; ++j) {
            // Nibbles (<= 15) or |v| (<= 128) times |q| <= 127: every int16 pair sum fits.
            const __m256i pairs =
                kSigned ? _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(qb, w[j]))
                        : _mm256_maddubs_epi16(w[j], qb);
            t[r][j] = _mm256_add_epi32(t[r][j], _mm256_madd_epi16(pairs, ones16));
          }
        }
      }
      for (size_t r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(x.scale(row0 + r, b0 + b));
        for (size_t j = 0; j < G; ++j) {
          const __m256 s = _mm256_load_ps(panel[(j0 + j) * panel_blocks + b].scales);
          f[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), _mm256_cvtepi32_ps(t[r][j]), f[r][j]);
        }
      }
    }
    for (size_t r = 0; r < R; ++r)
      for (size_t j = 0; j < G; ++j) {
        _mm256_storeu_ps(acc + r * acc_stride + (j0 + j) * kGroupCols, f[r][j]);
      }
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX512
template <class Format>
struct Int8Vnni {
  static constexpr int32_t kOffset = Int8Codes<Format>::kCodeOffset;
  static constexpr size_t kTileRows = 4, kTileGroups = 2, kMatVecTileRows = 8, kStreamRows = 8;

  ROUTEMM_CPU_AVX512_VNNI static __m256i codes(const uint8_t* block) {
    return Int8Codes<Format>::unsigned_codes(block);
  }
  ROUTEMM_CPU_AVX512_VNNI static void group_block(const uint8_t* const* blocks, GroupBlock& out) {
    group_block_avx2<Format, Int8Codes<Format>::unsigned_codes>(blocks, out);
  }

  // The mat-vec for few rows (R <= kStreamRows): eight columns stream along all of K with their
  // accumulators in registers; each block's eight columns are multiplied as they load and their
  // lanes summed per column (sum_lanes8), so nothing is rearranged through memory.
  template <size_t R>
  ROUTEMM_CPU_AVX512_VNNI static void stream_group(const Operands& ops, const QuantizedRowsView& x,
                                                   size_t col, size_t cols, float* const* out_rows,
                                                   size_t stride) {
    const uint8_t* rows[kGroupCols];
    for (size_t c = 0; c < kGroupCols; ++c) {
      rows[c] = c < cols ? ops.weight_row(col + c * stride) : kZeroBlock;
    }
    __m256 f[R];
    for (size_t r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
    for (size_t b = 0; b < x.blocks; ++b) {
      const uint8_t* blocks[kGroupCols];
      __m256i w[kGroupCols];
#pragma GCC unroll 8
      for (size_t c = 0; c < kGroupCols; ++c) {
        blocks[c] = c < cols ? rows[c] + b * Format::kBytes : kZeroBlock;
        w[c] = codes(blocks[c]);
      }
      const __m256 s = group_scales(blocks);
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q_block(r, b)));

        __m256i t[kGroupCols];
#pragma GCC unroll 8
        for (size_t c = 0; c < kGroupCols; ++c)
          t[c] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[c], q);
        const __m256i p = _mm256_add_epi32(sum_lanes8(t), _mm256_set1_epi32(x.block_bias(r, b)));
        f[r] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(x.scale(r, b))),
                               _mm256_cvtepi32_ps(p), f[r]);
      }
    }
    for (size_t r = 0; r < R; ++r) {
      alignas(32) float out[kGroupCols];
      _mm256_store_ps(out, f[r]);
      for (size_t c = 0; c < cols; ++c) out_rows[r][col + c * stride] = out[c];
    }
  }

  template <size_t R, size_t G>
  ROUTEMM_CPU_AVX512_VNNI static void tile(const GroupBlock* panel, size_t panel_blocks, size_t j0,
                                           size_t blocks, const QuantizedRowsView& x, size_t row0,
                                           size_t b0, float* acc, size_t acc_stride) {
    __m256 f[R][G];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t j = 0; j < G; ++j) {
        f[r][j] = _mm256_loadu_ps(acc + r * acc_stride + (j0 + j) * kGroupCols);
      }
    for (size_t b = 0; b < blocks; ++b) {
      __m256i t[R][G];
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const __m256i bias = _mm256_set1_epi32(x.block_bias(row0 + r, b0 + b));
#pragma GCC unroll 8
        for (size_t j = 0; j < G; ++j) t[r][j] = bias;
      }
#pragma GCC unroll 8
      for (size_t g = 0; g < kSlices; ++g) {
        __m256i w[G];
#pragma GCC unroll 8
        for (size_t j = 0; j < G; ++j) {
          w[j] = _mm256_load_si256(
              reinterpret_cast<const __m256i*>(panel[(j0 + j) * panel_blocks + b].codes + g * 32));
        }
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const __m256i qb = _mm256_set1_epi32(load_slice(x.q_block(row0 + r, b0 + b) + 4 * g));
#pragma GCC unroll 8
          for (size_t j = 0; j < G; ++j) t[r][j] = _mm256_dpbusd_epi32(t[r][j], w[j], qb);
        }
      }
#pragma GCC unroll 8
      for (size_t r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(x.scale(row0 + r, b0 + b));
#pragma GCC unroll 8
        for (size_t j = 0; j < G; ++j) {
          const __m256 s = _mm256_load_ps(panel[(j0 + j) * panel_blocks + b].scales);
          f[r][j] = _mm256_fmadd_ps(_mm256_mul_ps(s, d), _mm256_cvtepi32_ps(t[r][j]), f[r][j]);
        }
      }
    }
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t j = 0; j < G; ++j) {
        _mm256_storeu_ps(acc + r * acc_stride + (j0 + j) * kGroupCols, f[r][j]);
      }
  }
};
#endif

#if ROUTEMM_CPU_HAVE_NEON
// aarch64 SDOT clone, defined in neon_int8_dot.h (included at the end of this file).
template <class Format>
struct Int8NeonDot;
#endif

// ---- Work items ---------------------------------------------------------------------------------

// Blocks per panel: 8 groups x 8 blocks of GroupBlock are 18 KiB, next to the tile's rows of q.
constexpr size_t kPanelBlocks = 8;
constexpr size_t kItemGroups = kMmOutputTile / kGroupCols;  // groups of one 64-output item

template <class Isa, size_t G, size_t R>
void tile_rows(size_t rows, const GroupBlock* panel, size_t j0, size_t blocks,
               const QuantizedRowsView& x, size_t row0, size_t b0, float* acc, size_t acc_stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows<Isa, G, R - 1>(rows, panel, j0, blocks, x, row0, b0, acc, acc_stride);
      return;
    }
  }
  Isa::template tile<R, G>(panel, kPanelBlocks, j0, blocks, x, row0, b0, acc, acc_stride);
}

// Rows [row0, row0 + rows) of x x outputs [col0, col0 + cols <= kMmOutputTile) of the weights in
// ops, written to out_rows[r][col0 + c]: each panel of kPanelBlocks blocks is rearranged once into
// column groups and the register tiles (kTileGroups groups wide) run over it. Columns past the
// matrix get zero codes and scales and are never stored.
template <class Isa, class Format, size_t kTileGroups = Isa::kTileGroups,
          size_t kTileRows = Isa::kTileRows>
void item(const Operands& ops, const QuantizedRowsView& x, size_t row0, size_t rows, size_t col0,
          size_t cols, float* const* out_rows) {
  static_assert(kItemGroups % kTileGroups == 0);
  thread_local std::vector<GroupBlock> panel(kItemGroups * kPanelBlocks);
  thread_local std::vector<float> acc_scratch;
  const size_t acc_stride = kMmOutputTile;
  acc_scratch.assign(rows * acc_stride, 0.0f);
  float* acc = acc_scratch.data();
  const size_t groups = (cols + kGroupCols - 1) / kGroupCols;
  const size_t groups_pad = (groups + kTileGroups - 1) / kTileGroups * kTileGroups;
  for (size_t b0 = 0; b0 < x.blocks; b0 += kPanelBlocks) {
    const size_t blocks = std::min(kPanelBlocks, x.blocks - b0);
    for (size_t j = 0; j < groups_pad; ++j) {
      for (size_t b = 0; b < blocks; ++b) {
        const uint8_t* column_blocks[kGroupCols];
        for (size_t c = 0; c < kGroupCols; ++c) {
          const size_t col = j * kGroupCols + c;
          column_blocks[c] =
              col < cols ? ops.weight_row(col0 + col) + (b0 + b) * Format::kBytes : nullptr;
        }
        Isa::group_block(column_blocks, panel[j * kPanelBlocks + b]);
      }
    }
    // Ask for the next panel's weight bytes now: a short segment of each of 64 rows, which the
    // hardware prefetchers do not predict, arrives while this panel's tiles run.
    if (b0 + kPanelBlocks < x.blocks) {
      const size_t next_bytes =
          std::min(kPanelBlocks, x.blocks - b0 - kPanelBlocks) * Format::kBytes;
      for (size_t c = 0; c < cols; ++c) {
        const uint8_t* next = ops.weight_row(col0 + c) + (b0 + kPanelBlocks) * Format::kBytes;
        for (size_t off = 0; off < next_bytes; off += 64) __builtin_prefetch(next + off);
      }
    }
    for (size_t j = 0; j < groups_pad; j += kTileGroups) {
      for (size_t r = 0; r < rows; r += kTileRows) {
        tile_rows<Isa, kTileGroups, kTileRows>(std::min(kTileRows, rows - r), panel.data(), j,
                                               blocks, x, row0 + r, b0, acc + r * acc_stride,
                                               acc_stride);
      }
    }
  }
  for (size_t r = 0; r < rows; ++r)
    std::copy(acc + r * acc_stride, acc + r * acc_stride + cols, out_rows[r] + col0);
}

// Isa::stream_group<rows> (rows <= Isa::kStreamRows) on `cols` (<= kGroupCols) columns `stride`
// apart from `col`.
template <class Isa, size_t R = Isa::kStreamRows>
void stream_rows(size_t rows, const Operands& ops, const QuantizedRowsView& x, size_t col,
                 size_t cols, float* const* out_rows, size_t stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      stream_rows<Isa, R - 1>(rows, ops, x, col, cols, out_rows, stride);
      return;
    }
  }
  if constexpr (R > 0) Isa::template stream_group<R>(ops, x, col, cols, out_rows, stride);
}

// The mat-vec's item (at most 8 rows): one column group at a time, so that the weights stream
// through eight rows at once, as far along K as the group goes, rather than through 64. A group
// takes one column from each of kGroupCols equal segments of the item (long weight streams, as
// the exact mat-vec's passes), the columns left over in groups of neighbours.
template <class Isa, class Format>
void mat_vec_item(const Operands& ops, const QuantizedRowsView& x, size_t row0, size_t rows,
                  size_t col0, size_t cols, float* const* out_rows) {
  if (rows <= Isa::kStreamRows) {
    const QuantizedRowsView from_row0 = x.from(row0);
    const size_t seg = cols / kGroupCols;
    for (size_t j = 0; j < seg; ++j) {
      stream_rows<Isa>(rows, ops, from_row0, col0 + j, kGroupCols, out_rows, seg);
    }
    for (size_t c = seg * kGroupCols; c < cols; c += kGroupCols) {
      stream_rows<Isa>(rows, ops, from_row0, col0 + c, std::min(kGroupCols, cols - c), out_rows, 1);
    }
    return;
  }
  for (size_t c = 0; c < cols; c += kGroupCols) {
    item<Isa, Format, 1, Isa::kMatVecTileRows>(ops, x, row0, rows, col0 + c,
                                               std::min(kGroupCols, cols - c), out_rows);
  }
}

using Item = void (*)(const Operands&, const QuantizedRowsView&, size_t, size_t, size_t, size_t,
                      float* const*);

// The clone this process runs: its matrix and mat-vec items and the code offset its activations
// need.
struct Clone {
  Item item, mat_vec_item;
  int32_t offset;
};

template <class Format>
Clone clone_for() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512_vnni()) {
    using Isa = Int8Vnni<Format>;
    return {item<Isa, Format>, mat_vec_item<Isa, Format>, Isa::kOffset};
  }
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) {
    using Isa = Int8Avx2<Format>;
    return {item<Isa, Format>, mat_vec_item<Isa, Format>, Isa::kOffset};
  }
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon_dotprod()) {
    using Isa = Int8NeonDot<Format>;
    return {item<Isa, Format>, mat_vec_item<Isa, Format>, Isa::kOffset};
  }
#endif
  using Isa = Int8Portable<Format>;
  return {item<Isa, Format>, mat_vec_item<Isa, Format>, Isa::kOffset};
}

}  // namespace routemm::cpu::ggml::int8

#if ROUTEMM_CPU_HAVE_NEON
#include "neon_int8_dot.h"
#endif
