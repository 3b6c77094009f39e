// Kernel-argument structs of the MoE layer's pipelines (csrc/ops/moe.cpp), shared by the host,
// CUDA and Metal. Fixed-width fields only; the layouts are part of the kernel ABI (checked below).
#pragma once

#ifdef __METAL_VERSION__
#define ROUTEMM_U32 uint
#define ROUTEMM_U64 ulong
#define ROUTEMM_F32 float
#define ROUTEMM_CONSTANT constant  // MSL: program-scope constants live in constant space
#else
#include <cstddef>
#include <cstdint>
#define ROUTEMM_U32 uint32_t
#define ROUTEMM_U64 uint64_t
#define ROUTEMM_F32 float
#define ROUTEMM_CONSTANT
#endif

namespace routemm::kernels {

// moe_gate_softmax_topk_f32: one row of `n_experts` logits per token. Slot 4 holds the selection
// bias [n_experts] when has_bias is 1, slot 5 the router bias [n_experts] (added to every logit
// before scoring) when has_router_bias is 1; otherwise the logits are bound there and never read.
struct MoeGateKernelParams {
  ROUTEMM_U32 m;
  ROUTEMM_U32 n_experts;
  ROUTEMM_U32 top_k;
  ROUTEMM_U32 renormalize;       // 0 or 1
  ROUTEMM_U32 scoring;           // 0 softmax, 1 sigmoid (routemm::MoeGateScoring)
  ROUTEMM_U32 has_bias;          // 0 or 1
  ROUTEMM_U32 num_expert_group;  // 0: no grouping; else divides n_experts
  ROUTEMM_U32 topk_group;        // groups kept: 0 without grouping, else in [1, num_expert_group]
  float routed_scaling_factor;   // multiplies every final weight (finite)
  ROUTEMM_U32 has_router_bias;   // 0 or 1
};

// moe_silu_mul_f32: out[r, c] = act(g, u) of g = gate[r * gate_row_stride + c] and
// u = up[r * up_row_stride + c], each first scaled by the row's weight and given its expert's bias
// where `flags` asks (the contract in routemm/ops/moe.h).
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeActivationSilu = 0;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeActivationSwigluOai = 1;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeActScaleRows = 1;  // slot 5: weights F32 [rows]
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeActGateBias =
    2;  // slot 4 ids U32 [rows], slot 6 gate bias
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeActUpBias = 4;  // slot 4 ids U32 [rows], slot 7 up bias
struct MoeSiluMulKernelParams {
  ROUTEMM_U32 rows;
  ROUTEMM_U32 width;
  ROUTEMM_U64 gate_row_stride;  // elements
  ROUTEMM_U64 up_row_stride;    // elements
  ROUTEMM_U32 activation;       // kMoeActivation*
  ROUTEMM_U32 flags;            // kMoeAct* bits
  ROUTEMM_F32 alpha;            // swiglu_oai: sigmoid(alpha * g)
  ROUTEMM_F32 limit;            // swiglu_oai: g <= limit, -limit <= u <= limit
  ROUTEMM_U32 n_experts;        // ids >= n_experts read no bias
  ROUTEMM_U32 bias_row_stride;  // elements from one expert's bias row to the next
};

// moe_combine_f32: out[t, h] = ordered sum over valid slots of weight[t, s] * rows[t*top_k+s, h]
// (weight 1 with kMoeCombineUnitWeights; rows plus the expert's bias with kMoeCombineBias).
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeCombineUnitWeights = 1;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kMoeCombineBias = 2;  // slot 5: bias F32 [n_experts, hidden]
struct MoeCombineKernelParams {
  ROUTEMM_U32 m;
  ROUTEMM_U32 top_k;
  ROUTEMM_U32 hidden;
  ROUTEMM_U32 n_experts;
  ROUTEMM_U32 flags;  // kMoeCombine* bits
  ROUTEMM_U32 reserved;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(MoeGateKernelParams) == 40);
static_assert(offsetof(MoeGateKernelParams, routed_scaling_factor) == 32);
static_assert(offsetof(MoeGateKernelParams, has_router_bias) == 36);
static_assert(sizeof(MoeSiluMulKernelParams) == 48);
static_assert(offsetof(MoeSiluMulKernelParams, gate_row_stride) == 8);
static_assert(offsetof(MoeSiluMulKernelParams, up_row_stride) == 16);
static_assert(offsetof(MoeSiluMulKernelParams, activation) == 24);
static_assert(offsetof(MoeSiluMulKernelParams, alpha) == 32);
static_assert(offsetof(MoeSiluMulKernelParams, bias_row_stride) == 44);
static_assert(sizeof(MoeCombineKernelParams) == 24);
static_assert(offsetof(MoeCombineKernelParams, flags) == 16);
#endif

}  // namespace routemm::kernels

#undef ROUTEMM_U32
#undef ROUTEMM_U64
#undef ROUTEMM_F32
#undef ROUTEMM_CONSTANT
