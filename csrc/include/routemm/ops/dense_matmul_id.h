// Expert-ID matmul for mixture-of-experts layers: F32/F16/BF16 expert weight stacks, F32
// activations, per-token top-k expert IDs.
//
//   out[flat, col] = sum_inner widen(W[id[flat]][col, inner]) * x[row(flat), inner]
//
// with flat = token * top_k + slot and row(flat) = token (SharedPerToken) or flat (Slotted). IDs
// >= n_experts give an all-zero output row without forming a weight address. The route is always
// explicit: Direct (one dispatch) or GroupedPrefill (map + grouped dispatch, caller-owned
// scratch). GroupedPrefill is declared for DistinctPerToken ids (top_k <= n_experts, which sizes
// its scratch), but its map routes every slot, so an id that repeats within a token anyway still
// gets its row computed. Scalar routes accumulate in F32 in a fixed order, so Direct and
// GroupedPrefill are bit-identical on one backend, for any ids.
//
// Beyond those, two tensor-core routes share GroupedPrefill's map, scratch and receipt contract but
// round their operands, so they carry a stated tolerance instead of bit identity and are taken only
// when asked for (or chosen by a calibration that proved them): GroupedTensorTf32 (activations and
// weights rounded to tf32, exact for f16/bf16 weights; F32 accumulation) and GroupedTensorLowp
// (activations rounded to the weight dtype, f16/bf16 weights only; F32 accumulation). Backends
// without tensor cores do not register their pipelines.
//
// Two reduced-precision CPU routes, likewise explicit: DirectBf16Dot (one dispatch, ids may
// repeat, as Direct) and GroupedBf16Dot (GroupedPrefill's map, scratch and receipts), BF16 weights
// only. Activations are rounded to bf16 (nearest even) and multiplied by the weights with bf16 dot
// products accumulated in F32 (AVX512_BF16). Only a CPU backend whose processor has those
// instructions registers their pipelines; everywhere else the call fails before encoding.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "routemm/buffer.h"
#include "routemm/device.h"
#include "routemm/dtype.h"
#include "routemm/encoder.h"
#include "routemm/registry.h"

