// Argument contracts of every pipeline, shared by all backends (host code only; not included by
// shaders). A pipeline's slots, params struct and the extents its params imply are part of the
// kernel ABI, the same on every backend, so each contract is written once here and every backend
// attaches it to its KernelDef (KernelDef::check_args) through kernel_arg_contract(name).
//
// CommandEncoder::dispatch runs the contract before anything is encoded, so a raw dispatch (which
// no op front door validated) cannot make a kernel touch memory outside what is bound: every
// buffer slot must hold the bytes the params imply from its bound byte, start aligned for the
// slot's element type, and be writable when the kernel writes it; params must be exactly the
// kernel's struct and self-consistent. Violations are InvalidArgument naming the pipeline.
// Contracts see only the launch (bindings and geometry), never device memory: values that the
// kernels read from buffers (expert ids, routed rows) are checked by the kernels themselves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "backend/common/calibration_params.h"
#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/moe_fused_params.h"
#include "backend/common/moe_gate_row.h"
#include "backend/common/moe_params.h"
#include "backend/common/q4_0_block.h"
#include "routemm/backend.h"
#include "routemm/checked.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/moe_experts_fused.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/ops/quantized_matmul_id.h"

namespace routemm::kernels {

enum class Access : uint8_t { Read, Write };

[[noreturn]] inline void contract_violation(const KernelLaunch& launch, const std::string& why) {
  throw InvalidArgument(launch.label + ": " + why);
}

// Slots at or past `count` must be unbound: a kernel never reads them, so a binding there is a
// caller's mistake about the kernel's ABI.
inline void contract_slot_count(const KernelLaunch& launch, size_t count) {
  for (size_t slot = count; slot < launch.args.size(); ++slot) {
    if (launch.args[slot].kind != BoundArg::Kind::Empty) {
      contract_violation(launch, "argument slot " + std::to_string(slot) +
                                     " is bound but the kernel takes " + std::to_string(count));
    }
  }
}

// The kernel-argument struct T passed as inline bytes at `slot` (exactly sizeof(T) of them).
template <class T>
T contract_params(const KernelLaunch& launch, size_t slot) {
  const BoundArg& arg = launch.args.at(slot);
  if (arg.kind != BoundArg::Kind::Bytes || arg.size != sizeof(T)) {
    contract_violation(launch, "argument slot " + std::to_string(slot) + " must hold the " +
                                   std::to_string(sizeof(T)) + "-byte kernel params");
  }
  T params;
  std::memcpy(&params, arg.data, sizeof(T));
  return params;
}

// The buffer bound at `slot`: at least `need` bytes from its bound byte, that byte aligned to
// `align`, and writable when the kernel writes it.
inline void contract_buffer(const KernelLaunch& launch, size_t slot, const char* what,
                            uint64_t need, uint64_t align, Access access) {
  const BoundArg& arg = launch.args.at(slot);
  const std::string where = "argument slot " + std::to_string(slot) + " (" + what + ")";
  if (arg.kind != BoundArg::Kind::Buffer) contract_violation(launch, where + " must be a buffer");
  if (arg.size < need) {
    contract_violation(launch, where + " holds " + std::to_string(arg.size) +
                                   " bytes from its bound offset, the params need " +
                                   std::to_string(need));
  }
  if (reinterpret_cast<uintptr_t>(arg.data) % align != 0) {
    contract_violation(launch, where + " is bound at an address not aligned to " +
                                   std::to_string(align) + " bytes");
  }
  if (access == Access::Write && !arg.writable)
    contract_violation(launch, where + " is written by the kernel but is read-only");
}

// ---- Route-calibration proof kernels (calibration_params.h) ------------------------------------

inline CalibrationKernelParams calibration_params(const KernelLaunch& launch, size_t slot) {
  const auto p = contract_params<CalibrationKernelParams>(launch, slot);
  if (p.logical_elements > p.guarded_elements)
    contract_violation(launch, "logical elements exceed guarded elements");
  return p;
}

inline void check_calibration_poison_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 3);
  const auto p = calibration_params(launch, 2);
  const uint64_t bytes = checked_mul(p.guarded_elements, 4, launch.label + " guarded bytes");
  contract_buffer(launch, 0, "control output", bytes, 4, Access::Write);
  contract_buffer(launch, 1, "candidate output", bytes, 4, Access::Write);
}

