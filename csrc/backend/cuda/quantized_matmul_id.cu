// CUDA kernels of the quantised expert-ID matmul (csrc/ops/quantized_matmul_id.cpp owns
// validation and geometry): quantized_matmul_id_direct_F_f32 and quantized_matmul_id_grouped_F_f32
// for F = q4_0, q8_0 and every format of ggml_formats.h's kKernelFormats (q4_1, q5_0, q5_1, mxfp4,
// q4_k, q5_k, q6_k; the map is dense_matmul_id's), the tensor-core route's
// quantized_matmul_id_grouped_lowp_{q4_0,q8_0}_f32 (same map; see GgmlTiles below), and the kernel
// formats' dense projections kernel_mul_mv_F_f32 / kernel_mul_mm_F_f32 (csrc/ops/q4_matmul.cpp's
// front door; the same staged lane contract, see "Dense projections" below). Every kernel but the
// tensor route is one template over ggml_blocks.cuh's format traits.
//
// NUMERICS: direct and grouped are the exact route of the CPU oracle (ggml_blocks.cuh's lane
// contract on the exact weights of ggml's to_float), so both kernels are bit-identical to each
// other and to the CPU backend, in every format. The tensor route (grouped_tensor_lowp, Q4_0 and
// Q8_0) is not: activations rounded to f16 (nearest even), weights exact, F32 accumulation; tested
// within 1e-2 relative Frobenius error of a float64 reference on the dequantised weights
// (docs/numerics.md).
// GEOMETRY: 128 threads = 16 output columns x 8 lanes.
//   direct   grid [ceil(n / 16), m * top_k, 1]: one flat row per block; the block streams the
//            16 weight rows of that row's expert (an invalid id writes zeros, reads no weight).
//   grouped  grid [ceil(m / 8), ceil(n / 16), n_experts]: up to 8 routed rows of one expert per
//            block and step, each weight value read once for the 8 rows (an expert holding more
//            than m rows, when ids repeat within a token, loops over its segment).
// DATA PATH: the block's 16 weight rows stream through shared memory 1024 values (32 blocks, 4
//   K-quant super-blocks) at a time, copied by all 128 threads with coalesced 16-byte loads: a
//   row's segment lands at its address modulo 16 in its stage row, so only the partial 16-byte
//   units at its two ends go byte by byte (Q4_0 / Q8_0 blocks are only 2-byte aligned, the other
//   formats' 1-byte: MXFP4 blocks are 17 bytes); the lanes then run the lane contract from shared
//   memory. Each lane's FMAs keep their order (blocks ascending), so staging changes no bit.
//   Before staging every lane fetched its own 2 bytes per block value pair from global memory: the
//   loads, not the bytes, bounded the kernel (Qwen3-30B-A3B Q4_0 m = 1: 18.6 us for 7 MB).
//   On sm_90a, where the weight view starts 16-byte aligned and its allocation extends to the
//   16-byte unit holding its last byte, direct_bulk_kernel moves the stages with bulk copies
//   instead, input values included, two stages in flight from the block's start
//   (ROUTEMM_CUDA_DIRECT_PATH=loads keeps the copy loop). A bulk copy moves whole 16-byte units
//   from a 16-byte aligned address: where every row's stage is whole units (Q4_0 / Q8_0 / Q4_K
//   with K a multiple of 256, ...) it copies its blocks alone; elsewhere each row's stage copies
//   the units that hold its blocks (up to 15 bytes of its neighbours on either side, never
//   outside the allocation) and the lanes start at the blocks' offset in them, so rows of any
//   length (Q6_K's 210-byte blocks, MXFP4's 17 at K = 768 or 2880) take the same path. Measured
//   on an H100 in one run, Qwen3-30B-A3B m = 1 / 8: Q4_0 18.5 / 68.5 -> 7.7 / 36.8 us, Q8_0
//   16.9 / 79.6 -> 9.7 / 44.7 us (bench/lab/records/logs/h100-checks-2026-12-05c.md); the units
//   for Q6_K up 26.4 / 99.5 -> 12.9 / 56.1 us, Q6_K down 19.2 / 108.2 -> 14.4 / 62.0, MXFP4 down
//   19.3 / 115.8 -> 14.4 / 73.2 (bench/results/qid_direct_units-h100.md).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "ggml_blocks.cuh"
#include "grouped_tensor_kernel.cuh"
#include "hopper_support.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/quantized_matmul_id.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"
#include "wgmma.cuh"

#ifndef ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256
#define ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kThreads = 128;
constexpr uint32_t kColumns = kThreads / 8;  // output columns per block
constexpr uint32_t kGroupRows = 8;           // routed rows per grouped block
constexpr uint32_t kStageValues = 1024;      // values of each weight row per shared-memory stage

// Blocks of each weight row per stage (32 of a 32-value format, 4 K-quant super-blocks).
template <class F>
__host__ __device__ constexpr uint32_t stage_blocks() {
  return kStageValues / F::kValues;
}

// Shared-memory pitch of one staged weight row: the stage's bytes rounded up to 16, plus 16 for
// a row that starts part-way into a 16-byte unit (stage_rows).
template <class F>
__host__ __device__ constexpr uint32_t stage_pitch() {
  return (stage_blocks<F>() * F::kBytes + 15) / 16 * 16 + 16;
}

// The offset in its stage row of a staged segment starting at `src`: its address modulo 16.
__device__ __forceinline__ uint32_t stage_head(const uint8_t* src) {
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(src) & 15u);
}

// Copies blocks [b0, b0 + nb) of the tile's first `rows` weight rows (row r at first_row + r *
// row_bytes) into `stage`, with every thread of the block: the segment of row r, starting at
// address a, lands at r * stage_pitch + a % 16, so its 16-byte units keep their alignment. Units
// that lie inside the segment copy whole (coalesced 16-byte loads); the partial ones at either end
// byte by byte (Q4_0 / Q8_0 rows are only 2-byte aligned, the other formats' 1-byte). `aligned`:
// first_row and row_bytes are multiples of 16 (every head is 0; one unit loop). `tid`: the
// thread's index in the block.
template <class F>
__device__ __forceinline__ void stage_rows(uint8_t* __restrict__ stage,
                                           const uint8_t* __restrict__ first_row,
                                           uint64_t row_bytes, uint32_t rows, uint32_t b0,
                                           uint32_t nb, bool aligned, uint32_t tid) {
  const uint32_t seg = nb * F::kBytes;
  const uint8_t* src = first_row + uint64_t{b0} * F::kBytes;
  if (aligned && seg % 16 == 0 && stage_head(src) == 0) {
    const uint32_t units = seg / 16;
    for (uint32_t i = tid; i < rows * units; i += kThreads) {
      const uint32_t r = i / units, u = i - r * units;
      const auto* from = reinterpret_cast<const uint4*>(src + r * row_bytes + u * 16);
      *reinterpret_cast<uint4*>(stage + r * stage_pitch<F>() + u * 16) = __ldg(from);
    }
  } else {
    const uint32_t units = seg / 16 + 2;  // enough for any head
    for (uint32_t i = tid; i < rows * units; i += kThreads) {
      const uint32_t r = i / units, u = i - r * units;
      const uint8_t* const a = src + r * row_bytes;
      const uint8_t* const end = a + seg;
      const uint8_t* const unit = a - stage_head(a) + u * 16;
      uint8_t* const dst = stage + r * stage_pitch<F>() + u * 16;
      if (unit >= a && unit + 16 <= end) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(unit));
      } else {
        // Sixteen independent predicated loads (unrolled), so a partial unit costs one load
        // latency, not one per byte.
#pragma unroll
        for (uint32_t t = 0; t < 16; ++t) {
          if (unit + t >= a && unit + t < end) dst[t] = __ldg(unit + t);
        }
      }
    }
  }
}

