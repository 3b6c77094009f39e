// Expert-ID matmul front door: capability, call validation, geometry and encoding.
// Backends supply the seven kernels; every contract lives here.
#include "routemm/ops/dense_matmul_id.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

#include "backend/common/dense_matmul_id_params.h"
#include "ops/expert_id_encoding.h"
#include "routemm/error.h"

namespace routemm {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("dense_matmul_id " + message);
}

uint64_t checked_mul(std::string_view label, uint64_t a, uint64_t b) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    fail(std::string(label) + " byte extent overflow");
  }
  return a * b;
}

uint64_t checked_product(std::string_view label, std::initializer_list<uint64_t> factors) {
  uint64_t value = 1;
  for (const uint64_t factor : factors) value = checked_mul(label, value, factor);
  return value;
}

uint64_t scalar_weight_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
    case DType::F16:
    case DType::BF16: return dtype_size(dtype);
    default: fail("weights must be F32, F16, or BF16, got " + std::string(dtype_name(dtype)));
  }
}

void validate_buffer(std::string_view label, const Buffer& buffer, DType dtype, uint64_t required) {
  if (!buffer.valid()) fail(std::string(label) + " is an empty buffer");
  if (buffer.dtype() != dtype) {
    fail(std::string(label) + " must be " + std::string(dtype_name(dtype)) + ", got " +
         std::string(dtype_name(buffer.dtype())));
  }
  if (buffer.nbytes() < required) {
    fail(std::string(label) + " requires " + std::to_string(required) + " logical bytes, got " +
         std::to_string(buffer.nbytes()));
  }
  if (const std::string why = misalignment(buffer, dtype_size(dtype)); !why.empty()) {
    fail(std::string(label) + " " + why + " is not aligned to " + std::string(dtype_name(dtype)));
  }
}

ByteRange required_range(const Buffer& buffer, uint64_t required) {
  const uint64_t start = buffer.address() + buffer.byte_offset();
  if (start < buffer.address() || start + required < start) fail("logical buffer range overflow");
  return {start, start + required};
}

ByteRange logical_range(const Buffer& buffer) {
  const auto [start, end] = buffer.logical_range();
  return {start, end};
}

bool overlaps(ByteRange a, ByteRange b) { return a.start < b.end && b.start < a.end; }

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string_view to_string(DenseMatmulIdInputLayout value) {
  return value == DenseMatmulIdInputLayout::SharedPerToken ? "shared_per_token" : "slotted";
}
std::string_view to_string(DenseMatmulIdMultiplicity value) {
  return value == DenseMatmulIdMultiplicity::DistinctPerToken ? "distinct_per_token" : "may_repeat";
}
std::string_view to_string(DenseMatmulIdRoute value) {
  switch (value) {
    case DenseMatmulIdRoute::Direct: return "direct";
    case DenseMatmulIdRoute::GroupedPrefill: return "grouped_prefill";
    case DenseMatmulIdRoute::GroupedTensorTf32: return "grouped_tensor_tf32";
    case DenseMatmulIdRoute::GroupedTensorLowp: return "grouped_tensor_lowp";
    case DenseMatmulIdRoute::DirectBf16Dot: return "direct_bf16_dot";
    case DenseMatmulIdRoute::GroupedBf16Dot: return "grouped_bf16_dot";
  }
  return "?";
}
bool expert_id_auto_grouped(std::string_view backend, uint64_t m, uint64_t top_k,
                            uint64_t n_experts, bool quantized, uint64_t mm_threshold) {
  if (m <= mm_threshold || top_k == 0 || top_k > n_experts) return false;
  if (backend != "cuda") return true;
  // m * top_k >= rows * n_experts, without forming the product (n_experts < 2^32, rows <= 256).
  const uint64_t rows = quantized ? kCudaQuantizedGroupedRowsPerExpert : kCudaGroupedRowsPerExpert;
  if (n_experts > UINT64_MAX / rows) return false;
  const uint64_t routed_needed = rows * n_experts;
  return m >= (routed_needed + top_k - 1) / top_k;
}
bool expert_id_auto_grouped(std::string_view backend, uint64_t m, uint64_t top_k,
                            uint64_t n_experts, bool quantized) {
  return expert_id_auto_grouped(backend, m, top_k, n_experts, quantized,
                                expert_mm_threshold_from_environment());
}
uint64_t expert_mm_threshold_from_environment() {
  static const uint64_t threshold = [] {
    constexpr const char* kName = "ROUTEMM_MM_ID_ROUTING_THRESHOLD";
    const char* raw = std::getenv(kName);
    std::string value = raw != nullptr ? raw : "";
    const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
    value.erase(value.begin(), std::find_if_not(value.begin(), value.end(), blank));
    value.erase(std::find_if_not(value.rbegin(), value.rend(), blank).base(), value.end());
    if (value.empty()) return kExpertMmThreshold;
    const std::string digits = value[0] == '+' ? value.substr(1) : value;
    const bool decimal = !digits.empty() && digits.size() <= 10 &&
                         std::all_of(digits.begin(), digits.end(),
                                     [](unsigned char c) { return c >= '0' && c <= '9'; });
    if (!decimal || std::stoull(digits) > UINT32_MAX) {
      throw InvalidArgument(std::string(kName) + " must be an integer in [0, 4294967295], got '" +
                            value + "'");
    }
    return static_cast<uint64_t>(std::stoull(digits));
  }();
  return threshold;
}
bool expert_tensor_mm_from_environment() {
  static const bool allowed = [] {
    const char* raw = std::getenv("ROUTEMM_DISABLE_TENSOR_MM_ID");
    std::string value = raw != nullptr ? raw : "";
    const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
    value.erase(value.begin(), std::find_if_not(value.begin(), value.end(), blank));
    value.erase(std::find_if_not(value.rbegin(), value.rend(), blank).base(), value.end());
    return value != "1";
  }();
  return allowed;
}
std::string_view to_string(DenseMatmulIdMapUse value) {
  return value == DenseMatmulIdMapUse::Build ? "build" : "reuse";
}

