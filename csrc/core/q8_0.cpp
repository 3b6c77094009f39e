// Reference Q8_0 quantiser/dequantiser (see routemm/q8_0.h for the contract). Compiled with
// -ffp-contract=off like q4_0.cpp: `x * inv` must be rounded before it is rounded to an integer.
#include "routemm/q8_0.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "ggml_block_codec.h"
#include "routemm/error.h"
#include "routemm/q4_0.h"

namespace routemm::q8_0 {

namespace {

// The byte the reference stores for x * inv: rounded half away from zero, converted to int32 the
// way x86 does (values outside the int32 range and NaN give INT32_MIN), then truncated to its
// low byte. In-contract values always lie in [-127, 127].
uint8_t quant_byte(float scaled) {
  const float rounded = std::round(scaled);
  if (!(std::fabs(rounded) < 0x1p31f)) return 0;  // NaN, inf or out of int32 range: low byte 0
  return static_cast<uint8_t>(static_cast<uint32_t>(static_cast<int32_t>(rounded)) & 0xffu);
}

struct Q8_0Codec {
  static constexpr std::string_view kName = "q8_0";
  static constexpr size_t kBlockValues = q8_0::kBlockValues, kBlockBytes = q8_0::kBlockBytes;
  static void quantize_block(const float* x, uint8_t* out);
  static void dequantize_block(const uint8_t* block, float d, float* out) {
    for (size_t j = 0; j < kBlockValues; ++j) {
      out[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
    }
  }
};

void Q8_0Codec::quantize_block(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (size_t j = 0; j < kBlockValues; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float inv = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t d_bits = q4_0::float_to_half_bits(d);
  std::memcpy(out, &d_bits, 2);  // little endian host (checked in quantize)
  for (size_t j = 0; j < kBlockValues; ++j) out[2 + j] = quant_byte(x[j] * inv);
}

}  // namespace

size_t quantized_bytes(size_t values) { return ggml_codec::quantized_bytes<Q8_0Codec>(values); }

void quantize(std::span<const float> src, std::span<uint8_t> dst) {
  ggml_codec::quantize<Q8_0Codec>(src, dst);
}

void dequantize(std::span<const uint8_t> src, std::span<float> dst) {
  ggml_codec::dequantize<Q8_0Codec>(src, dst);
}

}  // namespace routemm::q8_0