// The lane contract (ggml::lane_dot) over a whole weight row, the row read through the shared
// stage: lane `lane` of tile column `column` accumulates R input rows. Every thread of the block
// calls it (it synchronises); columns at or past `rows` (past n) stage and compute nothing.
template <class F, int R>
__device__ __forceinline__ void staged_lane_dot(uint8_t* __restrict__ stage,
                                                const uint8_t* __restrict__ first_row,
                                                uint64_t row_bytes, uint32_t rows, uint32_t k,
                                                bool aligned, uint32_t column,
                                                const float* const (&x)[R], uint32_t lane,
                                                float (&acc)[R], uint32_t tid = threadIdx.x) {
  const uint32_t blocks = k / F::kValues;
  for (uint32_t b0 = 0; b0 < blocks; b0 += stage_blocks<F>()) {
    const uint32_t nb = min(stage_blocks<F>(), blocks - b0);
    __syncthreads();  // the previous stage is consumed
    stage_rows<F>(stage, first_row, row_bytes, rows, b0, nb, aligned, tid);
    __syncthreads();
    if (column < rows) {
      const float* xs[R];
#pragma unroll
      for (int r = 0; r < R; ++r) xs[r] = x[r] + b0 * F::kValues;
      const uint8_t* src = first_row + column * row_bytes + uint64_t{b0} * F::kBytes;
      ggml::lane_dot<F, R>(stage + column * stage_pitch<F>() + stage_head(src), nb * F::kValues, xs,
                           lane, acc);
    }
  }
}

__device__ __forceinline__ const float* input_row(const DenseMatmulIdKernelParams& p,
                                                  const unsigned char* input, uint32_t flat) {
  const uint32_t token = flat / p.top_k, slot = flat - token * p.top_k;
  return reinterpret_cast<const float*>(input + uint64_t{token} * p.input_token_stride_bytes +
                                        uint64_t{slot} * p.input_slot_stride_bytes);
}

// What a direct block computes, as both direct kernels read their grid: flat row blockIdx.y times
// the 16-column tile blockIdx.x, this thread lane `lane` of tile column `column`.
template <class F>
struct DirectTile {
  uint32_t flat, lane, column, col, rows;
  uint64_t row_bytes;
  float* out;                // the flat row's output row
  const uint8_t* first_row;  // the tile's first weight row; not formed for an invalid id
  bool valid;

  __device__ DirectTile(const DenseMatmulIdKernelParams& p, const uint8_t* weights,
                        const uint32_t* ids, float* output)
      : flat(blockIdx.y), lane(threadIdx.x & 7u), column(threadIdx.x / 8) {
    const uint32_t col0 = blockIdx.x * kColumns;
    const uint32_t id = ids[flat];
    col = col0 + column;
    rows = min(kColumns, p.n - col0);
    row_bytes = uint64_t{p.k} / F::kValues * F::kBytes;
    out = output + uint64_t{flat} * p.n;
    valid = id < p.n_experts;
    first_row = valid ? weights + uint64_t{id} * p.expert_stride_bytes + col0 * row_bytes : nullptr;
    // An invalid id: a zero row. Uniform over the block, so the kernel may return at once.
    if (!valid && lane == 0 && col < p.n) out[col] = 0.0f;
  }

  // The lanes' sum by the lane contract's tree, stored by lane 0. Every thread calls it (it
  // shuffles); columns past n took no part in the dot (acc 0) and store nothing.
  __device__ void store(const DenseMatmulIdKernelParams& p, float acc) const {
    const float sum = ggml::sum8(acc);
    if (lane == 0 && col < p.n) out[col] = sum;
  }
};

template <class F>
__global__ void __launch_bounds__(kThreads)
    direct_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                  const unsigned char* __restrict__ input, const uint32_t* __restrict__ ids,
                  float* __restrict__ output, bool aligned) {
  __shared__ __align__(16) uint8_t stage[kColumns * stage_pitch<F>()];
  const DirectTile<F> t(p, weights, ids, output);
  if (!t.valid) return;  // uniform over the block: no barrier or shuffle follows
  const float* x[1] = {input_row(p, input, t.flat)};
  float acc[1] = {0.0f};
  staged_lane_dot<F, 1>(stage, t.first_row, t.row_bytes, t.rows, p.k, aligned, t.column, x, t.lane,
                        acc);
  t.store(p, acc[0]);
}

// The direct kernel with its operands moved by the copy engine (sm_90a): the tile's weight rows and
// the input row travel in stages of kBulkStageBlocks blocks, one 1-D bulk copy per row and one for
// the activations, into a ring that fills as soon as the block starts, so no lane waits on a global
// load inside the lane contract. Each lane runs ggml::lane_dot over the stages in block order, the
// same FMAs in the same order as direct_kernel: the same bits.
template <class F>
struct BulkDirectLayout {
  static constexpr uint32_t kStageBlocks = stage_blocks<F>();  // blocks of each row per stage
  // A stage row holds the 16-byte units around its segment: at most the segment's bytes rounded
  // up to 16, plus 16. The pitch is an odd number of 16-byte units, so the rows of one warp start
  // on different banks (an even one put every other row on the same banks: MXFP4's 576-byte
  // pitch cost 16 % at m = 1).
  static constexpr uint32_t kSpanUnits = (kStageBlocks * F::kBytes + 15) / 16 + 1;
  static constexpr uint32_t kRowPitch = 16 * (kSpanUnits % 2 == 1 ? kSpanUnits : kSpanUnits + 1);
  static constexpr uint32_t kXOffset = kColumns * kRowPitch;  // the activations' stage row
  static constexpr uint32_t kStageBytes = kXOffset + kStageValues * 4;
  static constexpr uint32_t kRing = 2;
  static constexpr uint32_t kBarrierBytes = 128;
  // Q4_0: 26.6 KiB (8 blocks per multiprocessor); Q8_0: 42.6 KiB (5), the largest format. All
  // under the 48 KiB that needs no opt-in.
  static constexpr uint32_t kSmem = kBarrierBytes + kRing * kStageBytes;
  static_assert(kRowPitch % 32 == 16 && kStageBytes % 16 == 0 && kSmem <= 48 * 1024);
};

// The 16-byte units holding the segment [a, a + bytes): their first address and their length.
struct UnitSpan {
  const uint8_t* first;
  uint32_t bytes;
};
[[maybe_unused]] __device__ __forceinline__ UnitSpan unit_span(const uint8_t* a, uint32_t bytes) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(a) & ~uintptr_t{15};
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(a) + bytes + 15) & ~uintptr_t{15};
  return {reinterpret_cast<const uint8_t*>(lo), static_cast<uint32_t>(hi - lo)};
}

