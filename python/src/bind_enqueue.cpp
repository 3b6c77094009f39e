// The one-call enqueue path of the tensor front doors (routemm/_tensor_ops.py, the torch ops): a
// framework's tensors come in as raw pointers, and wrapping, encoding and starting the work happen
// here in one Python-to-C++ crossing, so an eager call in an engine's decode loop costs about one
// kernel launch on the host.
//
// Contract with the caller: the pointers are contiguous tensors of the byte sizes given, on the
// device `device`, alive until the work is done. On CUDA with a stream, the work is enqueued on that
// stream and the call returns at once; the framework's stream-ordered allocator keeps the memory
// until the stream passes it, so nothing here holds the tensors. On a host backend the call returns
// when the result is written. Every validation of the op runs before anything is encoded, exactly as
// through the encoder front door (this path calls the same op).
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "routemm/buffer.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/registry.h"

namespace routemm::python {
namespace {

// A buffer over caller memory that releases nothing (see the file comment for why no owner is held):
// its release is a no-op, since a Storage without one would hand the memory to the backend's
// deallocator.
Buffer borrowed(const Device& device, uint64_t pointer, uint64_t nbytes, DType dtype,
                std::vector<uint64_t> shape, bool writable) {
  if (nbytes != 0 && pointer == 0) throw InvalidArgument("enqueue: null data pointer");
  if (pointer % dtype_size(dtype) != 0) {
    throw InvalidArgument("enqueue: data pointer is not aligned to " +
                          std::string(dtype_name(dtype)));
  }
  auto storage = std::make_shared<Storage>(device.backend(), reinterpret_cast<void*>(pointer),
                                           nbytes, writable, [] {});
  return Buffer(std::move(storage), 0, nbytes, dtype, std::move(shape));
}

// Commits `encoder`: on a caller's stream without waiting; otherwise to completion, with the GIL
// released while the host backend works.
void start(CommandEncoder& encoder, bool on_stream) {
  if (on_stream) {
    encoder.commit();
  } else {
    without_gil([&] { encoder.commit_and_wait(); });
  }
}

py::tuple enqueue_dense_matmul_id(const Device& device, KernelRegistry& registry,
                                  const DenseMatmulIdParams& p, DType weight_dtype,
                                  uint64_t weights, uint64_t weights_nbytes, uint64_t input,
                                  uint64_t input_nbytes, uint64_t ids, uint64_t output,
                                  uint64_t expert_counts, uint64_t routed_rows,
                                  std::optional<uint64_t> stream) {
  const bool slotted = p.input_layout == DenseMatmulIdInputLayout::Slotted;
  const uint64_t m = p.m, top_k = p.top_k, n = p.n, k = p.k, e = p.n_experts;
  const Buffer w = borrowed(device, weights, weights_nbytes, weight_dtype, {e, n, k}, false);
  const Buffer x =
      borrowed(device, input, input_nbytes, DType::F32,
               slotted ? std::vector<uint64_t>{m, top_k, k} : std::vector<uint64_t>{m, k}, false);
  const Buffer id_buffer = borrowed(device, ids, m * top_k * 4, DType::U32, {m, top_k}, false);
  const Buffer out = borrowed(device, output, m * top_k * n * 4, DType::F32, {m * top_k, n}, true);
  std::optional<DenseMatmulIdScratch> scratch;
  if (expert_counts != 0 || routed_rows != 0) {
    scratch.emplace(borrowed(device, expert_counts, e * 4, DType::U32, {e}, true),
                    borrowed(device, routed_rows, e * m * 4, DType::U32, {e, m}, true), p.n_experts,
                    p.m);
  }
  CommandEncoder encoder = device.command_encoder(EncoderOptions{stream, std::nullopt});
  const auto r =
      dense_matmul_id(encoder, registry, w, x, id_buffer, out, scratch ? &*scratch : nullptr, p);
  start(encoder, stream.has_value());
  return py::make_tuple(dtype_name(r.weight_dtype), to_string(r.route), r.dispatch_count);
}

}  // namespace

void init_enqueue(py::module_& m) {
  m.def("_enqueue_dense_matmul_id", &enqueue_dense_matmul_id, py::arg("device"),
        py::arg("registry"), py::arg("params"), py::arg("weight_dtype"), py::arg("weights"),
        py::arg("weights_nbytes"), py::arg("input"), py::arg("input_nbytes"), py::arg("ids"),
        py::arg("output"), py::arg("expert_counts"), py::arg("routed_rows"), py::arg("stream"),
        "dense_matmul_id on caller memory given by pointers, encoded and started in one call "
        "(returns the native receipt tuple of _dense_matmul_id).");
}

}  // namespace routemm::python
