// The gate's per-row algorithm (the numeric contract in routemm/ops/moe.h), written once for the
// CPU and CUDA kernels: ROUTEMM_MOE_HD marks it host/device under nvcc. The Metal shader
// (metal/moe.metal) follows the same steps in MSL.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "backend/common/moe_params.h"

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

// Whether kernel params are ones the front door encodes: nonzero extents, flags 0 or 1, groups
// that divide the experts, topk_group in [1, groups] and top_k within the kept groups' experts
// (so a selection always finds an expert).
ROUTEMM_MOE_HD bool moe_gate_params_valid(const MoeGateKernelParams& p) {
  if (p.m == 0 || p.n_experts == 0 || p.top_k == 0 || p.top_k > p.n_experts) return false;
  if (p.renormalize > 1 || p.scoring > 1 || p.has_bias > 1 || p.has_router_bias > 1) return false;
  if (p.num_expert_group == 0) return p.topk_group == 0;
  return p.n_experts % p.num_expert_group == 0 && p.topk_group >= 1 &&
         p.topk_group <= p.num_expert_group &&
         uint64_t{p.top_k} <= uint64_t{p.topk_group} * (p.n_experts / p.num_expert_group);
}

// Expert e's ranking key as every later step reads it: the logit plus its router bias (one F32
// add) when p.has_router_bias is 1, else the logit; NaN ranks as -inf. router_bias is read only
// with the flag.
ROUTEMM_MOE_HD float moe_gate_logit(const float* logits, const float* router_bias, uint32_t e,
                                    const MoeGateKernelParams& p) {
  return moe_gate_key(p.has_router_bias != 0 ? logits[e] + router_bias[e] : logits[e]);
}

// What a row's scores need: softmax's largest key, sum of exp(key - max) (F32, experts in
// increasing order) and count of +inf keys; sigmoid needs none of them.
struct MoeGateRowStats {
  float max;
  float sum;
  uint32_t infinite;
  bool finite_max;
};

ROUTEMM_MOE_HD MoeGateRowStats moe_gate_row_stats(const float* logits, const float* router_bias,
                                                  const MoeGateKernelParams& p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  MoeGateRowStats r{-kInf, 0.0f, 0u, false};
  if (p.scoring != 0) return r;
  for (uint32_t e = 0; e < p.n_experts; ++e) {
    const float z = moe_gate_logit(logits, router_bias, e, p);
    r.max = z > r.max ? z : r.max;
    r.infinite += z == kInf ? 1u : 0u;
  }
  r.finite_max = r.max > -kInf && r.max < kInf;
  if (r.finite_max) {
    for (uint32_t e = 0; e < p.n_experts; ++e) {
      r.sum += expf(moe_gate_logit(logits, router_bias, e, p) - r.max);
    }
  }
  return r;
}

// Expert e's score: its softmax probability (max = +inf: the +inf experts share the mass; no
// logit above -inf: 0), or sigmoid(key).
ROUTEMM_MOE_HD float moe_gate_score(const float* logits, const float* router_bias, uint32_t e,
                                    const MoeGateRowStats& r, const MoeGateKernelParams& p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float z = moe_gate_logit(logits, router_bias, e, p);
  if (p.scoring != 0) return 1.0f / (1.0f + expf(-z));
  if (r.finite_max) return expf(z - r.max) / r.sum;
  return r.max == kInf && z == kInf ? 1.0f / static_cast<float>(r.infinite) : 0.0f;
}

// Expert e's selection score: score + bias (NaN ranks as -inf), or the score without a bias.
ROUTEMM_MOE_HD float moe_gate_biased(const float* logits, const float* router_bias,
                                     const float* bias, uint32_t e, const MoeGateRowStats& r,
                                     const MoeGateKernelParams& p) {
  const float s = moe_gate_score(logits, router_bias, e, r, p);
  return p.has_bias != 0 ? moe_gate_key(s + bias[e]) : s;
}