// Two instances per format. kSpans false, where every row's stage is whole 16-byte units (rows
// 16-byte aligned, stages a multiple of 16 bytes: bulk_stages_fit): each stage copies exactly its
// blocks, and the lanes read them at a compile-time aligned offset. kSpans true, any rows: each
// stage copies the units around its blocks and the lanes start at the blocks' offset in them.
// (Every format through the span instance measured 16-18 % slower at m = 1 on the aligned shapes,
// Q4_0 / Q4_K / MXFP4 Qwen3-30B-A3B up, H100: the lanes' byte reads at an unknown offset and
// thread 0's sum of the rows' spans before the first copy.)
// Preconditions (launch_direct checks them): the input rows 16-byte aligned, the sm_90a image
// running; kSpans false: bulk_stages_fit; kSpans true: bulk_spans_fit (the weight view 16-byte
// aligned, its allocation reaching the end of the 16-byte unit that holds its last byte).
template <class F, bool kSpans>
__global__ void __launch_bounds__(kThreads)
    direct_bulk_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                       const unsigned char* __restrict__ input, const uint32_t* __restrict__ ids,
                       float* __restrict__ output) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = BulkDirectLayout<F>;
  extern __shared__ __align__(128) uint8_t smem[];
  const DirectTile<F> t(p, weights, ids, output);
  if (!t.valid) return;  // uniform over the block: no barrier or shuffle follows
  const auto* xrow = reinterpret_cast<const uint8_t*>(input_row(p, input, t.flat));
  const uint32_t bar0 = smem_addr(smem);
  uint8_t* const ring = smem + L::kBarrierBytes;
  if (threadIdx.x == 0) {
    for (uint32_t s = 0; s < L::kRing; ++s) sm90::mbar_init(bar0 + 8 * s, 1);
    sm90::fence_mbar_init();
  }
  __syncthreads();

  const uint32_t blocks = p.k / F::kValues;
  const uint32_t stages = (blocks + L::kStageBlocks - 1) / L::kStageBlocks;
  // Row r's segment of the stage starting at block b0.
  const auto segment = [&](uint32_t r, uint32_t b0) {
    return t.first_row + r * t.row_bytes + uint64_t{b0} * F::kBytes;
  };
  // Warp 0 fills stage s: thread 0 arms the barrier with the stage's bytes (each row's units and
  // the input's values), threads 0..rows-1 copy the units around their row's blocks, thread
  // kColumns the input's values.
  const auto issue = [&](uint32_t s) {
    const uint32_t slot = s % L::kRing, b0 = s * L::kStageBlocks;
    const uint32_t nb = min(L::kStageBlocks, blocks - b0);
    uint8_t* const stage = ring + slot * L::kStageBytes;
    const uint32_t bar = bar0 + 8 * slot;
    if (threadIdx.x == 0) {
      uint32_t bytes = nb * F::kValues * 4;
      if constexpr (kSpans) {
        for (uint32_t r = 0; r < t.rows; ++r) {
          bytes += unit_span(segment(r, b0), nb * F::kBytes).bytes;
        }
      } else {
        bytes += t.rows * nb * F::kBytes;
      }
      sm90::mbar_arrive_expect_tx(bar, bytes);
    }
    __syncwarp();
    if (threadIdx.x < t.rows) {
      const UnitSpan span = kSpans ? unit_span(segment(threadIdx.x, b0), nb * F::kBytes)
                                   : UnitSpan{segment(threadIdx.x, b0), nb * F::kBytes};
      sm90::bulk_load(smem_addr(stage + threadIdx.x * L::kRowPitch), span.first, span.bytes, bar);
    } else if (threadIdx.x == kColumns) {
      sm90::bulk_load(smem_addr(stage + L::kXOffset), xrow + uint64_t{b0} * F::kValues * 4,
                      nb * F::kValues * 4, bar);
    }
  };
  if (threadIdx.x < 32) {
    for (uint32_t s = 0; s < min(L::kRing, stages); ++s) issue(s);
  }
  float acc[1] = {0.0f};
  for (uint32_t s = 0; s < stages; ++s) {
    const uint32_t slot = s % L::kRing;
    sm90::mbar_wait(bar0 + 8 * slot, (s / L::kRing) & 1);
    const uint8_t* const stage = ring + slot * L::kStageBytes;
    if (t.column < t.rows) {
      const float* const xs[1] = {reinterpret_cast<const float*>(stage + L::kXOffset)};
      const uint32_t b0 = s * L::kStageBlocks, nb = min(L::kStageBlocks, blocks - b0);
      // The blocks' offset in their units: seg % 16 (0 without spans).
      const uint32_t head = kSpans ? reinterpret_cast<uintptr_t>(segment(t.column, b0)) & 15u : 0u;
      ggml::lane_dot<F, 1>(stage + t.column * L::kRowPitch + head, nb * F::kValues, xs, t.lane,
                           acc);
    }
    __syncthreads();  // every read of this slot is done before the copy engine refills it
    if (threadIdx.x < 32 && s + L::kRing < stages) issue(s + L::kRing);
  }
  t.store(p, acc[0]);
#else
  __trap();  // launched only where the sm_90a image exists (hopper_kernels_available)
#endif
}

template <class F>
__global__ void __launch_bounds__(kThreads)
    grouped_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                   const unsigned char* __restrict__ input, const uint32_t* __restrict__ counts,
                   const uint32_t* __restrict__ routed, float* __restrict__ output, bool aligned) {
  __shared__ __align__(16) uint8_t stage[kColumns * stage_pitch<F>()];
  const uint32_t expert = blockIdx.z;
  // The map's list: expert e's flat rows are the segment routed[start, start + counts[e]), start
  // the counts of the experts before it (a segment can hold more than m rows when ids repeat
  // within a token). A stale or foreign scratch is clamped to the m * top_k flat rows.
  const uint32_t total = p.m * p.top_k;
  uint64_t start = 0;
  for (uint32_t e = 0; e < expert; ++e) start += counts[e];
  if (start >= total) return;  // uniform over the block
  const auto count = static_cast<uint32_t>(min(uint64_t{counts[expert]}, total - start));
  const uint32_t lane = threadIdx.x & 7u;
  const uint32_t column = threadIdx.x / 8;
  const uint32_t col0 = blockIdx.y * kColumns;
  const uint32_t col = col0 + column;
  const uint64_t row_bytes = uint64_t{p.k} / F::kValues * F::kBytes;
  const uint32_t tile_rows = min(kColumns, p.n - col0);
  const uint8_t* first_row = weights + uint64_t{expert} * p.expert_stride_bytes + col0 * row_bytes;
  // grid.x covers m rows per expert; an expert holding more (repeated ids) loops over the rest.
  for (uint32_t first = blockIdx.x * kGroupRows; first < count; first += gridDim.x * kGroupRows) {
    const uint32_t rows = min(kGroupRows, count - first);
    const uint32_t* list = routed + start + first;
    uint32_t flats[kGroupRows];
    const float* x[kGroupRows];
    for (uint32_t r = 0; r < kGroupRows; ++r) {
      // Rows past the tile repeat its first row (same values, never stored); a routed index out
      // of range (a stale or foreign scratch) is treated the same way instead of read.
      const uint32_t flat = r < rows ? list[r] : list[0];
      flats[r] = flat < total ? flat : total;
      x[r] = input_row(p, input, flat < total ? flat : 0);
    }
    float acc[kGroupRows] = {};
    staged_lane_dot<F, kGroupRows>(stage, first_row, row_bytes, tile_rows, p.k, aligned, column, x,
                                   lane, acc);
    for (uint32_t r = 0; r < kGroupRows; ++r) {
      const float sum = ggml::sum8(acc[r]);
      if (lane == 0 && col < p.n && r < rows && flats[r] < total) {
        output[uint64_t{flats[r]} * p.n + col] = sum;
      }
    }
  }
}

