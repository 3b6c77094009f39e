// Expert-ID matmul pipelines (spec §7.4, §7.5): dense_matmul_id_direct_{f32,f16,bf16}_f32,
// dense_matmul_id_map_distinct and dense_matmul_id_grouped_{f32,f16,bf16}_f32.
//
// NUMERIC CONTRACT (why Direct and Grouped are bit-identical on Metal): for every output element
// the 32 lanes of one simdgroup each walk inner = lane, lane + 32, lane + 64, ... < K in increasing
// order with acc = fma(widen(w), x, acc) starting from +0.0f, then one simd_sum. Widening F16/BF16
// to F32 is exact. Grouped stages weights already widened (the same values) and pads past K with
// zeros; a padded step is fma(0, 0, acc) == acc because acc is never -0.0f (it starts at +0.0f and
// round-to-nearest never produces -0.0f from a sum with a +0.0f addend or from x + (-x)).
//
// Bindings and geometry are the front door's (csrc/ops/dense_matmul_id.cpp) with the KernelDefs of
// csrc/backend/metal/kernels.cpp:
//   direct : 0 params, 1 weights, 2 input, 3 ids, 4 output; grid [ceil(n/8), m*top_k, 1],
//            64 threads (2 simdgroups x 4 output columns), no threadgroup memory.
//   map    : 0 params, 1 ids, 2 expert_counts, 3 routed_rows, 4 output; one threadgroup of 128
//            threads, threadgroup memory index 0 of 16400 bytes (4 x 1024 cursors, 4 totals).
//   grouped: 0 params, 1 weights, 2 input, 3 expert_counts, 4 routed_rows, 5 output; grid
//            [ceil(m/8), ceil(n/8), n_experts], 256 threads (8 simdgroups), threadgroup memory
//            index 0 of 4096 bytes (8 columns x 128 inner positions of F32).
#include <metal_stdlib>

#include "backend/common/dense_matmul_id_params.h"

using namespace metal;
using routemm::kernels::DenseMatmulIdKernelParams;

