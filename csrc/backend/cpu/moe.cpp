// CPU kernels of the MoE layer (csrc/ops/moe.cpp): moe_gate_softmax_topk_f32, moe_silu_mul_f32 and
// moe_combine_f32, each following the numeric contract in routemm/ops/moe.h. Work is split across
// the thread pool by rows only, so no result depends on the thread count.
#include "routemm/ops/moe.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/moe_gate_row.h"
#include "backend/common/moe_params.h"
#include "kernels.h"
#include "routemm/error.h"
#include "thread_pool.h"

#ifndef ROUTEMM_CPU_MOE_SHA256
#define ROUTEMM_CPU_MOE_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::MoeCombineKernelParams;
using kernels::MoeGateKernelParams;
using kernels::MoeSiluMulKernelParams;

// The front door validated every extent; these products only keep a corrupt launch from becoming
// an out-of-bounds access.
size_t bytes_of(const KernelLaunch& launch, std::initializer_list<size_t> factors) {
  size_t value = 1;
  for (const size_t factor : factors) {
    if (__builtin_mul_overflow(value, factor, &value)) {
      throw Error(launch.label + ": size overflow");
    }
  }
  return value;
}

template <typename T>
T* arg(const KernelLaunch& launch, size_t slot, size_t need, const char* what) {
  return static_cast<T*>(kernels::launch_arg(launch, slot, what, need).data);
}

// body(row) for every row in [0, rows), rows split across the pool.
template <typename Body>
void for_rows(void* queue_native, size_t rows, size_t grain, const Body& body) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  if (pool == nullptr || pool->size() == 1 || rows <= grain) {
    for (size_t r = 0; r < rows; ++r) body(r);
    return;
  }
  pool->parallel_for(rows, grain, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) body(r);
  });
}

void gate_kernel(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<MoeGateKernelParams>(launch, 0);
  if (!kernels::moe_gate_params_valid(p)) throw Error(launch.label + ": invalid gate params");
  const auto* logits =
      arg<const float>(launch, 1, bytes_of(launch, {p.m, p.n_experts, 4}), "logits");
  auto* weights = arg<float>(launch, 2, bytes_of(launch, {p.m, p.top_k, 4}), "weights");
  auto* ids = arg<uint32_t>(launch, 3, bytes_of(launch, {p.m, p.top_k, 4}), "ids");
  const auto* bias = arg<const float>(launch, 4, bytes_of(launch, {p.n_experts, 4}), "bias");
  const auto* router_bias =
      arg<const float>(launch, 5, bytes_of(launch, {p.n_experts, 4}), "router_bias");
  for_rows(queue_native, p.m, 16, [&](size_t t) {
    kernels::moe_gate_row(logits + t * p.n_experts, router_bias, bias, p, weights + t * p.top_k,
                          ids + t * p.top_k);
  });
}

