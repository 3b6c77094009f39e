// The Q4_0 mat-vec kernel of Hopper (sm_90a) for one to four tokens (the library runs one or two), shared by its launcher
// (q4_matvec_rows.cu, which states the design, numerics and measurements) and the lab that times
// other configurations of it (bench/lab/q4_matvec_mma_rows_lab.cu). Compile-guarded: the body
// exists only where __CUDA_ARCH_FEAT_SM90_ALL is defined.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "q4_matvec_block.cuh"
#include "wgmma.cuh"

namespace routemm::cuda {

inline constexpr int kRowsPerGroup = 16;       // one MMA tile of weight rows per row group
inline constexpr int kRowsQuadBytes = 8 * 16;  // one token's B quads of a block: 4 hi, 4 lo
inline constexpr int kRowsCtasPerSm = 2;

// What a launch runs: the product (kFull, the library); the lab's data-path measurements run the
// token's loads and splits with the stages (kDataPath) or the stages alone (kStagesOnly), waited
// for and released without arithmetic, the outputs then zeros.
enum class RowsMode { kFull, kDataPath, kStagesOnly };

struct RowsArgs {
  const uint8_t* weight;
  const float* input;
  float* output;
  int32_t m, n, k_blocks, row_groups;  // m <= the config's kTokens
  int32_t w_grain;   // 16: bulk copies; else plain copies of this many bytes (4, 2 or 1)
  int32_t x_vector;  // 1: 16-byte activation loads; 0: 4-byte loads
};

// kConsumers consumer warps, a ring of kRing stages of kSlabBlocks blocks per row, up to kTokens
// tokens (1, 2 or 4: B columns 2j and 2j + 1 hold token j's hi and lo parts). The library: 4 or 8
// warps, 3 stages of 64 blocks; the lab times other points.
template <int kConsumers_, int kRing_, int kSlabBlocks_ = 64, int kTokens_ = 1>
struct RowsConfig {
  static constexpr int kConsumers = kConsumers_, kRing = kRing_, kSlabBlocks = kSlabBlocks_;
  static constexpr int kTokens = kTokens_;
  static constexpr int kBlockQuadBytes = kTokens * kRowsQuadBytes;  // a block's quads, all tokens
  static constexpr int kThreads = 32 * (kConsumers + 1);
  static constexpr int kWarpBlocks = kSlabBlocks / kConsumers;
  static constexpr int kSlabBytes = kSlabBlocks * 18;
  // Stage rows kSlabBytes + 16 apart: 64 * 18 = 1152 is a multiple of 128, so the 8 rows of a lane
  // quarter would share banks; 16 more bytes spread them over distinct 16-byte bank groups (also
  // for 32-block slabs: 592 bytes).
  static constexpr int kRowStride = kSlabBytes + 16;
  static constexpr int kBarrierBytes = 2 * 8 * kRing;
  static constexpr int kRingBytes = kRing * kRowsPerGroup * kRowStride;
  static constexpr int kQuadsBytes = kConsumers * kWarpBlocks * kBlockQuadBytes;
  static constexpr int kSmem =
      256 + kRingBytes + kQuadsBytes + kConsumers * kTokens * kRowsPerGroup * 4;
  static_assert(kBarrierBytes <= 256 && kWarpBlocks % 4 == 0 && kRowStride % 16 == 0 &&
                kSlabBlocks % 8 == 0 && (kTokens == 1 || kTokens == 2 || kTokens == 4));
};

namespace rows_detail {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
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
}  // namespace rows_detail

template <class C, RowsMode kMode = RowsMode::kFull>
__global__ void __launch_bounds__(C::kThreads, kRowsCtasPerSm)
    q4_matvec_rows_kernel(const RowsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kConsumers = C::kConsumers, kRing = C::kRing, kSlabBlocks = C::kSlabBlocks;
  constexpr int kSlabBytes = C::kSlabBytes, kRowStride = C::kRowStride;
  constexpr int kRows = kRowsPerGroup, kQuadBytes = kRowsQuadBytes;
  constexpr int kWarpBlocks = C::kWarpBlocks;
  using rows_detail::copy_row_plain;
  constexpr bool kMath = kMode == RowsMode::kFull, kToken = kMode != RowsMode::kStagesOnly;
  constexpr int kXLoads = kWarpBlocks / 4;  // 4 blocks per warp-wide step
  constexpr int kTokens = C::kTokens, kBlockQuadBytes = C::kBlockQuadBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t full0 = smem_addr(smem), empty0 = full0 + 8 * kRing;
  uint8_t* const ring = smem + 256;
  uint8_t* const warp_quads = ring + C::kRingBytes + warp * kWarpBlocks * kBlockQuadBytes;
  float* const partial = reinterpret_cast<float*>(ring + C::kRingBytes + C::kQuadsBytes);
  const int slabs = (a.k_blocks + kSlabBlocks - 1) / kSlabBlocks;
  const uint64_t row_bytes = uint64_t(a.k_blocks) * 18;
  // mbarrier.arrive releases the arriving thread's own accesses only, so every lane that touched a
  // stage arrives itself: the producer's 32 lanes on the plain-copy path (one expect-tx arrival on
  // the bulk path, whose writes the transaction count covers), every consumer lane after its reads.
  const bool bulk = a.w_grain == 16;
  if (tid == 0) {
    for (int s = 0; s < kRing; ++s) {
      sm90::mbar_init(full0 + 8 * s, bulk ? 1 : 32);
      sm90::mbar_init(empty0 + 8 * s, 32 * kConsumers);
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
        if (bulk) {
          if (lane == 0) sm90::mbar_arrive_expect_tx(full0 + 8 * slot, rows * bytes);
          __syncwarp();
          if (lane < rows) {
            sm90::bulk_load(smem_addr(stage + lane * kRowStride), src + lane * row_bytes, bytes,
                            full0 + 8 * slot);
          }
        } else {
          // The warp copies the stage row by row; each lane's arrival releases its own stores.
          for (int r = 0; r < rows; ++r) {
            copy_row_plain(stage + r * kRowStride, src + r * row_bytes, bytes, a.w_grain, lane, 32);
          }
          sm90::mbar_arrive(full0 + 8 * slot);
        }
      }
    }
    return;
  }

