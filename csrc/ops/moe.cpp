// MoE layer front doors: validation, geometry and encoding of moe_gate, moe_silu_mul and
// moe_combine. Backends supply the three kernels (kMoePipelineNames); every contract lives here.
#include "routemm/ops/moe.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/common/moe_params.h"
#include "routemm/error.h"

namespace routemm {
namespace {

// Checks shared by the three front doors; every message starts with the op's name.
class Checks {
 public:
  explicit Checks(std::string_view op) : op_(op) {}

  [[noreturn]] void fail(const std::string& message) const {
    throw InvalidArgument(std::string(op_) + " " + message);
  }

  uint64_t product(std::string_view label, std::initializer_list<uint64_t> factors) const {
    uint64_t value = 1;
    for (const uint64_t factor : factors) {
      if (value != 0 && factor > std::numeric_limits<uint64_t>::max() / value) {
        fail(std::string(label) + " byte extent overflow");
      }
      value *= factor;
    }
    return value;
  }

  // A valid buffer of one of `dtypes` holding at least `required` logical bytes, aligned to its
  // element; returns the byte range the kernel touches.
  ByteRange buffer(std::string_view label, const Buffer& buffer,
                   std::initializer_list<DType> dtypes, uint64_t required) const {
    if (!buffer.valid()) fail(std::string(label) + " is an empty buffer");
    bool accepted = false;
    std::string names;
    for (const DType dtype : dtypes) {
      accepted = accepted || buffer.dtype() == dtype;
      names += (names.empty() ? "" : " or ") + std::string(dtype_name(dtype));
    }
    if (!accepted) {
      fail(std::string(label) + " must be " + names + ", got " +
           std::string(dtype_name(buffer.dtype())));
    }
    if (buffer.nbytes() < required) {
      fail(std::string(label) + " requires " + std::to_string(required) + " logical bytes, got " +
           std::to_string(buffer.nbytes()));
    }
    if (const std::string why = misalignment(buffer, dtype_size(buffer.dtype())); !why.empty()) {
      fail(std::string(label) + " " + why + " is not aligned to " +
           std::string(dtype_name(buffer.dtype())));
    }
    const uint64_t start = buffer.address() + buffer.byte_offset();
    if (start < buffer.address() || start + required < start) fail("logical buffer range overflow");
    return {start, start + required};
  }

  // The output is writable, overlaps no input, and every buffer lives on the encoder's device.
  void placement(CommandEncoder& encoder, KernelRegistry& registry,
                 std::initializer_list<std::pair<std::string_view, const Buffer*>> inputs,
                 const Buffer& output, ByteRange output_range,
                 std::initializer_list<ByteRange> input_ranges) const {
    if (!output.writable()) fail("output is read-only");
    auto range = input_ranges.begin();
    for (const auto& [label, buffer] : inputs) {
      const ByteRange in = *range++;
      if (output_range.start < in.end && in.start < output_range.end) {
        fail("output must not overlap " + std::string(label));
      }
      if (buffer->backend() != output.backend()) fail("buffers must all live on one device");
    }
    if (registry.device().backend() != encoder.backend() || output.backend() != encoder.backend()) {
      fail("encoder, registry and buffers must belong to one device (encoder/device mismatch)");
    }
    if (encoder.receipt_slots_left() < 1) fail("open dispatch receipt has no room for a dispatch");
  }

