// What the labs (bench/lab/*.cu) share: the CUDA-call check, the rotated weight copies and their
// activations, a median of CUDA-event times per call, back-to-back launch times, and a plain
// streaming reader (the read floor of a buffer).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "wgmma.cuh"

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

// The read floor of a buffer: `units` 16-byte words loaded once each (streaming loads, kUnroll in
// flight per thread; launch it as a grid of 8 x 256-thread CTAs per SM), XOR-folded so no load
// can be dropped; the sink is written only when the fold hits one value (a store the compiler must
// keep).
template <int kUnroll>
__global__ void __launch_bounds__(256)
    lab_read_kernel(const uint4* data, size_t units, uint32_t* sink) {
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
