// Quantised expert-ID matmul front door: capability, call validation and encoding. Backends supply
// the kernels of the routes they run (plus dense_matmul_id's map); every contract lives here.
#include "routemm/ops/quantized_matmul_id.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <string>

#include "ops/expert_id_encoding.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"

namespace routemm {
namespace {

constexpr std::string_view kOp = "quantized_matmul_id_ggml";

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument(std::string(kOp) + " " + message);
}

uint64_t checked_product(std::string_view label, std::initializer_list<uint64_t> factors) {
  uint64_t value = 1;
  for (const uint64_t factor : factors) {
    if (value != 0 && factor > std::numeric_limits<uint64_t>::max() / value) {
      fail(std::string(label) + " byte extent overflow");
    }
    value *= factor;
  }
  return value;
}

void validate_buffer(std::string_view label, const Buffer& buffer, DType dtype, uint64_t required,
                     uint64_t alignment) {
  if (!buffer.valid()) fail(std::string(label) + " is an empty buffer");
  if (buffer.dtype() != dtype) {
    fail(std::string(label) + " must be " + std::string(dtype_name(dtype)) + ", got " +
         std::string(dtype_name(buffer.dtype())));
  }
  if (buffer.nbytes() < required) {
    fail(std::string(label) + " requires " + std::to_string(required) + " logical bytes, got " +
         std::to_string(buffer.nbytes()));
  }
  if (const std::string why = misalignment(buffer, alignment); !why.empty()) {
    fail(std::string(label) + " " + why + " is not aligned to " + std::to_string(alignment) +
         " bytes");
  }
}

ByteRange required_range(const Buffer& buffer, uint64_t required) {
  const uint64_t start = buffer.address() + buffer.byte_offset();
  if (start < buffer.address() || start + required < start) fail("logical buffer range overflow");
  return {start, start + required};
}

bool overlaps(ByteRange a, ByteRange b) { return a.start < b.end && b.start < a.end; }

// The kernel format of a type beyond Q4_0 / Q8_0 (ggml_formats.h), or nullptr.
const ggml_formats::KernelFormat* kernel_format(GgmlType type) {
  return ggml_formats::kernel_format(static_cast<uint8_t>(type));
}

// The tensor route's pipelines follow kKernelFormats after Q4_0 and Q8_0, named after each format.
constexpr bool tensor_names_follow_kernel_formats() {
  constexpr std::string_view prefix = "quantized_matmul_id_grouped_lowp_";
  const auto& names = kGgmlQuantizedMatmulIdTensorPipelineNames;
  if (names.size() != 2 + ggml_formats::kKernelFormats.size()) return false;
  for (size_t i = 0; i < ggml_formats::kKernelFormats.size(); ++i) {
    const std::string_view name = names[2 + i], format = ggml_formats::kKernelFormats[i].name;
    if (name.size() != prefix.size() + format.size() + 4 ||
        name.substr(0, prefix.size()) != prefix ||
        name.substr(prefix.size(), format.size()) != format ||
        name.substr(prefix.size() + format.size()) != "_f32") {
      return false;
    }
  }
  return true;
}
static_assert(tensor_names_follow_kernel_formats());

bool is_supported(GgmlType type) {
  return type == GgmlType::Q4_0 || type == GgmlType::Q8_0 || kernel_format(type) != nullptr;
}

std::string supported_types() {
  std::string names = "q4_0, q8_0";
  for (const ggml_formats::KernelFormat& f : ggml_formats::kKernelFormats) {
    names += ", " + std::string(f.name);
  }
  return names;
}

[[noreturn]] void fail_unsupported(GgmlType type) {
  fail("does not support " + std::string(to_string(type)) + " (supported: " + supported_types() +
       ")");
}

// Q4_0 / Q8_0 block scales are binary16 read in place: every block must start on an even byte.
// The other formats' kernels read their blocks bytewise (MXFP4 blocks are 17 bytes).
uint64_t block_alignment(GgmlType type) { return kernel_format(type) != nullptr ? 1 : 2; }

// The int8-dot routes exist for Q4_0, Q8_0 and the K-quants of kKQuantInt8DotFormats; the other
// formats of kKernelFormats have the exact routes and the tensor-core one.
void check_route_supports(GgmlType type, GgmlQuantizedMatmulIdRoute route) {
  const bool int8_dot = route == GgmlQuantizedMatmulIdRoute::DirectInt8Dot ||
                        route == GgmlQuantizedMatmulIdRoute::GroupedInt8Dot;
  if (int8_dot && kernel_format(type) != nullptr &&
      ggml_formats::kquant_int8_dot_format(static_cast<uint8_t>(type)) == nullptr) {
    fail("route " + std::string(to_string(route)) +
         " supports q4_0, q8_0, q4_k, q5_k and q6_k only, not " + std::string(to_string(type)) +
         " (its routes: direct, grouped, grouped_tensor_lowp)");
  }
}

}  // namespace

