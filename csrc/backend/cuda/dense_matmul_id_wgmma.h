// The Hopper (sm_90a) kernel of the grouped_tensor_lowp route (dense_matmul_id_wgmma.cu), as the
// route's launcher in dense_matmul_id_tensor.cu sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/common/dense_matmul_id_params.h"
#include "routemm/backend.h"

namespace routemm::cuda {

// True when this build carries the sm_90a image and `device` is compute capability 9.0 (where that
// image runs), and the driver can encode TMA descriptors.
bool wgmma_lowp_available(int device);

// Dynamic shared memory of the kernel for `n_experts` experts (its widest tile).
uint64_t wgmma_lowp_smem_bytes(uint32_t n_experts);

// Launches the kernel for one grouped_tensor_lowp dispatch: f16 (half_weights) or bf16 weights,
// the launch's 1-D persistent grid, the map dispatch's counts and routed rows in slots 3 and 4.
// Preconditions (the launcher checks them): wgmma_lowp_available, k > 0 and k % 8 == 0, weights,
// input and their strides 16-byte aligned.
void launch_grouped_lowp_wgmma(const KernelLaunch& launch,
                               const kernels::DenseMatmulIdKernelParams& p, cudaStream_t stream,
                               bool half_weights, bool out_vec2);

}  // namespace routemm::cuda
