// Declarations shared by the bind_<area>.cpp files.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "routemm/dtype.h"
#include "routemm/error.h"

namespace routemm {
struct EncodedKernelDispatch;
class DenseMatmulIdScratch;
}  // namespace routemm

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

// The enum value among `values` whose snake_case name (to_string) is `text`; anything else is
// InvalidArgument "<op> unknown <what> '<text>'".
template <class Enum, size_t N>
Enum parse_enum(std::string_view op, const std::string& text, const std::array<Enum, N>& values,
                const char* what) {
  for (Enum v : values) {
    if (to_string(v) == text) return v;
  }
  throw InvalidArgument(std::string(op) + " unknown " + what + " '" + text + "'");
}

// Params of an expert-ID op (dense or quantised) with the shape fields both ops share set; the
// caller sets the rest.
template <class Params>
Params expert_id_params(uint32_t m, uint32_t n, uint32_t k, uint32_t top_k, uint32_t n_experts,
                        uint64_t expert_stride_bytes) {
  Params p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.top_k = top_k;
  p.n_experts = n_experts;
  p.expert_stride_bytes = expert_stride_bytes;
  return p;
}

// The byte extents an expert-ID capability (dense or quantised) reports, with its schema version,
// route and scratch requirement, as the dict its Python dataclass is built from; the caller adds
// the weight format.
template <class Capability>
py::dict expert_id_capability_dict(const Capability& c) {
  py::dict out;
  out["schema_version"] = c.schema_version;
  out["route"] = std::string(to_string(c.route));
  out["required_weight_bytes"] = c.required_weight_bytes;
  out["required_input_bytes"] = c.required_input_bytes;
  out["required_ids_bytes"] = c.required_ids_bytes;
  out["required_output_bytes"] = c.required_output_bytes;
  if (c.scratch) {
    py::dict s;
    s["expert_counts_bytes"] = c.scratch->expert_counts_bytes;
    s["routed_rows_bytes"] = c.scratch->routed_rows_bytes;
    out["scratch"] = s;
  } else {
    out["scratch"] = py::none();
  }
  return out;
}

// The expert-ID scratch an op was given: None -> nullptr, a DenseMatmulIdScratch -> it, anything
// else a TypeError naming `op`. Taken as an object and checked here: pybind11's caster for a class
// pointer tries (and fails) a foreign-module attribute lookup on None before accepting it, and a
// None that fails the no-convert pass makes the dispatcher load every argument twice; this keeps
// the per-call path to one pass.
const DenseMatmulIdScratch* optional_scratch(const py::object& scratch, std::string_view op);

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
