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

// The versioned ABI routemm exports (and the major version it imports).
constexpr uint32_t kRoutemmDLPackMajorVersion = 1;
constexpr uint32_t kRoutemmDLPackMinorVersion = 0;

// The consumer must not write through the tensor.
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
// Read-only provenance: a versioned tensor flagged read-only gives a read-only Buffer; a legacy
// tensor that routemm exported keeps the writability of the buffer it came from; any other legacy
// tensor is writable (the legacy ABI has no flag).
Buffer buffer_from_dlpack(const Device& device, DLManagedTensor* tensor);
Buffer buffer_from_dlpack(const Device& device, DLManagedTensorVersioned* tensor);

// A DLManagedTensor describing `buffer` (its logical view, compact row-major). The caller (the
// consumer) must call its deleter once. The legacy struct cannot carry read-only: consumers that
// can honour it should take the versioned export.
DLManagedTensor* buffer_to_dlpack(const Buffer& buffer);
// The same as a DLPack 1.0 versioned tensor, flagged read-only when `buffer` is not writable.
DLManagedTensorVersioned* buffer_to_dlpack_versioned(const Buffer& buffer);

}  // namespace routemm
