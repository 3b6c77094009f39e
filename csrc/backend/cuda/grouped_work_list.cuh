// The work list of the persistent grouped kernels (dense_matmul_id.cu, dense_matmul_id_tensor.cu,
// and dense_matmul_id_wgmma.cu on sm_90a). The map dispatch leaves one routed list ordered by
// expert: expert e's flat rows are the segment routed[start[e], start[e + 1]), start[e] being the
// counts of the experts before it (an expert can hold more than m rows when ids repeat within a
// token). Work items are (expert, column tile, row tile) for the row tiles an expert actually
// holds. Items run expert by expert, and within an expert column tile by column tile with its row
// tiles adjacent, so CTAs resident together share weight tiles and activation rows in L2.
#pragma once

#include <cstdint>

namespace routemm::cuda {

// The list lives in shared memory: the item prefix and the segment starts, n_experts + 1 entries
// each. The kernels size it for up to this many experts, and their launchers refuse more.
inline constexpr uint32_t kMaxWorkListExperts = 4096;

__host__ __device__ constexpr uint64_t work_list_bytes(uint32_t n_experts) {
  return 2 * (uint64_t{n_experts} + 1) * 4;
}

// Entries the routed list can hold: every flat row once (m * top_k, saturated to u32).
__host__ __device__ constexpr uint32_t routed_capacity(uint32_t m, uint32_t top_k) {
  const uint64_t rows = uint64_t{m} * top_k;
  return rows > 0xFFFFFFFFu ? 0xFFFFFFFFu : static_cast<uint32_t>(rows);
}

__device__ __forceinline__ uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

// Exclusive prefix sum over the CTA of one value per thread; `total` gets the sum of all. Every
// thread calls it; it ends with a CTA barrier (so a second call may follow at once).
// kThreads: the CTA's thread count (a multiple of 32).
template <uint32_t kThreads, typename T>
__device__ __forceinline__ T block_exclusive_scan(T local, T& total) {
  __shared__ T warp_sums[kThreads / 32];
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  T incl = local;
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const T v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  T base = 0;
  total = 0;
  for (uint32_t w = 0; w < kThreads / 32; ++w) {
    if (w < warp) base += warp_sums[w];
    total += warp_sums[w];
  }
  __syncthreads();
  return base + incl - local;
}

// Fills list[0..n_experts] with the exclusive prefix sum over experts of their item counts
// (list[n_experts] = total items) and list[n_experts + 1 ..] with the segment starts
// start[0..n_experts]. `capacity` (m * top_k, every flat row once) bounds the routed list: counts
// from a stale or foreign scratch are clamped to it, so no item reads past the list. Every thread
// of the CTA calls it; it ends with a CTA barrier.
template <uint32_t kThreads>
__device__ __forceinline__ void build_work_list(const uint32_t* __restrict__ counts,
                                                uint32_t capacity, uint32_t n_experts,
                                                uint32_t tile_rows, uint32_t col_tiles,
                                                uint32_t* list) {
  uint32_t* const start = list + n_experts + 1;
  const uint32_t tid = threadIdx.x;
  const uint32_t per = (n_experts + kThreads - 1) / kThreads;
  const uint32_t e0 = min(tid * per, n_experts), e1 = min(e0 + per, n_experts);
  uint64_t rows_local = 0;
  for (uint32_t e = e0; e < e1; ++e) rows_local += min(counts[e], capacity);
  uint64_t rows_total = 0;
  const uint64_t rows_before = block_exclusive_scan<kThreads>(rows_local, rows_total);

  uint32_t items_local = 0;
  uint64_t run = rows_before;
  for (uint32_t e = e0; e < e1; ++e) {
    const uint64_t begin = min_u64(run, capacity);
    run += min(counts[e], capacity);
    const auto rows = static_cast<uint32_t>(min_u64(run, capacity) - begin);
    start[e] = static_cast<uint32_t>(begin);
    items_local += (rows + tile_rows - 1) / tile_rows * col_tiles;
  }
  uint32_t items_total = 0;
  uint32_t items_run = block_exclusive_scan<kThreads>(items_local, items_total);
  run = rows_before;
  for (uint32_t e = e0; e < e1; ++e) {
    const uint64_t begin = min_u64(run, capacity);
    run += min(counts[e], capacity);
    const auto rows = static_cast<uint32_t>(min_u64(run, capacity) - begin);
    list[e] = items_run;
    items_run += (rows + tile_rows - 1) / tile_rows * col_tiles;
  }
  if (tid == 0) {
    list[n_experts] = items_total;
    start[n_experts] = static_cast<uint32_t>(min_u64(rows_total, capacity));
  }
  __syncthreads();
}

// One work item, decoded: its expert, first column, first routed entry (an index into the routed
// list, inside the expert's segment) and the number of routed rows it covers (1..tile_rows).
struct WorkItem {
  uint32_t expert, col0, row0, rows;
};

// Item `item` (< list[n_experts]) of the list built by build_work_list. With `balanced`, an
// expert's row tiles share its rows evenly (sizes differ by at most one) instead of full tiles and
// a remainder; the number of tiles is the same.
__device__ __forceinline__ WorkItem decode_item(uint32_t item, const uint32_t* list,
                                                uint32_t n_experts, uint32_t tile_rows,
                                                uint32_t tile_cols, bool balanced = false) {
  uint32_t lo = 0, hi = n_experts;  // list[lo] <= item < list[hi]
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) >> 1;
    if (list[mid] <= item)
      lo = mid;
    else
      hi = mid;
  }
  const uint32_t* const start = list + n_experts + 1;
  const uint32_t first = start[lo], count = start[lo + 1] - first;
  const uint32_t row_tiles = (count + tile_rows - 1) / tile_rows;
  const uint32_t local = item - list[lo];
  const uint32_t col0 = (local / row_tiles) * tile_cols, tile = local % row_tiles;
  if (balanced) {
    const uint32_t base = count / row_tiles, extra = count % row_tiles;
    return WorkItem{lo, col0, first + tile * base + min(tile, extra),
                    base + (tile < extra ? 1u : 0u)};
  }
  const uint32_t row0 = tile * tile_rows;
  return WorkItem{lo, col0, first + row0, min(tile_rows, count - row0)};
}

}  // namespace routemm::cuda
