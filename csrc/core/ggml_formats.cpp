// Reference codecs of the GGML block formats (routemm/ggml_formats.h). Each function follows the
// arithmetic of ggml's reference (dequantize_row_* / quantize_row_*_ref) operation by operation, in
// F32, so the results are the same bits: compiled with -ffp-contract=off (no fused multiply-adds),
// scales decoded from binary16 (or E8M0 for MXFP4) exactly.
#include "routemm/ggml_formats.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "routemm/error.h"
#include "routemm/q4_0.h"
#include "routemm/q8_0.h"

namespace routemm::ggml_formats {
namespace {

constexpr size_t kQK = 32;    // values per block of the 32-value formats
constexpr size_t kQKK = 256;  // values per super-block of the K-quants

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return q4_0::half_bits_to_float(bits);
}

void put_half(uint8_t* p, float value) {
  const uint16_t bits = q4_0::float_to_half_bits(value);
  std::memcpy(p, &bits, 2);
}

// ---- Q4_0 and Q8_0: the codecs of q4_0.h / q8_0.h ----------------------------------------------

void q4_0_dequantize(const uint8_t* block, float* out) {
  q4_0::dequantize({block, 18}, {out, kQK});
}
void q4_0_quantize(const float* x, uint8_t* out) { q4_0::quantize({x, kQK}, {out, 18}); }
void q8_0_dequantize(const uint8_t* block, float* out) {
  q8_0::dequantize({block, 34}, {out, kQK});
}
void q8_0_quantize(const float* x, uint8_t* out) { q8_0::quantize({x, kQK}, {out, 34}); }

// ---- Q4_1: d, m (binary16), 16 bytes of nibbles; y = q * d + m -----------------------------------

void q4_1_dequantize(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (size_t j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + kQK / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// The block's min and max as the reference finds them (comparisons in order; NaN never wins).
std::pair<float, float> min_max(const float* x) {
  float min = FLT_MAX, max = -FLT_MAX;
  for (size_t j = 0; j < kQK; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
  return {min, max};
}

void q4_1_quantize(const float* x, uint8_t* b) {
  const auto [min, max] = min_max(x);
  const float d = (max - min) / ((1 << 4) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  put_half(b, d);
  put_half(b + 2, min);
  for (size_t j = 0; j < kQK / 2; ++j) {
    const float x0 = (x[j] - min) * id, x1 = (x[kQK / 2 + j] - min) * id;
    const uint8_t xi0 = std::min<int8_t>(15, static_cast<int8_t>(x0 + 0.5f));
    const uint8_t xi1 = std::min<int8_t>(15, static_cast<int8_t>(x1 + 0.5f));
    b[4 + j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
  }
}

// ---- Q5_0 / Q5_1: d (and m), 32 high bits, 16 bytes of low nibbles -------------------------------

uint32_t high_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  return qh;
}

void q5_dequantize(const uint8_t* qh_bytes, const uint8_t* qs, float d, float m, bool offset,
                   float* y) {
  const uint32_t qh = high_bits(qh_bytes);
  for (size_t j = 0; j < kQK / 2; ++j) {
    const uint8_t xh0 = static_cast<uint8_t>(((qh >> j) << 4) & 0x10);
    const uint8_t xh1 = static_cast<uint8_t>((qh >> (j + 12)) & 0x10);
    if (offset) {  // Q5_0: centred codes, no min
      const int32_t x0 = ((qs[j] & 0x0F) | xh0) - 16, x1 = ((qs[j] >> 4) | xh1) - 16;
      y[j] = static_cast<float>(x0) * d;
      y[j + kQK / 2] = static_cast<float>(x1) * d;
    } else {
      const int32_t x0 = (qs[j] & 0x0F) | xh0, x1 = (qs[j] >> 4) | xh1;
      y[j] = static_cast<float>(x0) * d + m;
      y[j + kQK / 2] = static_cast<float>(x1) * d + m;
    }
  }
}

void q5_0_dequantize(const uint8_t* b, float* y) {
  q5_dequantize(b + 2, b + 6, half_at(b), 0.0f, true, y);
}
void q5_1_dequantize(const uint8_t* b, float* y) {
  q5_dequantize(b + 4, b + 8, half_at(b), half_at(b + 2), false, y);
}

void q5_pack(uint8_t* qh_bytes, uint8_t* qs, size_t j, uint8_t xi0, uint8_t xi1, uint32_t& qh) {
  qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
  qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
  qh |= ((xi1 & 0x10u) >> 4) << (j + kQK / 2);
  if (j == kQK / 2 - 1) std::memcpy(qh_bytes, &qh, 4);
}

void q5_0_quantize(const float* x, uint8_t* b) {
  float amax = 0.0f, max = 0.0f;
  for (size_t j = 0; j < kQK; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -16;
  const float id = d ? 1.0f / d : 0.0f;
  put_half(b, d);
  uint32_t qh = 0;
  for (size_t j = 0; j < kQK / 2; ++j) {
    const float x0 = x[j] * id, x1 = x[kQK / 2 + j] * id;
    const uint8_t xi0 = std::min<int8_t>(31, static_cast<int8_t>(x0 + 16.5f));
    const uint8_t xi1 = std::min<int8_t>(31, static_cast<int8_t>(x1 + 16.5f));
    q5_pack(b + 2, b + 6, j, xi0, xi1, qh);
  }
}

void q5_1_quantize(const float* x, uint8_t* b) {
  const auto [min, max] = min_max(x);
  const float d = (max - min) / ((1 << 5) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  put_half(b, d);
  put_half(b + 2, min);
  uint32_t qh = 0;
  for (size_t j = 0; j < kQK / 2; ++j) {
    const float x0 = (x[j] - min) * id, x1 = (x[kQK / 2 + j] - min) * id;
    q5_pack(b + 4, b + 8, j, static_cast<uint8_t>(x0 + 0.5f), static_cast<uint8_t>(x1 + 0.5f), qh);
  }
}

// ---- K-quants: 256-value super-blocks -------------------------------------------------------------

// The 6-bit scale and min of sub-block j (of 8) from Q4_K / Q5_K's 12 packed bytes.
void scale_min_k4(size_t j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

// Q4_K: d, dmin (binary16), 12 scale bytes, 128 bytes of nibbles.
void q4_k_dequantize(const uint8_t* b, float* y) {
  const float d = half_at(b), min = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  size_t is = 0;
  for (size_t j = 0; j < kQKK; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, sc, m);
    const float d1 = d * sc, m1 = min * m;
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * sc, m2 = min * m;
    for (size_t l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (size_t l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

// Q5_K: d, dmin, 12 scale bytes, 32 bytes of high bits, 128 bytes of low nibbles.
void q5_k_dequantize(const uint8_t* b, float* y) {
  const float d = half_at(b), min = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  size_t is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (size_t j = 0; j < kQKK; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is + 0, scales, sc, m);
    const float d1 = d * sc, m1 = min * m;
    scale_min_k4(is + 1, scales, sc, m);
    const float d2 = d * sc, m2 = min * m;
    for (size_t l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<float>((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
    }
    for (size_t l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
    ql += 32;
    is += 2;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, d (binary16).
void q6_k_dequantize(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (size_t n = 0; n < kQKK; n += 128) {
    for (size_t l = 0; l < 32; ++l) {
      const size_t is = l / 16;
      const int8_t q1 = static_cast<int8_t>(((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
      const int8_t q2 = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      const int8_t q3 = static_cast<int8_t>(((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      const int8_t q4 = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// ---- MXFP4: one E8M0 exponent, 16 bytes of FP4 (E2M1) codes ---------------------------------------

// The E2M1 values, doubled (so they are integers); the block's scale is halved to match.
constexpr std::array<int8_t, 16> kMxfp4Values = {0, 1,  2,  3,  4,  6,  8,  12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 127) / 2 as ggml computes it (subnormal for e < 2).
float e8m0_to_float_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  return std::bit_cast<float>(bits);
}

void mxfp4_dequantize(const uint8_t* b, float* y) {
  const float d = e8m0_to_float_half(b[0]);
  const uint8_t* qs = b + 1;
  for (size_t j = 0; j < kQK / 2; ++j) {
    y[j] = static_cast<float>(kMxfp4Values[qs[j] & 0x0F]) * d;
    y[j + kQK / 2] = static_cast<float>(kMxfp4Values[qs[j] >> 4]) * d;
  }
}

uint8_t mxfp4_best_index(float x, float e) {
  uint8_t best = 0;
  float best_err = std::fabs(static_cast<float>(kMxfp4Values[0]) * e - x);
  for (uint8_t i = 1; i < 16; ++i) {
    const float err = std::fabs(static_cast<float>(kMxfp4Values[i]) * e - x);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

void mxfp4_quantize(const float* x, uint8_t* b) {
  float amax = 0.0f;
  for (size_t j = 0; j < kQK; ++j) {
    if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
  }
  const uint8_t e =
      amax > 0.0f ? static_cast<uint8_t>(std::floor(std::log2(amax)) - 2 + 127) : uint8_t{0};
  const float d = e8m0_to_float_half(e);
  b[0] = e;
  for (size_t j = 0; j < kQK / 2; ++j) {
    b[1 + j] = static_cast<uint8_t>(mxfp4_best_index(x[j], d) |
                                    (mxfp4_best_index(x[kQK / 2 + j], d) << 4));
  }
}

constexpr std::array<Format, 9> kFormats = {{
    {"q4_0", kQK, 18, &q4_0_dequantize, &q4_0_quantize},
    {"q4_1", kQK, 20, &q4_1_dequantize, &q4_1_quantize},
    {"q5_0", kQK, 22, &q5_0_dequantize, &q5_0_quantize},
    {"q5_1", kQK, 24, &q5_1_dequantize, &q5_1_quantize},
    {"q8_0", kQK, 34, &q8_0_dequantize, &q8_0_quantize},
    {"q4_k", kQKK, 144, &q4_k_dequantize, nullptr},
    {"q5_k", kQKK, 176, &q5_k_dequantize, nullptr},
    {"q6_k", kQKK, 210, &q6_k_dequantize, nullptr},
    {"mxfp4", kQK, 17, &mxfp4_dequantize, &mxfp4_quantize},
}};

}  // namespace

std::span<const Format> formats() { return kFormats; }

const Format& format(std::string_view name) {
  std::string names;
  for (const Format& f : kFormats) {
    if (f.name == name) return f;
    names += (names.empty() ? "" : ", ") + std::string(f.name);
  }
  throw InvalidArgument("ggml format: unknown block format '" + std::string(name) +
                        "' (known: " + names + ")");
}

void dequantize(const Format& f, std::span<const uint8_t> src, std::span<float> dst) {
  if (src.size() % f.block_bytes != 0 ||
      dst.size() != src.size() / f.block_bytes * f.block_values) {
    throw InvalidArgument(std::string(f.name) + " dequantize: " + std::to_string(src.size()) +
                          " bytes are not whole blocks for " + std::to_string(dst.size()) +
                          " values");
  }
  for (size_t b = 0; b < src.size() / f.block_bytes; ++b) {
    f.dequantize_block(src.data() + b * f.block_bytes, dst.data() + b * f.block_values);
  }
}

void quantize(const Format& f, std::span<const float> src, std::span<uint8_t> dst) {
  static_assert(std::endian::native == std::endian::little, "GGML block scales are little endian");
  if (f.quantize_block == nullptr) {
    throw InvalidArgument(std::string(f.name) +
                          " quantize: routemm has no reference quantiser for this format yet");
  }
  if (src.size() % f.block_values != 0 ||
      dst.size() != src.size() / f.block_values * f.block_bytes) {
    throw InvalidArgument(std::string(f.name) + " quantize: " + std::to_string(src.size()) +
                          " values are not whole blocks for " + std::to_string(dst.size()) +
                          " bytes");
  }
  for (size_t b = 0; b < src.size() / f.block_values; ++b) {
    f.quantize_block(src.data() + b * f.block_values, dst.data() + b * f.block_bytes);
  }
}

}  // namespace routemm::ggml_formats