std::string_view to_string(GgmlQuantizedMatmulIdRoute value) {
  switch (value) {
    case GgmlQuantizedMatmulIdRoute::Direct: return "direct";
    case GgmlQuantizedMatmulIdRoute::Grouped: return "grouped";
    case GgmlQuantizedMatmulIdRoute::GroupedTensorLowp: return "grouped_tensor_lowp";
    case GgmlQuantizedMatmulIdRoute::DirectInt8Dot: return "direct_int8_dot";
    case GgmlQuantizedMatmulIdRoute::GroupedInt8Dot: return "grouped_int8_dot";
  }
  return "unknown";
}

GgmlQuantizedMatmulIdCapability quantized_matmul_id_ggml_capability(
    const GgmlQuantizedMatmulIdParams& p) {
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0) {
    fail("M, N, K, top_k, and n_experts must be nonzero");
  }
  if (!is_supported(p.ggml_type)) fail_unsupported(p.ggml_type);
  check_route_supports(p.ggml_type, p.route);
  const auto [qk, block_bytes] = ggml_block_layout(p.ggml_type);
  if (p.k % qk != 0) {
    fail("K (" + std::to_string(p.k) + ") must be divisible by block QK (" + std::to_string(qk) +
         ")");
  }
  const bool grouped = is_grouped(p.route);
  if (grouped && p.top_k > p.n_experts) {
    fail("distinct top_k " + std::to_string(p.top_k) + " exceeds n_experts " +
         std::to_string(p.n_experts));
  }
  if (grouped && p.n_experts > kDenseMatmulIdGroupedMaxExperts) {
    fail("grouped route supports at most " + std::to_string(kDenseMatmulIdGroupedMaxExperts) +
         " experts");
  }
  const uint64_t matrix_bytes = checked_product("expert matrix", {p.n, p.k / qk, block_bytes});
  if (p.expert_stride_bytes < matrix_bytes) {
    fail("expert stride " + std::to_string(p.expert_stride_bytes) + " is smaller than one " +
         std::to_string(matrix_bytes) + "-byte matrix");
  }
  if (p.expert_stride_bytes % block_alignment(p.ggml_type) != 0) {
    fail("expert stride " + std::to_string(p.expert_stride_bytes) +
         " is not aligned to the 2-byte block scale");
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

  GgmlQuantizedMatmulIdCapability cap;
  cap.ggml_type = p.ggml_type;
  cap.route = p.route;
  cap.required_weight_bytes = last_offset + matrix_bytes;
  cap.required_input_bytes = checked_product("input", {input_rows, p.k, 4});
  cap.required_ids_bytes = checked_product("expert IDs", {total_rows, 4});
  cap.required_output_bytes = checked_product("output", {total_rows, p.n, 4});
  if (grouped) {
    cap.scratch = DenseMatmulIdScratchRequirement{
        checked_product("scratch expert counts", {p.n_experts, 4}),
        checked_product("scratch routed rows", {p.n_experts, p.m, 4})};
  }
  return cap;
}

