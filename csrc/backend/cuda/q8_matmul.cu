// CUDA kernels of the GGML Q8_0 dense projections (csrc/ops/q4_matmul.cpp owns validation, routing
// and geometry): the mat-vec kernel_mul_mv_q8_0_f32 (m <= 8) and the matrix route
// kernel_mul_mm_q8_0_f32 (m > 8, compatibility_simdgroup), one streamed kernel on the CUDA cores
// (no tensor cores) with a token tile of up to 8.
//
// NUMERICS (both pipelines; exact F32, like the CPU routes, in an order of its own): every weight is
// dequantised exactly, d * q with d the block's f16 scale widened to F32 (ggml_blocks.cuh). An
// output's K range is cut in two halves at a multiple of 8 blocks (the first half holds
// ceil(K / 64) blocks rounded up to a multiple of 8, or all of them); in each half eight lanes
// accumulate from +0.0f, lane j taking values 4j .. 4j+3 of every block of the half, blocks in
// increasing order, one binary32 FMA per value. The eight lanes are summed in the fixed tree
// ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)) (ggml::sum8) and the two halves added. Each chain holds at
// most ceil(K / 8) FMAs and the reduction adds 4, so |result - exact| <= gamma_(K/8 + 4) *
// sum|w x| (+ subnormal terms): the CPU's bound (tests/python/tolerances.py, accumulation_bound).
// The order depends on K alone -- not on m, the route, the token tile or the copy path -- so the
// mat-vec and the matrix route are bit-identical to each other; they differ from the CPU oracle,
// whose lanes take positions l, l + 8, ..., in the last bits only.
//
// DATA PATH: a CTA of 4 warps owns 8 weight rows; warp w owns rows 2w, 2w + 1, and its 32 lanes
// are 4 segments (row, K half) x 8 lanes. Each warp streams its 4 segments through its own
// cp.async ring (kStages stages of kStageBlocks blocks per segment), synchronising only with
// itself: a stage is 4 runs of 544 contiguous bytes, copied as 16-byte units by consecutive lanes
// (coalesced). A Q8_0 block is 34 bytes, so blocks are not 16-byte aligned, but 8 blocks are 272 =
// 17 x 16 bytes: with K % 256 == 0 and a 16-byte aligned view every row, half and stage starts on
// a 16-byte boundary and the vector path copies 16 bytes at a time. Otherwise (a view at any byte,
// K with a tail of fewer than 8 blocks) every copy takes the widest size that divides the view's
// address, the row stride and the tail (ggml_copy.cuh), into the same shared layout. Lanes then
// read their 4 bytes of each block and the block's scale from shared memory (a block pair is 68
// bytes, so odd blocks' quads are word-aligned and even blocks' straddle two words) and the
// activations straight from global memory (16-byte loads of the lane's 4 values when the input is
// 16-byte aligned; the 8 lanes of a segment read 128 contiguous bytes).
//
// GEOMETRY (KernelDef below; tile_x / tile_y as the front door reads them):
//   kernel_mul_mv_q8_0_f32   grid [ceil(n / 8), ceil(m / 8), 1]: 8 rows x 8 tokens, 128 threads
//   kernel_mul_mm_q8_0_f32   grid [ceil(m / 8), ceil(n / 8), 1]: 8 tokens x 8 rows, 128 threads
// grid.y beyond 65535 is folded into the kernel's loop over y tiles. threadgroup memory = the four
// warps' rings (34816 bytes).
//
// COST (4096 x 14336, m = 1): 62,390,272 weight bytes (4096 rows x 448 blocks x 34) plus 57 KB of
// activations: the copy floor at 4.17 TB/s is 15.0 us, and the kernel is meant to stay within 1.25x
// of it (~19 us). Decoding costs a byte permute, an add and a multiply per weight value before its
// FMA (~10 us of issue over the whole GPU at m = 1), which the 16 warps per multiprocessor (4096
// rows) and three stages in flight per warp (6.5 KB) are sized to hide under the stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/q4_0_block.h"
#include "ggml_blocks.cuh"
#include "ggml_copy.cuh"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/q4_matmul.h"
#include "warp_mma.cuh"