inline void check_calibration_compare_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 4);
  const auto p = calibration_params(launch, 3);
  const uint64_t bytes = checked_mul(p.guarded_elements, 4, launch.label + " guarded bytes");
  contract_buffer(launch, 0, "control output", bytes, 4, Access::Read);
  contract_buffer(launch, 1, "candidate output", bytes, 4, Access::Read);
  contract_buffer(launch, 2, "statuses", (uint64_t{p.status_index} + 1) * 4, 4, Access::Write);
}

// ---- Expert-ID matmul (dense_matmul_id_params.h) ----------------------------------------------

inline DenseMatmulIdKernelParams dense_matmul_id_params(const KernelLaunch& launch) {
  const auto p = contract_params<DenseMatmulIdKernelParams>(launch, 0);
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0)
    contract_violation(launch, "params have a zero extent");
  if (p.input_layout != kInputSharedPerToken && p.input_layout != kInputSlotted)
    contract_violation(launch, "params have an unknown input layout");
  if (uint64_t{p.m} * p.top_k > UINT32_MAX)
    contract_violation(launch, "flattened routed rows exceed the u32 kernel ABI");
  if (p.input_token_stride_bytes % 4 != 0 || p.input_slot_stride_bytes % 4 != 0)
    contract_violation(launch, "input strides are not multiples of 4 bytes");
  return p;
}

// Bytes from the weight view's start to the end of the last expert matrix.
inline uint64_t dense_matmul_id_weight_bytes(const DenseMatmulIdKernelParams& p, uint64_t elem,
                                             std::string_view what) {
  const uint64_t matrix = checked_product({p.n, p.k, elem}, what);
  return checked_add(checked_mul(p.n_experts - 1, p.expert_stride_bytes, what), matrix, what);
}

// Bytes from the input view's start to the end of the last row read.
inline uint64_t dense_matmul_id_input_bytes(const DenseMatmulIdKernelParams& p,
                                            std::string_view what) {
  const uint64_t last =
      checked_add(checked_mul(p.m - 1, p.input_token_stride_bytes, what),
                  checked_mul(p.top_k - 1, p.input_slot_stride_bytes, what), what);
  return checked_add(last, checked_mul(p.k, 4, what), what);
}

// Weights, input and output of the compute routes (direct, grouped, tensor) at the given slots.
inline void dense_matmul_id_operands(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                                     uint64_t weight_elem, size_t weight_slot, size_t input_slot,
                                     size_t output_slot) {
  const std::string what = launch.label + " extents";
  if (p.expert_stride_bytes % weight_elem != 0)
    contract_violation(launch, "expert stride is not a multiple of the weight element size");
  contract_buffer(launch, weight_slot, "weights",
                  dense_matmul_id_weight_bytes(p, weight_elem, what), weight_elem, Access::Read);
  contract_buffer(launch, input_slot, "input", dense_matmul_id_input_bytes(p, what), 4,
                  Access::Read);
  contract_buffer(launch, output_slot, "output", checked_product({p.m, p.top_k, p.n, 4}, what), 4,
                  Access::Write);
}

// Bytes of the routed-rows list: the scratch's n_experts * m entries, and at least one entry per flat
// row (m * top_k), which the map may route when ids repeat within a token. Through the op front
// doors the two agree (the grouped routes need top_k <= n_experts); a raw dispatch with a larger
// top_k must bind room for every flat row.
inline uint64_t routed_rows_bytes(const DenseMatmulIdKernelParams& p, std::string_view what) {
  const uint64_t scratch = checked_mul(p.n_experts, p.m, what);
  const uint64_t flat = checked_mul(p.m, p.top_k, what);
  return checked_mul(scratch > flat ? scratch : flat, 4, what);
}

// Slots: 0 params, 1 weights, 2 input, 3 expert ids, 4 output.
template <uint64_t WeightElem>
void check_dense_matmul_id_direct_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 5);
  const auto p = dense_matmul_id_params(launch);
  dense_matmul_id_operands(launch, p, WeightElem, 1, 2, 4);
  contract_buffer(launch, 3, "expert ids", checked_product({p.m, p.top_k, 4}, launch.label), 4,
                  Access::Read);
}

