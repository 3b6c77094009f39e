// GGML Q4_0 and Q8_0 dense projection pipelines that need nothing beyond Metal 3 (spec §5.5, §5.6):
// kernel_mul_mv_{q4_0,q8_0}_f32 and kernel_mul_mv_q8_0_f32_nr2 (M <= 8), and
// kernel_mul_mm_{q4_0,q8_0}_f32 (the simdgroup-matrix route; Q8_0's only matrix route), and the
// mat-vec and simdgroup-matrix route of every format of ggml_formats.h's kKernelFormats
// (kernel_mul_{mv,mm}_<format>_f32, Q8_0's geometry). The tensor-API routes live in
// q4_matmul_tensor.metal, built into a separate, optional library.
//
// NUMERIC CONTRACT: ggml_blocks.h's (exact dequantisation, F32 FMA accumulation, nothing rounded to
// half precision). The results therefore meet the suite's F32 accumulation bound against a float64
// reference of the dequantised weights (tests/python/tolerances.py), like the CPU oracle.
// (llama.cpp's d * (sumq - 8 * sumy) factoring is deliberately not used: it cancels, so an
// all-zero block need not give exactly zero.)
//
// Function constants (the label suffix |700:i1|701:i1|702:i1 of every Q4/Q8 pipeline): 700 is the
// batch count, 701 and 702 the broadcast ratios r2 and r3 of the weight over the input batches.
//
// Bindings and geometry (csrc/ops/q4_matmul.cpp with csrc/backend/metal/kernels.cpp):
//   mat-vec: 0 weight, 1 input, 2 output, 3 GgmlMatmulMvParams; grid [ceil(N/8), M, batch],
//            threads [8, 8, 1] (2 simdgroups x 4 output rows), no threadgroup memory.
//   nr2 mat-vec: the mat-vec's bindings; grid [ceil(N/2), M, batch], threads [32, 4, 1]
//            (2 output rows), threadgroup memory index 0 of 256 bytes.
//   simdgroup mm: 0 GgmlMatmulMmParams, 1 weight, 2 input, 3 output; grid [ceil(M/32),
//            ceil(N/64), batch], 128 threads (4 simdgroups), threadgroup memory index 0 of 8192
//            bytes (ggml_blocks.h's mm_tile).
#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "backend/common/q4_0_block.h"
#include "ggml_blocks.h"

using namespace metal;
using routemm::kernels::GgmlMatmulMmParams;
using routemm::kernels::GgmlMatmulMvParams;

constant int routemm_q4_batch [[function_constant(700)]];
constant int routemm_q4_r2 [[function_constant(701)]];
constant int routemm_q4_r3 [[function_constant(702)]];  // nb03 batches are unused (nb03 = 0)

namespace {

constant constexpr uint kMvRowsPerSimdgroup = 4;
constant constexpr uint kMvRowsPerGroup = 8;

// Each simdgroup owns 4 consecutive output rows (ggml_blocks.h's lane contract), then one
// simd_sum per row.
template <typename F>
void mat_vec(F format, device const uchar* weight, device const float* input, device float* output,
             constant GgmlMatmulMvParams& p, uint3 group, uint simdgroup, uint lane) {
  const long n = p.ne01;
  const long k = p.ne00;
  const long token = group.y;
  const long batch = group.z;
  if (token >= p.ne1 || batch >= routemm_q4_batch) return;
  const long first_row = long(group.x) * kMvRowsPerGroup + long(simdgroup) * kMvRowsPerSimdgroup;
  if (first_row >= n) return;  // whole simdgroup; this kernel has no threadgroup barriers

  const ulong row_bytes = ggml_blocks::row_bytes(format, uint(k));
  device const uchar* w_batch = weight + ulong(batch / routemm_q4_r2) * row_bytes * ulong(n);
  device const float* x = input + (batch * p.ne1 + token) * p.ne10;
  const uint rows = uint(min(long(kMvRowsPerSimdgroup), n - first_row));
  float sums[kMvRowsPerSimdgroup];
  ggml_blocks::lane_row_dots<F, kMvRowsPerSimdgroup>(format, w_batch + ulong(first_row) * row_bytes, row_bytes,
                                                     rows, x, uint(k), lane, sums);
  for (uint r = 0; r < kMvRowsPerSimdgroup; ++r) {
    const float total = simd_sum(sums[r]);
    const long row = first_row + r;
    if (lane == 0 && row < n) output[(batch * p.ne1 + token) * p.ne0 + row] = total;
  }
}

// Spec §5.5's Q8_0 default: 2 output rows of one token per threadgroup of 4 simdgroups, split and
// reduced as ggml_blocks.h's nr2_row_dots says (256 bytes of threadgroup memory). Exact F32 like
// mat_vec above, but the partition and the reduction differ, so the bits may differ from
// kernel_mul_mv_q8_0_f32's.
template <typename F>
void mat_vec_nr2(F format, device const uchar* weight, device const float* input, device float* output,
                 constant GgmlMatmulMvParams& p, threadgroup float* slots, uint3 group, uint simdgroup,
                 uint lane) {
  const long n = p.ne01;
  const long k = p.ne00;
  const long token = group.y;
  const long batch = group.z;
  // Uniform over the threadgroup, so no thread skips the barrier in nr2_row_dots alone.
  if (token >= p.ne1 || batch >= routemm_q4_batch) return;
  const long first_row = long(group.x) * ggml_blocks::kNr2Rows;
  if (first_row >= n) return;

  const ulong row_bytes = ulong(k / ggml_blocks::kBlockValues) * ggml_blocks::block_bytes(format);
  device const uchar* w_batch = weight + ulong(batch / routemm_q4_r2) * row_bytes * ulong(n);
  device const float* x = input + (batch * p.ne1 + token) * p.ne10;
  const uint rows = uint(min(long(ggml_blocks::kNr2Rows), n - first_row));
  const float total = ggml_blocks::nr2_row_dots(format, w_batch + ulong(first_row) * row_bytes, row_bytes, rows, x,
                                                uint(k), slots, simdgroup, lane);
  const long row = first_row + simdgroup;
  if (simdgroup < ggml_blocks::kNr2Rows && lane == 0 && row < n) output[(batch * p.ne1 + token) * p.ne0 + row] = total;
}

// ggml_blocks.h's 32 x 64 tile over tokens [32 x, +32) and outputs [64 y, +64).
template <typename F>
void mat_mat(F format, constant GgmlMatmulMmParams& p, device const uchar* weight, device const uchar* input,
             device float* output, threadgroup float* shmem, uint3 group, uint tid, uint simdgroup) {
  const uint m = uint(p.ne1);
  const uint n = uint(p.ne0);
  const uint k = uint(p.ne00);
  const int batch = int(group.z);
  if (batch >= routemm_q4_batch) return;
  const uint m0 = group.x * ggml_blocks::kMmRows;
  const uint n0 = group.y * ggml_blocks::kMmOutputs;

  device const uchar* w_batch = weight + ulong(batch / routemm_q4_r2) * p.nb02;
  device const uchar* x_batch = input + ulong(batch) * p.nb12;
  device float* y_batch = output + ulong(batch) * ulong(m) * ulong(n);
  const uint row = m0 + (tid >> 2);
  const bool x_valid = row < m;
  device const float* x_row = reinterpret_cast<device const float*>(x_batch + ulong(x_valid ? row : 0) * p.nb11);
  ggml_blocks::mm_tile(format, w_batch, p.nb01, n, n0, k, x_row, x_valid, shmem, tid, simdgroup);
  for (uint e = tid; e < ggml_blocks::kMmRows * ggml_blocks::kMmOutputs; e += ggml_blocks::kMmThreads) {
    const uint tok = m0 + e / ggml_blocks::kMmOutputs;
    const uint col = n0 + e % ggml_blocks::kMmOutputs;
    if (tok < m && col < n) y_batch[ulong(tok) * ulong(n) + ulong(col)] = shmem[e];
  }
}

}  // namespace

