// Tensor-core kernels of the expert-ID matmul's opt-in routes (grouped_tensor_tf32,
// grouped_tensor_lowp). They consume the map_distinct output of the grouped route (expert counts and
// routed rows, same scratch, same barrier pattern) and use warp-level MMA (mma.sync + ldmatrix +
// cp.async, sm_80+). On Hopper, when the build carries the sm_90a image, aligned views take the
// warpgroup-MMA kernel of dense_matmul_id_wgmma.cu instead (same numerics contract, its own K steps);
// this file's kernel then serves only views that are not 16-byte aligned or have k % 8 != 0.
//
// NUMERICS (not bit-identical to the scalar routes; a stated tolerance instead):
//   tf32: activations rounded to tf32 (cvt.rna: round to nearest, ties away); weights rounded to
//         tf32 too, which is exact for f16 and bf16 weights; products summed in F32 by the tensor
//         cores. Tested within 2e-3 relative Frobenius error of a float64 reference.
//   lowp: activations rounded to the weight dtype (f16 or bf16, round to nearest even); weights
//         exact; F32 accumulation. Tested within 1e-2 relative Frobenius error.
// In this kernel each output element's sum runs over K in slices (32 for lowp, 16 for tf32) in
// increasing order, within a slice in the tensor core's own order; the result depends on K only,
// not on m, the tile size or the tile position.
// An id >= n_experts gives an all-zero row: the map dispatch writes it, these kernels never see it.
//
// Geometry and data path: grouped_tensor_kernel.cuh's persistent warp-MMA kernel (shared with the
// quantised expert-ID tensor route), with this file's weight tiles (DenseTiles). Each CTA builds
// the work list of (expert, column tile, row tile) items in shared memory and walks it. A CTA tile
// is BM (128, or 64 when experts hold few rows) routed rows x 128 columns. Weights arrive by
// cp.async (16 bytes, zero-filled past n and k) when they are stored in the MMA's operand type;
// f16/bf16 weights of the tf32 route pass through registers, converted. Rows that are not 16-byte
// aligned or k % 8 != 0 take the same kernel with element loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "dense_matmul_id_wgmma.h"
#include "grouped_tensor_kernel.cuh"
#include "grouped_work_list.cuh"
#include "hopper_support.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"

#ifndef ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256
#define ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;
using namespace grouped_tensor;

template <class W>
__device__ __forceinline__ float widen(W value);
template <>
__device__ __forceinline__ float widen<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ float widen<__half>(__half value) {
  return __half2float(value);
}
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

// The weight tiles of f32/f16/bf16 expert rows (grouped_tensor_kernel.cuh's policy contract).
// Weights stored in the MMA's operand type go straight to shared memory by cp.async (16 bytes,
// zero-filled past n and k); others (f16/bf16 for tf32, or element loads without kVec) pass
// through registers, converted.
template <class W, Mode M, uint32_t BN, bool kVec>
struct DenseTiles {
  static constexpr bool kTf32 = M == Mode::Tf32;
  static constexpr bool kWFloat = sizeof(W) == 4;
  static constexpr bool kAsync = kVec && (!kTf32 || kWFloat);
  static constexpr uint32_t kStageExtraBytes = 0;
  static constexpr bool kSliceScales = false;
  static constexpr uint32_t kBH = BN / 128;

  const char* w_expert;
  uint32_t col0, n, k, tid;
  uint32_t bregs[kAsync ? 1 : kBH][8];

  __device__ DenseTiles(const char* expert_weights, uint32_t first_col,
                        const DenseMatmulIdKernelParams& p, uint32_t thread)
      : w_expert(expert_weights), col0(first_col), n(p.n), k(p.k), tid(thread) {}

  // Raw f32 weights copied as they are: rounded to tf32 when they leave shared memory.
  static __device__ __forceinline__ uint32_t fragment(uint32_t word) {
    if constexpr (kTf32 && kWFloat && kAsync) {
      return to_tf32(__uint_as_float(word));
    } else {
      return word;
    }
  }

  // BN/64 chunks per thread, rows tid/4 + 64i, chunk tid % 4.
  __device__ __forceinline__ void issue(uint32_t base, uint32_t k0) {
    constexpr uint32_t kPerChunk = 16 / sizeof(W);
#pragma unroll
    for (uint32_t i = 0; i < BN / 64; ++i) {
      const uint32_t r = tid / 4 + i * 64, ch = tid % 4;
      const uint32_t col = col0 + r, kk = k0 + ch * kPerChunk;
      const bool valid = col < n && kk < k;
      const char* src =
          valid ? w_expert + (static_cast<uint64_t>(col) * k + kk) * sizeof(W) : w_expert;
      cp_async_16(base + swz(r, ch), src, valid);
    }
  }

