// Declarations shared by the bind_<area>.cpp files.
#pragma once

#include <pybind11/pybind11.h>

#include "routemm/dtype.h"

namespace routemm::python {

namespace py = pybind11;

void init_core(py::module_& m);
void init_encoder(py::module_& m);
void init_registry(py::module_& m);
void init_dense_matmul_id(py::module_& m);
void init_interop(py::module_& m);
void init_q4(py::module_& m);
void init_quantized_matmul_id(py::module_& m);
void init_moe(py::module_& m);

}  // namespace routemm::python
