// CUDA kernels of the GGML Q4_0 dense projections (csrc/ops/q4_matmul.cpp owns validation, routing
// and geometry): the four matrix routes (one kernel template) and the mat-vec (a per-warp streamed
// kernel), all on warp-level MMA (mma.sync m16n8k16 bf16, ldmatrix, cp.async; sm_80+, the same code
// on sm_90, where long K is also split across a thread-block cluster). On Hopper the two bf16 routes
// (compatibility_v2, tensor_64x32) take the warpgroup-MMA kernel of q4_matmul_wgmma.cu instead when
// k % 256 == 0 and the weight view is 16-byte aligned (launch_matrix below); same tiles, K split and
// numerics, so the dispatch geometry and the V2 == 64x32 contract hold on either kernel. On Hopper
// the mat-vec for m <= 2 and k % 256 == 0 runs q4_matvec_rows.cu (bulk copies per weight row,
// the same split numerics, its own fixed summation order and grid; the recorded geometry is this
// file's).
//
// DATA PATH (every route): raw GGUF blocks and F32 activations stream into a shared-memory ring by
// cp.async (16/8/4-byte copies, the widest the weight view's alignment and row length allow; byte
// copies for odd views), a stage of SB blocks (32 * SB values of K) at a time. Each stage is then
// converted once per CTA into bf16 MMA operand tiles (the weights decoded from nibbles, the
// activations rounded), and the warps multiply the tiles with ldmatrix + mma.sync. The mat-vec,
// whose warps share no weight rows, streams per warp instead (q4_matvec_kernel below) and decodes its
// weight fragments in registers straight from the raw stage. Tails in N, M and
// K are handled in the kernel (rows and tokens past the end are never loaded and never stored).
//
// NUMERICS, stated per route (tests/python/tolerances.py holds the matching tolerances):
//   split (mat-vec, compatibility_simdgroup, compatibility_tensor_v1): the weights enter exactly --
//     the MMA multiplies the integers (nibble - 8), which bf16 holds exactly -- and each activation
//     is split into x = hi + lo, two bf16 values (|x - hi - lo| <= 2^-16 |x|). Each 32-value block
//     is summed by the tensor cores in F32 from zero (hi and lo products of both 16-value halves),
//     then scaled by the block's F32 scale d with one FMA into the F32 accumulator. Accuracy close to
//     F32 accumulation; tested within 2^-14 * sum|w x| per element.
//   bf16 (compatibility_v2, tensor_64x32): the weights are dequantised to bf16 as bf16(d) * (nibble -
//     8) rounded to bf16, the activations rounded to bf16, products accumulated in F32 by the tensor
//     cores over the whole K range. The same rounding as a bf16 GEMM over dequantised weights; tested
//     within 2^-6 * sum|w x| per element and 1e-2 relative Frobenius error.
// ORDER (except the Hopper mat-vec of one or two tokens, whose order q4_matvec_rows.cu states): an
// output element's sum runs over K blocks in increasing order within its K split; the splits
// (grid.z, one cluster) are added in increasing split order by the CTA that stores the element. The
// split and this order depend on (m, n, k) only (csrc/ops/q4_matmul.cpp), never on a route's token
// tile, and an MMA's result depends only on its operand values, so V2 and 64x32 -- same numerics,
// different tiles -- give bit-identical outputs (the calibration's contract).
//
// GEOMETRY (KernelDef below; tile_x/tile_y as the front door reads them; SB and the ring depth are
// in the Tile aliases further down):
//   kernel_mul_mv_q4_0_f32               split,  64 rows x 8 tokens, 128 threads (8 x 16)
//   kernel_mul_mm_q4_0_f32               split,  32 tokens x 64 rows, 128 threads
//   kernel_mul_mm_q4_0_tensor_f32        split,  32 tokens x 128 rows, 256 threads
//   kernel_mul_mm_q4_0_tensor_v2_f32     bf16,  128 tokens x 128 rows, 256 threads
//   kernel_mul_mm_q4_0_tensor_64x32_f32  bf16,   32 tokens x 128 rows, 256 threads
// grid.z = the K split (<= 8, sm_90 only), reduced through distributed shared memory inside the
// cluster; threadgroup memory = the ring, the converted tiles (or the split's partial tile).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/q4_0_block.h"
#include "ggml_copy.cuh"
#include "hopper_support.h"
#include "kernels.h"
#include "q4_matmul_wgmma.h"
#include "q4_matvec_block.cuh"
#include "q4_matvec_rows.h"
#include "q4_nibbles.cuh"
#include "q4_split_store.cuh"
#include "routemm/error.h"
#include "routemm/ops/q4_matmul.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"

#ifndef ROUTEMM_CUDA_Q4_MATMUL_SHA256
#define ROUTEMM_CUDA_Q4_MATMUL_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

enum class Numerics { Split, Bf16 };

constexpr int align16(int bytes) { return (bytes + 15) / 16 * 16; }

