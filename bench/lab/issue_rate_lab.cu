// Throughput of the instructions a nibble decode is made of, per multiprocessor and clock: byte
// permute (PRMT), LOP3, funnel shift, FADD/FFMA, packed half add (HADD2) and half -> float
// conversion. Each thread runs 8 independent chains of one instruction kind; the grid fills every
// multiprocessor with 32 warps.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 -Icsrc/backend/cuda -o /tmp/issue_rate bench/lab/issue_rate_lab.cu && /tmp/issue_rate
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "q4_lab_common.cuh"

constexpr int kIters = 4096;
constexpr int kChains = 8;

enum Op { kPrmt, kLop3, kShf, kFfma, kFadd, kHadd2, kH2F };

template <Op kOp>
__global__ void chains(unsigned seed, unsigned* sink) {
  unsigned u[kChains];
  float f[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
    u[c] = seed * (threadIdx.x + c + 1);
    f[c] = __uint_as_float(0x3F800000u | (u[c] & 0xFFFF));
  }
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kOp == kPrmt) {
        u[c] = __byte_perm(u[c], 0x4B000000u, 0x7441u);
      } else if constexpr (kOp == kLop3) {
        asm volatile("lop3.b32 %0, %0, 0x0F0F0F0F, 0x4B000000, 0xEA;" : "+r"(u[c]));
      } else if constexpr (kOp == kShf) {
        u[c] = __funnelshift_rc(u[c], seed, 16);
      } else if constexpr (kOp == kFfma) {
        f[c] = fmaf(f[c], 1.0001f, 0.5f);
      } else if constexpr (kOp == kFadd) {
        f[c] = f[c] - 8388616.0f;
      } else if constexpr (kOp == kHadd2) {
        __half2 h = *reinterpret_cast<__half2*>(&u[c]);
        h = __hsub2(h, __floats2half2_rn(1032.0f, 1032.0f));
        u[c] = *reinterpret_cast<unsigned*>(&h);
      } else {
        const __half h = __ushort_as_half(static_cast<unsigned short>(u[c]));
        f[c] += __half2float(h);
        u[c] ^= __float_as_uint(f[c]);
      }
    }
  }
  unsigned acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc ^= u[c] ^ __float_as_uint(f[c]);
  if (acc == 0x12345678u) sink[0] = acc;
}

template <Op kOp>
void run(const char* name, int sms, unsigned* sink) {
  const int blocks = sms * 4, threads = 256;  // 32 warps per multiprocessor
  chains<kOp><<<blocks, threads>>>(1u, sink);
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0));
  chains<kOp><<<blocks, threads>>>(3u, sink);
  CHECK(cudaEventRecord(t1));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double ops = double(blocks) * threads * kIters * kChains;
  const double per_sm_clock = ops / sms / (ms * 1e-3 * clock_khz * 1e3);
  std::printf("%-28s %8.3f ms  %6.1f thread-ops per SM per clock (at %d MHz)\n", name, ms,
              per_sm_clock, clock_khz / 1000);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 4));
  run<kPrmt>("PRMT (byte permute)", sms, sink);
  run<kLop3>("LOP3", sms, sink);
  run<kShf>("SHF (funnel shift)", sms, sink);
  run<kFfma>("FFMA", sms, sink);
  run<kFadd>("FADD", sms, sink);
  run<kHadd2>("HADD2 (2 halves)", sms, sink);
  run<kH2F>("half -> float + FADD + LOP", sms, sink);
  CHECK(cudaFree(sink));
  return 0;
}