// Slots: 0 params, 1 expert ids, 2 expert counts, 3 routed rows, 4 output.
inline void check_dense_matmul_id_map_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 5);
  const auto p = dense_matmul_id_params(launch);
  const std::string what = launch.label + " extents";
  contract_buffer(launch, 1, "expert ids", checked_product({p.m, p.top_k, 4}, what), 4,
                  Access::Read);
  contract_buffer(launch, 2, "expert counts", checked_mul(p.n_experts, 4, what), 4, Access::Write);
  contract_buffer(launch, 3, "routed rows", routed_rows_bytes(p, what), 4, Access::Write);
  contract_buffer(launch, 4, "output", checked_product({p.m, p.top_k, p.n, 4}, what), 4,
                  Access::Write);
}

// Grouped and tensor routes. Slots: 0 params, 1 weights, 2 input, 3 expert counts, 4 routed
// rows, 5 output.
template <uint64_t WeightElem>
void check_dense_matmul_id_grouped_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 6);
  const auto p = dense_matmul_id_params(launch);
  const std::string what = launch.label + " extents";
  dense_matmul_id_operands(launch, p, WeightElem, 1, 2, 5);
  contract_buffer(launch, 3, "expert counts", checked_mul(p.n_experts, 4, what), 4, Access::Read);
  contract_buffer(launch, 4, "routed rows", routed_rows_bytes(p, what), 4, Access::Read);
}

// ---- Quantised expert-ID matmul (GGML block stacks) ---------------------------------------------

// Weights [n_experts] x [n, k / BlockValues * BlockBytes] at expert_stride_bytes (Align-byte
// aligned: Q4_0 / Q8_0 blocks start with an f16 scale read in place, 2; the formats of
// ggml_formats.h kKernelFormats are read bytewise, 1), input and output as the dense routes.
template <uint64_t BlockBytes, uint64_t BlockValues = 32, uint64_t Align = 2>
void quantized_matmul_id_operands(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                                  size_t output_slot) {
  const std::string what = launch.label + " extents";
  if (p.k % BlockValues != 0) contract_violation(launch, "K is not a multiple of the block");
  if (p.expert_stride_bytes % Align != 0)
    contract_violation(launch, "expert stride is not " + std::to_string(Align) + "-byte aligned");
  const uint64_t matrix = checked_mul(p.n, uint64_t{p.k} / BlockValues * BlockBytes, what);
  const uint64_t weights =
      checked_add(checked_mul(p.n_experts - 1, p.expert_stride_bytes, what), matrix, what);
  contract_buffer(launch, 1, "weights", weights, Align, Access::Read);
  contract_buffer(launch, 2, "input", dense_matmul_id_input_bytes(p, what), 4, Access::Read);
  contract_buffer(launch, output_slot, "output", checked_product({p.m, p.top_k, p.n, 4}, what), 4,
                  Access::Write);
}

// Slots: 0 params, 1 weights, 2 input, 3 expert ids, 4 output.
template <uint64_t BlockBytes, uint64_t BlockValues = 32, uint64_t Align = 2>
void check_quantized_matmul_id_direct_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 5);
  const auto p = dense_matmul_id_params(launch);
  quantized_matmul_id_operands<BlockBytes, BlockValues, Align>(launch, p, 4);
  contract_buffer(launch, 3, "expert ids", checked_product({p.m, p.top_k, 4}, launch.label), 4,
                  Access::Read);
}

// Slots: 0 params, 1 weights, 2 input, 3 expert counts, 4 routed rows, 5 output.
template <uint64_t BlockBytes, uint64_t BlockValues = 32, uint64_t Align = 2>
void check_quantized_matmul_id_grouped_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 6);
  const auto p = dense_matmul_id_params(launch);
  const std::string what = launch.label + " extents";
  quantized_matmul_id_operands<BlockBytes, BlockValues, Align>(launch, p, 5);
  contract_buffer(launch, 3, "expert counts", checked_mul(p.n_experts, 4, what), 4, Access::Read);
  contract_buffer(launch, 4, "routed rows", routed_rows_bytes(p, what), 4, Access::Read);
}

