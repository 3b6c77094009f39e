// The loops the reference GGML block codecs share (q4_0.cpp, q8_0.cpp): size checks with the
// messages the public headers promise, then one call per block. A format supplies what differs:
//
//   struct Format {
//     static constexpr std::string_view kName;          // "q4_0", as messages name it
//     static constexpr size_t kBlockValues, kBlockBytes;
//     static void quantize_block(const float* x, uint8_t* out);               // kBlockValues in
//     static void dequantize_block(const uint8_t* block, float d, float* out);  // scale decoded
//   };
//
// Every block starts with its little-endian binary16 scale d, which dequantize decodes once.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "routemm/error.h"
#include "routemm/q4_0.h"

namespace routemm::ggml_codec {

template <class Format>
size_t quantized_bytes(size_t values) {
  if (values % Format::kBlockValues != 0) {
    throw InvalidArgument(std::string(Format::kName) + ": " + std::to_string(values) +
                          " values are not a multiple of " + std::to_string(Format::kBlockValues));
  }
  return values / Format::kBlockValues * Format::kBlockBytes;
}

template <class Format>
void quantize(std::span<const float> src, std::span<uint8_t> dst) {
  static_assert(std::endian::native == std::endian::little, "GGML block scales are little endian");
  const size_t need = quantized_bytes<Format>(src.size());
  if (dst.size() != need) {
    throw InvalidArgument(std::string(Format::kName) + " quantize: " + std::to_string(src.size()) +
                          " values need " + std::to_string(need) + " bytes, got " +
                          std::to_string(dst.size()));
  }
  const size_t blocks = src.size() / Format::kBlockValues;
  for (size_t b = 0; b < blocks; ++b) {
    Format::quantize_block(src.data() + b * Format::kBlockValues,
                           dst.data() + b * Format::kBlockBytes);
  }
}

template <class Format>
void dequantize(std::span<const uint8_t> src, std::span<float> dst) {
  if (src.size() % Format::kBlockBytes != 0 ||
      dst.size() != src.size() / Format::kBlockBytes * Format::kBlockValues) {
    throw InvalidArgument(
        std::string(Format::kName) + " dequantize: " + std::to_string(src.size()) +
        " bytes are not whole blocks for " + std::to_string(dst.size()) + " values");
  }
  const size_t blocks = src.size() / Format::kBlockBytes;
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* block = src.data() + b * Format::kBlockBytes;
    uint16_t d_bits;
    std::memcpy(&d_bits, block, 2);
    Format::dequantize_block(block, q4_0::half_bits_to_float(d_bits),
                             dst.data() + b * Format::kBlockValues);
  }
}

}  // namespace routemm::ggml_codec
