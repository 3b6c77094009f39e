// Expert-ID matmul: params by field, enums by their snake_case values, results as dicts that the
// Python dataclasses are built from.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe_experts.h"

namespace routemm::python {
namespace {

template <class Enum, size_t N>
Enum parse(const std::string& text, const std::array<Enum, N>& values, const char* what) {
  return parse_enum("dense_matmul_id", text, values, what);
}

DenseMatmulIdParams make_params(uint32_t m, uint32_t n, uint32_t k, uint32_t top_k,
                                uint32_t n_experts, uint64_t expert_stride_bytes,
                                const std::string& input_layout, const std::string& id_multiplicity,
                                const std::string& route) {
  auto p = expert_id_params<DenseMatmulIdParams>(m, n, k, top_k, n_experts, expert_stride_bytes);
  p.input_layout =
      parse(input_layout,
            std::array{DenseMatmulIdInputLayout::SharedPerToken, DenseMatmulIdInputLayout::Slotted},
            "input layout");
  p.id_multiplicity = parse(
      id_multiplicity,
      std::array{DenseMatmulIdMultiplicity::DistinctPerToken, DenseMatmulIdMultiplicity::MayRepeat},
      "id multiplicity");
  p.route =
      parse(route,
            std::array{DenseMatmulIdRoute::Direct, DenseMatmulIdRoute::GroupedPrefill,
                       DenseMatmulIdRoute::GroupedTensorTf32, DenseMatmulIdRoute::GroupedTensorLowp,
                       DenseMatmulIdRoute::DirectBf16Dot, DenseMatmulIdRoute::GroupedBf16Dot},
            "route");
  return p;
}

py::dict capability_dict(const DenseMatmulIdCapability& c) {
  py::dict out = expert_id_capability_dict(c);
  out["weight_dtype"] = std::string(dtype_name(c.weight_dtype));
  return out;
}

}  // namespace

const DenseMatmulIdScratch* optional_scratch(const py::object& scratch, std::string_view op) {
  if (scratch.is_none()) return nullptr;
  if (!py::isinstance<DenseMatmulIdScratch>(scratch)) {
    throw py::type_error(std::string(op) +
                         ": scratch must be a DenseMatmulIdScratch or None, not " +
                         std::string(py::str(py::type::of(scratch).attr("__name__"))));
  }
  return scratch.cast<const DenseMatmulIdScratch*>();
}

void init_dense_matmul_id(py::module_& m) {
  m.def(
      "_moe_experts_auto_route",
      [](const std::string& backend, uint32_t tokens, uint32_t top_k, uint32_t n_experts,
         DType weight_dtype, bool block_stacks, bool exact, std::optional<bool> tensor_mm,
         bool bf16_dot, bool batch_invariant) {
        MoeExpertsParams p;
        p.m = tokens;
        p.top_k = top_k;
        p.n_experts = n_experts;
        p.weight_dtype = weight_dtype;
        if (block_stacks) p.ggml_type = GgmlType::Q4_0;  // the rule reads only that they are blocks
        const MoeRouteMode mode = exact             ? MoeRouteMode::Exact
                                  : batch_invariant ? MoeRouteMode::BatchInvariant
                                                    : MoeRouteMode::Default;
        moe_experts_auto_route(backend, p, mode,
                               tensor_mm ? *tensor_mm : expert_tensor_mm_from_environment(),
                               bf16_dot);
        return std::string(block_stacks ? to_string(p.block_route) : to_string(p.route));
      },
      py::arg("backend"), py::arg("tokens"), py::arg("top_k"), py::arg("n_experts"),
      py::arg("weight_dtype"), py::arg("block_stacks"), py::arg("exact"), py::arg("tensor_mm"),
      py::arg("bf16_dot") = false, py::arg("batch_invariant") = false,
      "The MoE op's automatic route (routemm::moe_experts_auto_route) for these shapes; "
      "tensor_mm: GgmlRoutingPolicy.expert_tensor_mm is auto_probe (None: the environment's); "
      "bf16_dot: the backend registers the bf16-dot pipelines; batch_invariant: the route mode "
      "(MoeRouteMode::BatchInvariant) when not exact.");

  py::class_<DenseMatmulIdParams>(m, "_DenseMatmulIdParams")
      .def(py::init(&make_params), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("top_k"),
           py::arg("n_experts"), py::arg("expert_stride_bytes"), py::arg("input_layout"),
           py::arg("id_multiplicity"), py::arg("route"));

  py::class_<DenseMatmulIdScratch, std::shared_ptr<DenseMatmulIdScratch>>(
      m, "DenseMatmulIdScratch",
      "Caller-owned scratch for the grouped_prefill route: U32 expert_counts[max_experts] and "
      "routed_rows[max_experts, max_tokens]. Keep it alive until every submission using it has "
      "completed.")
      .def(py::init<const Device&, uint32_t, uint32_t>(), py::arg("device"), py::arg("max_experts"),
           py::arg("max_tokens"))
      .def_static(
          "from_buffers",
          [](Buffer expert_counts, Buffer routed_rows, uint32_t max_experts, uint32_t max_tokens) {
            return std::make_shared<DenseMatmulIdScratch>(
                std::move(expert_counts), std::move(routed_rows), max_experts, max_tokens);
          },
          py::arg("expert_counts"), py::arg("routed_rows"), py::arg("max_experts"),
          py::arg("max_tokens"),
          "Scratch in the caller's U32 buffers (e.g. from a framework's allocator).")
      .def_property_readonly("max_experts", &DenseMatmulIdScratch::max_experts)
      .def_property_readonly("max_tokens", &DenseMatmulIdScratch::max_tokens)
      .def_property_readonly("expert_counts", &DenseMatmulIdScratch::expert_counts)
      .def_property_readonly("routed_rows", &DenseMatmulIdScratch::routed_rows);

  m.attr("DENSE_MATMUL_ID_SCHEMA_VERSION") = kDenseMatmulIdSchemaVersion;
  m.attr("DENSE_MATMUL_ID_GROUPED_MAX_EXPERTS") = kDenseMatmulIdGroupedMaxExperts;
  py::list names;
  for (auto name : kDenseMatmulIdPipelineNames) names.append(std::string(name));
  m.attr("DENSE_MATMUL_ID_PIPELINE_NAMES") = py::tuple(names);
  py::list tensor_names;
  for (auto name : kDenseMatmulIdTensorPipelineNames) tensor_names.append(std::string(name));
  m.attr("DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES") = py::tuple(tensor_names);
  py::list bf16_dot_names;
  for (auto name : kDenseMatmulIdBf16DotPipelineNames) bf16_dot_names.append(std::string(name));
  m.attr("DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES") = py::tuple(bf16_dot_names);

  m.def("_dense_matmul_id_capability", [](DType dtype, const DenseMatmulIdParams& p) {
    return capability_dict(dense_matmul_id_capability(dtype, p));
  });
  m.def("_dense_matmul_id_expected_dispatches",
        [](const KernelRegistry& registry, DType dtype, const DenseMatmulIdParams& p) {
          py::list out;
          for (const auto& d : dense_matmul_id_expected_dispatches(registry, dtype, p))
            out.append(encoded_dispatch_dict(d));
          return out;
        });
  m.def(
      "_dense_matmul_id",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& weights,
         const Buffer& input, const Buffer& ids, const Buffer& output, const py::object& scratch,
         const DenseMatmulIdParams& p, bool reuse_map) {
        const DenseMatmulIdScratch* scratch_ptr = optional_scratch(scratch, "dense_matmul_id");
        // (weight dtype name, route value, dispatch count): a hashable tuple, so the Python front
        // door can return one cached receipt per distinct result (its per-call hot path).
        const auto r =
            dense_matmul_id(encoder, registry, weights, input, ids, output, scratch_ptr, p,
                            reuse_map ? DenseMatmulIdMapUse::Reuse : DenseMatmulIdMapUse::Build);
        return py::make_tuple(dtype_name(r.weight_dtype), to_string(r.route), r.dispatch_count);
      },
      py::arg("encoder"), py::arg("registry"), py::arg("weights"), py::arg("input"),
      py::arg("expert_ids"), py::arg("output"), py::arg("scratch"), py::arg("params"),
      py::arg("reuse_map") = false);
}

}  // namespace routemm::python