DenseMatmulIdScratch::DenseMatmulIdScratch(const Device& device, uint32_t max_experts,
                                           uint32_t max_tokens)
    : max_experts_(max_experts), max_tokens_(max_tokens) {
  if (max_experts == 0 || max_tokens == 0) fail("scratch capacities must be nonzero");
  const uint64_t counts_bytes = checked_product("scratch expert counts", {max_experts, 4});
  const uint64_t routed_bytes =
      checked_product("scratch routed rows", {max_experts, max_tokens, 4});
  expert_counts_ = device.alloc(counts_bytes, DType::U32, {max_experts});
  routed_rows_ = device.alloc(routed_bytes, DType::U32, {max_experts, max_tokens});
}

DenseMatmulIdScratch::DenseMatmulIdScratch(Buffer expert_counts, Buffer routed_rows,
                                           uint32_t max_experts, uint32_t max_tokens)
    : expert_counts_(std::move(expert_counts)),
      routed_rows_(std::move(routed_rows)),
      max_experts_(max_experts),
      max_tokens_(max_tokens) {
  if (max_experts == 0 || max_tokens == 0) fail("scratch capacities must be nonzero");
  const uint64_t counts_bytes = checked_product("scratch expert counts", {max_experts, 4});
  const uint64_t routed_bytes =
      checked_product("scratch routed rows", {max_experts, max_tokens, 4});
  for (const auto& [buffer, bytes, what] :
       {std::tuple{&expert_counts_, counts_bytes, "expert_counts"},
        std::tuple{&routed_rows_, routed_bytes, "routed_rows"}}) {
    if (!buffer->valid()) fail(std::string("scratch ") + what + " is an empty buffer");
    if (buffer->dtype() != DType::U32)
      fail(std::string("scratch ") + what + " must be u32, got " +
           std::string(dtype_name(buffer->dtype())));
    if (buffer->nbytes() < bytes) {
      fail(std::string("scratch ") + what + " holds " + std::to_string(buffer->nbytes()) +
           " bytes, capacity needs " + std::to_string(bytes));
    }
    if (!buffer->writable()) fail(std::string("scratch ") + what + " is read-only");
  }
  if (expert_counts_.backend() != routed_rows_.backend())
    fail("scratch expert_counts and routed_rows live on different backends");
  const auto [a0, a1] = expert_counts_.logical_range();
  const auto [b0, b1] = routed_rows_.logical_range();
  if (a0 < b1 && b0 < a1) fail("scratch expert_counts and routed_rows must not overlap");
}

std::optional<DenseMatmulIdScratch::MapKey> DenseMatmulIdScratch::map_key() const {
  const std::lock_guard<std::mutex> lock(map_record_->mutex);
  return map_record_->key;
}

void DenseMatmulIdScratch::record_map(const MapKey& key) const {
  const std::lock_guard<std::mutex> lock(map_record_->mutex);
  map_record_->key = key;
}

