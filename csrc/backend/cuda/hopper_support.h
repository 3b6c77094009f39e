// What the Hopper (sm_90a) kernels need from the host: whether they can run on a device, the
// multiprocessor count their one-wave grids are sized by, the TMA descriptor encoder, and a
// stream-ordered workspace for kernels that stage operands in global memory. Shared by the
// expert-ID (dense_matmul_id.cu, dense_matmul_id_wgmma.cu) and Q4_0 (q4_matmul_wgmma.cu,
// q4_matvec_rows.cu) launchers.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace routemm::cuda {

// Multiprocessors of the current device, asked once per device (grids sized to one wave). Throws a
// routemm::Error naming `label` when there is no current device or the count cannot be read.
uint32_t multiprocessors(const std::string& label);

// True when this build carries the sm_90a image, `device` is compute capability 9.0 (where that
// image runs) and the driver can encode TMA descriptors. Answered once per device.
bool hopper_kernels_available(int device);

// Whether the quantised expert-ID direct kernel takes its bulk-copy data path for operands that
// allow it: the current device runs the sm_90a image and ROUTEMM_CUDA_DIRECT_PATH does not ask for
// the load path. Both paths give the same bits.
bool expert_direct_bulk_path();

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda), or
// nullptr where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// A 2-D TMA descriptor of `data`: `outer` rows of `inner` elements of `type`, rows
// `row_stride_bytes` apart, boxes of box_inner x box_outer, L2 promotion of 256 bytes, out-of-bounds
// elements read as zeros. Throws a routemm::Error naming `label` and `what` when the driver lacks the
// encoder or refuses the description.
CUtensorMap encode_tensor_map_2d(const std::string& label, const char* what,
                                 CUtensorMapDataType type, void* data, uint64_t inner,
                                 uint64_t outer, uint64_t row_stride_bytes, uint32_t box_inner,
                                 uint32_t box_outer, CUtensorMapSwizzle swizzle);

// `bytes` of device memory ordered on `stream`: allocated from a per-device pool (which keeps its
// memory between calls, so steady-state use costs no driver allocation) and freed on the same
// stream when this object goes away, after every kernel launched before that point. Throws a
// routemm::Error naming `label` when the allocation fails; nothing is launched then.
class StreamWorkspace {
 public:
  StreamWorkspace(const std::string& label, size_t bytes, cudaStream_t stream);
  ~StreamWorkspace();
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace routemm::cuda