// ---- GGML Q4_0 projections (q4_0_block.h) -----------------------------------------------------

// Weight [n, k] in GGML block rows of `block_bytes` per `block_values` values (U8 bytes: every
// route reads a block's scale bytewise, so any offset is valid), input [m, k] F32, output [m, n]
// F32.
inline void ggml_operands(const KernelLaunch& launch, int64_t m, int64_t n, int64_t k,
                          uint64_t block_bytes, uint64_t block_values, size_t weight_slot,
                          size_t input_slot, size_t output_slot) {
  if (m <= 0 || n <= 0 || k <= 0 || static_cast<uint64_t>(k) % block_values != 0)
    contract_violation(launch, "params have a nonpositive extent or K not a multiple of the block");
  const std::string what = launch.label + " extents";
  const auto um = static_cast<uint64_t>(m), un = static_cast<uint64_t>(n),
             uk = static_cast<uint64_t>(k);
  const uint64_t row_bytes = uk / block_values * block_bytes;
  contract_buffer(launch, weight_slot, "weight", checked_mul(un, row_bytes, what), 1, Access::Read);
  contract_buffer(launch, input_slot, "input", checked_product({um, uk, 4}, what), 4, Access::Read);
  contract_buffer(launch, output_slot, "output", checked_product({um, un, 4}, what), 4,
                  Access::Write);
}

// Slots: 0 weight, 1 input, 2 output, 3 params.
template <uint64_t BlockBytes, uint64_t BlockValues = kQ4_0BlockValues>
void check_ggml_matvec_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 4);
  const auto p = contract_params<GgmlMatmulMvParams>(launch, 3);
  if (p.ne00 != p.ne10 || p.ne01 != p.ne0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 || p.r3 != 1)
    contract_violation(launch, "inconsistent mat-vec params");
  ggml_operands(launch, p.ne1, p.ne0, p.ne00, BlockBytes, BlockValues, 0, 1, 2);
}

// Slots: 0 params, 1 weight, 2 input, 3 output.
template <uint64_t BlockBytes, uint64_t BlockValues = kQ4_0BlockValues>
void check_ggml_matrix_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 4);
  const auto p = contract_params<GgmlMatmulMmParams>(launch, 0);
  if (p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 || p.r3 != 1 || p.nb10 != 4 || p.ne00 <= 0 ||
      p.nb11 != uint64_t(p.ne00) * 4 || p.nb01 != uint64_t(p.ne00) / BlockValues * BlockBytes) {
    contract_violation(launch,
                       "inconsistent matrix params (only contiguous batch-1 inputs are supported)");
  }
  ggml_operands(launch, p.ne1, p.ne0, p.ne00, BlockBytes, BlockValues, 1, 2, 3);
}

// The four pipelines of Formats[Index] (ggml_formats.h's kKernelFormats or kKQuantInt8DotFormats:
// the Q8_0 pipelines' slots, with the format's block geometry; blocks read bytewise) when `name`
// is one of them.
template <const auto& Formats, size_t Index = 0>
KernelArgCheck ggml_format_arg_contract(std::string_view name) {
  constexpr ggml_formats::KernelFormat f = Formats[Index];
  if (name == f.mat_vec) return &check_ggml_matvec_args<f.block_bytes, f.block_values>;
  if (name == f.matrix) return &check_ggml_matrix_args<f.block_bytes, f.block_values>;
  if (name == f.id_direct)
    return &check_quantized_matmul_id_direct_args<f.block_bytes, f.block_values, 1>;
  if (name == f.id_grouped)
    return &check_quantized_matmul_id_grouped_args<f.block_bytes, f.block_values, 1>;
  if constexpr (Index + 1 < Formats.size()) {
    return ggml_format_arg_contract<Formats, Index + 1>(name);
  } else {
    return nullptr;
  }
}

// ---- MoE layer (moe_params.h) -------------------------------------------------------------------