 private:
  std::string_view op_;
};

ByteRange logical_range(const Buffer& buffer) {
  const auto [start, end] = buffer.logical_range();
  return {start, end};
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Threads per group from the pipeline (at least one).
uint64_t group_threads(const Pipeline& pipeline) {
  return pipeline.def().threads_per_group == 0 ? 1 : pipeline.def().threads_per_group;
}

}  // namespace

MoeGateScoring parse_moe_gate_scoring(std::string_view op, std::string_view name) {
  if (name == "softmax") return MoeGateScoring::Softmax;
  if (name == "sigmoid") return MoeGateScoring::Sigmoid;
  throw InvalidArgument(std::string(op) + " scoring_func must be 'softmax' or 'sigmoid', got '" +
                        std::string(name) + "'");
}

float moe_gate_scaling_factor(std::string_view op, double value) {
  const auto f = static_cast<float>(value);
  if (!std::isfinite(f)) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", value);
    throw InvalidArgument(std::string(op) +
                          " routed_scaling_factor must be finite as a float32, got " + text);
  }
  return f;
}

void check_moe_gate_params(const MoeGateParams& p) {
  const Checks check("moe_gate");
  if (p.m == 0 || p.n_experts == 0) check.fail("m and n_experts must be nonzero");
  if (p.top_k == 0 || p.top_k > p.n_experts) {
    check.fail("top_k " + std::to_string(p.top_k) +
               " must be in [1, n_experts = " + std::to_string(p.n_experts) + "]");
  }
  if (p.scoring != MoeGateScoring::Softmax && p.scoring != MoeGateScoring::Sigmoid) {
    check.fail("scoring_func must be 'softmax' or 'sigmoid', got code " +
               std::to_string(static_cast<uint32_t>(p.scoring)));
  }
  if (p.num_expert_group == 0) {
    if (p.topk_group != 0) check.fail("topk_group needs num_expert_group");
  } else {
    const std::string groups = std::to_string(p.num_expert_group);
    if (p.n_experts % p.num_expert_group != 0) {
      check.fail("num_expert_group " + groups +
                 " must divide n_experts = " + std::to_string(p.n_experts));
    }
    if (p.topk_group == 0 || p.topk_group > p.num_expert_group) {
      check.fail("topk_group " + std::to_string(p.topk_group) +
                 " must be in [1, num_expert_group = " + groups + "]");
    }
    const uint64_t kept = uint64_t{p.topk_group} * (p.n_experts / p.num_expert_group);
    if (p.top_k > kept) {
      check.fail("top_k " + std::to_string(p.top_k) + " exceeds the " + std::to_string(kept) +
                 " experts of the topk_group = " + std::to_string(p.topk_group) + " kept groups");
    }
  }
  moe_gate_scaling_factor("moe_gate", p.routed_scaling_factor);
}

void moe_gate(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& logits,
              const Buffer& weights, const Buffer& ids, const MoeGateParams& p, const Buffer* bias,
              const Buffer* router_bias) {
  const Checks check("moe_gate");
  check_moe_gate_params(p);
  const ByteRange logits_range =
      check.buffer("logits", logits, {DType::F32}, check.product("logits", {p.m, p.n_experts, 4}));
  const uint64_t slot_bytes = check.product("top-k", {p.m, p.top_k, 4});
  const ByteRange weights_range = check.buffer("weights", weights, {DType::F32}, slot_bytes);
  const ByteRange ids_range = check.buffer("ids", ids, {DType::U32, DType::I32}, slot_bytes);
  if (!ids.writable()) check.fail("ids is read-only");
  if (ids_range.start < weights_range.end && weights_range.start < ids_range.end) {
    check.fail("weights and ids must not overlap");
  }
  if (ids.backend() != weights.backend()) check.fail("buffers must all live on one device");
  // An F32 [n_experts] vector input's range; without one the logits fill its kernel slot (never
  // read there).
  const auto vector_range = [&](const char* name, const Buffer* v) {
    if (v == nullptr) return logits_range;
    const ByteRange range =
        check.buffer(name, *v, {DType::F32}, check.product(name, {p.n_experts, 4}));
    if (!v->shape().empty() && (v->shape().size() != 1 || v->shape()[0] != p.n_experts)) {
      std::string shape;
      for (const uint64_t d : v->shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
      check.fail(std::string(name) + " must have shape [n_experts = " +
                 std::to_string(p.n_experts) + "], got [" + shape + "]");
    }
    return range;
  };
  const Buffer& bias_arg = bias != nullptr ? *bias : logits;
  const ByteRange bias_range = vector_range("e_score_correction_bias", bias);
  const Buffer& router_bias_arg = router_bias != nullptr ? *router_bias : logits;
  const ByteRange router_bias_range = vector_range("router_bias", router_bias);
  for (const auto& [out, out_range] :
       {std::pair{&weights, weights_range}, std::pair{&ids, ids_range}}) {
    check.placement(encoder, registry,
                    {{"logits", &logits},
                     {"e_score_correction_bias", &bias_arg},
                     {"router_bias", &router_bias_arg}},
                    *out, out_range, {logits_range, bias_range, router_bias_range});
  }

  const PipelinePtr pipeline = registry.get_pipeline(kMoeGatePipeline);
  const kernels::MoeGateKernelParams gpu{p.m,
                                         p.n_experts,
                                         p.top_k,
                                         p.renormalize ? 1u : 0u,
                                         static_cast<uint32_t>(p.scoring),
                                         bias != nullptr ? 1u : 0u,
                                         p.num_expert_group,
                                         p.topk_group,
                                         p.routed_scaling_factor,
                                         router_bias != nullptr ? 1u : 0u};
  if (encoder.is_capturing()) {
    std::vector<ByteRange> reads = {logical_range(logits)};
    if (bias != nullptr) reads.push_back(logical_range(*bias));
    if (router_bias != nullptr) reads.push_back(logical_range(*router_bias));
    encoder.set_pending_buffer_ranges(std::move(reads),
                                      {logical_range(weights), logical_range(ids)});
  }
  const std::pair<uint32_t, KernelArg> args[] = {
      {0, KernelArg::pod(gpu)}, {1, KernelArg::of(logits)},   {2, KernelArg::of(weights)},
      {3, KernelArg::of(ids)},  {4, KernelArg::of(bias_arg)}, {5, KernelArg::of(router_bias_arg)}};
  // One thread per token row.
  const uint64_t threads = group_threads(*pipeline);
  encoder.dispatch(*pipeline, args, Dim3{ceil_div(p.m, threads), 1, 1}, Dim3{threads, 1, 1});
}

void moe_silu_mul(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& gate,
                  const Buffer& up, const Buffer& output, const MoeSiluMulParams& p,
                  const MoeSiluMulInputs& in) {
  const Checks check("moe_silu_mul");
  if (p.rows == 0 || p.width == 0) check.fail("rows and width must be nonzero");
  if (p.gate_row_stride < p.width || p.up_row_stride < p.width) {
    check.fail("row strides " + std::to_string(p.gate_row_stride) + "/" +
               std::to_string(p.up_row_stride) + " must be at least the width " +
               std::to_string(p.width));
  }
  uint32_t activation = kernels::kMoeActivationSilu;
  if (p.activation == MoeActivation::SwigluOai) {
    activation = kernels::kMoeActivationSwigluOai;
    if (!std::isfinite(p.alpha)) check.fail("alpha must be finite, got " + std::to_string(p.alpha));
    if (!(p.limit > 0.0f)) check.fail("limit must be > 0, got " + std::to_string(p.limit));
  } else if (p.activation != MoeActivation::Silu) {
    check.fail("activation must be silu or swiglu_oai");
  }
  // Elements up to the end of the last row read: (rows - 1) * stride + width.
  const auto extent = [&](std::string_view label, uint64_t stride, uint64_t rows) {
    const uint64_t before_last = check.product(label, {rows - 1ull, stride});
    if (before_last + p.width < before_last) check.fail(std::string(label) + " extent overflow");
    return check.product(label, {before_last + p.width, 4});
  };
  std::vector<std::pair<std::string_view, const Buffer*>> inputs = {{"gate", &gate}, {"up", &up}};
  std::vector<ByteRange> ranges = {
      check.buffer("gate", gate, {DType::F32}, extent("gate", p.gate_row_stride, p.rows)),
      check.buffer("up", up, {DType::F32}, extent("up", p.up_row_stride, p.rows))};
  uint32_t flags = 0;
  if (in.scale_rows != nullptr) {
    flags |= kernels::kMoeActScaleRows;
    inputs.emplace_back("scale_rows", in.scale_rows);
    ranges.push_back(check.buffer("scale_rows", *in.scale_rows, {DType::F32},
                                  check.product("scale_rows", {p.rows, 4})));
  }
  if (in.gate_bias != nullptr || in.up_bias != nullptr) {
    if (in.ids == nullptr) check.fail("a bias needs the rows' ids");
    if (p.n_experts == 0) check.fail("a bias needs n_experts > 0");
    if (p.bias_row_stride < p.width) {
      check.fail("bias_row_stride " + std::to_string(p.bias_row_stride) +
                 " must be at least the width " + std::to_string(p.width));
    }
    inputs.emplace_back("ids", in.ids);
    ranges.push_back(
        check.buffer("ids", *in.ids, {DType::U32, DType::I32}, check.product("ids", {p.rows, 4})));
    for (const auto& [label, bias, bit] : {std::tuple<std::string_view, const Buffer*, uint32_t>{
                                               "gate_bias", in.gate_bias, kernels::kMoeActGateBias},
                                           {"up_bias", in.up_bias, kernels::kMoeActUpBias}}) {
      if (bias == nullptr) continue;
      flags |= bit;
      inputs.emplace_back(label, bias);
      ranges.push_back(
          check.buffer(label, *bias, {DType::F32}, extent(label, p.bias_row_stride, p.n_experts)));
    }
  } else if (in.ids != nullptr) {
    check.fail("ids are read only with a bias");
  }
  const ByteRange out_range =
      check.buffer("output", output, {DType::F32}, check.product("output", {p.rows, p.width, 4}));
  if (!output.writable()) check.fail("output is read-only");
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (out_range.start < ranges[i].end && ranges[i].start < out_range.end) {
      check.fail("output must not overlap " + std::string(inputs[i].first));
    }
    if (inputs[i].second->backend() != output.backend()) {
      check.fail("buffers must all live on one device");
    }
  }
  check.placement(encoder, registry, {}, output, out_range, {});

  const PipelinePtr pipeline = registry.get_pipeline(kMoeSiluMulPipeline);
  const kernels::MoeSiluMulKernelParams gpu{
      p.rows, p.width, p.gate_row_stride, p.up_row_stride, activation,
      flags,  p.alpha, p.limit,           p.n_experts,     p.bias_row_stride};
  if (encoder.is_capturing()) {
    std::vector<ByteRange> reads;
    for (const auto& [label, buffer] : inputs) reads.push_back(logical_range(*buffer));
    encoder.set_pending_buffer_ranges(reads, {logical_range(output)});
  }
  // Every slot the kernel declares is bound (Metal binds all of them); an input the flags do not
  // name is stood in for by the gate rows, which the kernel then never reads there.
  const auto or_gate = [&](const Buffer* b) { return KernelArg::of(b != nullptr ? *b : gate); };
  const bool biased = in.gate_bias != nullptr || in.up_bias != nullptr;
  const std::pair<uint32_t, KernelArg> args[] = {{0, KernelArg::pod(gpu)},
                                                 {1, KernelArg::of(gate)},
                                                 {2, KernelArg::of(up)},
                                                 {3, KernelArg::of(output)},
                                                 {4, or_gate(biased ? in.ids : nullptr)},
                                                 {5, or_gate(in.scale_rows)},
                                                 {6, or_gate(in.gate_bias)},
                                                 {7, or_gate(in.up_bias)}};
  // Group (x, y) covers columns [x * threads, (x + 1) * threads) of row y.
  const uint64_t threads = group_threads(*pipeline);
  encoder.dispatch(*pipeline, args, Dim3{ceil_div(p.width, threads), p.rows, 1},
                   Dim3{threads, 1, 1});
}

void moe_combine(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& rows,
                 const Buffer& weights, const Buffer& ids, const Buffer& output,
                 const MoeCombineParams& p, const Buffer* bias) {
  const Checks check("moe_combine");
  if (p.m == 0 || p.top_k == 0 || p.hidden == 0 || p.n_experts == 0) {
    check.fail("m, top_k, hidden and n_experts must be nonzero");
  }
  const ByteRange rows_range =
      check.buffer("rows", rows, {DType::F32}, check.product("rows", {p.m, p.top_k, p.hidden, 4}));
  const uint64_t slot_bytes = check.product("top-k", {p.m, p.top_k, 4});
  const ByteRange weights_range = check.buffer("weights", weights, {DType::F32}, slot_bytes);
  const ByteRange ids_range = check.buffer("ids", ids, {DType::U32, DType::I32}, slot_bytes);
  const ByteRange out_range =
      check.buffer("output", output, {DType::F32}, check.product("output", {p.m, p.hidden, 4}));
  check.placement(encoder, registry, {{"rows", &rows}, {"weights", &weights}, {"ids", &ids}},
                  output, out_range, {rows_range, weights_range, ids_range});
  if (bias != nullptr) {
    const ByteRange bias_range = check.buffer("bias", *bias, {DType::F32},
                                              check.product("bias", {p.n_experts, p.hidden, 4}));
    check.placement(encoder, registry, {{"bias", bias}}, output, out_range, {bias_range});
  }

  const PipelinePtr pipeline = registry.get_pipeline(kMoeCombinePipeline);
  const uint32_t flags = (p.unit_weights ? kernels::kMoeCombineUnitWeights : 0u) |
                         (bias != nullptr ? kernels::kMoeCombineBias : 0u);
  const kernels::MoeCombineKernelParams gpu{p.m, p.top_k, p.hidden, p.n_experts, flags, 0};
  if (encoder.is_capturing()) {
    std::vector<ByteRange> reads = {logical_range(rows), logical_range(weights),
                                    logical_range(ids)};
    if (bias != nullptr) reads.push_back(logical_range(*bias));
    encoder.set_pending_buffer_ranges(reads, {logical_range(output)});
  }
  // Slot 5 is always bound (Metal binds every declared slot): the rows stand in for no bias.
  const std::pair<uint32_t, KernelArg> args[] = {
      {0, KernelArg::pod(gpu)},    {1, KernelArg::of(rows)},
      {2, KernelArg::of(weights)}, {3, KernelArg::of(ids)},
      {4, KernelArg::of(output)},  {5, KernelArg::of(bias != nullptr ? *bias : rows)}};
  // Group (x, y) covers columns [x * threads, (x + 1) * threads) of token y.
  const uint64_t threads = group_threads(*pipeline);
  encoder.dispatch(*pipeline, args, Dim3{ceil_div(p.hidden, threads), p.m, 1}, Dim3{threads, 1, 1});
}

}  // namespace routemm
