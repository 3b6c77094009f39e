// KernelRegistry, Pipeline and PipelineIdentity.
#include <pybind11/stl.h>

#include "bindings.h"
#include "routemm/error.h"
#include "routemm/registry.h"

namespace routemm::python {
namespace {

py::dict identity_dict(const PipelineIdentity& id) {
  py::dict out;
  out["schema_version"] = id.schema_version;
  out["pipeline_label"] = id.pipeline_label;
  out["kernel_name"] = id.kernel_name;
  out["entry_point"] = id.entry_point;
  out["backend"] = id.backend;
  out["origin"] = id.origin;
  out["content_sha256"] = id.content_sha256;
  return out;
}

}  // namespace

void init_registry(py::module_& m) {
  py::class_<Pipeline, std::shared_ptr<Pipeline>>(m, "Pipeline")
      .def_property_readonly("label", &Pipeline::label)
      .def_property_readonly("kernel_name", &Pipeline::kernel_name)
      .def_property_readonly("max_total_threads_per_threadgroup",
                             &Pipeline::max_total_threads_per_threadgroup)
      .def_property_readonly("int_constants", &Pipeline::int_constants)
      .def_property_readonly("bool_constants", &Pipeline::bool_constants)
      .def("_identity", [](const Pipeline& p) { return identity_dict(p.identity()); });

  m.def("_swap_next_registry_authority_id", &swap_next_registry_authority_id_for_testing,
        py::arg("next"),
        "Test hook: the id the next KernelRegistry takes; returns the one it replaces.");

  py::class_<KernelRegistry, std::shared_ptr<KernelRegistry>>(m, "KernelRegistry")
      .def(py::init<const Device&>(), py::arg("device"))
      .def_property_readonly("device", &KernelRegistry::device)
      .def_property_readonly("authority_id", &KernelRegistry::authority_id)
      .def(
          "get_pipeline",
          [](KernelRegistry& r, const std::string& name,
             const std::vector<std::pair<uint32_t, int32_t>>& int_constants) {
            return std::const_pointer_cast<Pipeline>(r.get_pipeline(name, int_constants));
          },
          py::arg("name"), py::arg("int_constants") = std::vector<std::pair<uint32_t, int32_t>>{})
      .def(
          "_get_pipeline_with_constants",
          [](KernelRegistry& r, const std::string& name,
             const std::vector<std::pair<uint32_t, bool>>& bool_constants,
             const std::vector<std::pair<uint32_t, int32_t>>& int_constants) {
            return std::const_pointer_cast<Pipeline>(
                r.get_pipeline_with_constants(name, bool_constants, int_constants));
          },
          py::arg("name"), py::arg("bool_constants"), py::arg("int_constants"))
      .def("register_source", &KernelRegistry::register_source, py::arg("name"), py::arg("source"),
           "Compile kernel `source` and register it under `name` (backends with a run-time "
           "compiler); refused for protected names and by backends whose kernels are built in.")
      .def("_pipeline_identity",
           [](KernelRegistry& r, const std::string& label) {
             return identity_dict(r.pipeline_identity(label));
           })
      .def("has_kernel", &KernelRegistry::has_kernel)
      .def("kernel_names", &KernelRegistry::kernel_names)
      .def("inject_next_pipeline_lookup_failure",
           &KernelRegistry::inject_next_pipeline_lookup_failure, py::arg("name"))
      .def(
          "register_kernel_from",
          [](KernelRegistry& r, const std::string& name, const std::string& source) {
            // Registers the backend's kernel `source` under `name` (a re-registration when equal).
            for (const KernelDef& def : r.device().backend()->kernels()) {
              if (def.name == source) {
                KernelDef copy = def;
                if (copy.entry_point.empty()) copy.entry_point = copy.name;
                copy.name = name;
                r.register_kernel(std::move(copy));
                return;
              }
            }
            throw InvalidArgument("backend '" + r.device().backend_name() + "' has no kernel '" +
                                  source + "'");
          },
          py::arg("name"), py::arg("source"),
          "Register the backend kernel `source` under `name`; refused for names a frozen plan "
          "protects.")
      .def(
          "freeze_plan",
          [](KernelRegistry& r, const std::string& kind, const std::string& id,
             const std::vector<std::string>& protected_names, std::string document) {
            r.freeze_plan(kind, id, protected_names, std::move(document));
          },
          py::arg("plan_kind"), py::arg("plan_id"), py::arg("protected_names"),
          py::arg("plan_document") = std::string())
      .def("frozen_plan_id", &KernelRegistry::frozen_plan_id, py::arg("plan_kind"))
      .def("frozen_plan_document", &KernelRegistry::frozen_plan_document, py::arg("plan_kind"))
      .def("is_protected", &KernelRegistry::is_protected, py::arg("name"));
}

}  // namespace routemm::python
