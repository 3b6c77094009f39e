// The gate's per-row algorithm (the numeric contract in routemm/ops/moe.h), written once for the
// CPU and CUDA kernels: ROUTEMM_MOE_HD marks it host/device under nvcc. The Metal shader
// (metal/moe.metal) follows the same steps in MSL.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __CUDACC__
#define ROUTEMM_MOE_HD __host__ __device__ inline
#else
#define ROUTEMM_MOE_HD inline
#endif

namespace routemm::kernels {

// The ranking key of a logit: NaN ranks as -inf.
ROUTEMM_MOE_HD float moe_gate_key(float logit) {
  return logit != logit ? -std::numeric_limits<float>::infinity() : logit;
}

// Softmax over `n_experts` logits, then the top_k experts by (logit descending, index
// ascending); writes top_k weights and ids. IdT is the id element type (uint32_t or int32_t).
template <typename IdT>
ROUTEMM_MOE_HD void moe_gate_row(const float* logits, uint32_t n_experts, uint32_t top_k,
                                 bool renormalize, float* weights, IdT* ids) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float max = -kInf;
  uint32_t infinite = 0;
  for (uint32_t e = 0; e < n_experts; ++e) {
    const float z = moe_gate_key(logits[e]);
    max = z > max ? z : max;
    infinite += z == kInf ? 1u : 0u;
  }
  const bool finite_max = max > -kInf && max < kInf;
  float sum = 0.0f;
  if (finite_max) {
    for (uint32_t e = 0; e < n_experts; ++e) sum += expf(moe_gate_key(logits[e]) - max);
  }
  // Slot s takes the best expert ranked strictly after slot s - 1's.
  float prev_z = kInf;
  uint32_t prev_e = 0;
  float total = 0.0f;
  for (uint32_t s = 0; s < top_k; ++s) {
    float best_z = 0.0f;
    uint32_t best_e = n_experts;  // none yet
    for (uint32_t e = 0; e < n_experts; ++e) {
      const float z = moe_gate_key(logits[e]);
      const bool after_prev = s == 0 || z < prev_z || (z == prev_z && e > prev_e);
      if (after_prev && (best_e == n_experts || z > best_z)) {
        best_z = z;
        best_e = e;
      }
    }
    float p = 0.0f;
    if (finite_max) {
      p = expf(best_z - max) / sum;
    } else if (max == kInf && best_z == kInf) {
      p = 1.0f / static_cast<float>(infinite);
    }
    weights[s] = p;
    ids[s] = static_cast<IdT>(best_e);
    total += p;
    prev_z = best_z;
    prev_e = best_e;
  }
  if (renormalize && total > 0.0f) {
    for (uint32_t s = 0; s < top_k; ++s) weights[s] = weights[s] / total;
  }
}

// SiLU(g) * u in F32.
ROUTEMM_MOE_HD float moe_silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// gpt-oss's clamped SwiGLU in F32: g = min(g, limit), u = clamp(u, -limit, limit) (a NaN stays
// NaN), then g * sigmoid(alpha * g) * (u + 1), rounded as written: g / (1 + exp(-(alpha * g)))
// times (u + 1).
ROUTEMM_MOE_HD float moe_swiglu_oai(float g, float u, float alpha, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return g / (1.0f + expf(-(alpha * g))) * (u + 1.0f);
}

// One activation input: v scaled by the row's weight (has_scale), plus the expert's bias
// (has_bias); scale and bias together take one rounding, fma(scale, v, bias).
ROUTEMM_MOE_HD float moe_scale_bias(float v, bool has_scale, float scale, bool has_bias,
                                    float bias) {
  if (has_scale && has_bias) return fmaf(scale, v, bias);
#ifdef __CUDA_ARCH__
  // Rounded here, never contracted with the activation's next add.
  if (has_scale) return __fmul_rn(scale, v);
  return has_bias ? __fadd_rn(v, bias) : v;
#else
  if (has_scale) return scale * v;
  return has_bias ? v + bias : v;
#endif
}

}  // namespace routemm::kernels

#undef ROUTEMM_MOE_HD
