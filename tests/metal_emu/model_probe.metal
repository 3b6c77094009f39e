// Probe kernels for the execution model's own tests (test_metal_emu.cpp): small, one behaviour each.
#include <metal_stdlib>
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

using namespace metal;
using namespace mpp::tensor_ops;

// Slots: 0 out (4 floats per thread). Lane l contributes l + 1.
kernel void probe_simd_functions(device float *out [[buffer(0)]],
                                 uint t [[thread_position_in_grid]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  const float v = float(lane + 1);
  out[t * 4 + 0] = simd_sum(v);
  out[t * 4 + 1] = simd_max(v);
  out[t * 4 + 2] = simd_prefix_exclusive_sum(v);
  out[t * 4 + 3] = simd_shuffle_down(v, 1);
}

// Lanes 16..31 return first: the sum covers the 16 lanes still active.
kernel void probe_active_lanes(device float *out [[buffer(0)]],
                               uint t [[thread_position_in_grid]],
                               uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 16) return;
  out[t] = simd_sum(1.0f);
}

// Reads a lane that has returned: undefined in Metal, an error in the model.
kernel void probe_shuffle_inactive(device float *out [[buffer(0)]],
                                   uint t [[thread_position_in_grid]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  if (lane >= 16) return;
  out[t] = simd_shuffle(1.0f, ushort(lane + 16));
}

// Slots: 0 counter, 1 positions (2 uints per thread of the grid).
kernel void probe_threads_dispatch(device atomic_uint *counter [[buffer(0)]],
                                   device uint *positions [[buffer(1)]],
                                   uint t [[thread_position_in_grid]],
                                   uint size [[threads_per_threadgroup]],
                                   uint group [[threadgroup_position_in_grid]]) {
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  positions[t * 2 + 0] = group;
  positions[t * 2 + 1] = size;
}

// Slots: 0 out (1 float per thread), threadgroup 0 (one float per thread): a correct exchange
// through threadgroup memory, reversed across the group.
kernel void probe_threadgroup_exchange(device float *out [[buffer(0)]],
                                       threadgroup float *shared_values [[threadgroup(0)]],
                                       uint t [[thread_position_in_grid]],
                                       uint tid [[thread_index_in_threadgroup]],
                                       uint size [[threads_per_threadgroup]]) {
  shared_values[tid] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = shared_values[size - 1 - tid];
}

// Slots: 0 left (3 rows x 5), 1 right (4 rows x 5, used transposed), 2 out (3 x 4). One
// simdgroup runs a 4 x 4 tile with K from the left operand (dynamic): row 3 of the tile lies past
// every operand's extent. Mode multiply overwrites the output, multiply_accumulate adds to it.
template <matmul2d_descriptor::mode Mode>
void probe_matmul2d(device float *left, device float *right, device float *out) {
  tensor<device float, dextents<int32_t, 2>, tensor_inline> a(left, dextents<int32_t, 2>(5, 3));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> b(right, dextents<int32_t, 2>(5, 4));
  tensor<device float, dextents<int32_t, 2>, tensor_inline> c(out, dextents<int32_t, 2>(4, 3));
  constexpr auto descriptor =
      matmul2d_descriptor(4, 4, static_cast<int>(dynamic_extent), false, true, false, Mode);
  matmul2d<descriptor, execution_simdgroup> op;
  op.run(a, b, c);
}
kernel void probe_matmul2d_multiply(device float *left [[buffer(0)]],
                                    device float *right [[buffer(1)]],
                                    device float *out [[buffer(2)]]) {
  probe_matmul2d<matmul2d_descriptor::mode::multiply>(left, right, out);
}
kernel void probe_matmul2d_accumulate(device float *left [[buffer(0)]],
                                      device float *right [[buffer(1)]],
                                      device float *out [[buffer(2)]]) {
  probe_matmul2d<matmul2d_descriptor::mode::multiply_accumulate>(left, right, out);
}
