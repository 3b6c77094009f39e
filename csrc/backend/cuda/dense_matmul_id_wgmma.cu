// The tensor-core expert-ID routes (grouped_tensor_lowp, grouped_tensor_tf32) on Hopper (sm_90a
// builds, compute capability 9.0 devices): a warp-specialised persistent kernel on warpgroup MMA
// (wgmma) with the weights brought in by TMA. dense_matmul_id_tensor.cu's launcher takes it on the
// vector path (every row 16-byte aligned, k % 8 == 0, k > 0); everything else keeps the mma.sync
// kernel there.
//
// NUMERICS: those of the routes (dense_matmul_id_tensor.cu): lowp rounds the activations to the
// weight dtype (round to nearest even); tf32 rounds the activations, and F32 weights, to tf32
// (cvt.rna), f16/bf16 weights being exact in tf32; products summed in F32 by the tensor cores. Each
// output element's sum runs over K in steps of 16 (lowp) or 8 (tf32) values in increasing order (one
// wgmma each), within a step in the tensor core's order; the result depends on K only, not on m, the
// tile or its place. The steps differ from the mma.sync kernel's, so the two kernels agree within
// the route's tolerance, not bit for bit.
//
// OPERANDS: before the kernel, a conversion pass rounds every input row (token, slot; one per token
// for the shared layout) once into a stream-ordered workspace (hopper_support.h) of dense rows:
// k values of the route's activation operand (bf16 / f16 for lowp, tf32 bit patterns in 32 bits
// for tf32), m x slots x k x 2 or 4 bytes. The kernel then only copies those rows; the rounding
// is the same one the routes define, so the result does not depend on where it happens.
//
// GEOMETRY: a persistent grid over the work list of grouped_work_list.cuh with 128 x BN tiles
// (routed rows x output columns; BN = 256, or 128 when n <= 128); lowp shares an expert's rows
// evenly among its row tiles (balanced_rows). Each slot of the shared-memory ring
// holds one K slice of both operands as 128-byte rows (64 16-bit or 32 32-bit values) with the
// 128-byte swizzle the wgmma descriptors name. Three warpgroups per CTA:
//   - warpgroup 0, the producers. Thread 0 streams the expert's weight tile slice by slice through
//     kStages slots by TMA (rows past n and K past k arrive as zeros). All 128 threads gather the
//     tile's 128 routed activation rows from the workspace with 16-byte cp.async (8 per thread and
//     slice; rows past the item and K past k are zero-filled), writing the same swizzle. A slot's
//     "full" mbarrier completes on the TMA bytes plus one cp.async arrival per producer thread.
//     For tf32 over 16-bit weights TMA lands the raw rows, unswizzled, in the back half of the
//     slot's weight tile, and the consumers widen them in place; F32 weights are rounded to tf32
//     in place.
//   - warpgroups 1 and 2, the consumers: each owns 64 of the tile's rows and issues four wgmmas
//     (m64 x BN, 16 or 8 K values each) per slot. A slot goes back to the producers (mbarrier
//     "empty", one arrival per consumer warp) once the wgmmas that read it have retired
//     (wgmma.wait_group 1: one group stays in flight).
// Registers: the producers drop to 56 per thread and the consumers rise to 224 (setmaxnreg; 168
// each at launch, the bound of 384 threads), which holds a 64 x 256 F32 accumulator (128 per
// thread) without spills. A consumer warpgroup without rows in an item (an item of at most 64
// rows) only prepares its share of the weights (tf32) and passes the slots back.
// Output rows are stored straight from the accumulators (float2 when n is even and the output
// 8-byte aligned) to the routed rows' positions; rows past the item and columns past n are skipped.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "dense_matmul_id_wgmma.h"
#include "grouped_work_list.cuh"
#include "hopper_support.h"
#include "routemm/error.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"
#include "wgmma.cuh"

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kTileRows = 128;       // two consumer warpgroups of 64 rows
constexpr uint32_t kSliceRowBytes = 128;  // bytes per operand row per slot = the swizzle span
constexpr uint32_t kThreads = 384;
[[maybe_unused]] constexpr uint32_t kProducerThreads = 128;  // warpgroup 0