// One route's tile: MT x NT MMA tiles (16 rows x 8 tokens each) per warp, WR x WT warps, SB blocks of
// K per stage, STAGES stages in the cp.async ring.
template <int MT, int NT, int WR, int WT, int SB, int STAGES, Numerics NUM, int MINB = 1>
struct Tile {
  static constexpr int kMT = MT, kNT = NT, kWR = WR, kSB = SB, kStages = STAGES;
  static constexpr bool kSplit = NUM == Numerics::Split;
  static constexpr int kThreads = 32 * WR * WT;
  static constexpr int kRows = 16 * MT * WR;
  static constexpr int kTokens = 8 * NT * WT;
  static constexpr int kK = 32 * SB;            // K values per stage
  static constexpr int kRawRowBytes = 18 * SB;  // raw weight bytes per row per stage
  static constexpr int kRawW = align16(kRows * kRawRowBytes);
  static constexpr int kRawX = kTokens * kK * 4;  // F32 activations per stage
  static constexpr int kRawStage = kRawW + kRawX;
  static constexpr int kLd = kK + 8;  // converted row stride in bf16: rows 16 bytes apart in banks
  static constexpr int kA = kRows * kLd * 2;
  static constexpr int kD = kSplit ? kRows * SB * 4 : 0;
  static constexpr int kB = kTokens * kLd * 2;
  static constexpr int kBlo = kSplit ? kB : 0;
  static constexpr int kPipeline = STAGES * kRawStage + kA + kD + kB + kBlo;
  static constexpr int kPartials = kRows * kTokens * 4;  // the K-split reduction reuses the ring
  static constexpr int kSmem = kPipeline > kPartials ? kPipeline : kPartials;
  static_assert(kRawRowBytes % 2 == 0 && kLd * 2 % 16 == 0 && kRawStage % 16 == 0);
  // The vector load path: each weight row's stage is kWUnits copies of kWGrain bytes (the widest
  // power of two dividing 18 * SB), each activation row's stage kXUnits 16-byte copies. Copy u of a
  // stage is row u / units, unit u % units, and thread t issues copies t, t + kThreads, ...: a warp
  // covers whole row segments, so each copy instruction touches as few cache lines as possible.
  static constexpr int kWGrain = kRawRowBytes % 16 == 0 ? 16 : kRawRowBytes % 8 == 0 ? 8 : 4;
  static constexpr int kWUnits = kRawRowBytes / kWGrain;
  static constexpr int kWPerThread = (kRows * kWUnits + kThreads - 1) / kThreads;
  static constexpr int kXUnits = kK * 4 / 16;
  static constexpr int kXPerThread = (kTokens * kXUnits + kThreads - 1) / kThreads;
  static constexpr int kMinBlocks = MINB;
};

using SimdgroupTile = Tile<2, 2, 2, 2, 2, 4, Numerics::Split>;
using TensorV1Tile = Tile<2, 2, 4, 2, 2, 4, Numerics::Split>;
using TensorV2Tile = Tile<4, 4, 2, 4, 2, 2, Numerics::Bf16, 2>;  // two CTAs per SM overlap phases
using Tensor64x32Tile = Tile<2, 2, 4, 2, 2, 4, Numerics::Bf16>;

constexpr int kMaxKSplits = 8;  // portable cluster size

struct Q4Args {
  const uint8_t* weight;
  const float* input;
  float* output;
  int32_t n, m, k_blocks;
  int32_t blocks_per_split;  // a multiple of the tile's SB
  uint64_t row_bytes;        // weight row stride (k_blocks * 18)
  int32_t w_grain;           // bytes per weight copy: 16, 8, 4, 2 or 1
  int32_t x_grain;           // bytes per activation copy: 16 or 4
  int32_t rows_on_x;         // 1: grid.x walks row tiles (mat-vec); 0: grid.x walks token tiles
};

// Stores a CTA's T::kRows x T::kTokens output tile (q4_split_store.cuh: a K split is reduced in
// increasing split order through the cluster's shared memory).
template <class T, class ForEach>
__device__ __forceinline__ void store_tile(const Q4Args& a, uint8_t* smem, int row0, int tok0,
                                           int rows_valid, int toks_valid, ForEach for_each) {
  static_assert(T::kRows * T::kTokens * 4 <= T::kSmem);
  store_q4_tile<T::kRows, T::kTokens, T::kThreads, T::kRows>(a.output, a.n, smem, row0, tok0,
                                                             rows_valid, toks_valid, for_each);
}

