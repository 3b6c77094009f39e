// GGML Q4_0 / Q8_0 dense projections (spec §4, §5, §6.2): out[M, N] = input[M, K] @ dequant(W[N, K])^T.
//
// Input and output are F32, row-major; the weight is a U8 buffer holding the raw GGUF blocks (N
// rows of K / 32 blocks of 18 bytes for Q4_0, 34 for Q8_0). M <= 8 takes the mat-vec pipeline;
// for Q4_0, M > 8 takes one of four matrix routes chosen by the routing policy and the route plan
// frozen into the registry; Q8_0 has one matrix route (compatibility_simdgroup).
// Every route has its own pipeline name; labels carry the int constants (700,1),(701,1),(702,1).
// The front doors validate, resolve every pipeline, then encode: a failure leaves the encoder
// untouched (no dispatch, no pending ranges, nothing in an open receipt).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "routemm/buffer.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/registry.h"

namespace routemm {

inline constexpr uint32_t kGgmlQuantizedMatmulSchemaVersion = 1;
// M at or below which the mat-vec pipeline is used (llama.cpp's ne11_mm_min).
inline constexpr uint32_t kGgmlMmRoutingThreshold = 8;

// GGML block formats this library knows by name. Q4_0 and Q8_0 are supported by
// quantized_matmul_ggml; the others exist so that callers can name them and get "does not support"
// rather than a parse error. snake_case names ("q4_0") are the JSON values.
enum class GgmlType : uint8_t {
  Q4_0,
  Q5_0,
  Q5_1,
  Q8_0,
  Q2_K,
  Q3_K,
  Q4_K,
  Q5_K,
  Q6_K,
  IQ4_NL,
  IQ4_XS,
  Q4_1,  // appended: the values above are the tensor-op ABI's type codes
  MXFP4
};
inline constexpr std::array<GgmlType, 13> kAllGgmlTypes = {
    GgmlType::Q4_0,   GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K,
    GgmlType::Q3_K,   GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_NL,
    GgmlType::IQ4_XS, GgmlType::Q4_1, GgmlType::MXFP4};
std::string_view to_string(GgmlType type);
// (values per block, bytes per block) of spec §5.1.
std::pair<uint32_t, uint32_t> ggml_block_layout(GgmlType type);

// Whether the dense matrix routes may use the tensor-API kernels (after a device probe).
enum class GgmlTensorMmPreference : uint8_t { AutoProbe, ForceSimd };
std::string_view to_string(GgmlTensorMmPreference value);

// The dense half of spec §4.1's policy. Explicit policies are used as given; only
// ggml_routing_policy_from_environment() reads the environment.
struct GgmlRoutingPolicy {
  GgmlTensorMmPreference dense_tensor_mm = GgmlTensorMmPreference::AutoProbe;
  bool allow_dense_large_tile_mm = true;
  // Q8_0 mat-vec calls take kQ8_0MatVecNr2Pipeline where the backend has it (spec §5.5).
  bool dense_q8_0_mv_nr2 = true;
  // Reduced precision, opt-in: every call (Q4_0 and Q8_0, mat-vec and matrix) takes the int8-dot
  // pipeline of kGgmlInt8DotPipelineNames where the backend has it (the CPU); elsewhere the exact
  // routes run as if it were off, and the receipt's label says which ran.
  bool dense_int8_dot = false;
  bool operator==(const GgmlRoutingPolicy&) const = default;
};
// Reads, at call time: ROUTEMM_DISABLE_TENSOR_MM=1 -> ForceSimd; ROUTEMM_LARGE_TILE_MM=0/false/off
// (any case) -> allow_dense_large_tile_mm = false; ROUTEMM_Q8_0_MV_NR2=0/false/off (any case) ->
// dense_q8_0_mv_nr2 = false; ROUTEMM_DENSE_INT8_DOT=1/true/on (any case) -> dense_int8_dot = true.
// Anything else keeps the default.
GgmlRoutingPolicy ggml_routing_policy_from_environment();

// The four matrix routes for M > 8 (spec §6.1), each its own pipeline.
enum class DenseQ4Route : uint8_t {
  CompatibilitySimdgroup,  // kernel_mul_mm_q4_0_f32, 32-token tile
  CompatibilityTensorV1,   // kernel_mul_mm_q4_0_tensor_f32, 32-token tile
  CompatibilityV2,         // kernel_mul_mm_q4_0_tensor_v2_f32, 128-token tile
  Tensor64x32,             // kernel_mul_mm_q4_0_tensor_64x32_f32: V2's arithmetic, 32-token tile
};
inline constexpr std::array<DenseQ4Route, 4> kAllDenseQ4Routes = {
    DenseQ4Route::CompatibilitySimdgroup, DenseQ4Route::CompatibilityTensorV1,
    DenseQ4Route::CompatibilityV2, DenseQ4Route::Tensor64x32};
std::string_view to_string(DenseQ4Route route);
std::string_view dense_q4_pipeline_name(DenseQ4Route route);

inline constexpr std::string_view kQ4_0MatVecPipeline = "kernel_mul_mv_q4_0_f32";
// Every pipeline name this op owns (mat-vec first, then the routes in kAllDenseQ4Routes order).
inline constexpr std::array<std::string_view, 5> kQ4MatmulPipelineNames = {
    "kernel_mul_mv_q4_0_f32", "kernel_mul_mm_q4_0_f32", "kernel_mul_mm_q4_0_tensor_f32",
    "kernel_mul_mm_q4_0_tensor_v2_f32", "kernel_mul_mm_q4_0_tensor_64x32_f32"};
// The Q8_0 pipelines: the mat-vec (M <= 8) and the one matrix route (M > 8), which carries the
// compatibility_simdgroup route's name, geometry and exact numerics for Q8_0 blocks.
inline constexpr std::array<std::string_view, 2> kQ8MatmulPipelineNames = {
    "kernel_mul_mv_q8_0_f32", "kernel_mul_mm_q8_0_f32"};
// The Q8_0 mat-vec of spec §5.5's default (GgmlRoutingPolicy::dense_q8_0_mv_nr2): threadgroups of
// [32, 4, 1] threads (4 simdgroups) computing 2 output rows of one token, 256 bytes of threadgroup
// memory; grid [ceil(N / 2), M, 1]. Optional: a backend without it (CUDA, which has its own Q8_0
// geometry) runs kQ8MatmulPipelineNames[0] instead, and the receipt's label says so.
inline constexpr std::string_view kQ8_0MatVecNr2Pipeline = "kernel_mul_mv_q8_0_f32_nr2";
inline constexpr uint32_t kQ8_0MatVecNr2Rows = 2;
inline constexpr uint32_t kQ8_0MatVecNr2Threads = 128;
inline constexpr uint64_t kQ8_0MatVecNr2ThreadgroupBytes = 256;
// The reduced-precision int8-dot pipelines (GgmlRoutingPolicy::dense_int8_dot; CPU only): each
// activation row rounded to int8 per 32-value block (binary32 scale max|x| / 127), exact integer
// dot products with the weight blocks, F32 scaling and accumulation in a fixed order; within the
// bound of docs/numerics.md. Q4_0 mat-vec, Q4_0 matrix, Q8_0 mat-vec, Q8_0 matrix: the mat-vecs
// with the exact mat-vec's geometry ([ceil(N / 8), M, 1] x [8, 8, 1]), the matrix pipelines with
// the simdgroup route's (32-token x 64-output tiles, 128 threads, 8192 bytes).
inline constexpr std::array<std::string_view, 4> kGgmlInt8DotPipelineNames = {
    "kernel_mul_mv_q4_0_int8dot_f32", "kernel_mul_mm_q4_0_int8dot_f32",
    "kernel_mul_mv_q8_0_int8dot_f32", "kernel_mul_mm_q8_0_int8dot_f32"};
// The receipt route string of an int8-dot call (mat-vec or matrix; the label tells which).
inline constexpr std::string_view kGgmlInt8DotRoute = "int8_dot";
// The specialisation constants every Q4 pipeline is fetched with: (700, batch=1), (701,1), (702,1).
inline constexpr std::array<std::pair<uint32_t, int32_t>, 3> kQ4PipelineConstants = {
    std::pair<uint32_t, int32_t>{700, 1}, {701, 1}, {702, 1}};

// Why a route was taken. The five after MatVecThreshold are spec §6.1's DenseQ4DecisionSource;
// MatVecThreshold (M <= 8) is routemm's name for calls that never reach dense Q4 route selection,
// PolicyInt8Dot for matrix calls the policy sent to an int8-dot pipeline.
enum class DenseQ4DecisionSource : uint8_t {
  MatVecThreshold,
  FrozenPlan,
  NoPlanCompatibilityFallback,
  UndeclaredCompatibilityFallback,
  IneligibleCompatibilityFallback,
  ForcedTest,
  PolicyInt8Dot,  // M > 8 under GgmlRoutingPolicy::dense_int8_dot: the int8-dot matrix pipeline
};
std::string_view to_string(DenseQ4DecisionSource value);

struct GgmlQuantizedMatmulParams {
  uint32_t m = 0;  // input rows (tokens)
  uint32_t n = 0;  // output features = weight rows
  uint32_t k = 0;  // input width = weight columns before quantisation
  GgmlType ggml_type = GgmlType::Q4_0;
  bool operator==(const GgmlQuantizedMatmulParams&) const = default;
};

struct DenseQ4RouteSelection {
  DenseQ4Route route = DenseQ4Route::CompatibilityV2;
  DenseQ4DecisionSource decision = DenseQ4DecisionSource::NoPlanCompatibilityFallback;
};

// Spec §6.2 without a frozen plan (steps 1-4), pure: not an exact shape (Q4_0, m > 8, k >= 32,
// k % 32 == 0) -> V2 / ineligible; ForceSimd -> simdgroup / ineligible; no large tile -> V1 /
// ineligible; else V2 / no_plan_compatibility_fallback.
DenseQ4RouteSelection select_dense_q4_route(const GgmlQuantizedMatmulParams& params,
                                            const GgmlRoutingPolicy& policy);

// The registry plan kind a dense Q4 route plan is frozen under.
inline constexpr std::string_view kDenseQ4PlanKind = "dense_q4";

// An exact plan key (spec §6.1 DenseQ4Shape; plans hold batch-1, contiguous-input shapes only).
struct DenseQ4Shape {
  uint32_t m = 0, n = 0, k = 0;
  auto operator<=>(const DenseQ4Shape&) const = default;
};

// What the dispatcher reads of a frozen dense Q4 route plan (spec §6.1 DenseQ4RoutePlan): the
// activation it is bound to and its exact-shape decisions. Plans are made, proved and
// fingerprinted by the calibration (routemm.calibrate_dense_q4_routes); this is their
// dispatch-time form, owned by the registry once frozen.
struct DenseQ4PlanRoutes {
  std::string plan_id;
  std::string device_name;
  uint64_t device_registry_id = 0;
  uint64_t registry_authority_id = 0;
  std::map<DenseQ4Shape, DenseQ4Route> routes;
};

// Freezes `plan` into `registry` under kDenseQ4PlanKind with KernelRegistry::freeze_plan's rules
// (one-shot; the same plan id again is a no-op; `protected_names` can no longer be re-registered;
// `plan_document` is the plan's serialised form). Refuses a plan bound to another registry
// authority ("different registry activation authority") or to another device than the registry's.
void freeze_dense_q4_plan_routes(KernelRegistry& registry, DenseQ4PlanRoutes plan,
                                 const std::vector<std::string>& protected_names,
                                 std::string plan_document = {});

// Spec §6.2 in full (no GPU work): steps 1-3 as above; then the plan frozen into `registry`:
// none -> V2 / no_plan_compatibility_fallback; bound to another registry authority or to another
// device than `device` -> V2 / ineligible; the exact shape declared -> its route / frozen_plan;
// else V2 / undeclared_compatibility_fallback.
DenseQ4RouteSelection select_dense_q4_route(const KernelRegistry& registry, const Device& device,
                                            const GgmlQuantizedMatmulParams& params,
                                            const GgmlRoutingPolicy& policy);

// The geometry a route's dispatch must have (spec §6.2 expected_dispatch): token tile 32 and 8192
// bytes of threadgroup memory for simdgroup/V1, 128 and 4096 for V2, 32 and 4096 for 64x32; grid
// [ceil(m / tile), ceil(n / 64), 1], threads [128, 1, 1], ThreadGroups.
// This is the reference geometry (the CPU backend's, and Metal's); see the overload below for
// the geometry a given registry's pipelines encode.
EncodedKernelDispatch q4_expected_dispatch(DenseQ4Route route, uint32_t m, uint32_t n);

// The geometry `route` encodes through `registry` for (m, n, k): derived from the registered
// KernelDef exactly as the front door derives it (tile extents, threads, threadgroup memory and,
// on backends that split K across grid.z, the split). Equals the reference geometry above on the
// CPU backend. Throws KernelNotFound when the registry lacks the route's pipeline.
EncodedKernelDispatch q4_expected_dispatch(const KernelRegistry& registry, DenseQ4Route route,
                                           uint32_t m, uint32_t n, uint32_t k);

struct GgmlQuantizedMatmulReceipt {
  GgmlType ggml_type = GgmlType::Q4_0;
  std::optional<DenseQ4Route> route;  // nullopt: the mat-vec pipeline
  DenseQ4DecisionSource decision = DenseQ4DecisionSource::MatVecThreshold;
  GgmlRoutingPolicy policy;
  bool int8_dot = false;  // an int8-dot pipeline ran (route is then nullopt)
  std::string pipeline_label;
  uint32_t dispatch_count = 0;
  EncodedKernelDispatch dispatch;  // what was encoded
};

// Byte extents of one call, checked in the order and with the messages of spec §5.3 (dtypes,
// signed-ABI range, supported type, positive dims, K % QK, then weight/input/output sizes), plus
// writability, one device and no output overlap. Throws InvalidArgument.
void validate_quantized_matmul_ggml_call(const Buffer& input, const Buffer& weight,
                                         const Buffer& output,
                                         const GgmlQuantizedMatmulParams& params);

// Validates, selects the route (M > 8, Q4_0: select_dense_q4_route with the registry's frozen
// plan for the registry's device), resolves the pipeline, then encodes one dispatch. The receipt's
// decision is the selection's when the selected route is the one encoded; a call that cannot take
// it says ineligible_compatibility_fallback: the plan's 64x32 pipeline failing to resolve falls
// back to V2 (spec §5.6), a backend without the tensor pipelines runs the simdgroup route.
// Q8_0 with M <= 8 runs kQ8_0MatVecNr2Pipeline when the policy's dense_q8_0_mv_nr2 is set and the
// registry has it, else kQ8MatmulPipelineNames[0]; the receipt's pipeline label names which.
// With the policy's dense_int8_dot set and the registry holding the call's int8-dot pipeline, that
// pipeline runs instead (decision mat_vec_threshold for M <= 8, policy_int8_dot above).
GgmlQuantizedMatmulReceipt quantized_matmul_ggml(CommandEncoder& encoder, KernelRegistry& registry,
                                                 const Buffer& input, const Buffer& weight,
                                                 const Buffer& output,
                                                 const GgmlQuantizedMatmulParams& params,
                                                 const GgmlRoutingPolicy& policy);

// quantized_matmul_ggml for an explicit device: the frozen plan is honoured only when it was made
// on `device` (spec §6.2 step 5).
GgmlQuantizedMatmulReceipt dense_q4_auto(CommandEncoder& encoder, KernelRegistry& registry,
                                         const Device& device, const Buffer& input,
                                         const Buffer& weight, const Buffer& output,
                                         const GgmlQuantizedMatmulParams& params,
                                         const GgmlRoutingPolicy& policy);

// Calibration entry: encodes exactly `route` (one dispatch, geometry == the registry's
// q4_expected_dispatch).
// Requires Q4_0 and M > 8 ("forced dense Q4 MM route requires Q4_0 and M > 8"), then the same
// validation as quantized_matmul_ggml. The decision is ForcedTest; no policy is consulted.
GgmlQuantizedMatmulReceipt encode_q4_route(CommandEncoder& encoder, KernelRegistry& registry,
                                           const Buffer& input, const Buffer& weight,
                                           const Buffer& output,
                                           const GgmlQuantizedMatmulParams& params,
                                           DenseQ4Route route);

}  // namespace routemm