DenseMatmulIdKernelParams read_params(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0 || p.k % 32 != 0) {
    throw Error(launch.label + ": params have a zero extent or K that is not a multiple of 32");
  }
  return p;
}

// Bytes the kernels may read from the weight and input views (the front door validated them; this
// keeps a corrupt raw launch from reading past its buffers). Each factor is at most 2^32 after the
// front door's checks; products are formed in 64 bits.
template <class F>
uint64_t weight_extent(const DenseMatmulIdKernelParams& p) {
  return uint64_t{p.n_experts - 1} * p.expert_stride_bytes +
         uint64_t{p.n} * (p.k / F::kValues) * F::kBytes;
}
uint64_t input_extent(const DenseMatmulIdKernelParams& p) {
  return uint64_t{p.m - 1} * p.input_token_stride_bytes +
         uint64_t{p.top_k - 1} * p.input_slot_stride_bytes + uint64_t{p.k} * 4;
}

// True when every weight row starts 16-byte aligned (the base, the expert stride and the row size
// are multiples of 16), so the stages may copy in 16-byte units.
template <class F>
bool rows_aligned16(const DenseMatmulIdKernelParams& p, const uint8_t* weights) {
  const uint64_t row_bytes = uint64_t{p.k} / F::kValues * F::kBytes;
  return reinterpret_cast<uintptr_t>(weights) % 16 == 0 && p.expert_stride_bytes % 16 == 0 &&
         row_bytes % 16 == 0;
}

// True when every stage of the bulk direct kernel moves a multiple of 16 bytes per weight row (the
// full stages and the last): its kSpans-false instance copies the blocks alone.
template <class F>
bool bulk_stages_fit(const DenseMatmulIdKernelParams& p) {
  constexpr uint32_t kStage = BulkDirectLayout<F>::kStageBlocks;
  const uint32_t blocks = p.k / F::kValues;
  return (uint64_t{kStage} * F::kBytes) % 16 == 0 &&
         (uint64_t{blocks % kStage} * F::kBytes) % 16 == 0;
}

// True when the bulk direct kernel's 16-byte units stay inside the weight view's allocation: the
// view starts 16-byte aligned (no unit starts before it) and the allocation holds the whole unit
// of the view's last byte (`available`: the bytes from the view's start to its allocation's end).
bool bulk_spans_fit(const uint8_t* weights, uint64_t extent, uint64_t available) {
  return reinterpret_cast<uintptr_t>(weights) % 16 == 0 && (extent + 15) / 16 * 16 <= available;
}

// The launch's params, K checked against the format's block (256 values for the K-quants).
template <class F>
DenseMatmulIdKernelParams read_format_params(const KernelLaunch& launch) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  if (p.k % F::kValues != 0) {
    throw Error(launch.label + ": K is not a multiple of the " + std::to_string(F::kValues) +
                "-value " + F::kName + " block");
  }
  return p;
}

void check(const KernelLaunch& launch, cudaError_t status) {
  if (status != cudaSuccess) {
    throw Error(launch.label + ": launch failed: " + std::string(cudaGetErrorString(status)));
  }
}

template <class F>
void launch_direct(const KernelLaunch& launch, void* stream) {
  const DenseMatmulIdKernelParams p = read_format_params<F>(launch);
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  if (launch.grid.x != (p.n + kColumns - 1) / kColumns || launch.grid.y != rows ||
      launch.grid.z != 1 || rows > 0x7fffffffu) {
    throw Error(launch.label + ": launch grid does not match the direct geometry");
  }
  const BoundArg& weights = kernels::launch_arg(launch, 1, "weights", weight_extent<F>(p));
  const auto* w = static_cast<const uint8_t*>(weights.data);
  const auto* x = static_cast<const unsigned char*>(
      kernels::launch_arg(launch, 2, "input", input_extent(p)).data);
  const auto* ids =
      static_cast<const uint32_t*>(kernels::launch_arg(launch, 3, "expert ids", rows * 4).data);
  auto* out = static_cast<float*>(kernels::launch_arg(launch, 4, "output", rows * p.n * 4).data);
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(rows), 1);
  const bool aligned = rows_aligned16<F>(p, w);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && p.input_token_stride_bytes % 16 == 0 &&
      p.input_slot_stride_bytes % 16 == 0 && expert_direct_bulk_path()) {
    const auto bulk = [&](auto kernel) {
      kernel<<<grid, kThreads, BulkDirectLayout<F>::kSmem, static_cast<cudaStream_t>(stream)>>>(
          p, w, x, ids, out);
      check(launch, cudaGetLastError());
    };
    // Formats whose full stage is not a multiple of 16 bytes (Q6_K) have the span instance only.
    if constexpr (BulkDirectLayout<F>::kStageBlocks * F::kBytes % 16 == 0) {
      if (aligned && bulk_stages_fit<F>(p)) return bulk(direct_bulk_kernel<F, false>);
    }
    if (bulk_spans_fit(w, weight_extent<F>(p), weights.size)) {
      return bulk(direct_bulk_kernel<F, true>);
    }
  }
  direct_kernel<F>
      <<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, w, x, ids, out, aligned);
  check(launch, cudaGetLastError());
}

template <class F>
void launch_grouped(const KernelLaunch& launch, void* stream) {
  const DenseMatmulIdKernelParams p = read_format_params<F>(launch);
  if (launch.grid.x != (p.m + kGroupRows - 1) / kGroupRows ||
      launch.grid.y != (p.n + kColumns - 1) / kColumns || launch.grid.z != p.n_experts ||
      p.n_experts > 65535) {
    throw Error(launch.label + ": launch grid does not match the grouped geometry");
  }
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  const auto* w = static_cast<const uint8_t*>(
      kernels::launch_arg(launch, 1, "weights", weight_extent<F>(p)).data);
  const auto* x = static_cast<const unsigned char*>(
      kernels::launch_arg(launch, 2, "input", input_extent(p)).data);
  const auto* counts = static_cast<const uint32_t*>(
      kernels::launch_arg(launch, 3, "expert counts", uint64_t{p.n_experts} * 4).data);
  const auto* routed = static_cast<const uint32_t*>(
      kernels::launch_arg(launch, 4, "routed rows", uint64_t{p.n_experts} * p.m * 4).data);
  auto* out = static_cast<float*>(kernels::launch_arg(launch, 5, "output", rows * p.n * 4).data);
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(launch.grid.y),
                  p.n_experts);
  grouped_kernel<F><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, w, x, counts, routed, out, rows_aligned16<F>(p, w));
  check(launch, cudaGetLastError());
}