// kVec: the weight view and row stride allow T::kWGrain-byte copies for every stage (the tail
// stage included) and the input is 16-byte aligned; else every copy takes the generic path.
template <class T, bool kVec>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) q4_kernel(const Q4Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row_tile = static_cast<int>(a.rows_on_x ? blockIdx.x : blockIdx.y);
  const int tok_tile = static_cast<int>(a.rows_on_x ? blockIdx.y : blockIdx.x);
  const int row0 = row_tile * T::kRows, tok0 = tok_tile * T::kTokens;
  const int rows_valid = min(T::kRows, a.n - row0);
  const int toks_valid = min(T::kTokens, a.m - tok0);
  const int kb_begin = static_cast<int>(blockIdx.z) * a.blocks_per_split;
  const int kb_end = min(a.k_blocks, kb_begin + a.blocks_per_split);
  const int stages = kb_end > kb_begin ? (kb_end - kb_begin + T::kSB - 1) / T::kSB : 0;

  uint8_t* const raw = smem;
  __nv_bfloat16* const sa = reinterpret_cast<__nv_bfloat16*>(smem + T::kStages * T::kRawStage);
  float* const sd = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(sa) + T::kA);
  __nv_bfloat16* const sb =
      reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<uint8_t*>(sd) + T::kD);
  __nv_bfloat16* const sbl = sb + T::kTokens * T::kLd;  // Split only

  // Edge tiles: rows past n and tokens past m are never loaded; zero the ring once so the values
  // converted from those rows are finite (their results are never stored).
  if (rows_valid < T::kRows || toks_valid < T::kTokens) {
    for (int i = tid * 16; i < T::kStages * T::kRawStage; i += T::kThreads * 16) {
      sts128(smem_addr(raw + i), 0, 0, 0, 0);
    }
    __syncthreads();
  }

  const uint64_t x_row_floats = uint64_t(a.k_blocks) * 32;
  const auto load_stage = [&](int stage) {
    const int kb0 = kb_begin + stage * T::kSB;
    const int nblk = min(T::kSB, kb_end - kb0);
    uint8_t* const w_dst = raw + (stage % T::kStages) * T::kRawStage;
    uint8_t* const x_dst = w_dst + T::kRawW;
    if constexpr (kVec) {
      const int w_units = nblk * 18 / T::kWGrain;  // per row, this stage
      const uint8_t* const w_src = a.weight + uint64_t(row0) * a.row_bytes + uint64_t(kb0) * 18;
#pragma unroll
      for (int j = 0; j < T::kWPerThread; ++j) {
        const int u = tid + j * T::kThreads;
        const int r = u / T::kWUnits, c = u % T::kWUnits;
        if (r < rows_valid && c < w_units) {
          copy_grain(w_dst + r * T::kRawRowBytes + c * T::kWGrain,
                     w_src + uint64_t(r) * a.row_bytes + c * T::kWGrain, T::kWGrain);
        }
      }
      const int x_units = nblk * 8;
      const uint8_t* const x_src = reinterpret_cast<const uint8_t*>(
          a.input + uint64_t(tok0) * x_row_floats + uint64_t(kb0) * 32);
#pragma unroll
      for (int j = 0; j < T::kXPerThread; ++j) {
        const int u = tid + j * T::kThreads;
        const int r = u / T::kXUnits, c = u % T::kXUnits;
        if (r < toks_valid && c < x_units) {
          cp_async_16(smem_addr(x_dst + r * T::kK * 4 + c * 16),
                      x_src + uint64_t(r) * x_row_floats * 4 + c * 16, true);
        }
      }
      return;
    }
    const int w_units = nblk * 18 / a.w_grain;
    const uint8_t* const w_src = a.weight + uint64_t(row0) * a.row_bytes + uint64_t(kb0) * 18;
    for (int u = tid; u < rows_valid * w_units; u += T::kThreads) {
      const int r = u / w_units, c = (u - r * w_units) * a.w_grain;
      copy_grain(w_dst + r * T::kRawRowBytes + c, w_src + uint64_t(r) * a.row_bytes + c, a.w_grain);
    }
    const int x_units = nblk * 128 / a.x_grain;
    const uint8_t* const x_src = reinterpret_cast<const uint8_t*>(
        a.input + uint64_t(tok0) * x_row_floats + uint64_t(kb0) * 32);
    for (int u = tid; u < toks_valid * x_units; u += T::kThreads) {
      const int r = u / x_units, c = (u - r * x_units) * a.x_grain;
      copy_grain(x_dst + r * T::kK * 4 + c, x_src + uint64_t(r) * x_row_floats * 4 + c, a.x_grain);
    }
  };

  // Raw stage -> bf16 operand tiles (and the split route's F32 scales).
  const auto convert_stage = [&](int stage) {
    const int nblk = min(T::kSB, kb_end - (kb_begin + stage * T::kSB));
    const uint8_t* const w_raw = raw + (stage % T::kStages) * T::kRawStage;
    const float* const x_raw = reinterpret_cast<const float*>(w_raw + T::kRawW);
    for (int u = tid; u < T::kRows * T::kSB; u += T::kThreads) {
      const int r = u / T::kSB, b = u % T::kSB;
      if (b >= nblk) continue;
      const uint8_t* const blk = w_raw + r * T::kRawRowBytes + b * 18;
      const uint16_t* const half_words = reinterpret_cast<const uint16_t*>(blk);
      const float d = __half2float(__ushort_as_half(half_words[0]));
      uint32_t lo[8], hi[8];
      if constexpr (T::kSplit) {
        sd[r * T::kSB + b] = d;
#pragma unroll
        for (int p = 0; p < 8; ++p) nibble_pairs(half_words[1 + p], lo[p], hi[p]);
      } else {
        const __nv_bfloat162 d2 = __floats2bfloat162_rn(d, d);
#pragma unroll
        for (int p = 0; p < 8; ++p) {
          nibble_pairs(half_words[1 + p], lo[p], hi[p]);
          lo[p] = scale_pair(lo[p], d2);
          hi[p] = scale_pair(hi[p], d2);
        }
      }
      const uint32_t dst = smem_addr(sa + r * T::kLd + b * 32);
      sts128(dst, lo[0], lo[1], lo[2], lo[3]);
      sts128(dst + 16, lo[4], lo[5], lo[6], lo[7]);
      sts128(dst + 32, hi[0], hi[1], hi[2], hi[3]);
      sts128(dst + 48, hi[4], hi[5], hi[6], hi[7]);
    }
    constexpr int kQuads = T::kK / 4;
    for (int u = tid; u < T::kTokens * kQuads; u += T::kThreads) {
      const int r = u / kQuads, c = (u % kQuads) * 4;
      if (c >= nblk * 32) continue;
      const float4 v = *reinterpret_cast<const float4*>(x_raw + r * T::kK + c);
      const __nv_bfloat162 h0 = __floats2bfloat162_rn(v.x, v.y),
                           h1 = __floats2bfloat162_rn(v.z, v.w);
      sts64(smem_addr(sb + r * T::kLd + c), bits_of(h0), bits_of(h1));
      if constexpr (T::kSplit) {
        const float2 f0 = __bfloat1622float2(h0), f1 = __bfloat1622float2(h1);
        sts64(smem_addr(sbl + r * T::kLd + c),
              bits_of(__floats2bfloat162_rn(v.x - f0.x, v.y - f0.y)),
              bits_of(__floats2bfloat162_rn(v.z - f1.x, v.w - f1.y)));
      }
    }
  };

  const int warp_row = (warp % T::kWR) * T::kMT * 16;
  const int warp_tok = (warp / T::kWR) * T::kNT * 8;
  float acc[T::kMT][T::kNT][4];