namespace routemm {

inline constexpr uint32_t kDenseMatmulIdSchemaVersion = 3;
inline constexpr uint32_t kDenseMatmulIdGroupedMaxExperts = 1024;

// Every pipeline name this op owns: registration and post-freeze protection use this one list.
inline constexpr std::array<std::string_view, 7> kDenseMatmulIdPipelineNames = {
    "dense_matmul_id_direct_f32_f32",   "dense_matmul_id_direct_f16_f32",
    "dense_matmul_id_direct_bf16_f32",  "dense_matmul_id_map_distinct",
    "dense_matmul_id_grouped_f32_f32",  "dense_matmul_id_grouped_f16_f32",
    "dense_matmul_id_grouped_bf16_f32",
};
inline constexpr std::string_view kDenseMatmulIdMapPipeline = "dense_matmul_id_map_distinct";

// Pipelines of the tensor-core routes (registered only by backends that have tensor cores).
inline constexpr std::array<std::string_view, 5> kDenseMatmulIdTensorPipelineNames = {
    "dense_matmul_id_grouped_tf32_f32_f32",  "dense_matmul_id_grouped_tf32_f16_f32",
    "dense_matmul_id_grouped_tf32_bf16_f32", "dense_matmul_id_grouped_lowp_f16_f32",
    "dense_matmul_id_grouped_lowp_bf16_f32",
};

enum class DenseMatmulIdInputLayout : uint8_t { SharedPerToken, Slotted };
enum class DenseMatmulIdMultiplicity : uint8_t { DistinctPerToken, MayRepeat };
// Pipelines of the reduced-precision CPU routes (registered only by a CPU backend whose processor
// has AVX512_BF16): direct, grouped.
inline constexpr std::array<std::string_view, 2> kDenseMatmulIdBf16DotPipelineNames = {
    "dense_matmul_id_direct_bf16dot_bf16_f32",
    "dense_matmul_id_grouped_bf16dot_bf16_f32",
};

enum class DenseMatmulIdRoute : uint8_t {
  Direct,
  GroupedPrefill,
  GroupedTensorTf32,
  GroupedTensorLowp,
  DirectBf16Dot,
  GroupedBf16Dot
};

// Routes that run the map dispatch and need caller-owned scratch (declared DistinctPerToken).
constexpr bool is_grouped(DenseMatmulIdRoute route) {
  return route != DenseMatmulIdRoute::Direct && route != DenseMatmulIdRoute::DirectBf16Dot;
}

// Whether a grouped call builds its routing map (the expert counts and routed rows in the scratch)
// or reuses one. The map depends only on the ids and on m, top_k and n_experts, so grouped calls
// over the same ids -- a MoE block's gate/up and down projections, of any n, k and input layout --
// can share one:
//   Build  the route's map dispatch (after the scratch barrier), then the grouped dispatch.
//   Reuse  the grouped dispatch alone, reading the map that the last Build call into this scratch
//          encoded. That call must have named the same ids view with the same m, top_k and
//          n_experts (checked: InvalidArgument otherwise); the caller leaves the ids and the
//          scratch unchanged in between. The building call's barrier after its map orders the map
//          before every later dispatch, so the Reuse call adds none: like the direct route, it is
//          ordered after its input's producer by the caller. The map is what zeroes the output
//          rows of invalid ids, so a Reuse call leaves those rows of its output unwritten.
// Only grouped routes take Reuse; its receipt counts one dispatch.
enum class DenseMatmulIdMapUse : uint8_t { Build, Reuse };

std::string_view to_string(DenseMatmulIdInputLayout value);
std::string_view to_string(DenseMatmulIdMultiplicity value);
std::string_view to_string(DenseMatmulIdRoute value);
std::string_view to_string(DenseMatmulIdMapUse value);

struct DenseMatmulIdParams {
  uint32_t m = 0;                    // tokens
  uint32_t n = 0;                    // output features per expert
  uint32_t k = 0;                    // input width
  uint32_t top_k = 0;                // expert slots per token
  uint32_t n_experts = 0;            // experts in the weight stack
  uint64_t expert_stride_bytes = 0;  // byte distance from expert e to e + 1
  DenseMatmulIdInputLayout input_layout = DenseMatmulIdInputLayout::SharedPerToken;
  DenseMatmulIdMultiplicity id_multiplicity = DenseMatmulIdMultiplicity::DistinctPerToken;
  DenseMatmulIdRoute route = DenseMatmulIdRoute::Direct;
  bool operator==(const DenseMatmulIdParams&) const = default;
};

struct DenseMatmulIdScratchRequirement {
  uint64_t expert_counts_bytes = 0;
  uint64_t routed_rows_bytes = 0;
  bool operator==(const DenseMatmulIdScratchRequirement&) const = default;
};

struct DenseMatmulIdCapability {
  uint32_t schema_version = kDenseMatmulIdSchemaVersion;
  DType weight_dtype = DType::F32;
  DenseMatmulIdRoute route = DenseMatmulIdRoute::Direct;
  uint64_t required_weight_bytes = 0;
  uint64_t required_input_bytes = 0;
  uint64_t required_ids_bytes = 0;
  uint64_t required_output_bytes = 0;
  std::optional<DenseMatmulIdScratchRequirement> scratch;
  bool operator==(const DenseMatmulIdCapability&) const = default;
};

struct DenseMatmulIdDispatchReceipt {
  DType weight_dtype = DType::F32;
  DenseMatmulIdRoute route = DenseMatmulIdRoute::Direct;
  uint32_t dispatch_count = 0;  // 1 direct, 2 grouped (1 when it reused a routing map)
};

// Caller-owned scratch for GroupedPrefill: U32 expert_counts[max_experts] and
// routed_rows[max_experts, max_tokens]. The map writes each expert's row count and one list of
// flat rows ordered by expert (expert e's segment starts after the counts of the experts before
// it, rows in flat order); it holds at most m * top_k <= n_experts * m entries, so the
// [max_experts, max_tokens] shape is a capacity, not a per-expert layout. The buffers must outlive
// every submission using them;
// reuse across encoders only after the previous submission completed (same-encoder reuse is
// ordered by the grouped route's leading barrier).
class DenseMatmulIdScratch {
 public:
  DenseMatmulIdScratch(const Device& device, uint32_t max_experts, uint32_t max_tokens);
  // Scratch in the caller's buffers (e.g. a framework's allocator, so that a captured CUDA graph
  // owns no routemm allocation): U32, writable, disjoint, at least the capacity's bytes each.
  DenseMatmulIdScratch(Buffer expert_counts, Buffer routed_rows, uint32_t max_experts,
                       uint32_t max_tokens);
  uint32_t max_experts() const { return max_experts_; }
  uint32_t max_tokens() const { return max_tokens_; }
  const Buffer& expert_counts() const { return expert_counts_; }
  const Buffer& routed_rows() const { return routed_rows_; }

  // What the last routing map encoded into this scratch was built from: the ids' logical byte
  // range and the call's m, top_k and n_experts. The expert-ID front doors record it when they
  // encode a map and check a DenseMatmulIdMapUse::Reuse call against it. Copies of a scratch share
  // their buffers and so this record.
  struct MapKey {
    uint64_t ids_start = 0;
    uint64_t ids_end = 0;
    uint32_t m = 0;
    uint32_t top_k = 0;
    uint32_t n_experts = 0;
    bool operator==(const MapKey&) const = default;
  };
  std::optional<MapKey> map_key() const;
  void record_map(const MapKey& key) const;

 private:
  struct MapRecord {
    std::mutex mutex;
    std::optional<MapKey> key;
  };

