// GGML Q4_0 matrix routes on the Metal tensor API (spec §5.6): kernel_mul_mm_q4_0_tensor_f32 (V1),
// kernel_mul_mm_q4_0_tensor_v2_f32 (V2, 128-token tile) and kernel_mul_mm_q4_0_tensor_64x32_f32
// (the calibration candidate: V2's code with a 32-token tile).
//
// This file needs <metal_tensor> and MetalPerformancePrimitives (Metal 4). It is built into its
// own library, routemm_tensor.metallib, only when the SDK compiles it; the backend registers these
// three pipelines only when that library loads and each pipeline builds on the device (the
// AUTO_PROBE of spec §5.6). Elsewhere the routes are reported unavailable and the front door takes
// the simdgroup route; nothing here is required.
//
// NUMERIC CONTRACT: as q4_matmul.metal, nothing is rounded below F32. Weights are dequantised
// exactly into F32 panels of 64 outputs x 16 K positions (4096 bytes); activations are F32; the
// matmul2d descriptor asks for full precision (relaxed_precision = false) and mode
// multiply_accumulate, so each K step adds to the F32 cooperative tensor (zeroed first; mode
// multiply would overwrite it). V2 and 64x32 run the same template with the same K
// loop and panels; only the token extent of the descriptor differs. Whether the hardware's
// per-element reduction order is the same for both extents is not assumed: the calibration proves
// bit identity per weight before it may select the candidate.
//
// Operand layout (matmul2d, no transposes, extents listed innermost first): left = activations,
// extents (K, tokens); right = the weight panel, extents (64 outputs, 16), element (o, kk) at
// panel[kk * 64 + o]; destination = output, extents (N, M), row-major [M, N] as callers see it.
//
// Bindings: 0 GgmlMatmulMmParams, 1 weight, 2 input, 3 output; threadgroup memory index 0 (8192
// bytes for V1: weight panel plus a staged 32 x 16 activation panel; 4096 for V2 and 64x32, which
// read activations from device memory through a tensor view); 128 threads (4 simdgroups); grid
// [ceil(M / tokens), ceil(N / 64), batch].
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

#include "backend/common/q4_0_block.h"

using namespace metal;
using namespace mpp::tensor_ops;
using routemm::kernels::GgmlMatmulMmParams;

constant int routemm_q4t_batch [[function_constant(700)]];
constant int routemm_q4t_r2 [[function_constant(701)]];
constant int routemm_q4t_r3 [[function_constant(702)]];  // nb03 batches are unused (nb03 = 0)

