// GGML Q4_0 dense projection front door: validation (spec §5.3), routing (§5.4, §6.2), geometry
// (§5.5, §5.6) and encoding. Backends supply the five pipelines; every contract lives here.
#include "routemm/ops/q4_matmul.h"

#include <algorithm>
#include <any>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/common/q4_0_block.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"

namespace routemm {
namespace {

constexpr std::string_view kOp = "quantized_matmul_ggml";
constexpr uint64_t kSignedAbiMax = std::numeric_limits<int32_t>::max();
// Output features per matrix-route threadgroup, and the mm threadgroup shape (spec §5.6).
constexpr uint32_t kMmOutputTile = 64;

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument(std::string(kOp) + " " + message);
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

ByteRange prefix_range(const Buffer& buffer, uint64_t bytes) {
  const uint64_t start = buffer.address() + buffer.byte_offset();
  return {start, start + bytes};
}

ByteRange logical_range(const Buffer& buffer) {
  const auto [start, end] = buffer.logical_range();
  return {start, end};
}

bool overlaps(ByteRange a, ByteRange b) { return a.start < b.end && b.start < a.end; }

struct Extents {
  uint64_t weight = 0, input = 0, output = 0;
};

Extents call_extents(const GgmlQuantizedMatmulParams& p) {
  const auto [qk, block_bytes] = ggml_block_layout(p.ggml_type);
  // Each factor is <= i32::MAX (checked first), so no product below can overflow u64.
  return {uint64_t{p.n} * (p.k / qk) * block_bytes, uint64_t{p.m} * p.k * 4,
          uint64_t{p.m} * p.n * 4};
}

bool env_is(const char* name, std::initializer_list<std::string_view> values) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return false;
  std::string text(raw);
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return std::find(values.begin(), values.end(), text) != values.end();
}

// Reduction groups along grid.z (KernelDef::k_split_max): the largest power of two that is at
// most k_split_max, at most K / 32 / kMinBlocksPerSplit, and no more than needed to bring a
// reference grid up to k_split_target_groups. The reference grid depends on the shape only --
// mat-vec: its own grid; matrix routes: 64-token x 128-row tiles whatever the route's tiles -- so
// every matrix route of one shape splits K the same way (V2 and 64x32 stay bit-identical).
constexpr uint64_t kMinBlocksPerSplit = 16;
constexpr uint64_t kSplitReferenceTokens = 64;
constexpr uint64_t kSplitReferenceRows = 128;

uint64_t k_splits(const KernelDef& def, bool mat_vec, uint64_t m, uint64_t n, uint64_t k) {
  if (def.k_split_max <= 1) return 1;
  const uint64_t reference =
      mat_vec ? ceil_div(n, def.tile_x) * ceil_div(m, def.tile_y)
              : ceil_div(m, kSplitReferenceTokens) * ceil_div(n, kSplitReferenceRows);
  const uint64_t wanted = ceil_div(std::max<uint64_t>(def.k_split_target_groups, 1), reference);
  const uint64_t limit = std::min<uint64_t>({def.k_split_max, wanted, k / 32 / kMinBlocksPerSplit});
  uint64_t splits = 1;
  while (splits * 2 <= limit) splits *= 2;
  return splits;
}

struct Geometry {
  Dim3 grid, threads;
  std::vector<std::pair<uint64_t, uint64_t>> shmem;
};

// Spec §5.5 (mat-vec: threadgroups of 8 x threads/8, tile_x output rows and tile_y tokens each) and
// §5.6 (matrix routes: x covers tokens, tile_x per group; y covers outputs, tile_y per group), with
// grid.z the K split (1 on backends without one).
Geometry geometry(const KernelDef& def, bool mat_vec, uint64_t m, uint64_t n, uint64_t k) {
  Geometry g;
  const uint64_t splits = k_splits(def, mat_vec, m, n, k);
  if (mat_vec) {
    // The nr2 mat-vec's threadgroup is whole simdgroups ([32, 4, 1]); the others are [8, threads/8].
    const uint64_t lanes_x = def.name == kQ8_0MatVecNr2Pipeline ? 32 : 8;
    g.grid = Dim3{ceil_div(n, def.tile_x), ceil_div(m, def.tile_y), splits};
    g.threads = Dim3{lanes_x, std::max<uint64_t>(1, def.threads_per_group / lanes_x), 1};
  } else {
    g.grid = Dim3{ceil_div(m, def.tile_x), ceil_div(n, def.tile_y), splits};
    g.threads = Dim3{def.threads_per_group, 1, 1};
  }
  if (def.threadgroup_memory_bytes != 0) g.shmem.emplace_back(0, def.threadgroup_memory_bytes);
  return g;
}

struct Route {
  std::optional<DenseQ4Route> route;  // nullopt: mat-vec
  DenseQ4DecisionSource decision;
  bool q8_0_nr2 = false;  // the Q8_0 mat-vec runs kQ8_0MatVecNr2Pipeline
  // The int8-dot pipeline of the type and regime runs; a matrix call keeps route =
  // CompatibilitySimdgroup for its geometry (the int8-dot matrix pipelines have that route's).
  bool int8_dot = false;
};

// The kernel format of a type beyond Q4_0 / Q8_0 (ggml_formats.h), or nullptr.
const ggml_formats::KernelFormat* kernel_format(GgmlType type) {
  return ggml_formats::kernel_format(static_cast<uint8_t>(type));
}

// The int8-dot pipeline of a (validated) type and regime: Q4_0, Q8_0 and the K-quants of
// kKQuantInt8DotFormats have one; the other formats none (empty).
std::string_view int8_dot_pipeline(GgmlType type, bool mat_vec) {
  if (const ggml_formats::KernelFormat* f =
          ggml_formats::kquant_int8_dot_format(static_cast<uint8_t>(type))) {
    return mat_vec ? f->mat_vec : f->matrix;
  }
  if (kernel_format(type) != nullptr) return {};
  return kGgmlInt8DotPipelineNames[(type == GgmlType::Q8_0 ? 2 : 0) + (mat_vec ? 0 : 1)];
}

// The pipeline of a (validated) type and route: Q8_0 has the two mat-vecs and the simdgroup route.
std::string_view pipeline_name(GgmlType type, const Route& choice) {
  const std::optional<DenseQ4Route> route = choice.route;
  if (choice.int8_dot) return int8_dot_pipeline(type, !route.has_value());
  if (const ggml_formats::KernelFormat* f = kernel_format(type)) {
    // One mat-vec and one matrix route (the simdgroup route's geometry), as Q8_0.
    if (route && *route != DenseQ4Route::CompatibilitySimdgroup) {
      fail("has no " + std::string(to_string(*route)) + " route for " + std::string(f->name));
    }
    return route ? f->matrix : f->mat_vec;
  }
  if (type == GgmlType::Q8_0) {
    if (route && *route != DenseQ4Route::CompatibilitySimdgroup) {
      fail("has no " + std::string(to_string(*route)) + " route for q8_0");
    }
    if (route) return kQ8MatmulPipelineNames[1];
    return choice.q8_0_nr2 ? kQ8_0MatVecNr2Pipeline : kQ8MatmulPipelineNames[0];
  }
  return route ? dense_q4_pipeline_name(*route) : kQ4_0MatVecPipeline;
}

// Resolves the pipeline, then encodes one dispatch with geometry from its KernelDef. Nothing is
// encoded when the lookup fails.
GgmlQuantizedMatmulReceipt encode(CommandEncoder& encoder, KernelRegistry& registry,
                                  const Buffer& input, const Buffer& weight, const Buffer& output,
                                  const GgmlQuantizedMatmulParams& p, Route choice,
                                  const GgmlRoutingPolicy& policy) {
  if (registry.device().backend() != encoder.backend() || weight.backend() != encoder.backend()) {
    fail("encoder, registry and buffers must belong to one device (encoder/device mismatch)");
  }
  const CommandEncoder::Use use(encoder, "quantized_matmul_ggml");
  if (encoder.receipt_slots_left() < 1) {
    fail("open dispatch receipt has no room for the one dispatch this call encodes");
  }
  const std::string_view name = pipeline_name(p.ggml_type, choice);
  const PipelinePtr pipeline = registry.get_pipeline(name, kQ4PipelineConstants);
  const KernelDef& def = pipeline->def();
  if (def.tile_x == 0 || def.tile_y == 0 || def.threads_per_group == 0 ||
      def.threads_per_group > pipeline->max_total_threads_per_threadgroup()) {
    fail("pipeline '" + pipeline->label() + "' has an invalid launch shape");
  }

  const auto [qk, block_bytes] = ggml_block_layout(p.ggml_type);
  const uint64_t row_bytes = uint64_t{p.k} / qk * block_bytes;
  const Geometry geo = geometry(def, !choice.route.has_value(), p.m, p.n, p.k);
  std::vector<std::pair<uint32_t, KernelArg>> args;
  if (!choice.route) {
    kernels::GgmlMatmulMvParams gpu{};
    gpu.ne00 = p.k;
    gpu.ne01 = p.n;
    gpu.ne02 = 1;
    gpu.ne10 = p.k;
    gpu.ne12 = 1;
    gpu.ne0 = p.n;
    gpu.ne1 = p.m;
    gpu.r2 = 1;
    gpu.r3 = 1;
    args = {{0, KernelArg::of(weight)},
            {1, KernelArg::of(input)},
            {2, KernelArg::of(output)},
            {3, KernelArg::pod(gpu)}};
  } else {
    kernels::GgmlMatmulMmParams gpu{};
    gpu.ne00 = static_cast<int32_t>(p.k);
    gpu.ne02 = 1;
    gpu.nb01 = row_bytes;
    gpu.nb02 = row_bytes * p.n;
    gpu.nb03 = 0;
    gpu.ne12 = 1;
    gpu.nb10 = 4;
    gpu.nb11 = uint64_t{p.k} * 4;
    gpu.nb12 = gpu.nb11 * p.m;
    gpu.nb13 = 0;
    gpu.ne0 = static_cast<int32_t>(p.n);
    gpu.ne1 = static_cast<int32_t>(p.m);
    gpu.r2 = 1;
    gpu.r3 = 1;
    args = {{0, KernelArg::pod(gpu)},
            {1, KernelArg::of(weight)},
            {2, KernelArg::of(input)},
            {3, KernelArg::of(output)}};
  }
  const Dim3 grid = geo.grid, threads = geo.threads;
  std::vector<std::pair<uint64_t, uint64_t>> shmem = geo.shmem;

  if (encoder.is_capturing()) {
    encoder.set_pending_buffer_ranges({logical_range(weight), logical_range(input)},
                                      {logical_range(output)});
  }
  EncodedKernelDispatch dispatch{pipeline->label(), DispatchKind::ThreadGroups, grid.array(),
                                 threads.array(), shmem};
  encoder.dispatch(*pipeline, args, grid, threads, DispatchKind::ThreadGroups, std::move(shmem));

  GgmlQuantizedMatmulReceipt receipt;
  receipt.ggml_type = p.ggml_type;
  receipt.route = choice.int8_dot ? std::nullopt : choice.route;
  receipt.decision = choice.decision;
  receipt.policy = policy;
  receipt.int8_dot = choice.int8_dot;
  receipt.pipeline_label = pipeline->label();
  receipt.dispatch_count = 1;
  receipt.dispatch = std::move(dispatch);
  return receipt;
}

}  // namespace

