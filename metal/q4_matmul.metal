// GGML Q4_0 dense projection pipelines that need nothing beyond Metal 3 (spec §5.5, §5.6):
// kernel_mul_mv_q4_0_f32 (M <= 8) and kernel_mul_mm_q4_0_f32 (the simdgroup-matrix route). The
// tensor-API routes live in q4_matmul_tensor.metal, built into a separate, optional library.
//
// NUMERIC CONTRACT: weights are dequantised exactly, w = float(d) * float(nibble - 8) (an 11-bit
// significand times an integer in [-8, 7] fits binary32), and every product is accumulated in F32
// with fused multiply-adds; nothing is rounded to half precision. The results therefore meet the
// suite's F32 accumulation bound against a float64 reference of the dequantised weights
// (tests/python/tolerances.py), like the CPU oracle. (llama.cpp's d * (sumq - 8 * sumy) factoring is
// deliberately not used: it cancels, so an all-zero block need not give exactly zero.)
//
// Function constants (the label suffix |700:i1|701:i1|702:i1 of every Q4 pipeline): 700 is the
// batch count, 701 and 702 the broadcast ratios r2 and r3 of the weight over the input batches.
//
// Bindings and geometry (csrc/ops/q4_matmul.cpp with csrc/backend/metal/kernels.cpp):
//   mat-vec: 0 weight, 1 input, 2 output, 3 GgmlMatmulMvParams; grid [ceil(N/8), M, batch],
//            threads [8, 8, 1] (2 simdgroups x 4 output rows), no threadgroup memory.
//   simdgroup mm: 0 GgmlMatmulMmParams, 1 weight, 2 input, 3 output; grid [ceil(M/32),
//            ceil(N/64), batch], 128 threads (4 simdgroups), threadgroup memory index 0 of 8192 bytes.
#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "backend/common/q4_0_block.h"

using namespace metal;
using routemm::kernels::GgmlMatmulMmParams;
using routemm::kernels::GgmlMatmulMvParams;

constant int routemm_q4_batch [[function_constant(700)]];
constant int routemm_q4_r2 [[function_constant(701)]];
constant int routemm_q4_r3 [[function_constant(702)]];  // nb03 batches are unused (nb03 = 0)

namespace {

constant constexpr uint kBlockValues = 32;
constant constexpr uint kBlockBytes = 18;
constant constexpr uint kMvRowsPerSimdgroup = 4;
constant constexpr uint kMvRowsPerGroup = 8;
constant constexpr uint kMmTokens = 32;   // token tile of the simdgroup route
constant constexpr uint kMmOutputs = 64;  // output tile of every matrix route
constant constexpr uint kMmDepth = 16;    // K positions staged per step (half a Q4_0 block)
constant constexpr uint kMmThreads = 128;

// The scale of a block: raw binary16 bits, little-endian, at the block's first two bytes (blocks
// are 2-byte aligned inside a row).
inline float block_scale(device const uchar* block) {
  return float(as_type<half>(*reinterpret_cast<device const ushort*>(block)));
}

// Value j (0..31) of a block, exactly dequantised.
inline float block_value(device const uchar* block, float d, uint j) {
  const uint byte = block[2 + (j & 15u)];
  const uint nibble = j < 16 ? (byte & 15u) : (byte >> 4);
  return d * float(int(nibble) - 8);
}

}  // namespace

