// The DLPack tensor exchange ABI (https://dmlc.github.io/dlpack, v0.8 "legacy" capsule and v1
// "versioned" structs), written from the public specification, plus routemm's import/export.
//
// Ownership: an imported DLManagedTensor is owned by the resulting Buffer's Storage, whose release
// calls the producer's deleter exactly once. An exported DLManagedTensor keeps the Buffer's Storage
// alive until the consumer calls its deleter.
#pragma once

#include <cstdint>

#include "routemm/buffer.h"
#include "routemm/device.h"

extern "C" {

enum RoutemmDLDeviceType : int32_t {
  kRoutemmDLCPU = 1,
  kRoutemmDLCUDA = 2,
  kRoutemmDLCUDAHost = 3,
  kRoutemmDLMetal = 8,
  kRoutemmDLCUDAManaged = 13,
};

enum RoutemmDLDataTypeCode : uint8_t {
  kRoutemmDLInt = 0,
  kRoutemmDLUInt = 1,
  kRoutemmDLFloat = 2,
  kRoutemmDLBfloat = 4,
  kRoutemmDLComplex = 5,
  kRoutemmDLBool = 6,
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

constexpr uint64_t kRoutemmDLFlagReadOnly = 1ull << 0;

struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

}  // extern "C"

namespace routemm {

// DLPack (device_type, device_id) of a device: (1, 0) for cpu, (2, ordinal) for cuda.
DLDevice dlpack_device(const Device& device);

// Wraps a producer's tensor without copying. The tensor must be compact row-major (or strides that
// describe it), of a dtype routemm has, on `device`. On success the Buffer owns `tensor` (its
// deleter runs when the last view is gone); on failure ownership stays with the caller.
Buffer buffer_from_dlpack(const Device& device, DLManagedTensor* tensor);
Buffer buffer_from_dlpack(const Device& device, DLManagedTensorVersioned* tensor);

// A DLManagedTensor describing `buffer` (its logical view, compact row-major). The caller (the
// consumer) must call its deleter once.
DLManagedTensor* buffer_to_dlpack(const Buffer& buffer);

}  // namespace routemm
