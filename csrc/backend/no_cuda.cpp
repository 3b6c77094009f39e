// Linked when the CUDA backend is not built: the backend is listed, and reports why it is missing.
#include <string>

#include "routemm/backend.h"
#include "routemm/error.h"

namespace routemm::cuda {

void register_cuda_backend() {
  register_backend(BackendEntry{
      "cuda", 20,
      [] { return std::string("not built (configure with ROUTEMM_CUDA=ON and a CUDA toolkit)"); },
      []() -> std::shared_ptr<Backend> { throw Error("backend 'cuda' is not built"); }});
}

}  // namespace routemm::cuda
