// How long one kernel takes to read N bytes once, N from 4 MB to 512 MB: the floor under every
// memory-bound kernel of the library, and its fixed part (launch ramp, first-byte latency, tail).
// A straight line time = t0 + N / B through the large sizes gives the streaming bandwidth B and the
// intercept t0; a one-wave kernel over 25-33 MB (the one-token expert-ID and Q4_0 products) cannot
// beat t0 + N / B whatever its arithmetic.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 -Icsrc/backend/cuda -o /tmp/read_floor \
//     bench/lab/read_floor_lab.cu && /tmp/read_floor
//
// The reader: 16-byte streaming loads (ld.global.cs), kUnroll in flight per thread, grid-stride
// over 8 x 256-thread CTAs per SM, XOR-folded so no load can be dropped (the sink is written only
// for one fold value). Buffers rotate over copies totalling >= 512 MB, so no call reads from L2.
// Times: back-to-back launches (events around 40 calls; below about 8 MB that is the host's launch
// rate, not the kernel). Kernel durations come from ncu: READ_FLOOR_MB=X runs size X alone, as
// bench/lab/mma_rows_device.sh does for each size.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "q4_lab_common.cuh"

namespace {

template <int kUnroll>
__global__ void __launch_bounds__(256)
    read_kernel(const uint4* data, size_t units, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < units; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < units; i += stride) {
    const uint4 v = __ldcs(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("empty kernel: %.2f us per launch (back to back)\n",
              back_to_back_us([](int) { lab_empty_kernel<<<1, 32>>>(); }));
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  std::printf("%10s %8s | %12s %10s | %12s %10s\n", "MB", "copies", "b2b us (x4)", "TB/s",
              "b2b us (x8)", "TB/s");
  std::vector<double> sizes = {4.0, 8.0, 16.0, 25.2, 33.0, 64.0, 128.0, 256.0, 512.0};
  if (const char* only = std::getenv("READ_FLOOR_MB")) sizes = {std::atof(only)};
  for (const double mb : sizes) {
    const size_t bytes = size_t(mb * 1e6) / 16 * 16;
    const int copies = int(std::max<size_t>(1, (size_t(512e6) + bytes - 1) / bytes));
    std::vector<uint8_t*> buffers(copies);
    for (auto& b : buffers) {
      CHECK(cudaMalloc(&b, bytes));
      CHECK(cudaMemset(b, 0x5A, bytes));
    }
    const auto time = [&](auto kernel) {
      return back_to_back_us([&](int call) {
        kernel<<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(buffers[call % copies]), bytes / 16,
                                 sink);
      });
    };
    const float t4 = time(read_kernel<4>), t8 = time(read_kernel<8>);
    std::printf("%10.1f %8d | %12.2f %10.2f | %12.2f %10.2f\n", mb, copies, t4, bytes / t4 / 1e6,
                t8, bytes / t8 / 1e6);
    for (auto* b : buffers) CHECK(cudaFree(b));
  }
  CHECK(cudaFree(sink));
  return 0;
}
