// Linked when the Metal backend is not built: the backend is listed, and reports why it is missing.
#include <string>

#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::metal {

void register_metal_backend() {
  register_backend(BackendEntry{
      "metal", 10,
      [] { return std::string("not built (macOS only, configure with ROUTEMM_METAL=ON)"); },
      []() -> std::shared_ptr<Backend> { throw Error("backend 'metal' is not built"); }});
}

}  // namespace routemm::metal
