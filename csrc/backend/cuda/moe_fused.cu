// CUDA kernels of the fused experts block (routemm/ops/moe_experts_fused.h), for decode-sized
// batches: two launches for the whole block, reading the hidden states, the ids (int32 or int64)
// and the routing weights as the model holds them, so the torch op needs no conversion launches.
//
// gate_up: block (x, y) = 8 warps, warp w computes act column j = 8x + w of slot row y: the gate
//   and up dot products over H in 16-byte vectors (8 bf16/f16 or 4 f32 per lane and step), each
//   lane keeping F32 partials, summed by a warp butterfly; lane 0 writes SiLU(g) * u.
// down: block (x, y) covers output columns 8x .. 8x + 7 of token y: its 8 warps share the
//   top_k * 8 (slot, column) dot products over I, park them in shared memory, and one thread per
//   column sums the slots in order (an F32 fma chain from +0.0f) and rounds once to the output
//   dtype. Nothing depends on the grid or on the other rows of the batch.
// Both are bound by the touched experts' weight bytes: every weight byte is read once per row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/moe_fused_params.h"
#include "backend/common/moe_gate_row.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/moe_experts_fused.h"

#ifndef ROUTEMM_CUDA_MOE_SHA256
#define ROUTEMM_CUDA_MOE_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::MoeFusedKernelParams;

constexpr uint32_t kWarps = 8;
constexpr uint32_t kThreads = 32 * kWarps;
constexpr uint32_t kColumns = 8;  // output columns per block of the down kernel

