// MoE layer pipelines (csrc/ops/moe.cpp): moe_gate_softmax_topk_f32, moe_silu_mul_f32 and
// moe_combine_f32, following the numeric contract in csrc/include/routemm/ops/moe.h (the CPU and
// CUDA kernels share csrc/backend/common/moe_gate_row.h; this file takes the same steps in MSL).
//
// Bindings and geometry are the front door's with the KernelDefs of csrc/backend/metal/kernels.cpp:
//   gate    : 0 params, 1 logits, 2 weights, 3 ids, 4 bias (the logits when has_bias is 0), 5
//             router bias (the logits when has_router_bias is 0); grid [ceil(m / 64), 1, 1], 64
//             threads, one thread per token row.
//   silu_mul: 0 params, 1 gate, 2 up, 3 output, by flag 4 ids, 5 weights, 6 gate bias, 7 up
//             bias; grid [ceil(width / 64), rows, 1], 64 threads.
//   combine : 0 params, 1 rows, 2 weights, 3 ids, 4 output, by flag 5 bias; grid
//             [ceil(hidden / 64), m, 1], 64 threads, one thread per output element, slots summed
//             in order.
#include <metal_stdlib>

#include "backend/common/moe_params.h"

using namespace metal;
using routemm::kernels::MoeCombineKernelParams;
using routemm::kernels::MoeGateKernelParams;
using routemm::kernels::MoeSiluMulKernelParams;
using routemm::kernels::kMoeActivationSwigluOai;
using routemm::kernels::kMoeActGateBias;
using routemm::kernels::kMoeActScaleRows;
using routemm::kernels::kMoeActUpBias;
using routemm::kernels::kMoeCombineBias;
using routemm::kernels::kMoeCombineUnitWeights;

namespace {

inline float positive_infinity() { return as_type<float>(0x7f800000u); }

// The ranking key of a logit: NaN ranks as -inf.
inline float gate_key(float logit) { return logit != logit ? -positive_infinity() : logit; }

// Expert e's key as every later step reads it: logit + router bias (one F32 add) with the flag,
// else the logit; NaN ranks as -inf.
inline float gate_logit(device const float *row, device const float *router_bias, uint e,
                        constant MoeGateKernelParams &p) {
  return gate_key(p.has_router_bias != 0 ? row[e] + router_bias[e] : row[e]);
}

// Softmax's row statistics: largest key, sum of exp(key - max) in expert order, +inf count.
struct GateRowStats {
  float max_z;
  float sum;
  uint infinite;
  bool finite_max;
};

inline GateRowStats gate_row_stats(device const float *row, device const float *router_bias,
                                   constant MoeGateKernelParams &p) {
  const float inf = positive_infinity();
  GateRowStats r;
  r.max_z = -inf;
  r.sum = 0.0f;
  r.infinite = 0;
  r.finite_max = false;
  if (p.scoring != 0) return r;
  for (uint e = 0; e < p.n_experts; ++e) {
    const float z = gate_logit(row, router_bias, e, p);
    r.max_z = z > r.max_z ? z : r.max_z;
    r.infinite += z == inf ? 1u : 0u;
  }
  r.finite_max = r.max_z > -inf && r.max_z < inf;
  if (r.finite_max) {
    for (uint e = 0; e < p.n_experts; ++e) {
      r.sum += exp(gate_logit(row, router_bias, e, p) - r.max_z);
    }
  }
  return r;
}

// Expert e's score: softmax probability or sigmoid.
inline float gate_score(device const float *row, device const float *router_bias, uint e,
                        thread const GateRowStats &r, constant MoeGateKernelParams &p) {
  const float inf = positive_infinity();
  const float z = gate_logit(row, router_bias, e, p);
  if (p.scoring != 0) return 1.0f / (1.0f + exp(-z));
  if (r.finite_max) return exp(z - r.max_z) / r.sum;
  return r.max_z == inf && z == inf ? 1.0f / float(r.infinite) : 0.0f;
}

// Selection score: score + bias (NaN ranks as -inf), or the score without a bias.
inline float gate_biased(device const float *row, device const float *router_bias,
                         device const float *bias, uint e, thread const GateRowStats &r,
                         constant MoeGateKernelParams &p) {
  const float s = gate_score(row, router_bias, e, r, p);
  return p.has_bias != 0 ? gate_key(s + bias[e]) : s;
}

// Ranking key: the selection score with a bias, else the (router-biased) logit.
inline float gate_rank_key(device const float *row, device const float *router_bias,
                           device const float *bias, uint e, thread const GateRowStats &r,
                           constant MoeGateKernelParams &p) {
  return p.has_bias != 0 ? gate_biased(row, router_bias, bias, e, r, p)
                         : gate_logit(row, router_bias, e, p);
}

// Group score: the sum of the group's two largest selection scores (one for groups of one).
inline float gate_group_score(device const float *row, device const float *router_bias,
                              device const float *bias, uint g, uint group_size,
                              thread const GateRowStats &r, constant MoeGateKernelParams &p) {
  const float inf = positive_infinity();
  float first = -inf, second = -inf;
  for (uint e = g * group_size; e < (g + 1) * group_size; ++e) {
    const float v = gate_biased(row, router_bias, bias, e, r, p);
    if (v > first) {
      second = first;
      first = v;
    } else if (v > second) {
      second = v;
    }
  }
  return group_size == 1 ? first : gate_key(first + second);
}

}  // namespace