// ---- The tensor-core route (grouped_tensor_lowp) ------------------------------------------------
//
// grouped_tensor_kernel.cuh's persistent warp-MMA kernel (the dense expert-ID tensor routes' kernel,
// same work list, activation staging, K ring and scatter) with GgmlTiles as its weight tiles: one
// K stage is one 32-value block of each of the tile's 128 weight rows. Tiles are 64 routed rows x
// 128 columns (the slice accumulator doubles the accumulators; 128-row tiles would not fit two CTAs
// per multiprocessor without spilling).
//
// NUMERICS: a block's values enter the MMA as their exact integers in f16 (q - 8 for Q4_0, in
// [-8, 7]; q for Q8_0, in [-128, 127]) and each block's partial sums, 32 products of an f16
// activation and an integer summed in F32 by the tensor cores, join the output as
// acc = fma(d, slice, acc) with the block's scale d widened to F32. So the weights are exact (no
// d * q rounded to f16, which loses up to 2^-11 relative and overflows f16 for large d * q); the
// activations' rounding to f16 is the only operand error, and |x| > 65504 becomes infinite as on
// the dense f16 route. Sums run over K one block at a time in increasing order.

using grouped_tensor::Mode;

// Q4_0 / Q8_0 weight tiles (grouped_tensor_kernel.cuh's policy contract). Two threads per weight
// row (r = tid / 2, half h = tid % 2); a block is read 2 bytes at a time (GGUF blocks are only
// 2-byte aligned), one stage ahead, and decoded when stored:
//   Q4_0  half h reads quant bytes 8h..8h+7: their low nibbles are K values 8h.., their high
//         nibbles K values 16 + 8h.. (chunks h and 2 + h of the row).
//   Q8_0  half h reads quant bytes 16h..16h+15, K values 16h.. (chunks 2h and 2h + 1).
// Half 0 also stores the block's scale, as F32, in the stage's scale row. Rows past n store zeros.
// Asks L2 for the bytes of the K stage at k0 (32 values) of a weight row in format F: half 0 for
// the stage's first byte, half 1 for its last, so the two cover the stage's sectors (a stage is
// at most 34 bytes: Q8_0). Blocks of 256 values hold their stages' bytes interleaved with the
// header, so this is the stage's share of the block, which is what its reads touch but for the
// header of the block's first stage (read in that line or the one before).
template <class F>
__device__ __forceinline__ void prefetch_stage_l2(const uint8_t* row, uint32_t k0, uint32_t h) {
  const uint64_t first = uint64_t{k0} * F::kBytes / F::kValues;
  const uint64_t last = (uint64_t{k0} + 32) * F::kBytes / F::kValues - 1;
  grouped_tensor::prefetch_l2(row + (h == 0 ? first : last));
}

template <class F, uint32_t BN>
struct GgmlTiles {
  static_assert(BN == grouped_tensor::kThreads / 2, "two threads per weight row");
  static constexpr bool kAsync = false;
  static constexpr uint32_t kStageExtraBytes = BN * 4;  // the F32 scale row
  static constexpr bool kSliceScales = true;
  static constexpr bool kQ4 = F::kBytes == kernels::kQ4_0BlockBytes;
  static constexpr uint32_t kQuantWords = kQ4 ? 2 : 4;  // 32-bit words of quant bytes per half
  // Integers as f16 by their bits: 0x6400 | u is the f16 1024 + u for u < 1024, so subtracting
  // 1024 + the format's offset (8 for a Q4_0 nibble, 128 for a Q8_0 byte with its sign bit
  // flipped) leaves q exactly (every value involved is an integer below 2048).
  static constexpr uint32_t kBias = kQ4 ? 0x64086408u : 0x64806480u;  // f16 1032 or 1152, twice

  const uint8_t* row;  // this thread's weight row; nullptr past n
  uint32_t r, h, k;
  uint32_t quant[kQuantWords];
  uint32_t scale_bits;

  __device__ GgmlTiles(const char* expert_weights, uint32_t col0,
                       const kernels::DenseMatmulIdKernelParams& p, uint32_t tid)
      : r(tid >> 1), h(tid & 1), k(p.k) {
    const uint32_t col = col0 + r;
    row = col < p.n ? reinterpret_cast<const uint8_t*>(expert_weights) +
                          uint64_t{col} * (p.k / 32) * F::kBytes
                    : nullptr;
  }

  static __device__ __forceinline__ uint32_t fragment(uint32_t word) { return word; }

  // Two bytes at an even address (a block starts on an even byte, checked by the front door; so
  // does every 2-byte field in it): one 16-bit load, not two byte loads.
  static __device__ __forceinline__ uint32_t load_pair(const uint8_t* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
  }

  __device__ __forceinline__ void load(uint32_t k0) {
    scale_bits = 0;
#pragma unroll
    for (uint32_t w = 0; w < kQuantWords; ++w) quant[w] = 0;
    if (row == nullptr) return;
    const uint8_t* block = row + uint64_t{k0 / 32} * F::kBytes;
    scale_bits = load_pair(block);
    const uint8_t* qs = block + 2 + h * kQuantWords * 4;
#pragma unroll
    for (uint32_t w = 0; w < kQuantWords; ++w) {
      quant[w] = load_pair(qs + 4 * w) | (load_pair(qs + 4 * w + 2) << 16);
    }
  }

  __device__ __forceinline__ void prefetch(uint32_t k0) const {
    if (row != nullptr && k0 < k) prefetch_stage_l2<F>(row, k0, h);
  }

  // Two f16 integers from the low halves of two biased 16-bit lanes (see kBias).
  static __device__ __forceinline__ uint32_t unbias(uint32_t biased) {
    __half2 v, bias;
    const uint32_t b = kBias;
    memcpy(&v, &biased, 4);
    memcpy(&bias, &b, 4);
    v = __hsub2(v, bias);
    uint32_t out;
    memcpy(&out, &v, 4);
    return out;
  }

  __device__ __forceinline__ void store(uint32_t base) const {
    const uint32_t valid = row != nullptr ? 0xFFFFFFFFu : 0u;
    uint32_t lo[4], hi[4];  // Q4_0: low / high nibble chunks; Q8_0: the two chunks
#pragma unroll
    for (uint32_t w = 0; w < kQuantWords; ++w) {
      if constexpr (kQ4) {
        // Bytes (b0, b1) and (b2, b3) of the word into 16-bit lanes, then each nibble.
        const uint32_t pairs[2] = {__byte_perm(quant[w], 0, 0x4140),
                                   __byte_perm(quant[w], 0, 0x4342)};
#pragma unroll
        for (uint32_t j = 0; j < 2; ++j) {
          lo[2 * w + j] = unbias((pairs[j] & 0x000F000Fu) | 0x64006400u) & valid;
          hi[2 * w + j] = unbias(((pairs[j] >> 4) & 0x000F000Fu) | 0x64006400u) & valid;
        }
      } else {
        const uint32_t flipped = quant[w] ^ 0x80808080u;
        uint32_t (&dst)[4] = w < 2 ? lo : hi;
        dst[(w & 1) * 2] = unbias(__byte_perm(flipped, 0x64646464u, 0x4140)) & valid;
        dst[(w & 1) * 2 + 1] = unbias(__byte_perm(flipped, 0x64646464u, 0x4342)) & valid;
      }
    }
    using grouped_tensor::swz;
    const uint32_t lo_chunk = kQ4 ? h : 2 * h, hi_chunk = kQ4 ? 2 + h : 2 * h + 1;
    sts128(base + swz(r, lo_chunk), lo[0], lo[1], lo[2], lo[3]);
    sts128(base + swz(r, hi_chunk), hi[0], hi[1], hi[2], hi[3]);
    if (h == 0) {
      const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(scale_bits)));
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + BN * grouped_tensor::kRowBytes + r * 4),
                   "f"(d)
                   : "memory");
    }
  }
};

