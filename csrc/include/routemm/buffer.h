// Buffer: a logical view (byte_offset, nbytes, dtype, shape) over a backend Storage.
// Views share storage; all validation uses [address + byte_offset, address + byte_offset + nbytes).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "routemm/backend.h"
#include "routemm/dtype.h"

namespace routemm {

class Buffer {
 public:
  Buffer() = default;
  Buffer(std::shared_ptr<Storage> storage, uint64_t byte_offset, uint64_t nbytes, DType dtype,
         std::vector<uint64_t> shape);

  // A view relative to this one's logical start; nested views compose. The view must lie inside
  // this buffer's logical range, and the shape (when given) must cover exactly nbytes.
  Buffer view(uint64_t byte_offset, uint64_t nbytes, DType dtype,
              std::vector<uint64_t> shape) const;

  bool valid() const { return storage_ != nullptr; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  const std::shared_ptr<Backend>& backend() const;
  // Base address of the whole allocation (not including byte_offset).
  uint64_t address() const;
  uint64_t byte_offset() const { return byte_offset_; }
  uint64_t nbytes() const { return nbytes_; }
  DType dtype() const { return dtype_; }
  const std::vector<uint64_t>& shape() const { return shape_; }
  bool writable() const;
  // Device pointer to the first logical byte.
  void* data() const;

  // [address + byte_offset, address + byte_offset + nbytes)
  std::pair<uint64_t, uint64_t> logical_range() const;

  void copy_from_host(const void* src, uint64_t nbytes);
  void copy_to_host(void* dst, uint64_t nbytes) const;

 private:
  std::shared_ptr<Storage> storage_;
  uint64_t byte_offset_ = 0;
  uint64_t nbytes_ = 0;
  DType dtype_ = DType::U8;
  std::vector<uint64_t> shape_;
};

// How the first logical byte of `buffer` -- allocation address plus byte offset, the byte a kernel
// binding starts at -- misses a multiple of `alignment` (nonzero): empty when it does not;
// "byte offset N" when the offset is what is misaligned; "start address 0x... (byte offset N)"
// when the allocation itself starts off the alignment (e.g. memory wrapped through DLPack). Op
// front doors check their operands with it before anything is encoded.
std::string misalignment(const Buffer& buffer, uint64_t alignment);

}  // namespace routemm
