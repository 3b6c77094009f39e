// Quantised expert-ID matmul pipelines (csrc/include/routemm/ops/quantized_matmul_id.h):
// quantized_matmul_id_direct_{q4_0,q8_0}_f32 and quantized_matmul_id_grouped_{q4_0,q8_0}_f32,
// quantized_matmul_id_direct_q8_0_f32_nr2 (Q8_0's direct under expert_q8_0_mv_nr2), and
// the same two routes for every format of ggml_formats.h's kKernelFormats
// (quantized_matmul_id_{direct,grouped}_<format>_f32); the grouped route's map is
// dense_matmul_id.metal's dense_matmul_id_map_distinct.
//
// NUMERIC CONTRACT: ggml_blocks.h's exact dequantisation and F32 accumulation.
//   direct : the mat-vec lane contract, so a row equals kernel_mul_mv_{q4_0,q8_0}_f32 on the
//            expert's matrix bit for bit; the nr2 pipeline equals kernel_mul_mv_q8_0_f32_nr2.
//   grouped: ggml_blocks.h's 32 x 64 simdgroup-matrix tile over an expert's routed rows (the tile
//            of kernel_mul_mm_{q4_0,q8_0}_f32). Every product and sum is F32, but the order in
//            which the hardware sums inside simdgroup_multiply_accumulate is not specified, so
//            this route meets the F32 accumulation bound rather than bit identity with direct.
//
// An id >= n_experts forms no weight address: direct writes a zero row, and the map (which the
// grouped route runs first) zero-fills that row and routes it to no expert.
//
// Bindings and geometry are the front door's (csrc/ops/expert_id_encoding.cpp) with the KernelDefs
// of csrc/backend/metal/kernels.cpp:
//   direct : 0 params, 1 weights, 2 input, 3 ids, 4 output; grid [ceil(n/8), m*top_k, 1],
//            64 threads (2 simdgroups x 4 output columns), no threadgroup memory.
//   direct nr2 (Q8_0): direct's bindings; grid [ceil(n/2), m*top_k, 1], threads [32, 4, 1]
//            (2 output columns), threadgroup memory index 0 of 256 bytes.
//   grouped: 0 params, 1 weights, 2 input, 3 expert_counts, 4 routed_rows, 5 output; grid
//            [ceil(m/32), ceil(n/64), n_experts], 128 threads (4 simdgroups), threadgroup memory
//            index 0 of 8192 bytes.
#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "backend/common/dense_matmul_id_params.h"
#include "ggml_blocks.h"

using namespace metal;
using routemm::kernels::DenseMatmulIdKernelParams;