// The weight tiles of the other formats (ggml_formats.h's kKernelFormats): a stage (32 K values) is
// one 32-value sub-block of each of the tile's 128 weight rows, entering the MMA as its integer
// codes minus the format's bias (at most 63 in magnitude: exact in f16), with the format's F32
// scale per column (two for Q6_K, one per 16 values: kScaleSteps 2) and, for the formats with a min
// (Q4_1, Q5_1: + m; Q4_K, Q5_K: - m1), the min per column (kSliceMins). Two threads per weight row
// (r = tid / 2, half h = tid % 2): half h decodes values 16h .. 16h + 15 (chunks 2h, 2h + 1), one
// stage ahead, by F::codes16 (16-byte reads as wide as the block's address allows: these formats'
// blocks may start at any byte); half 0 stores the sub-block's scales and min. Rows past n store
// zeros. prefetch(k0) asks L2 for the stage at k0 (grouped_tensor_kernel.cuh's kPrefetchStages).
//
// NUMERICS: the stage adds d * sum(q * x) + m * sum(x) to the result (two F32 FMAs after the MMA's
// F32 sum), x the activations rounded to f16, sum(x) their F32 sum in a fixed tree. The weights'
// integers and scales are exact; d * q + m is not formed, so each output is the exact product of
// weights q * d + m (without the dequantiser's roundings of q * d and of its sum with m, each a
// relative 2^-24) with the f16 activations, up to F32 accumulation: |error| <= u16 * sum |w x| +
// gamma * (sum |d q x| + sum |m x|) with u16 = 2^-11 the activations' rounding; see
// docs/numerics.md.
template <class F>
constexpr bool kLowpHasMin =
    std::is_same_v<F, ggml::Q4_1Blocks> || std::is_same_v<F, ggml::Q5_1Blocks> ||
    std::is_same_v<F, ggml::Q4_KBlocks> || std::is_same_v<F, ggml::Q5_KBlocks>;

template <class F, uint32_t BN>
struct GgmlFormatTiles {
  static_assert(BN == grouped_tensor::kThreads / 2, "two threads per weight row");
  static constexpr bool kAsync = false;
  static constexpr bool kSliceScales = true;
  static constexpr uint32_t kScaleSteps = std::is_same_v<F, ggml::Q6_KBlocks> ? 2 : 1;
  static constexpr bool kSliceMins = kLowpHasMin<F>;
  static constexpr uint32_t kStageExtraBytes =
      kScaleSteps * BN * 4 + (kSliceMins ? BN * 4 + grouped_tensor::kMaxTileRows * 4 : 0);
  // Codes as f16 by their bits: 0x6400 | u is the f16 1024 + u (u < 1024), so subtracting
  // 1024 + kCodeBias leaves the integer exactly.
  static constexpr uint32_t kBias = 0x00010001u * (0x6400u + F::kCodeBias);

  const uint8_t* row;  // this thread's weight row; nullptr past n
  uint32_t r, h, k;
  uint32_t codes[4];  // the 16 codes of this half, one byte each
  ggml::LowpScale scales;

  __device__ GgmlFormatTiles(const char* expert_weights, uint32_t col0,
                             const kernels::DenseMatmulIdKernelParams& p, uint32_t tid)
      : r(tid >> 1), h(tid & 1), k(p.k) {
    const uint32_t col = col0 + r;
    row = col < p.n ? reinterpret_cast<const uint8_t*>(expert_weights) +
                          uint64_t{col} * (p.k / F::kValues) * F::kBytes
                    : nullptr;
  }

  static __device__ __forceinline__ uint32_t fragment(uint32_t word) { return word; }

  __device__ __forceinline__ void load(uint32_t k0) {
    scales = {0.0f, 0.0f, 0.0f};
#pragma unroll
    for (uint32_t w = 0; w < 4; ++w) codes[w] = 0;
    if (row == nullptr) return;
    const uint8_t* block = row + uint64_t{k0 / F::kValues} * F::kBytes;
    const uint32_t sub = (k0 % F::kValues) / 32;
    const uint4 c = F::codes16(block, sub, h);
    codes[0] = c.x;
    codes[1] = c.y;
    codes[2] = c.z;
    codes[3] = c.w;
    if (h == 0) scales = F::lowp(block, sub);
  }

  __device__ __forceinline__ void prefetch(uint32_t k0) const {
    if (row != nullptr && k0 < k) prefetch_stage_l2<F>(row, k0, h);
  }

  // Two codes (bytes `sel` of a word) as the f16 pair of their integers.
  static __device__ __forceinline__ uint32_t pair(uint32_t word, uint32_t sel) {
    const uint32_t biased = __byte_perm(word, 0, sel) | 0x64006400u;
    __half2 v, bias;
    const uint32_t b = kBias;
    memcpy(&v, &biased, 4);
    memcpy(&bias, &b, 4);
    v = __hsub2(v, bias);
    uint32_t out;
    memcpy(&out, &v, 4);
    return out;
  }

  __device__ __forceinline__ void store(uint32_t base) const {
    const uint32_t valid = row != nullptr ? 0xFFFFFFFFu : 0u;
    uint32_t f[8];
#pragma unroll
    for (uint32_t w = 0; w < 4; ++w) {
      f[2 * w] = pair(codes[w], 0x4140) & valid;
      f[2 * w + 1] = pair(codes[w], 0x4342) & valid;
    }
    using grouped_tensor::swz;
    sts128(base + swz(r, 2 * h), f[0], f[1], f[2], f[3]);
    sts128(base + swz(r, 2 * h + 1), f[4], f[5], f[6], f[7]);
    if (h == 0) {
      const uint32_t extra = base + BN * grouped_tensor::kRowBytes;
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(extra + r * 4), "f"(scales.lo) : "memory");
      if constexpr (kScaleSteps == 2) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(extra + BN * 4 + r * 4), "f"(scales.hi)
                     : "memory");
      }
      if constexpr (kSliceMins) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(extra + kScaleSteps * BN * 4 + r * 4),
                     "f"(scales.m)
                     : "memory");
      }
    }
  }
};

// The tensor route's weight tiles of format F.
template <class F>
using LowpTiles =
    std::conditional_t<std::is_same_v<F, ggml::Q4_0Blocks> || std::is_same_v<F, ggml::Q8_0Blocks>,
                       GgmlTiles<F, grouped_tensor::kTileCols>,
                       GgmlFormatTiles<F, grouped_tensor::kTileCols>>;