#ifndef ROUTEMM_CUDA_Q8_MATMUL_SHA256
#define ROUTEMM_CUDA_Q8_MATMUL_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

constexpr int kBlockBytes = static_cast<int>(kernels::kQ8_0BlockBytes);  // 34
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 2;
constexpr int kRows = kWarps * kRowsPerWarp;  // weight rows per CTA
constexpr int kTokens = 8;                    // token tile of both pipelines
constexpr int kSegments = 4;                  // (row, K half) segments per warp
constexpr int kLanesPerSegment = 8;
constexpr int kHalfAlignBlocks = 8;  // 8 blocks = 272 bytes = 17 x 16: the halves stay aligned
constexpr int kStageBlocks = 16;     // blocks per segment per stage
constexpr int kStages = 4;           // ring depth (kStages - 1 stages in flight)
constexpr int kSegmentStageBytes = kStageBlocks * kBlockBytes;  // 544
constexpr int kStageBytes = kSegments * kSegmentStageBytes;     // 2176
constexpr int kWarpRing = kStages * kStageBytes;                // 8704
constexpr int kSmem = kWarps * kWarpRing;                       // 34816
constexpr uint32_t kMaxGridY = 65535;
static_assert(kSegments * kLanesPerSegment == 32 && kSegments == 2 * kRowsPerWarp);
static_assert(kSegmentStageBytes % 16 == 0 && kHalfAlignBlocks * kBlockBytes % 16 == 0 &&
              kStageBlocks % kHalfAlignBlocks == 0 && kStageBlocks % 2 == 0);
static_assert(kSmem <= 48 * 1024, "no shared-memory opt-in needed");

struct Q8Args {
  const uint8_t* weight;
  const float* input;
  float* output;
  uint32_t m, n, k_blocks;
  uint32_t half_blocks;  // blocks of the first K half: a multiple of 8, possibly >= k_blocks
  uint64_t row_bytes;    // k_blocks * 34
  uint32_t row_tiles, token_tiles;
  int32_t w_grain;    // bytes per weight copy on the generic path: 16, 8, 4, 2 or 1
  int32_t rows_on_x;  // 1: grid.x walks row tiles (mat-vec); 0: grid.x walks token tiles
};

// Blocks of `segment`'s K half; the rows of a segment past n have none.
struct Segment {
  uint32_t row;
  uint32_t kb_begin, kb_end;
};

__device__ __forceinline__ Segment segment_of(const Q8Args& a, uint32_t row0, int warp,
                                              int segment) {
  Segment s;
  s.row = row0 + warp * kRowsPerWarp + segment / 2;
  const uint32_t split = min(a.half_blocks, a.k_blocks);
  s.kb_begin = (segment & 1) ? split : 0;
  s.kb_end = s.row < a.n ? ((segment & 1) ? a.k_blocks : split) : s.kb_begin;
  return s;
}

// Blocks of stage `stage` for a segment (0 once its half is done).
__device__ __forceinline__ int stage_blocks(const Segment& s, int stage) {
  const uint32_t kb0 = s.kb_begin + uint32_t(stage) * kStageBlocks;
  return kb0 < s.kb_end ? static_cast<int>(min(uint32_t(kStageBlocks), s.kb_end - kb0)) : 0;
}

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// acc[t] += the lane's quad (4 values of one block, signed bytes of `word`, scale d) times the
// token's activations x[t][0..3], value by value in increasing order.
template <int T, bool kVec>
__device__ __forceinline__ void accumulate_quad(uint32_t word, float d, const float* const (&x)[T],
                                                uint32_t offset, float (&acc)[T]) {
  const uint32_t flipped = word ^ 0x80808080u;
  float w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __fmul_rn(d, ggml::int8_value(flipped, i));
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float v[4];
    if constexpr (kVec) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(x[t] + offset));
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = __ldg(x[t] + offset + i);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t] = __fmaf_rn(w[i], v[i], acc[t]);
  }
}