#pragma unroll
  for (int i = 0; i < T::kMT; ++i)
#pragma unroll
    for (int j = 0; j < T::kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const auto mma_stage = [&](int nblk) {
    for (int b = 0; b < nblk; ++b) {
      uint32_t af[T::kMT][2][4];
#pragma unroll
      for (int i = 0; i < T::kMT; ++i)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const __nv_bfloat16* p =
              sa + (warp_row + i * 16 + (lane & 15)) * T::kLd + b * 32 + s * 16 + (lane >> 4) * 8;
          ldmatrix_x4(smem_addr(p), af[i][s][0], af[i][s][1], af[i][s][2], af[i][s][3]);
        }
      uint32_t bh[T::kNT][4];
#pragma unroll
      for (int j = 0; j < T::kNT; ++j) {
        const int off = (warp_tok + j * 8 + (lane & 7)) * T::kLd + b * 32 + (lane >> 3) * 8;
        ldmatrix_x4(smem_addr(sb + off), bh[j][0], bh[j][1], bh[j][2], bh[j][3]);
      }
      if constexpr (T::kSplit) {
        uint32_t bl[T::kNT][4];
#pragma unroll
        for (int j = 0; j < T::kNT; ++j) {
          const int off = (warp_tok + j * 8 + (lane & 7)) * T::kLd + b * 32 + (lane >> 3) * 8;
          ldmatrix_x4(smem_addr(sbl + off), bl[j][0], bl[j][1], bl[j][2], bl[j][3]);
        }
#pragma unroll
        for (int i = 0; i < T::kMT; ++i) {
          const float d_top = sd[(warp_row + i * 16 + g) * T::kSB + b];
          const float d_bottom = sd[(warp_row + i * 16 + g + 8) * T::kSB + b];
#pragma unroll
          for (int j = 0; j < T::kNT; ++j) {
            float block_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_bf16_16816(block_sum, af[i][0], bh[j][0], bh[j][1]);
            mma_bf16_16816(block_sum, af[i][0], bl[j][0], bl[j][1]);
            mma_bf16_16816(block_sum, af[i][1], bh[j][2], bh[j][3]);
            mma_bf16_16816(block_sum, af[i][1], bl[j][2], bl[j][3]);
            acc[i][j][0] = fmaf(d_top, block_sum[0], acc[i][j][0]);
            acc[i][j][1] = fmaf(d_top, block_sum[1], acc[i][j][1]);
            acc[i][j][2] = fmaf(d_bottom, block_sum[2], acc[i][j][2]);
            acc[i][j][3] = fmaf(d_bottom, block_sum[3], acc[i][j][3]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < T::kMT; ++i)
#pragma unroll
          for (int j = 0; j < T::kNT; ++j) {
            mma_bf16_16816(acc[i][j], af[i][0], bh[j][0], bh[j][1]);
            mma_bf16_16816(acc[i][j], af[i][1], bh[j][2], bh[j][3]);
          }
      }
    }
  };

  // The ring: stage s is waited for, the stage STAGES-1 ahead is issued into the buffer stage s-1
  // used (free: every thread passed this iteration's first barrier after converting it), then s is
  // converted and multiplied. One commit per slot keeps the group count uniform.
#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < stages) load_stage(s);
    cp_async_commit();
  }
  for (int s = 0; s < stages; ++s) {
    cp_async_wait<T::kStages - 2>();
    __syncthreads();
    if (s + T::kStages - 1 < stages) load_stage(s + T::kStages - 1);
    cp_async_commit();
    convert_stage(s);
    __syncthreads();
    mma_stage(min(T::kSB, kb_end - (kb_begin + s * T::kSB)));
  }
  cp_async_wait_all();

  // acc[i][j][e] holds row warp_row + 16i + g (+8 for e >= 2), token warp_tok + 8j + 2t (+1 odd e).
  store_tile<T>(a, smem, row0, tok0, rows_valid, toks_valid, [&](auto&& store) {
#pragma unroll
    for (int i = 0; i < T::kMT; ++i)
#pragma unroll
      for (int j = 0; j < T::kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          store(warp_row + i * 16 + g + (e >= 2 ? 8 : 0), warp_tok + j * 8 + 2 * t + (e & 1),
                acc[i][j][e]);
  });
}

// The mat-vec (m <= 8), streamed per warp: warp w owns 16 weight rows (one MMA tile) of the CTA's 64
// and streams them over the CTA's K range through its own cp.async ring (kSB blocks = 144-byte row
// runs per stage, kStages deep), synchronising only with itself. Small tiles keep many warps per
// multiprocessor in flight: the kernel is bound by latency, not by issue. The activations of the K
// range are staged per chunk (the only CTA-wide barriers), already split into bf16 hi + lo and laid
// out in B-fragment order with token j's hi parts in MMA column 2j and its lo parts in column 2j + 1
// (q4_matvec_block.cuh) for m <= 4, so one MMA pair per block covers four tokens and a lane fetches
// its four B registers with one 16-byte shared load; for m > 4 eight tokens' hi parts and eight
// tokens' lo parts, four MMAs and two loads. Every warp of the CTA reuses them. Only the valid
// tokens are staged, so a chunk spans kX / (128 bytes * tokens) blocks: a single token's whole K
// range (up to 4096 values) in one go. Measured on the H200 (4096 x 14336): the column layout took
// m = 1 from 21.2 to 18.3 us and m = 4 from 23.3 to 21.0 us.
//
// K order inside one 32-value block (a dot product may pair A and B slots in any order, as long as
// both sides agree): the first MMA of a block takes the low nibbles (values 0..15), the second the
// high nibbles (16..31); lane t's k-slots 2t, 2t+1 hold values 4t, 4t+1 and slots 2t+8, 2t+9 values
// 4t+2, 4t+3 (+16 for the high MMA). So a lane's A registers for one row come from the 4 contiguous
// nibble bytes 4t..4t+3 and its B registers from the float4s x[4t..4t+3] and x[16+4t..16+4t+3].
// Numerics: the split numerics above (per block: the MMAs from zero, the hi and lo columns added,
// then one FMA with the block's scale).
// The ring depth, the activation chunk and the CTAs per SM are parameters so the lab
// (bench/lab/q4_matvec_lab.cu) can time other points; the library runs MatVecStream.
template <int kStagesPerWarp, int kXKiB, int kCtasPerSm>
struct MatVecStreamTile {
  static constexpr int kWarps = 4, kThreads = 128, kRows = 64, kTokens = 8;
  static constexpr int kWarpRows = 16;
  static constexpr int kSB = 8, kStages = kStagesPerWarp;
  static constexpr int kRowBytes = 18 * kSB;                // one row's run per stage
  static constexpr int kWGrain = 16;                        // copy size of the vector path
  static constexpr int kWarpStage = kWarpRows * kRowBytes;  // 2304 bytes
  static constexpr int kWarpRing = kStages * kWarpStage;
  static constexpr int kRing = kWarps * kWarpRing;
  // Staged activations: per token and block, the hi and lo 16-byte quads of its 4 lanes (128 bytes).
  static constexpr int kX = kXKiB * 1024;
  static constexpr int kXTokenBlockBytes = 2 * 4 * 16;
  static constexpr int kSmem = kX + kRing;
  static constexpr int kMinBlocks = kCtasPerSm;
  static_assert(kRowBytes % 16 == 0 && kWarpStage % 16 == 0 &&
                kX / (kTokens * kXTokenBlockBytes) % kSB == 0 && kThreads == 32 * kWarps &&
                kRows == kWarps * kWarpRows);
};
// 3 stages, 16 KB of activations: 43.5 KB, five CTAs per SM, so a launch of 8-CTA clusters with
// four CTAs per SM fits in one wave (the GPCs hold fewer clusters than multiprocessors / 8 * CTAs
// per SM).
using MatVecStream = MatVecStreamTile<3, 16, 5>;

// kVec: 16-byte weight copies for full stages (16-aligned view, K % 256 == 0) and 16-byte-aligned
// activations; else element-wise copies and loads. kColumns (m <= 4): the hi / lo column layout of
// matvec_split_columns_block, two MMAs per block; else eight tokens of hi and eight of lo columns,
// four MMAs per block.
template <class T, bool kVec, bool kColumns = false>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) q4_matvec_kernel(const Q4Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = static_cast<int>(blockIdx.x) * T::kRows;
  const int tok0 = static_cast<int>(blockIdx.y) * T::kTokens;
  const int toks_valid = min(T::kTokens, a.m - tok0);
  const int warp_row0 = row0 + warp * T::kWarpRows;
  const int warp_rows = max(0, min(T::kWarpRows, a.n - warp_row0));
  const int kb_begin = static_cast<int>(blockIdx.z) * a.blocks_per_split;
  const int kb_end = min(a.k_blocks, kb_begin + a.blocks_per_split);
  const int stages = kb_end > kb_begin ? (kb_end - kb_begin + T::kSB - 1) / T::kSB : 0;
  uint8_t* const xsplit = smem;
  uint8_t* const ring = smem + T::kX + warp * T::kWarpRing;

  if (warp_rows < T::kWarpRows) {  // rows past n are never loaded: keep what the MMA reads finite
    for (int i = lane * 16; i < T::kWarpRing; i += 32 * 16) sts128(smem_addr(ring + i), 0, 0, 0, 0);
    __syncwarp();
  }
  const uint8_t* const w_rows = a.weight + uint64_t(warp_row0) * a.row_bytes;
  const auto load_stage = [&](int stage) {
    const int kb0 = kb_begin + stage * T::kSB;
    const int nblk = min(T::kSB, kb_end - kb0);
    uint8_t* const dst = ring + (stage % T::kStages) * T::kWarpStage;
    const uint8_t* const src = w_rows + uint64_t(kb0) * 18;
    if (kVec && nblk == T::kSB) {
      constexpr int kUnits = T::kRowBytes / 16;  // 9 copies per row
#pragma unroll
      for (int j = 0; j < (T::kWarpRows * kUnits + 31) / 32; ++j) {
        const int u = lane + 32 * j;
        const int r = u / kUnits, c = u % kUnits;
        if (u < T::kWarpRows * kUnits && r < warp_rows) {
          cp_async_16(smem_addr(dst + r * T::kRowBytes + c * 16),
                      src + uint64_t(r) * a.row_bytes + c * 16, true);
        }
      }
    } else {
      const int units = nblk * 18 / a.w_grain;
      for (int u = lane; u < warp_rows * units; u += 32) {
        const int r = u / units, c = (u - r * units) * a.w_grain;
        copy_grain(dst + r * T::kRowBytes + c, src + uint64_t(r) * a.row_bytes + c, a.w_grain);
      }
    }
  };
  // Activations of blocks [kb0, kb0 + chunk_blocks) for the valid tokens, split and stored in
  // fragment order. kColumns: token j's hi quad of lane quarter t at cb * x_block_bytes + 16 (8 j +
  // t), its lo quad 64 bytes further, so lane L's quad sits at 16 L. Else: the hi quad of lane L
  // (token L / 4) at 16 L, its lo quad x_lo_offset further. Fragments of tokens past m are never
  // written or read.
  const int x_lo_offset = toks_valid * 4 * 16;
  const int x_block_bytes = 2 * x_lo_offset;
  const int chunk_blocks = T::kX / x_block_bytes / T::kSB * T::kSB;
  const uint64_t x_row_floats = uint64_t(a.k_blocks) * 32;
  const auto load_x_chunk = [&](int kb0) {
    const int lanes = toks_valid * 4;  // fragment lanes per block
    const int items = min(chunk_blocks, kb_end - kb0) * lanes;
    for (int item = tid; item < items; item += T::kThreads) {
      const int cb = item / lanes, frag_lane = item - cb * lanes;
      const int tg = frag_lane >> 2, tt = frag_lane & 3;
      const float* const src =
          a.input + uint64_t(tok0 + tg) * x_row_floats + uint64_t(kb0 + cb) * 32 + 4 * tt;
      float v[8];
      if constexpr (kVec) {
        const float4 low = *reinterpret_cast<const float4*>(src);
        const float4 high = *reinterpret_cast<const float4*>(src + 16);
        v[0] = low.x, v[1] = low.y, v[2] = low.z, v[3] = low.w;
        v[4] = high.x, v[5] = high.y, v[6] = high.z, v[7] = high.w;
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = src[i], v[4 + i] = src[16 + i];
      }
      uint32_t hi[4], lo[4];
      split_activation_pairs(v, hi, lo);
      uint8_t* const dst = xsplit + cb * x_block_bytes + (kColumns ? 8 * tg + tt : frag_lane) * 16;
      sts128(smem_addr(dst), hi[0], hi[1], hi[2], hi[3]);
      sts128(smem_addr(dst + (kColumns ? 64 : x_lo_offset)), lo[0], lo[1], lo[2], lo[3]);
    }
  };

  // Lanes of tokens past m read the fragments of a valid token instead of branching around the
  // loads: their MMA columns are never stored.
  const uint8_t* const x_lane = xsplit + min(lane, (kColumns ? 8 : 4) * toks_valid - 1) * 16;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // kColumns: acc[0] row g, acc[2] row g + 8

#pragma unroll
  for (int s = 0; s < T::kStages - 1; ++s) {
    if (s < stages) load_stage(s);
    cp_async_commit();
  }
  int chunk0 = kb_begin, next_chunk = kb_begin;
  for (int s = 0; s < stages; ++s) {
    const int kb0 = kb_begin + s * T::kSB;
    if (kb0 == next_chunk) {  // the same stages in every warp
      __syncthreads();        // the previous chunk is consumed
      load_x_chunk(kb0);
      chunk0 = kb0;
      next_chunk = kb0 + chunk_blocks;
      __syncthreads();
    }
    cp_async_wait<T::kStages - 2>();
    __syncwarp();
    if (s + T::kStages - 1 < stages) load_stage(s + T::kStages - 1);
    cp_async_commit();
    const int nblk = min(T::kSB, kb_end - kb0);
    // This lane's rows g and g + 8, at the nibble bytes 4t..4t+3 of block 0 of the stage.
    const uint8_t* const top = ring + (s % T::kStages) * T::kWarpStage + g * T::kRowBytes;
    const uint8_t* const bottom = top + 8 * T::kRowBytes;
    const uint8_t* const x_stage = x_lane + (kb0 - chunk0) * x_block_bytes;
    const auto block = [&](int b) {
      const uint8_t* const x = x_stage + b * x_block_bytes;
      if constexpr (kColumns) {
        matvec_split_columns_block(top, bottom, b, t, *reinterpret_cast<const uint4*>(x), acc[0],
                                   acc[2]);
      } else {
        matvec_split_block(top, bottom, b, t, *reinterpret_cast<const uint4*>(x),
                           *reinterpret_cast<const uint4*>(x + x_lo_offset), acc);
      }
    };
    if (nblk == T::kSB) {  // full stages without per-block bounds checks
#pragma unroll
      for (int b = 0; b < T::kSB; ++b) block(b);
    } else {
#pragma unroll
      for (int b = 0; b < T::kSB; ++b) {
        if (b >= nblk) break;
        block(b);
      }
    }
  }
  cp_async_wait_all();

  // kColumns: acc[0] / acc[2] hold rows warp_row0 + g / + 8, token tok0 + t. Else acc[e]: row
  // warp_row0 + g (+8 for e >= 2), token tok0 + 2t (+1 for odd e).
  store_tile<T>(a, smem, row0, tok0, min(T::kRows, a.n - row0), toks_valid, [&](auto&& store) {
    if constexpr (kColumns) {
      store(warp * T::kWarpRows + g, t, acc[0]);
      store(warp * T::kWarpRows + g + 8, t, acc[2]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        store(warp * T::kWarpRows + g + (e >= 2 ? 8 : 0), 2 * t + (e & 1), acc[e]);
    }
  });
}

// Largest copy size in {16, 8, 4, 2, 1} that divides the view's address, the row stride and every
// stage's byte count, so each copy is naturally aligned on both sides.
int weight_grain(const void* weight, uint64_t row_bytes, int sb, int k_blocks) {
  return copy_grain_for(weight, {row_bytes, uint64_t(18 * sb), uint64_t(k_blocks % sb) * 18});
}

struct Problem {
  const uint8_t* weight;
  const float* input;
  float* output;
  uint32_t m, n, k;
  uint64_t row_bytes;
};

Problem problem_of(const KernelLaunch& launch, size_t weight_slot, size_t input_slot,
                   size_t output_slot, uint64_t m, uint64_t n, uint64_t k, uint64_t row_bytes) {
  if (m == 0 || n == 0 || k == 0 || k % 32 != 0 || row_bytes != k / 32 * 18 || m > INT32_MAX ||
      n > INT32_MAX || k > INT32_MAX) {
    throw Error("'" + launch.label + "': malformed Q4_0 params");
  }
  Problem p{};
  p.m = static_cast<uint32_t>(m);
  p.n = static_cast<uint32_t>(n);
  p.k = static_cast<uint32_t>(k);
  p.row_bytes = row_bytes;
  p.weight = static_cast<const uint8_t*>(
      kernels::launch_arg(launch, weight_slot, "weight", n * row_bytes).data);
  p.input =
      static_cast<const float*>(kernels::launch_arg(launch, input_slot, "input", m * k * 4).data);
  p.output =
      static_cast<float*>(kernels::launch_arg(launch, output_slot, "output", m * n * 4).data);
  if (reinterpret_cast<uintptr_t>(p.input) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(p.output) % 4 != 0) {
    throw Error("'" + launch.label + "': input and output must be 4-byte aligned");
  }
  return p;
}

// The encoded launch must match the tiles of T: T::kThreads threads, one CTA per tile, and a K
// split of 1, 2, 4 or 8 along grid.z.
template <class T>
void check_launch_shape(const KernelLaunch& launch, const Problem& p, bool rows_on_x) {
  const uint64_t threads = launch.threads.x * launch.threads.y * launch.threads.z;
  if (threads != T::kThreads) {
    throw Error("'" + launch.label + "': launched with " + std::to_string(threads) +
                " threads, the kernel needs " + std::to_string(T::kThreads));
  }
  const uint64_t row_tiles = (p.n + T::kRows - 1) / T::kRows;
  const uint64_t token_tiles = (p.m + T::kTokens - 1) / T::kTokens;
  const uint64_t splits = launch.grid.z;
  if (launch.grid.x != (rows_on_x ? row_tiles : token_tiles) ||
      launch.grid.y != (rows_on_x ? token_tiles : row_tiles) || splits < 1 ||
      splits > kMaxKSplits || (splits & (splits - 1)) != 0) {
    throw Error("'" + launch.label + "': grid does not match the kernel's tiles");
  }
}

// Launches one Q4 kernel (T: its tile constants; kVec / kGeneric: its two instantiations) for `p`
// with the grid the front door encoded: checks that grid and block match the tiles, reserves the
// launched kernel's shared memory once per device, derives the copy sizes and the K split, and
// launches grid.z > 1 as clusters of grid.z CTAs. The vector instantiation runs when the weight view
// allows T::kWGrain-byte copies and the input 16-byte ones.
template <class T, auto kVec, auto kGeneric>
void launch_q4(const KernelLaunch& launch, void* stream, const Problem& p, bool rows_on_x) {
  check_launch_shape<T>(launch, p, rows_on_x);
  const uint64_t splits = launch.grid.z;
  Q4Args a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.n = static_cast<int32_t>(p.n);
  a.m = static_cast<int32_t>(p.m);
  a.k_blocks = static_cast<int32_t>(p.k / 32);
  const int per_split = static_cast<int>((uint64_t(a.k_blocks) + splits - 1) / splits);
  a.blocks_per_split = (per_split + T::kSB - 1) / T::kSB * T::kSB;
  a.row_bytes = p.row_bytes;
  a.w_grain = weight_grain(p.weight, p.row_bytes, T::kSB, a.k_blocks);
  a.x_grain = reinterpret_cast<uintptr_t>(p.input) % 16 == 0 ? 16 : 4;
  a.rows_on_x = rows_on_x ? 1 : 0;

  const bool use_vec = a.w_grain >= T::kWGrain && a.x_grain == 16;
  if (use_vec) {
    opt_in_dynamic_smem<kVec>(launch.label, T::kSmem, T::kSmem);
  } else {
    opt_in_dynamic_smem<kGeneric>(launch.label, T::kSmem, T::kSmem);
  }
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(launch.grid.y),
                  static_cast<unsigned>(splits));
  if (const cudaError_t e = launch_k_split(use_vec ? kVec : kGeneric, grid, T::kThreads, T::kSmem,
                                           static_cast<cudaStream_t>(stream), a);
      e != cudaSuccess) {
    throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
  }
}

