// CPU kernels of the route-calibration proof (backend/common/calibration_params.h):
// routemm_calibration_poison_f32 and routemm_calibration_compare_f32.
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/calibration_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "kernels.h"
#include "routemm/error.h"
#include "thread_pool.h"

#ifndef ROUTEMM_CPU_CALIBRATION_SHA256
#define ROUTEMM_CPU_CALIBRATION_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::CalibrationKernelParams;

constexpr size_t kGrain = 1 << 14;

const BoundArg& arg(const KernelLaunch& launch, size_t slot, const char* what) {
  return kernels::launch_arg(launch, slot, what);
}

CalibrationKernelParams params_of(const KernelLaunch& launch, size_t slot) {
  const auto p = kernels::launch_params<CalibrationKernelParams>(launch, slot);
  if (p.logical_elements > p.guarded_elements)
    throw Error(launch.label + ": logical elements exceed guarded");
  return p;
}

uint32_t* f32_words(const KernelLaunch& launch, size_t slot, const char* what, uint64_t elements) {
  const BoundArg& a = kernels::launch_arg(launch, slot, what, elements * 4);
  if (a.kind != BoundArg::Kind::Buffer)
    throw Error(launch.label + ": " + what + " must be a buffer");
  return static_cast<uint32_t*>(a.data);
}

void poison_kernel(const KernelLaunch& launch, void* pool_ptr) {
  const CalibrationKernelParams p = params_of(launch, 2);
  uint32_t* control = f32_words(launch, 0, "control output", p.guarded_elements);
  uint32_t* candidate = f32_words(launch, 1, "candidate output", p.guarded_elements);
  static_cast<ThreadPool*>(pool_ptr)->parallel_for(
      p.guarded_elements, kGrain, [&](size_t b, size_t e) {
        for (size_t t = b; t < e; ++t) {
          control[t] = kernels::kCalibrationPoisonBits;
          candidate[t] = kernels::kCalibrationPoisonBits;
        }
      });
}

void compare_kernel(const KernelLaunch& launch, void* pool_ptr) {
  const CalibrationKernelParams p = params_of(launch, 3);
  const uint32_t* control = f32_words(launch, 0, "control output", p.guarded_elements);
  const uint32_t* candidate = f32_words(launch, 1, "candidate output", p.guarded_elements);
  const BoundArg& s = arg(launch, 2, "statuses");
  if (s.kind != BoundArg::Kind::Buffer || s.size / 4 <= p.status_index) {
    throw Error(launch.label + ": status index " + std::to_string(p.status_index) +
                " is out of range");
  }
  std::atomic_ref<uint32_t> status(static_cast<uint32_t*>(s.data)[p.status_index]);
  static_cast<ThreadPool*>(pool_ptr)->parallel_for(
      p.guarded_elements, kGrain, [&](size_t b, size_t e) {
        uint32_t bits = 0;
        for (size_t t = b; t < e; ++t) {
          bits |=
              kernels::calibration_element_status(control[t], candidate[t], t < p.logical_elements);
        }
        if (bits != 0) status.fetch_or(bits, std::memory_order_relaxed);
      });
}

KernelDef def(std::string_view name, KernelFn fn) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.check_args = kernels::kernel_arg_contract(name);
  d.max_threads_per_threadgroup = 1024;
  d.threads_per_group = 256;
  d.origin = "builtin_cpu";
  d.content_sha256 = ROUTEMM_CPU_CALIBRATION_SHA256;
  return d;
}

}  // namespace

void add_calibration_kernels(std::vector<KernelDef>& out) {
  out.push_back(def("routemm_calibration_poison_f32", poison_kernel));
  out.push_back(def("routemm_calibration_compare_f32", compare_kernel));
}

}  // namespace routemm::cpu