// T: tokens computed per pass (1, 2, 4 or 8; tokens of the tile past m repeat its last valid
// token and are never stored). kVec: 16-byte weight copies and activation loads (see the top).
// Four CTAs (16 warps) per multiprocessor, three for eight tokens, whose accumulators and
// activation loads need more than 128 registers.
template <int T, bool kVec>
__global__ void __launch_bounds__(kThreads, T == 8 ? 3 : 4) q8_kernel(const Q8Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int own = lane / kLanesPerSegment, j = lane % kLanesPerSegment;
  uint8_t* const ring = smem + warp * kWarpRing;
  const uint32_t y_tiles = a.rows_on_x ? a.token_tiles : a.row_tiles;

  for (uint32_t y = blockIdx.y; y < y_tiles; y += gridDim.y) {
    const uint32_t row0 = (a.rows_on_x ? blockIdx.x : y) * kRows;
    const uint32_t tok0 = (a.rows_on_x ? y : blockIdx.x) * kTokens;
    const Segment mine = segment_of(a, row0, warp, own);
    // Half 0 is the longer one, so its stage count is the warp's.
    const uint32_t first_half = min(a.half_blocks, a.k_blocks);
    const int stages = static_cast<int>((first_half + kStageBlocks - 1) / kStageBlocks);

    const auto load_stage = [&](int stage) {
      uint8_t* const dst = ring + (stage % kStages) * kStageBytes;
#pragma unroll
      for (int s = 0; s < kSegments; ++s) {
        const Segment seg = segment_of(a, row0, warp, s);
        const int nblk = stage_blocks(seg, stage);
        if (nblk == 0) continue;  // a finished half or a row past n: no address is formed
        const uint8_t* const src =
            a.weight + uint64_t(seg.row) * a.row_bytes +
            (uint64_t(seg.kb_begin) + uint64_t(stage) * kStageBlocks) * kBlockBytes;
        uint8_t* const seg_dst = dst + s * kSegmentStageBytes;
        if constexpr (kVec) {  // nblk is a multiple of 8 here: whole 16-byte units
          const int units = nblk * kBlockBytes / 16;
          for (int u = lane; u < units; u += 32)
            cp_async_16(smem_addr(seg_dst + 16 * u), src + 16 * u, true);
        } else {
          const int units = nblk * kBlockBytes / a.w_grain;
          for (int u = lane; u < units; u += 32) {
            copy_grain(seg_dst + u * a.w_grain, src + u * a.w_grain, a.w_grain);
          }
        }
      }
    };

    const uint64_t x_row = uint64_t(a.k_blocks) * 32;
    const uint32_t toks = min(uint32_t(kTokens), a.m - tok0);
    const float* x[T];
#pragma unroll
    for (int t = 0; t < T; ++t)
      x[t] = a.input + uint64_t(tok0 + min(uint32_t(t), toks - 1)) * x_row;
    float acc[T];
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t] = 0.0f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < stages) load_stage(s);
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<kStages - 2>();
      __syncwarp();  // every lane's copies of stage s landed; every lane is done with stage s - 1
      if (s + kStages - 1 < stages) load_stage(s + kStages - 1);
      cp_async_commit();
      const int nblk = stage_blocks(mine, s);
      const uint8_t* const st = ring + (s % kStages) * kStageBytes + own * kSegmentStageBytes;
      // Value offset of the stage's first block for this lane's quad.
      const uint32_t base = (mine.kb_begin + uint32_t(s) * kStageBlocks) * 32 + 4 * j;
      // Block 2p of the stage (scale at pair bytes 0-1, the quad at 2 + 4j, straddling two words)
      // and block 2p + 1 (scale at 34-35, the quad at 36 + 4j, word-aligned); pairs are 68 bytes,
      // so every pair starts 4-byte aligned.
      const auto even_block = [&](int p) {
        const uint8_t* const pair = st + 68 * p;
        const uint32_t quad = __byte_perm(lds32(pair + 4 * j), lds32(pair + 4 * j + 4), 0x5432);
        accumulate_quad<T, kVec>(quad, ggml::block_scale(pair), x, base + 64 * p, acc);
      };
      const auto odd_block = [&](int p) {
        const uint8_t* const pair = st + 68 * p;
        accumulate_quad<T, kVec>(lds32(pair + 36 + 4 * j), ggml::block_scale(pair + 34), x,
                                 base + 64 * p + 32, acc);
      };
      if (nblk == kStageBlocks) {  // full stages without per-block bounds checks
        // Two pairs in flight for one or two tokens; more tokens bring enough loads per pair.
        constexpr int kUnroll = T <= 2 ? 2 : 1;
#pragma unroll kUnroll
        for (int p = 0; p < kStageBlocks / 2; ++p) even_block(p), odd_block(p);
      } else {
        for (int p = 0; 2 * p < nblk; ++p) {
          even_block(p);
          if (2 * p + 1 < nblk) odd_block(p);
        }
      }
    }
    cp_async_wait_all();
    __syncwarp();  // the ring is free for the next y tile

    const uint32_t row = mine.row;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float half_sum = ggml::sum8(acc[t]);
      const float sum = __fadd_rn(half_sum, __shfl_xor_sync(0xffffffffu, half_sum, 8));
      if ((lane & 15) == 0 && row < a.n && uint32_t(t) < toks) {
        a.output[uint64_t(tok0 + t) * a.n + row] = sum;
      }
    }
  }
}