  // Rows tid/2 + 128h, chunks 2*(tid&1) and +1 (8 tf32 words or 16 halves each).
  __device__ __forceinline__ void load(uint32_t k0) {
#pragma unroll
    for (uint32_t hh = 0; hh < kBH; ++hh) {
      uint32_t (&breg)[8] = bregs[hh];
      const uint32_t r = (tid >> 1) + 128 * hh, col = col0 + r;
      constexpr uint32_t kElems = kTf32 ? 8 : 16;
      const uint32_t kk = k0 + (tid & 1) * kElems;
      const char* src = w_expert + (static_cast<uint64_t>(col) * k + kk) * sizeof(W);
      if constexpr (kTf32 && !kWFloat && kVec) {
        uint4 v = make_uint4(0, 0, 0, 0);
        if (col < n && kk < k) v = __ldg(reinterpret_cast<const uint4*>(src));
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) {
          W lo16, hi16;
          const uint16_t l = static_cast<uint16_t>(words[j] & 0xFFFFu),
                         h = static_cast<uint16_t>(words[j] >> 16);
          memcpy(&lo16, &l, 2);
          memcpy(&hi16, &h, 2);
          breg[2 * j] = to_tf32(widen(lo16));
          breg[2 * j + 1] = to_tf32(widen(hi16));
        }
      } else if constexpr (kTf32) {
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
          float v = 0.0f;
          if (col < n && kk + j < k) {
            if constexpr (kWFloat) {
              v = widen(reinterpret_cast<const float*>(src)[j]);
            } else {
              W h;
              const uint16_t bits = load_u16(src + j * 2);
              memcpy(&h, &bits, 2);
              v = widen(h);
            }
          }
          breg[j] = to_tf32(v);
        }
      } else {
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
          const uint32_t lo16 = col < n && kk + 2 * j < k ? load_u16(src + 4 * j) : 0u;
          const uint32_t hi16 = col < n && kk + 2 * j + 1 < k ? load_u16(src + 4 * j + 2) : 0u;
          breg[j] = lo16 | (hi16 << 16);
        }
      }
    }
  }

  __device__ __forceinline__ void store(uint32_t base) const {
#pragma unroll
    for (uint32_t hh = 0; hh < kBH; ++hh) {
      const uint32_t r = (tid >> 1) + 128 * hh, ch = (tid & 1) * 2;
      const uint32_t (&breg)[8] = bregs[hh];
      sts128(base + swz(r, ch), breg[0], breg[1], breg[2], breg[3]);
      sts128(base + swz(r, ch + 1), breg[4], breg[5], breg[6], breg[7]);
    }
  }
};

template <class W, Mode M, uint32_t BM, uint32_t BN, bool kVec>
void launch_instance(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                     cudaStream_t stream, bool out_vec2) {
  constexpr auto kernel = &grouped_tensor_kernel<DenseTiles<W, M, BN, kVec>, M, BM, BN, kVec>;
  const uint64_t smem = smem_bytes<BM, BN>(p.n_experts);
  opt_in_dynamic_smem<kernel>(launch.label, smem, smem_bytes<BM, BN>(kMaxWorkListExperts));
  const auto blocks = static_cast<unsigned>(launch.grid.x);
  kernel<<<blocks, kThreads, static_cast<size_t>(smem), stream>>>(
      p, static_cast<const char*>(launch.args[1].data),
      static_cast<const char*>(launch.args[2].data),
      static_cast<const uint32_t*>(launch.args[3].data),
      static_cast<const uint32_t*>(launch.args[4].data), static_cast<float*>(launch.args[5].data),
      out_vec2);
}

