// MoE layer pipelines (csrc/ops/moe.cpp): moe_gate_softmax_topk_f32, moe_silu_mul_f32 and
// moe_combine_f32, following the numeric contract in csrc/include/routemm/ops/moe.h (the CPU and
// CUDA kernels share csrc/backend/common/moe_gate_row.h; this file takes the same steps in MSL).
//
// Bindings and geometry are the front door's with the KernelDefs of csrc/backend/metal/kernels.cpp:
//   gate    : 0 params, 1 logits, 2 weights, 3 ids; grid [ceil(m / 64), 1, 1], 64 threads, one
//             thread per token row.
//   silu_mul: 0 params, 1 gate, 2 up, 3 output; grid [ceil(width / 64), rows, 1], 64 threads.
//   combine : 0 params, 1 rows, 2 weights, 3 ids, 4 output; grid [ceil(hidden / 64), m, 1],
//             64 threads, one thread per output element, slots summed in order.
#include <metal_stdlib>

#include "backend/common/moe_params.h"

using namespace metal;
using routemm::kernels::MoeCombineKernelParams;
using routemm::kernels::MoeGateKernelParams;
using routemm::kernels::MoeSiluMulKernelParams;

namespace {

inline float positive_infinity() { return as_type<float>(0x7f800000u); }

// The ranking key of a logit: NaN ranks as -inf.
inline float gate_key(float logit) { return logit != logit ? -positive_infinity() : logit; }

}  // namespace

kernel void moe_gate_softmax_topk_f32(constant MoeGateKernelParams &p [[buffer(0)]],
                                      device const float *logits [[buffer(1)]],
                                      device float *weights [[buffer(2)]],
                                      device uint *ids [[buffer(3)]],
                                      uint t [[thread_position_in_grid]]) {
  if (t >= p.m) return;
  device const float *row = logits + ulong(t) * p.n_experts;
  device float *w = weights + ulong(t) * p.top_k;
  device uint *id = ids + ulong(t) * p.top_k;
  const float inf = positive_infinity();
  float max_z = -inf;
  uint infinite = 0;
  for (uint e = 0; e < p.n_experts; ++e) {
    const float z = gate_key(row[e]);
    max_z = z > max_z ? z : max_z;
    infinite += z == inf ? 1u : 0u;
  }
  const bool finite_max = max_z > -inf && max_z < inf;
  float sum = 0.0f;
  if (finite_max) {
    for (uint e = 0; e < p.n_experts; ++e) sum += exp(gate_key(row[e]) - max_z);
  }
  // Slot s takes the best expert ranked strictly after slot s - 1's (logit descending, index
  // ascending).
  float prev_z = inf;
  uint prev_e = 0;
  float total = 0.0f;
  for (uint s = 0; s < p.top_k; ++s) {
    float best_z = 0.0f;
    uint best_e = p.n_experts;
    for (uint e = 0; e < p.n_experts; ++e) {
      const float z = gate_key(row[e]);
      const bool after_prev = s == 0 || z < prev_z || (z == prev_z && e > prev_e);
      if (after_prev && (best_e == p.n_experts || z > best_z)) {
        best_z = z;
        best_e = e;
      }
    }
    float prob = 0.0f;
    if (finite_max) {
      prob = exp(best_z - max_z) / sum;
    } else if (max_z == inf && best_z == inf) {
      prob = 1.0f / float(infinite);
    }
    w[s] = prob;
    id[s] = best_e;
    total += prob;
    prev_z = best_z;
    prev_e = best_e;
  }
  if (p.renormalize != 0 && total > 0.0f) {
    for (uint s = 0; s < p.top_k; ++s) w[s] = w[s] / total;
  }
}

kernel void moe_silu_mul_f32(constant MoeSiluMulKernelParams &p [[buffer(0)]],
                             device const float *gate [[buffer(1)]],
                             device const float *up [[buffer(2)]],
                             device float *out [[buffer(3)]],
                             uint2 position [[thread_position_in_grid]]) {
  const uint c = position.x, r = position.y;
  if (c >= p.width || r >= p.rows) return;
  const float g = gate[ulong(r) * p.gate_row_stride + c];
  const float u = up[ulong(r) * p.up_row_stride + c];
  out[ulong(r) * p.width + c] = g / (1.0f + exp(-g)) * u;
}

kernel void moe_combine_f32(constant MoeCombineKernelParams &p [[buffer(0)]],
                            device const float *rows [[buffer(1)]],
                            device const float *weights [[buffer(2)]],
                            device const uint *ids [[buffer(3)]],
                            device float *out [[buffer(4)]],
                            uint2 position [[thread_position_in_grid]]) {
  const uint h = position.x, t = position.y;
  if (h >= p.hidden || t >= p.m) return;
  float acc = 0.0f;
  for (uint s = 0; s < p.top_k; ++s) {
    const uint flat = t * p.top_k + s;
    if (ids[flat] >= p.n_experts) continue;  // sentinel or invalid: skipped
    acc = fma(weights[flat], rows[ulong(flat) * p.hidden + h], acc);
  }
  out[ulong(t) * p.hidden + h] = acc;
}
