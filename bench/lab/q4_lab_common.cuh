// What the labs (bench/lab/*.cu) share: the CUDA-call check, the rotated weight copies and their
// activations, a median of CUDA-event times per call, and the 1-D bulk copy (sm_90).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "wgmma.cuh"

// Global -> shared bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned),
// counted on the mbarrier `bar` of the issuing CTA (sm_90+): the library's primitive.
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes,
                                              uint32_t bar) {
  routemm::cuda::sm90::bulk_load(dst, src, bytes, bar);
}

#define CHECK(call)                                                                              \
  do {                                                                                           \
    const cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// Weight copies to rotate over: LAB_COPIES (default 8, over twice the 50 MB L2 at 4096 x 14336;
// LAB_COPIES=1 keeps one copy resident in L2: the time without DRAM).
inline int lab_weight_copies() {
  const char* env = std::getenv("LAB_COPIES");
  return env != nullptr ? std::max(1, std::atoi(env)) : 8;
}

// The operands of an n x k Q4_0 product with up to `max_m` tokens: `copies` device copies of one
// pseudo-random weight matrix (finite f16 scales), zeroed activations and an output.
struct Q4LabOperands {
  std::vector<uint8_t*> weights;
  float* input = nullptr;
  float* output = nullptr;

  Q4LabOperands(uint32_t n, uint32_t k, uint32_t max_m, int copies) {
    const size_t bytes = size_t(n) * (k / 32) * 18;
    std::vector<uint8_t> host(bytes);
    uint32_t state = 12345;
    for (auto& b : host) {
      state = state * 1664525u + 1013904223u;
      b = uint8_t(state >> 24);
    }
    for (size_t i = 0; i < host.size(); i += 18) host[i + 1] = 0x2c;  // finite f16 scales
    weights.resize(copies);
    for (auto& p : weights) {
      CHECK(cudaMalloc(&p, bytes));
      CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    CHECK(cudaMalloc(&input, size_t(max_m) * k * 4));
    CHECK(cudaMemset(input, 0, size_t(max_m) * k * 4));
    CHECK(cudaMalloc(&output, size_t(max_m) * n * 4));
  }
  const uint8_t* weight(int call) const { return weights[call % weights.size()]; }
};

// Median CUDA-event time (us) of launch(call) on `stream` over `reps` calls after `warmup` calls;
// `min_us`, when given, receives the fastest.
template <class Launch>
float median_event_us(Launch&& launch, int reps, int warmup = 5, cudaStream_t stream = nullptr,
                      float* min_us = nullptr) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps + warmup; ++i) {
    CHECK(cudaEventRecord(a, stream));
    launch(i);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= warmup) t.push_back(ms * 1000.0f);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  if (min_us != nullptr) *min_us = t.front();
  return t[t.size() / 2];
}

// Per-launch time (us) of launches back to back: CUDA events around 40 calls launch(i) after 4
// warm-up calls, so the launch gap is included but not the host's wait for each call. Compare with
// lab_empty_kernel's figure.
template <class Launch>
float back_to_back_us(Launch&& launch) {
  constexpr int kCalls = 40;
  for (int i = 0; i < 4; ++i) launch(i);
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0));
  for (int i = 0; i < kCalls; ++i) launch(i);
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  return ms * 1000 / kCalls;
}

__global__ void lab_empty_kernel() {}
