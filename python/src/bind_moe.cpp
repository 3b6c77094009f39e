// MoE layer kernels: params by field; the argument shaping lives in routemm/ops/moe.py.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/moe_experts.h"

namespace routemm::python {
namespace {

// The block's params from Python's fields: the route is a DenseMatmulIdRoute value for float
// stacks, a GgmlQuantizedMatmulIdRoute value for block stacks (ggml_type set).
MoeExpertsParams moe_experts_params(uint32_t m, uint32_t top_k, uint32_t n_experts, uint32_t hidden,
                                    uint32_t intermediate, bool split_gate_up, DType weight_dtype,
                                    const std::optional<std::string>& ggml_type,
                                    const std::string& route) {
  MoeExpertsParams p;
  p.m = m;
  p.top_k = top_k;
  p.n_experts = n_experts;
  p.hidden = hidden;
  p.intermediate = intermediate;
  p.split_gate_up = split_gate_up;
  p.weight_dtype = weight_dtype;
  if (ggml_type) {
    p.ggml_type = parse_enum("moe_experts", *ggml_type, kAllGgmlTypes, "ggml_type");
    p.block_route = parse_enum("moe_experts", route, kAllGgmlQuantizedMatmulIdRoutes, "route");
  } else {
    p.route = parse_enum(
        "moe_experts", route,
        std::array{DenseMatmulIdRoute::Direct, DenseMatmulIdRoute::GroupedPrefill,
                   DenseMatmulIdRoute::GroupedTensorTf32, DenseMatmulIdRoute::GroupedTensorLowp,
                   DenseMatmulIdRoute::DirectBf16Dot, DenseMatmulIdRoute::GroupedBf16Dot},
        "route");
  }
  return p;
}

// The up and down stacks' own block types (mixed block stacks; None: ggml_type's).
void set_moe_experts_stack_types(MoeExpertsParams& p, const std::optional<std::string>& up,
                                 const std::optional<std::string>& down) {
  if (up) p.up_ggml_type = parse_enum("moe_experts", *up, kAllGgmlTypes, "up_ggml_type");
  if (down) p.down_ggml_type = parse_enum("moe_experts", *down, kAllGgmlTypes, "down_ggml_type");
}

// The block's options (routemm/ops/moe_experts.h) onto its params.
void set_moe_experts_options(MoeExpertsParams& p, const std::string& activation, float alpha,
                             float limit, bool gate_up_bias, bool down_bias,
                             bool weights_before_ffn) {
  if (activation == "silu") {
    p.activation = MoeActivation::Silu;
  } else if (activation == "swiglu_oai") {
    p.activation = MoeActivation::SwigluOai;
  } else {
    throw InvalidArgument("moe_experts activation must be 'silu' or 'swiglu_oai', got '" +
                          activation + "'");
  }
  p.swiglu_alpha = alpha;
  p.swiglu_limit = limit;
  p.gate_up_bias = gate_up_bias;
  p.down_bias = down_bias;
  p.weights_before_ffn = weights_before_ffn;
}

// The gate's params from Python's fields (num_expert_group 0: no grouping), each checked.
MoeGateParams moe_gate_params(uint32_t m, uint32_t n_experts, uint32_t top_k, bool renormalize,
                              const std::string& scoring_func, uint32_t num_expert_group,
                              uint32_t topk_group, double routed_scaling_factor) {
  MoeGateParams p{m, n_experts, top_k, renormalize};
  p.scoring = parse_moe_gate_scoring("moe_gate", scoring_func);
  p.num_expert_group = num_expert_group;
  p.topk_group = topk_group;
  p.routed_scaling_factor = moe_gate_scaling_factor("moe_gate", routed_scaling_factor);
  check_moe_gate_params(p);
  return p;
}

}  // namespace

void init_moe(py::module_& m) {
  py::list names;
  for (auto name : kMoePipelineNames) names.append(std::string(name));
  m.attr("MOE_PIPELINE_NAMES") = py::tuple(names);

  m.def(
      "_moe_gate",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& logits,
         const Buffer& weights, const Buffer& ids, uint32_t tokens, uint32_t n_experts,
         uint32_t top_k, bool renormalize, const std::string& scoring_func,
         const std::optional<Buffer>& bias, uint32_t num_expert_group, uint32_t topk_group,
         double routed_scaling_factor, const std::optional<Buffer>& router_bias) {
        moe_gate(encoder, registry, logits, weights, ids,
                 moe_gate_params(tokens, n_experts, top_k, renormalize, scoring_func,
                                 num_expert_group, topk_group, routed_scaling_factor),
                 bias ? &*bias : nullptr, router_bias ? &*router_bias : nullptr);
      },
      py::arg("encoder"), py::arg("registry"), py::arg("logits"), py::arg("weights"),
      py::arg("ids"), py::arg("m"), py::arg("n_experts"), py::arg("top_k"), py::arg("renormalize"),
      py::arg("scoring_func") = "softmax", py::arg("e_score_correction_bias") = std::nullopt,
      py::arg("num_expert_group") = 0, py::arg("topk_group") = 0,
      py::arg("routed_scaling_factor") = 1.0, py::arg("router_bias") = std::nullopt);
  m.def(
      "_check_moe_gate_params",
      [](uint32_t tokens, uint32_t n_experts, uint32_t top_k, bool renormalize,
         const std::string& scoring_func, uint32_t num_expert_group, uint32_t topk_group,
         double routed_scaling_factor) {
        check_moe_gate_params(moe_gate_params(tokens, n_experts, top_k, renormalize, scoring_func,
                                              num_expert_group, topk_group, routed_scaling_factor));
      },
      py::arg("m"), py::arg("n_experts"), py::arg("top_k"), py::arg("renormalize"),
      py::arg("scoring_func"), py::arg("num_expert_group"), py::arg("topk_group"),
      py::arg("routed_scaling_factor"),
      "Refuse gate params moe_gate would refuse (before anything is allocated).");
  m.def(
      "_moe_silu_mul",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& gate, const Buffer& up,
         const Buffer& output, uint32_t rows, uint32_t width, uint64_t gate_row_stride,
         uint64_t up_row_stride) {
        moe_silu_mul(encoder, registry, gate, up, output,
                     MoeSiluMulParams{rows, width, gate_row_stride, up_row_stride});
      },
      py::arg("encoder"), py::arg("registry"), py::arg("gate"), py::arg("up"), py::arg("output"),
      py::arg("rows"), py::arg("width"), py::arg("gate_row_stride"), py::arg("up_row_stride"));
  m.def(
      "_moe_combine",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& rows,
         const Buffer& weights, const Buffer& ids, const Buffer& output, uint32_t tokens,
         uint32_t top_k, uint32_t hidden, uint32_t n_experts) {
        moe_combine(encoder, registry, rows, weights, ids, output,
                    MoeCombineParams{tokens, top_k, hidden, n_experts});
      },
      py::arg("encoder"), py::arg("registry"), py::arg("rows"), py::arg("weights"), py::arg("ids"),
      py::arg("output"), py::arg("m"), py::arg("top_k"), py::arg("hidden"), py::arg("n_experts"));
  m.def(
      "_moe_experts_workspace_bytes",
      [](uint32_t m_, uint32_t top_k, uint32_t n_experts, uint32_t hidden, uint32_t intermediate,
         bool split_gate_up, DType weight_dtype, const std::optional<std::string>& ggml_type,
         const std::string& route, const std::string& activation, float swiglu_alpha,
         float swiglu_limit, bool gate_up_bias, bool down_bias, bool weights_before_ffn,
         const std::optional<std::string>& up_ggml_type,
         const std::optional<std::string>& down_ggml_type) {
        MoeExpertsParams p = moe_experts_params(m_, top_k, n_experts, hidden, intermediate,
                                                split_gate_up, weight_dtype, ggml_type, route);
        set_moe_experts_stack_types(p, up_ggml_type, down_ggml_type);
        set_moe_experts_options(p, activation, swiglu_alpha, swiglu_limit, gate_up_bias, down_bias,
                                weights_before_ffn);
        return moe_experts_workspace(p).total_bytes;
      },
      py::arg("m"), py::arg("top_k"), py::arg("n_experts"), py::arg("hidden"),
      py::arg("intermediate"), py::arg("split_gate_up"), py::arg("weight_dtype"),
      py::arg("ggml_type"), py::arg("route"), py::arg("activation") = "silu",
      py::arg("swiglu_alpha") = 1.702f, py::arg("swiglu_limit") = 7.0f,
      py::arg("gate_up_bias") = false, py::arg("down_bias") = false,
      py::arg("weights_before_ffn") = false, py::arg("up_ggml_type") = std::nullopt,
      py::arg("down_ggml_type") = std::nullopt,
      "The bytes of the workspace one moe_experts call of these params needs (every param "
      "checked).");
  m.def(
      "_moe_experts",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& hidden_states,
         const Buffer& ids, const Buffer& weights, const Buffer& gate_up,
         const std::optional<Buffer>& up, const Buffer& down, const Buffer& output,
         const Buffer& workspace, uint32_t m_, uint32_t top_k, uint32_t n_experts, uint32_t hidden,
         uint32_t intermediate, bool split_gate_up, DType weight_dtype,
         const std::optional<std::string>& ggml_type, const std::string& route,
         const std::string& activation, float swiglu_alpha, float swiglu_limit,
         const std::optional<Buffer>& gate_up_bias, const std::optional<Buffer>& up_bias,
         const std::optional<Buffer>& down_bias, bool weights_before_ffn,
         const std::optional<std::string>& up_ggml_type,
         const std::optional<std::string>& down_ggml_type, std::optional<bool> q8_0_mv_nr2) {
        MoeExpertsParams p = moe_experts_params(m_, top_k, n_experts, hidden, intermediate,
                                                split_gate_up, weight_dtype, ggml_type, route);
        set_moe_experts_stack_types(p, up_ggml_type, down_ggml_type);
        set_moe_experts_options(p, activation, swiglu_alpha, swiglu_limit, gate_up_bias.has_value(),
                                down_bias.has_value(), weights_before_ffn);
        p.q8_0_mv_nr2 = q8_0_mv_nr2;
        const MoeExpertsBiases biases{gate_up_bias ? &*gate_up_bias : nullptr,
                                      up_bias ? &*up_bias : nullptr,
                                      down_bias ? &*down_bias : nullptr};
        const MoeExpertsReceipt r =
            moe_experts(encoder, registry, hidden_states, ids, weights, gate_up,
                        up ? &*up : nullptr, down, output, workspace, p, biases);
        return py::make_tuple(r.grouped, r.dispatch_count);
      },
      py::arg("encoder"), py::arg("registry"), py::arg("hidden_states"), py::arg("ids"),
      py::arg("weights"), py::arg("gate_up"), py::arg("up"), py::arg("down"), py::arg("output"),
      py::arg("workspace"), py::arg("m"), py::arg("top_k"), py::arg("n_experts"), py::arg("hidden"),
      py::arg("intermediate"), py::arg("split_gate_up"), py::arg("weight_dtype"),
      py::arg("ggml_type"), py::arg("route"), py::arg("activation") = "silu",
      py::arg("swiglu_alpha") = 1.702f, py::arg("swiglu_limit") = 7.0f,
      py::arg("gate_up_bias") = std::nullopt, py::arg("up_bias") = std::nullopt,
      py::arg("down_bias") = std::nullopt, py::arg("weights_before_ffn") = false,
      py::arg("up_ggml_type") = std::nullopt, py::arg("down_ggml_type") = std::nullopt,
      py::arg("q8_0_mv_nr2") = std::nullopt,
      "Encode the experts block (routemm::moe_experts); returns (grouped, dispatch count). "
      "q8_0_mv_nr2: GgmlRoutingPolicy.expert_q8_0_mv_nr2 (None: the environment's, read once).");
}

}  // namespace routemm::python
