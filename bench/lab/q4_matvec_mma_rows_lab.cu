// The Q4_0 mat-vec of Hopper for one to four tokens (csrc/backend/cuda/q4_matvec_rows.cuh:
// tensor-core blocks fed by bulk copies per weight row; the design is stated in q4_matvec_rows.cu)
// at other configurations than the library's: consumer warps, ring depth, slab size, tokens, and
// the data path alone (the token and the stages, or the stages only). Each shape also times its
// plain read floor. Runs and readings:
// bench/lab/records/q4_0_matvec_mma_rows-h200-2026-12-04.md (runs 1-6 timed this file's
// own copy of the kernel before it moved into the library).
//
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -Icsrc/include -Icsrc \
//     -Icsrc/backend/cuda -o /tmp/mma_rows bench/lab/q4_matvec_mma_rows_lab.cu && /tmp/mma_rows
//
// Every full variant runs once on NaN-poisoned outputs first: every output must be written, and
// sampled rows must agree with a float64 reference of the dequantised weights within the split
// numerics' bound.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "q4_lab_common.cuh"
#include "q4_matvec_rows.cuh"

namespace {

namespace rc = routemm::cuda;

using rc::RowsConfig;
using rc::RowsMode;

// float64 reference of sampled rows and the split numerics' bound on each.
// Tokens 0..m-1: x holds m rows of k values, out m rows of n.
bool check(const std::vector<uint8_t>& blocks, const std::vector<float>& x_all,
           const std::vector<float>& out, int n, int k, int m) {
  const int kb = k / 32;
  int bad = 0;
  double worst = 0;
  for (int tok = 0; tok < m; ++tok)
    for (int r = 0; r < n; r += std::max(1, n / 257)) {
      const float* const x = x_all.data() + size_t(tok) * k;
      double ref = 0, magnitude = 0;
      for (int b = 0; b < kb; ++b) {
        const uint8_t* blk = blocks.data() + (size_t(r) * kb + b) * 18;
        const uint16_t bits = uint16_t(blk[0] | (blk[1] << 8));
        const int e = (bits >> 10) & 31, mant = bits & 1023;
        const double d = (bits & 0x8000 ? -1 : 1) *
                         (e == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, e - 25));
        for (int i = 0; i < 16; ++i) {
          const double w_lo = d * ((blk[2 + i] & 15) - 8), w_hi = d * ((blk[2 + i] >> 4) - 8);
          ref += w_lo * x[b * 32 + i] + w_hi * x[b * 32 + 16 + i];
          magnitude += std::fabs(w_lo * x[b * 32 + i]) + std::fabs(w_hi * x[b * 32 + 16 + i]);
        }
      }
      const double bound = (std::ldexp(1.0, -14) + (kb + 8) * std::ldexp(1.0, -23)) * magnitude;
      const double err = std::fabs(out[size_t(tok) * n + r] - ref);
      worst = std::max(worst, err / std::max(bound, 1e-30));
      if (!(err <= bound)) ++bad;
    }
  std::printf("  check n=%d k=%d m=%d: %d rows over the bound, worst error / bound %.3f\n", n, k, m,
              bad, worst);
  return bad == 0;
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int copies = lab_weight_copies();
  std::mt19937 rng(7);
  bool ok = true;
  std::printf("empty kernel: %.2f us per launch\n",
              back_to_back_us([](int) { lab_empty_kernel<<<1, 32>>>(); }));
  struct Shape {
    int n, k;
  };
  // LAB_SHAPE=i: shape i alone (for a profiler's kernel durations, keyed by kernel and grid).
  const char* only = std::getenv("LAB_SHAPE");
  std::vector<Shape> shapes = {Shape{4096, 14336}, Shape{4096, 2048}, Shape{2048, 4096},
                               Shape{512, 2048},   Shape{37, 4352},   Shape{16, 256}};
  if (only != nullptr) shapes = {shapes.at(std::atoi(only))};
  for (const Shape s : shapes) {
    const int kb = s.k / 32;
    const size_t bytes = size_t(s.n) * kb * 18;
    std::vector<uint8_t> host(bytes);
    for (size_t b = 0; b < bytes; b += 18) {
      const float d = std::ldexp(1.0f + float(rng() % 1000) / 1000.0f, -6);
      const uint32_t f =
          *reinterpret_cast<const uint32_t*>(&d);  // to f16 (normal range, truncated)
      const uint16_t h =
          uint16_t(((f >> 16) & 0x8000) | ((((f >> 23) & 0xFF) - 112) << 10) | ((f >> 13) & 0x3FF));
      host[b] = uint8_t(h & 0xFF);
      host[b + 1] = uint8_t(h >> 8);
      for (int i = 2; i < 18; ++i) host[b + i] = uint8_t(rng());
    }
    constexpr int kMaxTokens = 4;
    std::vector<float> hx(size_t(kMaxTokens) * s.k);
    for (auto& v : hx) v = float(int(rng() % 2001) - 1000) / 1000.0f;
    std::vector<uint8_t*> weights(copies);
    for (auto& w : weights) {
      CHECK(cudaMalloc(&w, bytes));
      CHECK(cudaMemcpy(w, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    float *x, *out;
    CHECK(cudaMalloc(&x, size_t(kMaxTokens) * s.k * 4));
    CHECK(cudaMalloc(&out, size_t(kMaxTokens) * s.n * 4));
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    const int row_groups = (s.n + rc::kRowsPerGroup - 1) / rc::kRowsPerGroup;
    const int grid = std::min(row_groups, rc::kRowsCtasPerSm * sms);
    // C: a RowsConfig; m tokens (m <= C::kTokens); the aligned paths (bulk weight copies, 16-byte
    // token loads).
    const auto run_variant = [&]<class C, RowsMode kMode>(int m, const char* what) {
      const auto kernel = rc::q4_matvec_rows_kernel<C, kMode>;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
      const auto launch = [&](int call) {
        const rc::RowsArgs a{weights[call % copies], x, out, m, s.n, kb, row_groups, 16, 1};
        kernel<<<grid, C::kThreads, C::kSmem>>>(a);
      };
      if (kMode == RowsMode::kFull) {
        const size_t outputs = size_t(m) * s.n;
        CHECK(cudaMemset(out, 0xFF, outputs * 4));  // NaN poison: every output must be written
        launch(0);
        CHECK(cudaDeviceSynchronize());
        std::vector<float> hout(outputs);
        CHECK(cudaMemcpy(hout.data(), out, outputs * 4, cudaMemcpyDeviceToHost));
        int unwritten = 0;
        for (float v : hout) unwritten += std::isnan(v) ? 1 : 0;
        std::printf("  %s: %d outputs unwritten\n", what, unwritten);
        ok = check(host, hx, hout, s.n, s.k, m) && unwritten == 0 && ok;
      }
      std::printf("  %-48s %6.2f us per launch (events around 40 back-to-back launches)\n", what,
                  back_to_back_us(launch));
    };
    std::printf("n=%d k=%d (%.1f MB): grid %d, %d weight copies\n", s.n, s.k, bytes / 1e6, grid,
                copies);
    constexpr auto kFull = RowsMode::kFull;
    run_variant.operator()<RowsConfig<8, 3>, kFull>(1, "8 consumers, 64-block slabs x 3, full");
    run_variant.operator()<RowsConfig<4, 3>, kFull>(1, "4 consumers, 64-block slabs x 3, full");
    run_variant.operator()<RowsConfig<4, 2>, kFull>(1, "4 consumers, 64-block slabs x 2, full");
    run_variant.operator()<RowsConfig<8, 2>, kFull>(1, "8 consumers, 64-block slabs x 2, full");
    run_variant.operator()<RowsConfig<8, 4>, kFull>(1, "8 consumers, 64-block slabs x 4, full");
    run_variant.operator()<RowsConfig<4, 3, 32>, kFull>(1, "4 consumers, 32-block slabs x 3, full");
    run_variant.operator()<RowsConfig<4, 4, 32>, kFull>(1, "4 consumers, 32-block slabs x 4, full");
    run_variant.operator()<RowsConfig<4, 3, 64, 2>, kFull>(2, "4 consumers, x 3, 2 tokens, full");
    run_variant.operator()<RowsConfig<8, 3, 64, 2>, kFull>(2, "8 consumers, x 3, 2 tokens, full");
    run_variant.operator()<RowsConfig<4, 3, 64, 4>, kFull>(3, "4 consumers, x 3, 3 of 4 tokens");
    run_variant.operator()<RowsConfig<4, 3, 64, 4>, kFull>(4, "4 consumers, x 3, 4 tokens, full");
    {  // the shape's read floor: its weight bytes read once by a plain streaming kernel
      uint32_t* sink = nullptr;
      CHECK(cudaMalloc(&sink, 4));
      const size_t units = bytes / 16;
      const auto floor_launch = [&](auto kernel) {
        return back_to_back_us([&](int call) {
          kernel<<<8 * sms, 256>>>(reinterpret_cast<const uint4*>(weights[call % copies]), units,
                                   sink);
        });
      };
      std::printf("  %-48s %6.2f us per launch (events around 40 back-to-back launches)\n",
                  "read floor, 4 loads in flight per thread", floor_launch(lab_read_kernel<4>));
      std::printf("  %-48s %6.2f us per launch (events around 40 back-to-back launches)\n",
                  "read floor, 8 loads in flight per thread", floor_launch(lab_read_kernel<8>));
      CHECK(cudaFree(sink));
    }
    run_variant.operator()<RowsConfig<4, 3>, RowsMode::kDataPath>(
        1, "64-block slabs x 3, data path (token + stages)");
    run_variant.operator()<RowsConfig<4, 3>, RowsMode::kStagesOnly>(
        1, "64-block slabs x 3, stages only");
    for (auto* w : weights) CHECK(cudaFree(w));
    CHECK(cudaFree(x));
    CHECK(cudaFree(out));
  }
  std::printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
