// DLPack import (zero-copy wrap of a producer's tensor) and export of a buffer's logical view.
#include "routemm/dlpack.h"

#include <memory>
#include <string>
#include <vector>

#include "routemm/checked.h"
#include "routemm/error.h"

namespace routemm {
namespace {

std::string device_text(DLDevice d) {
  return "(" + std::to_string(d.device_type) + ", " + std::to_string(d.device_id) + ")";
}

// "float64", "int64", "bool8", ...: a DLPack type as the frameworks name it.
std::string dlpack_type_text(DLDataType t) {
  std::string kind;
  switch (t.code) {
    case kRoutemmDLInt: kind = "int"; break;
    case kRoutemmDLUInt: kind = "uint"; break;
    case kRoutemmDLFloat: kind = "float"; break;
    case kRoutemmDLBfloat: kind = "bfloat"; break;
    case kRoutemmDLComplex: kind = "complex"; break;
    case kRoutemmDLBool: kind = "bool"; break;
    default:
      return "DLPack type code " + std::to_string(t.code) + " of " + std::to_string(t.bits) +
             " bits";
  }
  return kind + std::to_string(t.bits);
}

DType dtype_from_dlpack(DLDataType t) {
  if (t.lanes != 1)
    throw InvalidArgument("from_dlpack: vector dtypes (lanes=" + std::to_string(t.lanes) +
                          ") are not supported");
  switch (t.code) {
    case kRoutemmDLFloat:
      if (t.bits == 32) return DType::F32;
      if (t.bits == 16) return DType::F16;
      break;
    case kRoutemmDLBfloat:
      if (t.bits == 16) return DType::BF16;
      break;
    case kRoutemmDLUInt:
      if (t.bits == 8) return DType::U8;
      if (t.bits == 16) return DType::U16;
      if (t.bits == 32) return DType::U32;
      break;
    case kRoutemmDLInt:
      if (t.bits == 32) return DType::I32;
      break;
    default: break;
  }
  throw InvalidArgument("from_dlpack: " + dlpack_type_text(t) +
                        " has no routemm dtype (supported: float32, float16, bfloat16, uint8, "
                        "uint16, uint32, int32); convert first: activations are float32, expert "
                        "ids uint32 or int32");
}

DLDataType dtype_to_dlpack(DType dtype) {
  const auto bits = static_cast<uint8_t>(dtype_size(dtype) * 8);
  switch (dtype) {
    case DType::F32:
    case DType::F16: return {kRoutemmDLFloat, bits, 1};
    case DType::BF16: return {kRoutemmDLBfloat, bits, 1};
    case DType::U8:
    case DType::U16:
    case DType::U32: return {kRoutemmDLUInt, bits, 1};
    case DType::I32: return {kRoutemmDLInt, bits, 1};
  }
  throw InvalidArgument("to_dlpack: unknown dtype");
}

// Validates `t` against `device` and returns (dtype, shape, nbytes); throws on anything the kernels
// could not use as one contiguous range.
Buffer wrap(const Device& device, const DLTensor& t, bool writable, std::function<void()> release) {
  const DLDevice want = dlpack_device(device);
  if (t.device.device_type != want.device_type || t.device.device_id != want.device_id) {
    throw InvalidArgument("from_dlpack: tensor lives on DLPack device " + device_text(t.device) +
                          ", not on this " + device.backend_name() + " device " +
                          device_text(want));
  }
  const DType dtype = dtype_from_dlpack(t.dtype);
  if (t.ndim < 0) throw InvalidArgument("from_dlpack: negative ndim");
  if (t.ndim > 0 && t.shape == nullptr) throw InvalidArgument("from_dlpack: tensor has no shape");
  std::vector<uint64_t> shape;
  uint64_t elements = 1;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) throw InvalidArgument("from_dlpack: negative extent");
    shape.push_back(static_cast<uint64_t>(t.shape[i]));
    elements = checked_mul(elements, static_cast<uint64_t>(t.shape[i]), "from_dlpack: shape");
  }
  if (t.strides != nullptr && elements > 1) {
    // Row-major strides of a tensor whose element count fits 64 bits fit too (the count is >= each
    // partial product here, and a zero extent makes elements 0).
    uint64_t expected = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && static_cast<uint64_t>(t.strides[i]) != expected) {
        throw InvalidArgument(
            "from_dlpack: tensor is not contiguous (row-major strides required); pass a "
            "contiguous copy: np.ascontiguousarray(a) for NumPy, t.contiguous() for PyTorch");
      }
      expected *= static_cast<uint64_t>(t.shape[i]);
    }
  }
  const uint64_t nbytes = checked_mul(elements, dtype_size(dtype), "from_dlpack: byte size");
  if (t.data == nullptr && (nbytes != 0 || t.byte_offset != 0))
    throw InvalidArgument("from_dlpack: tensor has no data pointer");
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  checked_add(checked_add(base, t.byte_offset, "from_dlpack: byte offset"), nbytes,
              "from_dlpack: data range");
  char* data = static_cast<char*>(t.data) + t.byte_offset;
  if (reinterpret_cast<uintptr_t>(data) % dtype_size(dtype) != 0) {
    throw InvalidArgument("from_dlpack: data pointer is not aligned to " +
                          std::string(dtype_name(dtype)));
  }
  auto storage =
      std::make_shared<Storage>(device.backend(), data, nbytes, writable, std::move(release));
  return Buffer(std::move(storage), 0, nbytes, dtype,
                shape.empty() ? std::vector<uint64_t>{1} : shape);
}

