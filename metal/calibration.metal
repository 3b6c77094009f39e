// Route-calibration proof kernels (csrc/backend/common/calibration_params.h):
// routemm_calibration_poison_f32 and routemm_calibration_compare_f32.
//
// Both are Threads dispatches: the grid is the number of guarded elements (which fits u32: the
// calibration requires m * n + guard to), the threadgroup at most 256 threads; the last
// threadgroup may be partial, so every thread checks its index. The per-element semantics are the
// shared calibration_element_status, the same function the CPU and CUDA kernels call.
#include <metal_stdlib>

#include "backend/common/calibration_params.h"

using namespace metal;
using routemm::kernels::CalibrationKernelParams;

// Slots: 0 control, 1 candidate, 2 params.
kernel void routemm_calibration_poison_f32(device uint *control [[buffer(0)]],
                                           device uint *candidate [[buffer(1)]],
                                           constant CalibrationKernelParams &p [[buffer(2)]],
                                           uint t [[thread_position_in_grid]]) {
  if (ulong(t) >= p.guarded_elements) return;
  control[t] = routemm::kernels::kCalibrationPoisonBits;
  candidate[t] = routemm::kernels::kCalibrationPoisonBits;
}

// Slots: 0 control, 1 candidate, 2 statuses (U32), 3 params. Bits are ORed atomically; zero
// tolerance (bitwise comparison).
kernel void routemm_calibration_compare_f32(device const uint *control [[buffer(0)]],
                                            device const uint *candidate [[buffer(1)]],
                                            device atomic_uint *statuses [[buffer(2)]],
                                            constant CalibrationKernelParams &p [[buffer(3)]],
                                            uint t [[thread_position_in_grid]]) {
  if (ulong(t) >= p.guarded_elements) return;
  const uint bits =
      routemm::kernels::calibration_element_status(control[t], candidate[t], ulong(t) < p.logical_elements);
  if (bits != 0) atomic_fetch_or_explicit(&statuses[p.status_index], bits, memory_order_relaxed);
}
