// The next Q4_0 mat-vec experiment (bench/results/experiments/q4_0_matvec_rows-h200-2026-12-04.md,
// "Reading"): the library mat-vec's tensor-core arithmetic for one token
// (matvec_split_columns_block: two mma.sync per block, hi / lo activation columns, the split
// numerics) fed by the bulk-copy data path of the CUDA-core experiment. Runs and readings:
// bench/results/experiments/q4_0_matvec_mma_rows-h200-2026-12-04.md.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -Icsrc/include -Icsrc \
//     -Icsrc/backend/cuda -o /tmp/mma_rows bench/lab/q4_matvec_mma_rows_lab.cu && /tmp/mma_rows
//
// KERNEL (m = 1, k % 256 == 0, 16-byte aligned weights and input):
//   - A CTA walks 16-row groups (rg = blockIdx.x, blockIdx.x + gridDim.x, ...). A row group's K is cut
//     into slabs of 64 blocks (1152 bytes per row; the last slab may be shorter, a multiple of 8
//     blocks), and a stage is one slab of the 16 rows: 16 bulk copies (one per row, issued by the
//     producer warp's lanes 0..15) into a ring of kRing slots with full / empty mbarriers.
//   - kConsumers warps split each stage's blocks (4 warps: warp w takes blocks 16w..16w+15). Per
//     block, each
//     lane decodes its A registers of rows g and g + 8 from the stage and runs the block's two MMAs
//     with the token's hi / lo B quad (matvec_split_columns_block), then one FMA with the block's
//     scale into its two accumulators.
//   - The token's B quads (hi and lo bf16 parts of a block, 128 bytes per block): each consumer warp
//     loads its blocks' activations one stage ahead into registers and splits them into its own
//     shared slice before it waits for the stage (no prologue, no limit on K). (Runs 1-5 built the
//     whole K's quads per CTA before the first stage: about 1 us of prologue at 4096 x 14336.)
//   - After a row group's last slab the consumer warps' sums of each row are added in warp order and
//     stored.
// Each output is summed in a fixed order (a warp's blocks in increasing order, then the warps in order), so
// a run is repeatable. The order differs from the library mat-vec's K split: the results agree
// within the split numerics' bound, not bit for bit. The lab checks sampled rows against a float64
// reference of the dequantised weights with that bound.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "q4_lab_common.cuh"
#include "q4_matvec_block.cuh"
#include "wgmma.cuh"