namespace {

constant constexpr uint kBlockValues = 32;
constant constexpr uint kBlockBytes = 18;
constant constexpr int kOutputs = 64;  // outputs per threadgroup (every matrix route)
constant constexpr int kDepth = 16;    // K positions per step (half a Q4_0 block)

using device_matrix = tensor<device float, dextents<int32_t, 2>, tensor_inline>;
using group_matrix = tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline>;

inline float block_scale(device const uchar* block) {
  return float(as_type<half>(*reinterpret_cast<device const ushort*>(block)));
}

inline float block_value(device const uchar* block, float d, uint j) {
  const uint byte = block[2 + (j & 15u)];
  const uint nibble = j < 16 ? (byte & 15u) : (byte >> 4);
  return d * float(int(nibble) - 8);
}

// Stages the exact F32 weight panel for outputs [n0, n0 + 64) and K positions [k0, k0 + 16):
// panel[kk * 64 + o]; zero past N. Thread t fills output t / 2, positions 8 (t & 1) .. + 8.
inline void stage_weights(threadgroup float* panel, device const uchar* weight, ulong row_bytes, int n,
                          int n0, int k0, uint tid) {
  const int o = int(tid >> 1);
  const uint j0 = (tid & 1u) * 8;
  const int row = n0 + o;
  const uint first = uint(k0) % kBlockValues;
  if (row < n) {
    device const uchar* block = weight + ulong(row) * row_bytes + ulong(k0 / int(kBlockValues)) * kBlockBytes;
    const float d = block_scale(block);
    for (uint j = 0; j < 8; ++j) panel[(j0 + j) * kOutputs + o] = block_value(block, d, first + j0 + j);
  } else {
    for (uint j = 0; j < 8; ++j) panel[(j0 + j) * kOutputs + o] = 0.0f;
  }
}

// V2 and 64x32: activations straight from device memory (row stride nb11 / 4 = K: contiguous).
template <int Tokens>
void mm_device_activations(constant GgmlMatmulMmParams& p, device const uchar* weight, device uchar* input,
                           device float* output, threadgroup float* shmem, uint3 group, uint tid) {
  const int m = p.ne1;
  const int n = p.ne0;
  const int k = p.ne00;
  const int batch = int(group.z);
  if (batch >= routemm_q4t_batch) return;
  const int m0 = int(group.x) * Tokens;
  const int n0 = int(group.y) * kOutputs;

  device_matrix x(reinterpret_cast<device float*>(input + ulong(batch) * p.nb12),
                  dextents<int32_t, 2>(k, m));
  device_matrix y(output + ulong(batch) * ulong(m) * ulong(n), dextents<int32_t, 2>(n, m));
  group_matrix panel(shmem, dextents<int32_t, 2>(kOutputs, kDepth));

  constexpr auto descriptor = matmul2d_descriptor(Tokens, kOutputs, kDepth, false, false, false,
                                                  matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<descriptor, execution_simdgroups<4>> op;
  using left_t = decltype(x.slice(0, 0));
  auto acc = op.template get_destination_cooperative_tensor<left_t, group_matrix, float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
  }

  device const uchar* w_batch = weight + ulong(batch / routemm_q4t_r2) * p.nb02;
  for (int k0 = 0; k0 < k; k0 += kDepth) {
    stage_weights(shmem, w_batch, p.nb01, n, n0, k0, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    auto activations = x.slice(k0, m0);  // run() takes its operands as lvalues
    op.run(activations, panel, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  acc.store(y.slice(n0, m0));
}

}  // namespace

#define ROUTEMM_Q4_TENSOR_ARGS                                                                  \
  constant GgmlMatmulMmParams &p [[buffer(0)]], device const uchar *weight [[buffer(1)]],       \
      device uchar *input [[buffer(2)]], device float *output [[buffer(3)]],               \
      threadgroup float *shmem [[threadgroup(0)]], uint3 group [[threadgroup_position_in_grid]], \
      uint tid [[thread_index_in_threadgroup]]

// V1: both panels in threadgroup memory (weights 4096 bytes, activations [32 tokens][16] = 2048
// bytes, zero past M), 32-token tile.
kernel void kernel_mul_mm_q4_0_tensor_f32(ROUTEMM_Q4_TENSOR_ARGS) {
  constexpr int tokens = 32;
  const int m = p.ne1;
  const int n = p.ne0;
  const int k = p.ne00;
  const int batch = int(group.z);
  if (batch >= routemm_q4t_batch) return;
  const int m0 = int(group.x) * tokens;
  const int n0 = int(group.y) * kOutputs;

  threadgroup float* xs = shmem + kOutputs * kDepth;
  device_matrix y(output + ulong(batch) * ulong(m) * ulong(n), dextents<int32_t, 2>(n, m));
  group_matrix panel(shmem, dextents<int32_t, 2>(kOutputs, kDepth));
  group_matrix activations(xs, dextents<int32_t, 2>(kDepth, tokens));

  constexpr auto descriptor = matmul2d_descriptor(tokens, kOutputs, kDepth, false, false, false,
                                                  matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<descriptor, execution_simdgroups<4>> op;
  auto acc = op.template get_destination_cooperative_tensor<group_matrix, group_matrix, float>();
  for (uint16_t i = 0; i < acc.get_capacity(); ++i) {
    if (acc.is_valid_element(i)) acc[i] = 0.0f;
  }

  device const uchar* w_batch = weight + ulong(batch / routemm_q4t_r2) * p.nb02;
  device const uchar* x_batch = input + ulong(batch) * p.nb12;
  for (int k0 = 0; k0 < k; k0 += kDepth) {
    stage_weights(shmem, w_batch, p.nb01, n, n0, k0, tid);
    {  // thread t stages token t / 4, positions 4 (t & 3) .. + 4
      const uint tok = tid >> 2;
      const uint j0 = (tid & 3u) * 4;
      const int row = m0 + int(tok);
      device const float* xr = reinterpret_cast<device const float*>(x_batch + ulong(row) * p.nb11);
      for (uint j = 0; j < 4; ++j) xs[tok * kDepth + j0 + j] = row < m ? xr[k0 + int(j0 + j)] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.run(activations, panel, acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  acc.store(y.slice(n0, m0));
}

kernel void kernel_mul_mm_q4_0_tensor_v2_f32(ROUTEMM_Q4_TENSOR_ARGS) {
  mm_device_activations<128>(p, weight, input, output, shmem, group, tid);
}

kernel void kernel_mul_mm_q4_0_tensor_64x32_f32(ROUTEMM_Q4_TENSOR_ARGS) {
  mm_device_activations<32>(p, weight, input, output, shmem, group, tid);
}
