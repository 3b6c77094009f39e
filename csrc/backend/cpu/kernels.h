// CPU kernel families; each adds its KernelDefs to the CPU backend's list.
#pragma once

#include <vector>

#include "routemm/backend.h"

namespace routemm::cpu {

// Pipelines of csrc/ops/dense_matmul_id.cpp (kDenseMatmulIdPipelineNames).
void add_dense_matmul_id_kernels(std::vector<KernelDef>& out);

}  // namespace routemm::cpu
