// Lab: how fast can the Q4_0 mat-vec's grid stream its weights? Times copy-only kernels with the
// mat-vec's decomposition (CTA = 4 warps x 16 rows, K split over grid.z; warp w streams its 16 rows'
// K range through its own shared-memory ring) with two data paths -- per-lane cp.async 16-byte copies
// and TMA bulk copies (one per row run, completion on an mbarrier) -- over ring depths and stage
// sizes, beside the production kernel and an empty kernel. Weights rotate over 8 copies (> 2x L2).
// Kernel spans come from %globaltimer (first CTA start to last CTA end) and from CUDA events.
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/lab bench/lab/q4_matvec_lab.cu \
//        csrc/backend/cuda/q4_matmul_wgmma.cu csrc/backend/cuda/hopper_support.cu && /tmp/lab
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/q4_matmul.cu"
#include "q4_lab_common.cuh"

using namespace routemm::cuda;

// mbarrier and TMA bulk copies (sm_90+): one stage of a ring completes when its expected bytes
// have landed. mbar_wait spins on try_wait (which itself suspends for a while in hardware).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy
// (bulk copy) writes to the same memory.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

struct LabArgs {
  const uint8_t* weight;
  uint64_t row_bytes;
  int k_blocks, blocks_per_split;
  unsigned long long* span;  // [0] = min start, [1] = max end (ns)
  uint32_t* sink;
};

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void span_begin(const LabArgs& a) {
  if (threadIdx.x == 0) atomicMin(&a.span[0], now_ns());
}
__device__ __forceinline__ void span_end(const LabArgs& a) {
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&a.span[1], now_ns());
}

__global__ void empty_kernel(LabArgs a) {
  span_begin(a);
  span_end(a);
}

constexpr int kWarpRows = 16;

// What warp `warp` of a CTA streams (the mat-vec's decomposition): its 16 rows' K range of this
// CTA's split, in stages of SB blocks through its own S-stage shared-memory ring.
template <int SB, int S>
struct WarpShare {
  static constexpr int kRowBytes = 18 * SB, kStage = kWarpRows * kRowBytes;
  int lane, warp, stages;
  uint8_t* ring;
  const uint8_t* rows;
  __device__ WarpShare(const LabArgs& a, uint8_t* smem) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * 64 + warp * kWarpRows;
    const int kb_begin = blockIdx.z * a.blocks_per_split;
    stages = (min(a.k_blocks, kb_begin + a.blocks_per_split) - kb_begin) / SB;
    ring = smem + warp * S * kStage;
    rows = a.weight + uint64_t(row0) * a.row_bytes + uint64_t(kb_begin) * 18;
  }
  __device__ uint8_t* slot(int s) const { return ring + (s % S) * kStage; }
};

