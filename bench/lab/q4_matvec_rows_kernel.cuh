// EXPERIMENT (not in the library; bench/lab/records/q4_0_matvec_rows-h200-2026-12-04.md): a
// one-token Q4_0 mat-vec on Hopper (m == 1, k <= 15360), timed by bench/lab/q4_matvec_rows_lab.cu.
// It was wired in as the library's m = 1 mat-vec at cdc9131..ebfda09 and lost to the tensor-core
// mat-vec on every measured shape, so it lives here. A decode step's projection streams
// n * k * 18 / 32 bytes of weights once and does 2 FLOPs per weight, so this kernel is built around
// the weight stream: whole rows, one bulk copy per stage, and F32 FMAs on the CUDA cores instead of
// tensor-core MMAs (with one token, seven of an MMA's eight columns would be padding, and the
// per-block MMA chain was what bounded the tensor-core kernel at m = 1; see
// bench/lab/records/q4_0_matvec-h200-2026-12-03.md and the 2026-12-04 notes beside it).
//
// WORK SPLIT. A lane owns one block of K (32 values) and keeps the token's 32 activations of that
// block in registers for the whole kernel. A warp spans 32 blocks (1024 values of K), so
// KC = ceil(k / 1024) <= 15 "chunk" warps cover K, and a CTA holds G = max(1, 15 / KC) groups of
// them (consumers = KC * G warps, 64 registers each: two CTAs per multiprocessor) plus one producer
// warp. The CTA walks a contiguous range of weight rows in stages of R rows (R a multiple of G, about
// 16 KB per stage); within a stage group j takes rows j, j + G, ..., two rows at a time.
//
// DATA PATH. Stages land in a ring of up to 4 slots in shared memory, rows `stride` bytes apart
// (row_bytes rounded up to 16). When the weight view is 16-byte aligned and k % 256 == 0 (row_bytes
// % 16 == 0, so stride == row_bytes and a stage is one contiguous run of the matrix) the producer's
// lane 0 issues one cp.async.bulk per stage, completing the slot's "full" mbarrier by its bytes.
// Otherwise the producer warp copies the stage with 4-, 2- or 1-byte loads and stores (the widest
// the view allows) and each lane arrives on "full". Consumer warps hand a slot back through its
// "empty" mbarrier (one arrival per warp). Both paths produce the same shared-memory image, so the
// same bits.
//
// NUMERICS (tested within the mat-vec's split bound, tests/python/tolerances.py; no rounding of the
// weights or the activations): a nibble q becomes the exact F32 (q - 8) by building the float
// 2^23 + q with one byte permute and subtracting 2^23 + 8 (a high nibble is used in place, as 16 q,
// and scaled back by 1/16 once per block). Per block, the low and the high 16 products are each
// summed in F32 by FMAs in increasing K order from zero; the block's value is
// d * fma(hi, 1/16, lo) with d the block's F32 scale. A row's 32 block values of one warp are added
// lanes l + (l + 16) first, then by a butterfly (xor 8, 4, 2, 1), and the chunk warps' sums in
// increasing chunk order. The order depends on k only, never on the views' alignment.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "q4_lab_common.cuh"
#include "wgmma.cuh"