std::string_view to_string(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: return "q4_0";
    case GgmlType::Q5_0: return "q5_0";
    case GgmlType::Q5_1: return "q5_1";
    case GgmlType::Q8_0: return "q8_0";
    case GgmlType::Q2_K: return "q2_k";
    case GgmlType::Q3_K: return "q3_k";
    case GgmlType::Q4_K: return "q4_k";
    case GgmlType::Q5_K: return "q5_k";
    case GgmlType::Q6_K: return "q6_k";
    case GgmlType::IQ4_NL: return "iq4_nl";
    case GgmlType::IQ4_XS: return "iq4_xs";
    case GgmlType::Q4_1: return "q4_1";
    case GgmlType::MXFP4: return "mxfp4";
  }
  return "?";
}

std::pair<uint32_t, uint32_t> ggml_block_layout(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0: return {32, 18};
    case GgmlType::Q5_0: return {32, 22};
    case GgmlType::Q5_1: return {32, 24};
    case GgmlType::Q8_0: return {32, 34};
    case GgmlType::IQ4_NL: return {32, 18};
    case GgmlType::Q2_K: return {256, 84};
    case GgmlType::Q3_K: return {256, 110};
    case GgmlType::Q4_K: return {256, 144};
    case GgmlType::Q5_K: return {256, 176};
    case GgmlType::Q6_K: return {256, 210};
    case GgmlType::IQ4_XS: return {256, 136};
    case GgmlType::Q4_1: return {32, 20};
    case GgmlType::MXFP4: return {32, 17};
  }
  return {0, 0};
}

