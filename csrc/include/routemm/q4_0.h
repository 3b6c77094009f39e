// GGML Q4_0 reference quantiser and dequantiser (spec §5.1), byte-identical to ggml's scalar
// reference and to the `gguf` Python package.
//
// Layout: rows of `values_per_row` floats become rows of values_per_row / 32 blocks of 18 bytes:
// a little-endian binary16 scale d, then 16 bytes whose low nibble is value j and whose high
// nibble is value j + 16. A block's value is d * (nibble - 8).
//
// Quantisation of one block (all arithmetic in binary32, round to nearest even, no fused ops):
//   max = the value of largest magnitude (the first one on ties, so an all-zero block of -0.0
//   has max = -0.0 and d = +0.0, as in `gguf`); d = max / -8;
//   inv = d == 0 ? 0 : 1 / d;  nibble = min(15, trunc(x * inv + 8.5));
//   the stored scale is d rounded to binary16 (overflow gives +-inf), while the nibbles use the
//   binary32 inv. Non-finite inputs are not part of the contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace routemm::q4_0 {

inline constexpr size_t kBlockValues = 32;
inline constexpr size_t kBlockBytes = 18;

// Bytes that `values` floats quantise to; `values` must be a multiple of 32.
size_t quantized_bytes(size_t values);

// IEEE binary32 -> binary16 bits, round to nearest even (subnormals, overflow to inf, NaN kept).
uint16_t float_to_half_bits(float value);
// IEEE binary16 bits -> binary32, exact.
float half_bits_to_float(uint16_t bits);

// Quantises src (a multiple of 32 values, any number of rows back to back) into dst
// (quantized_bytes(src.size()) bytes). Throws InvalidArgument on a size mismatch.
void quantize(std::span<const float> src, std::span<uint8_t> dst);

// Dequantises whole blocks: dst.size() must be src.size() / 18 * 32. Every result is exact (a
// binary16 scale times an integer in [-8, 7] fits binary32).
void dequantize(std::span<const uint8_t> src, std::span<float> dst);

}  // namespace routemm::q4_0
