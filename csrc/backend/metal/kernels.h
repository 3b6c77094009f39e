// The Metal backend's pipeline table, in plain C++ (no Metal types), so that it also compiles and
// is checked on hosts without Metal (tests/metal/test_metal_kernel_table.cpp). It is the one
// definition of the Metal pipelines: the Metal backend (device.mm) and the execution model that
// runs the same shaders on the CPU (csrc/backend/metal_emu) both register their KernelDefs from it.
//
// Every pipeline is one MSL function of the same name in routemm.metallib (metal/*.metal) or, for
// the tensor-API routes, in the optional routemm_tensor.metallib. The geometry fields are what the
// op front doors read from KernelDef (csrc/ops/*.cpp); they are spec §5.5/§5.6/§7.4's Metal
// geometry except the expert-ID map (one threadgroup of 128 threads, not one thread per expert:
// docs/spec-conformance.md, 7.5-map-shader) and must match what the shaders assume.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "routemm/backend.h"

namespace routemm::metal {

// Which library holds a pipeline's function. Tensor: built only with an SDK that has the Metal 4
// tensor API, and used only where the library loads and the pipeline builds on the device.
enum class MetalLibrary : uint8_t { Base, Tensor };

struct MetalPipelineSpec {
  std::string_view name;  // pipeline name == MSL function name (the KernelDef's entry point)
  MetalLibrary library = MetalLibrary::Base;
  uint32_t threads_per_group = 1;
  uint32_t tile_x = 1;
  uint32_t tile_y = 1;
  uint64_t threadgroup_memory_bytes = 0;
  bool q4_constants = false;  // fetched with kQ4PipelineConstants (700, 701, 702)
  KernelFn fn = nullptr;      // hands a launch of `name` to the queue's MetalLaunchTarget
};

// Every pipeline this backend can supply, in a fixed order.
std::span<const MetalPipelineSpec> metal_pipeline_specs();

// What a queue running Metal pipelines implements: a spec's KernelFn receives the queue's
// MetalLaunchTarget* as its queue_native handle and calls encode() with the MSL function's name;
// the launch carries everything else.
class MetalLaunchTarget {
 public:
  virtual void encode(std::string_view function, const KernelLaunch& launch) = 0;

 protected:
  ~MetalLaunchTarget() = default;
};

// The KernelDef a backend registers for `spec`: the table's geometry, the device's thread limit
// for the pipeline, and where its code comes from.
KernelDef metal_kernel_def(const MetalPipelineSpec& spec, uint64_t max_threads_per_threadgroup,
                           std::string origin, std::string content_sha256);

}  // namespace routemm::metal
