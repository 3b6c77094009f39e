// Zero-copy interop: DLPack capsules in and out, and raw device pointers with a Python owner
// (__cuda_array_interface__, NumPy). Which protocol to use is decided in routemm/core/_interop.py.
#include <pybind11/stl.h>

#include <type_traits>

#include "bindings.h"
#include "routemm/dlpack.h"
#include "routemm/error.h"

namespace routemm::python {
namespace {

constexpr const char* kLegacy = "dltensor";
constexpr const char* kVersioned = "dltensor_versioned";

// Only an unconsumed capsule still owns its tensor (a consumer renames the capsule it takes).
template <class Managed>
void capsule_destructor(PyObject* capsule) {
  const char* name = std::is_same_v<Managed, DLManagedTensor> ? kLegacy : kVersioned;
  if (PyCapsule_IsValid(capsule, name)) {
    auto* tensor = static_cast<Managed*>(PyCapsule_GetPointer(capsule, name));
    if (tensor != nullptr && tensor->deleter != nullptr) tensor->deleter(tensor);
  }
}

Buffer from_capsule(const Device& device, const py::capsule& capsule) {
  PyObject* ptr = capsule.ptr();
  if (PyCapsule_IsValid(ptr, kVersioned)) {
    auto* tensor = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(ptr, kVersioned));
    Buffer buffer = buffer_from_dlpack(device, tensor);  // throws before taking ownership
    PyCapsule_SetName(ptr, "used_dltensor_versioned");
    return buffer;
  }
  if (PyCapsule_IsValid(ptr, kLegacy)) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(ptr, kLegacy));
    Buffer buffer = buffer_from_dlpack(device, tensor);
    PyCapsule_SetName(ptr, "used_dltensor");
    return buffer;
  }
  throw InvalidArgument("from_dlpack: not an unconsumed DLPack capsule");
}

}  // namespace

void init_interop(py::module_& m) {
  m.def("_buffer_from_dlpack_capsule", &from_capsule, py::arg("device"), py::arg("capsule"));
  m.def(
      "_buffer_from_pointer",
      [](const Device& device, uint64_t pointer, uint64_t nbytes, DType dtype,
         std::vector<uint64_t> shape, bool writable, py::object owner, bool file_backed) {
        // The owner (the producer object) stays alive as long as the storage; released with the GIL.
        auto* held = new py::object(std::move(owner));
        auto release = [held] {
          py::gil_scoped_acquire gil;
          delete held;
        };
        std::shared_ptr<Storage> storage;
        try {
          if (nbytes != 0 && pointer == 0) throw InvalidArgument("from pointer: null data pointer");
          if (pointer % dtype_size(dtype) != 0) {
            throw InvalidArgument("from pointer: data pointer is not aligned to " +
                                  std::string(dtype_name(dtype)));
          }
          storage = std::make_shared<Storage>(device.backend(), reinterpret_cast<void*>(pointer),
                                              nbytes, writable, release, file_backed);
        } catch (...) {
          delete held;
          throw;
        }
        return Buffer(std::move(storage), 0, nbytes, dtype, std::move(shape));
      },
      py::arg("device"), py::arg("pointer"), py::arg("nbytes"), py::arg("dtype"), py::arg("shape"),
      py::arg("writable"), py::arg("owner"), py::arg("file_backed") = false);
  m.def("_dlpack_device", [](const Device& device) {
    const DLDevice d = dlpack_device(device);
    return py::make_tuple(d.device_type, d.device_id);
  });
  m.def(
      "_buffer_to_dlpack_capsule",
      [](const Buffer& buffer, bool versioned) {
        if (versioned) {
          DLManagedTensorVersioned* tensor = buffer_to_dlpack_versioned(buffer);
          return py::capsule(tensor, kVersioned, &capsule_destructor<DLManagedTensorVersioned>);
        }
        DLManagedTensor* tensor = buffer_to_dlpack(buffer);
        return py::capsule(tensor, kLegacy, &capsule_destructor<DLManagedTensor>);
      },
      py::arg("buffer"), py::arg("versioned"));
  m.def("_wait_for_external_stream", [](const Device& device, uint64_t stream) {
    device.backend()->wait_for_external_stream(stream);
  });
}

}  // namespace routemm::python
