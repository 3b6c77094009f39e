// Device: one backend's device, opened by name or by preference (cuda > metal > cpu).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "routemm/backend.h"
#include "routemm/buffer.h"

namespace routemm {

class CommandEncoder;
struct EncoderOptions;

struct BackendStatus {
  std::string name;
  bool available = false;
  std::string reason;  // why not, when unavailable
};

// Every backend known to this build, available or not, in preference order.
std::vector<BackendStatus> backend_status();
// Names of the backends that can open a device here, in preference order.
std::vector<std::string> available_backends();

class Device {
 public:
  // nullopt: ROUTEMM_BACKEND if set, else the best available backend.
  explicit Device(std::optional<std::string> backend = std::nullopt);
  explicit Device(std::shared_ptr<Backend> backend);

  const std::shared_ptr<Backend>& backend() const { return backend_; }
  std::string backend_name() const;
  std::string name() const;
  uint64_t registry_id() const;

  Buffer alloc(uint64_t nbytes, DType dtype, std::vector<uint64_t> shape) const;
  // An encoder on this device's queue, or on a caller's stream (EncoderOptions::stream).
  CommandEncoder command_encoder(EncoderOptions options) const;
  CommandEncoder command_encoder() const;

  bool operator==(const Device& other) const { return backend_ == other.backend_; }

 private:
  std::shared_ptr<Backend> backend_;
};

}  // namespace routemm
