// Declarations shared by the bind_<area>.cpp files.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "routemm/dtype.h"

namespace routemm {
struct EncodedKernelDispatch;
}

namespace routemm::python {

namespace py = pybind11;

// EncodedKernelDispatch as the plain dict routemm.EncodedKernelDispatch is built from.
py::dict encoded_dispatch_dict(const EncodedKernelDispatch& d);

// Runs `work` (which must not touch Python) with the GIL released, then takes the GIL back in
// ordinary code rather than in a destructor. At interpreter exit CPython ends a daemon thread that
// asks for the GIL by unwinding its stack; an unwind through a destructor (implicitly noexcept)
// would call std::terminate and abort the whole process, while through ordinary frames it ends
// just that thread. An exception from `work` is rethrown once the GIL is held again.
template <class Work>
auto without_gil(Work&& work) -> decltype(work()) {
  using Result = decltype(work());
  std::exception_ptr error;
  std::optional<std::conditional_t<std::is_void_v<Result>, bool, Result>> result;
  PyThreadState* state = PyEval_SaveThread();
  try {
    if constexpr (std::is_void_v<Result>) {
      work();
      result = true;
    } else {
      result = work();
    }
  } catch (...) {
    error = std::current_exception();
  }
  PyEval_RestoreThread(state);
  if (error) std::rethrow_exception(error);
  if constexpr (!std::is_void_v<Result>) return std::move(*result);
}

void init_core(py::module_& m);
void init_encoder(py::module_& m);
void init_registry(py::module_& m);
void init_dense_matmul_id(py::module_& m);
void init_interop(py::module_& m);
void init_q4(py::module_& m);
void init_quantized_matmul_id(py::module_& m);
void init_moe(py::module_& m);
void init_enqueue(py::module_& m);

}  // namespace routemm::python
