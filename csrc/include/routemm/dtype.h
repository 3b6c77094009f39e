// Element types carried by buffers. Pure metadata: kernels and validation decide what they accept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace routemm {

enum class DType : uint8_t { F32, F16, BF16, U8, U16, U32, I32 };

inline constexpr DType kAllDTypes[] = {DType::F32, DType::F16, DType::BF16, DType::U8,
                                       DType::U16, DType::U32, DType::I32};

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::U8: return 1;
    case DType::U16: return 2;
    case DType::U32: return 4;
    case DType::I32: return 4;
  }
  return 0;
}

// Lowercase name used in every error message and in JSON ("f32", "bf16", ...).
constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "f32";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::U8: return "u8";
    case DType::U16: return "u16";
    case DType::U32: return "u32";
    case DType::I32: return "i32";
  }
  return "?";
}

}  // namespace routemm
