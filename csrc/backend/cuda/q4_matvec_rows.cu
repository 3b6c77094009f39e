// The one-token Q4_0 mat-vec on Hopper: m == 1, k <= 16384 (q4_matmul.cu's mat-vec launcher takes
// it there; every other mat-vec keeps the tensor-core kernel). A decode step's projection streams
// n * k * 18 / 32 bytes of weights once and does 2 FLOPs per weight, so this kernel is built around
// the weight stream: whole rows, one bulk copy per stage, and F32 FMAs on the CUDA cores instead of
// tensor-core MMAs (with one token, seven of an MMA's eight columns would be padding, and the
// per-block MMA chain was what bounded the tensor-core kernel at m = 1; see
// bench/results/experiments/q4_0_matvec-h200-2026-12-03.md and the 2026-12-04 notes beside it).
//
// WORK SPLIT. A lane owns one pair of blocks of K (64 values; the last pair may hold one block when
// k / 32 is odd) and keeps the token's 64 activations of that pair in registers for the whole
// kernel. A warp spans 32 pairs (2048 values of K), so KC = ceil(k / 2048) <= 8 "chunk" warps cover
// K, and a CTA holds G = max(1, 8 / KC) groups of them (consumers = KC * G warps) plus one producer
// warp. The CTA walks a contiguous range of weight rows in stages of R rows (R a multiple of G, about
// 16 KB per stage); within a stage group j takes rows j, j + G, ...
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
// summed in F32 by FMAs in increasing K order from zero; the block's sum is hi / 16 + lo (one FMA),
// then scaled by the block's F32 scale d: pair = d0 * block0, then fma(d1, block1, pair). The 32
// lanes' pair sums are added by a butterfly over lanes (xor 16, 8, 4, 2, 1), and the chunk warps'
// sums in increasing chunk order. The order depends on k only, never on the view's alignment.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "hopper_support.h"
#include "q4_matvec_rows.h"
#include "routemm/error.h"
#include "smem_opt_in.h"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

