// Lab: how many K-split clusters of the Q4_0 Hopper wgmma kernel the driver can place at once, per
// token tile and split (cudaOccupancyMaxActiveClusters), against the clusters a 4096 x 14336 product
// launches with one token tile (m <= 128 for V2, m <= 32 for 64x32); more clusters than that number
// run as a second wave. Then (LAB_TIME=1) the time of both routes at small m over splits 2, 4 and
// 8 (CUDA events per call, the activation pass included; weights rotated, LAB_COPIES): whether a
// split that fits in one wave beats the 8-way split the front door picks.
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/capacity bench/lab/q4_cluster_capacity.cu \
//        csrc/backend/cuda/hopper_support.cu && /tmp/capacity
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/q4_matmul_wgmma.cu"
#include "q4_lab_common.cuh"

using namespace routemm::cuda;

template <int kTokens>
void report(const char* route) {
  constexpr auto kernel = &q4_wgmma_kernel<kTokens>;
  const int smem = Layout<kTokens>::kSmem;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess) {
    std::printf("%s: cannot raise shared memory\n", route);
    return;
  }
  for (unsigned splits : {2u, 4u, 8u}) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config =
        k_split_config(dim3(1, 4096 / 128, splits), 256, smem, nullptr, attribute);
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    std::printf("%-10s smem=%6d splits=%u clusters launched=%u max active=%d%s\n", route, smem,
                splits, 4096 / 128, e == cudaSuccess ? clusters : -1,
                e == cudaSuccess && clusters < 4096 / 128 ? "  -> second wave" : "");
  }
}

void time_small_m() {
  const uint32_t n = 4096, k = 14336;
  const Q4LabOperands ops(n, k, 128, lab_weight_copies());
  for (int tokens : {32, 128}) {
    for (uint32_t m : {9u, 32u, 64u, 128u}) {
      if (tokens == 32 && m > 32) continue;
      for (uint32_t splits : {2u, 4u, 8u}) {
        float fastest = 0;
        const float median = median_event_us(
            [&](int i) {
              const Q4WgmmaProblem p{ops.weight(i), ops.input, ops.output, m, n, k, splits};
              launch_q4_wgmma("lab", nullptr, p, tokens);
            },
            50, 10, nullptr, &fastest);
        std::printf("%-6s m=%3u splits=%u  events median %7.2f us (min %7.2f)\n",
                    tokens == 128 ? "V2" : "64x32", m, splits, median, fastest);
      }
    }
  }
}

int main() {
  report<128>("V2");
  report<32>("64x32");
  if (std::getenv("LAB_TIME") != nullptr) time_small_m();
  return 0;
}
