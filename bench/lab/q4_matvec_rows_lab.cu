// Where the one-token Q4_0 mat-vec experiment (bench/lab/q4_matvec_rows_kernel.cuh) spends its
// time: the kernel, its data path alone (consumers release every stage unread) and its arithmetic
// alone (no copies), over stage size, ring depth and CTAs per multiprocessor.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//     -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/rows_lab bench/lab/q4_matvec_rows_lab.cu
//   /tmp/rows_lab            (LAB_COPIES=1: one weight copy, so the matrix can sit in L2)
//
// Timing: CUDA events around 40 back-to-back launches, weights rotating over 8 copies (> 2x L2);
// the per-launch figure includes the launch gap, so an empty kernel's figure is printed first.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "q4_lab_common.cuh"
#include "q4_matvec_rows_kernel.cuh"

namespace rc = q4_rows_lab;

template <rc::RowsMode kMode, rc::RowsDecode kDecode = rc::RowsDecode::kPermute>
float time_mode(const std::vector<uint8_t*>& weights, const float* x, float* out, uint32_t n,
                uint32_t k, uint32_t sms, const rc::RowsTuning& tuning) {
  std::vector<rc::RowsLaunch> launches;
  for (uint8_t* w : weights) {
    launches.push_back(
        rc::rows_launch({.weight = w, .input = x, .output = out, .n = n, .k = k}, sms, tuning));
  }
  const auto kernel = rc::q4_matvec_rows_kernel<kMode, kDecode>;
  CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, launches[0].smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, launches[0].threads,
                                                      launches[0].smem));
  const float us = back_to_back_us([&](int i) {
    const rc::RowsLaunch& l = launches[i % launches.size()];
    kernel<<<l.grid, l.threads, l.smem>>>(l.args);
  });
  const rc::RowsLaunch& l = launches[0];
  std::printf(
      "  grid %4u x %3u threads, smem %6u B, %d CTAs/SM, stage %2u rows x %5u B, %u stages/CTA, "
      "ring %u: %7.2f us\n",
      l.grid, l.threads, l.smem, per_sm, l.args.stage_rows, l.args.stride, l.args.stages_per_cta,
      l.args.ring, us);
  return us;
}

int main() {
  CHECK(cudaSetDevice(0));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int copies = lab_weight_copies();
  std::mt19937 rng(1);
  std::printf("empty kernel: %.2f us per launch\n",
              back_to_back_us([](int) { lab_empty_kernel<<<1, 32>>>(); }));
  struct Shape {
    uint32_t n, k;
  };
  for (const Shape s : {Shape{4096, 14336}, Shape{4096, 2048}}) {
    const size_t bytes = size_t(s.n) * s.k / 32 * 18;
    std::vector<uint8_t> host(bytes);
    for (size_t b = 0; b < bytes; b += 18) {
      host[b] = 0x00;
      host[b + 1] = 0x2C;  // d = 1/16
      for (int i = 2; i < 18; ++i) host[b + i] = static_cast<uint8_t>(rng());
    }
    std::vector<uint8_t*> weights(copies);
    for (auto& w : weights) {
      CHECK(cudaMalloc(&w, bytes));
      CHECK(cudaMemcpy(w, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    std::vector<float> hx(s.k);
    for (auto& v : hx) v = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
    float *x, *out;
    CHECK(cudaMalloc(&x, s.k * 4));
    CHECK(cudaMalloc(&out, s.n * 4));
    CHECK(cudaMemcpy(x, hx.data(), s.k * 4, cudaMemcpyHostToDevice));
    std::printf("n=%u k=%u (%.1f MB), %d copies\n", s.n, s.k, bytes / 1e6, copies);
    const rc::RowsTuning base;
    if (std::getenv("LAB_PROFILE")) {  // one launch of each mode, for Nsight Compute
      time_mode<rc::RowsMode::kFull>(weights, x, out, s.n, s.k, sms, base);
      time_mode<rc::RowsMode::kComputeOnly>(weights, x, out, s.n, s.k, sms, base);
      break;
    }
    std::printf(" full\n");
    time_mode<rc::RowsMode::kFull>(weights, x, out, s.n, s.k, sms, base);
    std::printf(" stream only\n");
    time_mode<rc::RowsMode::kStreamOnly>(weights, x, out, s.n, s.k, sms, base);
    std::printf(" compute only\n");
    time_mode<rc::RowsMode::kComputeOnly>(weights, x, out, s.n, s.k, sms, base);
    std::printf(" half decode: full / compute only\n");
    time_mode<rc::RowsMode::kFull, rc::RowsDecode::kHalves>(weights, x, out, s.n, s.k, sms, base);
    time_mode<rc::RowsMode::kComputeOnly, rc::RowsDecode::kHalves>(weights, x, out, s.n, s.k, sms,
                                                                   base);
    if (std::getenv("LAB_SHORT")) continue;
    std::printf(" tunings (full / stream only)\n");
    for (const rc::RowsTuning t : {
             rc::RowsTuning{.stage_bytes = 8192, .ring = 8},
             rc::RowsTuning{.stage_bytes = 32768, .ring = 2},
             rc::RowsTuning{.stage_bytes = 16384, .ring = 2},
             rc::RowsTuning{.stage_bytes = 16384, .ring = 4, .ctas_per_sm = 1},
             rc::RowsTuning{.stage_bytes = 16384, .ring = 4, .ctas_per_sm = 4},
             rc::RowsTuning{.stage_bytes = 8192, .ring = 4, .ctas_per_sm = 4},
             rc::RowsTuning{
                 .stage_bytes = 4096, .ring = 8, .ctas_per_sm = 2, .max_stages_per_cta = 32},
         }) {
      std::printf("  stage %u B target, ring %u, %u CTAs/SM target, <= %u stages/CTA\n",
                  t.stage_bytes, t.ring, t.ctas_per_sm, t.max_stages_per_cta);
      time_mode<rc::RowsMode::kFull>(weights, x, out, s.n, s.k, sms, t);
      time_mode<rc::RowsMode::kStreamOnly>(weights, x, out, s.n, s.k, sms, t);
    }
    for (auto* w : weights) CHECK(cudaFree(w));
    CHECK(cudaFree(x));
    CHECK(cudaFree(out));
  }
  return 0;
}
