// The one-token Q4_0 mat-vec on Hopper (compute capability 9.0, sm_90a builds): q4_matmul.cu's
// mat-vec launcher runs it for m == 1 and k % 256 == 0 (q4_matvec_rows_eligible); every other
// mat-vec keeps q4_matvec_kernel. The dispatch's recorded geometry stays the mat-vec pipeline's
// (the front door's grid); this launcher picks its own grid, as the Hopper matrix kernel does.
//
// WHY: at one token the mat-vec streams n * k / 32 * 18 bytes of weights and does 2 MMAs per 16
// rows and block. q4_matvec_kernel (a cp.async ring per warp, 16-byte copies, a K split across
// clusters) took 18.3 us at 4096 x 14336 on the H200; this kernel moves the weights with one bulk
// copy per row and stage and keeps the arithmetic (matvec_split_columns_block: the hi / lo split
// numerics, two mma.sync per block). Measurements: bench/results/experiments/
// q4_0_matvec_mma_rows-h200-2026-12-04.md (the lab: bench/lab/q4_matvec_mma_rows_lab.cu).
//
// KERNEL (one producer warp and kConsumers consumer warps per CTA, two CTAs per multiprocessor):
//   - A CTA walks 16-row groups (rg = blockIdx.x, + gridDim.x, ...). A row group's K is cut into
//     slabs of 64 blocks (1152 bytes of a row; the last slab may be shorter, a multiple of 8 blocks
//     since k % 256 == 0); a stage is one slab of the group's 16 rows. The producer warp fills a
//     ring of kRing stages guarded by full / empty mbarriers: lane r < 16 copies row r's slab with
//     one bulk copy (16-byte aligned views) or, for other views, the warp copies the stage with
//     plain loads and arrives once it is written. Rows past n are not copied (their MMA rows hold
//     stale values and are never stored; a row of an MMA never mixes with another).
//   - Stage rows sit 1168 bytes apart: 1152 is a multiple of 128, so the 8 rows of a lane quarter
//     would share banks (8-way conflicts on every A and scale load, measured 29.8 against 14.8 us).
//   - Consumer warp w takes blocks [w * kWarpBlocks, (w + 1) * kWarpBlocks) of every stage. Its
//     slice of the token (kWarpBlocks blocks) is loaded one stage ahead into registers (L2-resident
//     after the first CTA reads it) and split into B quads in the warp's own shared slice before
//     the warp waits for the stage: no prologue and no bound on K. Per block, each lane decodes its
//     A registers of rows g and g + 8 and runs matvec_split_columns_block into two accumulators.
//   - After a row group's last stage the consumer warps' sums of each row are added in warp order
//     and stored.
//
// NUMERICS: the split numerics of the mat-vec (q4_matvec_block.cuh); each output is summed in a
// fixed order that depends only on k (a warp's blocks of each stage in increasing order, stages in
// order, then the warps in order), never on alignment, grid or device load, so a product's bits
// repeat and aligned and unaligned views give the same bits. The order differs from
// q4_matvec_kernel's; both stay within the mat-vec's stated bound.
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "hopper_support.h"
#include "q4_matvec_block.cuh"
#include "q4_matvec_rows.h"
#include "routemm/error.h"
#include "smem_opt_in.h"
#include "wgmma.cuh"