DenseMatmulIdCapability dense_matmul_id_capability(DType weight_dtype,
                                                   const DenseMatmulIdParams& p) {
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0) {
    fail("M, N, K, top_k, and n_experts must be nonzero");
  }
  if (p.id_multiplicity == DenseMatmulIdMultiplicity::DistinctPerToken && p.top_k > p.n_experts) {
    fail("distinct top_k " + std::to_string(p.top_k) + " exceeds n_experts " +
         std::to_string(p.n_experts));
  }
  const uint64_t scalar = scalar_weight_size(weight_dtype);
  if ((p.route == DenseMatmulIdRoute::DirectBf16Dot ||
       p.route == DenseMatmulIdRoute::GroupedBf16Dot) &&
      weight_dtype != DType::BF16) {
    fail(std::string(to_string(p.route)) + " requires BF16 weights, got " +
         std::string(dtype_name(weight_dtype)));
  }
  const uint64_t matrix_bytes = checked_product("expert matrix", {p.n, p.k, scalar});
  if (p.expert_stride_bytes < matrix_bytes) {
    fail("expert stride " + std::to_string(p.expert_stride_bytes) + " is smaller than one " +
         std::to_string(matrix_bytes) + "-byte matrix");
  }
  if (p.expert_stride_bytes % scalar != 0) {
    fail("expert stride " + std::to_string(p.expert_stride_bytes) + " is not aligned to " +
         std::string(dtype_name(weight_dtype)));
  }
  const uint64_t experts_before_last = p.n_experts - 1ull;
  if (experts_before_last != 0 &&
      p.expert_stride_bytes > std::numeric_limits<uint64_t>::max() / experts_before_last) {
    fail("expert weight offset overflow");
  }
  const uint64_t last_offset = experts_before_last * p.expert_stride_bytes;
  if (last_offset + matrix_bytes < last_offset) fail("weight extent overflow");

  const uint64_t total_rows = uint64_t{p.m} * p.top_k;
  if (total_rows > std::numeric_limits<uint32_t>::max()) {
    fail("flattened routed rows exceed the u32 kernel ABI");
  }
  const uint64_t input_rows =
      p.input_layout == DenseMatmulIdInputLayout::SharedPerToken ? uint64_t{p.m} : total_rows;

  DenseMatmulIdCapability cap;
  cap.schema_version = kDenseMatmulIdSchemaVersion;
  cap.weight_dtype = weight_dtype;
  cap.route = p.route;
  cap.required_weight_bytes = last_offset + matrix_bytes;
  cap.required_input_bytes = checked_product("input", {input_rows, p.k, 4});
  cap.required_ids_bytes = checked_product("expert IDs", {total_rows, 4});
  cap.required_output_bytes = checked_product("output", {total_rows, p.n, 4});

  if (is_grouped(p.route)) {
    if (p.id_multiplicity != DenseMatmulIdMultiplicity::DistinctPerToken) {
      fail("grouped prefill requires distinct expert IDs per token");
    }
    if (p.n_experts > kDenseMatmulIdGroupedMaxExperts) {
      fail("grouped prefill supports at most " + std::to_string(kDenseMatmulIdGroupedMaxExperts) +
           " experts");
    }
    if (p.route == DenseMatmulIdRoute::GroupedTensorLowp && weight_dtype == DType::F32) {
      fail("grouped_tensor_lowp requires F16 or BF16 weights, got f32");
    }
    cap.scratch = DenseMatmulIdScratchRequirement{
        checked_product("scratch expert counts", {p.n_experts, 4}),
        checked_product("scratch routed rows", {p.n_experts, p.m, 4})};
  }
  return cap;
}

