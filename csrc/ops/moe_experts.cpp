// The experts block as one op (routemm/ops/moe_experts.h): the plan of its steps over one
// workspace, every check before the encoder is touched, then the steps in order.
#include "routemm/ops/moe_experts.h"

#include <cmath>
#include <string>
#include <vector>

#include "routemm/checked.h"
#include "routemm/error.h"
#include "routemm/ops/moe.h"

namespace routemm {
namespace {

[[noreturn]] void fail(const std::string& message) {
  throw InvalidArgument("moe_experts " + message);
}

uint64_t align16(uint64_t bytes) {
  return checked_mul((bytes + 15) / 16, 16, "moe_experts workspace");
}

bool block_stacks(const MoeExpertsParams& p) { return p.ggml_type.has_value(); }

// One expert-ID matmul of the block: its stack's output width n, input width k and block type
// (block stacks).
struct Step {
  uint32_t n, k;
  DenseMatmulIdInputLayout layout;
  std::optional<GgmlType> type;
};

// The expert stride of the step's stack of [n, k] matrices.
uint64_t expert_stride(const MoeExpertsParams& p, const Step& s) {
  const uint64_t n = s.n, k = s.k;
  if (!s.type) return checked_product({n, k, dtype_size(p.weight_dtype)}, "moe_experts stride");
  const auto [values, block_bytes] = ggml_block_layout(*s.type);
  if (k % values != 0) {
    fail("block stacks need widths that are multiples of " + std::to_string(values) + " (" +
         std::string(to_string(*s.type)) + "), got " + std::to_string(k));
  }
  return checked_product({n, k / values, block_bytes}, "moe_experts stride");
}

DenseMatmulIdParams dense_params(const MoeExpertsParams& p, const Step& s) {
  DenseMatmulIdParams d;
  d.m = p.m;
  d.n = s.n;
  d.k = s.k;
  d.top_k = p.top_k;
  d.n_experts = p.n_experts;
  d.expert_stride_bytes = expert_stride(p, s);
  d.input_layout = s.layout;
  d.id_multiplicity = is_grouped(p.route) ? DenseMatmulIdMultiplicity::DistinctPerToken
                                          : DenseMatmulIdMultiplicity::MayRepeat;
  d.route = p.route;
  return d;
}

GgmlQuantizedMatmulIdParams block_params(const MoeExpertsParams& p, const Step& s) {
  GgmlQuantizedMatmulIdParams q;
  q.m = p.m;
  q.n = s.n;
  q.k = s.k;
  q.top_k = p.top_k;
  q.n_experts = p.n_experts;
  q.ggml_type = *s.type;
  q.expert_stride_bytes = expert_stride(p, s);
  q.input_layout = s.layout;
  q.route = p.block_route;
  return q;
}

// The block's matmuls in encoding order: gate_up (or gate, up), then down.
std::vector<Step> steps(const MoeExpertsParams& p) {
  const auto shared = DenseMatmulIdInputLayout::SharedPerToken;
  const std::optional<GgmlType> gate = p.ggml_type;
  const std::optional<GgmlType> up = p.up_ggml_type ? p.up_ggml_type : gate;
  const std::optional<GgmlType> down = p.down_ggml_type ? p.down_ggml_type : gate;
  std::vector<Step> out;
  if (p.split_gate_up) {
    out.push_back({p.intermediate, p.hidden, shared, gate});
    out.push_back({p.intermediate, p.hidden, shared, up});
  } else {
    if (p.intermediate > 0x7FFFFFFFu) fail("2 * intermediate must fit a u32");
    out.push_back({2 * p.intermediate, p.hidden, shared, gate});
  }
  out.push_back({p.hidden, p.intermediate, DenseMatmulIdInputLayout::Slotted, down});
  return out;
}

// Q4_0 and Q8_0 have the lowp tensor route; the other formats direct and grouped only.
bool lowp_types(const MoeExpertsParams& p) {
  for (const std::optional<GgmlType>& t : {p.ggml_type, p.up_ggml_type, p.down_ggml_type}) {
    if (t && *t != GgmlType::Q4_0 && *t != GgmlType::Q8_0) return false;
  }
  return true;
}

// Every buffer of the block, carved from the caller's.
struct Views {
  Buffer ids_u32;
  Buffer gate_up_rows;  // F32 [rows, 2I]
  Buffer gate, up;      // strided views of gate_up_rows (the silu_mul inputs)
  Buffer act, down_rows;
  std::optional<DenseMatmulIdScratch> scratch;
  uint64_t gate_up_stride = 0;  // elements from one gate (or up) row to the next
};

Views carve(const MoeExpertsParams& p, const MoeExpertsWorkspaceLayout& w, const Buffer& ids,
            const Buffer& workspace) {
  if (!workspace.valid()) fail("workspace is an empty buffer");
  if (!workspace.writable()) fail("workspace is read-only");
  if (workspace.nbytes() < w.total_bytes) {
    fail("workspace requires " + std::to_string(w.total_bytes) + " bytes, got " +
         std::to_string(workspace.nbytes()));
  }
  if ((workspace.address() + workspace.byte_offset()) % 16 != 0) {
    fail("workspace must start at a 16-byte aligned address");
  }
  if (!ids.valid()) fail("ids is an empty buffer");
  if (ids.dtype() != DType::U32 && ids.dtype() != DType::I32) {
    fail("ids must be u32 or i32, got " + std::string(dtype_name(ids.dtype())));
  }
  const uint64_t rows = uint64_t{p.m} * p.top_k, inter = p.intermediate;
  const uint64_t ids_bytes = rows * 4;
  if (ids.nbytes() < ids_bytes) {
    fail("ids requires " + std::to_string(ids_bytes) + " logical bytes, got " +
         std::to_string(ids.nbytes()));
  }
  Views v;
  v.ids_u32 = ids.view(0, ids_bytes, DType::U32, {p.m, p.top_k});
  v.gate_up_rows = workspace.view(w.gate_up_offset, w.gate_up_bytes, DType::F32, {rows, 2 * inter});
  if (p.split_gate_up) {
    // Gate rows [rows, I], then up rows [rows, I].
    const uint64_t half = w.gate_up_bytes / 2;
    v.gate = v.gate_up_rows.view(0, half, DType::F32, {rows, inter});
    v.up = v.gate_up_rows.view(half, half, DType::F32, {rows, inter});
    v.gate_up_stride = inter;
  } else {
    // Gate row r is gate_up[r, :I], up row r is gate_up[r, I:]: two strided views of one buffer,
    // each ending where its last row ends.
    const uint64_t span = (rows - 1) * 2 * inter + inter;
    v.gate = v.gate_up_rows.view(0, span * 4, DType::F32, {span});
    v.up = v.gate_up_rows.view(inter * 4, span * 4, DType::F32, {span});
    v.gate_up_stride = 2 * inter;
  }
  v.act = workspace.view(w.act_offset, w.act_bytes, DType::F32, {rows, inter});
  v.down_rows = workspace.view(w.down_offset, w.down_bytes, DType::F32, {rows, p.hidden});
  if (moe_experts_grouped(p)) {
    v.scratch.emplace(workspace.view(w.counts_offset, w.counts_bytes, DType::U32, {p.n_experts}),
                      workspace.view(w.rows_offset, w.rows_bytes, DType::U32, {p.n_experts, p.m}),
                      p.n_experts, p.m);
  }
  return v;
}

void check_f32(const char* label, const Buffer& b, uint64_t required) {
  if (!b.valid()) fail(std::string(label) + " is an empty buffer");
  if (b.dtype() != DType::F32) {
    fail(std::string(label) + " must be f32, got " + std::string(dtype_name(b.dtype())));
  }
  if (b.nbytes() < required) {
    fail(std::string(label) + " requires " + std::to_string(required) + " logical bytes, got " +
         std::to_string(b.nbytes()));
  }
}

bool overlaps(const Buffer& a, const Buffer& b) {
  const auto [a0, a1] = a.logical_range();
  const auto [b0, b1] = b.logical_range();
  return a0 < b1 && b0 < a1;
}

}  // namespace

void moe_experts_auto_route(const KernelRegistry& registry, MoeExpertsParams& p,
                            MoeRouteMode mode) {
  const bool bf16_dot = registry.has_kernel(kDenseMatmulIdBf16DotPipelineNames[0]) &&
                        registry.has_kernel(kDenseMatmulIdBf16DotPipelineNames[1]);
  moe_experts_auto_route(registry.device().backend_name(), p, mode,
                         expert_tensor_mm_from_environment(), bf16_dot);
}

void moe_experts_auto_route(std::string_view backend, MoeExpertsParams& p, MoeRouteMode mode,
                            bool tensor_mm, bool bf16_dot) {
  const bool exact = mode == MoeRouteMode::Exact;
  const bool every_m = mode == MoeRouteMode::BatchInvariant;  // no crossover: one route at every m
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  const bool quantized = block_stacks(p);
  if (!exact && tensor_mm && backend == "cuda" && p.top_k <= p.n_experts) {
    if (quantized && lowp_types(p) &&
        (every_m || rows >= kMoeQuantizedLowpRowsPerExpert * p.n_experts)) {
      p.block_route = GgmlQuantizedMatmulIdRoute::GroupedTensorLowp;
      return;
    }
    if (!quantized && p.weight_dtype != DType::F32 &&
        (every_m || rows >= kMoeLowpRowsPerExpert * p.n_experts)) {
      p.route = DenseMatmulIdRoute::GroupedTensorLowp;
      return;
    }
  }
  const bool grouped = p.top_k <= p.n_experts &&
                       expert_id_auto_grouped(backend, p.m, p.top_k, p.n_experts, quantized);
  p.route = grouped ? DenseMatmulIdRoute::GroupedPrefill : DenseMatmulIdRoute::Direct;
  if (!exact && bf16_dot && backend == "cpu" && !quantized && p.weight_dtype == DType::BF16) {
    p.route = grouped ? DenseMatmulIdRoute::GroupedBf16Dot : DenseMatmulIdRoute::DirectBf16Dot;
  }
  p.block_route =
      grouped ? GgmlQuantizedMatmulIdRoute::Grouped : GgmlQuantizedMatmulIdRoute::Direct;
}

bool moe_experts_grouped(const MoeExpertsParams& p) {
  return block_stacks(p) ? is_grouped(p.block_route) : is_grouped(p.route);
}

MoeExpertsWorkspaceLayout moe_experts_workspace(const MoeExpertsParams& p) {
  if (p.m == 0 || p.top_k == 0 || p.n_experts == 0 || p.hidden == 0 || p.intermediate == 0) {
    fail("extents must be nonzero, got m=" + std::to_string(p.m) +
         ", top_k=" + std::to_string(p.top_k) + ", n_experts=" + std::to_string(p.n_experts) +
         ", H=" + std::to_string(p.hidden) + ", I=" + std::to_string(p.intermediate));
  }
  if (!block_stacks(p) && (p.up_ggml_type || p.down_ggml_type)) {
    fail("up_ggml_type and down_ggml_type need block stacks (a ggml_type)");
  }
  if (!p.split_gate_up && p.up_ggml_type && *p.up_ggml_type != *p.ggml_type) {
    fail("one gate_up stack has one block type: up_ggml_type " +
         std::string(to_string(*p.up_ggml_type)) + " differs from ggml_type " +
         std::string(to_string(*p.ggml_type)));
  }
  if (block_stacks(p)) {
    if (p.weight_dtype != DType::U8) fail("block stacks must be u8");
  } else if (p.weight_dtype != DType::F32 && p.weight_dtype != DType::F16 &&
             p.weight_dtype != DType::BF16) {
    fail("float stacks must be f32, f16 or bf16, got " + std::string(dtype_name(p.weight_dtype)));
  }
  if (p.activation == MoeActivation::SwigluOai) {
    if (!std::isfinite(p.swiglu_alpha)) {
      fail("swiglu_alpha must be finite, got " + std::to_string(p.swiglu_alpha));
    }
    if (!(p.swiglu_limit > 0.0f)) {
      fail("swiglu_limit must be > 0, got " + std::to_string(p.swiglu_limit));
    }
  } else if (p.activation != MoeActivation::Silu) {
    fail("activation must be silu or swiglu_oai");
  }
  if (moe_experts_grouped(p) && p.top_k > p.n_experts) {
    fail("a grouped route needs top_k <= n_experts (got top_k " + std::to_string(p.top_k) +
         ", n_experts " + std::to_string(p.n_experts) + ")");
  }
  // Each matmul's own capability (dims, type, route, extents), with its messages.
  for (const Step& s : steps(p)) {
    if (block_stacks(p)) {
      quantized_matmul_id_ggml_capability(block_params(p, s));
    } else {
      dense_matmul_id_capability(p.weight_dtype, dense_params(p, s));
    }
  }
  const uint64_t rows = checked_mul(p.m, p.top_k, "moe_experts rows");
  if (rows > 0xFFFFFFFFull) fail("m * top_k must fit a u32");
  MoeExpertsWorkspaceLayout w;
  uint64_t at = 0;
  auto place = [&](uint64_t& offset, uint64_t& bytes, uint64_t size) {
    offset = at;
    bytes = size;
    if (at + size < at) fail("workspace size overflow");
    at = align16(at + size);
  };
  place(w.gate_up_offset, w.gate_up_bytes,
        checked_product({rows, 2, p.intermediate, 4}, "moe_experts gate/up rows"));
  place(w.act_offset, w.act_bytes, checked_product({rows, p.intermediate, 4}, "moe_experts act"));
  place(w.down_offset, w.down_bytes, checked_product({rows, p.hidden, 4}, "moe_experts down rows"));
  if (moe_experts_grouped(p)) {
    place(w.counts_offset, w.counts_bytes, uint64_t{p.n_experts} * 4);
    place(w.rows_offset, w.rows_bytes, checked_product({p.n_experts, p.m, 4}, "moe_experts map"));
  }
  w.total_bytes = at;
  return w;
}

MoeExpertsReceipt moe_experts(CommandEncoder& encoder, KernelRegistry& registry,
                              const Buffer& hidden, const Buffer& ids, const Buffer& weights,
                              const Buffer& gate_up, const Buffer* up, const Buffer& down,
                              const Buffer& output, const Buffer& workspace,
                              const MoeExpertsParams& p, const MoeExpertsBiases& biases) {
  const MoeExpertsWorkspaceLayout layout = moe_experts_workspace(p);
  if (p.split_gate_up != (up != nullptr)) {
    fail(p.split_gate_up ? "split gate/up stacks need the up stack"
                         : "one gate_up stack takes no separate up stack");
  }
  if (p.gate_up_bias != (biases.gate_up != nullptr) ||
      (p.gate_up_bias && p.split_gate_up) != (biases.up != nullptr)) {
    fail(p.gate_up_bias ? (p.split_gate_up ? "gate_up_bias needs the gate and the up bias"
                                           : "gate_up_bias takes one [E, 2I] bias")
                        : "gate/up biases given without gate_up_bias");
  }
  if (p.down_bias != (biases.down != nullptr)) {
    fail(p.down_bias ? "down_bias needs the bias buffer" : "a down bias given without down_bias");
  }
  const Views v = carve(p, layout, ids, workspace);
  const std::vector<Step> plan = steps(p);
  std::vector<std::pair<const Buffer*, std::pair<const Buffer*, const Buffer*>>>
      calls;  // w, in, out
  if (p.split_gate_up) {
    calls.push_back({&gate_up, {&hidden, &v.gate}});
    calls.push_back({up, {&hidden, &v.up}});
  } else {
    calls.push_back({&gate_up, {&hidden, &v.gate_up_rows}});
  }
  calls.push_back({&down, {&v.act, &v.down_rows}});
  const DenseMatmulIdScratch* scratch = v.scratch ? &*v.scratch : nullptr;

  // Every check first: each matmul's buffers, the small kernels' pipelines, the receipt room.
  uint32_t dispatches = 2;  // silu_mul and combine
  const bool grouped = moe_experts_grouped(p);
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto& [w, io] = calls[i];
    if (block_stacks(p)) {
      validate_quantized_matmul_id_ggml_call(*w, *io.first, v.ids_u32, *io.second, scratch,
                                             block_params(p, plan[i]));
    } else {
      validate_dense_matmul_id_call(*w, *io.first, v.ids_u32, *io.second, scratch,
                                    dense_params(p, plan[i]));
    }
    dispatches += (grouped && i == 0) ? 2 : 1;
  }
  check_f32("weights", weights, uint64_t{p.m} * p.top_k * 4);
  check_f32("output", output, checked_product({p.m, p.hidden, 4}, "moe_experts output"));
  if (!output.writable()) fail("output is read-only");
  const uint64_t gate_up_bias_bytes = checked_product(
      {p.n_experts, p.split_gate_up ? 1u : 2u, p.intermediate, 4}, "moe_experts gate_up_bias");
  std::vector<std::pair<const char*, const Buffer*>> inputs = {
      {"hidden", &hidden}, {"weights", &weights}, {"ids", &ids}, {"workspace", &workspace}};
  if (p.gate_up_bias) {
    check_f32(p.split_gate_up ? "gate_bias" : "gate_up_bias", *biases.gate_up, gate_up_bias_bytes);
    inputs.emplace_back(p.split_gate_up ? "gate_bias" : "gate_up_bias", biases.gate_up);
    if (p.split_gate_up) {
      check_f32("up_bias", *biases.up, gate_up_bias_bytes);
      inputs.emplace_back("up_bias", biases.up);
    }
  }
  if (p.down_bias) {
    check_f32("down_bias", *biases.down,
              checked_product({p.n_experts, p.hidden, 4}, "moe_experts down_bias"));
    inputs.emplace_back("down_bias", biases.down);
  }
  for (const auto& [label, other] : inputs) {
    if (overlaps(output, *other)) fail(std::string("output must not overlap ") + label);
  }
  registry.get_pipeline(kMoeSiluMulPipeline);
  registry.get_pipeline(kMoeCombinePipeline);
  if (encoder.receipt_slots_left() < dispatches) {
    fail("open dispatch receipt has no room for the block's " + std::to_string(dispatches) +
         " dispatches");
  }