// A 16-byte vector of the element type widened to F32: kVec values.
template <class T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr uint32_t kVec = 4;
  __device__ static void widen(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ static float store(float v) { return v; }
};
template <>
struct Vec<__nv_bfloat16> {
  static constexpr uint32_t kVec = 8;
  __device__ static void widen(const uint4& v, float* out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Vec<__half> {
  static constexpr uint32_t kVec = 8;
  __device__ static void widen(const uint4& v, float* out) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};

__device__ inline uint4 load_stream(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The expert of slot row r, or -1 where its id lies outside [0, n_experts).
__device__ inline int64_t expert_of(const void* ids, uint64_t r, const MoeFusedKernelParams& p) {
  if (p.id_bytes == 8) {
    const int64_t id = static_cast<const int64_t*>(ids)[r];
    return id >= 0 && id < int64_t{p.n_experts} ? id : -1;
  }
  const uint32_t id = static_cast<const uint32_t*>(ids)[r];
  return id < p.n_experts ? int64_t{id} : -1;
}

__device__ inline float routing_weight(const void* weights, uint64_t r, uint32_t dtype) {
  if (dtype == 0) return static_cast<const float*>(weights)[r];
  if (dtype == 1) return __half2float(static_cast<const __half*>(weights)[r]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(weights)[r]);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    gate_up_kernel(MoeFusedKernelParams p, const T* __restrict__ hidden,
                   const void* __restrict__ ids, const T* __restrict__ gate_up,
                   const T* __restrict__ up, float* __restrict__ act) {
  constexpr uint32_t kVec = Vec<T>::kVec;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t r = blockIdx.y;
  const uint64_t j = uint64_t{blockIdx.x} * kWarps + warp;
  const uint64_t h = p.hidden, inter = p.intermediate;
  if (j >= inter) return;
  const int64_t e = expert_of(ids, r, p);
  if (e < 0) {
    if (lane == 0) act[r * inter + j] = 0.0f;
    return;
  }
  const T* g = p.split_gate_up ? gate_up + (uint64_t(e) * inter + j) * h
                               : gate_up + (uint64_t(e) * 2 * inter + j) * h;
  const T* u = p.split_gate_up ? up + (uint64_t(e) * inter + j) * h
                               : gate_up + (uint64_t(e) * 2 * inter + inter + j) * h;
  const T* x = hidden + (r / p.top_k) * h;
  float acc_g = 0.0f, acc_u = 0.0f;
#pragma unroll 4
  for (uint64_t k = uint64_t{lane} * kVec; k < h; k += 32 * kVec) {
    float gv[kVec], uv[kVec], xv[kVec];
    Vec<T>::widen(load_stream(g + k), gv);
    Vec<T>::widen(load_stream(u + k), uv);
    Vec<T>::widen(load_stream(x + k), xv);
#pragma unroll
    for (uint32_t i = 0; i < kVec; ++i) {
      acc_g = fmaf(gv[i], xv[i], acc_g);
      acc_u = fmaf(uv[i], xv[i], acc_u);
    }
  }
  acc_g = warp_sum(acc_g);
  acc_u = warp_sum(acc_u);
  if (lane == 0) act[r * inter + j] = kernels::moe_silu_mul(acc_g, acc_u);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    down_kernel(MoeFusedKernelParams p, const float* __restrict__ act, const void* __restrict__ ids,
                const void* __restrict__ weights, const T* __restrict__ down, T* __restrict__ out) {
  constexpr uint32_t kVec = Vec<T>::kVec;
  __shared__ float partial[kMoeExpertsFusedMaxTopK][kColumns];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint64_t t = blockIdx.y, h = p.hidden, inter = p.intermediate, k = p.top_k;
  const uint64_t base = uint64_t{blockIdx.x} * kColumns;
  for (uint32_t item = warp; item < p.top_k * kColumns; item += kWarps) {
    const uint32_t s = item / kColumns, c = item % kColumns;
    const uint64_t col = base + c, r = t * k + s;
    if (col >= h) continue;
    const int64_t e = expert_of(ids, r, p);
    if (e < 0) continue;  // skipped in the slot sum below
    const T* w = down + (uint64_t(e) * h + col) * inter;
    const float* a = act + r * inter;
    float acc = 0.0f;
#pragma unroll 4
    for (uint64_t i = uint64_t{lane} * kVec; i < inter; i += 32 * kVec) {
      float wv[kVec];
      Vec<T>::widen(load_stream(w + i), wv);
#pragma unroll
      for (uint32_t v = 0; v < kVec; v += 4) {
        const float4 av = *reinterpret_cast<const float4*>(a + i + v);
        acc = fmaf(wv[v], av.x, acc);
        acc = fmaf(wv[v + 1], av.y, acc);
        acc = fmaf(wv[v + 2], av.z, acc);
        acc = fmaf(wv[v + 3], av.w, acc);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) partial[s][c] = acc;
  }
  __syncthreads();
  if (threadIdx.x < kColumns && base + threadIdx.x < h) {
    const uint32_t c = threadIdx.x;
    float acc = 0.0f;
    for (uint64_t s = 0; s < k; ++s) {
      const uint64_t r = t * k + s;
      if (expert_of(ids, r, p) < 0) continue;  // sentinel or invalid: contributes nothing
      acc = fmaf(routing_weight(weights, r, p.weights_dtype), partial[s][c], acc);
    }
    out[t * h + base + c] = Vec<T>::store(acc);
  }
}

void check_launch(const KernelLaunch& launch) {
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error(launch.label + ": launch failed: " + cudaGetErrorString(e));
  }
}

MoeFusedKernelParams checked_params(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<MoeFusedKernelParams>(launch, 0);
  if (p.m == 0 || p.top_k == 0 || p.top_k > kMoeExpertsFusedMaxTopK || p.hidden == 0 ||
      p.intermediate == 0 || uint64_t{p.m} * p.top_k > 0xFFFFFFFFull) {
    throw Error(launch.label + ": invalid fused block params");
  }
  return p;
}

// Grid y carries rows (gate_up) or tokens (down): at most 65535 per launch, so larger batches
// launch in chunks of rows, each with its own base pointers.
constexpr uint64_t kMaxGridY = 65535;

template <class T>
void launch_gate_up(const KernelLaunch& launch, void* stream_ptr) {
  auto p = checked_params(launch);
  const auto* hidden = static_cast<const T*>(kernels::launch_arg(launch, 1, "hidden").data);
  const auto* ids = static_cast<const uint8_t*>(kernels::launch_arg(launch, 2, "ids").data);
  const auto* gate_up = static_cast<const T*>(kernels::launch_arg(launch, 3, "gate_up").data);
  const auto* up = static_cast<const T*>(kernels::launch_arg(launch, 4, "up").data);
  auto* act = static_cast<float*>(kernels::launch_arg(launch, 5, "act").data);
  const uint64_t tokens = p.m;
  // Chunks of whole tokens, so that a row's token stays r / top_k within its chunk.
  const uint64_t tokens_per_chunk = std::max<uint64_t>(1, kMaxGridY / p.top_k);
  for (uint64_t t0 = 0; t0 < tokens; t0 += tokens_per_chunk) {
    MoeFusedKernelParams chunk = p;
    chunk.m = static_cast<uint32_t>(std::min(tokens_per_chunk, tokens - t0));
    const uint64_t r0 = t0 * p.top_k;
    const dim3 grid((p.intermediate + kWarps - 1) / kWarps, chunk.m * p.top_k, 1);
    gate_up_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
        chunk, hidden + t0 * p.hidden, ids + r0 * p.id_bytes, gate_up, up,
        act + r0 * p.intermediate);
  }
  check_launch(launch);
}

template <class T>
void launch_down(const KernelLaunch& launch, void* stream_ptr) {
  auto p = checked_params(launch);
  const auto* act = static_cast<const float*>(kernels::launch_arg(launch, 1, "act").data);
  const auto* ids = static_cast<const uint8_t*>(kernels::launch_arg(launch, 2, "ids").data);
  const auto* weights = static_cast<const uint8_t*>(kernels::launch_arg(launch, 3, "weights").data);
  const auto* down = static_cast<const T*>(kernels::launch_arg(launch, 4, "down").data);
  auto* out = static_cast<T*>(kernels::launch_arg(launch, 5, "output").data);
  const uint64_t wsize = kernels::moe_fused_weights_size(p.weights_dtype);
  for (uint64_t t0 = 0; t0 < p.m; t0 += kMaxGridY) {
    MoeFusedKernelParams chunk = p;
    chunk.m = static_cast<uint32_t>(std::min<uint64_t>(kMaxGridY, p.m - t0));
    const uint64_t r0 = t0 * p.top_k;
    const dim3 grid((p.hidden + kColumns - 1) / kColumns, chunk.m, 1);
    down_kernel<T><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
        chunk, act + r0 * p.intermediate, ids + r0 * p.id_bytes, weights + r0 * wsize, down,
        out + t0 * p.hidden);
  }
  check_launch(launch);
}

KernelDef def(std::string_view name, KernelFn fn) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.max_threads_per_threadgroup = kThreads;
  d.threads_per_group = kThreads;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_MOE_SHA256;
  d.check_args = kernels::kernel_arg_contract(name);
  return d;
}

}  // namespace

void add_moe_fused_kernels(std::vector<KernelDef>& out) {
  const auto& names = kMoeExpertsFusedPipelineNames;
  out.push_back(def(names[0], launch_gate_up<float>));
  out.push_back(def(names[1], launch_gate_up<__half>));
  out.push_back(def(names[2], launch_gate_up<__nv_bfloat16>));
  out.push_back(def(names[3], launch_down<float>));
  out.push_back(def(names[4], launch_down<__half>));
  out.push_back(def(names[5], launch_down<__nv_bfloat16>));
}

}  // namespace routemm::cuda