std::string_view to_string(GgmlTensorMmPreference value) {
  return value == GgmlTensorMmPreference::AutoProbe ? "auto_probe" : "force_simd";
}

GgmlRoutingPolicy ggml_routing_policy_from_environment() {
  GgmlRoutingPolicy policy;
  if (env_is("ROUTEMM_DISABLE_TENSOR_MM", {"1"})) {
    policy.dense_tensor_mm = GgmlTensorMmPreference::ForceSimd;
  }
  if (env_is("ROUTEMM_LARGE_TILE_MM", {"0", "false", "off"})) {
    policy.allow_dense_large_tile_mm = false;
  }
  if (env_is("ROUTEMM_Q8_0_MV_NR2", {"0", "false", "off"})) policy.dense_q8_0_mv_nr2 = false;
  if (env_is("ROUTEMM_DENSE_INT8_DOT", {"1", "true", "on"})) policy.dense_int8_dot = true;
  return policy;
}

std::string_view to_string(DenseQ4Route route) {
  switch (route) {
    case DenseQ4Route::CompatibilitySimdgroup: return "compatibility_simdgroup";
    case DenseQ4Route::CompatibilityTensorV1: return "compatibility_tensor_v1";
    case DenseQ4Route::CompatibilityV2: return "compatibility_v2";
    case DenseQ4Route::Tensor64x32: return "tensor_64x32";
  }
  return "?";
}

