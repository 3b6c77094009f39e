// CUDA kernels of the MoE layer (csrc/ops/moe.cpp): moe_gate_softmax_topk_f32, moe_silu_mul_f32
// and moe_combine_f32, following the numeric contract in routemm/ops/moe.h. The gate runs the
// row algorithm shared with the CPU kernel (backend/common/moe_gate_row.h), one thread per token.
//
// Geometry: the front door encodes grid [ceil(m / 128), 1, 1] (gate), [ceil(width / 128), rows, 1]
// (silu_mul) and [ceil(hidden / 128), m, 1] (combine) with 128 threads, which receipts show; the
// launches flatten the element grids into x with a grid-stride loop (no 65535 limit on rows). Every
// output element is written by one thread from its own inputs, so no result depends on the grid.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/moe_gate_row.h"
#include "backend/common/moe_params.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/moe.h"

#ifndef ROUTEMM_CUDA_MOE_SHA256
#define ROUTEMM_CUDA_MOE_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::MoeCombineKernelParams;
using kernels::MoeGateKernelParams;
using kernels::MoeSiluMulKernelParams;

constexpr uint32_t kThreads = 128;
constexpr uint64_t kMaxBlocks = 65535;

__global__ void gate_kernel(MoeGateKernelParams p, const float* __restrict__ logits,
                            float* __restrict__ weights, uint32_t* __restrict__ ids,
                            const float* __restrict__ bias, const float* __restrict__ router_bias) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t t = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < p.m; t += stride) {
    kernels::moe_gate_row(logits + t * p.n_experts, router_bias, bias, p, weights + t * p.top_k,
                          ids + t * p.top_k);
  }
}

// Optional inputs (ids, weights, biases) are null unless the params' flags name them.
__global__ void silu_mul_kernel(MoeSiluMulKernelParams p, const float* __restrict__ gate,
                                const float* __restrict__ up, float* __restrict__ out,
                                const uint32_t* __restrict__ ids, const float* __restrict__ scale,
                                const float* __restrict__ gate_bias,
                                const float* __restrict__ up_bias) {
  const uint64_t total = uint64_t{p.rows} * p.width;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const bool oai = p.activation == kernels::kMoeActivationSwigluOai;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    const uint64_t r = i / p.width, c = i - r * p.width;
    const float w = scale != nullptr ? scale[r] : 1.0f;
    const uint32_t e = ids != nullptr ? ids[r] : p.n_experts;
    const bool valid = e < p.n_experts;
    const bool gb = valid && gate_bias != nullptr, ub = valid && up_bias != nullptr;
    const float g =
        kernels::moe_scale_bias(gate[r * p.gate_row_stride + c], scale != nullptr, w, gb,
                                gb ? gate_bias[uint64_t{e} * p.bias_row_stride + c] : 0.0f);
    const float u =
        kernels::moe_scale_bias(up[r * p.up_row_stride + c], scale != nullptr, w, ub,
                                ub ? up_bias[uint64_t{e} * p.bias_row_stride + c] : 0.0f);
    out[i] = oai ? kernels::moe_swiglu_oai(g, u, p.alpha, p.limit) : kernels::moe_silu_mul(g, u);
  }
}

__global__ void combine_kernel(MoeCombineKernelParams p, const float* __restrict__ rows,
                               const float* __restrict__ weights, const uint32_t* __restrict__ ids,
                               float* __restrict__ out, const float* __restrict__ bias) {
  const uint64_t total = uint64_t{p.m} * p.hidden;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const bool unit = (p.flags & kernels::kMoeCombineUnitWeights) != 0;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    const uint64_t t = i / p.hidden, h = i - t * p.hidden;
    float acc = 0.0f;
    for (uint32_t s = 0; s < p.top_k; ++s) {
      const uint64_t flat = t * p.top_k + s;
      const uint32_t e = ids[flat];
      if (e >= p.n_experts) continue;  // sentinel or invalid: skipped
      float row = rows[flat * p.hidden + h];
      if (bias != nullptr) row = __fadd_rn(row, bias[uint64_t{e} * p.hidden + h]);
      acc = fmaf(unit ? 1.0f : weights[flat], row, acc);
    }
    out[i] = acc;
  }
}

