// The work list of the persistent grouped tensor-core kernels (dense_matmul_id_tensor.cu, and
// dense_matmul_id_wgmma.cu on sm_90a): work items are (expert, column tile, row tile) for the row
// tiles an expert actually holds (its count from the map dispatch, capped at m). Items run expert
// by expert, and within an expert column tile by column tile with its row tiles adjacent, so CTAs
// resident together share weight tiles and activation rows in L2.
#pragma once

#include <cstdint>

namespace routemm::cuda {

// The prefix lives in shared memory (4 bytes per expert); the kernels size it for up to this many
// experts, and their launchers refuse more.
inline constexpr uint32_t kMaxWorkListExperts = 4096;

// Fills prefix[0..n_experts] with the exclusive prefix sum over experts of their item counts
// (prefix[n_experts] = total items). Every thread of the CTA calls it; it ends with a CTA barrier.
// kThreads: the CTA's thread count (a multiple of 32).
template <uint32_t kThreads>
__device__ __forceinline__ void build_item_prefix(const uint32_t* __restrict__ counts, uint32_t m,
                                                  uint32_t n_experts, uint32_t tile_rows,
                                                  uint32_t col_tiles, uint32_t* prefix) {
  __shared__ uint32_t warp_sums[kThreads / 32];
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t per = (n_experts + kThreads - 1) / kThreads;
  const uint32_t e0 = min(tid * per, n_experts), e1 = min(e0 + per, n_experts);
  const auto items_of = [&](uint32_t e) {
    return (min(counts[e], m) + tile_rows - 1) / tile_rows * col_tiles;
  };
  uint32_t local = 0;
  for (uint32_t e = e0; e < e1; ++e) local += items_of(e);
  uint32_t incl = local;
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  uint32_t base = 0;
  for (uint32_t w = 0; w < warp; ++w) base += warp_sums[w];
  uint32_t run = base + incl - local;
  for (uint32_t e = e0; e < e1; ++e) {
    prefix[e] = run;
    run += items_of(e);
  }
  if (tid == kThreads - 1) prefix[n_experts] = base + incl;
  __syncthreads();
}

// One work item, decoded: its expert, first column, first routed row (within the expert's list)
// and the number of routed rows it covers (1..tile_rows).
struct WorkItem {
  uint32_t expert, col0, row0, rows;
};

// Item `item` (< prefix[n_experts]) of the list built by build_item_prefix. With `balanced`, an
// expert's row tiles share its rows evenly (sizes differ by at most one) instead of full tiles and
// a remainder; the number of tiles is the same.
__device__ __forceinline__ WorkItem decode_item(uint32_t item, const uint32_t* prefix,
                                                const uint32_t* __restrict__ counts, uint32_t m,
                                                uint32_t n_experts, uint32_t tile_rows,
                                                uint32_t tile_cols, bool balanced = false) {
  uint32_t lo = 0, hi = n_experts;  // prefix[lo] <= item < prefix[hi]
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) >> 1;
    if (prefix[mid] <= item)
      lo = mid;
    else
      hi = mid;
  }
  const uint32_t count = min(counts[lo], m);
  const uint32_t row_tiles = (count + tile_rows - 1) / tile_rows;
  const uint32_t local = item - prefix[lo];
  const uint32_t col0 = (local / row_tiles) * tile_cols, tile = local % row_tiles;
  if (balanced) {
    const uint32_t base = count / row_tiles, extra = count % row_tiles;
    return WorkItem{lo, col0, tile * base + min(tile, extra), base + (tile < extra ? 1u : 0u)};
  }
  const uint32_t row0 = tile * tile_rows;
  return WorkItem{lo, col0, row0, min(tile_rows, count - row0)};
}

}  // namespace routemm::cuda
