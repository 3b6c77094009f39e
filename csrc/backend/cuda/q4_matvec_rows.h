// The one-token Q4_0 mat-vec on Hopper (q4_matvec_rows.cu), as q4_matmul.cu's mat-vec launcher
// sees it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace routemm::cuda {

struct Q4MatVecRowsProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks, rows k / 32 * 18 bytes apart
  const float* input;     // one token: k values, 4-byte aligned
  float* output;          // n values, 4-byte aligned
  uint32_t n, k;
};

// True when the kernel runs a one-token product of width `k` on `device`: the sm_90a image is there
// and the device runs it (hopper_kernels_available), and k <= kQ4MatVecRowsMaxK, so that one CTA's
// warps hold the whole activation row in registers. Any weight or input alignment.
inline constexpr uint64_t kQ4MatVecRowsMaxK = 15360;
bool q4_matvec_rows_eligible(int device, uint64_t k);

// Launches the kernel for `p` on `stream` (grid and CTA shape derived from n and k; see the .cu).
// Precondition: q4_matvec_rows_eligible. Throws a routemm::Error naming `label` when the launch
// fails.
void launch_q4_matvec_rows(const std::string& label, cudaStream_t stream,
                           const Q4MatVecRowsProblem& p);

}  // namespace routemm::cuda