template <typename T>
T* arg(const KernelLaunch& launch, size_t slot, const char* what) {
  return static_cast<T*>(kernels::launch_arg(launch, slot, what).data);
}

unsigned blocks_for(uint64_t elements) {
  return static_cast<unsigned>(
      std::clamp<uint64_t>((elements + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

void check_launch(const KernelLaunch& launch) {
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error(launch.label + ": launch failed: " + cudaGetErrorString(e));
  }
}

void launch_gate(const KernelLaunch& launch, void* stream_ptr) {
  const auto p = kernels::launch_params<MoeGateKernelParams>(launch, 0);
  if (!kernels::moe_gate_params_valid(p)) throw Error(launch.label + ": invalid gate params");
  gate_kernel<<<blocks_for(p.m), kThreads, 0, static_cast<cudaStream_t>(stream_ptr)>>>(
      p, arg<const float>(launch, 1, "logits"), arg<float>(launch, 2, "weights"),
      arg<uint32_t>(launch, 3, "ids"), arg<const float>(launch, 4, "bias"),
      arg<const float>(launch, 5, "router_bias"));
  check_launch(launch);
}

template <typename T>
T* optional_arg(const KernelLaunch& launch, size_t slot, const char* what, bool used) {
  return used ? arg<T>(launch, slot, what) : nullptr;
}

void launch_silu_mul(const KernelLaunch& launch, void* stream_ptr) {
  const auto p = kernels::launch_params<MoeSiluMulKernelParams>(launch, 0);
  if (p.rows == 0 || p.width == 0) throw Error(launch.label + ": invalid silu_mul params");
  const bool gate_biased = (p.flags & kernels::kMoeActGateBias) != 0;
  const bool up_biased = (p.flags & kernels::kMoeActUpBias) != 0;
  silu_mul_kernel<<<blocks_for(uint64_t{p.rows} * p.width), kThreads, 0,
                    static_cast<cudaStream_t>(stream_ptr)>>>(
      p, arg<const float>(launch, 1, "gate"), arg<const float>(launch, 2, "up"),
      arg<float>(launch, 3, "output"),
      optional_arg<const uint32_t>(launch, 4, "ids", gate_biased || up_biased),
      optional_arg<const float>(launch, 5, "weights", (p.flags & kernels::kMoeActScaleRows) != 0),
      optional_arg<const float>(launch, 6, "gate bias", gate_biased),
      optional_arg<const float>(launch, 7, "up bias", up_biased));
  check_launch(launch);
}

void launch_combine(const KernelLaunch& launch, void* stream_ptr) {
  const auto p = kernels::launch_params<MoeCombineKernelParams>(launch, 0);
  if (p.m == 0 || p.top_k == 0 || p.hidden == 0)
    throw Error(launch.label + ": invalid combine params");
  combine_kernel<<<blocks_for(uint64_t{p.m} * p.hidden), kThreads, 0,
                   static_cast<cudaStream_t>(stream_ptr)>>>(
      p, arg<const float>(launch, 1, "rows"), arg<const float>(launch, 2, "weights"),
      arg<const uint32_t>(launch, 3, "ids"), arg<float>(launch, 4, "output"),
      optional_arg<const float>(launch, 5, "bias", (p.flags & kernels::kMoeCombineBias) != 0));
  check_launch(launch);
}

KernelDef def(std::string_view name, KernelFn fn) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.max_threads_per_threadgroup = 1024;
  d.threads_per_group = kThreads;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_MOE_SHA256;
  d.check_args = kernels::kernel_arg_contract(name);
  return d;
}

}  // namespace

void add_moe_kernels(std::vector<KernelDef>& out) {
  out.push_back(def(kMoeGatePipeline, launch_gate));
  out.push_back(def(kMoeSiluMulPipeline, launch_silu_mul));
  out.push_back(def(kMoeCombinePipeline, launch_combine));
}

}  // namespace routemm::cuda
