// The Metal backend's pipeline table, in plain C++ (no Metal types), so that it also compiles and
// is checked on hosts without Metal (tests/metal/test_metal_kernel_table.cpp).
//
// Every pipeline is one MSL function of the same name in routemm.metallib (metal/*.metal) or, for
// the tensor-API routes, in the optional routemm_tensor.metallib. The geometry fields are what the
// op front doors read from KernelDef (csrc/ops/*.cpp); they are spec §5.5/§5.6/§7.4's Metal
// geometry and must match what the shaders assume.
#pragma once

#include <cstdint>
#include <span>
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
  KernelFn fn = nullptr;      // encodes a launch of `name` (see encode_metal_launch)
};

// Every pipeline this backend can supply, in a fixed order.
std::span<const MetalPipelineSpec> metal_pipeline_specs();

// Encodes one launch of the MSL function `function` on the Metal queue whose native handle is
// `queue_native`. Defined by the Objective-C++ queue (device.mm); a launch carries everything else.
void encode_metal_launch(std::string_view function, const KernelLaunch& launch, void* queue_native);

}  // namespace routemm::metal
