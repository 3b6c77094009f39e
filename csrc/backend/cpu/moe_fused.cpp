// CPU kernels of the fused experts block (routemm/ops/moe_experts_fused.h): each act element and
// each output element is one F32 dot product in index order (std::fma), the slots summed in order.
// The CPU has no launches to save; these kernels give the route its CPU reference (tests compare
// the CUDA kernels and the unfused block against them). Work is split by rows / tokens only.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/moe_fused_params.h"
#include "backend/common/moe_gate_row.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/moe_experts_fused.h"
#include "routemm/q4_0.h"
#include "simd.h"
#include "thread_pool.h"

#ifndef ROUTEMM_CPU_MOE_SHA256
#define ROUTEMM_CPU_MOE_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::MoeFusedKernelParams;

// The element types by the pipelines' dtype, with their exact widening and round-to-nearest-even
// narrowing.
struct F32 {
  using Raw = float;
  static float load(Raw v) { return v; }
  static Raw store(float v) { return v; }
};
struct F16 {
  using Raw = uint16_t;
  static float load(Raw v) { return simd::widen(simd::Half{v}); }
  static Raw store(float v) { return q4_0::float_to_half_bits(v); }
};
struct BF16 {
  using Raw = uint16_t;
  static float load(Raw v) { return simd::widen(simd::BFloat16{v}); }
  static Raw store(float v) {
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<Raw>((bits >> 16) | 0x0040u);
    return static_cast<Raw>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
};

// The expert of slot `r`, or -1 where the id lies outside [0, n_experts).
int64_t expert_of(const void* ids, uint64_t r, const MoeFusedKernelParams& p) {
  if (p.id_bytes == 8) {
    int64_t id;
    std::memcpy(&id, static_cast<const uint8_t*>(ids) + r * 8, 8);
    return id >= 0 && id < int64_t{p.n_experts} ? id : -1;
  }
  uint32_t id;
  std::memcpy(&id, static_cast<const uint8_t*>(ids) + r * 4, 4);
  return id < p.n_experts ? int64_t{id} : -1;
}

float routing_weight(const void* weights, uint64_t r, uint32_t dtype) {
  if (dtype == 0) return static_cast<const float*>(weights)[r];
  const uint16_t bits = static_cast<const uint16_t*>(weights)[r];
  return dtype == 1 ? simd::widen(simd::Half{bits}) : simd::widen(simd::BFloat16{bits});
}

template <class T>
float dot(const typename T::Raw* w, const typename T::Raw* x, uint64_t n) {
  float acc = 0.0f;
  for (uint64_t i = 0; i < n; ++i) acc = std::fma(T::load(w[i]), T::load(x[i]), acc);
  return acc;
}

template <class Body>
void for_each(void* queue_native, size_t count, const Body& body) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  if (pool == nullptr || pool->size() == 1 || count <= 1) {
    for (size_t i = 0; i < count; ++i) body(i);
    return;
  }
  pool->parallel_for(count, 1, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) body(i);
  });
}

template <class T>
void gate_up_kernel(const KernelLaunch& launch, void* queue_native) {
  using Raw = typename T::Raw;
  const auto p = kernels::launch_params<MoeFusedKernelParams>(launch, 0);
  const uint64_t h = p.hidden, inter = p.intermediate, rows = uint64_t{p.m} * p.top_k;
  const auto* hidden = static_cast<const Raw*>(kernels::launch_arg(launch, 1, "hidden").data);
  const void* ids = kernels::launch_arg(launch, 2, "ids").data;
  const auto* gate_up = static_cast<const Raw*>(kernels::launch_arg(launch, 3, "gate_up").data);
  const auto* up = static_cast<const Raw*>(kernels::launch_arg(launch, 4, "up").data);
  auto* act = static_cast<float*>(kernels::launch_arg(launch, 5, "act").data);
  for_each(queue_native, rows, [&](size_t r) {
    float* out = act + r * inter;
    const int64_t e = expert_of(ids, r, p);
    if (e < 0) {
      std::fill(out, out + inter, 0.0f);
      return;
    }
    const Raw* x = hidden + (r / p.top_k) * h;
    for (uint64_t j = 0; j < inter; ++j) {
      const Raw* g = p.split_gate_up ? gate_up + (uint64_t(e) * inter + j) * h
                                     : gate_up + (uint64_t(e) * 2 * inter + j) * h;
      const Raw* u = p.split_gate_up ? up + (uint64_t(e) * inter + j) * h
                                     : gate_up + (uint64_t(e) * 2 * inter + inter + j) * h;
      out[j] = kernels::moe_silu_mul(dot<T>(g, x, h), dot<T>(u, x, h));
    }
  });
}

template <class T>
void down_kernel(const KernelLaunch& launch, void* queue_native) {
  using Raw = typename T::Raw;
  const auto p = kernels::launch_params<MoeFusedKernelParams>(launch, 0);
  const uint64_t h = p.hidden, inter = p.intermediate, k = p.top_k;
  const auto* act = static_cast<const float*>(kernels::launch_arg(launch, 1, "act").data);
  const void* ids = kernels::launch_arg(launch, 2, "ids").data;
  const void* weights = kernels::launch_arg(launch, 3, "weights").data;
  const auto* down = static_cast<const Raw*>(kernels::launch_arg(launch, 4, "down").data);
  auto* output = static_cast<Raw*>(kernels::launch_arg(launch, 5, "output").data);
  for_each(queue_native, p.m, [&](size_t t) {
    for (uint64_t c = 0; c < h; ++c) {
      float acc = 0.0f;
      for (uint64_t s = 0; s < k; ++s) {
        const uint64_t r = t * k + s;
        const int64_t e = expert_of(ids, r, p);
        if (e < 0) continue;  // sentinel or invalid: contributes nothing
        const Raw* w = down + (uint64_t(e) * h + c) * inter;
        const float* a = act + r * inter;
        float d = 0.0f;
        for (uint64_t i = 0; i < inter; ++i) d = std::fma(T::load(w[i]), a[i], d);
        acc = std::fma(routing_weight(weights, r, p.weights_dtype), d, acc);
      }
      output[t * h + c] = T::store(acc);
    }
  });
}

KernelDef make_def(std::string_view name, KernelFn fn) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = 256;
  def.origin = "builtin_cpu";
  def.content_sha256 = ROUTEMM_CPU_MOE_SHA256;
  def.check_args = kernels::kernel_arg_contract(name);
  return def;
}

}  // namespace

void add_moe_fused_kernels(std::vector<KernelDef>& out) {
  const auto& names = kMoeExpertsFusedPipelineNames;
  out.push_back(make_def(names[0], gate_up_kernel<F32>));
  out.push_back(make_def(names[1], gate_up_kernel<F16>));
  out.push_back(make_def(names[2], gate_up_kernel<BF16>));
  out.push_back(make_def(names[3], down_kernel<F32>));
  out.push_back(make_def(names[4], down_kernel<F16>));
  out.push_back(make_def(names[5], down_kernel<BF16>));
}

}  // namespace routemm::cpu
