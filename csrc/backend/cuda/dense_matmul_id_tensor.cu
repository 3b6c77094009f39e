// Tensor-core kernels of the expert-ID matmul's opt-in routes (grouped_tensor_tf32,
// grouped_tensor_lowp). They consume the map_distinct output of the grouped route (expert counts and
// routed rows, same scratch, same barrier pattern) and use warp-level MMA (mma.sync, sm_80+).
//
// NUMERICS (not bit-identical to the scalar routes; a stated tolerance instead):
//   tf32: activations rounded to tf32 (cvt.rna: round to nearest, ties away); weights rounded to
//         tf32 too, which is exact for f16 and bf16 weights; products summed in F32 by the tensor
//         cores. Tested within 2e-3 relative Frobenius error of a float64 reference.
//   lowp: activations rounded to the weight dtype (f16 or bf16, round to nearest even); weights
//         exact; F32 accumulation. Tested within 1e-2 relative Frobenius error.
// Each output element's sum runs over K in slices of 32 in increasing order, within a slice in the
// tensor core's own order; the result depends on K only, not on m or the tile position.
// An id >= n_experts gives an all-zero row: the map dispatch writes it, these kernels never see it.
//
// Geometry: grid [ceil(m / 64), ceil(n / 64), n_experts], 128 threads (4 warps as 2 x 2). Block
// (x, y, e) computes routed rows [64x, 64x + 64) of expert e (rows past its count exit at once)
// times columns [64y, 64y + 64); each warp owns a 32 x 32 sub-tile. K is staged through shared
// memory 32 positions at a time, activations gathered by routed row and converted on the way in.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "backend/common/dense_matmul_id_params.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"

#ifndef ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256
#define ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kTileRows = 64;
constexpr uint32_t kTileCols = 64;
constexpr uint32_t kSliceK = 32;
constexpr uint32_t kThreads = 128;
// Row pitch of the shared tiles, in 32-bit words: 16 words of data plus 4 of padding for 16-bit
// operands, 32 plus 4 for tf32, so the fragment loads of one warp hit 32 different banks.
constexpr uint32_t kPitchLowp = kSliceK / 2 + 4;
constexpr uint32_t kPitchTf32 = kSliceK + 4;

enum class Mode { Tf32, LowpF16, LowpBf16 };

template <class W>
__device__ __forceinline__ float widen(W value);
template <>
__device__ __forceinline__ float widen<float>(float value) { return value; }
template <>
__device__ __forceinline__ float widen<__half>(__half value) { return __half2float(value); }
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }

__device__ __forceinline__ uint32_t to_tf32(float value) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(value));
  return out;
}

// Two consecutive K values packed into one 32-bit word of the 16-bit operand layout.
template <Mode M>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (M == Mode::LowpF16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t out;
    memcpy(&out, &h, 4);
    return out;
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t out;
    memcpy(&out, &h, 4);
    return out;
  }
}

