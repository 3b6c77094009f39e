// Linked when the Metal execution model is not built: the backend is listed, and reports why.
#include <string>

#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::metal_emu {

void register_metal_emu_backend() {
  register_backend(BackendEntry{
      "metal_emu", -10,
      [] {
        return std::string(
            "not built (a test backend: metal/*.metal on a CPU model of Metal; configure with "
            "ROUTEMM_METAL_EMU=ON)");
      },
      []() -> std::shared_ptr<Backend> { throw Error("backend 'metal_emu' is not built"); }});
}

}  // namespace routemm::metal_emu
