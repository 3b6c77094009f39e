// Declarations shared by the bind_<area>.cpp files.
#pragma once

#include <pybind11/pybind11.h>

#include "routemm/dtype.h"

namespace routemm {
struct EncodedKernelDispatch;
}

namespace routemm::python {

namespace py = pybind11;

// EncodedKernelDispatch as the plain dict routemm.EncodedKernelDispatch is built from.
py::dict encoded_dispatch_dict(const EncodedKernelDispatch& d);

void init_core(py::module_& m);
void init_encoder(py::module_& m);
void init_registry(py::module_& m);
void init_dense_matmul_id(py::module_& m);
void init_interop(py::module_& m);
void init_q4(py::module_& m);
void init_quantized_matmul_id(py::module_& m);
void init_moe(py::module_& m);

}  // namespace routemm::python
