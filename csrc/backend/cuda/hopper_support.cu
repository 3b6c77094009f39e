// Host side of the Hopper kernels (hopper_support.h).
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "hopper_support.h"
#include "routemm/env.h"
#include "routemm/error.h"
#include "smem_opt_in.h"

namespace routemm::cuda {

uint32_t multiprocessors(const std::string& label) {
  static std::atomic<uint32_t> known[kMaxOptInDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxOptInDevices) {
    throw Error(label + ": no current CUDA device");
  }
  uint32_t sms = known[device].load(std::memory_order_relaxed);
  if (sms == 0) {
    int value = 0;
    if (const cudaError_t e =
            cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device);
        e != cudaSuccess || value <= 0) {
      throw Error(label + ": cannot read the multiprocessor count: " + cudaGetErrorString(e));
    }
    sms = static_cast<uint32_t>(value);
    known[device].store(sms, std::memory_order_relaxed);
  }
  return sms;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

CUtensorMap encode_tensor_map_2d(const std::string& label, const char* what,
                                 CUtensorMapDataType type, void* data, uint64_t inner,
                                 uint64_t outer, uint64_t row_stride_bytes, uint32_t box_inner,
                                 uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) throw Error("'" + label + "': cuTensorMapEncodeTiled is unavailable");
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(&map, type, 2, data, dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error("'" + label + "': cannot describe the " + what + " for TMA (CUresult " +
                std::to_string(static_cast<int>(r)) + ")");
  }
  return map;
}

bool hopper_kernels_available(int device) {
#if defined(ROUTEMM_CUDA_HAS_SM90A)
  // Asked on every launch of the routes with a Hopper kernel: answered once per device (0 unknown,
  // 1 no, 2 yes).
  static std::atomic<int> known[kMaxOptInDevices];
  if (device < 0 || device >= kMaxOptInDevices) return false;
  if (const int v = known[device].load(std::memory_order_acquire); v != 0) return v == 2;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;  // not cached: a later call may find the device
  }
  const bool yes = major == 9 && minor == 0 && tensor_map_encoder() != nullptr;
  known[device].store(yes ? 2 : 1, std::memory_order_release);
  return yes;
#else
  (void)device;
  return false;
#endif
}

bool expert_direct_bulk_path() {
  const auto path = env::cuda_direct_path();
  if (path && *path == "loads") return false;
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess && hopper_kernels_available(device);
}

namespace {

// The workspace pool of `device`, created on first use. Its release threshold is unbounded: memory
// freed into it stays reserved for the next call instead of going back to the driver at every
// synchronisation (the pool holds at most the largest workspace in use at once).
cudaMemPool_t workspace_pool(const std::string& label, int device) {
  static std::mutex mutex;
  static cudaMemPool_t pools[kMaxOptInDevices] = {};
  if (device < 0 || device >= kMaxOptInDevices) throw Error("'" + label + "': bad CUDA device");
  const std::lock_guard<std::mutex> lock(mutex);
  if (pools[device] != nullptr) return pools[device];
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (const cudaError_t e = cudaMemPoolCreate(&pool, &props); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("'" + label + "': cannot create a workspace pool: " + cudaGetErrorString(e));
  }
  uint64_t keep = UINT64_MAX;
  if (const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      e != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaMemPoolDestroy(pool);
    throw Error("'" + label + "': cannot configure the workspace pool: " + cudaGetErrorString(e));
  }
  pools[device] = pool;
  return pool;
}

}  // namespace

StreamWorkspace::StreamWorkspace(const std::string& label, size_t bytes, cudaStream_t stream)
    : stream_(stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("'" + label + "': no current CUDA device");
  }
  const cudaMemPool_t pool = workspace_pool(label, device);
  if (const cudaError_t e = cudaMallocFromPoolAsync(&data_, bytes == 0 ? 1 : bytes, pool, stream);
      e != cudaSuccess) {
    (void)cudaGetLastError();  // an allocation failure is not sticky; clear it
    throw Error("'" + label + "': cannot allocate a " + std::to_string(bytes) +
                "-byte workspace: " + cudaGetErrorString(e));
  }
}

StreamWorkspace::~StreamWorkspace() { (void)cudaFreeAsync(data_, stream_); }

}  // namespace routemm::cuda