// The operation: operand precision and the weights' storage type.
enum class WgOp { LowpBf16, LowpF16, Tf32Bf16, Tf32F16, Tf32F32 };

template <WgOp Op>
struct WgOpTraits {
  static constexpr bool kTf32 = Op == WgOp::Tf32Bf16 || Op == WgOp::Tf32F16 || Op == WgOp::Tf32F32;
  static constexpr bool kHalfWeights = Op == WgOp::LowpF16 || Op == WgOp::Tf32F16;
  static constexpr uint32_t kWeightBytes = Op == WgOp::Tf32F32 ? 4 : 2;
  // K values per slot: 128-byte operand rows of 16-bit (lowp) or 32-bit (tf32) values.
  static constexpr uint32_t kSliceK = kTf32 ? 32 : 64;
  // Bytes of one activation operand value in the conversion pass's rows (tf32 in 32 bits).
  static constexpr uint32_t kOperandBytes = kTf32 ? 4 : 2;
  static_assert(kSliceK * kOperandBytes == kSliceRowBytes);
  // tf32 from 16-bit weights: TMA brings the raw rows (64 bytes each, unswizzled) into the back
  // half of the weight tile and the consumers widen them in place; otherwise TMA writes the tile
  // as the wgmma reads it (128-byte swizzle; F32 weights are then rounded to tf32 in place).
  static constexpr bool kWiden = kTf32 && kWeightBytes == 2;
};

// lowp splits an expert's rows evenly over its row tiles (grouped_work_list.cuh): the tiles of
// one (expert, column tile) then run at one pace on their multiprocessors and share each weight
// slice in L2, where a full tile and a short remainder drift apart and the remainder reads the
// weights from DRAM again (DeepSeek-V3 at m = 4096: 12.6 -> 8.6 GB read, 2.99 -> 2.13 ms). tf32
// keeps full tiles: at half the tensor rate the extra MMA work of two half-full tiles costs more
// than the second read (DeepSeek-V3: 4.36 ms full tiles, 4.52 ms balanced).
template <WgOp Op>
constexpr bool balanced_rows() {
  return !WgOpTraits<Op>::kTf32;
}

template <uint32_t BN>
struct WgTile {
  static constexpr uint32_t kStages = BN == 256 ? 4 : 6;
  static constexpr uint32_t kABytes = kTileRows * kSliceRowBytes;  // 16 KB
  static constexpr uint32_t kBBytes = BN * kSliceRowBytes;
  static constexpr uint32_t kSlotBytes = kABytes + kBBytes;
  static constexpr uint32_t kPipeBytes = kStages * kSlotBytes;
  static_assert(kSlotBytes % 1024 == 0, "slots keep the swizzle atoms aligned");
};

// Dynamic shared memory: 1024 bytes of alignment slack, the slots, 2 x kStages mbarriers, the
// expert prefix.
template <uint32_t BN>
constexpr uint64_t smem_bytes(uint32_t experts) {
  return 1024 + uint64_t{WgTile<BN>::kPipeBytes} + 16 * WgTile<BN>::kStages +
         work_list_bytes(experts);
}

// Device helpers of the kernel, compiled where its body is (the sm_90a image).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <bool kHalf>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t out;
  if constexpr (kHalf) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&out, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&out, &h, 4);
  }
  return out;
}

__device__ __forceinline__ uint32_t to_tf32(float value) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(value));
  return out;
}

