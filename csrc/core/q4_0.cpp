// Reference Q4_0 quantiser/dequantiser (see routemm/q4_0.h for the contract). This file is
// compiled with -ffp-contract=off: `x * inv + 8.5` must be two rounded operations, as in the
// reference, or a value on a rounding boundary could land in the neighbouring nibble.
#include "routemm/q4_0.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "ggml_block_codec.h"
#include "routemm/error.h"

namespace routemm::q4_0 {

uint16_t float_to_half_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // inf or NaN: keep a quiet NaN's top payload bits
    const uint32_t nan = magnitude > 0x7f800000u ? (0x0200u | ((magnitude >> 13) & 0x03ffu)) : 0;
    return static_cast<uint16_t>(sign | 0x7c00u | nan);
  }
  // Values at or above 65520 (the midpoint between 65504 and 65536) round to infinity.
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    // binary16 subnormal (or zero): the result is magnitude / 2^-24 rounded to an integer, nearest
    // even; the scaling is exact and nearbyint rounds in the default (nearest-even) mode. A result
    // of 1024 is the smallest normal's encoding, so the carry needs no special case.
    const float scaled = std::bit_cast<float>(magnitude) * 0x1p24f;  // exact: power of two
    const float rounded = std::nearbyint(scaled);  // default rounding mode: nearest even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  // Normal: rebias and round the 13 dropped mantissa bits to nearest even. A carry out of the
  // mantissa correctly bumps the exponent (and 65504 + carry cannot happen: checked above).
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t lsb = (rebased >> 13) & 1u;
  const uint32_t rounded = (rebased + 0x0fffu + lsb) >> 13;
  return static_cast<uint16_t>(sign | rounded);
}

float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  uint32_t bits;
  if (magnitude >= 0x7c00u) {
    bits = 0x7f800000u | ((magnitude & 0x03ffu) << 13);
  } else if (magnitude >= 0x0400u) {
    bits = (magnitude << 13) + (112u << 23);
  } else {
    bits = std::bit_cast<uint32_t>(static_cast<float>(magnitude) * 0x1p-24f);  // exact
  }
  return std::bit_cast<float>(bits | sign);
}

namespace {

struct Q4_0Codec {
  static constexpr std::string_view kName = "q4_0";
  static constexpr size_t kBlockValues = q4_0::kBlockValues, kBlockBytes = q4_0::kBlockBytes;
  static void quantize_block(const float* x, uint8_t* out);
  static void dequantize_block(const uint8_t* block, float d, float* out) {
    for (size_t j = 0; j < kBlockValues / 2; ++j) {
      out[j] = d * static_cast<float>((block[2 + j] & 0x0f) - 8);
      out[j + kBlockValues / 2] = d * static_cast<float>((block[2 + j] >> 4) - 8);
    }
  }
};

void Q4_0Codec::quantize_block(const float* x, uint8_t* out) {
  // Starting from x[0] (not from +0) matters for an all-zero block of -0.0: the reference then
  // picks -0.0 as its max and stores d = +0.0.
  float amax = std::fabs(x[0]), max = x[0];
  for (size_t j = 1; j < kBlockValues; ++j) {
    const float magnitude = std::fabs(x[j]);
    if (magnitude > amax) {  // strict: the first value of largest magnitude wins a tie
      amax = magnitude;
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float inv = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t d_bits = float_to_half_bits(d);
  std::memcpy(out, &d_bits, 2);  // little endian host (checked in quantize)
  uint8_t nibbles[kBlockValues];
  for (size_t j = 0; j < kBlockValues; ++j) {
    const float scaled = x[j] * inv;
    const float shifted = scaled + 8.5f;
    // A non-finite value only arises when d is subnormal and 1 / d overflows; it gives nibble 0,
    // as the NumPy reference does on x86 (ggml leaves the case undefined).
    const float truncated = std::isfinite(shifted) ? std::trunc(shifted) : 0.0f;
    // |x * inv| <= 8 up to rounding, so truncated lies in [0, 16]; the clamps keep the casts
    // defined whatever happens.
    nibbles[j] = truncated >= 15.0f ? 15 : truncated <= 0.0f ? 0 : static_cast<uint8_t>(truncated);
  }
  for (size_t j = 0; j < kBlockValues / 2; ++j) {
    out[2 + j] = static_cast<uint8_t>(nibbles[j] | (nibbles[j + kBlockValues / 2] << 4));
  }
}

}  // namespace

size_t quantized_bytes(size_t values) { return ggml_codec::quantized_bytes<Q4_0Codec>(values); }

void quantize(std::span<const float> src, std::span<uint8_t> dst) {
  ggml_codec::quantize<Q4_0Codec>(src, dst);
}

void dequantize(std::span<const uint8_t> src, std::span<float> dst) {
  ggml_codec::dequantize<Q4_0Codec>(src, dst);
}

}  // namespace routemm::q4_0
