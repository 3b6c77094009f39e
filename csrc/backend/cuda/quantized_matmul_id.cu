// CUDA kernels of the quantised expert-ID matmul (csrc/ops/quantized_matmul_id.cpp owns
// validation and geometry): quantized_matmul_id_direct_{q4_0,q8_0}_f32 and
// quantized_matmul_id_grouped_{q4_0,q8_0}_f32 (the map is dense_matmul_id's).
//
// NUMERICS: the exact route of the CPU oracle (ggml_blocks.cuh's lane contract), so both kernels
// are bit-identical to each other and to the CPU backend.
// GEOMETRY: 128 threads = 16 output columns x 8 lanes.
//   direct   grid [ceil(n / 16), m * top_k, 1]: one flat row per block; the block streams the
//            16 weight rows of that row's expert (an invalid id writes zeros, reads no weight).
//   grouped  grid [ceil(m / 8), ceil(n / 16), n_experts]: up to 8 routed rows of one expert per
//            block, each weight value read once for the 8 rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/launch_args.h"
#include "ggml_blocks.cuh"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/quantized_matmul_id.h"

#ifndef ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256
#define ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kThreads = 128;
constexpr uint32_t kColumns = kThreads / 8;  // output columns per block
constexpr uint32_t kGroupRows = 8;           // routed rows per grouped block

__device__ __forceinline__ const float* input_row(const DenseMatmulIdKernelParams& p,
                                                  const unsigned char* input, uint32_t flat) {
  const uint32_t token = flat / p.top_k, slot = flat - token * p.top_k;
  return reinterpret_cast<const float*>(input + uint64_t{token} * p.input_token_stride_bytes +
                                        uint64_t{slot} * p.input_slot_stride_bytes);
}

template <class F>
__global__ void __launch_bounds__(kThreads)
    direct_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                  const unsigned char* __restrict__ input, const uint32_t* __restrict__ ids,
                  float* __restrict__ output) {
  const uint32_t flat = blockIdx.y;
  const uint32_t lane = threadIdx.x & 7u;
  const uint32_t col = blockIdx.x * kColumns + threadIdx.x / 8;
  const uint32_t id = ids[flat];
  float* out = output + uint64_t{flat} * p.n;
  if (id >= p.n_experts) {  // invalid id: a zero row, no weight address formed
    if (lane == 0 && col < p.n) out[col] = 0.0f;
    return;  // uniform over the block: no shuffle follows
  }
  const uint64_t row_bytes = uint64_t{p.k} / 32 * F::kBytes;
  // Columns past n compute on the last row (every lane must join the shuffles) and store nothing.
  const uint32_t read_col = min(col, p.n - 1);
  const uint8_t* row = weights + uint64_t{id} * p.expert_stride_bytes + read_col * row_bytes;
  const float* x[1] = {input_row(p, input, flat)};
  float acc[1] = {0.0f};
  ggml::lane_dot<F, 1>(row, p.k, x, lane, acc);
  const float sum = ggml::sum8(acc[0]);
  if (lane == 0 && col < p.n) out[col] = sum;
}

template <class F>
__global__ void __launch_bounds__(kThreads)
    grouped_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                   const unsigned char* __restrict__ input, const uint32_t* __restrict__ counts,
                   const uint32_t* __restrict__ routed, float* __restrict__ output) {
  const uint32_t expert = blockIdx.z;
  const uint32_t count = min(counts[expert], p.m);
  const uint32_t first = blockIdx.x * kGroupRows;
  if (first >= count) return;  // uniform over the block
  const uint32_t rows = min(kGroupRows, count - first);
  const uint32_t lane = threadIdx.x & 7u;
  const uint32_t col = blockIdx.y * kColumns + threadIdx.x / 8;
  const uint32_t read_col = min(col, p.n - 1);
  const uint64_t row_bytes = uint64_t{p.k} / 32 * F::kBytes;
  const uint8_t* row = weights + uint64_t{expert} * p.expert_stride_bytes + read_col * row_bytes;
  const uint32_t* list = routed + uint64_t{expert} * p.m + first;
  const uint32_t total = p.m * p.top_k;
  uint32_t flats[kGroupRows];
  const float* x[kGroupRows];
  for (uint32_t r = 0; r < kGroupRows; ++r) {
    // Rows past the tile repeat its first row (same values, never stored); a routed index out of
    // range (a stale or foreign scratch) is treated the same way instead of read.
    const uint32_t flat = r < rows ? list[r] : list[0];
    flats[r] = flat < total ? flat : total;
    x[r] = input_row(p, input, flat < total ? flat : 0);
  }
  float acc[kGroupRows] = {};
  ggml::lane_dot<F, kGroupRows>(row, p.k, x, lane, acc);
  for (uint32_t r = 0; r < kGroupRows; ++r) {
    const float sum = ggml::sum8(acc[r]);
    if (lane == 0 && col < p.n && r < rows && flats[r] < total) {
      output[uint64_t{flats[r]} * p.n + col] = sum;
    }
  }
}