void launch_mat_vec(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMvParams>(launch, 3);
  if (q.ne00 != q.ne10 || q.ne01 != q.ne0 || q.ne00 < 0 || q.ne01 < 0 || q.ne1 < 0) {
    throw Error("'" + launch.label + "': malformed Q4_0 mat-vec params");
  }
  const auto k = static_cast<uint64_t>(q.ne00);
  const Problem p = problem_of(launch, 0, 1, 2, static_cast<uint64_t>(q.ne1),
                               static_cast<uint64_t>(q.ne01), k, k / 32 * 18);
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess && q4_matvec_rows_eligible(device, p.m, p.k)) {
    check_launch_shape<MatVecStream>(launch, p, true);  // the recorded geometry is still checked
    launch_q4_matvec_rows(
        launch.label, static_cast<cudaStream_t>(stream),
        {.weight = p.weight, .input = p.input, .output = p.output, .m = p.m, .n = p.n, .k = p.k});
    return;
  }
  if (p.m <= 4) {  // hi / lo columns: two MMAs per block
    launch_q4<MatVecStream, q4_matvec_kernel<MatVecStream, true, true>,
              q4_matvec_kernel<MatVecStream, false, true>>(launch, stream, p, true);
  } else {
    launch_q4<MatVecStream, q4_matvec_kernel<MatVecStream, true, false>,
              q4_matvec_kernel<MatVecStream, false, false>>(launch, stream, p, true);
  }
}