DenseMatmulIdCapability validate_dense_matmul_id_call(const Buffer& weights, const Buffer& input,
                                                      const Buffer& expert_ids,
                                                      const Buffer& output,
                                                      const DenseMatmulIdScratch* scratch,
                                                      const DenseMatmulIdParams& params) {
  if (!weights.valid()) fail("weights is an empty buffer");
  const DenseMatmulIdCapability cap = dense_matmul_id_capability(weights.dtype(), params);
  validate_buffer("weights", weights, cap.weight_dtype, cap.required_weight_bytes);
  validate_buffer("input", input, DType::F32, cap.required_input_bytes);
  validate_buffer("expert IDs", expert_ids, DType::U32, cap.required_ids_bytes);
  validate_buffer("output", output, DType::F32, cap.required_output_bytes);
  if (!output.writable()) fail("output is read-only");

  const ByteRange out_range = required_range(output, cap.required_output_bytes);
  const std::pair<std::string_view, ByteRange> reads[] = {
      {"weights", required_range(weights, cap.required_weight_bytes)},
      {"input", required_range(input, cap.required_input_bytes)},
      {"expert IDs", required_range(expert_ids, cap.required_ids_bytes)},
  };
  for (const auto& [label, range] : reads) {
    if (overlaps(out_range, range)) fail("output must not overlap " + std::string(label));
  }

  if (is_grouped(cap.route)) {
    if (scratch == nullptr) fail("grouped prefill requires caller-owned scratch");
    if (scratch->max_experts() < params.n_experts || scratch->max_tokens() < params.m) {
      fail("scratch capacity experts/tokens=" + std::to_string(scratch->max_experts()) + "/" +
           std::to_string(scratch->max_tokens()) + " is smaller than " +
           std::to_string(params.n_experts) + "/" + std::to_string(params.m));
    }
    validate_buffer("scratch expert counts", scratch->expert_counts(), DType::U32,
                    cap.scratch->expert_counts_bytes);
    validate_buffer("scratch routed rows", scratch->routed_rows(), DType::U32,
                    cap.scratch->routed_rows_bytes);
  }

  // Every buffer must live where the kernels will run.
  const auto& backend = weights.backend();
  for (const Buffer* buffer : {&input, &expert_ids, &output}) {
    if (buffer->backend() != backend) fail("buffers must all live on one device");
  }
  if (scratch != nullptr && is_grouped(cap.route) &&
      scratch->expert_counts().backend() != backend) {
    fail("scratch must live on the device of the other buffers");
  }
  return cap;
}

namespace {

// The pipelines of a route in dispatch order (the second empty for one-dispatch routes), without
// allocating: this runs on every call.
std::array<std::string_view, 2> route_pipeline_names(DType weight_dtype, DenseMatmulIdRoute route) {
  // Index of the weight dtype in each per-dtype list: f32, f16, bf16.
  size_t index = 0;
  switch (weight_dtype) {
    case DType::F32: index = 0; break;
    case DType::F16: index = 1; break;
    case DType::BF16: index = 2; break;
    default: fail("has no scalar pipeline for " + std::string(dtype_name(weight_dtype)));
  }
  switch (route) {
    case DenseMatmulIdRoute::Direct: return {kDenseMatmulIdPipelineNames[index], {}};
    case DenseMatmulIdRoute::GroupedPrefill:
      return {kDenseMatmulIdMapPipeline, kDenseMatmulIdPipelineNames[4 + index]};
    case DenseMatmulIdRoute::GroupedTensorTf32:
      return {kDenseMatmulIdMapPipeline, kDenseMatmulIdTensorPipelineNames[index]};
    case DenseMatmulIdRoute::GroupedTensorLowp:
      if (index == 0) fail("grouped_tensor_lowp requires F16 or BF16 weights, got f32");
      return {kDenseMatmulIdMapPipeline, kDenseMatmulIdTensorPipelineNames[2 + index]};
    case DenseMatmulIdRoute::DirectBf16Dot:
    case DenseMatmulIdRoute::GroupedBf16Dot:
      if (weight_dtype != DType::BF16) {
        fail(std::string(to_string(route)) + " requires BF16 weights, got " +
             std::string(dtype_name(weight_dtype)));
      }
      if (route == DenseMatmulIdRoute::DirectBf16Dot) {
        return {kDenseMatmulIdBf16DotPipelineNames[0], {}};
      }
      return {kDenseMatmulIdMapPipeline, kDenseMatmulIdBf16DotPipelineNames[1]};
  }
  fail("unknown route");
}

}  // namespace

std::vector<std::string_view> dense_matmul_id_route_pipelines(DType weight_dtype,
                                                              DenseMatmulIdRoute route) {
  const auto names = route_pipeline_names(weight_dtype, route);
  if (names[1].empty()) return {names[0]};
  return {names[0], names[1]};
}

