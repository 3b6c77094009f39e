// The Hopper (sm_90a) kernel of the two bf16 Q4_0 matrix routes (compatibility_v2, tensor_64x32),
// as q4_matmul.cu's launcher sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace routemm::cuda {

struct Q4WgmmaProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks
  const float* input;     // m x k, 4-byte aligned
  float* output;          // m x n
  uint32_t m, n, k;
  uint32_t splits;  // K split = cluster size along grid.z (1, 2, 4 or 8)
};

// True when the kernel can run this product on `device`: the Hopper image and TMA are there
// (hopper_kernels_available), k % 256 == 0 (a weight row is a whole number of 16-byte units and of
// 256-value stages) and the weight view is 16-byte aligned.
bool q4_wgmma_eligible(int device, const void* weight, uint64_t k);

// Dynamic shared memory of the kernel with a token tile of `tokens` (128 or 32).
uint64_t q4_wgmma_smem_bytes(int tokens);

// Converts the activations to the kernel's bf16 operand layout in a stream-ordered workspace, then
// launches the (m / tokens) x (n / 128) x splits grid of 256-thread CTAs (clusters of `splits` along
// z). Preconditions: q4_wgmma_eligible, tokens 128 or 32.
void launch_q4_wgmma(const std::string& label, cudaStream_t stream, const Q4WgmmaProblem& p,
                     int tokens);

}  // namespace routemm::cuda
