// Host cost of one bare kernel launch on an otherwise empty stream: the floor under the per-call
// host cost that bench/host_cost.py measures (validation + encode + launch); host_cost.py builds
// and runs it before and after its own measurement on CUDA.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 -cudart static -o /tmp/launch_cost bench/lab/launch_cost.cu
//   /tmp/launch_cost [calls=200] [batches=15]
//
// Same protocol as host_cost.py: `calls` launches back to back into one stream, timed on the host,
// synchronised outside the timer, median per-call time over `batches` (a first warm-up batch is
// dropped). Two kernels: one with no parameters, one with the direct expert-ID kernel's parameter
// footprint (a 64-byte struct and five pointers), launched with <<<>>> and with cudaLaunchKernel.
// Two more protocols for the same launch: "one per idle stream" synchronises before each launch and
// times it alone (the stream is empty at every call), and "behind a busy queue" launches a kernel
// that runs about 9 us (the Qwen3 m = 1 direct kernel's time), so the host gets ahead of the GPU
// and the queue grows over the batch, as it does when host_cost.py times the real kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                           \
  do {                                                                        \
    const cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

struct Params {
  unsigned v[16];
};

__global__ void empty_kernel() {}
__global__ void params_kernel(Params p, const char* w, const char* x, const unsigned* ids,
                              float* out, unsigned tiles, unsigned long long rows) {
  if (p.v[0] == 0xFFFFFFFFu && w == nullptr) out[0] = float(tiles + rows) + x[0] + ids[0];
}

// Spins for `ns` nanoseconds of GPU time (one thread).
__global__ void busy_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// Median host time (us) of one launch timed alone on an idle stream.
template <typename Launch>
double median_idle_us(Launch launch, cudaStream_t s, int calls) {
  std::vector<double> per_call;
  for (int i = 0; i <= calls; ++i) {
    CHECK(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    launch(s);
    const auto t1 = std::chrono::steady_clock::now();
    if (i > 0) per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  CHECK(cudaStreamSynchronize(s));
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

template <typename Launch>
double median_us(Launch launch, cudaStream_t s, int calls, int batches) {
  std::vector<double> per_call;
  for (int b = 0; b <= batches; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) launch(s);
    const auto t1 = std::chrono::steady_clock::now();
    CHECK(cudaStreamSynchronize(s));
    if (b > 0)
      per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 200;
  const int batches = argc > 2 ? std::atoi(argv[2]) : 15;
  cudaStream_t s;
  CHECK(cudaSetDevice(0));
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
  float* out;
  CHECK(cudaMalloc(&out, 4));
  Params p{};
  const double empty =
      median_us([](cudaStream_t st) { empty_kernel<<<1, 64, 0, st>>>(); }, s, calls, batches);
  CHECK(cudaGetLastError());
  const double with_params = median_us(
      [&](cudaStream_t st) {
        params_kernel<<<768, 64, 0, st>>>(p, nullptr, nullptr, nullptr, out, 96, 8);
      },
      s, calls, batches);
  CHECK(cudaGetLastError());
  const double checked = median_us(
      [&](cudaStream_t st) {
        params_kernel<<<768, 64, 0, st>>>(p, nullptr, nullptr, nullptr, out, 96, 8);
        CHECK(cudaGetLastError());
      },
      s, calls, batches);
  const double idle = median_idle_us(
      [&](cudaStream_t st) {
        params_kernel<<<768, 64, 0, st>>>(p, nullptr, nullptr, nullptr, out, 96, 8);
      },
      s, calls * 5);
  CHECK(cudaGetLastError());
  const double busy =
      median_us([&](cudaStream_t st) { busy_kernel<<<1, 32, 0, st>>>(9000); }, s, calls, batches);
  CHECK(cudaGetLastError());
  std::printf("bare launch, no parameters: %.2f us/call\n", empty);
  std::printf("bare launch, direct kernel's parameters: %.2f us/call\n", with_params);
  std::printf("same, with cudaGetLastError after each: %.2f us/call\n", checked);
  std::printf("same, one per idle stream: %.2f us/call\n", idle);
  std::printf("bare launch behind a busy queue (9 us kernels): %.2f us/call\n", busy);
  CHECK(cudaFree(out));
  CHECK(cudaStreamDestroy(s));
  return 0;
}