// Routed rows per tile: 64 for every format. (Q6_K's per-K-step scales cost it a few registers
// more: at the 128 two CTAs per multiprocessor allow, 4-32 bytes spill, which costs less than the
// 32-row tiles' second pass over every weight tile.)
template <class F>
constexpr uint32_t kLowpTileRows = 64;
constexpr uint32_t kLowpTileCols = grouped_tensor::kTileCols;

template <class F, bool kVec>
void launch_lowp_instance(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                          void* const (&args)[5], cudaStream_t stream, bool out_vec2) {
  using Tiles = LowpTiles<F>;
  constexpr uint32_t kExtra = Tiles::kStageExtraBytes;
  constexpr auto kernel =
      &grouped_tensor::grouped_tensor_kernel<Tiles, Mode::LowpF16, kLowpTileRows<F>, kLowpTileCols,
                                             kVec>;
  const uint64_t smem =
      grouped_tensor::smem_bytes<kLowpTileRows<F>, kLowpTileCols, kExtra>(p.n_experts);
  opt_in_dynamic_smem<kernel>(
      launch.label, smem,
      grouped_tensor::smem_bytes<kLowpTileRows<F>, kLowpTileCols, kExtra>(kMaxWorkListExperts));
  kernel<<<static_cast<unsigned>(launch.grid.x), grouped_tensor::kThreads,
           static_cast<size_t>(smem), stream>>>(
      p, static_cast<const char*>(args[0]), static_cast<const char*>(args[1]),
      static_cast<const uint32_t*>(args[2]), static_cast<const uint32_t*>(args[3]),
      static_cast<float*>(args[4]), out_vec2);
}

template <class F>
void launch_grouped_lowp(const KernelLaunch& launch, void* stream) {
  const DenseMatmulIdKernelParams p = read_format_params<F>(launch);
  if (p.n_experts > kMaxWorkListExperts) {
    throw Error(launch.label + ": n_experts " + std::to_string(p.n_experts) + " exceeds " +
                std::to_string(kMaxWorkListExperts));
  }
  // The persistent grid the front door encoded (KernelDef::persistent_groups, capped by the tile
  // count); CTAs beyond the work items find none and exit.
  if (launch.grid.x == 0 || launch.grid.x > 0x7fffffffu || launch.grid.y != 1 ||
      launch.grid.z != 1) {
    throw Error(launch.label + ": expected a 1-D persistent grid");
  }
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  void* const args[5] = {
      kernels::launch_arg(launch, 1, "weights", weight_extent<F>(p)).data,
      kernels::launch_arg(launch, 2, "input", input_extent(p)).data,
      kernels::launch_arg(launch, 3, "expert counts", uint64_t{p.n_experts} * 4).data,
      kernels::launch_arg(launch, 4, "routed rows", uint64_t{p.n_experts} * p.m * 4).data,
      kernels::launch_arg(launch, 5, "output", rows * p.n * 4).data,
  };
  // 16-byte activation loads need every input row 16-byte aligned (k is a multiple of 32).
  const auto addr = [&](int i) { return reinterpret_cast<uintptr_t>(args[i]); };
  const bool vec = addr(1) % 16 == 0 && p.input_token_stride_bytes % 16 == 0 &&
                   p.input_slot_stride_bytes % 16 == 0;
  const bool out_vec2 = p.n % 2 == 0 && addr(4) % 8 == 0;
  const auto s = static_cast<cudaStream_t>(stream);
  if (vec) {
    launch_lowp_instance<F, true>(launch, p, args, s, out_vec2);
  } else {
    launch_lowp_instance<F, false>(launch, p, args, s, out_vec2);
  }
  check(launch, cudaGetLastError());
}

// ---- Dense projections of the kernel formats ----------------------------------------------------
//
// kernel_mul_mv_F_f32 and kernel_mul_mm_F_f32 of every format of ggml_formats.h's kKernelFormats
// (the Q8_0 pipelines' slots and params): one kernel, a block of 16 output columns x up to 8
// tokens, the 16 weight rows read once through the shared stage for the block's tokens and each
// output the lane contract's (bit-identical to the CPU backend, and the mat-vec to the matrix
// route). The mat-vec's grid is [ceil(n / 16), ceil(m / 8), 1] with threads [8, 16, 1]; the
// matrix route's [ceil(m / 8), ceil(n / 16), 1] with threads [128, 1, 1].
constexpr uint32_t kDenseTokens = 8;

template <class F, int R>
__global__ void __launch_bounds__(kThreads)
    dense_kernel(const uint8_t* __restrict__ weight, const float* __restrict__ input,
                 float* __restrict__ output, uint32_t m, uint32_t n, uint32_t k, bool aligned,
                 bool rows_on_x) {
  __shared__ __align__(16) uint8_t stage[kColumns * stage_pitch<F>()];
  const uint32_t tid = threadIdx.y * blockDim.x + threadIdx.x;
  const uint32_t lane = tid & 7u, column = tid / 8;
  const uint32_t col0 = (rows_on_x ? blockIdx.x : blockIdx.y) * kColumns;
  const uint32_t t0 = (rows_on_x ? blockIdx.y : blockIdx.x) * kDenseTokens;
  const uint32_t col = col0 + column;
  const uint32_t tokens = min(static_cast<uint32_t>(R), m - t0);
  const uint64_t row_bytes = uint64_t{k} / F::kValues * F::kBytes;
  const float* x[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // Tokens past m repeat the tile's first (same values, never stored).
    x[r] = input + uint64_t{t0 + (static_cast<uint32_t>(r) < tokens ? r : 0)} * k;
  }
  float acc[R] = {};
  staged_lane_dot<F, R>(stage, weight + col0 * row_bytes, row_bytes, min(kColumns, n - col0), k,
                        aligned, column, x, lane, acc, tid);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float sum = ggml::sum8(acc[r]);
    if (lane == 0 && col < n && static_cast<uint32_t>(r) < tokens) {
      output[uint64_t{t0 + r} * n + col] = sum;
    }
  }
}

