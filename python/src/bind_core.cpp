// DType, Device, Buffer, backend discovery and environment knobs.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "routemm/buffer.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/env.h"
#include "routemm/error.h"

namespace routemm::python {

void init_core(py::module_& m) {
  py::enum_<DType>(m, "DType", "Element type of a buffer.")
      .value("F32", DType::F32)
      .value("F16", DType::F16)
      .value("BF16", DType::BF16)
      .value("U8", DType::U8)
      .value("U16", DType::U16)
      .value("U32", DType::U32)
      .value("I32", DType::I32)
      .def_property_readonly(
          "size", [](DType d) { return dtype_size(d); }, "Bytes per element.")
      .def_property_readonly(
          "type_name", [](DType d) { return std::string(dtype_name(d)); },
          "Lowercase name used in messages and JSON ('f32', 'bf16', ...).")
      .def("__str__", [](DType d) { return std::string(dtype_name(d)); });

  m.def("available_backends", &available_backends,
        "Names of the backends that can open a device here, best first.");
  m.def("backend_status", [] {
    py::list out;
    for (const auto& s : backend_status())
      out.append(py::make_tuple(s.name, s.available, s.reason));
    return out;
  });
  m.def("version", [] { return std::string(ROUTEMM_VERSION); });
  m.def("env_knobs", [] {
    size_t count = 0;
    const env::Knob* knobs = env::knobs(&count);
    py::list out;
    for (size_t i = 0; i < count; ++i) {
      out.append(
          py::make_tuple(knobs[i].name, knobs[i].type, knobs[i].default_value, knobs[i].effect));
    }
    return out;
  });
  m.def("env_non_default", &env::non_default);

  py::class_<Device>(m, "Device", "A device of one backend (cpu, cuda, metal).")
      .def(py::init<std::optional<std::string>>(), py::arg("backend") = py::none())
      .def_property_readonly("backend", &Device::backend_name)
      .def_property_readonly("name", &Device::name)
      .def_property_readonly("registry_id", &Device::registry_id)
      .def_property_readonly("host_accessible",
                             [](const Device& d) { return d.backend()->host_accessible(); })
      .def_property_readonly("properties",
                             [](const Device& d) { return d.backend()->properties(); })
      .def("alloc", &Device::alloc, py::arg("nbytes"), py::arg("dtype"),
           py::arg("shape") = std::vector<uint64_t>{},
           "Allocate `nbytes` of device memory tagged with dtype and shape (contents undefined).")
      .def(
          "_command_encoder",
          [](const Device& d, std::optional<uint64_t> stream, std::optional<bool> auto_barrier) {
            return d.command_encoder(EncoderOptions{stream, auto_barrier});
          },
          py::arg("stream") = py::none(), py::arg("auto_barrier") = py::none())
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__hash__", [](const Device& d) { return std::hash<const void*>()(d.backend().get()); })
      .def("__repr__", [](const Device& d) {
        return "Device(backend='" + d.backend_name() + "', name='" + d.name() + "')";
      });

  py::class_<Buffer>(m, "Buffer",
                     "A logical view (byte_offset, nbytes, dtype, shape) of device memory.")
      .def_property_readonly("byte_offset", &Buffer::byte_offset)
      .def_property_readonly("nbytes", &Buffer::nbytes)
      .def_property_readonly("dtype", &Buffer::dtype)
      .def_property_readonly("shape",
                             [](const Buffer& b) { return py::tuple(py::cast(b.shape())); })
      .def_property_readonly("address", &Buffer::address,
                             "Base address of the whole allocation (not including byte_offset).")
      .def_property_readonly("writable", &Buffer::writable)
      .def_property_readonly(
          "is_file_backed", [](const Buffer& b) { return b.valid() && b.storage()->file_backed(); },
          "True when the buffer's memory is a mapping of a file (a GGUF tensor wrapped without "
          "copying).")
      .def(
          "_host_array",
          [](const Buffer& b, const py::dtype& dtype, bool writable) {
            // A NumPy array over the buffer's logical bytes, sharing its memory; the array keeps
            // the storage alive. The Python caller checks host access, length and alignment.
            if (!b.backend()->host_accessible()) {
              throw InvalidArgument("host slice: backend '" + std::string(b.backend()->name()) +
                                    "' memory is not host-accessible");
            }
            const auto itemsize = static_cast<uint64_t>(dtype.itemsize());
            if (itemsize == 0 || b.nbytes() % itemsize != 0 ||
                reinterpret_cast<uintptr_t>(b.data()) % itemsize != 0) {
              throw InvalidArgument("host slice: buffer bytes are not whole aligned elements");
            }
            auto* keep = new std::shared_ptr<Storage>(b.storage());
            py::capsule owner(keep,
                              [](void* p) { delete static_cast<std::shared_ptr<Storage>*>(p); });
            py::array out(dtype, {static_cast<py::ssize_t>(b.nbytes() / itemsize)},
                          {static_cast<py::ssize_t>(itemsize)}, b.data(), owner);
            if (!writable) {
              py::detail::array_proxy(out.ptr())->flags &=
                  ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
            }
            return out;
          },
          py::arg("dtype"), py::arg("writable"))
      .def_property_readonly("device", [](const Buffer& b) { return Device(b.backend()); })
      .def_property_readonly("logical_range", &Buffer::logical_range)
      .def("view", &Buffer::view, py::arg("byte_offset"), py::arg("nbytes"), py::arg("dtype"),
           py::arg("shape") = std::vector<uint64_t>{},
           "A view relative to this buffer's logical start; nested views compose.")
      .def("_write_bytes",
           [](Buffer& b, py::array_t<uint8_t, py::array::c_style> data) {
             b.copy_from_host(data.data(), static_cast<uint64_t>(data.size()));
           })
      .def("_read_bytes",
           [](const Buffer& b) {
             py::array_t<uint8_t> out(static_cast<py::ssize_t>(b.nbytes()));
             b.copy_to_host(out.mutable_data(), b.nbytes());
             return out;
           })
      .def("__repr__", [](const Buffer& b) {
        std::string shape;
        for (auto d : b.shape()) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        return "Buffer(dtype=" + std::string(dtype_name(b.dtype())) + ", shape=(" + shape +
               "), byte_offset=" + std::to_string(b.byte_offset()) +
               ", nbytes=" + std::to_string(b.nbytes()) + ", backend='" +
               std::string(b.backend()->name()) + "')";
      });
}

}  // namespace routemm::python