template <class W, Mode M>
void launch_grouped_tensor(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  for (int slot = 1; slot <= 5; ++slot) {
    if (kernels::launch_arg(launch, slot, "buffer").kind != BoundArg::Kind::Buffer) {
      throw Error("'" + launch.label + "': slot " + std::to_string(slot) + " must be a buffer");
    }
  }
  if (p.n_experts > kMaxWorkListExperts) {
    throw Error("'" + launch.label + "': n_experts " + std::to_string(p.n_experts) + " exceeds " +
                std::to_string(kMaxWorkListExperts));
  }
  // The persistent grid the front door encoded (KernelDef::persistent_groups, capped by the tile
  // count); CTAs beyond the work items find none and exit.
  if (launch.grid.x == 0 || launch.grid.x > 0x7fffffffu || launch.grid.y != 1 ||
      launch.grid.z != 1) {
    throw Error("'" + launch.label + "': expected a 1-D persistent grid");
  }
  auto stream = static_cast<cudaStream_t>(queue_native);
  const auto addr = [&](int slot) { return reinterpret_cast<uintptr_t>(launch.args[slot].data); };
  const bool vec = p.k % 8 == 0 && addr(1) % 16 == 0 && p.expert_stride_bytes % 16 == 0 &&
                   addr(2) % 16 == 0 && p.input_token_stride_bytes % 16 == 0 &&
                   p.input_slot_stride_bytes % 16 == 0;
  const bool out_vec2 = p.n % 2 == 0 && addr(5) % 8 == 0;
  if (int device = 0;
      vec && p.k > 0 && cudaGetDevice(&device) == cudaSuccess && hopper_kernels_available(device)) {
    constexpr WgmmaOperands kOperands = M == Mode::LowpF16                 ? WgmmaOperands::LowpF16
                                        : M == Mode::LowpBf16              ? WgmmaOperands::LowpBf16
                                        : std::is_same_v<W, __half>        ? WgmmaOperands::Tf32F16
                                        : std::is_same_v<W, __nv_bfloat16> ? WgmmaOperands::Tf32Bf16
                                                                           : WgmmaOperands::Tf32F32;
    launch_grouped_wgmma(launch, p, stream, kOperands, out_vec2);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
    }
    return;
  }
  // Experts holding few rows on average take 64-row tiles (less padding), others 128.
  const bool small = uint64_t{p.m} * p.top_k < uint64_t{100} * p.n_experts;
  // 128 x 256 tiles (1 CTA per multiprocessor) measured no faster than 128 x 128 on the H200 and
  // slower for tf32, so every shape takes 128 columns.
  if (!vec) {
    launch_instance<W, M, 64, 128, false>(launch, p, stream, out_vec2);
  } else if (small) {
    launch_instance<W, M, 64, 128, true>(launch, p, stream, out_vec2);
  } else {
    launch_instance<W, M, 128, 128, true>(launch, p, stream, out_vec2);
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
  }
}

KernelDef tensor_def(std::string_view name, KernelFn fn, uint32_t persistent_groups) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = kThreads;
  // A persistent kernel: the tile fields bound the work items (64-row tiles, the smaller of the two
  // heights), and the front door encodes min(persistent_groups, tiles) groups.
  def.persistent_groups = persistent_groups;
  def.tile_x = 64;
  def.tile_y = kTileCols;
  // The 128-row variant's stages plus the row indices; the work list adds 8 bytes per expert.
  // (The launch sizes its dynamic shared memory itself.)
  def.threadgroup_memory_bytes = uint64_t{pipe_bytes<128, kTileCols>()} + kMaxTileRows * 4;
  def.origin = "cuda_fatbin";
  def.content_sha256 = ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256;
  return def;
}

}  // namespace

void add_dense_matmul_id_tensor_kernels(std::vector<KernelDef>& out) {
  // Two resident CTAs per multiprocessor of device 0 (the 128x128 variant's occupancy).
  const uint32_t sms = device0_multiprocessors();
  // Where the Hopper kernel serves these routes: one CTA per multiprocessor (its shared memory and
  // registers), so a persistent grid of one wave; the mma.sync fallback (unaligned views) runs its
  // persistent loop on that grid too.
  const bool hopper = hopper_kernels_available(0);
  const uint32_t groups = hopper ? sms : 2 * sms;
  const auto& names = kDenseMatmulIdTensorPipelineNames;
  const KernelFn fns[5] = {
      &launch_grouped_tensor<float, Mode::Tf32>,
      &launch_grouped_tensor<__half, Mode::Tf32>,
      &launch_grouped_tensor<__nv_bfloat16, Mode::Tf32>,
      &launch_grouped_tensor<__half, Mode::LowpF16>,
      &launch_grouped_tensor<__nv_bfloat16, Mode::LowpBf16>,
  };
  for (size_t i = 0; i < names.size(); ++i) {
    KernelDef def = tensor_def(names[i], fns[i], groups);
    if (hopper) {
      def.threadgroup_memory_bytes =
          std::max(def.threadgroup_memory_bytes, wgmma_grouped_smem_bytes(0));
    }
    out.push_back(std::move(def));
  }
}

}  // namespace routemm::cuda
