// Checked access to a KernelLaunch's bound arguments, for every backend's host-side launch code
// (not included by shaders). The op front doors bind correct arguments; these checks only keep a
// malformed launch from becoming an out-of-bounds access, and name the pipeline when one fails.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::kernels {

// The argument at `slot`: bound, and holding at least `need` bytes from its start.
inline const BoundArg& launch_arg(const KernelLaunch& launch, size_t slot, const char* what,
                                  size_t need = 0) {
  const BoundArg& arg = launch.args.at(slot);
  if (arg.kind == BoundArg::Kind::Empty || arg.data == nullptr) {
    throw Error(launch.label + ": argument slot " + std::to_string(slot) + " (" + what +
                ") is not bound");
  }
  if (arg.size < need) {
    throw Error(launch.label + ": argument slot " + std::to_string(slot) + " (" + what +
                ") holds " + std::to_string(arg.size) + " bytes, needs " + std::to_string(need));
  }
  return arg;
}

// The kernel-argument struct T passed as inline bytes at `slot` (exactly sizeof(T) of them).
template <class T>
T launch_params(const KernelLaunch& launch, size_t slot) {
  const BoundArg& arg = launch_arg(launch, slot, "params");
  if (arg.kind != BoundArg::Kind::Bytes || arg.size != sizeof(T)) {
    throw Error(launch.label + ": argument slot " + std::to_string(slot) + " must hold the " +
                std::to_string(sizeof(T)) + "-byte kernel params");
  }
  T params;
  std::memcpy(&params, arg.data, sizeof(T));
  return params;
}

}  // namespace routemm::kernels