namespace q4_rows_lab {
namespace sm90 = routemm::cuda::sm90;

struct Q4MatVecRowsProblem {
  const uint8_t* weight;  // n rows of k / 32 GGUF Q4_0 blocks, rows k / 32 * 18 bytes apart
  const float* input;     // one token: k values, 4-byte aligned
  float* output;          // n values
  uint32_t n, k;
};

constexpr uint32_t kMaxConsumerWarps = 15;
constexpr uint32_t kMaxThreads = 32 * (kMaxConsumerWarps + 1);
constexpr uint32_t kBlocksPerWarp = 32;
constexpr uint32_t kRingSlots =
    8;  // barrier pairs reserved; a launch uses RowsTuning::ring of them
constexpr uint32_t kBarrierBytes = 2 * kRingSlots * 8;
constexpr uint32_t kTailSlackBytes = 32;

struct RowsArgs {
  const uint8_t* weight;
  const float* input;
  float* output;
  uint32_t n, k_blocks;
  uint32_t row_bytes, stride;  // global and shared-memory row strides
  uint32_t chunk_warps, groups, stage_rows, stages_total, stages_per_cta, ring;
  uint32_t ring_offset;  // bytes from the start of shared memory (after barriers and partials)
  uint32_t bulk;         // 1: one cp.async.bulk per stage; 0: the producer warp's copies
  uint32_t grain;        // bytes per copy of the second path: 4, 2 or 1
  uint32_t x_vec;        // 1: the input is 16-byte aligned (float4 loads)
  // 0x4B000000, the bits of 2^23, passed at run time: the compiler keeps it in a register, so each
  // byte permute takes its selector as the immediate (a compile-time constant here would take the
  // immediate slot and push every selector into a register rebuilt before its permute).
  uint32_t exponent_2_23;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One row's block for this lane: `window` is the 4-byte-aligned run of 20 bytes holding it (an even
// block starts at its first byte, an odd one 2 bytes in), `x` the block's 32 values. `shift` (16 for
// an even block, 32 for an odd one) aligns the 16 nibble bytes, `d_shift` (0 / 16) picks the scale.
__device__ __forceinline__ float block_row_sum(const uint8_t* window, const float (&x)[32],
                                               uint32_t shift, uint32_t d_shift,
                                               uint32_t exponent) {
  const auto* words = reinterpret_cast<const uint32_t*>(window);
  uint32_t w[5];
#pragma unroll
  for (int j = 0; j < 5; ++j) w[j] = words[j];
  float s_lo = 0.0f, s_hi = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t nibbles = __funnelshift_rc(w[j], w[j + 1], shift);
    const uint32_t lo = nibbles & 0x0F0F0F0Fu, hi = nibbles & 0xF0F0F0F0u;
#pragma unroll
    for (int byte = 0; byte < 4; ++byte) {
      const int i = 4 * j + byte;
      // 2^23 + q (or 2^23 + 16 q): the byte in the low mantissa bits under exponent 150.
      const float q_lo = __uint_as_float(__byte_perm(lo, exponent, 0x7440u | byte));
      const float q_hi = __uint_as_float(__byte_perm(hi, exponent, 0x7440u | byte));
      s_lo = fmaf(q_lo - 8388616.0f, x[i], s_lo);       // (q - 8) x
      s_hi = fmaf(q_hi - 8388736.0f, x[16 + i], s_hi);  // 16 (q - 8) x
    }
  }
  const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(w[0] >> d_shift)));
  return d * fmaf(s_hi, 0.0625f, s_lo);
}