template <class T>
void launch_matrix(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMmParams>(launch, 0);
  if (q.ne00 <= 0 || q.ne0 <= 0 || q.ne1 <= 0 || q.nb10 != 4 || q.nb11 != uint64_t(q.ne00) * 4) {
    throw Error("'" + launch.label + "': malformed Q4_0 matrix params");
  }
  const Problem p =
      problem_of(launch, 1, 2, 3, uint64_t(q.ne1), uint64_t(q.ne0), uint64_t(q.ne00), q.nb01);
  if constexpr (!T::kSplit) {  // the bf16 routes: the Hopper kernel where it applies
    int device = 0;
    if (cudaGetDevice(&device) == cudaSuccess && q4_wgmma_eligible(device, p.weight, p.k)) {
      check_launch_shape<T>(launch, p, false);
      const Q4WgmmaProblem h{.weight = p.weight,
                             .input = p.input,
                             .output = p.output,
                             .m = p.m,
                             .n = p.n,
                             .k = p.k,
                             .splits = static_cast<uint32_t>(launch.grid.z)};
      launch_q4_wgmma(launch.label, static_cast<cudaStream_t>(stream), h, T::kTokens);
      return;
    }
  }
  launch_q4<T, q4_kernel<T, true>, q4_kernel<T, false>>(launch, stream, p, false);
}