namespace {

constant constexpr uint kSimdWidth = 32;
constant constexpr uint kDirectColumnsPerSimdgroup = 4;
constant constexpr uint kDirectColumnsPerGroup = 8;
constant constexpr uint kGroupedRows = 8;     // routed rows per threadgroup (one per simdgroup)
constant constexpr uint kGroupedColumns = 8;  // output columns per threadgroup
constant constexpr uint kGroupedDepth = 128;  // inner positions staged per step
constant constexpr uint kGroupedThreads = 256;
constant constexpr uint kMapThreads = 128;  // the map's fixed threadgroup (4 simdgroups)
constant constexpr uint kMapSimdgroups = kMapThreads / kSimdWidth;
constant constexpr uint kMapMaxExperts = 1024;  // the grouped route's expert limit
constant constexpr uint kMapExpertsPerThread = kMapMaxExperts / kMapThreads;

// BF16 weights are read as their raw 16 bits; widening is exact (the F32 with those high bits).
struct bf16_bits {
  ushort bits;
};

inline float widen(float v) { return v; }
inline float widen(half v) { return float(v); }
inline float widen(bf16_bits v) { return as_type<float>(uint(v.bits) << 16); }

// The value-independence boundary shared by both routes: where an input row and an expert start.
inline device const float* input_row(device const uchar* input, constant DenseMatmulIdKernelParams& p,
                                     uint flat) {
  const uint token = flat / p.top_k;
  const uint slot = flat - token * p.top_k;
  const ulong offset = ulong(token) * p.input_token_stride_bytes + ulong(slot) * p.input_slot_stride_bytes;
  return reinterpret_cast<device const float*>(input + offset);
}

template <typename W>
inline device const W* expert_matrix(device const uchar* weights, constant DenseMatmulIdKernelParams& p,
                                     uint expert) {
  return reinterpret_cast<device const W*>(weights + ulong(expert) * p.expert_stride_bytes);
}

template <typename W>
void direct_impl(constant DenseMatmulIdKernelParams& p, device const uchar* weights, device const uchar* input,
                 device const uint* ids, device float* out, uint3 group, uint simdgroup, uint lane) {
  const uint flat = group.y;
  if (flat >= p.m * p.top_k) return;
  const uint first_col = group.x * kDirectColumnsPerGroup + simdgroup * kDirectColumnsPerSimdgroup;
  if (first_col >= p.n) return;  // whole simdgroup; this kernel has no threadgroup barriers

  float sums[kDirectColumnsPerSimdgroup] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint id = ids[flat];
  if (id < p.n_experts) {  // an invalid id forms no weight address and writes zeros
    device const float* x = input_row(input, p, flat);
    device const W* w = expert_matrix<W>(weights, p, id);
    for (uint inner = lane; inner < p.k; inner += kSimdWidth) {
      const float a = x[inner];
      for (uint c = 0; c < kDirectColumnsPerSimdgroup; ++c) {
        const uint col = first_col + c;
        if (col < p.n) sums[c] = fma(widen(w[ulong(col) * p.k + inner]), a, sums[c]);
      }
    }
  }
  for (uint c = 0; c < kDirectColumnsPerSimdgroup; ++c) {
    const float total = simd_sum(sums[c]);
    const uint col = first_col + c;
    if (lane == 0 && col < p.n) out[ulong(flat) * p.n + col] = total;
  }
}

// Where expert `expert`'s segment of the map's routed list starts: the counts of the experts
// before it, clamped to the m * top_k flat rows (so stale counts cannot index past the list).
inline uint routed_start(constant DenseMatmulIdKernelParams& p, device const uint* expert_counts, uint expert) {
  const ulong capacity = ulong(p.m) * p.top_k;
  ulong start = 0;
  for (uint e = 0; e < expert; ++e) start += expert_counts[e];
  return uint(min(start, capacity));
}

template <typename W>
void grouped_impl(constant DenseMatmulIdKernelParams& p, device const uchar* weights, device const uchar* input,
                  device const uint* expert_counts, device const uint* routed_rows, device float* out,
                  threadgroup float* tile, uint3 group, uint3 groups, uint tid, uint simdgroup, uint lane) {
  const uint expert = group.z;
  const uint first_col = group.y * kGroupedColumns;
  if (first_col >= p.n) return;  // uniform across the threadgroup
  const uint start = routed_start(p, expert_counts, expert);
  const uint count = uint(min(ulong(expert_counts[expert]), ulong(p.m) * p.top_k - start));
  device const uint* segment = routed_rows + start;
  device const W* w = expert_matrix<W>(weights, p, expert);

  // The grid has ceil(m / 8) row tiles per expert; an expert named more than m times (an id
  // repeated within tokens) takes its further tiles in strides of the grid.
  for (uint first_routed = group.x * kGroupedRows; first_routed < count; first_routed += groups.x * kGroupedRows) {
    const uint routed = first_routed + simdgroup;
    const bool active = routed < count;
    const uint flat = active ? segment[routed] : 0;
    device const float* x = input_row(input, p, flat);

    float sums[kGroupedColumns] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (uint k0 = 0; k0 < p.k; k0 += kGroupedDepth) {
      // Stage 8 columns x 128 inner positions, widened, zero outside [n, k).
      for (uint t = tid; t < kGroupedColumns * kGroupedDepth; t += kGroupedThreads) {
        const uint c = t / kGroupedDepth;
        const uint inner = k0 + (t - c * kGroupedDepth);
        const uint col = first_col + c;
        tile[t] = (col < p.n && inner < p.k) ? widen(w[ulong(col) * p.k + inner]) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (active) {
        for (uint i = lane; i < kGroupedDepth; i += kSimdWidth) {
          const uint inner = k0 + i;
          const float a = inner < p.k ? x[inner] : 0.0f;
          for (uint c = 0; c < kGroupedColumns; ++c) sums[c] = fma(tile[c * kGroupedDepth + i], a, sums[c]);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint c = 0; c < kGroupedColumns; ++c) {
      const float total = simd_sum(sums[c]);
      const uint col = first_col + c;
      if (active && lane == 0 && col < p.n) out[ulong(flat) * p.n + col] = total;
    }
  }
}

}  // namespace

#define ROUTEMM_DIRECT_ARGS                                                                    \
  constant DenseMatmulIdKernelParams &p [[buffer(0)]], device const uchar *weights [[buffer(1)]], \
      device const uchar *input [[buffer(2)]], device const uint *ids [[buffer(3)]],           \
      device float *out [[buffer(4)]], uint3 group [[threadgroup_position_in_grid]],          \
      uint simdgroup [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]

kernel void dense_matmul_id_direct_f32_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl<float>(p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void dense_matmul_id_direct_f16_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl<half>(p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void dense_matmul_id_direct_bf16_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl<bf16_bits>(p, weights, input, ids, out, group, simdgroup, lane);
}

// Routes every flat row with a valid id, repeated ids included: expert e's rows form the segment
// routed_rows[start(e), start(e) + count(e)) of one list ordered by expert, in flat-row order,
// where start(e) is the number of flat rows whose id is below e. The list holds at most m * top_k
// rows (within the scratch's n_experts * m entries, since grouped needs top_k <= n_experts).
//
// One threadgroup of 128 threads (4 simdgroups); simdgroup s owns the contiguous quarter s of the
// flat rows. Threadgroup memory: cursor[s][e] for 4 x 1024 experts, then 4 simdgroup totals (all
// atomic_uint, so that no access is a race). Every pass is parallel over rows or experts, with
// no thread scanning every row for every expert:
//   1. count: each thread counts its rows into cursor[s][id]; a row whose id is >= n_experts is
//      zero-filled in the output by that thread (the grouped kernel never visits it: Direct's
//      full-overwrite behaviour);
//   2. place: thread t owns experts [8 t, 8 t + 8): count(e) = the sum over s, start(e) comes from
//      an exclusive scan over the threads (simd_prefix_exclusive_sum, then the simdgroup totals),
//      and cursor[s][e] becomes where simdgroup s's first row of expert e goes;
//   3. scatter: each simdgroup walks its rows in order, 32 at a time: a row's rank among the lanes
//      before it with the same id (32 shuffles) plus the cursor, which the lowest such lane
//      advances by their number (one atomic add, its result broadcast by a shuffle).
kernel void dense_matmul_id_map_distinct(constant DenseMatmulIdKernelParams &p [[buffer(0)]],
                                         device const uint *ids [[buffer(1)]],
                                         device uint *expert_counts [[buffer(2)]],
                                         device uint *routed_rows [[buffer(3)]],
                                         device float *out [[buffer(4)]],
                                         threadgroup atomic_uint *cursor [[threadgroup(0)]],
                                         uint tid [[thread_index_in_threadgroup]],
                                         uint simdgroup [[simdgroup_index_in_threadgroup]],
                                         uint lane [[thread_index_in_simdgroup]]) {
  const uint total = p.m * p.top_k;
  const uint experts = min(p.n_experts, kMapMaxExperts);
  const uint span = (total + kMapSimdgroups - 1) / kMapSimdgroups;
  const uint begin = min(total, simdgroup * span);
  const uint end = min(total, begin + span);
  threadgroup atomic_uint* mine = cursor + simdgroup * kMapMaxExperts;
  threadgroup atomic_uint* simdgroup_totals = cursor + kMapSimdgroups * kMapMaxExperts;

  for (uint i = tid; i < kMapSimdgroups * experts; i += kMapThreads) {
    atomic_store_explicit(&cursor[(i / experts) * kMapMaxExperts + i % experts], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 1. count
  for (uint flat = begin + lane; flat < end; flat += kSimdWidth) {
    const uint id = ids[flat];
    if (id < experts) {
      atomic_fetch_add_explicit(&mine[id], 1u, memory_order_relaxed);
    } else {
      for (uint col = 0; col < p.n; ++col) out[ulong(flat) * p.n + col] = 0.0f;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. place
  const uint first_expert = tid * kMapExpertsPerThread;
  uint owned = 0;
  for (uint e = first_expert; e < min(experts, first_expert + kMapExpertsPerThread); ++e) {
    for (uint s = 0; s < kMapSimdgroups; ++s) {
      owned += atomic_load_explicit(&cursor[s * kMapMaxExperts + e], memory_order_relaxed);
    }
  }
  const uint before_in_simdgroup = simd_prefix_exclusive_sum(owned);
  if (lane == kSimdWidth - 1) {
    atomic_store_explicit(&simdgroup_totals[simdgroup], before_in_simdgroup + owned, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint next = before_in_simdgroup;
  for (uint s = 0; s < simdgroup; ++s) next += atomic_load_explicit(&simdgroup_totals[s], memory_order_relaxed);
  for (uint e = first_expert; e < min(experts, first_expert + kMapExpertsPerThread); ++e) {
    uint count = 0;
    for (uint s = 0; s < kMapSimdgroups; ++s) {
      threadgroup atomic_uint* c = &cursor[s * kMapMaxExperts + e];
      const uint rows = atomic_load_explicit(c, memory_order_relaxed);
      atomic_store_explicit(c, next, memory_order_relaxed);
      next += rows;
      count += rows;
    }
    expert_counts[e] = count;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. scatter (every lane takes every batch of its simdgroup: the shuffles need all 32)
  for (uint batch = begin; batch < end; batch += kSimdWidth) {
    const uint flat = batch + lane;
    const uint id = flat < end ? ids[flat] : 0xffffffffu;
    const bool routed = id < experts;
    uint rank = 0, same = 0, leader = lane;
    for (ushort other = 0; other < kSimdWidth; ++other) {
      const uint other_id = simd_shuffle(id, other);
      const bool match = other_id == id;
      same += match ? 1u : 0u;
      rank += match && other < lane ? 1u : 0u;
      leader = match && other < leader ? other : leader;
    }
    uint base = 0;
    if (routed && leader == lane) base = atomic_fetch_add_explicit(&mine[id], same, memory_order_relaxed);
    base = simd_shuffle(base, ushort(leader));
    if (routed) routed_rows[base + rank] = flat;
  }
}

#define ROUTEMM_GROUPED_ARGS                                                                   \
  constant DenseMatmulIdKernelParams &p [[buffer(0)]], device const uchar *weights [[buffer(1)]], \
      device const uchar *input [[buffer(2)]], device const uint *expert_counts [[buffer(3)]], \
      device const uint *routed_rows [[buffer(4)]], device float *out [[buffer(5)]],          \
      threadgroup float *tile [[threadgroup(0)]], uint3 group [[threadgroup_position_in_grid]], \
      uint3 groups [[threadgroups_per_grid]], uint tid [[thread_index_in_threadgroup]], uint simdgroup [[simdgroup_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]]

kernel void dense_matmul_id_grouped_f32_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl<float>(p, weights, input, expert_counts, routed_rows, out, tile, group, groups, tid, simdgroup, lane);
}
kernel void dense_matmul_id_grouped_f16_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl<half>(p, weights, input, expert_counts, routed_rows, out, tile, group, groups, tid, simdgroup, lane);
}
kernel void dense_matmul_id_grouped_bf16_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl<bf16_bits>(p, weights, input, expert_counts, routed_rows, out, tile, group, groups, tid, simdgroup, lane);
}