namespace routemm::cuda {
namespace {

constexpr int kRows = 16;        // one MMA tile of weight rows per row group
constexpr int kSlabBlocks = 64;  // blocks per stage and row
constexpr int kSlabBytes = kSlabBlocks * 18;
constexpr int kRowStride = kSlabBytes + 16;  // see "Stage rows" above
constexpr int kQuadBytes = 8 * 16;           // one block's B quads: 4 hi, 4 lo
constexpr int kCtasPerSm = 2;

struct RowsArgs {
  const uint8_t* weight;
  const float* input;
  float* output;
  int32_t n, k_blocks, row_groups;
  int32_t w_grain;   // 16: bulk copies; else plain copies of this many bytes (4, 2 or 1)
  int32_t x_vector;  // 1: 16-byte activation loads; 0: 4-byte loads
};

template <int kConsumers, int kRing>
struct RowsConfig {
  static constexpr int kThreads = 32 * (kConsumers + 1);
  static constexpr int kWarpBlocks = kSlabBlocks / kConsumers;
  static constexpr int kBarrierBytes = 2 * 8 * kRing;
  static constexpr int kRingBytes = kRing * kRows * kRowStride;
  static constexpr int kQuadsBytes = kConsumers * kWarpBlocks * kQuadBytes;
  static constexpr int kSmem = 128 + kRingBytes + kQuadsBytes + kConsumers * kRows * 4;
  static_assert(kBarrierBytes <= 128 && kWarpBlocks % 4 == 0 && kRowStride % 16 == 0);
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `bytes` of one row's slab, global -> shared, with plain copies of `grain` bytes (4, 2 or 1; both
// addresses and bytes are multiples of it). Lanes split the units.
__device__ __forceinline__ void copy_row_plain(uint8_t* dst, const uint8_t* src, int bytes,
                                               int grain, int lane, int lanes) {
  if (grain == 4) {
    for (int i = lane * 4; i < bytes; i += lanes * 4) {
      *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
    }
  } else if (grain == 2) {
    for (int i = lane * 2; i < bytes; i += lanes * 2) {
      *reinterpret_cast<uint16_t*>(dst + i) = *reinterpret_cast<const uint16_t*>(src + i);
    }
  } else {
    for (int i = lane; i < bytes; i += lanes) dst[i] = src[i];
  }
}
#endif

template <int kConsumers, int kRing>
__global__ void __launch_bounds__(RowsConfig<kConsumers, kRing>::kThreads, kCtasPerSm)
    q4_matvec_rows_kernel(const RowsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = RowsConfig<kConsumers, kRing>;
  constexpr int kWarpBlocks = C::kWarpBlocks;
  constexpr int kXLoads = kWarpBlocks / 4;  // 4 blocks per warp-wide step
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t full0 = smem_u32(smem), empty0 = full0 + 8 * kRing;
  uint8_t* const ring = smem + 128;
  uint8_t* const warp_quads = ring + C::kRingBytes + warp * kWarpBlocks * kQuadBytes;
  float* const partial = reinterpret_cast<float*>(ring + C::kRingBytes + C::kQuadsBytes);
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

  if (warp == kConsumers) {  // the producer: stages in (row group, slab) order
    int s = 0;
    for (int rg = static_cast<int>(blockIdx.x); rg < a.row_groups; rg += gridDim.x) {
      const int rows = min(kRows, a.n - rg * kRows);
      const uint8_t* const group = a.weight + uint64_t(rg) * kRows * row_bytes;
      for (int j = 0; j < slabs; ++j, ++s) {
        const int slot = s % kRing, round = s / kRing;
        if (round > 0) sm90::mbar_wait(empty0 + 8 * slot, (round - 1) & 1);
        const int bytes = min(kSlabBlocks, a.k_blocks - j * kSlabBlocks) * 18;
        uint8_t* const stage = ring + slot * kRows * kRowStride;
        const uint8_t* const src = group + j * kSlabBytes;
        if (a.w_grain == 16) {
          if (lane == 0) sm90::mbar_arrive_expect_tx(full0 + 8 * slot, rows * bytes);
          __syncwarp();
          if (lane < rows) {
            sm90::bulk_load(smem_u32(stage + lane * kRowStride), src + lane * row_bytes, bytes,
                            full0 + 8 * slot);
          }
        } else {
          // The warp copies the stage row by row, then lane 0 arrives (a release) once every lane's
          // stores are ordered before it.
          for (int r = 0; r < rows; ++r) {
            copy_row_plain(stage + r * kRowStride, src + r * row_bytes, bytes, a.w_grain, lane, 32);
          }
          __threadfence_block();
          __syncwarp();
          if (lane == 0) sm90::mbar_arrive(full0 + 8 * slot);
        }
      }
    }
    return;
  }

  // The token slice of stage j, one step per 4 blocks: lane L holds chunk c = L % 8
  // (x[32 b + 4 c .. + 3]) of block b = 4 q + L / 8 of the warp's slice; blocks past K read zeros.
  float4 xv[kXLoads];
  const auto load_x = [&](int j) {
#pragma unroll
    for (int q = 0; q < kXLoads; ++q) {
      const int b = j * kSlabBlocks + warp * kWarpBlocks + 4 * q + (lane >> 3);
      const float* const src = a.input + int64_t(b) * 32 + 4 * (lane & 7);
      if (b >= a.k_blocks) {
        xv[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      } else if (a.x_vector) {
        xv[q] = __ldg(reinterpret_cast<const float4*>(src));
      } else {
        xv[q] = make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
      }
    }
  };
  // Quad tq of a block needs chunks tq (values 4tq..) and tq + 4 (16 + 4tq..): lanes L and L ^ 4
  // exchange chunks; lane c < 4 stores the hi quad c, lane c >= 4 the lo quad c, so lane L's store
  // lands at 16 L of the step's 512 bytes (the layout matvec_split_columns_block reads).
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
      split_activation_pairs(v, hi, lo);
      const uint32_t dst = smem_u32(warp_quads + q * 4 * kQuadBytes + lane * 16);
      if (low_half) {
        sts128(dst, hi[0], hi[1], hi[2], hi[3]);
      } else {
        sts128(dst, lo[0], lo[1], lo[2], lo[3]);
      }
    }
  };

