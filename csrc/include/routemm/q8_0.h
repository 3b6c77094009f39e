// GGML Q8_0 reference quantiser and dequantiser (spec §5.1), byte-identical to ggml's scalar
// reference and to the `gguf` Python package.
//
// Layout: rows of `values_per_row` floats become rows of values_per_row / 32 blocks of 34 bytes:
// a little-endian binary16 scale d, then 32 signed bytes q[j]. A block's value j is d * q[j].
//
// Quantisation of one block (all arithmetic in binary32, round to nearest even, no fused ops):
//   amax = the largest magnitude; d = amax / 127; inv = d == 0 ? 0 : 1 / d;
//   q[j] = round_half_away_from_zero(x[j] * inv), stored as the low byte of its int32 value;
//   the stored scale is d rounded to binary16 (overflow gives +inf), while q uses the binary32
//   inv. When x * inv is not finite (d subnormal and 1 / d overflowing) q is 0, as the NumPy
//   reference gives on x86. Non-finite inputs are not part of the contract.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace routemm::q8_0 {

inline constexpr size_t kBlockValues = 32;
inline constexpr size_t kBlockBytes = 34;

// Bytes that `values` floats quantise to; `values` must be a multiple of 32.
size_t quantized_bytes(size_t values);

// Quantises src (a multiple of 32 values, any number of rows back to back) into dst
// (quantized_bytes(src.size()) bytes). Throws InvalidArgument on a size mismatch.
void quantize(std::span<const float> src, std::span<uint8_t> dst);

// Dequantises whole blocks: dst.size() must be src.size() / 34 * 32. Every result is exact (a
// binary16 scale times an integer in [-128, 127] fits binary32).
void dequantize(std::span<const uint8_t> src, std::span<float> dst);

}  // namespace routemm::q8_0