namespace {

namespace rc = routemm::cuda;
namespace sm90 = routemm::cuda::sm90;

constexpr int kRows = 16;           // one MMA tile of weight rows per row group
constexpr int kMaxConsumers = 8;    // consumer warps: 4 or 8
constexpr int kBarrierBytes = 256;  // full and empty mbarriers of up to 16 slots

// What a variant runs: kFull the product; kDataPath the token's copy and conversion and the stages
// (waited for and released, no arithmetic; the outputs are zeros); kStagesOnly the stages alone.
enum Mode { kFull, kDataPath, kStagesOnly };

// kSlabBlocks blocks per stage and row, kRing stages in the ring.
template <int kSlabBlocks_, int kRing_>
struct Ring {
  static constexpr int kSlabBlocks = kSlabBlocks_, kRing = kRing_;
  static constexpr int kSlabBytes = kSlabBlocks * 18;  // a full slab of one row
  // The stage's row stride: 64 * 18 = 1152 is a multiple of 128, so rows g = 0..7 of a lane's MMA
  // fragment would share banks (8-way conflicts on every A and scale load); 16 more bytes spread
  // the 8 rows over distinct 16-byte bank groups (also for 32-block slabs: 592 bytes).
  static constexpr int kRowStride = kSlabBytes + 16;
  static constexpr int kBytes = kRing * kRows * kRowStride;
  static_assert(2 * 8 * kRing <= kBarrierBytes);
};
constexpr int kQuadBytes = 8 * 16;  // B quads of one block: lanes 0..3 hi, 4..7 lo

struct Args {
  const uint8_t* weight;
  const float* input;
  float* output;
  int n, k_blocks, row_groups;
};

template <class R>
constexpr int smem_bytes() {
  return kBarrierBytes + R::kBytes + R::kSlabBlocks * kQuadBytes + kMaxConsumers * kRows * 4;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

template <int kConsumers, class R, Mode kMode>
__global__ void __launch_bounds__(32 * (kConsumers + 1), 2)
    q4_matvec_mma_rows_kernel(const Args a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kSlabBlocks = R::kSlabBlocks, kRing = R::kRing, kSlabBytes = R::kSlabBytes;
  constexpr int kRowStride = R::kRowStride;
  constexpr int kWarpBlocks = kSlabBlocks / kConsumers;  // blocks per consumer warp and stage
  constexpr int kXLoads = kWarpBlocks / 4;               // float4 loads per lane and stage
  constexpr bool kMath = kMode == kFull;
  static_assert(kWarpBlocks % 4 == 0);
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t full0 = smem_u32(smem), empty0 = full0 + 8 * kRing;
  uint8_t* const ring = smem + kBarrierBytes;
  uint8_t* const warp_quads = ring + R::kBytes + warp * kWarpBlocks * kQuadBytes;
  float* const partial =
      reinterpret_cast<float*>(ring + R::kBytes + kConsumers * kWarpBlocks * kQuadBytes);
  const int slabs = (a.k_blocks + kSlabBlocks - 1) / kSlabBlocks;
  const uint64_t row_bytes = uint64_t(a.k_blocks) * 18;
  if (tid == 0) {
    for (int s = 0; s < kRing; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);
      sm90::mbar_init(empty0 + 8 * s, kConsumers);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();

  if (warp == kConsumers) {  // producer: stages in (row group, slab) order
    int s = 0;
    for (int rg = blockIdx.x; rg < a.row_groups; rg += gridDim.x) {
      const int rows = min(kRows, a.n - rg * kRows);
      for (int j = 0; j < slabs; ++j, ++s) {
        const int slot = s % kRing, round = s / kRing;
        if (round > 0) sm90::mbar_wait(empty0 + 8 * slot, (round - 1) & 1);
        const int bytes = min(kSlabBlocks, a.k_blocks - j * kSlabBlocks) * 18;
        if (lane == 0) sm90::mbar_arrive_expect_tx(full0 + 8 * slot, rows * bytes);
        __syncwarp();
        if (lane < rows) {
          routemm::cuda::sm90::bulk_load(
              smem_u32(ring + (slot * kRows + lane) * kRowStride),
              a.weight + (uint64_t(rg) * kRows + lane) * row_bytes + j * kSlabBytes, bytes,
              full0 + 8 * slot);
        }
      }
    }
    return;
  }

  // The token, per consumer warp and stage: the warp's kWarpBlocks blocks of the slab (loaded one
  // stage ahead into registers, L2-resident after the first CTA), split into B quads in the warp's
  // own shared slice. Load step q: lane L holds chunk c = L % 8 (x[32b + 4c .. + 3]) of block
  // b = 4q + L / 8 of the slice; quad tq needs chunks tq and tq + 4, so lanes L and L ^ 4 exchange
  // chunks, and lane c < 4 writes the hi quad c, lane c >= 4 the lo quad c (= 4 + (c - 4)).
  float4 xv[kXLoads];
  const auto load_x = [&](int j) {
#pragma unroll
    for (int q = 0; q < kXLoads; ++q) {
      const int b = j * kSlabBlocks + warp * kWarpBlocks + 4 * q + (lane >> 3);
      xv[q] = b < a.k_blocks
                  ? __ldg(reinterpret_cast<const float4*>(a.input + b * 32 + 4 * (lane & 7)))
                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  const auto split_x = [&]() {
    const bool low_half = (lane & 4) == 0;
#pragma unroll
    for (int q = 0; q < kXLoads; ++q) {
      const float own[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};
      float v[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float other = __shfl_xor_sync(0xFFFFFFFFu, own[i], 4);
        v[i] = low_half ? own[i] : other;
        v[4 + i] = low_half ? other : own[i];
      }
      uint32_t hi[4], lo[4];
      rc::split_activation_pairs(v, hi, lo);
      const uint32_t dst = smem_u32(warp_quads + q * 4 * kQuadBytes + lane * 16);
      if (low_half) {
        rc::sts128(dst, hi[0], hi[1], hi[2], hi[3]);
      } else {
        rc::sts128(dst, lo[0], lo[1], lo[2], lo[3]);
      }
    }
  };

  // Lanes past the token's 8 quads read quad 7 (finite; their MMA columns are never used).
  const uint8_t* const my_quads = warp_quads + min(lane, 7) * 16;
  if (kMode != kStagesOnly) load_x(0);
  int s = 0;
  for (int rg = blockIdx.x; rg < a.row_groups; rg += gridDim.x) {
    float acc_top = 0.0f, acc_bottom = 0.0f;  // rows g and g + 8 (lanes t == 0)
    for (int j = 0; j < slabs; ++j, ++s) {
      const int slot = s % kRing, round = s / kRing;
      if (kMode != kStagesOnly) {
        __syncwarp();  // the previous stage's quads are read
        split_x();
        load_x(j + 1 < slabs ? j + 1 : 0);  // the next stage's slice (the next row group's first)
        __syncwarp();
      }
      sm90::mbar_wait(full0 + 8 * slot, round & 1);
      const int blocks = min(kSlabBlocks, a.k_blocks - j * kSlabBlocks);
      const uint8_t* const top = ring + (slot * kRows + g) * kRowStride;
      const uint8_t* const bottom = top + 8 * kRowStride;
      const int first = warp * kWarpBlocks;
      if (!kMath) {
      } else if (first + kWarpBlocks <= blocks) {
#pragma unroll
        for (int i = 0; i < kWarpBlocks; ++i) {
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kQuadBytes);
          rc::matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
        }
      } else {
        for (int i = 0; first + i < blocks; ++i) {
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kQuadBytes);
          rc::matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
        }
      }
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(empty0 + 8 * slot);
    }
    if (t == 0) {
      partial[warp * kRows + g] = acc_top;
      partial[warp * kRows + g + 8] = acc_bottom;
    }
    sm90::named_barrier_sync(1, 32 * kConsumers);
    if (tid < kRows && rg * kRows + tid < a.n) {
      float sum = partial[tid];
      for (int w = 1; w < kConsumers; ++w) sum += partial[w * kRows + tid];
      a.output[rg * kRows + tid] = sum;
    }
    sm90::named_barrier_sync(1, 32 * kConsumers);  // partial is free for the next row group
  }
#else
  __trap();  // the lab builds for sm_90a only
#endif
}

// float64 reference of sampled rows and the split numerics' bound on each.
bool check(const std::vector<uint8_t>& blocks, const std::vector<float>& x,
           const std::vector<float>& out, int n, int k) {
  const int kb = k / 32;
  int bad = 0;
  double worst = 0;
  for (int r = 0; r < n; r += std::max(1, n / 257)) {
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
    const double err = std::fabs(out[r] - ref);
    worst = std::max(worst, err / std::max(bound, 1e-30));
    if (!(err <= bound)) ++bad;
  }
  std::printf("  check n=%d k=%d: %d rows over the bound, worst error / bound %.3f\n", n, k, bad,
              worst);
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
    std::vector<float> hx(s.k);
    for (auto& v : hx) v = float(int(rng() % 2001) - 1000) / 1000.0f;
    std::vector<uint8_t*> weights(copies);
    for (auto& w : weights) {
      CHECK(cudaMalloc(&w, bytes));
      CHECK(cudaMemcpy(w, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    float *x, *out;
    CHECK(cudaMalloc(&x, s.k * 4));
    CHECK(cudaMalloc(&out, s.n * 4));
    CHECK(cudaMemcpy(x, hx.data(), s.k * 4, cudaMemcpyHostToDevice));
    const int row_groups = (s.n + kRows - 1) / kRows;
    const int grid = std::min(row_groups, 2 * sms);
    // kConsumers consumer warps, ring R, mode kMode; threads and shared memory follow from them.
    const auto run_variant = [&]<int kConsumers, class R, Mode kMode>(const char* what) {
      const auto kernel = q4_matvec_mma_rows_kernel<kConsumers, R, kMode>;
      const int smem = smem_bytes<R>(), threads = 32 * (kConsumers + 1);
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const auto launch = [&](int call) {
        const Args a{weights[call % copies], x, out, s.n, kb, row_groups};
        kernel<<<grid, threads, smem>>>(a);
      };
      if (kMode == kFull) {
        CHECK(cudaMemset(out, 0xFF, s.n * 4));  // NaN poison: every output must be written
        launch(0);
        CHECK(cudaDeviceSynchronize());
        std::vector<float> hout(s.n);
        CHECK(cudaMemcpy(hout.data(), out, s.n * 4, cudaMemcpyDeviceToHost));
        int unwritten = 0;
        for (float v : hout) unwritten += std::isnan(v) ? 1 : 0;
        std::printf("  %s: %d outputs unwritten\n", what, unwritten);
        ok = check(host, hx, hout, s.n, s.k) && unwritten == 0 && ok;
      }
      std::printf("  %-48s %6.2f us per launch (events around 40 back-to-back launches)\n", what,
                  back_to_back_us(launch));
    };
    using R64x2 = Ring<64, 2>;
    using R64x3 = Ring<64, 3>;
    using R64x4 = Ring<64, 4>;
    using R32x3 = Ring<32, 3>;
    using R32x4 = Ring<32, 4>;
    std::printf("n=%d k=%d (%.1f MB): grid %d, %d weight copies\n", s.n, s.k, bytes / 1e6, grid,
                copies);
    run_variant.operator()<8, R64x3, kFull>("8 consumers, 64-block slabs x 3, full");
    run_variant.operator()<4, R64x3, kFull>("4 consumers, 64-block slabs x 3, full");
    run_variant.operator()<4, R64x2, kFull>("4 consumers, 64-block slabs x 2, full");
    run_variant.operator()<8, R64x2, kFull>("8 consumers, 64-block slabs x 2, full");
    run_variant.operator()<8, R64x4, kFull>("8 consumers, 64-block slabs x 4, full");
    run_variant.operator()<4, R32x3, kFull>("4 consumers, 32-block slabs x 3, full");
    run_variant.operator()<4, R32x4, kFull>("4 consumers, 32-block slabs x 4, full");
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
    run_variant.operator()<4, R64x3, kDataPath>("64-block slabs x 3, data path (token + stages)");
    run_variant.operator()<4, R64x3, kStagesOnly>("64-block slabs x 3, stages only");
    for (auto* w : weights) CHECK(cudaFree(w));
    CHECK(cudaFree(x));
    CHECK(cudaFree(out));
  }
  std::printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
