// The GGML block formats' reference codecs, one table by format name ("q4_0", "q4_k", "mxfp4", ...):
// block geometry, a dequantiser bit-identical to ggml's to_float (dequantize_row_*) and, where the
// format has one, a quantiser byte-identical to ggml's quantize_row_*_ref (no importance matrix).
// Values are little-endian blocks of block_bytes bytes holding block_values values; dequantize and
// quantize work on whole blocks, in order. Q4_0 and Q8_0 are the codecs of routemm/q4_0.h and
// routemm/q8_0.h (the same functions, reached through this table too).
//
// KERNELS. Q4_0 and Q8_0 have their own specialised pipelines (routemm/ops/q4_matmul.h,
// routemm/ops/quantized_matmul_id.h). Every other format of the table has the four pipelines of
// kKernelFormats, named after the format's table name F, on every backend that runs them:
//   kernel_mul_mv_F_f32                  dense mat-vec (M <= 8), Q8_0 mat-vec's slots and geometry
//   kernel_mul_mm_F_f32                  dense matrix route (M > 8), Q8_0 matrix route's slots and
//                                        geometry (32-token x 64-output tiles, 128 threads)
//   quantized_matmul_id_direct_F_f32     expert-ID direct route, Q8_0's slots and geometry
//   quantized_matmul_id_grouped_F_f32    expert-ID grouped route, Q8_0's slots and geometry
// Their params are those of the Q8_0 pipelines; rows hold K / block_values blocks of block_bytes.
// Blocks are read bytewise (any alignment). Format codes are routemm::GgmlType's values (the
// tensor-op ABI): q4_0 0, q5_0 1, q5_1 2, q8_0 3, q2_k 4, q3_k 5, q4_k 6, q5_k 7, q6_k 8, iq4_nl 9,
// iq4_xs 10, q4_1 11, mxfp4 12. Each product follows the lane contract of docs/numerics.md with
// weights exactly as this table's dequantiser gives them: eight F32 lanes, lane l accumulating
// fma(w[i], x[i], acc) for i = l, l + 8, ... < K in order, reduced in the fixed tree.
#pragma once

#include <array>
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

// The pipelines of one format beyond Q4_0 / Q8_0 (see KERNELS above).
struct KernelFormat {
  std::string_view name;  // the table's name, as in the pipeline names
  uint8_t ggml_type;      // routemm::GgmlType's value
  size_t block_values, block_bytes;
  std::string_view mat_vec, matrix, id_direct, id_grouped;
};

inline constexpr std::array<KernelFormat, 7> kKernelFormats = {{
    {"q4_1", 11, 32, 20, "kernel_mul_mv_q4_1_f32", "kernel_mul_mm_q4_1_f32",
     "quantized_matmul_id_direct_q4_1_f32", "quantized_matmul_id_grouped_q4_1_f32"},
    {"q5_0", 1, 32, 22, "kernel_mul_mv_q5_0_f32", "kernel_mul_mm_q5_0_f32",
     "quantized_matmul_id_direct_q5_0_f32", "quantized_matmul_id_grouped_q5_0_f32"},
    {"q5_1", 2, 32, 24, "kernel_mul_mv_q5_1_f32", "kernel_mul_mm_q5_1_f32",
     "quantized_matmul_id_direct_q5_1_f32", "quantized_matmul_id_grouped_q5_1_f32"},
    {"mxfp4", 12, 32, 17, "kernel_mul_mv_mxfp4_f32", "kernel_mul_mm_mxfp4_f32",
     "quantized_matmul_id_direct_mxfp4_f32", "quantized_matmul_id_grouped_mxfp4_f32"},
    {"q4_k", 6, 256, 144, "kernel_mul_mv_q4_k_f32", "kernel_mul_mm_q4_k_f32",
     "quantized_matmul_id_direct_q4_k_f32", "quantized_matmul_id_grouped_q4_k_f32"},
    {"q5_k", 7, 256, 176, "kernel_mul_mv_q5_k_f32", "kernel_mul_mm_q5_k_f32",
     "quantized_matmul_id_direct_q5_k_f32", "quantized_matmul_id_grouped_q5_k_f32"},
    {"q6_k", 8, 256, 210, "kernel_mul_mv_q6_k_f32", "kernel_mul_mm_q6_k_f32",
     "quantized_matmul_id_direct_q6_k_f32", "quantized_matmul_id_grouped_q6_k_f32"},
}};