// The same sum with the nibbles decoded two at a time in f16: (n & 0x000F000F) | 0x64006400 is the
// pair of halves 1024 + q (bytes 0 and 2; bytes 1 and 3 after a shift by 8), minus 1032 the exact
// q - 8 (high nibbles: 1024 + 16 q, minus 1152), then each half widened to F32. The products and
// their order are those of block_row_sum, so the two decodes give the same bits.
__device__ __forceinline__ float block_row_sum_half(const uint8_t* window, const float (&x)[32],
                                                    uint32_t shift, uint32_t d_shift) {
  const auto* words = reinterpret_cast<const uint32_t*>(window);
  uint32_t w[5];
#pragma unroll
  for (int j = 0; j < 5; ++j) w[j] = words[j];
  const __half2 lo_bias = __floats2half2_rn(1032.0f, 1032.0f);
  const __half2 hi_bias = __floats2half2_rn(1152.0f, 1152.0f);
  const auto halves = [](uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); };
  float s_lo = 0.0f, s_hi = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t n02 = __funnelshift_rc(w[j], w[j + 1], shift), n13 = n02 >> 8;
    const float2 lo02 = __half22float2(__hsub2(halves((n02 & 0x000F000Fu) | 0x64006400u), lo_bias));
    const float2 lo13 = __half22float2(__hsub2(halves((n13 & 0x000F000Fu) | 0x64006400u), lo_bias));
    const float2 hi02 = __half22float2(__hsub2(halves((n02 & 0x00F000F0u) | 0x64006400u), hi_bias));
    const float2 hi13 = __half22float2(__hsub2(halves((n13 & 0x00F000F0u) | 0x64006400u), hi_bias));
    s_lo = fmaf(lo02.x, x[4 * j], s_lo);
    s_hi = fmaf(hi02.x, x[16 + 4 * j], s_hi);
    s_lo = fmaf(lo13.x, x[4 * j + 1], s_lo);
    s_hi = fmaf(hi13.x, x[16 + 4 * j + 1], s_hi);
    s_lo = fmaf(lo02.y, x[4 * j + 2], s_lo);
    s_hi = fmaf(hi02.y, x[16 + 4 * j + 2], s_hi);
    s_lo = fmaf(lo13.y, x[4 * j + 3], s_lo);
    s_hi = fmaf(hi13.y, x[16 + 4 * j + 3], s_hi);
  }
  const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(w[0] >> d_shift)));
  return d * fmaf(s_hi, 0.0625f, s_lo);
}

// The warp's sums of two rows' lane values: row `a` ends in lane 0, row `b` in lane 16 (lanes l and
// l + 16 added first, then a butterfly within each half).
__device__ __forceinline__ float warp_sum_two(float a, float b, uint32_t lane) {
  const bool upper = (lane & 16) != 0;
  float keep = upper ? b : a;
  keep += __shfl_xor_sync(0xFFFFFFFFu, upper ? a : b, 16);
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) keep += __shfl_xor_sync(0xFFFFFFFFu, keep, offset);
  return keep;
}

