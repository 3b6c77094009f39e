// Size arithmetic that cannot wrap. Every byte and element count the core derives from caller input
// (allocation sizes, view extents, DLPack shapes, kernel argument extents) goes through these: each
// returns the exact result or throws InvalidArgument naming `what`, so an impossible size is
// refused before any memory is touched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "routemm/error.h"

namespace routemm {

[[noreturn]] inline void size_overflow(std::string_view what) {
  throw InvalidArgument(std::string(what) + ": size arithmetic overflows 64 bits");
}

inline uint64_t checked_add(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) size_overflow(what);
  return sum;
}

inline uint64_t checked_mul(uint64_t a, uint64_t b, std::string_view what) {
  uint64_t product;
  if (__builtin_mul_overflow(a, b, &product)) size_overflow(what);
  return product;
}

inline uint64_t checked_product(std::initializer_list<uint64_t> factors, std::string_view what) {
  uint64_t value = 1;
  for (const uint64_t factor : factors) value = checked_mul(value, factor, what);
  return value;
}

// `value` rounded up to a multiple of `multiple` (nonzero).
inline uint64_t checked_round_up(uint64_t value, uint64_t multiple, std::string_view what) {
  const uint64_t remainder = value % multiple;
  return remainder == 0 ? value : checked_add(value, multiple - remainder, what);
}

}  // namespace routemm