// Slots: 0 params, 1 logits [m, n_experts] F32, 2 weights [m, top_k] F32, 3 ids [m, top_k] U32,
// 4 bias [n_experts] F32 (the logits when has_bias is 0), 5 router bias [n_experts] F32 (the
// logits when has_router_bias is 0).
inline void check_moe_gate_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 6);
  const auto p = contract_params<MoeGateKernelParams>(launch, 0);
  if (!moe_gate_params_valid(p))
    contract_violation(launch, "params have a zero extent, a bad flag or top_k above its experts");
  const std::string what = launch.label + " extents";
  contract_buffer(launch, 1, "logits", checked_product({p.m, p.n_experts, 4}, what), 4,
                  Access::Read);
  contract_buffer(launch, 2, "weights", checked_product({p.m, p.top_k, 4}, what), 4, Access::Write);
  contract_buffer(launch, 3, "ids", checked_product({p.m, p.top_k, 4}, what), 4, Access::Write);
  contract_buffer(launch, 4, "bias", checked_mul(p.n_experts, 4, what), 4, Access::Read);
  contract_buffer(launch, 5, "router_bias", checked_mul(p.n_experts, 4, what), 4, Access::Read);
}

// Slots: 0 params, 1 gate rows, 2 up rows (F32, row strides in elements), 3 output [rows, width];
// with a bias flag 4 ids [rows] U32 and 6 gate bias / 7 up bias (F32, n_experts rows of width,
// bias_row_stride apart); with kMoeActScaleRows 5 weights [rows] F32. A slot its flag does not
// name holds a stand-in buffer the kernel does not read.
inline void check_moe_silu_mul_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 8);
  const auto p = contract_params<MoeSiluMulKernelParams>(launch, 0);
  if (p.rows == 0 || p.width == 0 || p.gate_row_stride < p.width || p.up_row_stride < p.width)
    contract_violation(launch, "params have a zero extent or a row stride below the width");
  if (p.activation > kMoeActivationSwigluOai || p.flags > 7)
    contract_violation(launch, "params have an unknown activation or flag");
  const bool biased = (p.flags & (kMoeActGateBias | kMoeActUpBias)) != 0;
  if (biased && (p.n_experts == 0 || p.bias_row_stride < p.width))
    contract_violation(launch, "a bias needs n_experts and a bias row stride of at least width");
  const std::string what = launch.label + " extents";
  const auto rows_bytes = [&](uint64_t rows, uint64_t stride) {
    return checked_mul(checked_add(checked_mul(rows - 1, stride, what), p.width, what), 4, what);
  };
  contract_buffer(launch, 1, "gate", rows_bytes(p.rows, p.gate_row_stride), 4, Access::Read);
  contract_buffer(launch, 2, "up", rows_bytes(p.rows, p.up_row_stride), 4, Access::Read);
  contract_buffer(launch, 3, "output", checked_product({p.rows, p.width, 4}, what), 4,
                  Access::Write);
  const auto optional = [&](size_t slot, const char* name, bool used, uint64_t need) {
    if (used) contract_buffer(launch, slot, name, need, 4, Access::Read);
  };
  optional(4, "ids", biased, checked_mul(p.rows, 4, what));
  optional(5, "weights", (p.flags & kMoeActScaleRows) != 0, checked_mul(p.rows, 4, what));
  optional(6, "gate bias", (p.flags & kMoeActGateBias) != 0,
           rows_bytes(p.n_experts, p.bias_row_stride));
  optional(7, "up bias", (p.flags & kMoeActUpBias) != 0,
           rows_bytes(p.n_experts, p.bias_row_stride));
}