  // Then the steps, as one transaction: everything checkable was checked above, and anything that
  // still refuses (the encoder itself) takes the steps before it back out.
  CommandEncoder::Transaction transaction(encoder, "moe_experts");
  auto matmul = [&](size_t i) {
    const auto& [w, io] = calls[i];
    const auto map = (i == 0 || !grouped) ? DenseMatmulIdMapUse::Build : DenseMatmulIdMapUse::Reuse;
    if (block_stacks(p)) {
      quantized_matmul_id_ggml(encoder, registry, *io.first, *w, v.ids_u32, *io.second, scratch,
                               block_params(p, plan[i]), map,
                               p.q8_0_mv_nr2.value_or(expert_q8_0_mv_nr2_from_environment()));
    } else {
      dense_matmul_id(encoder, registry, *w, *io.first, v.ids_u32, *io.second, scratch,
                      dense_params(p, plan[i]), map);
    }
  };
  const size_t down_call = calls.size() - 1;
  for (size_t i = 0; i < down_call; ++i) matmul(i);
  encoder.memory_barrier();
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  // The gate/up biases as the activation reads them: a split pair, or the two halves of each
  // [2I] row of one bias (strided views, as the gate/up rows are).
  std::optional<Buffer> gate_bias, up_bias;
  uint32_t bias_stride = p.intermediate;
  if (p.gate_up_bias && p.split_gate_up) {
    gate_bias = *biases.gate_up;
    up_bias = *biases.up;
  } else if (p.gate_up_bias) {
    bias_stride = 2 * p.intermediate;
    const uint64_t span = (uint64_t{p.n_experts} - 1) * bias_stride + p.intermediate;
    gate_bias = biases.gate_up->view(0, span * 4, DType::F32, {span});
    up_bias = biases.gate_up->view(uint64_t{p.intermediate} * 4, span * 4, DType::F32, {span});
  }
  MoeSiluMulParams act{static_cast<uint32_t>(rows), p.intermediate, v.gate_up_stride,
                       v.gate_up_stride};
  act.activation = p.activation;
  act.alpha = p.swiglu_alpha;
  act.limit = p.swiglu_limit;
  act.n_experts = p.n_experts;
  act.bias_row_stride = bias_stride;
  MoeSiluMulInputs act_inputs;
  if (p.gate_up_bias) {
    act_inputs.ids = &v.ids_u32;
    act_inputs.gate_bias = &*gate_bias;
    act_inputs.up_bias = &*up_bias;
  }
  const Buffer weight_rows = weights.view(0, rows * 4, DType::F32, {rows});
  if (p.weights_before_ffn) act_inputs.scale_rows = &weight_rows;
  moe_silu_mul(encoder, registry, v.gate, v.up, v.act, act, act_inputs);
  encoder.memory_barrier();
  matmul(down_call);
  encoder.memory_barrier();
  MoeCombineParams combine{p.m, p.top_k, p.hidden, p.n_experts};
  combine.unit_weights = p.weights_before_ffn;
  moe_combine(encoder, registry, v.down_rows, weights, ids, output, combine,
              p.down_bias ? biases.down : nullptr);
  transaction.commit();
  return {grouped, dispatches};
}

}  // namespace routemm