// Each simdgroup owns 4 consecutive output rows; lane l takes half-block (l & 1) of blocks l/2,
// l/2 + 16, ...; each lane's 16 values are FMA'd in order, then one simd_sum per row.
kernel void kernel_mul_mv_q4_0_f32(device const uchar *weight [[buffer(0)]],
                                   device const float *input [[buffer(1)]],
                                   device float *output [[buffer(2)]],
                                   constant GgmlMatmulMvParams &p [[buffer(3)]],
                                   uint3 group [[threadgroup_position_in_grid]],
                                   uint simdgroup [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  const long n = p.ne01;
  const long k = p.ne00;
  const long token = group.y;
  const long batch = group.z;
  if (token >= p.ne1 || batch >= routemm_q4_batch) return;
  const long first_row = long(group.x) * kMvRowsPerGroup + long(simdgroup) * kMvRowsPerSimdgroup;
  if (first_row >= n) return;

  const long blocks_per_row = k / kBlockValues;
  const ulong row_bytes = ulong(blocks_per_row) * kBlockBytes;
  device const uchar* w_batch = weight + ulong(batch / routemm_q4_r2) * row_bytes * ulong(n);
  device const float* x = input + (batch * p.ne1 + token) * p.ne10;
  const uint half_block = lane & 1u;

  float sums[kMvRowsPerSimdgroup] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (long b = lane >> 1; b < blocks_per_row; b += 16) {
    device const float* xb = x + b * kBlockValues + half_block * 16;
    for (uint r = 0; r < kMvRowsPerSimdgroup; ++r) {
      const long row = first_row + r;
      if (row >= n) break;
      device const uchar* block = w_batch + ulong(row) * row_bytes + ulong(b) * kBlockBytes;
      const float d = block_scale(block);
      for (uint j = 0; j < 16; ++j) {
        sums[r] = fma(block_value(block, d, half_block * 16 + j), xb[j], sums[r]);
      }
    }
  }
  for (uint r = 0; r < kMvRowsPerSimdgroup; ++r) {
    const float total = simd_sum(sums[r]);
    const long row = first_row + r;
    if (lane == 0 && row < n) output[(batch * p.ne1 + token) * p.ne0 + row] = total;
  }
}

// Tile: 32 tokens x 64 outputs. Per K step of 16: the 64 x 16 weight panel (exact F32, 4096 bytes)
// and the 32 x 16 activation panel (2048 bytes) are staged; simdgroup s owns outputs
// [16 s, 16 s + 16) for all 32 tokens (4 x 2 accumulators of 8 x 8). At the end the accumulators
// go through threadgroup memory (32 x 64 F32 = 8192 bytes, reusing the panels) so edge tiles are
// written with bounds checks.
kernel void kernel_mul_mm_q4_0_f32(constant GgmlMatmulMmParams &p [[buffer(0)]],
                                   device const uchar *weight [[buffer(1)]],
                                   device const uchar *input [[buffer(2)]],
                                   device float *output [[buffer(3)]],
                                   threadgroup float *shmem [[threadgroup(0)]],
                                   uint3 group [[threadgroup_position_in_grid]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint simdgroup [[simdgroup_index_in_threadgroup]]) {
  const int m = p.ne1;
  const int n = p.ne0;
  const int k = p.ne00;
  const int batch = int(group.z);
  if (batch >= routemm_q4_batch) return;
  const int m0 = int(group.x * kMmTokens);
  const int n0 = int(group.y * kMmOutputs);

  device const uchar* w_batch = weight + ulong(batch / routemm_q4_r2) * p.nb02;
  device const uchar* x_batch = input + ulong(batch) * p.nb12;
  device float* y_batch = output + ulong(batch) * ulong(m) * ulong(n);

  threadgroup float* ws = shmem;                          // [64 outputs][16 k]
  threadgroup float* xs = shmem + kMmOutputs * kMmDepth;  // [32 tokens][16 k]

  simdgroup_float8x8 acc[8];
  for (uint i = 0; i < 8; ++i) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < k; k0 += int(kMmDepth)) {
    {  // weights: thread t stages output row t / 2, values 8 (t & 1) .. + 8 of this half block
      const uint r = tid >> 1;
      const uint j0 = (tid & 1u) * 8;
      const int row = n0 + int(r);
      const uint first = uint(k0) % kBlockValues;  // 0 or 16: which half of the block
      if (row < n) {
        device const uchar* block = w_batch + ulong(row) * p.nb01 + ulong(k0 / int(kBlockValues)) * kBlockBytes;
        const float d = block_scale(block);
        for (uint j = 0; j < 8; ++j) ws[r * kMmDepth + j0 + j] = block_value(block, d, first + j0 + j);
      } else {
        for (uint j = 0; j < 8; ++j) ws[r * kMmDepth + j0 + j] = 0.0f;
      }
    }
    {  // activations: thread t stages token t / 4, positions 4 (t & 3) .. + 4
      const uint tok = tid >> 2;
      const uint j0 = (tid & 3u) * 4;
      const int row = m0 + int(tok);
      device const float* x = reinterpret_cast<device const float*>(x_batch + ulong(row) * p.nb11);
      for (uint j = 0; j < 4; ++j) xs[tok * kMmDepth + j0 + j] = row < m ? x[k0 + int(j0 + j)] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < kMmDepth; kk += 8) {
      simdgroup_float8x8 a[4];
      simdgroup_float8x8 b[2];
      for (uint i = 0; i < 4; ++i) simdgroup_load(a[i], xs + i * 8 * kMmDepth + kk, kMmDepth);
      for (uint j = 0; j < 2; ++j) {
        // b[j][kk', col] = ws[(16 s + 8 j + col) * 16 + kk + kk']: the transposed panel.
        simdgroup_load(b[j], ws + (simdgroup * 16 + j * 8) * kMmDepth + kk, kMmDepth, ulong2(0, 0), true);
      }
      for (uint i = 0; i < 4; ++i) {
        for (uint j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i * 2 + j], a[i], b[j], acc[i * 2 + j]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  threadgroup float* tile = shmem;  // [32 tokens][64 outputs]
  for (uint i = 0; i < 4; ++i) {
    for (uint j = 0; j < 2; ++j) {
      simdgroup_store(acc[i * 2 + j], tile + i * 8 * kMmOutputs + simdgroup * 16 + j * 8, kMmOutputs);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < kMmTokens * kMmOutputs; e += kMmThreads) {
    const int tok = m0 + int(e / kMmOutputs);
    const int col = n0 + int(e % kMmOutputs);
    if (tok < m && col < n) y_batch[ulong(tok) * ulong(n) + ulong(col)] = tile[e];
  }
}
