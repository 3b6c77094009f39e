// The Hopper (sm_90a) kernel of the tensor-core expert-ID routes (dense_matmul_id_wgmma.cu), as the
// routes' launcher in dense_matmul_id_tensor.cu sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/common/dense_matmul_id_params.h"
#include "routemm/backend.h"

namespace routemm::cuda {

// Dynamic shared memory of the kernel for `n_experts` experts (its widest tile).
uint64_t wgmma_grouped_smem_bytes(uint32_t n_experts);

// The route's operand precision and the weights' storage type.
enum class WgmmaOperands { LowpBf16, LowpF16, Tf32Bf16, Tf32F16, Tf32F32 };

// Launches the kernel for one grouped_tensor_lowp / grouped_tensor_tf32 dispatch: the launch's 1-D
// persistent grid, the map dispatch's counts and routed rows in slots 3 and 4. Preconditions (the
// launcher checks them): hopper_kernels_available (hopper_support.h), k > 0 and k % 8 == 0, weights, input and their
// strides 16-byte aligned, n_experts <= kMaxWorkListExperts, a 1-D grid of 1..2^31-1 CTAs.
void launch_grouped_wgmma(const KernelLaunch& launch, const kernels::DenseMatmulIdKernelParams& p,
                          cudaStream_t stream, WgmmaOperands operands, bool out_vec2);

}  // namespace routemm::cuda