  // The tokens' slice of stage j, one step per token and 4 blocks: lane L holds chunk c = L % 8
  // (x[32 b + 4 c .. + 3]) of block b = 4 q + L / 8 of the warp's slice; blocks past K and tokens
  // past m read zeros.
  float4 xv[kTokens][kXLoads];
  const int64_t k_values = int64_t(a.k_blocks) * 32;
  const auto load_x = [&](int j) {
#pragma unroll
    for (int tok = 0; tok < kTokens; ++tok) {
#pragma unroll
      for (int q = 0; q < kXLoads; ++q) {
        const int b = j * kSlabBlocks + warp * kWarpBlocks + 4 * q + (lane >> 3);
        const float* const src = a.input + tok * k_values + int64_t(b) * 32 + 4 * (lane & 7);
        float4& v = xv[tok][q];
        if (b >= a.k_blocks || tok >= a.m) {
          v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        } else if (a.x_vector) {
          v = __ldg(reinterpret_cast<const float4*>(src));
        } else {
          v = make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
        }
      }
    }
  };
  // Quad tq of a block is [the pairs of values 4tq..4tq+3, of 16+4tq..16+4tq+3]: the hi quad at 16
  // tq of the token's 128 bytes of the block, the lo quad at 64 + 16 tq. Lane L (chunk c = L % 8)
  // splits its own four values and stores their hi and lo halves (8 bytes each) at 16 (c % 4) +
  // 8 (c / 4) and 64 bytes further: no exchange between lanes. A block holds its tokens' quads in
  // token order, so lane L of the MMA finds its quad (token L / 8, hi for L % 8 < 4) at 16 L: the
  // layout matvec_split_columns_block reads. The order of the two stores alternates with c / 4 and
  // the block's parity, so each store's 32 lanes cover every bank twice (two wavefronts).
  const auto split_x = [&]() {
    const int c = lane & 7;
    const bool hi_first = ((c >> 2) ^ (lane >> 3)) & 1;
#pragma unroll
    for (int tok = 0; tok < kTokens; ++tok) {
#pragma unroll
      for (int q = 0; q < kXLoads; ++q) {
        const float4 x4 = xv[tok][q];
        const float own[4] = {x4.x, x4.y, x4.z, x4.w};
        uint32_t hi[2], lo[2];
        split_activation_pairs(own, hi, lo);
        const int block = 4 * q + (lane >> 3);
        const uint32_t quad = smem_addr(warp_quads + block * kBlockQuadBytes + tok * kQuadBytes) +
                              16 * (c & 3) + 8 * (c >> 2);
        const uint32_t first = quad + (hi_first ? 0 : 64), second = quad + (hi_first ? 64 : 0);
        sts64(first, hi_first ? hi[0] : lo[0], hi_first ? hi[1] : lo[1]);
        sts64(second, hi_first ? lo[0] : hi[0], hi_first ? lo[1] : hi[1]);
      }
    }
  };

  // Lane (g, t) reads quad lane of each block: MMA column g = 2j + h is token j's hi (h = 0) or lo
  // (h = 1) parts; lanes past the kTokens' quads read the last one (finite; their MMA columns are
  // never used).
  const uint8_t* const my_quads = warp_quads + min(lane, 8 * kTokens - 1) * 16;
  if (kToken) load_x(0);
  int s = 0;
  for (int rg = static_cast<int>(blockIdx.x); rg < a.row_groups; rg += gridDim.x) {
    float acc_top = 0.0f, acc_bottom = 0.0f;  // rows g and g + 8 of token t
    for (int j = 0; j < slabs; ++j, ++s) {
      const int slot = s % kRing, round = s / kRing;
      if (kToken) {
        __syncwarp();  // the previous stage's quads are read
        split_x();
        load_x(j + 1 < slabs ? j + 1 : 0);  // the next stage's slice (the next group's first)
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
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kBlockQuadBytes);
          matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
        }
      } else {
        for (int i = 0; first + i < blocks; ++i) {
          const uint4 bq = *reinterpret_cast<const uint4*>(my_quads + i * kBlockQuadBytes);
          matvec_split_columns_block(top, bottom, first + i, t, bq, acc_top, acc_bottom);
        }
      }
      sm90::mbar_arrive(empty0 + 8 * slot);  // this lane's reads of the stage are done
    }
    if (t < kTokens) {  // partial[warp][token][row]
      partial[(warp * kTokens + t) * kRows + g] = acc_top;
      partial[(warp * kTokens + t) * kRows + g + 8] = acc_bottom;
    }
    sm90::named_barrier_sync(1, 32 * kConsumers);
    if (tid < kTokens * kRows) {
      const int tok = tid / kRows, r = tid % kRows, row = rg * kRows + r;
      if (tok < a.m && row < a.n) {
        float sum = partial[tok * kRows + r];
#pragma unroll
        for (int w = 1; w < kConsumers; ++w) sum += partial[(w * kTokens + tok) * kRows + r];
        a.output[int64_t(tok) * a.n + row] = sum;
      }
    }
    sm90::named_barrier_sync(1, 32 * kConsumers);  // partial is free for the next row group
  }
#else
  __trap();  // launched only where the sm_90a image exists (q4_matvec_rows_eligible)
#endif
}

}  // namespace routemm::cuda