// Launches the dense kernel for m x n x k (the params checked by the caller): the fewest tokens per
// block (1, 2, 4 or 8) that cover m, which changes no output's order.
template <class F>
void launch_dense(const KernelLaunch& launch, void* stream, size_t weight_slot, size_t input_slot,
                  size_t output_slot, int64_t m, int64_t n, int64_t k, bool rows_on_x) {
  if (m <= 0 || n <= 0 || k <= 0 || k % F::kValues != 0 || m > INT32_MAX || n > INT32_MAX ||
      k > INT32_MAX) {
    throw Error(launch.label +
                ": params have a nonpositive extent or K that is not a multiple of "
                "the " +
                std::to_string(F::kValues) + "-value " + F::kName + " block");
  }
  const auto um = static_cast<uint64_t>(m), un = static_cast<uint64_t>(n),
             uk = static_cast<uint64_t>(k);
  const uint64_t row_bytes = uk / F::kValues * F::kBytes;
  const uint64_t col_tiles = (un + kColumns - 1) / kColumns;
  const uint64_t token_tiles = (um + kDenseTokens - 1) / kDenseTokens;
  const uint64_t threads = launch.threads.x * launch.threads.y * launch.threads.z;
  if (threads != kThreads || launch.grid.x != (rows_on_x ? col_tiles : token_tiles) ||
      launch.grid.y != (rows_on_x ? token_tiles : col_tiles) || launch.grid.z != 1 ||
      launch.grid.y > 65535 || launch.grid.x > 0x7fffffffu) {
    throw Error(launch.label + ": launch does not match the dense tiles (128 threads, " +
                std::to_string(kColumns) + " outputs x " + std::to_string(kDenseTokens) +
                " tokens per block)");
  }
  const auto* w = static_cast<const uint8_t*>(
      kernels::launch_arg(launch, weight_slot, "weight", un * row_bytes).data);
  const auto* x =
      static_cast<const float*>(kernels::launch_arg(launch, input_slot, "input", um * uk * 4).data);
  auto* out =
      static_cast<float*>(kernels::launch_arg(launch, output_slot, "output", um * un * 4).data);
  const bool aligned = reinterpret_cast<uintptr_t>(w) % 16 == 0 && row_bytes % 16 == 0;
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(launch.grid.y), 1);
  const dim3 block(static_cast<unsigned>(launch.threads.x), static_cast<unsigned>(launch.threads.y),
                   static_cast<unsigned>(launch.threads.z));
  const auto s = static_cast<cudaStream_t>(stream);
  const auto go = [&](auto kernel) {
    kernel<<<grid, block, 0, s>>>(w, x, out, static_cast<uint32_t>(m), static_cast<uint32_t>(n),
                                  static_cast<uint32_t>(k), aligned, rows_on_x);
  };
  if (m == 1) {
    go(dense_kernel<F, 1>);
  } else if (m == 2) {
    go(dense_kernel<F, 2>);
  } else if (m <= 4) {
    go(dense_kernel<F, 4>);
  } else {
    go(dense_kernel<F, 8>);
  }
  check(launch, cudaGetLastError());
}

// Slots: 0 weight, 1 input, 2 output, 3 params (GgmlMatmulMvParams).
template <class F>
void launch_dense_mat_vec(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMvParams>(launch, 3);
  if (q.ne00 != q.ne10 || q.ne01 != q.ne0) throw Error(launch.label + ": inconsistent params");
  launch_dense<F>(launch, stream, 0, 1, 2, q.ne1, q.ne01, q.ne00, true);
}

// Slots: 0 params (GgmlMatmulMmParams), 1 weight, 2 input, 3 output.
template <class F>
void launch_dense_matrix(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMmParams>(launch, 0);
  if (q.ne00 <= 0 || q.nb10 != 4 || q.nb11 != uint64_t(q.ne00) * 4 ||
      q.nb01 != uint64_t(q.ne00) / F::kValues * F::kBytes) {
    throw Error(launch.label + ": inconsistent params (contiguous batch-1 operands only)");
  }
  launch_dense<F>(launch, stream, 1, 2, 3, q.ne1, q.ne0, q.ne00, false);
}

KernelDef def(std::string_view name, KernelFn fn, uint32_t tile_x, uint32_t tile_y) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.max_threads_per_threadgroup = 1024;
  d.threads_per_group = kThreads;
  d.tile_x = tile_x;
  d.tile_y = tile_y;
  d.threadgroup_memory_bytes = 0;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256;
  d.check_args = kernels::kernel_arg_contract(name);
  return d;
}

// The tensor route of format F under `name`, checked by `contract`'s argument contract (the
// grouped pipeline's: same slots and extents): a persistent grid of two CTAs per multiprocessor
// (the 64 x 128 tile's occupancy); the tile fields bound its work items, and the launch sizes its
// shared memory (the declared bytes leave out the work list, 8 bytes per expert).
template <class F>
KernelDef lowp_def(std::string_view name, std::string_view contract) {
  KernelDef d = def(contract, launch_grouped_lowp<F>, kLowpTileRows<F>, kLowpTileCols);
  d.name = std::string(name);
  d.threads_per_group = grouped_tensor::kThreads;
  d.persistent_groups = 2 * grouped_tensor::device0_multiprocessors();
  d.threadgroup_memory_bytes =
      uint64_t{grouped_tensor::pipe_bytes<kLowpTileRows<F>, kLowpTileCols,
                                          LowpTiles<F>::kStageExtraBytes>()} +
      grouped_tensor::kMaxTileRows * 4;
  return d;
}

// The five pipelines of the format F (its kKernelFormats entry, found by name; its tensor route's
// name at the same index after Q4_0 and Q8_0's).
template <class F>
void add_format_kernels(std::vector<KernelDef>& out) {
  constexpr size_t i = [] {
    for (size_t j = 0; j < ggml_formats::kKernelFormats.size(); ++j) {
      if (ggml_formats::kKernelFormats[j].name == std::string_view(F::kName)) return j;
    }
    return ggml_formats::kKernelFormats.size();
  }();
  static_assert(i < ggml_formats::kKernelFormats.size());
  constexpr const ggml_formats::KernelFormat& f = ggml_formats::kKernelFormats[i];
  static_assert(f.block_values == F::kValues && f.block_bytes == F::kBytes);
  out.push_back(def(f.id_direct, launch_direct<F>, kColumns, 1));
  out.push_back(def(f.id_grouped, launch_grouped<F>, kGroupRows, kColumns));
  out.push_back(def(f.mat_vec, launch_dense_mat_vec<F>, kColumns, kDenseTokens));
  out.push_back(def(f.matrix, launch_dense_matrix<F>, kDenseTokens, kColumns));
  out.push_back(lowp_def<F>(kGgmlQuantizedMatmulIdTensorPipelineNames[2 + i], f.id_grouped));
}

}  // namespace

void add_quantized_matmul_id_kernels(std::vector<KernelDef>& out) {
  const auto& names = kGgmlQuantizedMatmulIdPipelineNames;
  out.push_back(def(names[0], launch_direct<ggml::Q4_0Blocks>, kColumns, 1));
  out.push_back(def(names[1], launch_direct<ggml::Q8_0Blocks>, kColumns, 1));
  out.push_back(def(names[2], launch_grouped<ggml::Q4_0Blocks>, kGroupRows, kColumns));
  out.push_back(def(names[3], launch_grouped<ggml::Q8_0Blocks>, kGroupRows, kColumns));
  add_format_kernels<ggml::Q4_1Blocks>(out);
  add_format_kernels<ggml::Q5_0Blocks>(out);
  add_format_kernels<ggml::Q5_1Blocks>(out);
  add_format_kernels<ggml::Mxfp4Blocks>(out);
  add_format_kernels<ggml::Q4_KBlocks>(out);
  add_format_kernels<ggml::Q5_KBlocks>(out);
  add_format_kernels<ggml::Q6_KBlocks>(out);
  static_assert(ggml_formats::kKernelFormats.size() == 7, "a CUDA trait for every kernel format");

  const auto& lowp = kGgmlQuantizedMatmulIdTensorPipelineNames;
  out.push_back(lowp_def<ggml::Q4_0Blocks>(lowp[0], lowp[0]));
  out.push_back(lowp_def<ggml::Q8_0Blocks>(lowp[1], lowp[1]));
}

}  // namespace routemm::cuda