// `hopper`: the bf16 routes may launch q4_matmul_wgmma.cu's kernel on this device, so the
// definition reserves the larger of the two kernels' shared memory.
template <class T>
KernelDef q4_def(std::string_view name, KernelFn fn, bool rows_on_x, uint32_t k_split_max,
                 uint32_t target, bool hopper = false) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = T::kThreads;
  def.tile_x = rows_on_x ? T::kRows : T::kTokens;
  def.tile_y = rows_on_x ? T::kTokens : T::kRows;
  def.threadgroup_memory_bytes = T::kSmem;
  if (hopper) {
    def.threadgroup_memory_bytes =
        std::max<uint64_t>(def.threadgroup_memory_bytes, q4_wgmma_smem_bytes(T::kTokens));
  }
  def.k_split_max = k_split_max;
  def.k_split_target_groups = target;
  def.origin = "cuda_fatbin";
  def.content_sha256 = ROUTEMM_CUDA_Q4_MATMUL_SHA256;
  return def;
}

}  // namespace

void add_q4_matmul_kernels(std::vector<KernelDef>& out) {
  // K splits need thread-block clusters (sm_90+); the matrix routes aim at two groups per
  // multiprocessor.
  int sms = 0, major = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      sms <= 0) {
    (void)cudaGetLastError();
    sms = 132;
    major = 0;
  }
  const uint32_t splits = major >= 9 ? kMaxKSplits : 1;
  const auto target = static_cast<uint32_t>(2 * sms);
  const auto& names = kQ4MatmulPipelineNames;
  // The mat-vec is latency-bound: it aims at four of its small groups per multiprocessor.
  out.push_back(q4_def<MatVecStream>(names[0], &launch_mat_vec, true, splits, 2 * target));
  out.push_back(
      q4_def<SimdgroupTile>(names[1], &launch_matrix<SimdgroupTile>, false, splits, target));
  out.push_back(
      q4_def<TensorV1Tile>(names[2], &launch_matrix<TensorV1Tile>, false, splits, target));
  const bool hopper = hopper_kernels_available(0);
  out.push_back(
      q4_def<TensorV2Tile>(names[3], &launch_matrix<TensorV2Tile>, false, splits, target, hopper));
  out.push_back(q4_def<Tensor64x32Tile>(names[4], &launch_matrix<Tensor64x32Tile>, false, splits,
                                        target, hopper));
}

}  // namespace routemm::cuda