std::string_view dense_q4_pipeline_name(DenseQ4Route route) {
  return kQ4MatmulPipelineNames[1 + static_cast<size_t>(route)];
}

std::string_view to_string(DenseQ4DecisionSource value) {
  switch (value) {
    case DenseQ4DecisionSource::MatVecThreshold: return "mat_vec_threshold";
    case DenseQ4DecisionSource::FrozenPlan: return "frozen_plan";
    case DenseQ4DecisionSource::NoPlanCompatibilityFallback:
      return "no_plan_compatibility_fallback";
    case DenseQ4DecisionSource::UndeclaredCompatibilityFallback:
      return "undeclared_compatibility_fallback";
    case DenseQ4DecisionSource::IneligibleCompatibilityFallback:
      return "ineligible_compatibility_fallback";
    case DenseQ4DecisionSource::ForcedTest: return "forced_test";
    case DenseQ4DecisionSource::PolicyInt8Dot: return "policy_int8_dot";
  }
  return "?";
}

DenseQ4RouteSelection select_dense_q4_route(const GgmlQuantizedMatmulParams& p,
                                            const GgmlRoutingPolicy& policy) {
  using enum DenseQ4DecisionSource;
  const bool exact_shape = p.ggml_type == GgmlType::Q4_0 && p.m > kGgmlMmRoutingThreshold &&
                           p.n > 0 && p.k >= 32 && p.k % 32 == 0;
  if (!exact_shape) return {DenseQ4Route::CompatibilityV2, IneligibleCompatibilityFallback};
  if (policy.dense_tensor_mm != GgmlTensorMmPreference::AutoProbe) {
    return {DenseQ4Route::CompatibilitySimdgroup, IneligibleCompatibilityFallback};
  }
  if (!policy.allow_dense_large_tile_mm) {
    return {DenseQ4Route::CompatibilityTensorV1, IneligibleCompatibilityFallback};
  }
  return {DenseQ4Route::CompatibilityV2, NoPlanCompatibilityFallback};
}

