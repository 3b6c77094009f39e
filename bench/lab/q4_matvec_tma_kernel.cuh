// EXPERIMENT (not part of the library): a TMA-fed Q4_0 mat-vec for Hopper, kept so the
// measurements in bench/lab/records/q4_0_matvec_tma-h200-2026-12-04.md can be reproduced
// with bench/lab/q4_matvec_tma_lab.cu. It has the library mat-vec's split numerics, fragment order
// and K-split reduction (q4_matmul.cu), so its outputs are bit-identical to that kernel's (checked on
// the H200 through the Q4 test suite while it was wired in), but it ran 20-25% slower there, so the
// library keeps the per-warp cp.async kernel.
//
// DESIGN: CTA-wide rings instead of per-warp ones. One thread issues a whole weight stage of the
// CTA (16 * kWarps rows x 144 bytes, one 2-D TMA box) and a stage of F32 activations (a 256 x tokens
// box); warp j < tokens converts token j's stage into bf16 hi / lo quads in fragment order in a
// split ring; every warp then multiplies its 16 rows per block with four mma.sync m16n8k16 (low /
// high nibbles x hi / lo activations) from zero and one FMA with the block's scale.
// Synchronisation: mbarriers only ("full": TMA bytes, or the CTA's arrivals after converting;
// "empty": one arrival per warp); thread 0 refills.
//   - weights: stage s = blocks [kb_begin + 8 s, +8) of the CTA's rows, w_stages deep; rows past n
//     arrive as zeros (TMA out-of-bounds fill).
//   - activations: raw and split rings of x_slots slots; tokens past m arrive as zeros.
//   - the K split: q4_split_store.cuh (one cluster along z, fixed split order).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "hopper_support.h"
#include "q4_matvec_block.cuh"
#include "q4_nibbles.cuh"
#include "q4_split_store.cuh"
#include "routemm/error.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"
#include "wgmma.cuh"

