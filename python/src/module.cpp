// routemm._core: the compiled half of routemm. Errors map onto routemm.core._errors classes.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "routemm/error.h"

namespace py = pybind11;

namespace {

void raise_as(const char* class_name, const char* message) {
  py::object cls = py::module_::import("routemm.core._errors").attr(class_name);
  PyErr_SetString(cls.ptr(), message);
}

// CommandBufferError carries the failing pipeline's label as an attribute.
void raise_command_buffer_error(const routemm::CommandBufferError& e) {
  py::object cls = py::module_::import("routemm.core._errors").attr("CommandBufferError");
  py::object error = cls(e.what());
  error.attr("pipeline_label") = e.pipeline_label();
  PyErr_SetObject(cls.ptr(), error.ptr());
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "routemm native core";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const routemm::InvalidArgument& e) {
      raise_as("InvalidArgumentError", e.what());
    } catch (const routemm::OutOfMemory& e) {
      raise_as("OutOfMemoryError", e.what());
    } catch (const routemm::KernelNotFound& e) {
      raise_as("KernelNotFoundError", e.what());
    } catch (const routemm::CommandBufferError& e) {
      raise_command_buffer_error(e);
    } catch (const routemm::Error& e) {
      raise_as("Error", e.what());
    }
  });
  routemm::python::init_core(m);
  routemm::python::init_encoder(m);
  routemm::python::init_registry(m);
  routemm::python::init_dense_matmul_id(m);
  routemm::python::init_interop(m);
  routemm::python::init_enqueue(m);
  routemm::python::init_q4(m);
  routemm::python::init_quantized_matmul_id(m);
  routemm::python::init_moe(m);
}
