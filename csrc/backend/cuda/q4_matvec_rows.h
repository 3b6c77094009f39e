// The Hopper (sm_90a) Q4_0 mat-vec for one or two tokens, as q4_matmul.cu's mat-vec launcher
// sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace routemm::cuda {

struct Q4MatVecRowsProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks (any byte alignment)
  const float* input;     // m x k values, 4-byte aligned
  float* output;          // m x n values
  uint32_t m, n, k;
};

// True when the kernel runs this product on `device`: one or two tokens, k % 256 == 0 (a row is a whole
// number of 16-byte units and of 8-block slab tails) and the Hopper image can run there
// (hopper_kernels_available). The views' alignment only picks the copy path, never the arithmetic.
bool q4_matvec_rows_eligible(int device, uint64_t m, uint64_t k);

// Launches min(ceil(n / 16), 2 x multiprocessors) CTAs on `stream`. Precondition:
// q4_matvec_rows_eligible. Throws a routemm::Error naming `label` when the launch fails.
void launch_q4_matvec_rows(const std::string& label, cudaStream_t stream,
                           const Q4MatVecRowsProblem& p);

}  // namespace routemm::cuda
