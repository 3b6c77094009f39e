// MoE layer kernels: params by field; the argument shaping lives in routemm/moe.py.
#include <pybind11/stl.h>

#include "bindings.h"
#include "routemm/ops/moe.h"

namespace routemm::python {

void init_moe(py::module_& m) {
  py::list names;
  for (auto name : kMoePipelineNames) names.append(std::string(name));
  m.attr("MOE_PIPELINE_NAMES") = py::tuple(names);

  m.def(
      "_moe_gate",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& logits,
         const Buffer& weights, const Buffer& ids, uint32_t m, uint32_t n_experts, uint32_t top_k,
         bool renormalize) {
        moe_gate(encoder, registry, logits, weights, ids,
                 MoeGateParams{m, n_experts, top_k, renormalize});
      },
      py::arg("encoder"), py::arg("registry"), py::arg("logits"), py::arg("weights"),
      py::arg("ids"), py::arg("m"), py::arg("n_experts"), py::arg("top_k"), py::arg("renormalize"));
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
         const Buffer& weights, const Buffer& ids, const Buffer& output, uint32_t m, uint32_t top_k,
         uint32_t hidden, uint32_t n_experts) {
        moe_combine(encoder, registry, rows, weights, ids, output,
                    MoeCombineParams{m, top_k, hidden, n_experts});
      },
      py::arg("encoder"), py::arg("registry"), py::arg("rows"), py::arg("weights"), py::arg("ids"),
      py::arg("output"), py::arg("m"), py::arg("top_k"), py::arg("hidden"), py::arg("n_experts"));
}

}  // namespace routemm::python