namespace routemm::cuda {
namespace {

constexpr int kTokens = 8;
static_assert(kTokens == 8, "one MMA column per token");
constexpr int kStageBlocks = 8;                    // Q4_0 blocks of K per stage
constexpr int kStageK = 32 * kStageBlocks;         // 256 values: one activation box row
constexpr int kStageRowBytes = 18 * kStageBlocks;  // 144 = 9 x 16: one weight box row
constexpr int kXTokenBytes = kStageK * 4;  // per token and stage: raw F32, or split hi + lo bf16
constexpr int kMaxWStages = 6;
constexpr int kAlignSlack = 128;  // the dynamic window is aligned up to 128 bytes for TMA

// A CTA shape: kWarps warps of 16 weight rows, sized for kCtasPerSm CTAs per multiprocessor
// (registers via __launch_bounds__, shared memory via kSmemPerCta: 228 KB per SM less the 1 KB the
// runtime reserves per CTA, shared out).
template <int kWarpsPerCta, int kCtasPerSm>
struct MvShape {
  static constexpr int kWarps = kWarpsPerCta, kThreads = 32 * kWarps, kRows = 16 * kWarps;
  static constexpr int kMinBlocks = kCtasPerSm;
  static constexpr int kWStageBytes = kRows * kStageRowBytes;
  static constexpr int kSmemPerCta = (228 * 1024 - kCtasPerSm * 1024) / kCtasPerSm;
  static constexpr int kPartialStride = kRows + 4;
  static_assert(kTokens * kPartialStride * 4 <= 2 * kWStageBytes, "partials reuse the ring");
};

// Shared-memory layout for a token box of `box_tokens` (1..8): the weight ring first (128-byte
// aligned stages), then the raw and the split activation rings (x_slots each), then the barriers.
struct MvLayout {
  int box_tokens, w_stages, x_slots, w_stage_bytes;
  __host__ __device__ int x_slot() const { return box_tokens * kXTokenBytes; }
  __host__ __device__ int raw_offset() const { return w_stages * w_stage_bytes; }
  __host__ __device__ int split_offset() const { return raw_offset() + x_slots * x_slot(); }
  __host__ __device__ int bar_offset() const { return split_offset() + x_slots * x_slot(); }
  __host__ __device__ int bars() const { return 2 * w_stages + 4 * x_slots; }
  __host__ __device__ int smem_bytes() const { return kAlignSlack + bar_offset() + 8 * bars(); }
};

// Three activation slots per ring for one or two tokens, two beyond; then the deepest weight ring
// (2..kMaxWStages stages) that fits the shape's share of shared memory.
template <class S>
MvLayout layout_for(int box_tokens) {
  MvLayout l{box_tokens, kMaxWStages, box_tokens <= 2 ? 3 : 2, S::kWStageBytes};
  while (l.w_stages > 2 && l.smem_bytes() > S::kSmemPerCta) --l.w_stages;
  return l;
}

struct Q4MatVecTmaProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks, 16-byte aligned
  const float* input;     // m x k, 16-byte aligned
  float* output;          // m x n
  uint32_t m, n, k;
  uint32_t splits;  // K split = cluster size along grid.z (1, 2, 4 or 8)
};

struct MvArgs {
  float* output;
  int32_t n, m, k_blocks, blocks_per_split;
  MvLayout layout;
};

template <class S>
__global__ void __launch_bounds__(S::kThreads, S::kMinBlocks)
    q4_matvec_tma_kernel(const __grid_constant__ CUtensorMap weight_map,
                         const __grid_constant__ CUtensorMap input_map, const MvArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kWarps = S::kWarps, kThreads = S::kThreads, kRows = S::kRows;
  constexpr int kWStageBytes = S::kWStageBytes;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_base + (kAlignSlack - 1)) & ~uint32_t(kAlignSlack - 1);
  unsigned char* const base_ptr = smem_raw + (base - raw_base);
  const MvLayout l = a.layout;
  const int w_stages = l.w_stages, x_slots = l.x_slots, x_slot = l.x_slot();
  const uint32_t bars = base + l.bar_offset();
  const auto w_full = [&](int i) { return bars + 8 * i; };
  const auto w_empty = [&](int i) { return bars + 8 * (w_stages + i); };
  const auto xr_full = [&](int i) { return bars + 8 * (2 * w_stages + i); };
  const auto xr_empty = [&](int i) { return bars + 8 * (2 * w_stages + x_slots + i); };
  const auto xs_full = [&](int i) { return bars + 8 * (2 * w_stages + 2 * x_slots + i); };
  const auto xs_empty = [&](int i) {
    return bars + 8 * (2 * w_stages + 2 * x_slots + x_slots + i);
  };

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = static_cast<int>(blockIdx.x) * kRows;
  const int tok0 = static_cast<int>(blockIdx.y) * kTokens;
  const int rows_valid = min(kRows, a.n - row0), toks_valid = min(kTokens, a.m - tok0);
  const int kb_begin = static_cast<int>(blockIdx.z) * a.blocks_per_split;
  // A whole number of stages: k % 256 == 0 and blocks_per_split % kStageBlocks == 0.
  const int stages =
      max(0, min(a.k_blocks, kb_begin + a.blocks_per_split) - kb_begin) / kStageBlocks;