namespace routemm::cuda {
namespace {

constexpr uint32_t kMaxConsumerWarps = 8;
constexpr uint32_t kMaxThreads = 32 * (kMaxConsumerWarps + 1);
constexpr uint32_t kPairsPerWarp = 32;
constexpr uint32_t kStageTargetBytes = 16384;
constexpr uint32_t kRingSlots = 4;
constexpr uint32_t kMaxStagesPerCta = 8;
constexpr uint32_t kBarrierBytes = 2 * kRingSlots * 8;
constexpr uint32_t kTailSlackBytes = 32;

struct RowsArgs {
  const uint8_t* weight;
  const float* input;
  float* output;
  uint32_t n, k_blocks, pairs;
  uint32_t row_bytes, stride;  // global and shared-memory row strides
  uint32_t chunk_warps, groups, stage_rows, stages_total, stages_per_cta, ring;
  uint32_t ring_offset;  // bytes from the start of shared memory (after barriers and partials)
  uint32_t bulk;         // 1: one cp.async.bulk per stage; 0: the producer warp's copies
  uint32_t grain;        // bytes per copy of the second path: 4, 2 or 1
  uint32_t x_vec;        // 1: the input is 16-byte aligned (float4 loads)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared, completing `bar`'s
// transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// One block's sum over its 32 values: `lo` / `hi` are the pair's words masked to their low / high
// nibbles, kFirst the pair byte of the block's first nibble byte (2 or 20), `x` the block's values.
template <int kFirst>
__device__ __forceinline__ float block_sum(const uint32_t (&lo)[9], const uint32_t (&hi)[9],
                                           const float* x) {
  float s_lo = 0.0f, s_hi = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int word = (kFirst + i) >> 2, byte = (kFirst + i) & 3;
    // 2^23 + q (or 2^23 + 16 q): the byte in the low mantissa bits under exponent 150.
    const float q_lo = __uint_as_float(__byte_perm(lo[word], 0x4B000000u, 0x7440u | byte));
    const float q_hi = __uint_as_float(__byte_perm(hi[word], 0x4B000000u, 0x7440u | byte));
    s_lo = fmaf(q_lo - 8388616.0f, x[i], s_lo);       // (q - 8) x
    s_hi = fmaf(q_hi - 8388736.0f, x[16 + i], s_hi);  // 16 (q - 8) x
  }
  return fmaf(s_hi, 0.0625f, s_lo);
}

// The lane's sum over its pair of blocks of one row (`pair`: the pair's 36 bytes in the stage,
// 4-byte aligned; only the first 18 are read when !two).
__device__ __forceinline__ float pair_sum(const uint8_t* pair, const float (&x)[64], bool two) {
  const auto* words = reinterpret_cast<const uint32_t*>(pair);
  uint32_t lo[9], hi[9];
#pragma unroll
  for (int j = 0; j < 5; ++j) {
    const uint32_t w = words[j];
    lo[j] = w & 0x0F0F0F0Fu;
    hi[j] = w & 0xF0F0F0F0u;
  }
  const float d0 = __half2float(__ushort_as_half(static_cast<unsigned short>(words[0] & 0xFFFFu)));
  float sum = d0 * block_sum<2>(lo, hi, x);
  if (two) {
#pragma unroll
    for (int j = 5; j < 9; ++j) {
      const uint32_t w = words[j];
      lo[j] = w & 0x0F0F0F0Fu;
      hi[j] = w & 0xF0F0F0F0u;
    }
    const float d1 = __half2float(__ushort_as_half(static_cast<unsigned short>(words[4] >> 16)));
    sum = fmaf(d1, block_sum<20>(lo, hi, x + 32), sum);
  }
  return sum;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
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
    for (uint32_t s = 0; s < stages; ++s) {
      const uint32_t slot = s % a.ring, round = s / a.ring;
      if (round > 0) sm90::mbar_wait(empty0 + 8 * slot, (round - 1) & 1);
      const uint32_t first = row0 + s * a.stage_rows;
      const uint32_t rows = min(a.stage_rows, a.n - first);
      const uint8_t* src = a.weight + uint64_t(first) * a.row_bytes;
      uint8_t* dst = ring + slot * stage_bytes;
      if (a.bulk) {
        if (lane == 0) {
          sm90::mbar_arrive_expect_tx(full0 + 8 * slot, rows * a.stride);
          bulk_load(smem_u32(dst), src, rows * a.stride, full0 + 8 * slot);
        }
      } else {
        copy_stage(a, dst, src, rows, lane);
        sm90::mbar_arrive(full0 + 8 * slot);
      }
    }
    return;
  }

  const uint32_t chunk = warp % a.chunk_warps, group = warp / a.chunk_warps;
  const uint32_t pair = chunk * kPairsPerWarp + lane;
  const bool valid = pair < a.pairs, two = 2 * pair + 1 < a.k_blocks;
  float x[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) x[i] = 0.0f;
  if (valid) {
    const float* src = a.input + uint64_t(pair) * 64;
    if (a.x_vec) {
#pragma unroll
      for (int q = 0; q < 16; ++q) {
        if (q < 8 || two) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(src) + q);
          x[4 * q] = v.x;
          x[4 * q + 1] = v.y;
          x[4 * q + 2] = v.z;
          x[4 * q + 3] = v.w;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 64; ++i) {
        if (i < 32 || two) x[i] = __ldg(src + i);
      }
    }
  }

  for (uint32_t s = 0; s < stages; ++s) {
    const uint32_t slot = s % a.ring, round = s / a.ring;
    sm90::mbar_wait(full0 + 8 * slot, round & 1);
    const uint32_t rows = min(a.stage_rows, a.n - (row0 + s * a.stage_rows));
    const uint8_t* const stage = ring + slot * stage_bytes + pair * 36;
    float* const out = partial + (s * a.stage_rows) * a.chunk_warps + chunk;
    // Two rows at a time: independent FMA chains for the scheduler to interleave.
    for (uint32_t r = group; r < rows; r += 2 * a.groups) {
      const uint32_t r2 = r + a.groups;
      const bool second = r2 < rows;
      float v1 = valid ? pair_sum(stage + r * a.stride, x, two) : 0.0f;
      float v2 = valid && second ? pair_sum(stage + r2 * a.stride, x, two) : 0.0f;
      v1 = warp_sum(v1);
      v2 = warp_sum(v2);
      if (lane == 0) {
        out[r * a.chunk_warps] = v1;
        if (second) out[r2 * a.chunk_warps] = v2;
      }
    }
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(empty0 + 8 * slot);
  }

