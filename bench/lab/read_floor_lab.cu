// How long one kernel takes to read N bytes once, N from 4 MB to 512 MB: the floor under every
// memory-bound kernel of the library, and its fixed part (launch ramp, first-byte latency, tail).
// A straight line time = t0 + N / B through the large sizes gives the streaming bandwidth B and the
// intercept t0; a one-wave kernel over 25-33 MB (the one-token expert-ID and Q4_0 products) cannot
// beat t0 + N / B whatever its arithmetic.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 -Icsrc/backend/cuda -o /tmp/read_floor \
//     bench/lab/read_floor_lab.cu && /tmp/read_floor
//
// The reader: lab_read_kernel (q4_lab_common.cuh: 16-byte streaming loads, 4 or 8 in flight per
// thread, grid-stride over 8 x 256-thread CTAs per SM). Buffers rotate over copies totalling
// >= 512 MB, so no call reads from L2.
// Times: back-to-back launches (events around 40 calls; below about 8 MB that is the host's launch
// rate, not the kernel). Kernel durations come from ncu: READ_FLOOR_MB=X runs size X alone, as
// `bash bench/device.sh lab mma-rows` does for each size.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "q4_lab_common.cuh"

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
    const float t4 = time(lab_read_kernel<4>), t8 = time(lab_read_kernel<8>);
    std::printf("%10.1f %8d | %12.2f %10.2f | %12.2f %10.2f\n", mb, copies, t4, bytes / t4 / 1e6,
                t8, bytes / t8 / 1e6);
    for (auto* b : buffers) CHECK(cudaFree(b));
  }
  CHECK(cudaFree(sink));
  return 0;
}
