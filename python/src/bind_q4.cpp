// GGML Q4_0 and Q8_0: the reference quantisers/dequantisers on flat NumPy arrays, and the dense projection
// front doors. Enums travel as their snake_case values; results as dicts that the Python
// dataclasses are built from.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/q4_0.h"
#include "routemm/q8_0.h"

namespace routemm::python {
namespace {

template <class Enum, size_t N>
Enum parse(const std::string& text, const std::array<Enum, N>& values, const char* what) {
  return parse_enum("quantized_matmul_ggml", text, values, what);
}

GgmlRoutingPolicy make_policy(const std::string& dense_tensor_mm, bool allow_large_tile,
                              bool q8_0_mv_nr2, bool int8_dot) {
  GgmlRoutingPolicy policy;
  policy.dense_tensor_mm =
      parse(dense_tensor_mm,
            std::array{GgmlTensorMmPreference::AutoProbe, GgmlTensorMmPreference::ForceSimd},
            "tensor MM preference");
  policy.allow_dense_large_tile_mm = allow_large_tile;
  policy.dense_q8_0_mv_nr2 = q8_0_mv_nr2;
  policy.dense_int8_dot = int8_dot;
  return policy;
}

py::dict receipt_dict(const GgmlQuantizedMatmulReceipt& r) {
  py::dict out;
  out["ggml_type"] = std::string(to_string(r.ggml_type));
  out["route"] = r.int8_dot ? std::string(kGgmlInt8DotRoute)
                 : r.route  ? std::string(to_string(*r.route))
                            : std::string("mat_vec");
  out["decision"] = std::string(to_string(r.decision));
  py::dict policy;
  policy["dense_tensor_mm"] = std::string(to_string(r.policy.dense_tensor_mm));
  policy["allow_dense_large_tile_mm"] = r.policy.allow_dense_large_tile_mm;
  policy["dense_q8_0_mv_nr2"] = r.policy.dense_q8_0_mv_nr2;
  policy["dense_int8_dot"] = r.policy.dense_int8_dot;
  out["policy"] = policy;
  out["pipeline_label"] = r.pipeline_label;
  out["dispatch_count"] = r.dispatch_count;
  out["dispatch"] = encoded_dispatch_dict(r.dispatch);
  return out;
}

DenseQ4Route parse_route(const std::string& text) {
  return parse(text, kAllDenseQ4Routes, "dense Q4 route");
}

// _<format>_quantize / _<format>_dequantize on flat NumPy arrays, for one GGML block format.
template <size_t (*QuantizedBytes)(size_t),
          void (*Quantize)(std::span<const float>, std::span<uint8_t>),
          void (*Dequantize)(std::span<const uint8_t>, std::span<float>)>
void def_block_format(py::module_& m, const std::string& format, size_t block_values,
                      size_t block_bytes) {
  m.def(("_" + format + "_quantize").c_str(),
        [](py::array_t<float, py::array::c_style | py::array::forcecast> values) {
          const size_t count = static_cast<size_t>(values.size());
          py::array_t<uint8_t> out(static_cast<py::ssize_t>(QuantizedBytes(count)));
          const float* src = values.data();
          uint8_t* dst = out.mutable_data();
          const size_t bytes = static_cast<size_t>(out.size());
          {
            py::gil_scoped_release release;
            Quantize({src, count}, {dst, bytes});
          }
          return out;
        },
        py::arg("values"),
        ("Flat float32 values (a multiple of 32) -> flat " + format + " bytes.").c_str());
  m.def(("_" + format + "_dequantize").c_str(),
        [format, block_values,
         block_bytes](py::array_t<uint8_t, py::array::c_style | py::array::forcecast> blocks) {
          const size_t bytes = static_cast<size_t>(blocks.size());
          if (bytes % block_bytes != 0) {
            throw InvalidArgument(format + " dequantize: " + std::to_string(bytes) +
                                  " bytes are not a whole number of " +
                                  std::to_string(block_bytes) + "-byte blocks");
          }
          const size_t count = bytes / block_bytes * block_values;
          py::array_t<float> out(static_cast<py::ssize_t>(count));
          const uint8_t* src = blocks.data();
          float* dst = out.mutable_data();
          {
            py::gil_scoped_release release;
            Dequantize({src, bytes}, {dst, count});
          }
          return out;
        },
        py::arg("blocks"), ("Flat " + format + " bytes -> flat float32 values (exact).").c_str());
}

}  // namespace

void init_q4(py::module_& m) {
  // Every GGML block format's reference codec by name (routemm/ggml_formats.h).
  py::list table;
  for (const ggml_formats::Format& f : ggml_formats::formats()) {
    table.append(py::make_tuple(std::string(f.name), f.block_values, f.block_bytes,
                                f.quantize_block != nullptr));
  }
  m.attr("GGML_FORMATS") = py::tuple(table);
  // The formats beyond Q4_0 / Q8_0 that have kernels, with their pipelines (ggml_formats.h):
  // (name, GgmlType code, block values, block bytes, mat-vec, matrix, id direct, id grouped).
  py::list kernel_formats;
  for (const ggml_formats::KernelFormat& f : ggml_formats::kKernelFormats) {
    kernel_formats.append(py::make_tuple(
        std::string(f.name), f.ggml_type, f.block_values, f.block_bytes, std::string(f.mat_vec),
        std::string(f.matrix), std::string(f.id_direct), std::string(f.id_grouped)));
  }
  m.attr("GGML_KERNEL_FORMATS") = py::tuple(kernel_formats);
  m.def(
      "_ggml_quantize",
      [](const std::string& name,
         py::array_t<float, py::array::c_style | py::array::forcecast> values) {
        const ggml_formats::Format& f = ggml_formats::format(name);
        const size_t count = static_cast<size_t>(values.size());
        if (count % f.block_values != 0) {
          throw InvalidArgument(name + " quantize: " + std::to_string(count) +
                                " values are not a multiple of " + std::to_string(f.block_values));
        }
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(count / f.block_values * f.block_bytes));
        const float* src = values.data();
        uint8_t* dst = out.mutable_data();
        const size_t bytes = static_cast<size_t>(out.size());
        {
          py::gil_scoped_release release;
          ggml_formats::quantize(f, {src, count}, {dst, bytes});
        }
        return out;
      },
      py::arg("format"), py::arg("values"),
      "Flat float32 values (whole blocks) -> flat bytes of the named GGML block format.");
  m.def(
      "_ggml_dequantize",
      [](const std::string& name,
         py::array_t<uint8_t, py::array::c_style | py::array::forcecast> blocks) {
        const ggml_formats::Format& f = ggml_formats::format(name);
        const size_t bytes = static_cast<size_t>(blocks.size());
        if (bytes % f.block_bytes != 0) {
          throw InvalidArgument(name + " dequantize: " + std::to_string(bytes) +
                                " bytes are not a whole number of " +
                                std::to_string(f.block_bytes) + "-byte blocks");
        }
        const size_t count = bytes / f.block_bytes * f.block_values;
        py::array_t<float> out(static_cast<py::ssize_t>(count));
        const uint8_t* src = blocks.data();
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release release;
          ggml_formats::dequantize(f, {src, bytes}, {dst, count});
        }
        return out;
      },
      py::arg("format"), py::arg("blocks"),
      "Flat bytes of the named GGML block format -> flat float32 values (exact).");
  m.attr("GGML_QUANTIZED_MATMUL_SCHEMA_VERSION") = kGgmlQuantizedMatmulSchemaVersion;
  m.attr("GGML_MM_ROUTING_THRESHOLD") = kGgmlMmRoutingThreshold;
  py::list names;
  for (auto name : kQ4MatmulPipelineNames) names.append(std::string(name));
  m.attr("Q4_MATMUL_PIPELINE_NAMES") = py::tuple(names);
  py::list q8_names;
  for (auto name : kQ8MatmulPipelineNames) q8_names.append(std::string(name));
  m.attr("Q8_MATMUL_PIPELINE_NAMES") = py::tuple(q8_names);
  m.attr("Q8_0_MAT_VEC_NR2_PIPELINE") = std::string(kQ8_0MatVecNr2Pipeline);
  py::list int8_names;
  for (auto name : kGgmlInt8DotPipelineNames) int8_names.append(std::string(name));
  m.attr("GGML_INT8_DOT_PIPELINE_NAMES") = py::tuple(int8_names);
  m.attr("GGML_INT8_DOT_ROUTE") = std::string(kGgmlInt8DotRoute);

  def_block_format<q4_0::quantized_bytes, q4_0::quantize, q4_0::dequantize>(
      m, "q4_0", q4_0::kBlockValues, q4_0::kBlockBytes);
  def_block_format<q8_0::quantized_bytes, q8_0::quantize, q8_0::dequantize>(
      m, "q8_0", q8_0::kBlockValues, q8_0::kBlockBytes);

  py::class_<GgmlQuantizedMatmulParams>(m, "_GgmlQuantizedMatmulParams")
      .def(py::init([](uint32_t m_, uint32_t n, uint32_t k, const std::string& type) {
             GgmlQuantizedMatmulParams p;
             p.m = m_;
             p.n = n;
             p.k = k;
             p.ggml_type = parse(type, kAllGgmlTypes, "GGML type");
             return p;
           }),
           py::arg("m"), py::arg("n"), py::arg("k"), py::arg("ggml_type"));

  m.def("_ggml_block_layout", [](const std::string& type) {
    return ggml_block_layout(parse(type, kAllGgmlTypes, "GGML type"));
  });
  m.def("_dense_q4_pipeline_name", [](const std::string& route) {
    return std::string(dense_q4_pipeline_name(parse_route(route)));
  });
  m.def(
      "_select_dense_q4_route",
      [](const GgmlQuantizedMatmulParams& p, const std::string& pref, bool allow_large,
         bool q8_0_mv_nr2, bool int8_dot) {
        const DenseQ4RouteSelection s =
            select_dense_q4_route(p, make_policy(pref, allow_large, q8_0_mv_nr2, int8_dot));
        return py::make_tuple(std::string(to_string(s.route)), std::string(to_string(s.decision)));
      },
      py::arg("params"), py::arg("dense_tensor_mm"), py::arg("allow_dense_large_tile_mm"),
      py::arg("dense_q8_0_mv_nr2"), py::arg("dense_int8_dot") = false);
  m.def(
      "_select_dense_q4_planned_route",
      [](const KernelRegistry& registry, const Device& device, const GgmlQuantizedMatmulParams& p,
         const std::string& pref, bool allow_large, bool q8_0_mv_nr2, bool int8_dot) {
        const DenseQ4RouteSelection s = select_dense_q4_route(
            registry, device, p, make_policy(pref, allow_large, q8_0_mv_nr2, int8_dot));
        return py::make_tuple(std::string(to_string(s.route)), std::string(to_string(s.decision)));
      },
      py::arg("registry"), py::arg("device"), py::arg("params"), py::arg("dense_tensor_mm"),
      py::arg("allow_dense_large_tile_mm"), py::arg("dense_q8_0_mv_nr2"),
      py::arg("dense_int8_dot") = false);
  m.def(
      "_freeze_dense_q4_plan_routes",
      [](KernelRegistry& registry, const std::string& plan_id, const std::string& device_name,
         uint64_t device_registry_id, uint64_t registry_authority_id,
         const std::vector<std::tuple<uint32_t, uint32_t, uint32_t, std::string>>& decisions,
         const std::vector<std::string>& protected_names, std::string plan_document) {
        DenseQ4PlanRoutes plan{plan_id, device_name, device_registry_id, registry_authority_id, {}};
        for (const auto& [m_, n, k, route] : decisions) {
          if (!plan.routes.emplace(DenseQ4Shape{m_, n, k}, parse_route(route)).second) {
            throw InvalidArgument("dense Q4 route plan repeats the shape (" + std::to_string(m_) +
                                  ", " + std::to_string(n) + ", " + std::to_string(k) + ")");
          }
        }
        freeze_dense_q4_plan_routes(registry, std::move(plan), protected_names,
                                    std::move(plan_document));
      },
      py::arg("registry"), py::arg("plan_id"), py::arg("device_name"),
      py::arg("device_registry_id"), py::arg("registry_authority_id"), py::arg("decisions"),
      py::arg("protected_names"), py::arg("plan_document"));
  m.def("_q4_expected_dispatch", [](const std::string& route, uint32_t m_, uint32_t n) {
    return encoded_dispatch_dict(q4_expected_dispatch(parse_route(route), m_, n));
  });
  m.def(
      "_q4_registry_expected_dispatch", [](const KernelRegistry& registry, const std::string& route,
                                           uint32_t m_, uint32_t n, uint32_t k) {
        return encoded_dispatch_dict(q4_expected_dispatch(registry, parse_route(route), m_, n, k));
      });
  m.def(
      "_quantized_matmul_ggml",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& input,
         const Buffer& weight, const Buffer& output, const GgmlQuantizedMatmulParams& p,
         const std::string& dense_tensor_mm, bool allow_large_tile, bool q8_0_mv_nr2, bool int8_dot,
         const std::optional<Device>& device) {
        return receipt_dict(dense_q4_auto(
            encoder, registry, device ? *device : registry.device(), input, weight, output, p,
            make_policy(dense_tensor_mm, allow_large_tile, q8_0_mv_nr2, int8_dot)));
      },
      py::arg("encoder"), py::arg("registry"), py::arg("input"), py::arg("weight"),
      py::arg("output"), py::arg("params"), py::arg("dense_tensor_mm"),
      py::arg("allow_dense_large_tile_mm"), py::arg("dense_q8_0_mv_nr2"),
      py::arg("dense_int8_dot") = false, py::arg("device") = std::nullopt);
  m.def(
      "_encode_q4_route",
      [](CommandEncoder& encoder, KernelRegistry& registry, const Buffer& input,
         const Buffer& weight, const Buffer& output, const GgmlQuantizedMatmulParams& p,
         const std::string& route) {
        return receipt_dict(
            encode_q4_route(encoder, registry, input, weight, output, p, parse_route(route)));
      },
      py::arg("encoder"), py::arg("registry"), py::arg("input"), py::arg("weight"),
      py::arg("output"), py::arg("params"), py::arg("route"));
}

}  // namespace routemm::python
