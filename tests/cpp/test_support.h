// Small helpers shared by the C++ tests.
#pragma once

#include <cstring>
#include <vector>

#include "routemm/buffer.h"
#include "routemm/device.h"

namespace routemm::test {

template <class T>
Buffer upload(const Device& device, const std::vector<T>& values, DType dtype) {
  Buffer buffer = device.alloc(values.size() * sizeof(T), dtype, {values.size()});
  buffer.copy_from_host(values.data(), values.size() * sizeof(T));
  return buffer;
}

template <class T>
std::vector<T> download(const Buffer& buffer) {
  std::vector<T> out(buffer.nbytes() / sizeof(T));
  buffer.copy_to_host(out.data(), buffer.nbytes());
  return out;
}

inline uint32_t bits(float value) {
  uint32_t out;
  std::memcpy(&out, &value, 4);
  return out;
}

}  // namespace routemm::test
