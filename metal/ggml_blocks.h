// GGML block formats in MSL, shared by the quantised kernels of q4_matmul.metal and
// quantized_matmul_id.metal (the Metal side of csrc/backend/common/q4_0_block.h's layouts).
//
// NUMERIC CONTRACT: dequantisation is exact. A Q4_0 value is float(d) * float(nibble - 8), a Q8_0
// value float(d) * float(q) (an 11-bit significand times an integer of at most 8 bits fits
// binary32), and every product is accumulated in F32 with fused multiply-adds; nothing is rounded
// to half precision.
//
// The lane contract of the mat-vec kernels (kernel_mul_mv_{q4_0,q8_0}_f32 and the expert-ID direct
// kernels, which are therefore equal bit for bit on one expert matrix): lane l of a simdgroup owns
// half-block (l & 1) of blocks l / 2, l / 2 + 16, ... of every row it computes, FMAs that half
// block's 16 products in the order half_block_dot states into its per-row sum, and the row's
// result is one simd_sum. Activations are read as 16-byte vectors (packed_float4: inputs are only
// 4-byte aligned); weights as 2-byte words (blocks are 18 or 34 bytes long, so only 2-byte
// aligned inside a row).
#pragma once

#include <metal_stdlib>

using namespace metal;

namespace ggml_blocks {

constant constexpr uint kBlockValues = 32;
constant constexpr uint kSimdWidth = 32;

// Format tags: the bytes of a block, one exactly dequantised value, and a lane's half-block dot.
struct Q4_0 {};
struct Q8_0 {};

inline ulong block_bytes(Q4_0) { return 18; }
inline ulong block_bytes(Q8_0) { return 34; }

// The scale of a block: raw binary16 bits, little-endian, at the block's first two bytes.
inline float block_scale(device const uchar* block) {
  return float(as_type<half>(*reinterpret_cast<device const ushort*>(block)));
}

// Value j (0..31) of a block, exactly dequantised (d is block_scale(block)).
inline float block_value(Q4_0, device const uchar* block, float d, uint j) {
  const uint byte = block[2 + (j & 15u)];
  const uint nibble = j < 16 ? (byte & 15u) : (byte >> 4);
  return d * float(int(nibble) - 8);
}
inline float block_value(Q8_0, device const uchar* block, float d, uint j) {
  return d * float(as_type<char>(block[2 + j]));
}

// The 16 products of half-block `half_index` of `block` with the block's 32 activations `x`,
// FMA'd into `acc` in a fixed order.
//   Q4_0: half h owns quant bytes [8h, 8h + 8), so values j and j + 16 for j in [8h, 8h + 8):
//         the low nibbles (j ascending), then the high nibbles (j ascending).
//   Q8_0: half h owns values [16h, 16h + 16), j ascending.
inline float half_block_dot(Q4_0, device const uchar* block, uint half_index, device const float* x,
                            float acc) {
  const float d = block_scale(block);
  device const ushort* q = reinterpret_cast<device const ushort*>(block + 2 + 8 * half_index);
  device const packed_float4* lo = reinterpret_cast<device const packed_float4*>(x + 8 * half_index);
  device const packed_float4* hi = reinterpret_cast<device const packed_float4*>(x + 16 + 8 * half_index);
  const ushort words[4] = {q[0], q[1], q[2], q[3]};
  for (uint v = 0; v < 2; ++v) {
    const packed_float4 a = lo[v];
    for (uint i = 0; i < 4; ++i) {
      const uint byte = (words[2 * v + i / 2] >> (8 * (i & 1u))) & 0xffu;
      acc = fma(d * float(int(byte & 15u) - 8), a[i], acc);
    }
  }
  for (uint v = 0; v < 2; ++v) {
    const packed_float4 a = hi[v];
    for (uint i = 0; i < 4; ++i) {
      const uint byte = (words[2 * v + i / 2] >> (8 * (i & 1u))) & 0xffu;
      acc = fma(d * float(int(byte >> 4) - 8), a[i], acc);
    }
  }
  return acc;
}
inline float half_block_dot(Q8_0, device const uchar* block, uint half_index, device const float* x,
                            float acc) {
  const float d = block_scale(block);
  device const ushort* q = reinterpret_cast<device const ushort*>(block + 2 + 16 * half_index);
  device const packed_float4* xs = reinterpret_cast<device const packed_float4*>(x + 16 * half_index);
  for (uint v = 0; v < 4; ++v) {
    const packed_float4 a = xs[v];
    const ushort w0 = q[2 * v], w1 = q[2 * v + 1];
    const ushort words[2] = {w0, w1};
    for (uint i = 0; i < 4; ++i) {
      const uint byte = (words[i / 2] >> (8 * (i & 1u))) & 0xffu;
      acc = fma(d * float(as_type<char>(uchar(byte))), a[i], acc);
    }
  }
  return acc;
}

// ---- The formats of csrc/include/routemm/ggml_formats.h's kKernelFormats ------------------------
// Q4_1, Q5_0, Q5_1, MXFP4 (32-value blocks) and Q4_K, Q5_K, Q6_K (256-value super-blocks). Value i
// of a row is the F32 value ggml's to_float gives, operation for operation as the codec table
// (csrc/core/ggml_formats.cpp) computes it; a K-quant super-block is read as its eight 32-value
// sub-blocks, each with its own scale and min, so the lane contract above applies unchanged:
// lane l owns half-block (l & 1) of 32-value blocks l / 2, l / 2 + 16, ..., and FMAs that half
// block's 16 products in increasing position. Blocks are read bytewise (rows start anywhere: an
// MXFP4 block is 17 bytes). Products that ggml rounds twice (q * d + m, d1 * q - m1) are kept in
// separate statements and the metallibs are built without fast math, so nothing is fused.
struct Q4_1 {};
struct Q5_0 {};
struct Q5_1 {};
struct Mxfp4 {};
struct Q4_K {};
struct Q5_K {};
struct Q6_K {};

inline uint super_values(Q4_1) { return 32; }
inline uint super_values(Q5_0) { return 32; }
inline uint super_values(Q5_1) { return 32; }
inline uint super_values(Mxfp4) { return 32; }
inline uint super_values(Q4_K) { return 256; }
inline uint super_values(Q5_K) { return 256; }
inline uint super_values(Q6_K) { return 256; }
inline ulong super_bytes(Q4_1) { return 20; }
inline ulong super_bytes(Q5_0) { return 22; }
inline ulong super_bytes(Q5_1) { return 24; }
inline ulong super_bytes(Mxfp4) { return 17; }
inline ulong super_bytes(Q4_K) { return 144; }
inline ulong super_bytes(Q5_K) { return 176; }
inline ulong super_bytes(Q6_K) { return 210; }

// Bytes of a row of k values: Q4_0 / Q8_0 by their 32-value blocks, the others by super-block.
template <typename F>
inline ulong row_bytes(F format, uint k) {
  return ulong(k / super_values(format)) * super_bytes(format);
}
inline ulong row_bytes(Q4_0 format, uint k) { return ulong(k / kBlockValues) * block_bytes(format); }
inline ulong row_bytes(Q8_0 format, uint k) { return ulong(k / kBlockValues) * block_bytes(format); }

inline float half_at(device const uchar* p) { return float(as_type<half>(ushort(p[0] | (p[1] << 8)))); }

// Code j (0..31) of a 32-value block of 4-bit codes at qs: low nibbles, then high nibbles.
inline uint nibble(device const uchar* qs, uint j) { return j < 16 ? (qs[j] & 15u) : (qs[j - 16] >> 4); }

// The fifth bit of code j of a Q5_0 / Q5_1 block (32 bits at qh, little endian), as 0 or 16.
inline uint fifth_bit(device const uchar* qh, uint j) { return ((qh[j >> 3] >> (j & 7u)) & 1u) << 4; }

inline float value_at(Q4_1, device const uchar* b, uint j) {
  const float y = float(nibble(b + 4, j)) * half_at(b);
  return y + half_at(b + 2);
}
inline float value_at(Q5_0, device const uchar* b, uint j) {
  return float(int(nibble(b + 6, j) | fifth_bit(b + 2, j)) - 16) * half_at(b);
}
inline float value_at(Q5_1, device const uchar* b, uint j) {
  const float y = float(nibble(b + 8, j) | fifth_bit(b + 4, j)) * half_at(b);
  return y + half_at(b + 2);
}
// MXFP4's E2M1 values, doubled (integers); the block's scale is halved to match.
constant constexpr char kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float value_at(Mxfp4, device const uchar* b, uint j) {
  const uint e = b[0];  // 2^(e - 127) / 2, as ggml computes it (subnormal for e < 2)
  const float d = as_type<float>(e < 2 ? 0x00200000u << e : (e - 1u) << 23);
  return float(kMxfp4Values[nibble(b + 1, j)]) * d;
}

// The 6-bit scale and min of sub-block s (of 8) from Q4_K / Q5_K's 12 scale bytes at q.
inline uint2 scale_min_k4(uint s, device const uchar* q) {
  if (s < 4) return uint2(q[s] & 63u, q[s + 4] & 63u);
  return uint2((q[s + 4] & 15u) | ((q[s - 4] >> 6) << 4), (q[s + 4] >> 4) | ((q[s] >> 6) << 4));
}
// Value t (0..255) of a Q4_K / Q5_K super-block: d1 * q - m1 with d1 = d * sc, m1 = dmin * m.
inline float k4_value(device const uchar* b, uint s, uint q) {
  const uint2 sm = scale_min_k4(s, b + 4);
  const float d1 = half_at(b) * float(sm.x);
  const float m1 = half_at(b + 2) * float(sm.y);
  const float y = d1 * float(q);
  return y - m1;
}
inline float value_at(Q4_K, device const uchar* b, uint t) {
  const uint s = t >> 5, l = t & 31u;
  const uchar byte = b[16 + 32 * (s >> 1) + l];
  return k4_value(b, s, (s & 1u) ? (byte >> 4) : (byte & 15u));
}
inline float value_at(Q5_K, device const uchar* b, uint t) {
  const uint s = t >> 5, l = t & 31u;
  const uchar byte = b[48 + 32 * (s >> 1) + l];
  const uint high = ((b[16 + l] >> s) & 1u) << 4;
  return k4_value(b, s, ((s & 1u) ? (byte >> 4) : (byte & 15u)) + high);
}
inline float value_at(Q6_K, device const uchar* b, uint t) {
  const uint half_index = t >> 7, u = t & 127u;  // two halves of 128 values
  const uint quarter = u >> 5, l = u & 31u;      // values l + 32 * quarter of the half
  device const uchar* ql = b + 64 * half_index;
  device const uchar* qh = b + 128 + 32 * half_index;
  device const char* sc = reinterpret_cast<device const char*>(b + 192 + 8 * half_index);
  const uchar low = ql[l + 32 * (quarter & 1u)];
  const uint q = ((quarter < 2 ? low & 15u : low >> 4) | (((qh[l] >> (2 * quarter)) & 3u) << 4));
  const float ds = half_at(b + 208) * float(sc[l / 16 + 2 * quarter]);
  return ds * float(int(q) - 32);
}

// Value i of a row of `format`.
template <typename F>
inline float row_value(F format, device const uchar* row, uint i) {
  const uint v = super_values(format);
  return value_at(format, row + ulong(i / v) * super_bytes(format), i % v);
}

// Half-block `half_index` of 32-value block b of `row` with the block's 32 activations `x`, FMA'd
// into `acc`: Q4_0 / Q8_0 through half_block_dot's order, the other formats position by position.
template <typename F>
inline float block_dot(F format, device const uchar* row, uint b, uint half_index, device const float* x,
                       float acc) {
  for (uint j = 16 * half_index; j < 16 * half_index + 16; ++j) {
    acc = fma(row_value(format, row, b * kBlockValues + j), x[j], acc);
  }
  return acc;
}
inline float block_dot(Q4_0 format, device const uchar* row, uint b, uint half_index, device const float* x,
                       float acc) {
  return half_block_dot(format, row + ulong(b) * block_bytes(format), half_index, x, acc);
}
inline float block_dot(Q8_0 format, device const uchar* row, uint b, uint half_index, device const float* x,
                       float acc) {
  return half_block_dot(format, row + ulong(b) * block_bytes(format), half_index, x, acc);
}

// The 8 weights at row positions [i, i + 8) (inside one 16-value half block) into `out`.
template <typename F>
inline void stage_weights(F format, device const uchar* row, uint i, threadgroup float* out) {
  for (uint j = 0; j < 8; ++j) out[j] = row_value(format, row, i + j);
}
template <typename F>
inline void stage_block_weights(F format, device const uchar* row, uint i, threadgroup float* out) {
  device const uchar* block = row + ulong(i / kBlockValues) * block_bytes(format);
  const float d = block_scale(block);
  for (uint j = 0; j < 8; ++j) out[j] = block_value(format, block, d, i % kBlockValues + j);
}
inline void stage_weights(Q4_0 format, device const uchar* row, uint i, threadgroup float* out) {
  stage_block_weights(format, row, i, out);
}
inline void stage_weights(Q8_0 format, device const uchar* row, uint i, threadgroup float* out) {
  stage_block_weights(format, row, i, out);
}

// Worker w's share of the dots of rows [0, rows) (rows <= Rows) starting at `first_row`, row r at
// first_row + r * row_bytes, with the K activations `x`, when `workers` threads (even) split each
// row: worker w owns half-block (w & 1) of blocks w / 2, w / 2 + workers / 2, ..., FMA'd in that
// order. sums[r] gets the worker's partial sum; rows past `rows` stay at +0.
template <typename F, uint Rows>
inline void worker_row_dots(F format, device const uchar* first_row, ulong row_bytes, uint rows,
                            device const float* x, uint k, uint worker, uint workers, thread float* sums) {
  for (uint r = 0; r < Rows; ++r) sums[r] = 0.0f;
  const uint blocks = k / kBlockValues;
  const uint half_index = worker & 1u;
  for (uint b = worker >> 1; b < blocks; b += workers / 2) {
    device const float* xb = x + b * kBlockValues;
    for (uint r = 0; r < Rows; ++r) {
      if (r >= rows) break;
      sums[r] = block_dot(format, first_row + ulong(r) * row_bytes, b, half_index, xb, sums[r]);
    }
  }
}

// The lane contract above: one simdgroup splits each row (the caller reduces with simd_sum).
template <typename F, uint Rows>
inline void lane_row_dots(F format, device const uchar* first_row, ulong row_bytes, uint rows,
                          device const float* x, uint k, uint lane, thread float* sums) {
  worker_row_dots<F, Rows>(format, first_row, row_bytes, rows, x, k, lane, kSimdWidth, sums);
}

// ---- The nr2 mat-vec (spec §5.5) -------------------------------------------------------------------
// kNr2Rows rows of one activation row per threadgroup of kNr2Simdgroups simdgroups (128 threads):
// worker_row_dots with 128 workers (thread t owns half-block t & 1 of blocks t / 2, t / 2 + 64,
// ...); each simdgroup reduces its lanes with simd_sum, lane 0 stores the result in slot
// [row][simdgroup] of the [2][32] F32 `slots` (256 bytes of threadgroup memory; simdgroup 0 zeroes
// slots 4..31), and after one barrier simdgroup r reduces row r's 32 slots with simd_sum. Returns
// that total (meaningful on simdgroups r < kNr2Rows). kernel_mul_mv_q8_0_f32_nr2 and the Q8_0
// expert-ID nr2 pipeline both run it, so their rows agree bit for bit. Every thread of the
// threadgroup must call it (it has a barrier).
constant constexpr uint kNr2Rows = 2;
constant constexpr uint kNr2Simdgroups = 4;

template <typename F>
inline float nr2_row_dots(F format, device const uchar* first_row, ulong row_bytes, uint rows,
                          device const float* x, uint k, threadgroup float* slots, uint simdgroup,
                          uint lane) {
  float sums[kNr2Rows];
  worker_row_dots<F, kNr2Rows>(format, first_row, row_bytes, rows, x, k, simdgroup * kSimdWidth + lane,
                               kNr2Simdgroups * kSimdWidth, sums);
  for (uint r = 0; r < kNr2Rows; ++r) {
    const float partial = simd_sum(sums[r]);
    if (lane == 0) slots[r * kSimdWidth + simdgroup] = partial;
    if (simdgroup == 0 && lane >= kNr2Simdgroups) slots[r * kSimdWidth + lane] = 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simdgroup >= kNr2Rows) return 0.0f;
  return simd_sum(slots[simdgroup * kSimdWidth + lane]);
}

// ---- The simdgroup-matrix tile of the matrix routes ----------------------------------------------
// 32 rows (tokens, or an expert's routed rows) x 64 outputs, 128 threads (4 simdgroups). Per K step
// of 16 (half a block) the 64 x 16 weight panel (exactly dequantised F32, 4096 bytes) and the
// 32 x 16 activation panel (2048 bytes) are staged in threadgroup memory; simdgroup s owns outputs
// [16 s, 16 s + 16) for all 32 rows, as 4 x 2 accumulators of 8 x 8. The 8 x 8 tile is Apple's
// matrix unit (simdgroup_multiply_accumulate); 32 x 64 keeps 8 accumulators per simdgroup in
// registers and each staged weight value is used by 32 rows. At the end the accumulators go
// through threadgroup memory (32 x 64 F32 = 8192 bytes, reusing the panels) so that callers write
// edge tiles with bounds checks and scatter rows where they belong.
constant constexpr uint kMmRows = 32;
constant constexpr uint kMmOutputs = 64;
constant constexpr uint kMmDepth = 16;
constant constexpr uint kMmThreads = 128;

// Accumulates rows x outputs [n0, n0 + 64) over K into `shmem`: on return (after a barrier) shmem
// holds the tile as [32 rows][64 outputs] F32; outputs past n are zero. `x_row` is the activation
// row this thread stages (row tid / 4 of the tile); `x_valid` false stages zeros (rows past the
// tile's count). The weight matrix starts at `weight`, rows `row_bytes` apart.
template <typename F>
inline void mm_tile(F format, device const uchar* weight, ulong row_bytes, uint n, uint n0, uint k,
                    device const float* x_row, bool x_valid, threadgroup float* shmem, uint tid,
                    uint simdgroup) {
  threadgroup float* ws = shmem;                          // [64 outputs][16 k]
  threadgroup float* xs = shmem + kMmOutputs * kMmDepth;  // [32 rows][16 k]

  simdgroup_float8x8 acc[8];
  for (uint i = 0; i < 8; ++i) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  const uint w_out = tid >> 1;         // weights: thread t stages output t / 2,
  const uint w_j0 = (tid & 1u) * 8;    //   values 8 (t & 1) .. + 8 of the half block
  const uint x_tok = tid >> 2;         // activations: thread t stages row t / 4,
  const uint x_j0 = (tid & 3u) * 4;    //   positions 4 (t & 3) .. + 4 (one 16-byte vector)
  const bool w_valid = n0 + w_out < n;
  device const uchar* w_row = weight + ulong(w_valid ? n0 + w_out : 0) * row_bytes;
  for (uint k0 = 0; k0 < k; k0 += kMmDepth) {
    if (w_valid) {
      stage_weights(format, w_row, k0 + w_j0, ws + w_out * kMmDepth + w_j0);
    } else {
      for (uint j = 0; j < 8; ++j) ws[w_out * kMmDepth + w_j0 + j] = 0.0f;
    }
    if (x_valid) {
      const packed_float4 a = *reinterpret_cast<device const packed_float4*>(x_row + k0 + x_j0);
      for (uint j = 0; j < 4; ++j) xs[x_tok * kMmDepth + x_j0 + j] = a[j];
    } else {
      for (uint j = 0; j < 4; ++j) xs[x_tok * kMmDepth + x_j0 + j] = 0.0f;
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
  for (uint i = 0; i < 4; ++i) {
    for (uint j = 0; j < 2; ++j) {
      simdgroup_store(acc[i * 2 + j], shmem + i * 8 * kMmOutputs + simdgroup * 16 + j * 8, kMmOutputs);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

}  // namespace ggml_blocks