  // Lane (g, t) reads quad g of each block: g = 0 the token's hi parts, g = 1 its lo parts; lanes
  // past quad 7 read quad 7 (finite; their MMA columns are never used).
  const uint8_t* const my_quads = warp_quads + min(lane, 7) * 16;
  load_x(0);
  int s = 0;
  for (int rg = static_cast<int>(blockIdx.x); rg < a.row_groups; rg += gridDim.x) {
    float acc_top = 0.0f, acc_bottom = 0.0f;  // rows g and g + 8 (lanes t == 0 hold the sums)
    for (int j = 0; j < slabs; ++j, ++s) {
      const int slot = s % kRing, round = s / kRing;
      __syncwarp();  // the previous stage's quads are read
      split_x();
      load_x(j + 1 < slabs ? j + 1 : 0);  // the next stage's slice (the next group's first)
      __syncwarp();
      sm90::mbar_wait(full0 + 8 * slot, round & 1);
      const int blocks = min(kSlabBlocks, a.k_blocks - j * kSlabBlocks);
      const uint8_t* const top = ring + (slot * kRows + g) * kRowStride;
      const uint8_t* const bottom = top + 8 * kRowStride;
      const int first = warp * kWarpBlocks;
      if (first + kWarpBlocks <= blocks) {
#pragma unroll
        for (int i = 0; i < kWarpBlocks; ++i) {
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kQuadBytes);
          matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
        }
      } else {
        for (int i = 0; first + i < blocks; ++i) {
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kQuadBytes);
          matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
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
#pragma unroll
      for (int w = 1; w < kConsumers; ++w) sum += partial[w * kRows + tid];
      a.output[int64_t(rg) * kRows + tid] = sum;
    }
    sm90::named_barrier_sync(1, 32 * kConsumers);  // partial is free for the next row group
  }
#else
  __trap();  // launched only where the sm_90a image exists (q4_matvec_rows_eligible)
#endif
}

// Multiprocessors of the current device, asked once per device.
int multiprocessors(const std::string& label) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    throw Error("'" + label + "': no current CUDA device");
  }
  int sms = known[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    if (const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess || sms <= 0) {
      throw Error("'" + label +
                  "': cannot read the multiprocessor count: " + cudaGetErrorString(e));
    }
    known[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

template <int kConsumers, int kRing>
void launch_rows(const std::string& label, cudaStream_t stream, const RowsArgs& a, int grid) {
  using C = RowsConfig<kConsumers, kRing>;
  constexpr auto kernel = &q4_matvec_rows_kernel<kConsumers, kRing>;
  opt_in_dynamic_smem<kernel>(label, C::kSmem, C::kSmem);
  q4_matvec_rows_kernel<kConsumers, kRing><<<grid, C::kThreads, C::kSmem, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + label + "': launch failed: " + cudaGetErrorString(e));
  }
}

}  // namespace

bool q4_matvec_rows_eligible(int device, uint64_t m, uint64_t k) {
  return m == 1 && k > 0 && k % 256 == 0 && k / 32 <= INT32_MAX && hopper_kernels_available(device);
}

void launch_q4_matvec_rows(const std::string& label, cudaStream_t stream,
                           const Q4MatVecRowsProblem& p) {
  RowsArgs a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.n = static_cast<int32_t>(p.n);
  a.k_blocks = static_cast<int32_t>(p.k / 32);
  a.row_groups = static_cast<int32_t>((uint64_t{p.n} + kRows - 1) / kRows);
  // Rows start row_bytes (a multiple of 144) apart and slabs 1152 bytes into a row, so the view's
  // own alignment decides every copy's.
  const auto w_address = reinterpret_cast<uintptr_t>(p.weight);
  a.w_grain = w_address % 16 == 0 ? 16 : w_address % 4 == 0 ? 4 : w_address % 2 == 0 ? 2 : 1;
  a.x_vector = reinterpret_cast<uintptr_t>(p.input) % 16 == 0 ? 1 : 0;
  if (a.n <= 0) return;
  const int sms = multiprocessors(label);
  const int grid = std::min(a.row_groups, kCtasPerSm * sms);
  // Fewer row groups than multiprocessors: 8 consumer warps shorten each stage's arithmetic
  // (measured: 2048 x 4096 5.7 against 6.2 us, 512 x 2048 4.1 against 4.6); else 4 keep more
  // registers per warp (4096 x 14336: 15.7 against 16.9 us with 8).
  if (a.row_groups < sms) {
    launch_rows<8, 3>(label, stream, a, grid);
  } else {
    launch_rows<4, 3>(label, stream, a, grid);
  }
}

}  // namespace routemm::cuda