  if (tid == 0) {
    for (int i = 0; i < w_stages; ++i) {
      sm90::mbar_init(w_full(i), 1);
      sm90::mbar_init(w_empty(i), kWarps);
    }
    for (int i = 0; i < x_slots; ++i) {
      sm90::mbar_init(xr_full(i), 1);
      sm90::mbar_init(xr_empty(i), kWarps);
    }
    for (int i = 0; i < x_slots; ++i) {
      sm90::mbar_init(xs_full(i), kThreads);
      sm90::mbar_init(xs_empty(i), kWarps);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();

  // Thread 0 only.
  const auto issue_weights = [&](int s) {
    const int pos = s % w_stages;
    sm90::mbar_arrive_expect_tx(w_full(pos), kWStageBytes);
    sm90::tma_load_2d(base + pos * kWStageBytes, &weight_map, w_full(pos),
                      (kb_begin + s * kStageBlocks) * 18 / 8, row0);
  };
  const auto issue_inputs = [&](int s) {
    const int pos = s % x_slots;
    sm90::mbar_arrive_expect_tx(xr_full(pos), x_slot);
    sm90::tma_load_2d(base + l.raw_offset() + pos * x_slot, &input_map, xr_full(pos),
                      kb_begin * 32 + s * kStageK, tok0);
  };
  if (tid == 0) {
    sm90::prefetch_tensor_map(&weight_map);
    sm90::prefetch_tensor_map(&input_map);
    // The activations of a stage before its weights: they are small and the conversion waits on them.
    for (int s = 0; s < max(w_stages, x_slots); ++s) {
      if (s < x_slots && s < stages) issue_inputs(s);
      if (s < w_stages && s < stages) issue_weights(s);
    }
  }

  // Stage s of the split ring: block b's hi quads at b * x_block + token * 64 + quad * 16, its lo
  // quads x_lo further (x_block = box_tokens * 128, x_lo = box_tokens * 64).
  const int x_block = l.box_tokens * 128, x_lo = l.box_tokens * 64;
  unsigned char* const split_ring = base_ptr + l.split_offset();
  const unsigned char* const raw_ring = base_ptr + l.raw_offset();
  // Warp j < toks_valid converts token j: lane = block * 4 + quad (the fragment lane's quarter).
  const auto convert = [&](int s) {
    const int raw_pos = s % x_slots, split_pos = s % x_slots;
    if (s >= x_slots) {  // every warp is done reading stage s - x_slots from this slot
      sm90::mbar_wait(xs_empty(split_pos), ((s - x_slots) / x_slots) & 1);
    }
    sm90::mbar_wait(xr_full(raw_pos), (s / x_slots) & 1);
    if (warp < toks_valid) {
      const int b = lane >> 2, q = lane & 3;
      const auto* const src = reinterpret_cast<const float*>(raw_ring + raw_pos * x_slot) +
                              warp * kStageK + b * 32 + 4 * q;
      const float4 low = *reinterpret_cast<const float4*>(src);
      const float4 high = *reinterpret_cast<const float4*>(src + 16);
      const float v[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
      uint32_t hi[4], lo[4];
      split_activation_pairs(v, hi, lo);
      unsigned char* const dst = split_ring + split_pos * x_slot + b * x_block + warp * 64 + q * 16;
      sts128(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), hi[0], hi[1], hi[2], hi[3]);
      sts128(static_cast<uint32_t>(__cvta_generic_to_shared(dst + x_lo)), lo[0], lo[1], lo[2],
             lo[3]);
    }
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(xr_empty(raw_pos));
    sm90::mbar_arrive(xs_full(split_pos));  // every thread: each releases its own stores
  };

  // Lanes of tokens past m read a valid token's fragments instead of branching around the loads:
  // their MMA columns are never stored.
  const int x_lane = min(g, max(toks_valid, 1) - 1) * 64 + t * 16;
  const unsigned char* const w_warp = base_ptr + (16 * warp + g) * kStageRowBytes;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};

  if (stages > 0) convert(0);
  for (int s = 0; s < stages; ++s) {
    if (s + 1 < stages) convert(s + 1);
    const int w_pos = s % w_stages, x_pos = s % x_slots;
    sm90::mbar_wait(xs_full(x_pos), (s / x_slots) & 1);
    sm90::mbar_wait(w_full(w_pos), (s / w_stages) & 1);
    const unsigned char* const top = w_warp + w_pos * kWStageBytes;
    const unsigned char* const bottom = top + 8 * kStageRowBytes;
    const unsigned char* const x_stage = split_ring + x_pos * x_slot + x_lane;
#pragma unroll
    for (int b = 0; b < kStageBlocks; ++b) {
      const uint4 bh = *reinterpret_cast<const uint4*>(x_stage + b * x_block);
      const uint4 bl = *reinterpret_cast<const uint4*>(x_stage + b * x_block + x_lo);
      matvec_split_block(top, bottom, b, t, bh, bl, acc);
    }
    __syncwarp();
    if (lane == 0) {
      sm90::mbar_arrive(w_empty(w_pos));
      sm90::mbar_arrive(xs_empty(x_pos));
    }
    if (tid == 0) {
      // Refill the weight stage every warp finished `lag` iterations ago (one with a ring of three
      // or more, so thread 0 rarely waits for the slowest warp; none with two, where a lag would
      // leave no stage in flight), and the raw activation slot every warp converted one iteration
      // ago (stage s, converted during iteration s - 1).
      const int lag = w_stages >= 3 ? 1 : 0;
      if (s >= lag && s - lag + w_stages < stages) {
        sm90::mbar_wait(w_empty((s - lag) % w_stages), ((s - lag) / w_stages) & 1);
        issue_weights(s - lag + w_stages);
      }
      if (s + x_slots < stages) {
        sm90::mbar_wait(xr_empty(s % x_slots), (s / x_slots) & 1);
        issue_inputs(s + x_slots);
      }
    }
  }

  // acc[e]: tile row 16 warp + g (+8 for e >= 2), tile token 2t + (e & 1).
  const auto for_each = [&](auto&& visit) {
#pragma unroll
    for (int e = 0; e < 4; ++e) visit(16 * warp + g + (e >= 2 ? 8 : 0), 2 * t + (e & 1), acc[e]);
  };
  store_q4_tile<kRows, kTokens, kThreads, S::kPartialStride>(a.output, a.n, base_ptr, row0, tok0,
                                                             rows_valid, toks_valid, for_each);
#else
  __trap();  // launched only where the sm_90a image exists (q4_matvec_tma_eligible)
#endif
}

template <class S>
uint64_t smem_bytes_of() {
  int most = 0;
  for (int tokens = 1; tokens <= kTokens; ++tokens) {
    most = std::max(most, layout_for<S>(tokens).smem_bytes());
  }
  return static_cast<uint64_t>(most);
}

template <class S>
void launch_shape(const std::string& label, cudaStream_t stream, const Q4MatVecTmaProblem& p) {
  constexpr auto kernel = &q4_matvec_tma_kernel<S>;
  const int box_tokens = static_cast<int>(std::min<uint32_t>(p.m, kTokens));
  const MvLayout layout = layout_for<S>(box_tokens);
  opt_in_dynamic_smem<kernel>(label, static_cast<uint64_t>(layout.smem_bytes()),
                              smem_bytes_of<S>());
  const uint64_t row_bytes = uint64_t{p.k} / 32 * 18;
  // The blocks as 8-byte elements (row_bytes % 16 == 0 keeps rows whole), as the Q4_0 wgmma kernel.
  const CUtensorMap weight_map = encode_tensor_map_2d(
      label, "weights", CU_TENSOR_MAP_DATA_TYPE_UINT64, const_cast<uint8_t*>(p.weight),
      row_bytes / 8, p.n, row_bytes, kStageRowBytes / 8, S::kRows, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap input_map = encode_tensor_map_2d(
      label, "activations", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, const_cast<float*>(p.input), p.k, p.m,
      uint64_t{p.k} * 4, kStageK, static_cast<uint32_t>(box_tokens), CU_TENSOR_MAP_SWIZZLE_NONE);
  MvArgs a{};
  a.output = p.output;
  a.n = static_cast<int32_t>(p.n);
  a.m = static_cast<int32_t>(p.m);
  a.k_blocks = static_cast<int32_t>(p.k / 32);
  const int per_split = (a.k_blocks + static_cast<int>(p.splits) - 1) / static_cast<int>(p.splits);
  a.blocks_per_split = (per_split + kStageBlocks - 1) / kStageBlocks * kStageBlocks;
  a.layout = layout;

  const dim3 grid((p.n + S::kRows - 1) / S::kRows, (p.m + kTokens - 1) / kTokens, p.splits);
  if (const cudaError_t e =
          launch_k_split(kernel, grid, S::kThreads, static_cast<size_t>(layout.smem_bytes()),
                         stream, weight_map, input_map, a);
      e != cudaSuccess) {
    throw Error("'" + label + "': launch failed: " + cudaGetErrorString(e));
  }
}

}  // namespace
}  // namespace routemm::cuda