// The F32 bits of one 16-bit weight value (exact, hence exact in tf32 as well).
template <bool kHalf>
__device__ __forceinline__ uint32_t widen_bits(uint32_t bits16) {
  if constexpr (kHalf) {
    __half h;
    const auto b = static_cast<uint16_t>(bits16);
    memcpy(&h, &b, 2);
    return __float_as_uint(__half2float(h));
  } else {
    return bits16 << 16;
  }
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// One slot's MMA step: 64 K values (lowp) or 32 (tf32), four instructions.
template <uint32_t BN, WgOp Op>
__device__ __forceinline__ void wgmma_step(float (&acc)[BN / 2], uint64_t desc_a, uint64_t desc_b,
                                           uint32_t accumulate) {
  if constexpr (WgOpTraits<Op>::kTf32) {
    if constexpr (BN == 256) {
      sm90::wgmma_m64n256k8_tf32(acc, desc_a, desc_b, accumulate);
    } else {
      sm90::wgmma_m64n128k8_tf32(acc, desc_a, desc_b, accumulate);
    }
  } else if constexpr (BN == 256 && Op == WgOp::LowpF16) {
    sm90::wgmma_m64n256k16_f16(acc, desc_a, desc_b, accumulate);
  } else if constexpr (BN == 256) {
    sm90::wgmma_m64n256k16_bf16(acc, desc_a, desc_b, accumulate);
  } else if constexpr (Op == WgOp::LowpF16) {
    sm90::wgmma_m64n128k16_f16(acc, desc_a, desc_b, accumulate);
  } else {
    sm90::wgmma_m64n128k16_bf16(acc, desc_a, desc_b, accumulate);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The conversion pass: row token * slots + slot of `out` (dense, k values of the route's activation
// operand each) is input row (token, slot) rounded as the route defines. One warp per row, eight
// values per lane and step (k % 8 == 0; input rows and strides 16-byte aligned, as the launcher
// checks).
template <WgOp Op>
__global__ void __launch_bounds__(256)
    round_activation_rows_kernel(const char* __restrict__ input, uint64_t token_stride,
                                 uint64_t slot_stride, uint32_t slots, uint64_t rows, uint32_t k,
                                 char* __restrict__ out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using O = WgOpTraits<Op>;
  const uint32_t lane = threadIdx.x & 31;
  const uint64_t warps = uint64_t{gridDim.x} * (blockDim.x / 32);
  const uint32_t chunks = k / 8;
  for (uint64_t row = (uint64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; row < rows;
       row += warps) {
    const uint64_t token = row / slots, slot = row - token * slots;
    const char* const src = input + token * token_stride + slot * slot_stride;
    char* const dst = out + row * k * O::kOperandBytes;
#pragma unroll 4
    for (uint32_t c = lane; c < chunks; c += 32) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(src + 32 * uint64_t{c}));
      const float4 b = __ldg(reinterpret_cast<const float4*>(src + 32 * uint64_t{c} + 16));
      if constexpr (O::kTf32) {
        auto* const d = reinterpret_cast<uint4*>(dst + 32 * uint64_t{c});
        d[0] = make_uint4(to_tf32(a.x), to_tf32(a.y), to_tf32(a.z), to_tf32(a.w));
        d[1] = make_uint4(to_tf32(b.x), to_tf32(b.y), to_tf32(b.z), to_tf32(b.w));
      } else {
        *reinterpret_cast<uint4*>(dst + 16 * uint64_t{c}) =
            make_uint4(pack_pair<O::kHalfWeights>(a.x, a.y), pack_pair<O::kHalfWeights>(a.z, a.w),
                       pack_pair<O::kHalfWeights>(b.x, b.y), pack_pair<O::kHalfWeights>(b.z, b.w));
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a image exists (hopper_kernels_available)
#endif
}

// `operands`: the conversion pass's rows (m x slots); `slots`: 1 for the shared input layout, top_k
// for the slotted one.
template <uint32_t BN, WgOp Op>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgmma_kernel(const __grid_constant__ CUtensorMap weights_map,
                         DenseMatmulIdKernelParams p, const char* __restrict__ operands,
                         uint32_t slots, const uint32_t* __restrict__ counts,
                         const uint32_t* __restrict__ routed, float* __restrict__ output,
                         bool out_vec2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgTile<BN>;
  using O = WgOpTraits<Op>;
  constexpr uint32_t kSliceK = O::kSliceK;
  // Bytes TMA writes per slot, and where in the weight tile.
  constexpr uint32_t kTmaBytes = BN * kSliceK * O::kWeightBytes;
  constexpr uint32_t kTmaOffset = O::kWiden ? T::kBBytes - kTmaBytes : 0;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pipe = (raw_base + 1023u) & ~1023u;  // slot s: A at pipe + s * kSlotBytes, then B
  const uint32_t full_bar = pipe + T::kPipeBytes;     // kStages x 8 bytes
  const uint32_t empty_bar = full_bar + 8 * T::kStages;
  uint32_t* const list =
      reinterpret_cast<uint32_t*>(smem_raw + (pipe - raw_base) + T::kPipeBytes + 16 * T::kStages);

  const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const uint32_t m = p.m, n = p.n, k = p.k, n_experts = p.n_experts;
  const uint32_t col_tiles = (n + BN - 1) / BN;
  const uint32_t slices = (k + kSliceK - 1) / kSliceK;

  if (tid == 0) {
    for (uint32_t s = 0; s < T::kStages; ++s) {
      // The weight TMA's arrive_expect_tx plus one cp.async arrival per producer thread.
      sm90::mbar_init(full_bar + 8 * s, 1 + kProducerThreads);
      sm90::mbar_init(empty_bar + 8 * s, 8);  // one arrival per consumer warp
    }
    sm90::fence_mbar_init();
  }
  build_work_list<kThreads>(counts, routed_capacity(m, p.top_k), n_experts, kTileRows, col_tiles,
                            list);  // + barrier
  const uint32_t total = list[n_experts];

  if (warp < 4) {  // ---- producer warpgroup ----
    sm90::setmaxnreg_dec<56>();
    // Thread t copies 16-byte chunk q = t % 8 of the 128-byte slice rows r0 + 16 i (i < 8); in the
    // swizzled row that chunk sits at q ^ (row % 8) = q ^ (r0 % 8).
    constexpr uint32_t kRowsPer = kTileRows / (kProducerThreads / 8);
    const uint32_t q = tid & 7u, r0 = tid >> 3;
    const uint32_t a_off = r0 * kSliceRowBytes + ((q ^ (r0 & 7u)) << 4);
    const uint64_t row_bytes = uint64_t{k} * O::kOperandBytes;
    if (tid == 0) sm90::prefetch_tensor_map(&weights_map);
    uint32_t stage = 0;
    for (uint32_t item = blockIdx.x; item < total; item += gridDim.x) {
      const WorkItem w = decode_item(item, list, n_experts, kTileRows, BN, balanced_rows<Op>());
      const uint32_t* const item_routed = routed + w.row0;
      const char* src[kRowsPer];
#pragma unroll
      for (uint32_t i = 0; i < kRowsPer; ++i) {
        const uint32_t r = r0 + 16 * i;
        src[i] = nullptr;
        if (r < w.rows) {
          const uint32_t flat = item_routed[r];
          const uint32_t row = slots == 1 ? flat / p.top_k : flat;
          src[i] = operands + row * row_bytes + q * 16;
        }
      }
      for (uint32_t kt = 0; kt < slices; ++kt, ++stage) {
        const uint32_t slot = stage % T::kStages, parity = (stage / T::kStages) & 1u;
        sm90::mbar_wait(empty_bar + 8 * slot, parity ^ 1u);
        if (tid == 0) {
          sm90::mbar_arrive_expect_tx(full_bar + 8 * slot, kTmaBytes);
          sm90::tma_load_3d(pipe + slot * T::kSlotBytes + T::kABytes + kTmaOffset, &weights_map,
                            full_bar + 8 * slot, static_cast<int32_t>(kt * kSliceK),
                            static_cast<int32_t>(w.col0), static_cast<int32_t>(w.expert));
        }
        const uint32_t a_tile = pipe + slot * T::kSlotBytes + a_off;
        const uint64_t kb = uint64_t{kt} * kSliceRowBytes;
        const bool k_in = kb + q * 16 < row_bytes;
#pragma unroll
        for (uint32_t i = 0; i < kRowsPer; ++i) {
          const bool valid = src[i] != nullptr && k_in;
          cp_async_16(a_tile + 16 * i * kSliceRowBytes, valid ? src[i] + kb : operands, valid);
        }
        cp_async_mbar_arrive_noinc(full_bar + 8 * slot);
      }
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumer warpgroups ----
  sm90::setmaxnreg_inc<224>();          // 128 x 56 + 256 x 224 <= 64 K registers
  const uint32_t wg = (warp >> 2) - 1;  // 0 or 1: rows 64 wg .. 64 wg + 63 of each tile
  const uint32_t t = tid & 127, ct = tid - 128;
  const uint32_t wg_warp = t >> 5;

  // tf32: the slot's weights as the wgmma reads them, prepared by both consumer warpgroups.
  const auto prepare_weights = [&](uint32_t b_tile) {
    if constexpr (O::kWiden) {
      // Raw rows of 32 16-bit values (64 bytes) at b_tile + kTmaOffset; four threads per row, 8
      // values each, widened into the two 16-byte chunks of K 8c..8c+7 of the swizzled row.
      constexpr uint32_t kPer = BN * 4 / 256;
      const uint32_t c = ct & 3u;
      uint4 raw[kPer];
#pragma unroll
      for (uint32_t i = 0; i < kPer; ++i) {
        raw[i] = lds128(b_tile + kTmaOffset + ((ct >> 2) + 64 * i) * 64 + c * 16);
      }
      sm90::named_barrier_sync(3, 256);  // every raw row is read before the widened rows land
#pragma unroll
      for (uint32_t i = 0; i < kPer; ++i) {
        const uint32_t r = (ct >> 2) + 64 * i;
        const uint32_t row = b_tile + r * kSliceRowBytes;
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
        uint32_t f[8];
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) {
          f[2 * j] = widen_bits<O::kHalfWeights>(words[j] & 0xFFFFu);
          f[2 * j + 1] = widen_bits<O::kHalfWeights>(words[j] >> 16);
        }
        sts128(row + (((2 * c) ^ (r & 7u)) << 4), f[0], f[1], f[2], f[3]);
        sts128(row + (((2 * c + 1) ^ (r & 7u)) << 4), f[4], f[5], f[6], f[7]);
      }
    } else if constexpr (O::kTf32) {  // F32 weights: round each value to tf32 in place
#pragma unroll
      for (uint32_t i = 0; i < BN * 8 / 256; ++i) {
        const uint32_t addr = b_tile + (ct + 256 * i) * 16;
        const uint4 v = lds128(addr);
        sts128(addr, to_tf32(__uint_as_float(v.x)), to_tf32(__uint_as_float(v.y)),
               to_tf32(__uint_as_float(v.z)), to_tf32(__uint_as_float(v.w)));
      }
    }
  };
  // Slot `slot`'s operands, ready for the wgmma: its TMA bytes and the producers' cp.async have
  // landed (the full barrier), the tf32 weights are prepared, and the proxy fence orders the
  // generic-proxy writes (cp.async, the preparation's stores) before the async-proxy wgmma reads.
  const auto slot_ready = [&](uint32_t slot, uint32_t parity) {
    sm90::mbar_wait(full_bar + 8 * slot, parity);
    prepare_weights(pipe + slot * T::kSlotBytes + T::kABytes);
    sm90::fence_proxy_async_smem();
    if constexpr (O::kTf32) sm90::named_barrier_sync(3, 256);  // both halves of the weights
  };

  float acc[BN / 2];  // the warpgroup's 64 x BN accumulator, BN / 2 per thread
  uint32_t stage = 0;

  for (uint32_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem w = decode_item(item, list, n_experts, kTileRows, BN, balanced_rows<Op>());
    const uint32_t* const item_routed = routed + w.row0;
    const uint32_t my_rows = w.rows > wg * 64 ? min(64u, w.rows - wg * 64) : 0u;
    if (my_rows == 0) {  // no rows here: prepare its share of the weights (tf32), pass slots back
      for (uint32_t kt = 0; kt < slices; ++kt, ++stage) {
        const uint32_t slot = stage % T::kStages, parity = (stage / T::kStages) & 1u;
        slot_ready(slot, parity);
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(empty_bar + 8 * slot);
      }
      continue;
    }

    for (uint32_t kt = 0; kt < slices; ++kt) {
      const uint32_t s = stage + kt;
      const uint32_t slot = s % T::kStages, parity = (s / T::kStages) & 1u;
      slot_ready(slot, parity);
      const uint64_t desc_a =
          sm90::smem_desc_k128(pipe + slot * T::kSlotBytes + wg * 64 * kSliceRowBytes);
      const uint64_t desc_b = sm90::smem_desc_k128(pipe + slot * T::kSlotBytes + T::kABytes);
      sm90::wgmma_fence();
      sm90::fence_operands(acc);
#pragma unroll
      for (uint32_t j = 0; j < 4; ++j) {  // 32-byte steps along the 128-byte rows
        wgmma_step<BN, Op>(acc, desc_a + 2 * j, desc_b + 2 * j, kt > 0 || j > 0 ? 1u : 0u);
      }
      sm90::wgmma_commit();
      sm90::fence_operands(acc);
      sm90::wgmma_wait<1>();  // slice kt - 1's wgmmas have retired: its slot goes back
      sm90::fence_operands(acc);
      if (kt > 0) {
        __syncwarp();
        if (lane == 0) sm90::mbar_arrive(empty_bar + 8 * ((s - 1) % T::kStages));
      }
    }
    stage += slices;
    sm90::wgmma_wait<0>();
    sm90::fence_operands(acc);
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(empty_bar + 8 * ((stage - 1) % T::kStages));

    // Epilogue: rows 16 wg_warp + lane / 4 (+ 8) of this warpgroup's 64, columns 8 j + 2 (lane % 4).
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
      const uint32_t r = wg_warp * 16 + (lane >> 2) + 8 * half;
      if (r >= my_rows) continue;
      float* const out_row = output + static_cast<uint64_t>(item_routed[wg * 64 + r]) * n;
#pragma unroll
      for (uint32_t j = 0; j < BN / 8; ++j) {
        const uint32_t col = w.col0 + 8 * j + 2 * (lane & 3);
        const float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
        if (out_vec2) {
          if (col < n) *reinterpret_cast<float2*>(out_row + col) = make_float2(v0, v1);
        } else {
          if (col < n) out_row[col] = v0;
          if (col + 1 < n) out_row[col + 1] = v1;
        }
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a image exists (hopper_kernels_available)
#endif
}

// The weight stack as a 3-D tensor (k, n, experts), boxes of kSliceK x BN x 1 laid out as the
// kernel expects (see WgOpTraits); out-of-range rows and K values read as zeros.
template <uint32_t BN, WgOp Op>
CUtensorMap weights_tensor_map(const std::string& label, const void* weights,
                               const DenseMatmulIdKernelParams& p) {
  using O = WgOpTraits<Op>;
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) throw Error("'" + label + "': cuTensorMapEncodeTiled is unavailable");
  CUtensorMap map;
  const cuuint64_t dims[3] = {p.k, p.n, p.n_experts};
  const cuuint64_t strides[2] = {cuuint64_t{p.k} * O::kWeightBytes, p.expert_stride_bytes};
  const cuuint32_t box[3] = {O::kSliceK, BN, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = O::kWeightBytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : O::kHalfWeights    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(&map, type, 3, const_cast<void*>(weights), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            O::kWiden ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("'" + label + "': cannot describe the weights for TMA (CUresult " +
                std::to_string(static_cast<int>(r)) + ")");
  }
  return map;
}

// Grid of the conversion pass: one warp per row, at most this many CTAs of 8 warps (grid-stride).
constexpr uint64_t kConvertBlocksMax = 4096;

template <uint32_t BN, WgOp Op>
void launch_wgmma(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                  cudaStream_t stream, bool out_vec2) {
  using O = WgOpTraits<Op>;
  constexpr auto kernel = &grouped_wgmma_kernel<BN, Op>;
  opt_in_dynamic_smem<kernel>(launch.label, smem_bytes<BN>(p.n_experts),
                              smem_bytes<BN>(kMaxWorkListExperts));
  const CUtensorMap map = weights_tensor_map<BN, Op>(launch.label, launch.args[1].data, p);
  // The activation operand rows, converted once. The workspace is freed on the stream after both
  // launches (or at once if a launch fails).
  const uint32_t slots = p.input_layout == kernels::kInputSlotted ? p.top_k : 1u;
  const uint64_t rows = uint64_t{p.m} * slots;
  const StreamWorkspace workspace(launch.label, rows * p.k * O::kOperandBytes, stream);
  char* const operands = static_cast<char*>(workspace.data());
  const uint64_t blocks = std::min<uint64_t>((rows + 7) / 8, kConvertBlocksMax);
  round_activation_rows_kernel<Op><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const char*>(launch.args[2].data), p.input_token_stride_bytes,
      p.input_slot_stride_bytes, slots, rows, p.k, operands);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + launch.label +
                "': activation conversion launch failed: " + cudaGetErrorString(e));
  }
  kernel<<<static_cast<unsigned>(launch.grid.x), kThreads,
           static_cast<size_t>(smem_bytes<BN>(p.n_experts)), stream>>>(
      map, p, operands, slots, static_cast<const uint32_t*>(launch.args[3].data),
      static_cast<const uint32_t*>(launch.args[4].data), static_cast<float*>(launch.args[5].data),
      out_vec2);
}

template <WgOp Op>
void launch_op(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p, cudaStream_t stream,
               bool out_vec2) {
  if (p.n <= 128) {
    launch_wgmma<128, Op>(launch, p, stream, out_vec2);
  } else {
    launch_wgmma<256, Op>(launch, p, stream, out_vec2);
  }
}

}  // namespace

uint64_t wgmma_grouped_smem_bytes(uint32_t n_experts) { return smem_bytes<256>(n_experts); }

void launch_grouped_wgmma(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                          cudaStream_t stream, WgmmaOperands operands, bool out_vec2) {
  switch (operands) {
    case WgmmaOperands::LowpBf16: return launch_op<WgOp::LowpBf16>(launch, p, stream, out_vec2);
    case WgmmaOperands::LowpF16: return launch_op<WgOp::LowpF16>(launch, p, stream, out_vec2);
    case WgmmaOperands::Tf32Bf16: return launch_op<WgOp::Tf32Bf16>(launch, p, stream, out_vec2);
    case WgmmaOperands::Tf32F16: return launch_op<WgOp::Tf32F16>(launch, p, stream, out_vec2);
    case WgmmaOperands::Tf32F32: return launch_op<WgOp::Tf32F32>(launch, p, stream, out_vec2);
  }
  throw Error("'" + launch.label + "': unknown wgmma operand kind");
}

}  // namespace routemm::cuda
