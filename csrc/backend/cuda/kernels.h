// CUDA kernel families; each adds its KernelDefs to the CUDA backend's list.
#pragma once

#include <vector>

#include "routemm/backend.h"

namespace routemm::cuda {

// Pipelines of csrc/ops/dense_matmul_id.cpp (kDenseMatmulIdPipelineNames), dense_matmul_id.cu.
void add_dense_matmul_id_kernels(std::vector<KernelDef>& out);
// Tensor-core routes (kDenseMatmulIdTensorPipelineNames), dense_matmul_id_tensor.cu.
void add_dense_matmul_id_tensor_kernels(std::vector<KernelDef>& out);
// GGML Q4_0 dense projections (kQ4MatmulPipelineNames), q4_matmul.cu.
void add_q4_matmul_kernels(std::vector<KernelDef>& out);
// GGML Q8_0 dense projections (kQ8MatmulPipelineNames), q8_matmul.cu.
void add_q8_matmul_kernels(std::vector<KernelDef>& out);
// Quantised expert-ID matmul (kGgmlQuantizedMatmulIdPipelineNames), quantized_matmul_id.cu.
void add_quantized_matmul_id_kernels(std::vector<KernelDef>& out);
// MoE layer kernels (kMoePipelineNames of csrc/ops/moe.cpp), moe.cu.
void add_moe_kernels(std::vector<KernelDef>& out);
void add_moe_fused_kernels(std::vector<KernelDef>& out);
// Route-calibration proof kernels (routemm_calibration_poison_f32 / _compare_f32), calibration.cu.
void add_calibration_kernels(std::vector<KernelDef>& out);

}  // namespace routemm::cuda
