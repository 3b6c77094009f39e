// Reference Q8_0 quantiser/dequantiser (see routemm/q8_0.h for the contract). Compiled with
// -ffp-contract=off like q4_0.cpp: `x * inv` must be rounded before it is rounded to an integer.
#include "routemm/q8_0.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "routemm/error.h"
#include "routemm/q4_0.h"

namespace routemm::q8_0 {

size_t quantized_bytes(size_t values) {
  if (values % kBlockValues != 0) {
    throw InvalidArgument("q8_0: " + std::to_string(values) + " values are not a multiple of " +
                          std::to_string(kBlockValues));
  }
  return values / kBlockValues * kBlockBytes;
}

namespace {

// The byte the reference stores for x * inv: rounded half away from zero, converted to int32 the
// way x86 does (values outside the int32 range and NaN give INT32_MIN), then truncated to its
// low byte. In-contract values always lie in [-127, 127].
uint8_t quant_byte(float scaled) {
  const float rounded = std::round(scaled);
  if (!(std::fabs(rounded) < 0x1p31f)) return 0;  // NaN, inf or out of int32 range: low byte 0
  return static_cast<uint8_t>(static_cast<uint32_t>(static_cast<int32_t>(rounded)) & 0xffu);
}

void quantize_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (size_t j = 0; j < kBlockValues; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float inv = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t d_bits = q4_0::float_to_half_bits(d);
  std::memcpy(out, &d_bits, 2);  // little endian host (checked in quantize)
  for (size_t j = 0; j < kBlockValues; ++j) out[2 + j] = quant_byte(x[j] * inv);
}

}  // namespace

void quantize(std::span<const float> src, std::span<uint8_t> dst) {
  static_assert(std::endian::native == std::endian::little, "Q8_0 scales are little endian");
  if (dst.size() != quantized_bytes(src.size())) {
    throw InvalidArgument("q8_0 quantize: " + std::to_string(src.size()) + " values need " +
                          std::to_string(quantized_bytes(src.size())) + " bytes, got " +
                          std::to_string(dst.size()));
  }
  const size_t blocks = src.size() / kBlockValues;
  for (size_t b = 0; b < blocks; ++b) {
    quantize_block(src.data() + b * kBlockValues, dst.data() + b * kBlockBytes);
  }
}

void dequantize(std::span<const uint8_t> src, std::span<float> dst) {
  if (src.size() % kBlockBytes != 0 || dst.size() != src.size() / kBlockBytes * kBlockValues) {
    throw InvalidArgument("q8_0 dequantize: " + std::to_string(src.size()) +
                          " bytes are not whole blocks for " + std::to_string(dst.size()) +
                          " values");
  }
  const size_t blocks = src.size() / kBlockBytes;
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* block = src.data() + b * kBlockBytes;
    uint16_t d_bits;
    std::memcpy(&d_bits, block, 2);
    const float d = q4_0::half_bits_to_float(d_bits);
    float* out = dst.data() + b * kBlockValues;
    for (size_t j = 0; j < kBlockValues; ++j) {
      out[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
    }
  }
}

}  // namespace routemm::q8_0
