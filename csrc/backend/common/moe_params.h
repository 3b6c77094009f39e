// Kernel-argument structs of the MoE layer's pipelines (csrc/ops/moe.cpp), shared by the host,
// CUDA and Metal. Fixed-width fields only; the layouts are part of the kernel ABI (checked below).
#pragma once

#ifdef __METAL_VERSION__
#define ROUTEMM_U32 uint
#define ROUTEMM_U64 ulong
#else
#include <cstddef>
#include <cstdint>
#define ROUTEMM_U32 uint32_t
#define ROUTEMM_U64 uint64_t
#endif

namespace routemm::kernels {

// moe_gate_softmax_topk_f32: one row of `n_experts` logits per token.
struct MoeGateKernelParams {
  ROUTEMM_U32 m;
  ROUTEMM_U32 n_experts;
  ROUTEMM_U32 top_k;
  ROUTEMM_U32 renormalize;  // 0 or 1
};

// moe_silu_mul_f32: out[r, c] = silu(gate[r * gate_row_stride + c]) * up[r * up_row_stride + c].
struct MoeSiluMulKernelParams {
  ROUTEMM_U32 rows;
  ROUTEMM_U32 width;
  ROUTEMM_U64 gate_row_stride;  // elements
  ROUTEMM_U64 up_row_stride;    // elements
};

// moe_combine_f32: out[t, h] = ordered sum over valid slots of weight[t, s] * rows[t*top_k+s, h].
struct MoeCombineKernelParams {
  ROUTEMM_U32 m;
  ROUTEMM_U32 top_k;
  ROUTEMM_U32 hidden;
  ROUTEMM_U32 n_experts;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(MoeGateKernelParams) == 16);
static_assert(sizeof(MoeSiluMulKernelParams) == 24);
static_assert(offsetof(MoeSiluMulKernelParams, gate_row_stride) == 8);
static_assert(offsetof(MoeSiluMulKernelParams, up_row_stride) == 16);
static_assert(sizeof(MoeCombineKernelParams) == 16);
#endif

}  // namespace routemm::kernels

#undef ROUTEMM_U32
#undef ROUTEMM_U64