GgmlQuantizedMatmulIdCapability validate_quantized_matmul_id_ggml_call(
    const Buffer& weights, const Buffer& input, const Buffer& expert_ids, const Buffer& output,
    const DenseMatmulIdScratch* scratch, const GgmlQuantizedMatmulIdParams& params) {
  const GgmlQuantizedMatmulIdCapability cap = quantized_matmul_id_ggml_capability(params);
  validate_buffer("weights", weights, DType::U8, cap.required_weight_bytes,
                  block_alignment(params.ggml_type));
  validate_buffer("input", input, DType::F32, cap.required_input_bytes, 4);
  validate_buffer("expert IDs", expert_ids, DType::U32, cap.required_ids_bytes, 4);
  validate_buffer("output", output, DType::F32, cap.required_output_bytes, 4);
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

  const auto& backend = weights.backend();
  for (const Buffer* buffer : {&input, &expert_ids, &output}) {
    if (buffer->backend() != backend) fail("buffers must all live on one device");
  }
  if (cap.scratch) {
    if (scratch == nullptr) fail("grouped route requires caller-owned scratch");
    if (scratch->max_experts() < params.n_experts || scratch->max_tokens() < params.m) {
      fail("scratch capacity experts/tokens=" + std::to_string(scratch->max_experts()) + "/" +
           std::to_string(scratch->max_tokens()) + " is smaller than " +
           std::to_string(params.n_experts) + "/" + std::to_string(params.m));
    }
    validate_buffer("scratch expert counts", scratch->expert_counts(), DType::U32,
                    cap.scratch->expert_counts_bytes, 4);
    validate_buffer("scratch routed rows", scratch->routed_rows(), DType::U32,
                    cap.scratch->routed_rows_bytes, 4);
    if (scratch->expert_counts().backend() != backend) {
      fail("scratch must live on the device of the other buffers");
    }
    // The map writes the scratch and the output in one dispatch: they must not share bytes.
    for (const Buffer* buffer : {&scratch->expert_counts(), &scratch->routed_rows()}) {
      if (overlaps(out_range, required_range(*buffer, buffer->nbytes()))) {
        fail("output must not overlap the scratch");
      }
    }
  }
  return cap;
}

std::vector<std::string_view> quantized_matmul_id_ggml_route_pipelines(
    GgmlType type, GgmlQuantizedMatmulIdRoute route) {
  if (!is_supported(type)) fail_unsupported(type);
  if (const ggml_formats::KernelFormat* f = kernel_format(type)) {
    switch (route) {
      case GgmlQuantizedMatmulIdRoute::Direct: return {f->id_direct};
      case GgmlQuantizedMatmulIdRoute::Grouped: return {kDenseMatmulIdMapPipeline, f->id_grouped};
      case GgmlQuantizedMatmulIdRoute::GroupedTensorLowp:
        return {
            kDenseMatmulIdMapPipeline,
            kGgmlQuantizedMatmulIdTensorPipelineNames[2 +
                                                      (f - ggml_formats::kKernelFormats.data())]};
      case GgmlQuantizedMatmulIdRoute::DirectInt8Dot:
        check_route_supports(type, route);
        return {ggml_formats::kquant_int8_dot_format(f->ggml_type)->id_direct};
      case GgmlQuantizedMatmulIdRoute::GroupedInt8Dot:
        check_route_supports(type, route);
        return {kDenseMatmulIdMapPipeline,
                ggml_formats::kquant_int8_dot_format(f->ggml_type)->id_grouped};
    }
  }
  const size_t index = type == GgmlType::Q4_0 ? 0 : 1;
  switch (route) {
    case GgmlQuantizedMatmulIdRoute::Direct: return {kGgmlQuantizedMatmulIdPipelineNames[index]};
    case GgmlQuantizedMatmulIdRoute::Grouped:
      return {kDenseMatmulIdMapPipeline, kGgmlQuantizedMatmulIdPipelineNames[2 + index]};
    case GgmlQuantizedMatmulIdRoute::GroupedTensorLowp:
      return {kDenseMatmulIdMapPipeline, kGgmlQuantizedMatmulIdTensorPipelineNames[index]};
    case GgmlQuantizedMatmulIdRoute::DirectInt8Dot:
      return {kGgmlQuantizedMatmulIdInt8DotPipelineNames[index]};
    case GgmlQuantizedMatmulIdRoute::GroupedInt8Dot:
      return {kDenseMatmulIdMapPipeline, kGgmlQuantizedMatmulIdInt8DotPipelineNames[2 + index]};
  }
  fail("unknown route");
}