namespace {

constant constexpr uint kDirectColumnsPerSimdgroup = 4;
constant constexpr uint kDirectColumnsPerGroup = 8;

// Where flat row `flat`'s activations start (SharedPerToken or Slotted, through the strides).
inline device const float* input_row(device const uchar* input, constant DenseMatmulIdKernelParams& p, uint flat) {
  const uint token = flat / p.top_k;
  const uint slot = flat - token * p.top_k;
  const ulong offset = ulong(token) * p.input_token_stride_bytes + ulong(slot) * p.input_slot_stride_bytes;
  return reinterpret_cast<device const float*>(input + offset);
}

template <typename F>
inline ulong weight_row_bytes(F format, constant DenseMatmulIdKernelParams& p) {
  return ggml_blocks::row_bytes(format, p.k);
}

template <typename F>
void direct_impl(F format, constant DenseMatmulIdKernelParams& p, device const uchar* weights,
                 device const uchar* input, device const uint* ids, device float* out, uint3 group,
                 uint simdgroup, uint lane) {
  const uint flat = group.y;
  if (flat >= p.m * p.top_k) return;
  const uint first_col = group.x * kDirectColumnsPerGroup + simdgroup * kDirectColumnsPerSimdgroup;
  if (first_col >= p.n) return;  // whole simdgroup; this kernel has no threadgroup barriers

  float sums[kDirectColumnsPerSimdgroup] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint id = ids[flat];
  if (id < p.n_experts) {  // an invalid id forms no weight address and writes zeros
    const ulong row_bytes = weight_row_bytes(format, p);
    device const uchar* first_row = weights + ulong(id) * p.expert_stride_bytes + ulong(first_col) * row_bytes;
    const uint rows = min(kDirectColumnsPerSimdgroup, p.n - first_col);
    ggml_blocks::lane_row_dots<F, kDirectColumnsPerSimdgroup>(format, first_row, row_bytes, rows,
                                                              input_row(input, p, flat), p.k, lane, sums);
  }
  for (uint c = 0; c < kDirectColumnsPerSimdgroup; ++c) {
    const float total = simd_sum(sums[c]);
    const uint col = first_col + c;
    if (lane == 0 && col < p.n) out[ulong(flat) * p.n + col] = total;
  }
}

// The Q8_0 nr2 pipeline (GgmlRoutingPolicy.expert_q8_0_mv_nr2): 2 output columns of one flat row
// per threadgroup of [32, 4, 1] threads, split and reduced by ggml_blocks.h's nr2_row_dots as
// kernel_mul_mv_q8_0_f32_nr2 does, so a routed row equals that pipeline on its expert's matrix bit
// for bit. The flat row (so its id) is uniform over the threadgroup: an invalid id returns before
// the barrier on every thread at once.
template <typename F>
void direct_nr2_impl(F format, constant DenseMatmulIdKernelParams& p, device const uchar* weights,
                     device const uchar* input, device const uint* ids, device float* out,
                     threadgroup float* slots, uint3 group, uint simdgroup, uint lane) {
  const uint flat = group.y;
  if (flat >= p.m * p.top_k) return;
  const uint first_col = group.x * ggml_blocks::kNr2Rows;
  if (first_col >= p.n) return;
  const uint col = first_col + simdgroup;
  const uint id = ids[flat];
  if (id >= p.n_experts) {  // an invalid id forms no weight address and writes zeros
    if (simdgroup < ggml_blocks::kNr2Rows && lane == 0 && col < p.n) out[ulong(flat) * p.n + col] = 0.0f;
    return;
  }
  const ulong row_bytes = weight_row_bytes(format, p);
  device const uchar* first_row = weights + ulong(id) * p.expert_stride_bytes + ulong(first_col) * row_bytes;
  const uint rows = min(ggml_blocks::kNr2Rows, p.n - first_col);
  const float total = ggml_blocks::nr2_row_dots(format, first_row, row_bytes, rows, input_row(input, p, flat), p.k,
                                                slots, simdgroup, lane);
  if (simdgroup < ggml_blocks::kNr2Rows && lane == 0 && col < p.n) out[ulong(flat) * p.n + col] = total;
}

// Expert e's segment of the map's routed list is routed_rows[start, start + count), start the
// counts of the experts before it; both are clamped to the m * top_k flat rows, so stale or
// foreign counts cannot index past the list.
template <typename F>
void grouped_impl(F format, constant DenseMatmulIdKernelParams& p, device const uchar* weights,
                  device const uchar* input, device const uint* expert_counts, device const uint* routed_rows,
                  device float* out, threadgroup float* shmem, uint3 group, uint3 groups, uint tid,
                  uint simdgroup) {
  const uint expert = group.z;
  const uint n0 = group.y * ggml_blocks::kMmOutputs;
  if (n0 >= p.n) return;  // uniform across the threadgroup
  const ulong capacity = ulong(p.m) * p.top_k;
  ulong start = 0;
  for (uint e = 0; e < expert; ++e) start += expert_counts[e];
  start = min(start, capacity);
  const uint count = uint(min(ulong(expert_counts[expert]), capacity - start));
  device const uint* segment = routed_rows + start;
  device const uchar* w = weights + ulong(expert) * p.expert_stride_bytes;
  const ulong row_bytes = weight_row_bytes(format, p);

  // The grid has ceil(m / 32) row tiles per expert; an expert named more than m times (an id
  // repeated within tokens) takes its further tiles in strides of the grid. count is uniform, so
  // every thread takes the same iterations and reaches the same barriers.
  for (uint first = group.x * ggml_blocks::kMmRows; first < count; first += groups.x * ggml_blocks::kMmRows) {
    const uint routed = first + (tid >> 2);  // the row this thread stages (mm_tile's layout)
    const bool x_valid = routed < count;
    device const float* x_row = input_row(input, p, x_valid ? segment[routed] : 0);
    ggml_blocks::mm_tile(format, w, row_bytes, p.n, n0, p.k, x_row, x_valid, shmem, tid, simdgroup);
    for (uint e = tid; e < ggml_blocks::kMmRows * ggml_blocks::kMmOutputs; e += ggml_blocks::kMmThreads) {
      const uint r = first + e / ggml_blocks::kMmOutputs;
      const uint col = n0 + e % ggml_blocks::kMmOutputs;
      if (r < count && col < p.n) out[ulong(segment[r]) * p.n + col] = shmem[e];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next tile's panels reuse shmem
  }
}

}  // namespace

#define ROUTEMM_DIRECT_ARGS                                                                    \
  constant DenseMatmulIdKernelParams &p [[buffer(0)]], device const uchar *weights [[buffer(1)]], \
      device const uchar *input [[buffer(2)]], device const uint *ids [[buffer(3)]],           \
      device float *out [[buffer(4)]], uint3 group [[threadgroup_position_in_grid]],          \
      uint simdgroup [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]

kernel void quantized_matmul_id_direct_q4_0_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q4_0(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_direct_q8_0_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q8_0(), p, weights, input, ids, out, group, simdgroup, lane);
}