// The producer warp's copy of one stage without the bulk engine: `rows` rows of row_bytes, `grain`
// bytes per load and store (both addresses multiples of it).
__device__ __forceinline__ void copy_stage(const RowsArgs& a, uint8_t* dst, const uint8_t* src,
                                           uint32_t rows, uint32_t lane) {
  for (uint32_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + uint64_t(r) * a.row_bytes;
    uint8_t* d = dst + r * a.stride;
    for (uint32_t off = lane * a.grain; off < a.row_bytes; off += 32 * a.grain) {
      if (a.grain == 4) {
        *reinterpret_cast<uint32_t*>(d + off) = *reinterpret_cast<const uint32_t*>(s + off);
      } else if (a.grain == 2) {
        *reinterpret_cast<uint16_t*>(d + off) = *reinterpret_cast<const uint16_t*>(s + off);
      } else {
        d[off] = s[off];
      }
    }
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// kFull is the mat-vec; the lab also times the data path alone (kStreamOnly:
// consumers release each stage unread) and the arithmetic alone (kComputeOnly: no copies, consumers
// read whatever the ring holds).
enum class RowsMode { kFull, kStreamOnly, kComputeOnly };
// The nibble decode: byte permutes (block_row_sum) or packed halves (block_row_sum_half).
enum class RowsDecode { kPermute, kHalves };

template <RowsMode kMode = RowsMode::kFull, RowsDecode kDecode = RowsDecode::kPermute>
__global__ void __launch_bounds__(kMaxThreads, 2) q4_matvec_rows_kernel(const RowsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t consumers = a.chunk_warps * a.groups;
  const uint32_t full0 = smem_u32(smem), empty0 = full0 + 8 * kRingSlots;
  float* const partial = reinterpret_cast<float*>(smem + kBarrierBytes);
  uint8_t* const ring = smem + a.ring_offset;
  const uint32_t stage_bytes = a.stage_rows * a.stride;
  const uint32_t stage0 = blockIdx.x * a.stages_per_cta;
  const uint32_t stages = min(a.stages_per_cta, a.stages_total - stage0);
  const uint32_t row0 = stage0 * a.stage_rows;
  if (tid == 0) {
    for (uint32_t s = 0; s < a.ring; ++s) {
      sm90::mbar_init(full0 + 8 * s, a.bulk ? 1 : 32);
      sm90::mbar_init(empty0 + 8 * s, consumers);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();

  if (warp == consumers) {  // the producer
    for (uint32_t s = 0; kMode != RowsMode::kComputeOnly && s < stages; ++s) {
      const uint32_t slot = s % a.ring, round = s / a.ring;
      if (round > 0) sm90::mbar_wait(empty0 + 8 * slot, (round - 1) & 1);
      const uint32_t first = row0 + s * a.stage_rows;
      const uint32_t rows = min(a.stage_rows, a.n - first);
      const uint8_t* src = a.weight + uint64_t(first) * a.row_bytes;
      uint8_t* dst = ring + slot * stage_bytes;
      if (a.bulk) {
        if (lane == 0) {
          sm90::mbar_arrive_expect_tx(full0 + 8 * slot, rows * a.stride);
          routemm::cuda::sm90::bulk_load(smem_u32(dst), src, rows * a.stride, full0 + 8 * slot);
        }
      } else {
        copy_stage(a, dst, src, rows, lane);
        sm90::mbar_arrive(full0 + 8 * slot);
      }
    }
    return;
  }

  const uint32_t chunk = warp % a.chunk_warps, group = warp / a.chunk_warps;
  const uint32_t block = chunk * kBlocksPerWarp + lane;
  const bool valid = block < a.k_blocks;
  // Lanes past the last block read the last block (same code, no divergence) and add zero.
  const uint32_t read_block = valid ? block : a.k_blocks - 1;
  const uint32_t window = (read_block * 18) & ~3u;
  const uint32_t shift = read_block % 2 == 0 ? 16 : 32, d_shift = read_block % 2 == 0 ? 0 : 16;
  const uint32_t exponent = a.exponent_2_23;
  float x[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) x[i] = 0.0f;
  if (valid) {
    const float* src = a.input + uint64_t(block) * 32;
    if (a.x_vec) {
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(src) + q);
        x[4 * q] = v.x;
        x[4 * q + 1] = v.y;
        x[4 * q + 2] = v.z;
        x[4 * q + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) x[i] = __ldg(src + i);
    }
  }

  for (uint32_t s = 0; s < stages; ++s) {
    const uint32_t slot = s % a.ring, round = s / a.ring;
    if constexpr (kMode != RowsMode::kComputeOnly) sm90::mbar_wait(full0 + 8 * slot, round & 1);
    const uint32_t rows = min(a.stage_rows, a.n - (row0 + s * a.stage_rows));
    const uint8_t* const stage = ring + slot * stage_bytes + window;
    float* const out = partial + (s * a.stage_rows) * a.chunk_warps + chunk;
    // Two rows at a time: independent FMA chains for the scheduler to interleave. Without a second
    // row the first is read twice and the copy dropped.
    if constexpr (kMode != RowsMode::kStreamOnly) {  // kStreamOnly hands the stage back unread
      for (uint32_t r = group; r < rows; r += 2 * a.groups) {
        const uint32_t r2 = r + a.groups;
        const bool second = r2 < rows;
        const auto row_sum = [&](uint32_t row) {
          if constexpr (kDecode == RowsDecode::kHalves) {
            return block_row_sum_half(stage + row * a.stride, x, shift, d_shift);
          } else {
            return block_row_sum(stage + row * a.stride, x, shift, d_shift, exponent);
          }
        };
        const float v1 = row_sum(r);
        const float v2 = row_sum(second ? r2 : r);
        const float sum = warp_sum_two(valid ? v1 : 0.0f, valid ? v2 : 0.0f, lane);
        if (lane == 0) out[r * a.chunk_warps] = sum;
        if (lane == 16 && second) out[r2 * a.chunk_warps] = sum;
      }
    }
    __syncwarp();
    if (kMode != RowsMode::kComputeOnly && lane == 0) sm90::mbar_arrive(empty0 + 8 * slot);
  }

  sm90::named_barrier_sync(1, consumers * 32);
  const uint32_t rows = min(stages * a.stage_rows, a.n - row0);
  for (uint32_t i = tid; i < rows; i += consumers * 32) {
    float sum = partial[i * a.chunk_warps];
    for (uint32_t c = 1; c < a.chunk_warps; ++c) sum += partial[i * a.chunk_warps + c];
    a.output[row0 + i] = sum;
  }
#else
  __trap();  // the lab builds for sm_90a only
#endif
}

constexpr uint32_t round_up(uint32_t v, uint32_t to) { return (v + to - 1) / to * to; }

// The grid and CTA shape of one launch; `tuning` holds the choices the lab varies.
struct RowsTuning {
  uint32_t stage_bytes = 16384;     // target bytes per stage (whole rows, a multiple of G rows)
  uint32_t ring = 4;                // slots in the ring, <= kRingSlots
  uint32_t ctas_per_sm = 2;         // the grid aims at this many CTAs per multiprocessor ...
  uint32_t max_stages_per_cta = 8;  // ... unless a CTA would get more stages than this
};

struct RowsLaunch {
  RowsArgs args;
  uint32_t grid, threads, smem;
};

RowsLaunch rows_launch(const Q4MatVecRowsProblem& p, uint32_t multiprocessors,
                       const RowsTuning& tuning = {}) {
  RowsArgs a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.n = p.n;
  a.k_blocks = p.k / 32;
  a.chunk_warps = (a.k_blocks + kBlocksPerWarp - 1) / kBlocksPerWarp;
  a.groups = std::max<uint32_t>(1, kMaxConsumerWarps / a.chunk_warps);
  a.row_bytes = 18 * a.k_blocks;
  a.stride = round_up(a.row_bytes, 16);
  const uint32_t group_bytes = a.stride * a.groups;
  a.stage_rows =
      a.groups * std::max<uint32_t>(1, (tuning.stage_bytes + group_bytes / 2) / group_bytes);
  a.stages_total = (p.n + a.stage_rows - 1) / a.stage_rows;
  const uint32_t target = tuning.ctas_per_sm * multiprocessors;
  a.stages_per_cta =
      std::clamp<uint32_t>((a.stages_total + target - 1) / target, 1, tuning.max_stages_per_cta);
  a.ring = std::min({kRingSlots, tuning.ring, a.stages_per_cta});
  const uint32_t partial_bytes = round_up(a.stages_per_cta * a.stage_rows * a.chunk_warps * 4, 16);
  a.ring_offset = kBarrierBytes + partial_bytes;
  const auto address = reinterpret_cast<uintptr_t>(p.weight);
  a.bulk = address % 16 == 0 && a.row_bytes % 16 == 0;
  a.grain = address % 4 == 0 && a.row_bytes % 4 == 0 ? 4 : address % 2 == 0 ? 2 : 1;
  a.x_vec = reinterpret_cast<uintptr_t>(p.input) % 16 == 0;
  a.exponent_2_23 = 0x4B000000u;
  RowsLaunch l{};
  l.args = a;
  l.grid = (a.stages_total + a.stages_per_cta - 1) / a.stages_per_cta;
  l.threads = 32 * (a.chunk_warps * a.groups + 1);
  l.smem = a.ring_offset + a.ring * a.stage_rows * a.stride + kTailSlackBytes;
  return l;
}

}  // namespace q4_rows_lab
