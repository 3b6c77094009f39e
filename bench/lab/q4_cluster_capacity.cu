// Lab: how many K-split clusters of the Q4_0 Hopper wgmma kernel the driver can place at once, per
// token tile and split (cudaOccupancyMaxActiveClusters), against the clusters a 4096 x 14336 product
// launches with one token tile (m <= 128 for V2, m <= 32 for 64x32). More clusters than that number
// run as a second wave.
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/capacity bench/lab/q4_cluster_capacity.cu \
//        csrc/backend/cuda/hopper_support.cu && /tmp/capacity
#include <cstdio>

#include "backend/cuda/q4_matmul_wgmma.cu"

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
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(1, 4096 / 128, splits);
    config.blockDim = dim3(256);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = splits;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
    std::printf("%-10s smem=%6d splits=%u clusters launched=%u max active=%d%s\n", route, smem,
                splits, 4096 / 128, e == cudaSuccess ? clusters : -1,
                e == cudaSuccess && clusters < 4096 / 128 ? "  -> second wave" : "");
  }
}

int main() {
  report<128>("V2");
  report<32>("64x32");
  return 0;
}
