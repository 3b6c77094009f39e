// Backend discovery and Device.
#include "routemm/device.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "routemm/encoder.h"
#include "routemm/env.h"
#include "routemm/error.h"

namespace routemm {

// Defined by each backend folder (or its "not built" stub).
namespace cpu {
void register_cpu_backend();
}
namespace cuda {
void register_cuda_backend();
}
namespace metal {
void register_metal_backend();
}
namespace metal_emu {
void register_metal_emu_backend();
}

namespace {

std::vector<BackendEntry>& entries_storage() {
  static std::vector<BackendEntry> entries;
  return entries;
}

std::once_flag& builtin_once() {
  static std::once_flag flag;
  return flag;
}

void register_builtin_backends() {
  std::call_once(builtin_once(), [] {
    cpu::register_cpu_backend();
    cuda::register_cuda_backend();
    metal::register_metal_backend();
    metal_emu::register_metal_emu_backend();
  });
}

const BackendEntry& find_entry(const std::string& name) {
  for (const auto& entry : backend_entries()) {
    if (entry.name == name) return entry;
  }
  std::string known;
  for (const auto& entry : backend_entries()) known += (known.empty() ? "" : ", ") + entry.name;
  throw InvalidArgument("unknown backend '" + name + "' (known: " + known + ")");
}

std::shared_ptr<Backend> open_backend(const std::string& name) {
  const BackendEntry& entry = find_entry(name);
  if (const std::string reason = entry.probe(); !reason.empty()) {
    throw Error("backend '" + name + "' is unavailable: " + reason);
  }
  return entry.open();
}

}  // namespace

void register_backend(BackendEntry entry) {
  auto& entries = entries_storage();
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [&](const BackendEntry& e) { return e.name == entry.name; }),
                entries.end());
  entries.push_back(std::move(entry));
  std::stable_sort(
      entries.begin(), entries.end(),
      [](const BackendEntry& a, const BackendEntry& b) { return a.priority > b.priority; });
}

const std::vector<BackendEntry>& backend_entries() {
  register_builtin_backends();
  return entries_storage();
}

std::vector<BackendStatus> backend_status() {
  std::vector<BackendStatus> out;
  for (const auto& entry : backend_entries()) {
    std::string reason;
    try {
      reason = entry.probe();
    } catch (const std::exception& error) {
      reason = error.what();
    }
    out.push_back({entry.name, reason.empty(), reason});
  }
  return out;
}

std::vector<std::string> available_backends() {
  std::vector<std::string> out;
  for (const auto& status : backend_status()) {
    if (status.available) out.push_back(status.name);
  }
  return out;
}

Device::Device(std::optional<std::string> backend) {
  if (!backend) backend = env::backend();
  if (!backend) {
    const auto names = available_backends();
    if (names.empty()) throw Error("no backend is available");
    backend = names.front();
  }
  backend_ = open_backend(*backend);
}

Device::Device(std::shared_ptr<Backend> backend) : backend_(std::move(backend)) {
  if (!backend_) throw InvalidArgument("Device needs a backend");
}

std::string Device::backend_name() const { return std::string(backend_->name()); }
std::string Device::name() const { return backend_->device_name(); }
uint64_t Device::registry_id() const { return backend_->registry_id(); }

Buffer Device::alloc(uint64_t nbytes, DType dtype, std::vector<uint64_t> shape) const {
  // No address space holds more than PTRDIFF_MAX bytes at once; a larger request is a wrong size,
  // not a lack of memory. Backends round the size up with checked arithmetic as well.
  if (nbytes > static_cast<uint64_t>(PTRDIFF_MAX)) {
    throw InvalidArgument("alloc of " + std::to_string(nbytes) +
                          " bytes exceeds the largest possible allocation");
  }
  auto storage = backend_->allocate(nbytes);
  return Buffer(std::move(storage), 0, nbytes, dtype, std::move(shape));
}

CommandEncoder Device::command_encoder() const { return CommandEncoder(backend_); }

CommandEncoder Device::command_encoder(EncoderOptions options) const {
  return CommandEncoder(backend_, std::move(options));
}

KernelDef Backend::compile_kernel_source(const std::string& name, const std::string& source) {
  (void)source;
  throw InvalidArgument("register_source: backend '" + std::string(this->name()) +
                        "' compiles no kernel source at run time (its kernels are built in); "
                        "cannot register '" +
                        name + "'");
}

}  // namespace routemm