// Slots: 0 params, 1 slot rows [m * top_k, hidden] F32, 2 weights [m, top_k] F32, 3 ids [m, top_k]
// U32, 4 output [m, hidden] F32; with kMoeCombineBias 5 bias [n_experts, hidden] F32 (else a
// stand-in buffer the kernel does not read).
inline void check_moe_combine_args(const KernelLaunch& launch) {
  contract_slot_count(launch, 6);
  const auto p = contract_params<MoeCombineKernelParams>(launch, 0);
  if (p.m == 0 || p.top_k == 0 || p.hidden == 0 || p.n_experts == 0)
    contract_violation(launch, "params have a zero extent");
  if (p.flags > 3 || p.reserved != 0) contract_violation(launch, "params have an unknown flag");
  const std::string what = launch.label + " extents";
  contract_buffer(launch, 1, "rows", checked_product({p.m, p.top_k, p.hidden, 4}, what), 4,
                  Access::Read);
  contract_buffer(launch, 2, "weights", checked_product({p.m, p.top_k, 4}, what), 4, Access::Read);
  contract_buffer(launch, 3, "ids", checked_product({p.m, p.top_k, 4}, what), 4, Access::Read);
  contract_buffer(launch, 4, "output", checked_product({p.m, p.hidden, 4}, what), 4, Access::Write);
  if ((p.flags & kMoeCombineBias) != 0) {
    contract_buffer(launch, 5, "bias", checked_product({p.n_experts, p.hidden, 4}, what), 4,
                    Access::Read);
  }
}

// ---- The fused experts block (moe_fused_params.h gives the slots) ------------------------------

inline MoeFusedKernelParams check_moe_fused_params(const KernelLaunch& launch) {
  contract_slot_count(launch, 6);
  const auto p = contract_params<MoeFusedKernelParams>(launch, 0);
  if (p.m == 0 || p.top_k == 0 || p.n_experts == 0 || p.hidden == 0 || p.intermediate == 0 ||
      p.hidden % 8 != 0 || p.intermediate % 8 != 0 || p.split_gate_up > 1 || p.weights_dtype > 2 ||
      (p.id_bytes != 4 && p.id_bytes != 8) || p.top_k > kMoeExpertsFusedMaxTopK) {
    contract_violation(launch,
                       "params have a zero extent, a width not a multiple of 8, top_k above the "
                       "kernel's bound, or an unknown weights dtype, id width or split flag");
  }
  return p;
}

template <uint64_t kElement>
void check_moe_fused_gate_up_args(const KernelLaunch& launch) {
  const auto p = check_moe_fused_params(launch);
  const std::string what = launch.label + " extents";
  const uint64_t rows = checked_mul(p.m, p.top_k, what);
  const uint64_t gate_rows =
      p.split_gate_up ? p.intermediate : checked_mul(2, p.intermediate, what);
  contract_buffer(launch, 1, "hidden", checked_product({p.m, p.hidden, kElement}, what), 16,
                  Access::Read);
  contract_buffer(launch, 2, "ids", checked_mul(rows, p.id_bytes, what), p.id_bytes, Access::Read);
  contract_buffer(launch, 3, "gate_up",
                  checked_product({p.n_experts, gate_rows, p.hidden, kElement}, what), 16,
                  Access::Read);
  contract_buffer(launch, 4, "up",
                  p.split_gate_up
                      ? checked_product({p.n_experts, p.intermediate, p.hidden, kElement}, what)
                      : 0,
                  16, Access::Read);
  contract_buffer(launch, 5, "act", checked_product({rows, p.intermediate, 4}, what), 16,
                  Access::Write);
}

template <uint64_t kElement>
void check_moe_fused_down_args(const KernelLaunch& launch) {
  const auto p = check_moe_fused_params(launch);
  const std::string what = launch.label + " extents";
  const uint64_t rows = checked_mul(p.m, p.top_k, what);
  const uint64_t wsize = moe_fused_weights_size(p.weights_dtype);
  contract_buffer(launch, 1, "act", checked_product({rows, p.intermediate, 4}, what), 16,
                  Access::Read);
  contract_buffer(launch, 2, "ids", checked_mul(rows, p.id_bytes, what), p.id_bytes, Access::Read);
  contract_buffer(launch, 3, "weights", checked_mul(rows, wsize, what), wsize, Access::Read);
  contract_buffer(launch, 4, "down",
                  checked_product({p.n_experts, p.hidden, p.intermediate, kElement}, what), 16,
                  Access::Read);
  contract_buffer(launch, 5, "output", checked_product({p.m, p.hidden, kElement}, what), 16,
                  Access::Write);
}

// ---- Lookup by canonical pipeline name ---------------------------------------------------------

