// CPU kernel families; each adds its KernelDefs to the CPU backend's list.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "routemm/backend.h"

namespace routemm::cpu {

// Pipelines of csrc/ops/dense_matmul_id.cpp (kDenseMatmulIdPipelineNames).
void add_dense_matmul_id_kernels(std::vector<KernelDef>& out);
// The reduced-precision bf16-dot routes (kDenseMatmulIdBf16DotPipelineNames), dense_matmul_id.cpp;
// adds nothing unless the processor (and ROUTEMM_CPU_ISA) allows AVX512_BF16.
void add_dense_matmul_id_bf16_dot_kernels(std::vector<KernelDef>& out);
// Pipelines of csrc/ops/q4_matmul.cpp (kQ4MatmulPipelineNames).
void add_q4_matmul_kernels(std::vector<KernelDef>& out);
// Pipelines of csrc/ops/quantized_matmul_id.cpp (kGgmlQuantizedMatmulIdPipelineNames).
void add_quantized_matmul_id_kernels(std::vector<KernelDef>& out);
// The dense and expert-ID pipelines of ggml_formats.h's kKernelFormats (Q4_1, Q5_0, Q5_1, MXFP4,
// Q4_K, Q5_K, Q6_K), ggml_format_kernels.cpp.
void add_ggml_format_kernels(std::vector<KernelDef>& out);
// MoE layer kernels (kMoePipelineNames of csrc/ops/moe.cpp), moe.cpp.
void add_moe_kernels(std::vector<KernelDef>& out);
void add_moe_fused_kernels(std::vector<KernelDef>& out);
// Route-calibration proof kernels (routemm_calibration_poison_f32 / _compare_f32), calibration.cpp.
void add_calibration_kernels(std::vector<KernelDef>& out);

// A number of its own (from 1) for every launch that asks: the grouped expert-ID kernels key their
// per-thread reused rows by it, so a thread never takes rows gathered for another launch as its own.
inline uint64_t next_launch_number() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

// Output columns per work item of the direct expert-ID kernels (one routed row per item): 256, so
// that each of a column pass's eight weight streams walks 32 columns back to back (see
// kDirectCols in dense_matmul_id.cpp), halved down to 64 while a launch of `rows` rows x `n`
// columns would give each of `threads` threads fewer than four items, so that a decode step
// still spreads over a large pool.
inline size_t direct_item_columns(size_t rows, size_t n, size_t threads) {
  size_t cols = 256;
  while (cols > 64 && rows * ((n + cols - 1) / cols) < 4 * threads) cols /= 2;
  return cols;
}

}  // namespace routemm::cpu
