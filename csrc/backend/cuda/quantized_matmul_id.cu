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
//            block and step, each weight value read once for the 8 rows (an expert holding more
//            than m rows, when ids repeat within a token, loops over its segment).
// DATA PATH: the block's 16 weight rows stream through shared memory kStageBlocks blocks at a time,
//   copied by all 128 threads with coalesced 16-byte loads when the rows are 16-byte aligned (2-byte
//   loads otherwise: GGUF blocks are only 2-byte aligned); the lanes then run the lane contract from
//   shared memory. Each lane's FMAs keep their order (blocks ascending), so staging changes no bit.
//   Before staging every lane fetched its own 2 bytes per block value pair from global memory: the
//   loads, not the bytes, bounded the kernel (Qwen3-30B-A3B Q4_0 m = 1: 18.6 us for 7 MB).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
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
constexpr uint32_t kStageBlocks = 32;        // blocks of each weight row per shared-memory stage

// Shared-memory pitch of one staged weight row (a multiple of 16 bytes for both formats).
template <class F>
__host__ __device__ constexpr uint32_t stage_pitch() {
  return kStageBlocks * F::kBytes;
}
static_assert(stage_pitch<ggml::Q4_0Blocks>() % 16 == 0 &&
              stage_pitch<ggml::Q8_0Blocks>() % 16 == 0);

// Copies blocks [b0, b0 + nb) of the tile's first `rows` weight rows (row r at first_row + r *
// row_bytes) into `stage` (row r at r * stage_pitch), with every thread of the block. `aligned`:
// first_row and row_bytes are multiples of 16, so a stage whose bytes per row are too goes in 16-byte
// units; anything else in 2-byte units (the blocks' own alignment).
template <class F>
__device__ __forceinline__ void stage_rows(uint8_t* __restrict__ stage,
                                           const uint8_t* __restrict__ first_row,
                                           uint64_t row_bytes, uint32_t rows, uint32_t b0,
                                           uint32_t nb, bool aligned) {
  const uint32_t seg = nb * F::kBytes;
  const uint8_t* src = first_row + uint64_t{b0} * F::kBytes;
  if (aligned && seg % 16 == 0) {
    const uint32_t units = seg / 16;
    for (uint32_t i = threadIdx.x; i < rows * units; i += kThreads) {
      const uint32_t r = i / units, u = i - r * units;
      const auto* from = reinterpret_cast<const uint4*>(src + r * row_bytes + u * 16);
      *reinterpret_cast<uint4*>(stage + r * stage_pitch<F>() + u * 16) = __ldg(from);
    }
  } else {
    const uint32_t units = seg / 2;
    for (uint32_t i = threadIdx.x; i < rows * units; i += kThreads) {
      const uint32_t r = i / units, u = i - r * units;
      const auto* from = reinterpret_cast<const uint16_t*>(src + r * row_bytes + u * 2);
      *reinterpret_cast<uint16_t*>(stage + r * stage_pitch<F>() + u * 2) = __ldg(from);
    }
  }
}

// The lane contract (ggml::lane_dot) over a whole weight row, the row read through the shared
// stage: lane `lane` of tile column `column` accumulates R input rows. Every thread of the block
// calls it (it synchronises); columns at or past `rows` (past n) stage and compute nothing.
template <class F, int R>
__device__ __forceinline__ void staged_lane_dot(uint8_t* __restrict__ stage,
                                                const uint8_t* __restrict__ first_row,
                                                uint64_t row_bytes, uint32_t rows, uint32_t k,
                                                bool aligned, uint32_t column,
                                                const float* const (&x)[R], uint32_t lane,
                                                float (&acc)[R]) {
  const uint32_t blocks = k / 32;
  for (uint32_t b0 = 0; b0 < blocks; b0 += kStageBlocks) {
    const uint32_t nb = min(kStageBlocks, blocks - b0);
    __syncthreads();  // the previous stage is consumed
    stage_rows<F>(stage, first_row, row_bytes, rows, b0, nb, aligned);
    __syncthreads();
    if (column < rows) {
      const float* xs[R];
#pragma unroll
      for (int r = 0; r < R; ++r) xs[r] = x[r] + b0 * 32;
      ggml::lane_dot<F, R>(stage + column * stage_pitch<F>(), nb * 32, xs, lane, acc);
    }
  }
}

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
                  float* __restrict__ output, bool aligned) {
  __shared__ __align__(16) uint8_t stage[kColumns * stage_pitch<F>()];
  const uint32_t flat = blockIdx.y;
  const uint32_t lane = threadIdx.x & 7u;
  const uint32_t column = threadIdx.x / 8;
  const uint32_t col0 = blockIdx.x * kColumns;
  const uint32_t col = col0 + column;
  const uint32_t id = ids[flat];
  float* out = output + uint64_t{flat} * p.n;
  if (id >= p.n_experts) {  // invalid id: a zero row, no weight address formed
    if (lane == 0 && col < p.n) out[col] = 0.0f;
    return;  // uniform over the block: no barrier or shuffle follows
  }
  const uint64_t row_bytes = uint64_t{p.k} / 32 * F::kBytes;
  const uint32_t rows = min(kColumns, p.n - col0);
  const uint8_t* first_row = weights + uint64_t{id} * p.expert_stride_bytes + col0 * row_bytes;
  const float* x[1] = {input_row(p, input, flat)};
  float acc[1] = {0.0f};
  staged_lane_dot<F, 1>(stage, first_row, row_bytes, rows, p.k, aligned, column, x, lane, acc);
  // Columns past n took no part in the dot (acc 0) but join the shuffles, and store nothing.
  const float sum = ggml::sum8(acc[0]);
  if (lane == 0 && col < p.n) out[col] = sum;
}