// Expert e's ranking key: the selection score with a bias; without one the (router-biased)
// logit, which every scoring function preserves the order of (so ranks are exact, not those of
// rounded scores).
ROUTEMM_MOE_HD float moe_gate_rank_key(const float* logits, const float* router_bias,
                                       const float* bias, uint32_t e, const MoeGateRowStats& r,
                                       const MoeGateKernelParams& p) {
  return p.has_bias != 0 ? moe_gate_biased(logits, router_bias, bias, e, r, p)
                         : moe_gate_logit(logits, router_bias, e, p);
}

// Group g's score: the sum of its two largest selection scores (its one score when groups hold
// one expert), NaN ranked as -inf.
ROUTEMM_MOE_HD float moe_gate_group_score(const float* logits, const float* router_bias,
                                          const float* bias, uint32_t g, uint32_t group_size,
                                          const MoeGateRowStats& r, const MoeGateKernelParams& p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float first = -kInf, second = -kInf;
  for (uint32_t e = g * group_size; e < (g + 1) * group_size; ++e) {
    const float v = moe_gate_biased(logits, router_bias, bias, e, r, p);
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return group_size == 1 ? first : moe_gate_key(first + second);
}

// The gate of one row (routemm/ops/moe.h): router-biased logits, scores, the kept groups, then
// the top_k experts of the kept groups by (rank key descending, index ascending); writes top_k
// weights (scores without the selection bias, renormalised, scaled) and ids. router_bias is read
// only when p.has_router_bias is 1, bias only when p.has_bias is 1. IdT is the id element type
// (uint32_t or int32_t).
template <typename IdT>
ROUTEMM_MOE_HD void moe_gate_row(const float* logits, const float* router_bias, const float* bias,
                                 const MoeGateKernelParams& p, float* weights, IdT* ids) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const MoeGateRowStats r = moe_gate_row_stats(logits, router_bias, p);
  const uint32_t groups = p.num_expert_group == 0 ? 1u : p.num_expert_group;
  const uint32_t group_size = p.n_experts / groups;
  // The last kept group, found as slot topk_group - 1 of a top-k over groups (score descending,
  // index ascending): group g is kept when it ranks at or before it.
  float kept_score = -kInf;
  uint32_t kept_g = groups - 1;
  if (groups > 1) {
    float prev = kInf;
    uint32_t prev_g = 0;
    for (uint32_t j = 0; j < p.topk_group; ++j) {
      float best = 0.0f;
      uint32_t best_g = groups;  // none yet
      for (uint32_t g = 0; g < groups; ++g) {
        const float v = moe_gate_group_score(logits, router_bias, bias, g, group_size, r, p);
        const bool after_prev = j == 0 || v < prev || (v == prev && g > prev_g);
        if (after_prev && (best_g == groups || v > best)) {
          best = v;
          best_g = g;
        }
      }
      prev = best;
      prev_g = best_g;
    }
    kept_score = prev;
    kept_g = prev_g;
  }
  // Slot s takes the best expert of a kept group ranked strictly after slot s - 1's.
  float prev_z = kInf;
  uint32_t prev_e = 0;
  float total = 0.0f;
  for (uint32_t s = 0; s < p.top_k; ++s) {
    float best_z = 0.0f;
    uint32_t best_e = p.n_experts;  // none yet
    for (uint32_t g = 0; g < groups; ++g) {
      if (groups > 1) {
        const float v = moe_gate_group_score(logits, router_bias, bias, g, group_size, r, p);
        if (!(v > kept_score || (v == kept_score && g <= kept_g))) continue;
      }
      for (uint32_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float z = moe_gate_rank_key(logits, router_bias, bias, e, r, p);
        const bool after_prev = s == 0 || z < prev_z || (z == prev_z && e > prev_e);
        if (after_prev && (best_e == p.n_experts || z > best_z)) {
          best_z = z;
          best_e = e;
        }
      }
    }
    const float w = moe_gate_score(logits, router_bias, best_e, r, p);
    weights[s] = w;
    ids[s] = static_cast<IdT>(best_e);
    total += w;
    prev_z = best_z;
    prev_e = best_e;
  }
  for (uint32_t s = 0; s < p.top_k; ++s) {
    const float w = p.renormalize != 0 && total > 0.0f ? weights[s] / total : weights[s];
    weights[s] = w * p.routed_scaling_factor;
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
