// Lab: the Hopper Q4_0 mat-vec (csrc/backend/cuda/q4_matvec_tma.cu) over CTA shapes (warps x CTAs
// per SM) and K splits, beside the cluster capacity the driver reports for each launch. Weights rotate over 8 copies (> 2x L2); CUDA
// events per launch (an empty kernel's event time is printed for the overhead).
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/mvlab bench/lab/q4_matvec_tma_lab.cu \
//        csrc/backend/cuda/hopper_support.cu && /tmp/mvlab
#include <algorithm>
#include <cstdio>
#include <vector>

#include "backend/cuda/q4_matvec_tma.cu"

using namespace routemm::cuda;

#define CHECK(call)                                                                              \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

__global__ void empty_kernel() {}

template <class Launch>
float median_us(Launch&& launch, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps + 5; ++i) {
    CHECK(cudaEventRecord(a));
    launch(i);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 5) t.push_back(ms * 1000.0f);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  const int copies = 8, n_max = 4096, k_max = 14336;
  const size_t w_bytes = size_t(n_max) * (k_max / 32) * 18;
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
  CHECK(cudaMalloc(&x, size_t(8) * k_max * 4));
  CHECK(cudaMemset(x, 0, size_t(8) * k_max * 4));
  CHECK(cudaMalloc(&out, size_t(8) * n_max * 4));
  std::printf("empty kernel: events median %.2f us\n",
              median_us([&](int) { empty_kernel<<<1, 32>>>(); }, 200));
  struct Shape {
    uint32_t n, k;
  };
  const auto sweep = [&](auto shape_tag, const char* name) {
    using S = decltype(shape_tag);
    for (const Shape s : {Shape{4096, 14336}, Shape{4096, 2048}}) {
      for (uint32_t m : {1u, 8u}) {
        for (uint32_t splits : {2u, 4u, 8u}) {
          const MvLayout l = layout_for<S>(static_cast<int>(std::min(m, 8u)));
          cudaLaunchConfig_t config{};
          config.gridDim = dim3((s.n + S::kRows - 1) / S::kRows, (m + 7) / 8, splits);
          config.blockDim = dim3(S::kThreads);
          config.dynamicSmemBytes = l.smem_bytes();
          cudaLaunchAttribute attribute{};
          attribute.id = cudaLaunchAttributeClusterDimension;
          attribute.val.clusterDim.x = 1;
          attribute.val.clusterDim.y = 1;
          attribute.val.clusterDim.z = splits;
          config.attrs = &attribute;
          config.numAttrs = 1;
          CHECK(cudaFuncSetAttribute(q4_matvec_tma_kernel<S>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem_bytes_of<S>())));
          int clusters = 0;
          CHECK(cudaOccupancyMaxActiveClusters(&clusters, q4_matvec_tma_kernel<S>, &config));
          const float us = median_us(
              [&](int i) {
                const Q4MatVecTmaProblem p{w[i % copies], x, out, m, s.n, s.k, splits};
                launch_shape<S>("lab", nullptr, p);
              },
              100);
          CHECK(cudaGetLastError());
          std::printf(
              "%-10s n=%u k=%5u m=%u splits=%u ctas=%4u clusters=%3u smem=%6d w_stages=%d "
              "x_slots=%d max_clusters=%3d  events median %6.2f us\n",
              name, s.n, s.k, m, splits, config.gridDim.x * config.gridDim.z, config.gridDim.x,
              l.smem_bytes(), l.w_stages, l.x_slots, clusters, us);
        }
      }
    }
  };
  sweep(MvShape<8, 3>{}, "8w x 3/SM");
  sweep(MvShape<8, 2>{}, "8w x 2/SM");
  sweep(MvShape<4, 5>{}, "4w x 5/SM");
  sweep(MvShape<4, 4>{}, "4w x 4/SM");
  CHECK(cudaDeviceSynchronize());
  return 0;
}
