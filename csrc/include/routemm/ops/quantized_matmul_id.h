// Expert-ID matmul over GGML block-quantised expert stacks (Q4_0, Q8_0): F32 activations,
// per-token top-k expert IDs, F32 output.
//
//   out[flat, col] = sum_inner dequant(W[id[flat]])[col, inner] * x[row(flat), inner]
//
// with flat = token * top_k + slot and row(flat) = token (SharedPerToken) or flat (Slotted).
// Expert e is n rows of k / 32 blocks (18 bytes for Q4_0, 34 for Q8_0), starting e *
// expert_stride_bytes bytes from the weight view's start (the raw bytes of a GGUF `_exps` tensor
// with stride n * k / 32 * block_bytes). IDs >= n_experts give an all-zero output row without
// forming a weight address. The route is explicit:
//   Direct   one dispatch; IDs may repeat. The decode route, and the flattened "expert-down"
//            form (m = tokens * top_k, top_k = 1, Slotted input, repeated IDs).
//   Grouped  dense_matmul_id's map (the same pipeline and DenseMatmulIdScratch) + a grouped
//            dispatch that reads each expert's blocks once per row tile; top_k <= n_experts (the
//            capacity the scratch is sized for), at most 1024 experts. IDs may repeat within a
//            token: the map routes every slot (an expert's segment then holds more than m rows,
//            which the dispatch loops over), so every row is computed.
//   GroupedTensorLowp  Grouped's map, scratch and id contract, multiplied on tensor cores: the
//            block values enter the MMA as exact f16 integers, activations are rounded to f16
//            (nearest even), and each block's partial sums are scaled by its F32 scale and summed
//            in F32. Not bit-identical to the other routes: a stated tolerance instead (1e-2
//            relative Frobenius error against a float64 reference on the dequantised weights,
//            docs/numerics.md). Taken only when asked for; only backends with tensor cores (CUDA)
//            register its pipelines, elsewhere the call fails before encoding (KernelNotFound).
//   DirectInt8Dot, GroupedInt8Dot  Direct's and Grouped's dispatches, maps, scratch and id
//            contracts under the reduced-precision int8-dot contract of quantized_matmul_ggml's
//            int8-dot pipelines (ggml_int8_dot.h; the K-quants': ggml_kquant_int8_dot.h, per
//            256-value block): each routed row's activations are rounded to int8 per 32-value
//            block, each block pair is an exact integer dot product, scaled and
//            summed in F32 in a fixed order. Each routed row therefore equals that dense
//            pipeline on its expert's matrix bit for bit, and the two routes equal each other,
//            on every clone, work split and thread count. Not bit-identical to the exact routes:
//            the stated bound of docs/numerics.md instead. Taken only when asked for; only the
//            CPU backend registers their pipelines, elsewhere the call fails before encoding
//            (KernelNotFound).
// Direct and Grouped dequantise exactly and accumulate in F32. Direct follows quantized_matmul_ggml's
// mat-vec order and equals it bit for bit on the same expert matrix (CPU, Metal). On CPU and CUDA
// Grouped sums in Direct's order, so the two routes are bit-identical there; Metal's Grouped
// multiplies on 8x8 simdgroup matrices, whose summation order the hardware does not specify, so
// it meets the F32 accumulation bound against the dequantised reference instead.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "routemm/buffer.h"
#include "routemm/encoder.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/registry.h"

