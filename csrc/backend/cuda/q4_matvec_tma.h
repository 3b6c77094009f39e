// The Hopper (sm_90a) kernel of the Q4_0 mat-vec (kernel_mul_mv_q4_0_f32), as q4_matmul.cu's
// launcher sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace routemm::cuda {

// The tile of the mat-vec on devices where this kernel may run: 128 weight rows x 8 tokens per CTA
// of 256 threads (the mma.sync mat-vec takes the same tile there, so the dispatch geometry does not
// depend on which of the two kernels runs a product).
inline constexpr int kQ4MatVecTmaRows = 128;
inline constexpr int kQ4MatVecTmaTokens = 8;
inline constexpr int kQ4MatVecTmaThreads = 256;
inline constexpr int kQ4MatVecTmaCtasPerSm = 3;  // the occupancy the kernel is built for

struct Q4MatVecTmaProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks, 16-byte aligned
  const float* input;     // m x k, 16-byte aligned
  float* output;          // m x n
  uint32_t m, n, k;
  uint32_t splits;  // K split = cluster size along grid.z (1, 2, 4 or 8)
};

// True when the kernel can run this product on `device`: the Hopper image and TMA are there, k %
// 256 == 0 (whole 256-value stages; rows a multiple of 16 bytes) and both the weight view and the
// activations are 16-byte aligned (TMA's global address rule).
bool q4_matvec_tma_eligible(int device, const void* weight, const float* input, uint64_t k);

// The largest dynamic shared memory a launch takes (the ring depth adapts to the token count).
uint64_t q4_matvec_tma_smem_bytes();

// Launches the (n / 128) x (m / 8) x splits grid (clusters of `splits` along z). Precondition:
// q4_matvec_tma_eligible.
void launch_q4_matvec_tma(const std::string& label, cudaStream_t stream,
                          const Q4MatVecTmaProblem& p);

}  // namespace routemm::cuda
