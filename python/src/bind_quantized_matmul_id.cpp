// Quantised expert-ID matmul: params by field, enums by their snake_case values, results as dicts
// (capability) or tuples (receipt) that the Python dataclasses are built from.
#include <pybind11/stl.h>

#include "bindings.h"
#include "routemm/error.h"
#include "routemm/ops/quantized_matmul_id.h"

namespace routemm::python {
namespace {

template <class Enum, size_t N>
Enum parse(const std::string& text, const std::array<Enum, N>& values, const char* what) {
  return parse_enum("quantized_matmul_id_ggml", text, values, what);
}

GgmlQuantizedMatmulIdParams make_params(uint32_t m, uint32_t n, uint32_t k, uint32_t top_k,
                                        uint32_t n_experts, const std::string& ggml_type,
                                        uint64_t expert_stride_bytes,
                                        const std::string& input_layout, const std::string& route) {
  auto p =
      expert_id_params<GgmlQuantizedMatmulIdParams>(m, n, k, top_k, n_experts, expert_stride_bytes);
  p.ggml_type = parse(ggml_type, kAllGgmlTypes, "GGML type");
  p.input_layout =
      parse(input_layout,
            std::array{DenseMatmulIdInputLayout::SharedPerToken, DenseMatmulIdInputLayout::Slotted},
            "input layout");
  p.route = parse(route, kAllGgmlQuantizedMatmulIdRoutes, "route");
  return p;
}

py::dict capability_dict(const GgmlQuantizedMatmulIdCapability& c) {
  py::dict out = expert_id_capability_dict(c);
  out["ggml_type"] = std::string(to_string(c.ggml_type));
  return out;
}

}  // namespace

void init_quantized_matmul_id(py::module_& m) {
  py::class_<GgmlQuantizedMatmulIdParams>(m, "_GgmlQuantizedMatmulIdParams")
      .def(py::init(&make_params), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("top_k"),
           py::arg("n_experts"), py::arg("ggml_type"), py::arg("expert_stride_bytes"),
           py::arg("input_layout"), py::arg("route"));

  m.attr("GGML_QUANTIZED_MATMUL_ID_SCHEMA_VERSION") = kGgmlQuantizedMatmulIdSchemaVersion;
  py::list names;
  for (auto name : kGgmlQuantizedMatmulIdPipelineNames) names.append(std::string(name));
  m.attr("GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES") = py::tuple(names);
  py::list tensor_names;
  for (auto name : kGgmlQuantizedMatmulIdTensorPipelineNames)
    tensor_names.append(std::string(name));
  m.attr("GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES") = py::tuple(tensor_names);
  py::list int8_dot_names;
  for (auto name : kGgmlQuantizedMatmulIdInt8DotPipelineNames)
    int8_dot_names.append(std::string(name));
  m.attr("GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES") = py::tuple(int8_dot_names);
  m.attr("GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE") =
      std::string(kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline);

  m.def("_quantized_matmul_id_ggml_capability", [](const GgmlQuantizedMatmulIdParams& p) {
    return capability_dict(quantized_matmul_id_ggml_capability(p));
  });
  m.def("_quantized_matmul_id_ggml_route_pipelines",
        [](const std::string& type, const std::string& route) {
          std::vector<std::string> out;
          for (auto name : quantized_matmul_id_ggml_route_pipelines(
                   parse(type, kAllGgmlTypes, "GGML type"),
                   parse(route, kAllGgmlQuantizedMatmulIdRoutes, "route"))) {
            out.emplace_back(name);
          }
          return out;
        });
  m.def(
      "_quantized_matmul_id_ggml",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& input,
         const Buffer& weights, const Buffer& ids, const Buffer& output, const py::object& scratch,
         const GgmlQuantizedMatmulIdParams& p, bool reuse_map, bool q8_0_mv_nr2) {
        const DenseMatmulIdScratch* scratch_ptr =
            optional_scratch(scratch, "quantized_matmul_id_ggml");
        const auto r = quantized_matmul_id_ggml(
            encoder, registry, input, weights, ids, output, scratch_ptr, p,
            reuse_map ? DenseMatmulIdMapUse::Reuse : DenseMatmulIdMapUse::Build, q8_0_mv_nr2);
        return py::make_tuple(std::string(to_string(r.ggml_type)), std::string(to_string(r.route)),
                              r.dispatch_count, std::string(r.pipeline));
      },
      py::arg("encoder"), py::arg("registry"), py::arg("input"), py::arg("weights"),
      py::arg("expert_ids"), py::arg("output"), py::arg("scratch"), py::arg("params"),
      py::arg("reuse_map") = false, py::arg("q8_0_mv_nr2") = false);
  m.def("_expert_q8_0_mv_nr2_from_environment", &expert_q8_0_mv_nr2_from_environment,
        "GgmlRoutingPolicy.expert_q8_0_mv_nr2 as the tensor ops and the MoE op read it (once).");
}

}  // namespace routemm::python