template <Mode M>
__device__ __forceinline__ void mma_lowp(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (M == Mode::LowpF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class W, Mode M>
__global__ void __launch_bounds__(kThreads) grouped_tensor_kernel(
    DenseMatmulIdKernelParams p, const W* __restrict__ weights, const char* __restrict__ input,
    const uint32_t* __restrict__ counts, const uint32_t* __restrict__ routed,
    float* __restrict__ output) {
  constexpr bool kTf32 = M == Mode::Tf32;
  constexpr uint32_t kPitch = kTf32 ? kPitchTf32 : kPitchLowp;
  // Operand tiles as 32-bit words: [row][k-word] for activations, [column][k-word] for weights.
  __shared__ uint32_t a_tile[kTileRows * kPitch];
  __shared__ uint32_t b_tile[kTileCols * kPitch];
  __shared__ const float* row_input[kTileRows];
  __shared__ uint32_t row_flat[kTileRows];

  const uint32_t expert = blockIdx.z;
  const uint32_t count = counts[expert];
  const uint32_t row0 = blockIdx.x * kTileRows;
  const uint32_t col0 = blockIdx.y * kTileCols;
  if (row0 >= count || col0 >= p.n) return;
  const uint32_t rows = min(kTileRows, count - row0);

  const uint32_t tid = threadIdx.x;
  if (tid < kTileRows) {
    if (tid < rows) {
      const uint32_t flat = routed[static_cast<uint64_t>(expert) * p.m + row0 + tid];
      const uint32_t token = flat / p.top_k;
      const uint32_t slot = flat - token * p.top_k;
      row_flat[tid] = flat;
      row_input[tid] = reinterpret_cast<const float*>(input + token * p.input_token_stride_bytes +
                                                      slot * p.input_slot_stride_bytes);
    } else {
      row_flat[tid] = 0xFFFFFFFFu;
      row_input[tid] = nullptr;
    }
  }
  const W* expert_weights = reinterpret_cast<const W*>(reinterpret_cast<const char*>(weights) +
                                                       expert * p.expert_stride_bytes);

  const uint32_t lane = tid & 31, warp = tid >> 5;
  const uint32_t group = lane >> 2, quad = lane & 3;
  const uint32_t warp_row = (warp >> 1) * 32, warp_col = (warp & 1) * 32;
  float acc[2][4][4] = {};

  for (uint32_t k0 = 0; k0 < p.k; k0 += kSliceK) {
    __syncthreads();  // previous slice consumed (and row pointers visible on the first pass)
    // Stage the slice: thread t handles k-word (t % words) of rows t / words, + stride.
    if constexpr (kTf32) {
      for (uint32_t i = tid; i < kTileRows * kSliceK; i += kThreads) {
        const uint32_t r = i / kSliceK, kk = i % kSliceK, k = k0 + kk;
        const float* src = row_input[r];
        a_tile[r * kPitch + kk] = to_tf32(src != nullptr && k < p.k ? src[k] : 0.0f);
      }
      for (uint32_t i = tid; i < kTileCols * kSliceK; i += kThreads) {
        const uint32_t c = i / kSliceK, kk = i % kSliceK, k = k0 + kk, col = col0 + c;
        const float w = col < p.n && k < p.k ? widen(expert_weights[static_cast<uint64_t>(col) * p.k + k]) : 0.0f;
        b_tile[c * kPitch + kk] = to_tf32(w);
      }
    } else {
      constexpr uint32_t kWords = kSliceK / 2;
      for (uint32_t i = tid; i < kTileRows * kWords; i += kThreads) {
        const uint32_t r = i / kWords, kw = i % kWords, k = k0 + 2 * kw;
        const float* src = row_input[r];
        const float lo = src != nullptr && k < p.k ? src[k] : 0.0f;
        const float hi = src != nullptr && k + 1 < p.k ? src[k + 1] : 0.0f;
        a_tile[r * kPitch + kw] = pack_pair<M>(lo, hi);
      }
      for (uint32_t i = tid; i < kTileCols * kWords; i += kThreads) {
        const uint32_t c = i / kWords, kw = i % kWords, k = k0 + 2 * kw, col = col0 + c;
        const W* src = expert_weights + static_cast<uint64_t>(col) * p.k;
        const uint16_t zero = 0;
        uint16_t lo = zero, hi = zero;
        if (col < p.n && k < p.k) memcpy(&lo, src + k, 2);
        if (col < p.n && k + 1 < p.k) memcpy(&hi, src + k + 1, 2);
        b_tile[c * kPitch + kw] = uint32_t{lo} | (uint32_t{hi} << 16);
      }
    }
    __syncthreads();

    if constexpr (kTf32) {
      for (uint32_t ks = 0; ks < kSliceK; ks += 8) {
        uint32_t a[2][4], b[4][2];
        for (int mi = 0; mi < 2; ++mi) {
          const uint32_t r = warp_row + mi * 16 + group;
          a[mi][0] = a_tile[r * kPitch + ks + quad];
          a[mi][1] = a_tile[(r + 8) * kPitch + ks + quad];
          a[mi][2] = a_tile[r * kPitch + ks + quad + 4];
          a[mi][3] = a_tile[(r + 8) * kPitch + ks + quad + 4];
        }
        for (int ni = 0; ni < 4; ++ni) {
          const uint32_t c = warp_col + ni * 8 + group;
          b[ni][0] = b_tile[c * kPitch + ks + quad];
          b[ni][1] = b_tile[c * kPitch + ks + quad + 4];
        }
        for (int mi = 0; mi < 2; ++mi)
          for (int ni = 0; ni < 4; ++ni) mma_tf32(acc[mi][ni], a[mi], b[ni]);
      }
    } else {
      for (uint32_t kw = 0; kw < kSliceK / 2; kw += 8) {  // 16 K values = 8 words per MMA
        uint32_t a[2][4], b[4][2];
        for (int mi = 0; mi < 2; ++mi) {
          const uint32_t r = warp_row + mi * 16 + group;
          a[mi][0] = a_tile[r * kPitch + kw + quad];
          a[mi][1] = a_tile[(r + 8) * kPitch + kw + quad];
          a[mi][2] = a_tile[r * kPitch + kw + quad + 4];
          a[mi][3] = a_tile[(r + 8) * kPitch + kw + quad + 4];
        }
        for (int ni = 0; ni < 4; ++ni) {
          const uint32_t c = warp_col + ni * 8 + group;
          b[ni][0] = b_tile[c * kPitch + kw + quad];
          b[ni][1] = b_tile[c * kPitch + kw + quad + 4];
        }
        for (int mi = 0; mi < 2; ++mi)
          for (int ni = 0; ni < 4; ++ni) mma_lowp<M>(acc[mi][ni], a[mi], b[ni]);
      }
    }
  }

  // Scatter: accumulator (mi, ni, j) is row warp_row + mi*16 + group + 8*(j/2), column
  // warp_col + ni*8 + 2*quad + j%2.
  for (int mi = 0; mi < 2; ++mi) {
    for (int half = 0; half < 2; ++half) {
      const uint32_t r = warp_row + mi * 16 + group + 8 * half;
      if (r >= rows) continue;
      float* out_row = output + static_cast<uint64_t>(row_flat[r]) * p.n;
      for (int ni = 0; ni < 4; ++ni) {
        const uint32_t col = col0 + warp_col + ni * 8 + 2 * quad;
        if (col < p.n) out_row[col] = acc[mi][ni][2 * half];
        if (col + 1 < p.n) out_row[col + 1] = acc[mi][ni][2 * half + 1];
      }
    }
  }
}

template <class W, Mode M>
void launch_grouped_tensor(const KernelLaunch& launch, void* queue_native) {
  const BoundArg& params_arg = launch.args[0];
  if (params_arg.kind != BoundArg::Kind::Bytes || params_arg.size != sizeof(DenseMatmulIdKernelParams)) {
    throw Error("'" + launch.label + "': slot 0 must hold the 48-byte kernel params");
  }
  for (int slot = 1; slot <= 5; ++slot) {
    if (launch.args[slot].kind != BoundArg::Kind::Buffer) {
      throw Error("'" + launch.label + "': slot " + std::to_string(slot) + " must be a buffer");
    }
  }
  DenseMatmulIdKernelParams p;
  std::memcpy(&p, params_arg.data, sizeof(p));
  if (launch.grid.y > 65535 || launch.grid.z > 65535) {
    throw Error("'" + launch.label + "': grid exceeds the CUDA y/z limits");
  }
  auto stream = static_cast<cudaStream_t>(queue_native);
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(launch.grid.y),
                  static_cast<unsigned>(launch.grid.z));
  grouped_tensor_kernel<W, M><<<grid, kThreads, 0, stream>>>(
      p, static_cast<const W*>(launch.args[1].data), static_cast<const char*>(launch.args[2].data),
      static_cast<const uint32_t*>(launch.args[3].data), static_cast<const uint32_t*>(launch.args[4].data),
      static_cast<float*>(launch.args[5].data));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
  }
}