struct Problem {
  const uint8_t* weight;
  const float* input;
  float* output;
  uint64_t m, n, k;
};

Problem problem_of(const KernelLaunch& launch, size_t weight_slot, size_t input_slot,
                   size_t output_slot, uint64_t m, uint64_t n, uint64_t k) {
  if (m == 0 || n == 0 || k == 0 || k % 32 != 0 || m > INT32_MAX || n > INT32_MAX ||
      k > INT32_MAX) {
    throw Error("'" + launch.label + "': malformed Q8_0 params");
  }
  const uint64_t row_bytes = k / 32 * kBlockBytes;
  Problem p{};
  p.m = m;
  p.n = n;
  p.k = k;
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

template <int T>
void launch_tokens(const Q8Args& a, bool vec, dim3 grid, cudaStream_t stream) {
  if (vec) {
    q8_kernel<T, true><<<grid, kThreads, kSmem, stream>>>(a);
  } else {
    q8_kernel<T, false><<<grid, kThreads, kSmem, stream>>>(a);
  }
}

// Checks the encoded launch against the tiles (128 threads; grid [row tiles, token tiles, 1] for
// the mat-vec, [token tiles, row tiles, 1] for the matrix route), then launches with the smallest
// token count per pass that covers m (the mat-vec for m < 8) -- the order of every output's sum is
// the same whatever the count.
void launch_q8(const KernelLaunch& launch, void* stream, const Problem& p, bool rows_on_x) {
  const uint64_t threads = launch.threads.x * launch.threads.y * launch.threads.z;
  if (threads != kThreads) {
    throw Error("'" + launch.label + "': launched with " + std::to_string(threads) +
                " threads, the kernel needs " + std::to_string(kThreads));
  }
  const uint64_t row_tiles = (p.n + kRows - 1) / kRows;
  const uint64_t token_tiles = (p.m + kTokens - 1) / kTokens;
  if (launch.grid.x != (rows_on_x ? row_tiles : token_tiles) ||
      launch.grid.y != (rows_on_x ? token_tiles : row_tiles) || launch.grid.z != 1) {
    throw Error("'" + launch.label + "': grid does not match the kernel's tiles");
  }
  Q8Args a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.m = static_cast<uint32_t>(p.m);
  a.n = static_cast<uint32_t>(p.n);
  a.k_blocks = static_cast<uint32_t>(p.k / 32);
  const uint32_t half = (a.k_blocks + 1) / 2;
  a.half_blocks = (half + kHalfAlignBlocks - 1) / kHalfAlignBlocks * kHalfAlignBlocks;
  a.row_bytes = uint64_t(a.k_blocks) * kBlockBytes;
  a.row_tiles = static_cast<uint32_t>(row_tiles);
  a.token_tiles = static_cast<uint32_t>(token_tiles);
  // Every copy starts at a row start plus a multiple of 8 blocks (272 bytes) and spans whole
  // stages or the row's tail of k_blocks % 8 blocks beyond such a multiple.
  a.w_grain = copy_grain_for(p.weight,
                             {a.row_bytes, uint64_t(a.k_blocks % kHalfAlignBlocks) * kBlockBytes});
  a.rows_on_x = rows_on_x ? 1 : 0;
  const bool vec = a.w_grain == 16 && reinterpret_cast<uintptr_t>(p.input) % 16 == 0;
  const uint64_t y_tiles = rows_on_x ? token_tiles : row_tiles;
  const dim3 grid(static_cast<unsigned>(launch.grid.x),
                  static_cast<unsigned>(std::min<uint64_t>(y_tiles, kMaxGridY)), 1);
  const auto s = static_cast<cudaStream_t>(stream);
  if (p.m == 1) {
    launch_tokens<1>(a, vec, grid, s);
  } else if (p.m == 2) {
    launch_tokens<2>(a, vec, grid, s);
  } else if (p.m <= 4) {
    launch_tokens<4>(a, vec, grid, s);
  } else {
    launch_tokens<8>(a, vec, grid, s);
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
  }
}

void launch_mat_vec(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMvParams>(launch, 3);
  if (q.ne00 != q.ne10 || q.ne01 != q.ne0 || q.ne00 <= 0 || q.ne01 <= 0 || q.ne1 <= 0) {
    throw Error("'" + launch.label + "': malformed Q8_0 mat-vec params");
  }
  const Problem p = problem_of(launch, 0, 1, 2, static_cast<uint64_t>(q.ne1),
                               static_cast<uint64_t>(q.ne01), static_cast<uint64_t>(q.ne00));
  launch_q8(launch, stream, p, true);
}

void launch_matrix(const KernelLaunch& launch, void* stream) {
  const auto q = kernels::launch_params<kernels::GgmlMatmulMmParams>(launch, 0);
  if (q.ne00 <= 0 || q.ne0 <= 0 || q.ne1 <= 0 || q.nb10 != 4 || q.nb11 != uint64_t(q.ne00) * 4 ||
      q.nb01 != uint64_t(q.ne00) / 32 * kBlockBytes) {
    throw Error("'" + launch.label + "': malformed Q8_0 matrix params");
  }
  const Problem p = problem_of(launch, 1, 2, 3, uint64_t(q.ne1), uint64_t(q.ne0), uint64_t(q.ne00));
  launch_q8(launch, stream, p, false);
}

KernelDef q8_def(std::string_view name, KernelFn fn, bool rows_on_x) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = kThreads;
  def.tile_x = rows_on_x ? kRows : kTokens;
  def.tile_y = rows_on_x ? kTokens : kRows;
  def.threadgroup_memory_bytes = kSmem;
  def.origin = "cuda_fatbin";
  def.content_sha256 = ROUTEMM_CUDA_Q8_MATMUL_SHA256;
  return def;
}

}  // namespace

void add_q8_matmul_kernels(std::vector<KernelDef>& out) {
  const auto& names = kQ8MatmulPipelineNames;
  out.push_back(q8_def(names[0], &launch_mat_vec, true));
  out.push_back(q8_def(names[1], &launch_matrix, false));
}

}  // namespace routemm::cuda