template <class F>
__global__ void __launch_bounds__(kThreads)
    grouped_kernel(const DenseMatmulIdKernelParams p, const uint8_t* __restrict__ weights,
                   const unsigned char* __restrict__ input, const uint32_t* __restrict__ counts,
                   const uint32_t* __restrict__ routed, float* __restrict__ output, bool aligned) {
  __shared__ __align__(16) uint8_t stage[kColumns * stage_pitch<F>()];
  const uint32_t expert = blockIdx.z;
  // The map's list: expert e's flat rows are the segment routed[start, start + counts[e]), start
  // the counts of the experts before it (a segment can hold more than m rows when ids repeat
  // within a token). A stale or foreign scratch is clamped to the m * top_k flat rows.
  const uint32_t total = p.m * p.top_k;
  uint64_t start = 0;
  for (uint32_t e = 0; e < expert; ++e) start += counts[e];
  if (start >= total) return;  // uniform over the block
  const auto count = static_cast<uint32_t>(min(uint64_t{counts[expert]}, total - start));
  const uint32_t lane = threadIdx.x & 7u;
  const uint32_t column = threadIdx.x / 8;
  const uint32_t col0 = blockIdx.y * kColumns;
  const uint32_t col = col0 + column;
  const uint64_t row_bytes = uint64_t{p.k} / 32 * F::kBytes;
  const uint32_t tile_rows = min(kColumns, p.n - col0);
  const uint8_t* first_row = weights + uint64_t{expert} * p.expert_stride_bytes + col0 * row_bytes;
  // grid.x covers m rows per expert; an expert holding more (repeated ids) loops over the rest.
  for (uint32_t first = blockIdx.x * kGroupRows; first < count; first += gridDim.x * kGroupRows) {
    const uint32_t rows = min(kGroupRows, count - first);
    const uint32_t* list = routed + start + first;
    uint32_t flats[kGroupRows];
    const float* x[kGroupRows];
    for (uint32_t r = 0; r < kGroupRows; ++r) {
      // Rows past the tile repeat its first row (same values, never stored); a routed index out
      // of range (a stale or foreign scratch) is treated the same way instead of read.
      const uint32_t flat = r < rows ? list[r] : list[0];
      flats[r] = flat < total ? flat : total;
      x[r] = input_row(p, input, flat < total ? flat : 0);
    }
    float acc[kGroupRows] = {};
    staged_lane_dot<F, kGroupRows>(stage, first_row, row_bytes, tile_rows, p.k, aligned, column, x,
                                   lane, acc);
    for (uint32_t r = 0; r < kGroupRows; ++r) {
      const float sum = ggml::sum8(acc[r]);
      if (lane == 0 && col < p.n && r < rows && flats[r] < total) {
        output[uint64_t{flats[r]} * p.n + col] = sum;
      }
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

// True when every weight row starts 16-byte aligned (the base, the expert stride and the row size
// are multiples of 16), so the stages may copy in 16-byte units.
template <class F>
bool rows_aligned16(const DenseMatmulIdKernelParams& p, const uint8_t* weights) {
  const uint64_t row_bytes = uint64_t{p.k} / 32 * F::kBytes;
  return reinterpret_cast<uintptr_t>(weights) % 16 == 0 && p.expert_stride_bytes % 16 == 0 &&
         row_bytes % 16 == 0;
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
  direct_kernel<F><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, w, x, ids, out, rows_aligned16<F>(p, w));
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
  grouped_kernel<F><<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p, w, x, counts, routed, out, rows_aligned16<F>(p, w));
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
  d.check_args = kernels::kernel_arg_contract(name);
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
