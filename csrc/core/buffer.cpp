// Storage lifetime, buffer views and host copies.
#include "routemm/buffer.h"

#include <cstdio>
#include <string>

#include "routemm/error.h"

namespace routemm {

Storage::Storage(std::shared_ptr<Backend> backend, void* data, size_t nbytes, bool writable,
                 std::function<void()> release, bool file_backed)
    : backend_(std::move(backend)),
      data_(data),
      nbytes_(nbytes),
      writable_(writable),
      release_(std::move(release)),
      file_backed_(file_backed) {}

Storage::~Storage() {
  if (release_) {
    release_();
  } else if (data_ != nullptr) {
    backend_->deallocate(data_, nbytes_);
  }
}

namespace {

uint64_t checked_element_count(const std::vector<uint64_t>& shape) {
  uint64_t count = 1;
  for (const uint64_t dim : shape) {
    if (dim != 0 && count > UINT64_MAX / dim)
      throw InvalidArgument("buffer shape element count overflows");
    count *= dim;
  }
  return count;
}

void check_shape(uint64_t nbytes, DType dtype, const std::vector<uint64_t>& shape) {
  const uint64_t size = dtype_size(dtype);
  if (nbytes % size != 0) {
    throw InvalidArgument("buffer of " + std::to_string(nbytes) +
                          " bytes is not a whole number of " + std::string(dtype_name(dtype)) +
                          " elements");
  }
  if (!shape.empty() && checked_element_count(shape) != nbytes / size) {
    throw InvalidArgument("buffer shape holds " + std::to_string(checked_element_count(shape)) +
                          " elements but " + std::to_string(nbytes) + " bytes of " +
                          std::string(dtype_name(dtype)) + " hold " +
                          std::to_string(nbytes / size));
  }
}

}  // namespace

Buffer::Buffer(std::shared_ptr<Storage> storage, uint64_t byte_offset, uint64_t nbytes, DType dtype,
               std::vector<uint64_t> shape)
    : storage_(std::move(storage)),
      byte_offset_(byte_offset),
      nbytes_(nbytes),
      dtype_(dtype),
      shape_(std::move(shape)) {
  if (!storage_) throw InvalidArgument("buffer needs a storage");
  if (byte_offset_ > storage_->nbytes() || nbytes_ > storage_->nbytes() - byte_offset_) {
    throw InvalidArgument("buffer range [" + std::to_string(byte_offset_) + ", +" +
                          std::to_string(nbytes_) + ") exceeds its " +
                          std::to_string(storage_->nbytes()) + "-byte allocation");
  }
  check_shape(nbytes_, dtype_, shape_);
  if (shape_.empty()) shape_ = {nbytes_ / dtype_size(dtype_)};
}

Buffer Buffer::view(uint64_t byte_offset, uint64_t nbytes, DType dtype,
                    std::vector<uint64_t> shape) const {
  if (!storage_) throw InvalidArgument("view of an empty buffer");
  if (byte_offset > nbytes_ || nbytes > nbytes_ - byte_offset) {
    throw InvalidArgument("view [" + std::to_string(byte_offset) + ", +" + std::to_string(nbytes) +
                          ") exceeds the parent's " + std::to_string(nbytes_) + " logical bytes");
  }
  return Buffer(storage_, byte_offset_ + byte_offset, nbytes, dtype, std::move(shape));
}

const std::shared_ptr<Backend>& Buffer::backend() const {
  if (!storage_) throw InvalidArgument("empty buffer has no backend");
  return storage_->backend();
}

uint64_t Buffer::address() const {
  return storage_ ? reinterpret_cast<uint64_t>(storage_->data()) : 0;
}

bool Buffer::writable() const { return storage_ && storage_->writable(); }

void* Buffer::data() const {
  return storage_ ? static_cast<char*>(storage_->data()) + byte_offset_ : nullptr;
}

std::pair<uint64_t, uint64_t> Buffer::logical_range() const {
  const uint64_t start = address() + byte_offset_;
  return {start, start + nbytes_};
}

std::string misalignment(const Buffer& buffer, uint64_t alignment) {
  const uint64_t offset = buffer.byte_offset();
  const uint64_t start = buffer.address() + offset;
  if (start % alignment == 0) return {};
  if (buffer.address() % alignment == 0) return "byte offset " + std::to_string(offset);
  char hex[19];
  std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(start));
  return "start address " + std::string(hex) + " (byte offset " + std::to_string(offset) + ")";
}

void Buffer::copy_from_host(const void* src, uint64_t nbytes) {
  if (nbytes != nbytes_) {
    throw InvalidArgument("copy of " + std::to_string(nbytes) + " bytes into a " +
                          std::to_string(nbytes_) + "-byte buffer");
  }
  if (!writable()) throw InvalidArgument("cannot write a read-only buffer");
  backend()->copy_from_host(data(), src, nbytes);
}

void Buffer::copy_to_host(void* dst, uint64_t nbytes) const {
  if (nbytes != nbytes_) {
    throw InvalidArgument("copy of " + std::to_string(nbytes) + " bytes out of a " +
                          std::to_string(nbytes_) + "-byte buffer");
  }
  backend()->copy_to_host(dst, data(), nbytes);
}

}  // namespace routemm