void silu_mul_kernel(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<MoeSiluMulKernelParams>(launch, 0);
  if (p.rows == 0 || p.width == 0 || p.gate_row_stride < p.width || p.up_row_stride < p.width) {
    throw Error(launch.label + ": invalid silu_mul params");
  }
  const auto extent = [&](uint64_t rows, uint64_t stride) {
    return bytes_of(launch, {static_cast<size_t>((rows - 1ull) * stride + p.width), 4});
  };
  const auto* gate = arg<const float>(launch, 1, extent(p.rows, p.gate_row_stride), "gate");
  const auto* up = arg<const float>(launch, 2, extent(p.rows, p.up_row_stride), "up");
  auto* out = arg<float>(launch, 3, bytes_of(launch, {p.rows, p.width, 4}), "output");
  const bool scaled = (p.flags & kernels::kMoeActScaleRows) != 0;
  const bool gate_biased = (p.flags & kernels::kMoeActGateBias) != 0;
  const bool up_biased = (p.flags & kernels::kMoeActUpBias) != 0;
  const uint32_t* ids = gate_biased || up_biased
                            ? arg<const uint32_t>(launch, 4, bytes_of(launch, {p.rows, 4}), "ids")
                            : nullptr;
  const float* scale =
      scaled ? arg<const float>(launch, 5, bytes_of(launch, {p.rows, 4}), "weights") : nullptr;
  const float* gate_bias =
      gate_biased ? arg<const float>(launch, 6, extent(p.n_experts, p.bias_row_stride), "gate bias")
                  : nullptr;
  const float* up_bias =
      up_biased ? arg<const float>(launch, 7, extent(p.n_experts, p.bias_row_stride), "up bias")
                : nullptr;
  const bool oai = p.activation == kernels::kMoeActivationSwigluOai;
  for_rows(queue_native, p.rows, 8, [&](size_t r) {
    const float* g = gate + r * p.gate_row_stride;
    const float* u = up + r * p.up_row_stride;
    float* o = out + r * p.width;
    const float w = scaled ? scale[r] : 1.0f;
    const bool valid = ids != nullptr && ids[r] < p.n_experts;
    const float* gb =
        valid && gate_biased ? gate_bias + size_t{ids[r]} * p.bias_row_stride : nullptr;
    const float* ub = valid && up_biased ? up_bias + size_t{ids[r]} * p.bias_row_stride : nullptr;
    for (size_t c = 0; c < p.width; ++c) {
      const float gv = kernels::moe_scale_bias(g[c], scaled, w, gb != nullptr, gb ? gb[c] : 0.0f);
      const float uv = kernels::moe_scale_bias(u[c], scaled, w, ub != nullptr, ub ? ub[c] : 0.0f);
      o[c] =
          oai ? kernels::moe_swiglu_oai(gv, uv, p.alpha, p.limit) : kernels::moe_silu_mul(gv, uv);
    }
  });
}

void combine_kernel(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<MoeCombineKernelParams>(launch, 0);
  if (p.m == 0 || p.top_k == 0 || p.hidden == 0 || p.n_experts == 0) {
    throw Error(launch.label + ": invalid combine params");
  }
  const auto* rows =
      arg<const float>(launch, 1, bytes_of(launch, {p.m, p.top_k, p.hidden, 4}), "rows");
  const auto* weights = arg<const float>(launch, 2, bytes_of(launch, {p.m, p.top_k, 4}), "weights");
  const auto* ids = arg<const uint32_t>(launch, 3, bytes_of(launch, {p.m, p.top_k, 4}), "ids");
  auto* out = arg<float>(launch, 4, bytes_of(launch, {p.m, p.hidden, 4}), "output");
  const bool unit = (p.flags & kernels::kMoeCombineUnitWeights) != 0;
  const float* bias =
      (p.flags & kernels::kMoeCombineBias) != 0
          ? arg<const float>(launch, 5, bytes_of(launch, {p.n_experts, p.hidden, 4}), "bias")
          : nullptr;
  for_rows(queue_native, p.m, 4, [&](size_t t) {
    float* o = out + t * p.hidden;
    std::fill(o, o + p.hidden, 0.0f);
    for (size_t s = 0; s < p.top_k; ++s) {
      const uint32_t e = ids[t * p.top_k + s];
      if (e >= p.n_experts) continue;  // sentinel or invalid: skipped
      const float w = unit ? 1.0f : weights[t * p.top_k + s];
      const float* row = rows + (t * p.top_k + s) * p.hidden;
      if (bias != nullptr) {
        const float* b = bias + size_t{e} * p.hidden;
        for (size_t h = 0; h < p.hidden; ++h) o[h] = std::fma(w, row[h] + b[h], o[h]);
      } else {
        for (size_t h = 0; h < p.hidden; ++h) o[h] = std::fma(w, row[h], o[h]);
      }
    }
  });
}

KernelDef make_def(std::string_view name, KernelFn fn) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = 64;  // sizes the grid the front door encodes; the CPU kernels ignore it
  def.origin = "builtin_cpu";
  def.content_sha256 = ROUTEMM_CPU_MOE_SHA256;
  def.check_args = kernels::kernel_arg_contract(name);
  return def;
}

}  // namespace

void add_moe_kernels(std::vector<KernelDef>& out) {
  out.push_back(make_def(kMoeGatePipeline, gate_kernel));
  out.push_back(make_def(kMoeSiluMulPipeline, silu_mul_kernel));
  out.push_back(make_def(kMoeCombinePipeline, combine_kernel));
}

}  // namespace routemm::cpu