#define ROUTEMM_MV_ARGS                                                                     \
  device const uchar *weight [[buffer(0)]], device const float *input [[buffer(1)]],        \
      device float *output [[buffer(2)]], constant GgmlMatmulMvParams &p [[buffer(3)]],     \
      uint3 group [[threadgroup_position_in_grid]], uint simdgroup [[simdgroup_index_in_threadgroup]], \
      uint lane [[thread_index_in_simdgroup]]

// The mat-vec's bindings plus threadgroup memory index 0 (the nr2 reduction slots).
#define ROUTEMM_MV_NR2_ARGS                                                                 \
  device const uchar *weight [[buffer(0)]], device const float *input [[buffer(1)]],        \
      device float *output [[buffer(2)]], constant GgmlMatmulMvParams &p [[buffer(3)]],     \
      threadgroup float *slots [[threadgroup(0)]], uint3 group [[threadgroup_position_in_grid]], \
      uint simdgroup [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]

kernel void kernel_mul_mv_q4_0_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q4_0(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mv_q8_0_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q8_0(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mv_q8_0_f32_nr2(ROUTEMM_MV_NR2_ARGS) {
  mat_vec_nr2(ggml_blocks::Q8_0(), weight, input, output, p, slots, group, simdgroup, lane);
}

#define ROUTEMM_MM_ARGS                                                                          \
  constant GgmlMatmulMmParams &p [[buffer(0)]], device const uchar *weight [[buffer(1)]],        \
      device const uchar *input [[buffer(2)]], device float *output [[buffer(3)]],               \
      threadgroup float *shmem [[threadgroup(0)]], uint3 group [[threadgroup_position_in_grid]], \
      uint tid [[thread_index_in_threadgroup]], uint simdgroup [[simdgroup_index_in_threadgroup]]

kernel void kernel_mul_mm_q4_0_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q4_0(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mm_q8_0_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q8_0(), p, weight, input, output, shmem, group, tid, simdgroup);
}

// The formats of ggml_formats.h's kKernelFormats.
kernel void kernel_mul_mv_q4_1_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q4_1(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q4_1_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q4_1(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_q5_0_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q5_0(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q5_0_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q5_0(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_q5_1_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q5_1(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q5_1_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q5_1(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_mxfp4_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Mxfp4(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_mxfp4_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Mxfp4(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_q4_k_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q4_K(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q4_k_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q4_K(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_q5_k_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q5_K(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q5_k_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q5_K(), p, weight, input, output, shmem, group, tid, simdgroup);
}
kernel void kernel_mul_mv_q6_k_f32(ROUTEMM_MV_ARGS) {
  mat_vec(ggml_blocks::Q6_K(), weight, input, output, p, group, simdgroup, lane);
}
kernel void kernel_mul_mm_q6_k_f32(ROUTEMM_MM_ARGS) {
  mat_mat(ggml_blocks::Q6_K(), p, weight, input, output, shmem, group, tid, simdgroup);
}