void freeze_dense_q4_plan_routes(KernelRegistry& registry, DenseQ4PlanRoutes plan,
                                 const std::vector<std::string>& protected_names,
                                 std::string plan_document) {
  if (plan.registry_authority_id != registry.authority_id()) {
    throw InvalidArgument(
        "dense Q4 route plan belongs to a different registry activation authority");
  }
  const Device& device = registry.device();
  if (plan.device_registry_id != device.registry_id() || plan.device_name != device.name()) {
    throw InvalidArgument("dense Q4 route plan belongs to a different device");
  }
  const std::string id = plan.plan_id;
  registry.freeze_plan(std::string(kDenseQ4PlanKind), id, protected_names, std::move(plan_document),
                       std::make_shared<const DenseQ4PlanRoutes>(std::move(plan)));
}

DenseQ4RouteSelection select_dense_q4_route(const KernelRegistry& registry, const Device& device,
                                            const GgmlQuantizedMatmulParams& p,
                                            const GgmlRoutingPolicy& policy) {
  using enum DenseQ4DecisionSource;
  const DenseQ4RouteSelection unplanned = select_dense_q4_route(p, policy);
  if (unplanned.decision != NoPlanCompatibilityFallback) return unplanned;
  const std::any table = registry.frozen_plan_table(std::string(kDenseQ4PlanKind));
  const auto* plan = std::any_cast<std::shared_ptr<const DenseQ4PlanRoutes>>(&table);
  if (plan == nullptr || *plan == nullptr) return unplanned;
  const DenseQ4PlanRoutes& frozen = **plan;
  if (frozen.registry_authority_id != registry.authority_id() ||
      frozen.device_registry_id != device.registry_id() || frozen.device_name != device.name()) {
    return {DenseQ4Route::CompatibilityV2, IneligibleCompatibilityFallback};
  }
  const auto it = frozen.routes.find(DenseQ4Shape{p.m, p.n, p.k});
  if (it == frozen.routes.end()) {
    return {DenseQ4Route::CompatibilityV2, UndeclaredCompatibilityFallback};
  }
  return {it->second, FrozenPlan};
}

EncodedKernelDispatch q4_expected_dispatch(DenseQ4Route route, uint32_t m, uint32_t n) {
  uint64_t token_tile = 32, shmem = 4096;
  switch (route) {
    case DenseQ4Route::CompatibilitySimdgroup:
    case DenseQ4Route::CompatibilityTensorV1: shmem = 8192; break;
    case DenseQ4Route::CompatibilityV2: token_tile = 128; break;
    case DenseQ4Route::Tensor64x32: break;
  }
  EncodedKernelDispatch d;
  d.pipeline_label = pipeline_label(dense_q4_pipeline_name(route), kQ4PipelineConstants);
  d.dispatch_kind = DispatchKind::ThreadGroups;
  d.grid = {ceil_div(m, token_tile), ceil_div(n, kMmOutputTile), 1};
  d.threads_per_threadgroup = {128, 1, 1};
  d.threadgroup_memory = {{0, shmem}};
  return d;
}

