// The GGML block formats' reference codecs, one table by format name ("q4_0", "q4_k", "mxfp4", ...):
// block geometry, a dequantiser bit-identical to ggml's to_float (dequantize_row_*) and, where the
// format has one, a quantiser byte-identical to ggml's quantize_row_*_ref (no importance matrix).
// Values are little-endian blocks of block_bytes bytes holding block_values values; dequantize and
// quantize work on whole blocks, in order. Q4_0 and Q8_0 are the codecs of routemm/q4_0.h and
// routemm/q8_0.h (the same functions, reached through this table too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace routemm::ggml_formats {

struct Format {
  std::string_view name;
  size_t block_values;
  size_t block_bytes;
  void (*dequantize_block)(const uint8_t* block, float* out);
  void (*quantize_block)(const float* x, uint8_t* out);  // nullptr: no reference quantiser here
};

// The format of `name`; throws InvalidArgument naming the known formats for any other name.
const Format& format(std::string_view name);

// Every format of the table, in table order.
std::span<const Format> formats();

// Whole blocks: src.size() a multiple of block_bytes, dst.size() the matching value count (and the
// reverse for quantize); throws InvalidArgument naming the format otherwise, and for quantize of a
// format without a reference quantiser.
void dequantize(const Format& f, std::span<const uint8_t> src, std::span<float> dst);
void quantize(const Format& f, std::span<const float> src, std::span<uint8_t> dst);

}  // namespace routemm::ggml_formats
