// The store of a Q4_0 CTA's output tile, shared by the warp-MMA kernels (q4_matmul.cu) and the
// Hopper kernel (q4_matmul_wgmma.cu), so both reduce a K split in the same fixed order.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace routemm::cuda {

// Stores a kRows x kTokens output tile whose top-left element is output[tok0 * n + row0].
// `for_each(store)` calls store(r, k, value) for each of the thread's accumulators (tile row r, tile
// token k). Without a K split (gridDim.z == 1) the valid ones go straight to the output. With one
// (gridDim.z CTAs, one cluster along z) every CTA parks its partial tile [token][row] (kStride
// floats per token) at `smem` -- the caller's pipeline buffers, free by then -- and CTA `rank` sums
// slice `rank` of the tile over the splits in increasing split order, a fixed order, so the result
// depends on (m, n, k) only, and stores it. Every thread of every CTA of the cluster must call it.
template <int kRows, int kTokens, int kThreads, int kStride, class ForEach>
__device__ __forceinline__ void store_q4_tile(float* output, int n, void* smem, int row0, int tok0,
                                              int rows_valid, int toks_valid, ForEach for_each) {
  if (gridDim.z == 1) {
    for_each([&](int r, int k, float v) {
      if (r < rows_valid && k < toks_valid) output[uint64_t(tok0 + k) * n + row0 + r] = v;
    });
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  static_assert(kStride >= kRows && kRows * kTokens % 8 == 0);
  __syncthreads();  // every warp is done with the pipeline's buffers before they are reused
  float* const partial = static_cast<float*>(smem);
  for_each([&](int r, int k, float v) { partial[k * kStride + r] = v; });
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int splits = static_cast<int>(gridDim.z);
  const int rank = static_cast<int>(cluster.block_rank());
  const int per = kRows * kTokens / splits;
  for (int e = rank * per + static_cast<int>(threadIdx.x); e < (rank + 1) * per; e += kThreads) {
    const int k = e / kRows, r = e % kRows;
    if (k >= toks_valid || r >= rows_valid) continue;
    const int at = k * kStride + r;
    float sum = cluster.map_shared_rank(partial, 0)[at];
    for (int s = 1; s < splits; ++s) sum += cluster.map_shared_rank(partial, s)[at];
    output[uint64_t(tok0 + k) * n + row0 + r] = sum;
  }
  cluster.sync();  // no CTA leaves while another still reads its partials
#else
  __trap();  // the host never splits K below sm_90 (KernelDef::k_split_max == 1)
#endif
}

// The launch configuration of a Q4_0 kernel whose grid.z is the K split: grid.z > 1 runs as
// clusters of grid.z CTAs along z, the cluster store_q4_tile reduces in. `attribute` holds the
// cluster dimension the configuration points at (it must outlive the launch or query).
inline cudaLaunchConfig_t k_split_config(dim3 grid, unsigned threads, size_t smem,
                                         cudaStream_t stream, cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute = cudaLaunchAttribute{};
  if (grid.z > 1) {
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = grid.z;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return config;
}

// Launches a Q4_0 kernel over k_split_config.
template <class... Params, class... Args>
cudaError_t launch_k_split(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem,
                           cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = k_split_config(grid, threads, smem, stream, attribute);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace routemm::cuda