  sm90::named_barrier_sync(1, consumers * 32);
  const uint32_t rows = min(stages * a.stage_rows, a.n - row0);
  for (uint32_t i = tid; i < rows; i += consumers * 32) {
    float sum = partial[i * a.chunk_warps];
    for (uint32_t c = 1; c < a.chunk_warps; ++c) sum += partial[i * a.chunk_warps + c];
    a.output[row0 + i] = sum;
  }
#else
  __trap();  // launched only where the sm_90a image exists (q4_matvec_rows_eligible)
#endif
}

uint32_t multiprocessors(const std::string& label, int device) {
  static std::atomic<uint32_t> known[kMaxOptInDevices];
  uint32_t sms = known[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    int value = 0;
    if (const cudaError_t e =
            cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess || value <= 0) {
      (void)cudaGetLastError();
      throw Error("'" + label + "': cannot read the multiprocessor count");
    }
    sms = static_cast<uint32_t>(value);
    known[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

constexpr uint32_t round_up(uint32_t v, uint32_t to) { return (v + to - 1) / to * to; }

}  // namespace

bool q4_matvec_rows_eligible(int device, uint64_t k) {
  return k >= 32 && k % 32 == 0 && k <= kQ4MatVecRowsMaxK && hopper_kernels_available(device);
}

void launch_q4_matvec_rows(const std::string& label, cudaStream_t stream,
                           const Q4MatVecRowsProblem& p) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxOptInDevices) {
    (void)cudaGetLastError();
    throw Error("'" + label + "': no current CUDA device");
  }
  if (p.n == 0 || p.k == 0 || p.k % 32 != 0 || p.k > kQ4MatVecRowsMaxK) {
    throw Error("'" + label + "': the one-token mat-vec needs 0 < k <= " +
                std::to_string(kQ4MatVecRowsMaxK) + ", k % 32 == 0 and n > 0");
  }
  RowsArgs a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.n = p.n;
  a.k_blocks = p.k / 32;
  a.pairs = (a.k_blocks + 1) / 2;
  a.chunk_warps = (a.pairs + kPairsPerWarp - 1) / kPairsPerWarp;
  a.groups = std::max<uint32_t>(1, kMaxConsumerWarps / a.chunk_warps);
  a.row_bytes = 18 * a.k_blocks;
  a.stride = round_up(a.row_bytes, 16);
  const uint32_t group_bytes = a.stride * a.groups;
  a.stage_rows =
      a.groups * std::max<uint32_t>(1, (kStageTargetBytes + group_bytes / 2) / group_bytes);
  a.stages_total = (p.n + a.stage_rows - 1) / a.stage_rows;
  // About two CTAs per multiprocessor, each over a contiguous range of at most kMaxStagesPerCta
  // stages (larger products launch more CTAs).
  const uint32_t target = 2 * multiprocessors(label, device);
  a.stages_per_cta =
      std::clamp<uint32_t>((a.stages_total + target - 1) / target, 1, kMaxStagesPerCta);
  const uint32_t grid = (a.stages_total + a.stages_per_cta - 1) / a.stages_per_cta;
  a.ring = std::min(kRingSlots, a.stages_per_cta);
  const uint32_t partial_bytes = round_up(a.stages_per_cta * a.stage_rows * a.chunk_warps * 4, 16);
  a.ring_offset = kBarrierBytes + partial_bytes;
  const uint32_t smem = a.ring_offset + a.ring * a.stage_rows * a.stride + kTailSlackBytes;
  const auto address = reinterpret_cast<uintptr_t>(p.weight);
  a.bulk = address % 16 == 0 && a.row_bytes % 16 == 0;
  a.grain = address % 4 == 0 && a.row_bytes % 4 == 0 ? 4 : address % 2 == 0 ? 2 : 1;
  a.x_vec = reinterpret_cast<uintptr_t>(p.input) % 16 == 0;
  const uint32_t threads = 32 * (a.chunk_warps * a.groups + 1);
  opt_in_dynamic_smem<q4_matvec_rows_kernel>(label, smem, smem);
  q4_matvec_rows_kernel<<<grid, threads, smem, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + label + "': launch failed: " + cudaGetErrorString(e));
  }
}

}  // namespace routemm::cuda