kernel void moe_gate_softmax_topk_f32(constant MoeGateKernelParams &p [[buffer(0)]],
                                      device const float *logits [[buffer(1)]],
                                      device float *weights [[buffer(2)]],
                                      device uint *ids [[buffer(3)]],
                                      device const float *bias [[buffer(4)]],
                                      device const float *router_bias [[buffer(5)]],
                                      uint t [[thread_position_in_grid]]) {
  if (t >= p.m) return;
  device const float *row = logits + ulong(t) * p.n_experts;
  device float *w = weights + ulong(t) * p.top_k;
  device uint *id = ids + ulong(t) * p.top_k;
  const float inf = positive_infinity();
  const GateRowStats r = gate_row_stats(row, router_bias, p);
  const uint groups = p.num_expert_group == 0 ? 1u : p.num_expert_group;
  const uint group_size = p.n_experts / groups;
  // The last kept group: slot topk_group - 1 of a top-k over groups (score descending, index
  // ascending); a group is kept when it ranks at or before it.
  float kept_score = -inf;
  uint kept_g = groups - 1;
  if (groups > 1) {
    float prev = inf;
    uint prev_g = 0;
    for (uint j = 0; j < p.topk_group; ++j) {
      float best = 0.0f;
      uint best_g = groups;
      for (uint g = 0; g < groups; ++g) {
        const float v = gate_group_score(row, router_bias, bias, g, group_size, r, p);
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
  // Slot s takes the best expert of a kept group ranked strictly after slot s - 1's (key
  // descending, index ascending).
  float prev_z = inf;
  uint prev_e = 0;
  float total = 0.0f;
  for (uint s = 0; s < p.top_k; ++s) {
    float best_z = 0.0f;
    uint best_e = p.n_experts;
    for (uint g = 0; g < groups; ++g) {
      if (groups > 1) {
        const float v = gate_group_score(row, router_bias, bias, g, group_size, r, p);
        if (!(v > kept_score || (v == kept_score && g <= kept_g))) continue;
      }
      for (uint e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float z = gate_rank_key(row, router_bias, bias, e, r, p);
        const bool after_prev = s == 0 || z < prev_z || (z == prev_z && e > prev_e);
        if (after_prev && (best_e == p.n_experts || z > best_z)) {
          best_z = z;
          best_e = e;
        }
      }
    }
    const float prob = gate_score(row, router_bias, best_e, r, p);
    w[s] = prob;
    id[s] = best_e;
    total += prob;
    prev_z = best_z;
    prev_e = best_e;
  }
  for (uint s = 0; s < p.top_k; ++s) {
    const float v = p.renormalize != 0 && total > 0.0f ? w[s] / total : w[s];
    w[s] = v * p.routed_scaling_factor;
  }
}

// One activation input: fma(w, v, b) with both, w * v or v + b with one, v with neither.
inline float scale_bias(float v, bool has_scale, float scale, bool has_bias, float bias) {
  if (has_scale && has_bias) return fma(scale, v, bias);
  if (has_scale) return scale * v;
  return has_bias ? v + bias : v;
}

// Optional buffers (ids, weights, biases) are bound only when the params' flags name them.
kernel void moe_silu_mul_f32(constant MoeSiluMulKernelParams &p [[buffer(0)]],
                             device const float *gate [[buffer(1)]],
                             device const float *up [[buffer(2)]],
                             device float *out [[buffer(3)]],
                             device const uint *ids [[buffer(4)]],
                             device const float *scale [[buffer(5)]],
                             device const float *gate_bias [[buffer(6)]],
                             device const float *up_bias [[buffer(7)]],
                             uint2 position [[thread_position_in_grid]]) {
  const uint c = position.x, r = position.y;
  if (c >= p.width || r >= p.rows) return;
  const bool scaled = (p.flags & kMoeActScaleRows) != 0;
  const bool gate_biased = (p.flags & kMoeActGateBias) != 0;
  const bool up_biased = (p.flags & kMoeActUpBias) != 0;
  const float w = scaled ? scale[r] : 1.0f;
  const uint e = (gate_biased || up_biased) ? ids[r] : p.n_experts;
  const bool gb = e < p.n_experts && gate_biased, ub = e < p.n_experts && up_biased;
  const float g = scale_bias(gate[ulong(r) * p.gate_row_stride + c], scaled, w, gb,
                             gb ? gate_bias[ulong(e) * p.bias_row_stride + c] : 0.0f);
  const float u = scale_bias(up[ulong(r) * p.up_row_stride + c], scaled, w, ub,
                             ub ? up_bias[ulong(e) * p.bias_row_stride + c] : 0.0f);
  float value;
  if (p.activation == kMoeActivationSwigluOai) {
    // gpt-oss's clamped SwiGLU: g = min(g, limit), u = clamp(u, -limit, limit), NaN kept.
    const float gc = g > p.limit ? p.limit : g;
    const float uc = u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
    value = gc / (1.0f + exp(-(p.alpha * gc))) * (uc + 1.0f);
  } else {
    value = g / (1.0f + exp(-g)) * u;
  }
  out[ulong(r) * p.width + c] = value;
}

kernel void moe_combine_f32(constant MoeCombineKernelParams &p [[buffer(0)]],
                            device const float *rows [[buffer(1)]],
                            device const float *weights [[buffer(2)]],
                            device const uint *ids [[buffer(3)]],
                            device float *out [[buffer(4)]],
                            device const float *bias [[buffer(5)]],
                            uint2 position [[thread_position_in_grid]]) {
  const uint h = position.x, t = position.y;
  if (h >= p.hidden || t >= p.m) return;
  const bool unit = (p.flags & kMoeCombineUnitWeights) != 0;
  const bool biased = (p.flags & kMoeCombineBias) != 0;
  float acc = 0.0f;
  for (uint s = 0; s < p.top_k; ++s) {
    const uint flat = t * p.top_k + s;
    const uint e = ids[flat];
    if (e >= p.n_experts) continue;  // sentinel or invalid: skipped
    float row = rows[ulong(flat) * p.hidden + h];
    if (biased) row = row + bias[ulong(e) * p.hidden + h];
    acc = fma(unit ? 1.0f : weights[flat], row, acc);
  }
  out[ulong(t) * p.hidden + h] = acc;
}
