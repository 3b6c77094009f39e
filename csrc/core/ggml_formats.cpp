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

// ---- K-quant reference quantisers (no importance matrix) ------------------------------------------
// Each step is ggml's quantize_row_q{4,5,6}_K_ref's, in the same order and in F32: the sums
// accumulate left to right, ints convert to float where the reference's C promotions put them, and
// narrowing conversions wrap as the reference's stores do. Inputs the reference does not guard
// (infinities, NaN, values past 2^22 in a step) take the same path through the same operations.

// Round to nearest by the reference's magic-number addition: exact for |v| <= 2^22 - 1; beyond
// that (and for NaN) the same bits the reference gets.
int nearest_int(float v) {
  const float biased = v + 12582912.f;
  return static_cast<int>(std::bit_cast<uint32_t>(biased) & 0x007fffffu) - 0x00400000;
}

template <class T>
T clamp_int(T v, T lo, T hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// One 32-value sub-block of Q4_K / Q5_K: codes L in [0, nmax] for x ~ scale * L - the_min, the
// scale and min chosen by a weighted least-squares search over nstep + 1 candidate scales.
float fit_scale_min(const float* x, const float* w, int nmax, float rmin, float rdelta, int nstep,
                    uint8_t* L, float& the_min) {
  constexpr int n = 32;
  std::array<uint8_t, n> trial{};
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + n, uint8_t{0});
    the_min = -min;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(clamp_int(nearest_int(iscale * (x[i] - min)), 0, nmax));
    float diff = scale * static_cast<float>(L[i]) + min - x[i];
    diff = diff * diff;
    best_error += w[i] * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(nearest_int(iscale * (x[i] - min)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float fl = static_cast<float>(l);
      sum_l += w[i] * fl;
      sum_l2 += w[i] * fl * fl;
      sum_xl += w[i] * fl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (det > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * static_cast<float>(trial[i]) + this_min - x[i];
        diff = diff * diff;
        cur_error += w[i] * diff;
      }
      if (cur_error < best_error) {
        std::copy(trial.begin(), trial.end(), L);
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  the_min = -min;
  return scale;
}

// Q4_K and Q5_K share everything but the code width and the search's first candidate: per
// sub-block scales and mins, both quantised to 6 bits against the block's largest, then the codes
// requantised with the stored (binary16-rounded) scales. Fills d, dmin and the 12 scale bytes at
// `b`; returns the codes in L.
void k_scales_and_codes(const float* x, uint8_t* b, int nmax, float rmin, int nstep,
                        std::array<uint8_t, kQKK>& L) {
  std::array<float, 8> scales{}, mins{};
  std::array<float, 32> weights{};
  float max_scale = 0, max_min = 0;
  for (size_t j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (size_t l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (size_t l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] =
        fit_scale_min(xs, weights.data(), nmax, rmin, 0.1f, nstep, L.data() + 32 * j, mins[j]);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t* sc = b + 4;
  for (size_t j = 0; j < 8; ++j) {
    const uint8_t ls =
        std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    const uint8_t lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] = static_cast<uint8_t>(sc[j - 4] | ((ls >> 4) << 6));
      sc[j] = static_cast<uint8_t>(sc[j] | ((lm >> 4) << 6));
    }
  }
  put_half(b, max_scale / 63.f);
  put_half(b + 2, max_min / 63.f);
  const float d_all = half_at(b), dmin_all = half_at(b + 2);
  for (size_t j = 0; j < 8; ++j) {
    uint8_t s, m;
    scale_min_k4(j, sc, s, m);
    const float d = d_all * static_cast<float>(s);
    if (d == 0.0f) continue;  // the sub-block keeps the codes of its fit
    const float dm = dmin_all * static_cast<float>(m);
    for (size_t i = 0; i < 32; ++i) {
      L[32 * j + i] =
          static_cast<uint8_t>(clamp_int(nearest_int((x[32 * j + i] + dm) / d), 0, nmax));
    }
  }
}

void q4_k_quantize(const float* x, uint8_t* b) {
  std::array<uint8_t, kQKK> L{};
  k_scales_and_codes(x, b, 15, -1.f, 20, L);
  uint8_t* q = b + 16;
  for (size_t j = 0; j < kQKK; j += 64) {
    for (size_t l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
    q += 32;
  }
}

void q5_k_quantize(const float* x, uint8_t* b) {
  std::array<uint8_t, kQKK> L{};
  k_scales_and_codes(x, b, 31, -0.5f, 15, L);
  uint8_t* qh = b + 16;
  uint8_t* ql = b + 48;
  std::fill(qh, qh + 32, uint8_t{0});
  uint8_t m1 = 1, m2 = 2;
  for (size_t n = 0; n < kQKK; n += 64) {
    for (size_t j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (l1 > 15) {
        l1 -= 16;
        qh[j] |= m1;
      }
      if (l2 > 15) {
        l2 -= 16;
        qh[j] |= m2;
      }
      ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
    }
    m1 = static_cast<uint8_t>(m1 << 2);
    m2 = static_cast<uint8_t>(m2 << 2);
    ql += 32;
  }
}

// One 16-value sub-block of Q6_K: signed codes L - 32 in [-32, 31] for x ~ scale * (L - 32),
// the scale chosen among 19 candidates by the x^2-weighted fit (ggml's make_qx_quants, type 1).
float fit_scale_signed(const float* x, int8_t* L) {
  constexpr int n = 16, nmax = 32;
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < 1e-15f) {  // an all-zero sub-block
    std::fill(L, L + n, int8_t{0});
    return 0.f;
  }
  const auto fit = [&](float iscale, float& sumlx, float& suml2) {
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const float fl = static_cast<float>(clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * fl;
      suml2 += w * fl * fl;
    }
  };
  const auto store = [&](float iscale) {
    for (int i = 0; i < n; ++i) {
      L[i] = static_cast<int8_t>(nmax + clamp_int(nearest_int(iscale * x[i]), -nmax, nmax - 1));
    }
  };
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx, suml2;
  fit(iscale, sumlx, suml2);
  store(iscale);
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    fit(iscale, sumlx, suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      store(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

void q6_k_quantize(const float* x, uint8_t* b) {
  std::array<int8_t, kQKK> L{};
  std::array<float, 16> scales{};
  float max_scale = 0, max_abs_scale = 0;
  for (size_t ib = 0; ib < 16; ++ib) {
    scales[ib] = fit_scale_signed(x + 16 * ib, L.data() + 16 * ib);
    const float abs_scale = std::fabs(scales[ib]);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scales[ib];
    }
  }
  if (max_abs_scale < 1e-15f) {  // an all-zero block: every byte zero
    std::fill(b, b + 210, uint8_t{0});
    return;
  }
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  auto* sc = reinterpret_cast<int8_t*>(b + 192);
  const float iscale = -128.f / max_scale;
  put_half(b + 208, 1 / iscale);
  for (size_t ib = 0; ib < 16; ++ib) {
    sc[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
  }
  const float d_all = half_at(b + 208);
  for (size_t j = 0; j < 16; ++j) {
    const float d = d_all * static_cast<float>(sc[j]);
    if (d == 0.0f) continue;  // the sub-block keeps the codes of its fit
    for (size_t i = 0; i < 16; ++i) {
      L[16 * j + i] = static_cast<int8_t>(clamp_int(nearest_int(x[16 * j + i] / d), -32, 31) + 32);
    }
  }
  for (size_t j = 0; j < kQKK; j += 128) {
    for (size_t l = 0; l < 32; ++l) {
      const auto code = [&](size_t k) { return static_cast<uint8_t>(L[j + l + k]); };
      ql[l] = static_cast<uint8_t>((code(0) & 0xF) | ((code(64) & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((code(32) & 0xF) | ((code(96) & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((code(0) >> 4) | ((code(32) >> 4) << 2) |
                                   ((code(64) >> 4) << 4) | ((code(96) >> 4) << 6));
    }
    ql += 64;
    qh += 32;
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
    {"q4_k", kQKK, 144, &q4_k_dequantize, &q4_k_quantize},
    {"q5_k", kQKK, 176, &q5_k_dequantize, &q5_k_quantize},
    {"q6_k", kQKK, 210, &q6_k_dequantize, &q6_k_quantize},
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