EncodedKernelDispatch q4_expected_dispatch(const KernelRegistry& registry, DenseQ4Route route,
                                           uint32_t m, uint32_t n, uint32_t k) {
  const std::string_view name = dense_q4_pipeline_name(route);
  const std::optional<KernelDef> def = registry.kernel_def(name);
  if (!def) {
    throw KernelNotFound("q4_expected_dispatch: no pipeline '" + std::string(name) + "' on " +
                         std::string(registry.device().backend()->name()));
  }
  const Geometry geo = geometry(*def, false, m, n, k);
  return EncodedKernelDispatch{pipeline_label(name, kQ4PipelineConstants),
                               DispatchKind::ThreadGroups, geo.grid.array(), geo.threads.array(),
                               geo.shmem};
}

void validate_quantized_matmul_ggml_call(const Buffer& input, const Buffer& weight,
                                         const Buffer& output, const GgmlQuantizedMatmulParams& p) {
  if (!input.valid() || !weight.valid() || !output.valid()) fail("got an empty buffer");
  if (input.dtype() != DType::F32 || weight.dtype() != DType::U8 || output.dtype() != DType::F32) {
    fail("requires F32 input, native U8 GGUF blocks, and F32 output; got input " +
         std::string(dtype_name(input.dtype())) + ", weight " +
         std::string(dtype_name(weight.dtype())) + ", output " +
         std::string(dtype_name(output.dtype())));
  }
  if (p.m > kSignedAbiMax || p.n > kSignedAbiMax || p.k > kSignedAbiMax) {
    fail("M=" + std::to_string(p.m) + ", N=" + std::to_string(p.n) + ", K=" + std::to_string(p.k) +
         " exceeds the signed kernel ABI (i32::MAX)");
  }
  if (p.ggml_type != GgmlType::Q4_0 && p.ggml_type != GgmlType::Q8_0 &&
      kernel_format(p.ggml_type) == nullptr) {
    std::string supported = "q4_0, q8_0";
    for (const ggml_formats::KernelFormat& f : ggml_formats::kKernelFormats) {
      supported += ", " + std::string(f.name);
    }
    fail("does not support " + std::string(to_string(p.ggml_type)) + " (supported: " + supported +
         ")");
  }
  if (p.m == 0 || p.n == 0 || p.k == 0) {
    fail("M, K, and N must all be > 0 (got M=" + std::to_string(p.m) +
         ", K=" + std::to_string(p.k) + ", N=" + std::to_string(p.n) + ")");
  }
  const uint32_t qk = ggml_block_layout(p.ggml_type).first;
  if (p.k % qk != 0) {
    fail("K (" + std::to_string(p.k) + ") must be divisible by block QK (" + std::to_string(qk) +
         ")");
  }
  const Extents need = call_extents(p);
  const auto check_size = [](const char* what, const Buffer& buffer, uint64_t required) {
    if (buffer.nbytes() < required) {
      fail(std::string(what) + " buffer too small: need " + std::to_string(required) +
           " bytes, got " + std::to_string(buffer.nbytes()));
    }
  };
  check_size("Weight", weight, need.weight);
  check_size("Input", input, need.input);
  check_size("Output", output, need.output);

  for (const auto& [label, buffer] : {std::pair{"input", &input}, std::pair{"output", &output}}) {
    if (const std::string why = misalignment(*buffer, 4); !why.empty()) {
      fail(std::string(label) + " " + why + " is not aligned to 4 bytes");
    }
  }
  if (!output.writable()) fail("output is read-only");
  if (input.backend() != weight.backend() || output.backend() != weight.backend()) {
    fail("buffers must all live on one device");
  }
  const ByteRange out = prefix_range(output, need.output);
  if (overlaps(out, prefix_range(input, need.input))) fail("output must not overlap input");
  if (overlaps(out, prefix_range(weight, need.weight))) fail("output must not overlap weight");
}

GgmlQuantizedMatmulReceipt quantized_matmul_ggml(CommandEncoder& encoder, KernelRegistry& registry,
                                                 const Buffer& input, const Buffer& weight,
                                                 const Buffer& output,
                                                 const GgmlQuantizedMatmulParams& params,
                                                 const GgmlRoutingPolicy& policy) {
  return dense_q4_auto(encoder, registry, registry.device(), input, weight, output, params, policy);
}