// The contract of the pipeline named `name`: one of kDenseMatmulIdPipelineNames,
// kDenseMatmulIdTensorPipelineNames, kDenseMatmulIdBf16DotPipelineNames, kQ4MatmulPipelineNames,
// kQ8MatmulPipelineNames, kQ8_0MatVecNr2Pipeline, kGgmlInt8DotPipelineNames,
// kGgmlQuantizedMatmulIdPipelineNames, kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline,
// kGgmlQuantizedMatmulIdTensorPipelineNames,
// kGgmlQuantizedMatmulIdInt8DotPipelineNames, kMoePipelineNames, the two calibration kernels or
// the pipelines of ggml_formats.h's kKernelFormats and kKQuantInt8DotFormats.
// Backends call this while building their kernel lists, so a kernel added without a contract
// fails when its backend opens instead of going unchecked.
inline KernelArgCheck kernel_arg_contract(std::string_view name) {
  constexpr auto& ids = kDenseMatmulIdPipelineNames;
  constexpr auto& tensor = kDenseMatmulIdTensorPipelineNames;
  static_assert(
      ids[0] == "dense_matmul_id_direct_f32_f32" && ids[1] == "dense_matmul_id_direct_f16_f32" &&
      ids[2] == "dense_matmul_id_direct_bf16_f32" && ids[3] == kDenseMatmulIdMapPipeline &&
      ids[4] == "dense_matmul_id_grouped_f32_f32" && ids[5] == "dense_matmul_id_grouped_f16_f32" &&
      ids[6] == "dense_matmul_id_grouped_bf16_f32");
  static_assert(tensor[0] == "dense_matmul_id_grouped_tf32_f32_f32" &&
                tensor[1] == "dense_matmul_id_grouped_tf32_f16_f32" &&
                tensor[2] == "dense_matmul_id_grouped_tf32_bf16_f32" &&
                tensor[3] == "dense_matmul_id_grouped_lowp_f16_f32" &&
                tensor[4] == "dense_matmul_id_grouped_lowp_bf16_f32");
  constexpr auto& bf16dot = kDenseMatmulIdBf16DotPipelineNames;
  static_assert(bf16dot[0] == "dense_matmul_id_direct_bf16dot_bf16_f32" &&
                bf16dot[1] == "dense_matmul_id_grouped_bf16dot_bf16_f32");
  static_assert(kQ4MatmulPipelineNames[0] == kQ4_0MatVecPipeline);
  static_assert(kQ8MatmulPipelineNames[0] == "kernel_mul_mv_q8_0_f32");
  constexpr auto& qid = kGgmlQuantizedMatmulIdPipelineNames;
  static_assert(qid[0] == "quantized_matmul_id_direct_q4_0_f32" &&
                qid[1] == "quantized_matmul_id_direct_q8_0_f32" &&
                qid[2] == "quantized_matmul_id_grouped_q4_0_f32" &&
                qid[3] == "quantized_matmul_id_grouped_q8_0_f32");
  constexpr auto& qid_tensor = kGgmlQuantizedMatmulIdTensorPipelineNames;
  static_assert(qid_tensor[0] == "quantized_matmul_id_grouped_lowp_q4_0_f32" &&
                qid_tensor[1] == "quantized_matmul_id_grouped_lowp_q8_0_f32");
  constexpr auto& qid_int8 = kGgmlQuantizedMatmulIdInt8DotPipelineNames;
  static_assert(qid_int8[0] == "quantized_matmul_id_direct_int8dot_q4_0_f32" &&
                qid_int8[1] == "quantized_matmul_id_direct_int8dot_q8_0_f32" &&
                qid_int8[2] == "quantized_matmul_id_grouped_int8dot_q4_0_f32" &&
                qid_int8[3] == "quantized_matmul_id_grouped_int8dot_q8_0_f32");
  constexpr uint64_t q4 = kQ4_0BlockBytes, q8 = kQ8_0BlockBytes;
  const std::pair<std::string_view, KernelArgCheck> table[] = {
      {"routemm_calibration_poison_f32", &check_calibration_poison_args},
      {"routemm_calibration_compare_f32", &check_calibration_compare_args},
      {ids[0], &check_dense_matmul_id_direct_args<4>},
      {ids[1], &check_dense_matmul_id_direct_args<2>},
      {ids[2], &check_dense_matmul_id_direct_args<2>},
      {ids[3], &check_dense_matmul_id_map_args},
      {ids[4], &check_dense_matmul_id_grouped_args<4>},
      {ids[5], &check_dense_matmul_id_grouped_args<2>},
      {ids[6], &check_dense_matmul_id_grouped_args<2>},
      {tensor[0], &check_dense_matmul_id_grouped_args<4>},
      {tensor[1], &check_dense_matmul_id_grouped_args<2>},
      {tensor[2], &check_dense_matmul_id_grouped_args<2>},
      {tensor[3], &check_dense_matmul_id_grouped_args<2>},
      {tensor[4], &check_dense_matmul_id_grouped_args<2>},
      {bf16dot[0], &check_dense_matmul_id_direct_args<2>},
      {bf16dot[1], &check_dense_matmul_id_grouped_args<2>},
      {kQ4MatmulPipelineNames[0], &check_ggml_matvec_args<q4>},
      {kQ4MatmulPipelineNames[1], &check_ggml_matrix_args<q4>},
      {kQ4MatmulPipelineNames[2], &check_ggml_matrix_args<q4>},
      {kQ4MatmulPipelineNames[3], &check_ggml_matrix_args<q4>},
      {kQ4MatmulPipelineNames[4], &check_ggml_matrix_args<q4>},
      {kQ8MatmulPipelineNames[0], &check_ggml_matvec_args<q8>},
      {kQ8MatmulPipelineNames[1], &check_ggml_matrix_args<q8>},
      {kQ8_0MatVecNr2Pipeline, &check_ggml_matvec_args<q8>},
      {kGgmlInt8DotPipelineNames[0], &check_ggml_matvec_args<q4>},
      {kGgmlInt8DotPipelineNames[1], &check_ggml_matrix_args<q4>},
      {kGgmlInt8DotPipelineNames[2], &check_ggml_matvec_args<q8>},
      {kGgmlInt8DotPipelineNames[3], &check_ggml_matrix_args<q8>},
      {qid[0], &check_quantized_matmul_id_direct_args<q4>},
      {qid[1], &check_quantized_matmul_id_direct_args<q8>},
      {qid[2], &check_quantized_matmul_id_grouped_args<q4>},
      {qid[3], &check_quantized_matmul_id_grouped_args<q8>},
      {kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline, &check_quantized_matmul_id_direct_args<q8>},
      {qid_tensor[0], &check_quantized_matmul_id_grouped_args<q4>},
      {qid_tensor[1], &check_quantized_matmul_id_grouped_args<q8>},
      {qid_int8[0], &check_quantized_matmul_id_direct_args<q4>},
      {qid_int8[1], &check_quantized_matmul_id_direct_args<q8>},
      {qid_int8[2], &check_quantized_matmul_id_grouped_args<q4>},
      {qid_int8[3], &check_quantized_matmul_id_grouped_args<q8>},
      {kMoeGatePipeline, &check_moe_gate_args},
      {kMoeSiluMulPipeline, &check_moe_silu_mul_args},
      {kMoeCombinePipeline, &check_moe_combine_args},
      {kMoeExpertsFusedPipelineNames[0], &check_moe_fused_gate_up_args<4>},
      {kMoeExpertsFusedPipelineNames[1], &check_moe_fused_gate_up_args<2>},
      {kMoeExpertsFusedPipelineNames[2], &check_moe_fused_gate_up_args<2>},
      {kMoeExpertsFusedPipelineNames[3], &check_moe_fused_down_args<4>},
      {kMoeExpertsFusedPipelineNames[4], &check_moe_fused_down_args<2>},
      {kMoeExpertsFusedPipelineNames[5], &check_moe_fused_down_args<2>},
  };
  for (const auto& [known, check] : table) {
    if (known == name) return check;
  }
  if (const KernelArgCheck check = ggml_format_arg_contract<ggml_formats::kKernelFormats>(name)) {
    return check;
  }
  if (const KernelArgCheck check =
          ggml_format_arg_contract<ggml_formats::kKQuantInt8DotFormats>(name)) {
    return check;
  }
  throw Error("no argument contract for kernel '" + std::string(name) + "'");
}

}  // namespace routemm::kernels