DenseMatmulIdKernelParams read_params(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0 || p.k % 32 != 0) {
    throw Error(launch.label + ": params have a zero extent or K that is not a multiple of 32");
  }
  return p;
}

// Bytes the kernels may read from the weight and input views (the front door validated them; this
// keeps a corrupt raw launch from reading past its buffers). Each factor is at most 2^32 after the
// front door's checks; products are formed in 64 bits.
template <class F>
uint64_t weight_extent(const DenseMatmulIdKernelParams& p) {
  return uint64_t{p.n_experts - 1} * p.expert_stride_bytes + uint64_t{p.n} * (p.k / 32) * F::kBytes;
}
uint64_t input_extent(const DenseMatmulIdKernelParams& p) {
  return uint64_t{p.m - 1} * p.input_token_stride_bytes +
         uint64_t{p.top_k - 1} * p.input_slot_stride_bytes + uint64_t{p.k} * 4;
}

void check(const KernelLaunch& launch, cudaError_t status) {
  if (status != cudaSuccess) {
    throw Error(launch.label + ": launch failed: " + std::string(cudaGetErrorString(status)));
  }
}

template <class F>
void launch_direct(const KernelLaunch& launch, void* stream) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  if (launch.grid.x != (p.n + kColumns - 1) / kColumns || launch.grid.y != rows ||
      launch.grid.z != 1 || rows > 0x7fffffffu) {
    throw Error(launch.label + ": launch grid does not match the direct geometry");
  }
  const auto* w = static_cast<const uint8_t*>(
      kernels::launch_arg(launch, 1, "weights", weight_extent<F>(p)).data);
  const auto* x = static_cast<const unsigned char*>(
      kernels::launch_arg(launch, 2, "input", input_extent(p)).data);
  const auto* ids =
      static_cast<const uint32_t*>(kernels::launch_arg(launch, 3, "expert ids", rows * 4).data);
  auto* out = static_cast<float*>(kernels::launch_arg(launch, 4, "output", rows * p.n * 4).data);
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(rows), 1);
  direct_kernel<F><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, w, x, ids, out);
  check(launch, cudaGetLastError());
}

template <class F>
void launch_grouped(const KernelLaunch& launch, void* stream) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  if (launch.grid.x != (p.m + kGroupRows - 1) / kGroupRows ||
      launch.grid.y != (p.n + kColumns - 1) / kColumns || launch.grid.z != p.n_experts ||
      p.n_experts > 65535) {
    throw Error(launch.label + ": launch grid does not match the grouped geometry");
  }
  const uint64_t rows = uint64_t{p.m} * p.top_k;
  const auto* w = static_cast<const uint8_t*>(
      kernels::launch_arg(launch, 1, "weights", weight_extent<F>(p)).data);
  const auto* x = static_cast<const unsigned char*>(
      kernels::launch_arg(launch, 2, "input", input_extent(p)).data);
  const auto* counts = static_cast<const uint32_t*>(
      kernels::launch_arg(launch, 3, "expert counts", uint64_t{p.n_experts} * 4).data);
  const auto* routed = static_cast<const uint32_t*>(
      kernels::launch_arg(launch, 4, "routed rows", uint64_t{p.n_experts} * p.m * 4).data);
  auto* out = static_cast<float*>(kernels::launch_arg(launch, 5, "output", rows * p.n * 4).data);
  const dim3 grid(static_cast<unsigned>(launch.grid.x), static_cast<unsigned>(launch.grid.y),
                  p.n_experts);
  grouped_kernel<F>
      <<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, w, x, counts, routed, out);
  check(launch, cudaGetLastError());
}

KernelDef def(std::string_view name, KernelFn fn, uint32_t tile_x, uint32_t tile_y) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.max_threads_per_threadgroup = 1024;
  d.threads_per_group = kThreads;
  d.tile_x = tile_x;
  d.tile_y = tile_y;
  d.threadgroup_memory_bytes = 0;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_QUANTIZED_MATMUL_ID_SHA256;
  return d;
}

}  // namespace

void add_quantized_matmul_id_kernels(std::vector<KernelDef>& out) {
  const auto& names = kGgmlQuantizedMatmulIdPipelineNames;
  out.push_back(def(names[0], launch_direct<ggml::Q4_0Blocks>, kColumns, 1));
  out.push_back(def(names[1], launch_direct<ggml::Q8_0Blocks>, kColumns, 1));
  out.push_back(def(names[2], launch_grouped<ggml::Q4_0Blocks>, kGroupRows, kColumns));
  out.push_back(def(names[3], launch_grouped<ggml::Q8_0Blocks>, kGroupRows, kColumns));
}

}  // namespace routemm::cuda