// Per-lane cp.async 16-byte copies, SB blocks per stage, S stages per warp ring.
template <int SB, int S>
__global__ void __launch_bounds__(128) stream_cp(LabArgs a) {
  span_begin(a);
  extern __shared__ __align__(128) uint8_t smem[];
  using Share = WarpShare<SB, S>;
  const Share w(a, smem);
  constexpr int kRowBytes = Share::kRowBytes, kUnits = kRowBytes / 16;
  constexpr int kCopies = (kWarpRows * kUnits + 31) / 32;
  const int lane = w.lane, stages = w.stages;
  uint32_t x = 0;
  const auto load = [&](int s) {
#pragma unroll
    for (int j = 0; j < kCopies; ++j) {
      const int u = lane + 32 * j;
      if (u < kWarpRows * kUnits) {
        const int r = u / kUnits, c = u % kUnits;
        cp_async_16(smem_addr(w.slot(s) + r * kRowBytes + c * 16),
                    w.rows + uint64_t(r) * a.row_bytes + uint64_t(s) * kRowBytes + c * 16, true);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < stages) load(s);
    cp_async_commit();
  }
  for (int s = 0; s < stages; ++s) {
    cp_async_wait<S - 2>();
    __syncwarp();
    if (s + S - 1 < stages) load(s + S - 1);
    cp_async_commit();
    x ^= *reinterpret_cast<const uint32_t*>(w.slot(s) + lane * 4);
  }
  cp_async_wait_all();
  if (x == 0x12345678u) a.sink[0] = x;
  span_end(a);
}

// TMA bulk copies: per stage, lane r < 16 copies row r's run (18 * SB bytes) and the stage's
// mbarrier counts the bytes; S stages per warp ring.
template <int SB, int S>
__global__ void __launch_bounds__(128) stream_bulk(LabArgs a) {
  span_begin(a);
  extern __shared__ __align__(128) uint8_t smem[];
  using Share = WarpShare<SB, S>;
  const Share w(a, smem);
  constexpr int kRowBytes = Share::kRowBytes, kStage = Share::kStage;
  const int lane = w.lane, stages = w.stages;
  __shared__ __align__(8) uint64_t bars[4][S];
  const uint32_t bar0 = smem_addr(&bars[w.warp][0]);
  if (lane < S) mbar_init(bar0 + 8 * lane, 1);
  mbar_init_fence();
  __syncwarp();
  const auto load = [&](int s) {
    const uint32_t bar = bar0 + 8 * (s % S);
    if (lane == 0) mbar_arrive_expect_tx(bar, kStage);
    __syncwarp();
    if (lane < kWarpRows) {
      routemm::cuda::sm90::bulk_load(
          smem_addr(w.slot(s) + lane * kRowBytes),
          w.rows + uint64_t(lane) * a.row_bytes + uint64_t(s) * kRowBytes, kRowBytes, bar);
    }
  };
  for (int s = 0; s < S - 1 && s < stages; ++s) load(s);
  uint32_t x = 0;
  for (int s = 0; s < stages; ++s) {
    mbar_wait(bar0 + 8 * (s % S), (s / S) & 1);
    x ^= *reinterpret_cast<const uint32_t*>(w.slot(s) + lane * 4);
    __syncwarp();
    fence_proxy_async_shared();
    if (s + S - 1 < stages) load(s + S - 1);
  }
  if (x == 0x12345678u) a.sink[0] = x;
  span_end(a);
}

using LabKernel = void (*)(LabArgs);

struct Case {
  const char* name;
  LabKernel kernel;
  int smem, splits, k;
};

int main() {
  const int n = 4096, k_max = 14336;
  const Q4LabOperands ops(n, k_max, 8, lab_weight_copies());
  unsigned long long* span;
  uint32_t* sink;
  CHECK(cudaMalloc(&span, 16));
  CHECK(cudaMalloc(&sink, 16));
  const int stage8 = kWarpRows * 8 * 18 * 4, stage16 = 2 * stage8;  // per CTA
  const std::vector<Case> cases = {
      {"empty", empty_kernel, 0, 8, k_max},
      {"cp  SB8  S3", stream_cp<8, 3>, 3 * stage8, 8, k_max},
      {"cp  SB8  S4", stream_cp<8, 4>, 4 * stage8, 8, k_max},
      {"cp  SB8  S6", stream_cp<8, 6>, 6 * stage8, 8, k_max},
      {"blk SB8  S4", stream_bulk<8, 4>, 4 * stage8, 8, k_max},
      {"blk SB8  S6", stream_bulk<8, 6>, 6 * stage8, 8, k_max},
      {"cp  SB8  S4", stream_cp<8, 4>, 4 * stage8, 4, k_max},
      {"cp  SB8  S8", stream_cp<8, 8>, 8 * stage8, 4, k_max},
      {"blk SB8  S8", stream_bulk<8, 8>, 8 * stage8, 4, k_max},
      {"blk SB16 S6", stream_bulk<16, 6>, 6 * stage16, 4, k_max},
      {"cp  SB8  S8", stream_cp<8, 8>, 8 * stage8, 2, k_max},
      {"blk SB16 S6", stream_bulk<16, 6>, 6 * stage16, 2, k_max},
      {"blk SB8  S8", stream_bulk<8, 8>, 8 * stage8, 16, k_max},
      {"cp  SB8  S4", stream_cp<8, 4>, 4 * stage8, 8, 2048},
      {"blk SB8  S4", stream_bulk<8, 4>, 4 * stage8, 8, 2048},
  };
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Case& c : cases) {
    if (std::getenv("LAB_MATVEC_ONLY") != nullptr) break;  // the mat-vec sweep below only
    CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    LabArgs a{};
    a.k_blocks = c.k / 32;
    a.row_bytes = uint64_t(a.k_blocks) * 18;
    a.blocks_per_split = (a.k_blocks + c.splits - 1) / c.splits;
    a.span = span;
    a.sink = sink;
    int sb = std::strstr(c.name, "SB16") ? 16 : 8;
    a.blocks_per_split = (a.blocks_per_split + sb - 1) / sb * sb;
    const double bytes = double(n) * a.k_blocks * 18;
    std::vector<double> spans, events;
    for (int i = 0; i < 60; ++i) {
      a.weight = ops.weight(i);
      const unsigned long long init[2] = {~0ull, 0ull};
      CHECK(cudaMemcpyAsync(span, init, 16, cudaMemcpyHostToDevice, stream));
      CHECK(cudaEventRecord(e0, stream));
      c.kernel<<<dim3(n / 64, 1, c.splits), 128, c.smem, stream>>>(a);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1, stream));
      unsigned long long got[2];
      CHECK(cudaMemcpyAsync(got, span, 16, cudaMemcpyDeviceToHost, stream));
      CHECK(cudaStreamSynchronize(stream));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 10) {
        spans.push_back((got[1] - got[0]) / 1000.0);
        events.push_back(ms * 1000.0);
      }
    }
    std::sort(spans.begin(), spans.end());
    std::sort(events.begin(), events.end());
    const double med = spans[spans.size() / 2];
    std::printf(
        "%-12s k=%5d splits=%2d smem=%6d  span median %6.2f us (min %6.2f) = %5.2f TB/s"
        "  events median %6.2f us\n",
        c.name, c.k, c.splits, c.smem, med, spans[0], bytes / med / 1e6, events[events.size() / 2]);
  }
  // The library mat-vec (Q4Args, cluster launch when split) at its own point and at other ring
  // depths / activation chunks / CTAs per SM (MatVecStreamTile), CUDA-event times: compare with the
  // empty kernel's event time above.
  const auto matvec = [&](auto tile, const char* name) {
    using T = decltype(tile);
    constexpr auto kernel = q4_matvec_kernel<T, true>;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem));
    for (int kk : {14336, 2048}) {
      for (int m : {1, 8}) {
        const int splits = 8;
        Q4Args q{};
        q.input = ops.input;
        q.output = ops.output;
        q.n = n;
        q.m = m;
        q.k_blocks = kk / 32;
        const int per = (q.k_blocks + splits - 1) / splits;
        q.blocks_per_split = (per + 7) / 8 * 8;
        q.row_bytes = uint64_t(q.k_blocks) * 18;
        q.w_grain = 16;
        q.x_grain = 16;
        q.rows_on_x = 1;
        cudaLaunchAttribute attribute;
        const cudaLaunchConfig_t config =
            k_split_config(dim3(n / 64, (m + 7) / 8, splits), 128, T::kSmem, stream, attribute);
        int clusters = 0;
        CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
        float fastest = 0;
        const float median = median_event_us(
            [&](int i) {
              q.weight = ops.weight(i);
              CHECK(cudaLaunchKernelEx(&config, kernel, q));
            },
            50, 10, stream, &fastest);
        std::printf(
            "matvec %-22s smem=%6d max_clusters=%3d k=%5d m=%d splits=%d  events median "
            "%6.2f us (min %6.2f)\n",
            name, T::kSmem, clusters, kk, m, splits, median, fastest);
      }
    }
  };
  matvec(MatVecStream{}, "library (3 st, 16K, 5)");
  matvec(MatVecStreamTile<4, 8, 5>{}, "4 st, 8K x, 5/SM");
  matvec(MatVecStreamTile<5, 8, 4>{}, "5 st, 8K x, 4/SM");
  matvec(MatVecStreamTile<4, 16, 4>{}, "4 st, 16K x, 4/SM");
  if (std::getenv("LAB_ALL_TILES") == nullptr) return 0;
  matvec(MatVecStreamTile<2, 8, 8>{}, "2 st, 8K x, 8/SM");
  matvec(MatVecStreamTile<3, 8, 6>{}, "3 st, 8K x, 6/SM");
  matvec(MatVecStreamTile<3, 16, 4>{}, "3 st, 16K x, 4/SM");
  matvec(MatVecStreamTile<5, 16, 3>{}, "5 st, 16K x, 3/SM");
  matvec(MatVecStreamTile<8, 16, 2>{}, "8 st, 16K x, 2/SM");
  return 0;
}