// What an exported tensor owns: the buffer's storage (kept alive), its shape, and the struct the
// consumer holds (DLManagedTensor or DLManagedTensorVersioned).
template <class Managed>
struct ExportContext {
  std::shared_ptr<Storage> storage;
  std::vector<int64_t> shape;
  Managed tensor{};
};

// Named (not lambdas) so that an import can recognise a tensor routemm exported itself.
void delete_legacy_export(DLManagedTensor* self) {
  delete static_cast<ExportContext<DLManagedTensor>*>(self->manager_ctx);
}
void delete_versioned_export(DLManagedTensorVersioned* self) {
  delete static_cast<ExportContext<DLManagedTensorVersioned>*>(self->manager_ctx);
}

// Fills `ctx` for `buffer`'s logical view, compact row-major.
template <class Managed>
void describe(const Buffer& buffer, ExportContext<Managed>& ctx) {
  ctx.storage = buffer.storage();
  for (uint64_t d : buffer.shape()) ctx.shape.push_back(static_cast<int64_t>(d));
  const Device device(buffer.backend());
  DLTensor& t = ctx.tensor.dl_tensor;
  // The data pointer names the first logical byte (byte_offset 0): some consumers ignore byte_offset.
  t.data = buffer.data();
  t.byte_offset = 0;
  t.device = dlpack_device(device);
  t.ndim = static_cast<int32_t>(ctx.shape.size());
  t.dtype = dtype_to_dlpack(buffer.dtype());
  t.shape = ctx.shape.data();
  t.strides = nullptr;
  ctx.tensor.manager_ctx = &ctx;
}

}  // namespace

DLDevice dlpack_device(const Device& device) {
  return {device.backend()->dlpack_device_type(), device.backend()->device_ordinal()};
}

Buffer buffer_from_dlpack(const Device& device, DLManagedTensor* tensor) {
  if (tensor == nullptr) throw InvalidArgument("from_dlpack: null tensor");
  // A legacy capsule cannot say read-only. One that routemm exported keeps its storage's flag;
  // any other producer's tensor is writable, as the legacy protocol implies.
  bool writable = true;
  if (tensor->deleter == &delete_legacy_export) {
    writable =
        static_cast<ExportContext<DLManagedTensor>*>(tensor->manager_ctx)->storage->writable();
  }
  return wrap(device, tensor->dl_tensor, writable, [tensor] {
    if (tensor->deleter != nullptr) tensor->deleter(tensor);
  });
}

Buffer buffer_from_dlpack(const Device& device, DLManagedTensorVersioned* tensor) {
  if (tensor == nullptr) throw InvalidArgument("from_dlpack: null tensor");
  if (tensor->version.major != 1) {
    throw InvalidArgument("from_dlpack: unsupported DLPack major version " +
                          std::to_string(tensor->version.major));
  }
  const bool writable = (tensor->flags & kRoutemmDLFlagReadOnly) == 0;
  return wrap(device, tensor->dl_tensor, writable, [tensor] {
    if (tensor->deleter != nullptr) tensor->deleter(tensor);
  });
}

DLManagedTensor* buffer_to_dlpack(const Buffer& buffer) {
  if (!buffer.valid()) throw InvalidArgument("to_dlpack: empty buffer");
  auto ctx = std::make_unique<ExportContext<DLManagedTensor>>();
  describe(buffer, *ctx);
  ctx->tensor.deleter = &delete_legacy_export;
  return &ctx.release()->tensor;
}

DLManagedTensorVersioned* buffer_to_dlpack_versioned(const Buffer& buffer) {
  if (!buffer.valid()) throw InvalidArgument("to_dlpack: empty buffer");
  auto ctx = std::make_unique<ExportContext<DLManagedTensorVersioned>>();
  describe(buffer, *ctx);
  ctx->tensor.version = {kRoutemmDLPackMajorVersion, kRoutemmDLPackMinorVersion};
  ctx->tensor.flags = buffer.writable() ? 0 : kRoutemmDLFlagReadOnly;
  ctx->tensor.deleter = &delete_versioned_export;
  return &ctx.release()->tensor;
}

}  // namespace routemm