namespace routemm {

inline constexpr uint32_t kGgmlQuantizedMatmulIdSchemaVersion = 1;

// Every pipeline this op owns besides the shared map (kDenseMatmulIdMapPipeline): direct Q4_0,
// direct Q8_0, grouped Q4_0, grouped Q8_0.
inline constexpr std::array<std::string_view, 4> kGgmlQuantizedMatmulIdPipelineNames = {
    "quantized_matmul_id_direct_q4_0_f32",
    "quantized_matmul_id_direct_q8_0_f32",
    "quantized_matmul_id_grouped_q4_0_f32",
    "quantized_matmul_id_grouped_q8_0_f32",
};

// Pipelines of the tensor-core route (registered only by backends with tensor cores): Q4_0, Q8_0,
// then the formats of ggml_formats.h's kKernelFormats in its order (Q4_1, Q5_0, Q5_1, MXFP4, Q4_K,
// Q5_K, Q6_K), each with its format's grouped pipeline's slots and contract.
inline constexpr std::array<std::string_view, 9> kGgmlQuantizedMatmulIdTensorPipelineNames = {
    "quantized_matmul_id_grouped_lowp_q4_0_f32", "quantized_matmul_id_grouped_lowp_q8_0_f32",
    "quantized_matmul_id_grouped_lowp_q4_1_f32", "quantized_matmul_id_grouped_lowp_q5_0_f32",
    "quantized_matmul_id_grouped_lowp_q5_1_f32", "quantized_matmul_id_grouped_lowp_mxfp4_f32",
    "quantized_matmul_id_grouped_lowp_q4_k_f32", "quantized_matmul_id_grouped_lowp_q5_k_f32",
    "quantized_matmul_id_grouped_lowp_q6_k_f32",
};

// Q8_0's Direct pipeline under GgmlRoutingPolicy.expert_q8_0_mv_nr2 (spec §4.1), registered by the
// CPU and Metal: kQ8_0MatVecNr2Pipeline's geometry and reduction order per routed row (2 output
// columns of one flat row per threadgroup of [32, 4, 1] threads, kQ8_0MatVecNr2ThreadgroupBytes of
// threadgroup memory at index 0; grid [ceil(n / 2), m * top_k, 1]). Each routed row equals
// kQ8_0MatVecNr2Pipeline on its expert's matrix bit for bit (on the CPU both also equal the
// lane-contract mat-vec, as the dense pair does); Direct's id contract and bindings.
inline constexpr std::string_view kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline =
    "quantized_matmul_id_direct_q8_0_f32_nr2";

// Pipelines of the int8-dot routes (registered only by the CPU backend): direct Q4_0, direct Q8_0,
// grouped Q4_0, grouped Q8_0.
inline constexpr std::array<std::string_view, 4> kGgmlQuantizedMatmulIdInt8DotPipelineNames = {
    "quantized_matmul_id_direct_int8dot_q4_0_f32",
    "quantized_matmul_id_direct_int8dot_q8_0_f32",
    "quantized_matmul_id_grouped_int8dot_q4_0_f32",
    "quantized_matmul_id_grouped_int8dot_q8_0_f32",
};

enum class GgmlQuantizedMatmulIdRoute : uint8_t {
  Direct,
  Grouped,
  GroupedTensorLowp,
  DirectInt8Dot,
  GroupedInt8Dot
};
std::string_view to_string(GgmlQuantizedMatmulIdRoute value);
inline constexpr std::array<GgmlQuantizedMatmulIdRoute, 5> kAllGgmlQuantizedMatmulIdRoutes = {
    GgmlQuantizedMatmulIdRoute::Direct, GgmlQuantizedMatmulIdRoute::Grouped,
    GgmlQuantizedMatmulIdRoute::GroupedTensorLowp, GgmlQuantizedMatmulIdRoute::DirectInt8Dot,
    GgmlQuantizedMatmulIdRoute::GroupedInt8Dot};

// Routes that run dense_matmul_id's map and need caller-owned scratch.
constexpr bool is_grouped(GgmlQuantizedMatmulIdRoute route) {
  return route != GgmlQuantizedMatmulIdRoute::Direct &&
         route != GgmlQuantizedMatmulIdRoute::DirectInt8Dot;
}

struct GgmlQuantizedMatmulIdParams {
  uint32_t m = 0;          // tokens (rows of ids)
  uint32_t n = 0;          // output features per expert (weight rows)
  uint32_t k = 0;          // input width (weight columns before quantisation), a multiple of 32
  uint32_t top_k = 0;      // expert slots per token
  uint32_t n_experts = 0;  // experts in the weight stack
  GgmlType ggml_type = GgmlType::Q4_0;
  uint64_t expert_stride_bytes = 0;  // byte distance from expert e to e + 1
  DenseMatmulIdInputLayout input_layout = DenseMatmulIdInputLayout::SharedPerToken;
  GgmlQuantizedMatmulIdRoute route = GgmlQuantizedMatmulIdRoute::Direct;
  bool operator==(const GgmlQuantizedMatmulIdParams&) const = default;
};

struct GgmlQuantizedMatmulIdCapability {
  uint32_t schema_version = kGgmlQuantizedMatmulIdSchemaVersion;
  GgmlType ggml_type = GgmlType::Q4_0;
  GgmlQuantizedMatmulIdRoute route = GgmlQuantizedMatmulIdRoute::Direct;
  uint64_t required_weight_bytes = 0;  // (n_experts - 1) * stride + one expert matrix
  uint64_t required_input_bytes = 0;
  uint64_t required_ids_bytes = 0;
  uint64_t required_output_bytes = 0;
  std::optional<DenseMatmulIdScratchRequirement> scratch;  // grouped routes only
  bool operator==(const GgmlQuantizedMatmulIdCapability&) const = default;
};

struct GgmlQuantizedMatmulIdDispatchReceipt {
  GgmlType ggml_type = GgmlType::Q4_0;
  GgmlQuantizedMatmulIdRoute route = GgmlQuantizedMatmulIdRoute::Direct;
  uint32_t dispatch_count = 0;  // 1 direct, 2 grouped routes (1 when they reused a routing map)
  std::string_view pipeline;    // the product's pipeline (direct or grouped; not the map)
};

// Exact byte extents for one call, with checked arithmetic; no allocation, no compilation. In
// order (messages prefixed "quantized_matmul_id_ggml "): nonzero dims; supported type (q4_0,
// q8_0); K % 32; for the grouped routes, top_k <= n_experts and n_experts <= 1024; stride >= one matrix and
// even (block scales are 2-byte aligned); weight extent; u32 flattened rows; input/ids/output.
GgmlQuantizedMatmulIdCapability quantized_matmul_id_ggml_capability(
    const GgmlQuantizedMatmulIdParams& params);

// Capability plus every per-buffer check: dtypes (weights U8, input/output F32, ids U32), logical
// extents, alignment (weights 2 bytes, the others their dtype), writable output, no overlap of the
// output with any input, one device, and for the grouped routes the scratch's presence and
// capacity.
GgmlQuantizedMatmulIdCapability validate_quantized_matmul_id_ggml_call(
    const Buffer& weights, const Buffer& input, const Buffer& expert_ids, const Buffer& output,
    const DenseMatmulIdScratch* scratch, const GgmlQuantizedMatmulIdParams& params);

// The pipelines a route encodes, in order: {direct} or {map, grouped} (the grouped pipeline of the
// route: exact, lowp or int8-dot).
std::vector<std::string_view> quantized_matmul_id_ggml_route_pipelines(
    GgmlType type, GgmlQuantizedMatmulIdRoute route);
// The same for a call on `registry` under GgmlRoutingPolicy.expert_q8_0_mv_nr2: with q8_0_mv_nr2,
// Q8_0's Direct route runs kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline where the registry has it
// (elsewhere, e.g. CUDA, the lane-contract direct pipeline). Every other call is unchanged.
std::vector<std::string_view> quantized_matmul_id_ggml_call_pipelines(
    const KernelRegistry& registry, GgmlType type, GgmlQuantizedMatmulIdRoute route,
    bool q8_0_mv_nr2);
// GgmlRoutingPolicy.expert_q8_0_mv_nr2 of the callers that take no policy (the tensor and torch
// ops, the MoE op): ROUTEMM_Q8_0_ID_MV_NR2 is 1, true or on (any case, blanks around it ignored,
// as GgmlRoutingPolicy's reader), else false. Read once, at first use.
bool expert_q8_0_mv_nr2_from_environment();

// Validates, resolves every pipeline, then encodes. Any failure happens before the encoder is
// touched: no barrier, no pending ranges, no dispatch. `map` (grouped routes only) says whether the call
// builds its routing map or reuses the scratch's (DenseMatmulIdMapUse; dense_matmul_id and this op
// share the map, so either may build it for the other).
// q8_0_mv_nr2: GgmlRoutingPolicy.expert_q8_0_mv_nr2 (quantized_matmul_id_ggml_call_pipelines); the
// receipt names the pipeline that ran.
GgmlQuantizedMatmulIdDispatchReceipt quantized_matmul_id_ggml(
    CommandEncoder& encoder, KernelRegistry& registry, const Buffer& input, const Buffer& weights,
    const Buffer& expert_ids, const Buffer& output, const DenseMatmulIdScratch* scratch,
    const GgmlQuantizedMatmulIdParams& params, DenseMatmulIdMapUse map = DenseMatmulIdMapUse::Build,
    bool q8_0_mv_nr2 = false);

}  // namespace routemm