// The direct bindings plus threadgroup memory index 0 (the nr2 reduction slots).
#define ROUTEMM_DIRECT_NR2_ARGS                                                                \
  constant DenseMatmulIdKernelParams &p [[buffer(0)]], device const uchar *weights [[buffer(1)]], \
      device const uchar *input [[buffer(2)]], device const uint *ids [[buffer(3)]],           \
      device float *out [[buffer(4)]], threadgroup float *slots [[threadgroup(0)]],           \
      uint3 group [[threadgroup_position_in_grid]], uint simdgroup [[simdgroup_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]]

kernel void quantized_matmul_id_direct_q8_0_f32_nr2(ROUTEMM_DIRECT_NR2_ARGS) {
  direct_nr2_impl(ggml_blocks::Q8_0(), p, weights, input, ids, out, slots, group, simdgroup, lane);
}

#define ROUTEMM_GROUPED_ARGS                                                                   \
  constant DenseMatmulIdKernelParams &p [[buffer(0)]], device const uchar *weights [[buffer(1)]], \
      device const uchar *input [[buffer(2)]], device const uint *expert_counts [[buffer(3)]], \
      device const uint *routed_rows [[buffer(4)]], device float *out [[buffer(5)]],          \
      threadgroup float *shmem [[threadgroup(0)]], uint3 group [[threadgroup_position_in_grid]], \
      uint3 groups [[threadgroups_per_grid]], uint tid [[thread_index_in_threadgroup]],        \
      uint simdgroup [[simdgroup_index_in_threadgroup]]

kernel void quantized_matmul_id_grouped_q4_0_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q4_0(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_grouped_q8_0_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q8_0(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}

// The formats of ggml_formats.h's kKernelFormats.
kernel void quantized_matmul_id_direct_q4_1_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q4_1(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q4_1_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q4_1(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_q5_0_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q5_0(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q5_0_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q5_0(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_q5_1_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q5_1(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q5_1_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q5_1(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_mxfp4_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Mxfp4(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_mxfp4_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Mxfp4(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_q4_k_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q4_K(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q4_k_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q4_K(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_q5_k_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q5_K(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q5_k_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q5_K(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
kernel void quantized_matmul_id_direct_q6_k_f32(ROUTEMM_DIRECT_ARGS) {
  direct_impl(ggml_blocks::Q6_K(), p, weights, input, ids, out, group, simdgroup, lane);
}
kernel void quantized_matmul_id_grouped_q6_k_f32(ROUTEMM_GROUPED_ARGS) {
  grouped_impl(ggml_blocks::Q6_K(), p, weights, input, expert_counts, routed_rows, out, shmem, group, groups, tid,
               simdgroup);
}