GgmlQuantizedMatmulReceipt dense_q4_auto(CommandEncoder& encoder, KernelRegistry& registry,
                                         const Device& device, const Buffer& input,
                                         const Buffer& weight, const Buffer& output,
                                         const GgmlQuantizedMatmulParams& params,
                                         const GgmlRoutingPolicy& policy) {
  using enum DenseQ4DecisionSource;
  validate_quantized_matmul_ggml_call(input, weight, output, params);
  Route choice{std::nullopt, MatVecThreshold};
  const bool mat_vec = params.m <= kGgmlMmRoutingThreshold;
  const std::string_view int8_dot = int8_dot_pipeline(params.ggml_type, mat_vec);
  if (policy.dense_int8_dot && !int8_dot.empty() && registry.has_kernel(int8_dot)) {
    // The reduced-precision opt-in, where the backend has it (the CPU); no plan is consulted.
    if (!mat_vec) choice = {DenseQ4Route::CompatibilitySimdgroup, PolicyInt8Dot};
    choice.int8_dot = true;
  } else if (mat_vec && params.ggml_type == GgmlType::Q8_0) {
    // Spec §5.5: the nr2 mat-vec by default; a backend without it keeps the other mat-vec.
    choice.q8_0_nr2 = policy.dense_q8_0_mv_nr2 && registry.has_kernel(kQ8_0MatVecNr2Pipeline);
  } else if (params.m > kGgmlMmRoutingThreshold && params.ggml_type != GgmlType::Q4_0) {
    // Q8_0 and the other formats have one matrix route and no calibration: the
    // simdgroup-compatible one.
    choice = {DenseQ4Route::CompatibilitySimdgroup, IneligibleCompatibilityFallback};
  } else if (params.m > kGgmlMmRoutingThreshold) {
    DenseQ4RouteSelection selected = select_dense_q4_route(registry, device, params, policy);
    // Spec §5.6: a plan's candidate whose pipeline does not resolve at dispatch falls back to V2.
    if (selected.route == DenseQ4Route::Tensor64x32) {
      try {
        registry.get_pipeline(dense_q4_pipeline_name(selected.route), kQ4PipelineConstants);
      } catch (const Error&) {
        selected = {DenseQ4Route::CompatibilityV2, IneligibleCompatibilityFallback};
      }
    }
    // Spec §5.6 step 1: the tensor routes need the tensor API; a backend without the V1 tensor
    // pipeline takes the simdgroup route.
    if (selected.route != DenseQ4Route::CompatibilitySimdgroup &&
        !registry.has_kernel(dense_q4_pipeline_name(DenseQ4Route::CompatibilityTensorV1))) {
      selected = {DenseQ4Route::CompatibilitySimdgroup, IneligibleCompatibilityFallback};
    }
    choice = {selected.route, selected.decision};
  }
  return encode(encoder, registry, input, weight, output, params, choice, policy);
}

GgmlQuantizedMatmulReceipt encode_q4_route(CommandEncoder& encoder, KernelRegistry& registry,
                                           const Buffer& input, const Buffer& weight,
                                           const Buffer& output,
                                           const GgmlQuantizedMatmulParams& params,
                                           DenseQ4Route route) {
  if (params.ggml_type != GgmlType::Q4_0 || params.m <= kGgmlMmRoutingThreshold) {
    throw InvalidArgument("forced dense Q4 MM route requires Q4_0 and M > 8 (got " +
                          std::string(to_string(params.ggml_type)) +
                          ", M=" + std::to_string(params.m) + ")");
  }
  validate_quantized_matmul_ggml_call(input, weight, output, params);
  return encode(encoder, registry, input, weight, output, params,
                {route, DenseQ4DecisionSource::ForcedTest}, GgmlRoutingPolicy{});
}

}  // namespace routemm