// The reduced-precision int8-dot pipelines of the K-quants (the CPU's; contract in
// csrc/backend/cpu/ggml_kquant_int8_dot.h), each with the slots, params and geometry of the same
// format's exact pipeline of the same kind: kernel_mul_{mv,mm}_F_int8dot_f32 (taken under
// GgmlRoutingPolicy::dense_int8_dot) and quantized_matmul_id_{direct,grouped}_int8dot_F_f32 (the
// direct_int8_dot and grouped_int8_dot routes).
inline constexpr std::array<KernelFormat, 3> kKQuantInt8DotFormats = {{
    {"q4_k", 6, 256, 144, "kernel_mul_mv_q4_k_int8dot_f32", "kernel_mul_mm_q4_k_int8dot_f32",
     "quantized_matmul_id_direct_int8dot_q4_k_f32", "quantized_matmul_id_grouped_int8dot_q4_k_f32"},
    {"q5_k", 7, 256, 176, "kernel_mul_mv_q5_k_int8dot_f32", "kernel_mul_mm_q5_k_int8dot_f32",
     "quantized_matmul_id_direct_int8dot_q5_k_f32", "quantized_matmul_id_grouped_int8dot_q5_k_f32"},
    {"q6_k", 8, 256, 210, "kernel_mul_mv_q6_k_int8dot_f32", "kernel_mul_mm_q6_k_int8dot_f32",
     "quantized_matmul_id_direct_int8dot_q6_k_f32", "quantized_matmul_id_grouped_int8dot_q6_k_f32"},
}};

// The int8-dot pipelines of GgmlType value `ggml_type`, or nullptr (the formats without them).
constexpr const KernelFormat* kquant_int8_dot_format(uint8_t ggml_type) {
  for (const KernelFormat& f : kKQuantInt8DotFormats) {
    if (f.ggml_type == ggml_type) return &f;
  }
  return nullptr;
}

// The kernel format of GgmlType value `ggml_type`, or nullptr (Q4_0, Q8_0 and the formats without
// kernels).
constexpr const KernelFormat* kernel_format(uint8_t ggml_type) {
  for (const KernelFormat& f : kKernelFormats) {
    if (f.ggml_type == ggml_type) return &f;
  }
  return nullptr;
}

// The 6-bit scale and min of sub-block j (of 8) from Q4_K / Q5_K's 12 packed scale bytes (ggml's
// get_scale_min_k4), whatever holds them: byte(i) is scale byte i (i < 12), read from memory or
// from words already in registers. The one decoding the codecs, the CPU kernels and the CUDA
// kernels share (constexpr, so device code calls it under --expt-relaxed-constexpr).
template <class Byte>
constexpr void scale_min_k4_of(uint32_t j, const Byte& byte, uint32_t& sc, uint32_t& m) {
  if (j < 4) {
    sc = byte(j) & 63u;
    m = byte(j + 4) & 63u;
  } else {
    sc = (byte(j + 4) & 0xFu) | ((byte(j - 4) >> 6) << 4);
    m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
  }
}

// scale_min_k4_of on the 12 bytes at q.
constexpr void scale_min_k4(size_t j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  uint32_t s = 0, n = 0;
  scale_min_k4_of(static_cast<uint32_t>(j), [q](uint32_t i) -> uint32_t { return q[i]; }, s, n);
  sc = static_cast<uint8_t>(s);
  m = static_cast<uint8_t>(n);
}

}  // namespace routemm::ggml_formats