KernelDef tensor_def(std::string_view name, KernelFn fn, uint32_t pitch_words) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = kThreads;
  def.tile_x = kTileRows;
  def.tile_y = kTileCols;
  // Both operand tiles plus the per-row input pointers and flat indices.
  def.threadgroup_memory_bytes = uint64_t{2} * kTileRows * pitch_words * 4 + uint64_t{kTileRows} * (sizeof(void*) + 4);
  def.origin = "cuda_fatbin";
  def.content_sha256 = ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256;
  return def;
}

}  // namespace

void add_dense_matmul_id_tensor_kernels(std::vector<KernelDef>& out) {
  const auto& names = kDenseMatmulIdTensorPipelineNames;
  out.push_back(tensor_def(names[0], &launch_grouped_tensor<float, Mode::Tf32>, kPitchTf32));
  out.push_back(tensor_def(names[1], &launch_grouped_tensor<__half, Mode::Tf32>, kPitchTf32));
  out.push_back(tensor_def(names[2], &launch_grouped_tensor<__nv_bfloat16, Mode::Tf32>, kPitchTf32));
  out.push_back(tensor_def(names[3], &launch_grouped_tensor<__half, Mode::LowpF16>, kPitchLowp));
  out.push_back(tensor_def(names[4], &launch_grouped_tensor<__nv_bfloat16, Mode::LowpBf16>, kPitchLowp));
}

}  // namespace routemm::cuda
