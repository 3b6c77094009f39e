// Kernel-argument struct and status bits of the route-calibration proof kernels
// (routemm_calibration_poison_f32, routemm_calibration_compare_f32), shared by the host, CUDA and
// Metal. Fixed-width fields only; the layout is part of the kernel ABI (24 bytes, checked below).
//
// Both kernels are Threads dispatches over `guarded_elements` F32 elements of two outputs, the
// control route's and the candidate route's: elements [0, logical_elements) are the product, the
// rest are guard elements no route may write.
//   poison : slots 0 control, 1 candidate, 2 params. Writes kCalibrationPoisonBits to every
//            guarded element of both outputs.
//   compare: slots 0 control, 1 candidate, 2 statuses (U32), 3 params. ORs the status bits below
//            (atomically) into statuses[status_index]; bit-exact comparison, zero tolerance.
#pragma once

#ifdef __METAL_VERSION__
#define ROUTEMM_U32 uint
#define ROUTEMM_U64 ulong
#define ROUTEMM_CONSTANT \
  constant  // MSL: program-scope constants live in the constant address space
#else
#include <cstddef>
#include <cstdint>
#define ROUTEMM_U32 uint32_t
#define ROUTEMM_U64 uint64_t
#define ROUTEMM_CONSTANT
#endif

namespace routemm::kernels {

ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationPoisonBits = 0xFFFFFFFFu;

// Logical range: control still holds the poison / is NaN or Inf; same for the candidate; the two
// differ bitwise. Guard range: control / candidate no longer holds the poison.
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationControlUnwritten = 1u << 0;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationControlNonFinite = 1u << 1;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationCandidateUnwritten = 1u << 2;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationCandidateNonFinite = 1u << 3;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationMismatch = 1u << 4;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationControlGuard = 1u << 5;
ROUTEMM_CONSTANT constexpr ROUTEMM_U32 kCalibrationCandidateGuard = 1u << 6;

struct CalibrationKernelParams {
  ROUTEMM_U64 logical_elements;  // product elements (m * n)
  ROUTEMM_U64 guarded_elements;  // logical_elements + guard elements
  ROUTEMM_U32 status_index;      // which statuses[] word the compare kernel ORs into
  ROUTEMM_U32 pad;
};

// Status bits of one element (the compare kernel's whole semantics, shared by CPU, CUDA and Metal).
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline ROUTEMM_U32 calibration_element_status(ROUTEMM_U32 control, ROUTEMM_U32 candidate,
                                                  bool logical) {
  constexpr ROUTEMM_U32 kExponent = 0x7F800000u;
  ROUTEMM_U32 bits = 0;
  if (logical) {
    if (control == kCalibrationPoisonBits) {
      bits |= kCalibrationControlUnwritten;
    } else if ((control & kExponent) == kExponent) {
      bits |= kCalibrationControlNonFinite;
    }
    if (candidate == kCalibrationPoisonBits) {
      bits |= kCalibrationCandidateUnwritten;
    } else if ((candidate & kExponent) == kExponent) {
      bits |= kCalibrationCandidateNonFinite;
    }
    if (control != candidate) bits |= kCalibrationMismatch;
  } else {
    if (control != kCalibrationPoisonBits) bits |= kCalibrationControlGuard;
    if (candidate != kCalibrationPoisonBits) bits |= kCalibrationCandidateGuard;
  }
  return bits;
}

#ifndef __METAL_VERSION__
static_assert(sizeof(CalibrationKernelParams) == 24);
static_assert(offsetof(CalibrationKernelParams, guarded_elements) == 8);
static_assert(offsetof(CalibrationKernelParams, status_index) == 16);
static_assert(offsetof(CalibrationKernelParams, pad) == 20);
#endif

}  // namespace routemm::kernels

#undef ROUTEMM_U32
#undef ROUTEMM_U64
#undef ROUTEMM_CONSTANT