namespace {

struct Launch {
  Dim3 grid;
  Dim3 threads;
  std::vector<std::pair<uint64_t, uint64_t>> shmem;
};

Launch direct_launch(const KernelDef& def, const DenseMatmulIdParams& p) {
  return {Dim3{ceil_div(p.n, def.tile_x), uint64_t{p.m} * p.top_k, 1},
          Dim3{def.threads_per_group, 1, 1},
          {}};
}

// expert_id::map_launch's threads and threadgroup memory, in one threadgroup.
Launch map_launch(const KernelDef& def, const DenseMatmulIdParams& p) {
  expert_id::MapLaunch ml = expert_id::map_launch(def, p.n_experts);
  return {Dim3{1, 1, 1}, ml.threads, std::move(ml.shmem)};
}

Launch grouped_launch(const KernelDef& def, const DenseMatmulIdParams& p) {
  Launch l;
  const Dim3 tiles{ceil_div(p.m, def.tile_x), ceil_div(p.n, def.tile_y), p.n_experts};
  l.grid = def.persistent_groups == 0
               ? tiles
               : Dim3{std::min<uint64_t>(def.persistent_groups, tiles.x * tiles.y * tiles.z), 1, 1};
  l.threads = Dim3{def.threads_per_group, 1, 1};
  if (def.threadgroup_memory_bytes != 0) l.shmem.emplace_back(0, def.threadgroup_memory_bytes);
  return l;
}

}  // namespace

std::vector<EncodedKernelDispatch> dense_matmul_id_expected_dispatches(
    const KernelRegistry& registry, DType weight_dtype, const DenseMatmulIdParams& params) {
  const std::vector<std::string_view> names =
      dense_matmul_id_route_pipelines(weight_dtype, params.route);
  std::vector<EncodedKernelDispatch> out;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::optional<KernelDef> def = registry.kernel_def(names[i]);
    if (!def) {
      throw KernelNotFound("dense_matmul_id expected dispatch: no pipeline '" +
                           std::string(names[i]) + "' on " +
                           std::string(registry.device().backend()->name()));
    }
    const Launch l = names.size() == 1 ? direct_launch(*def, params)
                     : i == 0          ? map_launch(*def, params)
                                       : grouped_launch(*def, params);
    out.push_back(EncodedKernelDispatch{std::string(names[i]), DispatchKind::ThreadGroups,
                                        l.grid.array(), l.threads.array(), l.shmem});
  }
  return out;
}

DenseMatmulIdDispatchReceipt dense_matmul_id(CommandEncoder& encoder, KernelRegistry& registry,
                                             const Buffer& weights, const Buffer& input,
                                             const Buffer& expert_ids, const Buffer& output,
                                             const DenseMatmulIdScratch* scratch,
                                             const DenseMatmulIdParams& params,
                                             DenseMatmulIdMapUse map) {
  const DenseMatmulIdCapability cap =
      validate_dense_matmul_id_call(weights, input, expert_ids, output, scratch, params);
  constexpr std::string_view kOp = "dense_matmul_id";
  const bool grouped = is_grouped(cap.route);
  const kernels::DenseMatmulIdKernelParams gpu =
      expert_id::kernel_params(kOp, params.m, params.n, params.k, params.top_k, params.n_experts,
                               params.expert_stride_bytes, params.input_layout);
  expert_id::check_map_use(kOp, map, grouped, scratch, expert_ids, gpu);

  // Held across the route's dispatches: no other thread can enter the encoder between them.
  const CommandEncoder::Use use(encoder, "dense_matmul_id");
  const uint32_t dispatches = expert_id::dispatch_count(grouped, map);
  expert_id::check_encoder(kOp, to_string(cap.route), encoder, registry, weights, dispatches);
  const std::array<std::string_view, 2> names = route_pipeline_names(weights.dtype(), cap.route);
  if (grouped) {
    expert_id::encode_grouped(kOp, encoder, registry, names[1], gpu,
                              {weights, input, expert_ids, output}, *scratch, map);
    return {weights.dtype(), cap.route, dispatches};
  }

  const PipelinePtr pipeline = registry.get_pipeline(names[0]);
  if (encoder.is_capturing()) {
    encoder.set_pending_buffer_ranges(
        {logical_range(weights), logical_range(input), logical_range(expert_ids)},
        {logical_range(output)});
  }
  const std::pair<uint32_t, KernelArg> args[] = {{0, KernelArg::pod(gpu)},
                                                 {1, KernelArg::of(weights)},
                                                 {2, KernelArg::of(input)},
                                                 {3, KernelArg::of(expert_ids)},
                                                 {4, KernelArg::of(output)}};
  // No threadgroup memory in the dispatch: a direct kernel's own is static (receipts show none).
  const Launch l = direct_launch(pipeline->def(), params);
  encoder.dispatch(*pipeline, args, l.grid, l.threads);
  return {weights.dtype(), cap.route, 1};
}

}  // namespace routemm