std::vector<std::string_view> quantized_matmul_id_ggml_call_pipelines(
    const KernelRegistry& registry, GgmlType type, GgmlQuantizedMatmulIdRoute route,
    bool q8_0_mv_nr2) {
  std::vector<std::string_view> names = quantized_matmul_id_ggml_route_pipelines(type, route);
  if (q8_0_mv_nr2 && type == GgmlType::Q8_0 && route == GgmlQuantizedMatmulIdRoute::Direct &&
      registry.has_kernel(kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline)) {
    names[0] = kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline;
  }
  return names;
}

bool expert_q8_0_mv_nr2_from_environment() {
  static const bool nr2 = [] {
    const char* raw = std::getenv("ROUTEMM_Q8_0_ID_MV_NR2");
    std::string value = raw != nullptr ? raw : "";
    const auto blank = [](unsigned char c) { return std::isspace(c) != 0; };
    value.erase(value.begin(), std::find_if_not(value.begin(), value.end(), blank));
    value.erase(std::find_if_not(value.rbegin(), value.rend(), blank).base(), value.end());
    std::transform(value.begin(), value.end(), value.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return value == "1" || value == "true" || value == "on";
  }();
  return nr2;
}

GgmlQuantizedMatmulIdDispatchReceipt quantized_matmul_id_ggml(
    CommandEncoder& encoder, KernelRegistry& registry, const Buffer& input, const Buffer& weights,
    const Buffer& expert_ids, const Buffer& output, const DenseMatmulIdScratch* scratch,
    const GgmlQuantizedMatmulIdParams& params, DenseMatmulIdMapUse map, bool q8_0_mv_nr2) {
  const GgmlQuantizedMatmulIdCapability cap =
      validate_quantized_matmul_id_ggml_call(weights, input, expert_ids, output, scratch, params);
  const bool grouped = is_grouped(cap.route);
  const kernels::DenseMatmulIdKernelParams gpu =
      expert_id::kernel_params(kOp, params.m, params.n, params.k, params.top_k, params.n_experts,
                               params.expert_stride_bytes, params.input_layout);
  expert_id::check_map_use(kOp, map, grouped, scratch, expert_ids, gpu);

  // Held across the route's dispatches: no other thread can enter the encoder between them.
  const CommandEncoder::Use use(encoder, "quantized_matmul_id_ggml");
  const uint32_t dispatches = expert_id::dispatch_count(grouped, map);
  expert_id::check_encoder(kOp, to_string(cap.route), encoder, registry, weights, dispatches);
  const std::vector<std::string_view> names = quantized_matmul_id_ggml_call_pipelines(
      registry, params.ggml_type, params.route, q8_0_mv_nr2);
  const expert_id::Buffers buffers{weights, input, expert_ids, output};
  if (grouped) {
    expert_id::encode_grouped(kOp, encoder, registry, names[1], gpu, buffers, *scratch, map);
  } else {
    expert_id::encode_direct(encoder, registry, names[0], gpu, buffers);
  }
  return {params.ggml_type, cap.route, dispatches, names.back()};
}

}  // namespace routemm
