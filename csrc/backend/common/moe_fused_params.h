// Kernel-argument struct and argument contracts of the fused experts block's two pipelines
// (routemm/ops/moe_experts_fused.h), shared by the host, CPU and CUDA. Fixed-width fields only.
//
// gate_up slots: 0 params, 1 hidden [m, H], 2 ids [m, top_k] (id_bytes each), 3 gate_up
//   [E, 2I, H] (split: gate [E, I, H]), 4 up [E, I, H] (unsplit: gate_up bound again, not read),
//   5 act F32 [m * top_k, I] (written).
// down slots: 0 params, 1 act F32 [m * top_k, I], 2 ids, 3 weights [m, top_k] (weights_dtype),
//   4 down [E, H, I], 5 output [m, H] (written).
// Stacks, hidden and output are of the pipeline's dtype. The contracts live in kernel_contracts.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace routemm::kernels {

struct MoeFusedKernelParams {
  uint32_t m;
  uint32_t top_k;
  uint32_t n_experts;
  uint32_t hidden;
  uint32_t intermediate;
  uint32_t split_gate_up;  // 0 or 1
  uint32_t weights_dtype;  // a DType value: 0 F32, 1 F16, 2 BF16
  uint32_t id_bytes;       // 4 or 8
};
static_assert(sizeof(MoeFusedKernelParams) == 32);

inline uint64_t moe_fused_weights_size(uint32_t weights_dtype) {
  return weights_dtype == 0 ? 4 : 2;
}

}  // namespace routemm::kernels
