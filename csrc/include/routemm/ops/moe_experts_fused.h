// The experts block of a MoE layer fused into two dispatches, for decode-sized batches in the
// model's dtype (the route the torch op takes on CUDA below the tensor-core crossover):
//
//   gate_up  act[r, j] = SiLU(dot(W_gate[e][j], x[t])) * dot(W_up[e][j], x[t])   (F32)
//   down     out[t, h] = sum over s = 0 .. top_k - 1, in order, of
//                        weight[t, s] * dot(W_down[e_s][h], act[t * top_k + s])  (rounded once)
//
// with r = t * top_k + s and e = ids[t, s]. hidden, the float stacks and the output share one
// dtype (F32, F16 or BF16); the routing weights are F32, F16 or BF16; ids are 4-byte (U32, or I32
// read as its U32 bit pattern as moe_experts does, so a negative one is invalid) or 8-byte
// (int64, valid in [0, n_experts)) integers. An id outside [0, n_experts) contributes exactly nothing and reads no
// weight (its act row is written as zeros). Every product widens its operands to F32 and
// accumulates in F32 (the order of the partial sums is the backend's: CUDA sums 8-wide lane
// partials with a warp tree; the CPU sums in index order); the ordered slot sum is an F32 fma
// chain from +0.0f, so no result depends on the grid or on the other tokens of the batch.
//
// Memory: hidden [m, H]; ids [m, top_k]; weights [m, top_k]; gate_up [E, 2I, H] (gate rows, then
// up rows) or, split, gate [E, I, H] and up [E, I, H]; down [E, H, I]; output [m, H]; workspace at
// least moe_experts_fused_workspace_bytes(params) bytes (F32 act rows). H and I must be multiples
// of 8 and every buffer 16-byte aligned (the kernels read 16-byte vectors).
//
// Fail closed: every buffer, extent, pipeline and receipt slot is checked before the encoder is
// touched; the two dispatches are encoded inside one CommandEncoder::Transaction.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "routemm/buffer.h"
#include "routemm/encoder.h"
#include "routemm/registry.h"

namespace routemm {

struct MoeExpertsFusedParams {
  uint32_t m = 0, top_k = 0, n_experts = 0, hidden = 0, intermediate = 0;
  bool split_gate_up = false;
  DType dtype = DType::BF16;         // hidden, stacks and output: F32, F16 or BF16
  DType weights_dtype = DType::F32;  // the routing weights: F32, F16 or BF16
  uint32_t id_bytes = 4;             // 4 (I32/U32 ids) or 8 (int64 ids)
  bool operator==(const MoeExpertsFusedParams&) const = default;
};

// The pipelines, by stack dtype: gate_up then down for F32, F16, BF16.
inline constexpr std::array<std::string_view, 6> kMoeExpertsFusedPipelineNames = {
    "moe_experts_fused_gate_up_f32",  "moe_experts_fused_gate_up_f16",
    "moe_experts_fused_gate_up_bf16", "moe_experts_fused_down_f32",
    "moe_experts_fused_down_f16",     "moe_experts_fused_down_bf16"};

// Largest top_k the down kernel takes (its per-slot partial sums live in on-chip memory).
inline constexpr uint32_t kMoeExpertsFusedMaxTopK = 64;

// Checks every extent and dtype of `p` (InvalidArgument naming the field); returns the workspace
// bytes the call needs.
uint64_t moe_experts_fused_workspace_bytes(const MoeExpertsFusedParams& p);

// Whether the fused route serves this call shape on `backend` (the kernels exist there and the
// rows are few enough that re-reading an expert's weights per row costs less than grouping):
// CUDA and CPU have the kernels; the torch op takes the route on CUDA only (see torch_ops.cpp).
// The rows are few enough while m * top_k * kMoeFusedExpertsPerRow <= n_experts (a quarter of a
// row per expert; between that and the tensor-core crossover the direct route runs).
inline constexpr uint64_t kMoeFusedExpertsPerRow = 4;
bool moe_experts_fused_serves(std::string_view backend, const MoeExpertsFusedParams& p);

void moe_experts_fused(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& hidden,
                       const Buffer& ids, const Buffer& weights, const Buffer& gate_up,
                       const Buffer* up, const Buffer& down, const Buffer& output,
                       const Buffer& workspace, const MoeExpertsFusedParams& p);

}  // namespace routemm