  Buffer expert_counts_;
  Buffer routed_rows_;
  uint32_t max_experts_;
  uint32_t max_tokens_;
  std::shared_ptr<MapRecord> map_record_ = std::make_shared<MapRecord>();
};

// The automatic route of an expert-ID call that names none (`matmul_id`, the MoE layer, the
// tensor and torch ops), for ids that may be declared distinct per token: true for the exact
// grouped route, false for direct. Only for more than `mm_threshold` tokens
// (GgmlRoutingPolicy.expert_mm_threshold, spec §4.1; by default kExpertMmThreshold, so from
// kExpertIdAutoGroupedMinTokens tokens on), on every backend;
// on CUDA also only once the rows routed per expert reach kCudaGroupedRowsPerExpert (dense
// stacks) or kCudaQuantizedGroupedRowsPerExpert (GGML block stacks) on average
// (m * top_k >= rows * n_experts), because CUDA's direct kernels share a weight tile among the
// rows routed to it through L2 and its exact grouped kernels pay per tile: measured on an H100 and
// an H200 (bench/lab/records/logs/h200-checks-2026-12-05d.md), for dense stacks direct was up to
// 3.6x faster at 0.5-4 rows per expert and grouped 1.5-7.9x faster from 8 on; for block stacks
// direct was ahead at every measured m (up to 32 rows per expert, by 1.04-4.6x) and, by its time
// at m = 512, level with grouped at 256 (Qwen3-30B-A3B Q4_0, m = 4096). Depends on the shapes and
// the backend only, never on the ids. `backend` is a Device::backend_name() ("cpu", "cuda",
// "metal").
inline constexpr uint64_t kExpertIdAutoGroupedMinTokens = 9;
inline constexpr uint64_t kCudaGroupedRowsPerExpert = 8;
inline constexpr uint64_t kCudaQuantizedGroupedRowsPerExpert = 256;
inline constexpr uint64_t kExpertMmThreshold = kExpertIdAutoGroupedMinTokens - 1;
bool expert_id_auto_grouped(std::string_view backend, uint64_t m, uint64_t top_k,
                            uint64_t n_experts, bool quantized, uint64_t mm_threshold);
// The same under the environment's threshold (expert_mm_threshold_from_environment), for the
// callers that take no policy: the tensor and torch ops and the MoE op.
bool expert_id_auto_grouped(std::string_view backend, uint64_t m, uint64_t top_k,
                            uint64_t n_experts, bool quantized);
// ROUTEMM_MM_ID_ROUTING_THRESHOLD, read once at first use (as the tensor ops' other routing
// knobs): unset or blank is kExpertMmThreshold; anything but a decimal integer in [0, 2^32 - 1]
// is an InvalidArgument naming the variable (and is read again at the next use).
uint64_t expert_mm_threshold_from_environment();
// GgmlRoutingPolicy.expert_tensor_mm (spec §4.1) of the callers that take no policy (the MoE op's
// automatic route): false (force_simd, no tensor-core expert routes) when
// ROUTEMM_DISABLE_TENSOR_MM_ID is "1" (blanks around it ignored, as GgmlRoutingPolicy's reader),
// else true (auto_probe). Read once, at first use, as the threshold.
bool expert_tensor_mm_from_environment();

// Exact byte extents for one call, with checked arithmetic; no allocation, no compilation.
DenseMatmulIdCapability dense_matmul_id_capability(DType weight_dtype,
                                                   const DenseMatmulIdParams& params);

// Capability plus every per-buffer check (dtype, extent, alignment, output overlap, scratch).
DenseMatmulIdCapability validate_dense_matmul_id_call(const Buffer& weights, const Buffer& input,
                                                      const Buffer& expert_ids,
                                                      const Buffer& output,
                                                      const DenseMatmulIdScratch* scratch,
                                                      const DenseMatmulIdParams& params);

// The pipelines a route encodes, in order: {direct} or {map, grouped kernel of the route}.
std::vector<std::string_view> dense_matmul_id_route_pipelines(DType weight_dtype,
                                                              DenseMatmulIdRoute route);

// The dispatches a call of `params.route` encodes on `registry`'s backend, in order, with the
// geometry derived from the registered kernel definitions exactly as the encoder derives it (spec
// §7.4's geometry on the CPU; Metal's map is one threadgroup of 128 threads with its own
// threadgroup memory; CUDA's own tiles). Resolves nothing; throws KernelNotFound when a pipeline
// is not registered.
std::vector<EncodedKernelDispatch> dense_matmul_id_expected_dispatches(
    const KernelRegistry& registry, DType weight_dtype, const DenseMatmulIdParams& params);

// Validates, resolves every pipeline, then encodes. Any failure happens before the encoder is
// touched: no barrier, no pending ranges, no dispatch. `map` (grouped routes only) says whether
// the call builds its routing map or reuses the scratch's (DenseMatmulIdMapUse).
DenseMatmulIdDispatchReceipt dense_matmul_id(CommandEncoder& encoder, KernelRegistry& registry,
                                             const Buffer& weights, const Buffer& input,
                                             const Buffer& expert_ids, const Buffer& output,
                                             const DenseMatmulIdScratch* scratch,
                                             const DenseMatmulIdParams& params,
                                             DenseMatmulIdMapUse map = DenseMatmulIdMapUse::Build);

}  // namespace routemm
