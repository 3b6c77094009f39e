// Lab: how many K-split clusters of the Q4_0 Hopper wgmma kernel the driver can place at once, per
// token tile and split (cudaOccupancyMaxActiveClusters), against the clusters a 4096 x 14336 product
// launches with one token tile (m <= 128 for V2, m <= 32 for 64x32); more clusters than that number
// run as a second wave. Then (LAB_TIME=1) the time of both routes at small m over splits 2, 4 and
// 8 (CUDA events per call, the activation pass included; weights rotated over 8 copies): whether a
// split that fits in one wave beats the 8-way split the front door picks.
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/capacity bench/lab/q4_cluster_capacity.cu \
//        csrc/backend/cuda/hopper_support.cu && /tmp/capacity
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

#define CHECK(call)                                                                              \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

void time_small_m() {
  const int copies = 8;
  const uint32_t n = 4096, k = 14336;
  const size_t w_bytes = size_t(n) * (k / 32) * 18;
  std::vector<uint8_t> host(w_bytes);
  uint32_t state = 12345;
  for (auto& b : host) {
    state = state * 1664525u + 1013904223u;
    b = uint8_t(state >> 24);
  }
  for (size_t i = 0; i < host.size(); i += 18) host[i + 1] = 0x2c;  // finite f16 scales
  std::vector<uint8_t*> w(copies);
  for (auto& p : w) {
    CHECK(cudaMalloc(&p, w_bytes));
    CHECK(cudaMemcpy(p, host.data(), w_bytes, cudaMemcpyHostToDevice));
  }
  float *x, *out;
  CHECK(cudaMalloc(&x, size_t(128) * k * 4));
  CHECK(cudaMemset(x, 0, size_t(128) * k * 4));
  CHECK(cudaMalloc(&out, size_t(128) * n * 4));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int tokens : {32, 128}) {
    for (uint32_t m : {9u, 32u, 64u, 128u}) {
      if (tokens == 32 && m > 32) continue;
      for (uint32_t splits : {2u, 4u, 8u}) {
        std::vector<float> t;
        for (int i = 0; i < 60; ++i) {
          const Q4WgmmaProblem p{w[i % copies], x, out, m, n, k, splits};
          CHECK(cudaEventRecord(e0));
          launch_q4_wgmma("lab", nullptr, p, tokens);
          CHECK(cudaEventRecord(e1));
          CHECK(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK(cudaEventElapsedTime(&ms, e0, e1));
          if (i >= 10) t.push_back(ms * 1000.0f);
        }
        std::sort(t.begin(), t.end());
        std::printf("%-6s m=%3u splits=%u  events median %7.2f us (min %7.2f)\n",
                    tokens == 128 ? "V2" : "64x32", m, splits, t[t.size() / 2], t[0]);
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
