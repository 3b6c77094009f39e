// Argument binding for the entry points bind_shaders.py generates: each kernel parameter gets its
// value from the running thread's Invocation, by the parameter's attribute and declared type.
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/metal_emu/msl.h"
#include "backend/metal_emu/runtime_api.h"

namespace routemm::metal_emu {

// [[buffer(i)]]: `device T*` / `constant T*` get the bound address, `constant T&` its object.
template <class T>
T bind_buffer(const Invocation& invocation, uint32_t index) {
  void* address = bound_buffer(invocation, index);
  if constexpr (std::is_reference_v<T>) {
    return *static_cast<std::remove_reference_t<T>*>(address);
  } else {
    static_assert(std::is_pointer_v<T>, "[[buffer(i)]] parameters are pointers or references");
    return static_cast<T>(address);
  }
}

template <class T>
T bind_threadgroup(const Invocation& invocation, uint32_t index) {
  static_assert(std::is_pointer_v<T>, "[[threadgroup(i)]] parameters are pointers");
  return static_cast<T>(bound_threadgroup(invocation, index));
}

template <class T>
struct vector_size : std::integral_constant<int, 1> {};
template <class U, int N>
struct vector_size<metal::vec<U, N>> : std::integral_constant<int, N> {};

// Position attributes: a scalar takes the first component, an N-vector the first N (read from
// the model's own memory: not instrumented).
template <class T>
ROUTEMM_MSL_UNCHECKED T bind_position(const Invocation& invocation, Position which) {
  using V = std::remove_cv_t<T>;
  const uint32_t* v = position(invocation, which);
  if constexpr (vector_size<V>::value == 1) {
    return static_cast<V>(v[0]);
  } else if constexpr (vector_size<V>::value == 2) {
    return V(v[0], v[1]);
  } else {
    static_assert(vector_size<V>::value == 3, "position attributes have at most 3 components");
    return V(v[0], v[1], v[2]);
  }
}

}  // namespace routemm::metal_emu
