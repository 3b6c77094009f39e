// Kernel-argument struct for the expert-ID matmul pipelines, shared by the host, CUDA and Metal.
// Fixed-width fields only; the layout is part of the kernel ABI (48 bytes, checked below).
#pragma once

#ifdef __METAL_VERSION__
#define ROUTEMM_U32 uint
#define ROUTEMM_U64 ulong
#define ROUTEMM_CONSTANT \
  constant  // MSL: program-scope constants live in the constant address space
#else
#include <cstddef>
#include <cstdint>
#define ROUTEMM_CONSTANT
#define ROUTEMM_U32 uint32_t
#define ROUTEMM_U64 uint64_t
#endif

namespace routemm::kernels {

// input_layout values.
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kInputSharedPerToken = 0;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kInputSlotted = 1;

struct DenseMatmulIdKernelParams {
  ROUTEMM_U32 m;                         // tokens
  ROUTEMM_U32 n;                         // output features per expert (weight rows)
  ROUTEMM_U32 k;                         // input width (weight columns)
  ROUTEMM_U32 top_k;                     // expert slots per token
  ROUTEMM_U32 n_experts;                 // ids >= n_experts give an all-zero output row
  ROUTEMM_U32 input_layout;              // kInputSharedPerToken or kInputSlotted
  ROUTEMM_U64 expert_stride_bytes;       // byte distance between consecutive expert matrices
  ROUTEMM_U64 input_token_stride_bytes;  // Shared: k*4; Slotted: k*4*top_k
  ROUTEMM_U64 input_slot_stride_bytes;   // Shared: 0;   Slotted: k*4
};

#ifndef __METAL_VERSION__
static_assert(sizeof(DenseMatmulIdKernelParams) == 48);
static_assert(offsetof(DenseMatmulIdKernelParams, input_layout) == 20);
static_assert(offsetof(DenseMatmulIdKernelParams, expert_stride_bytes) == 24);
static_assert(offsetof(DenseMatmulIdKernelParams, input_token_stride_bytes) == 32);
static_assert(offsetof(DenseMatmulIdKernelParams, input_slot_stride_bytes) == 40);
#endif

}  // namespace routemm::kernels

#undef ROUTEMM_U32
#undef ROUTEMM_U64
#undef ROUTEMM_CONSTANT
