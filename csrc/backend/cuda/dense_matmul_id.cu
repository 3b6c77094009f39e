// CUDA kernels of the expert-ID matmul (spec §7.4, §7.5): dense_matmul_id_direct_*,
// dense_matmul_id_map_distinct and dense_matmul_id_grouped_*.
//
// NUMERIC CONTRACT (shared by the direct and grouped kernels, which are therefore bit-identical on
// CUDA; it depends on k only, never on m, the tile, the grid or the load width):
//   1. The inner dimension is padded with zeros to kp = round_up(k, 64); a padded position
//      contributes fma(+0, +0, acc).
//   2. Chunk c covers inner positions [8c, 8c + 8). Eight partial sums s_0..s_7 start at +0.0f;
//      s_p takes the chunks c = p, p + 8, p + 16, ... < kp / 8 in increasing order and, within a
//      chunk, the positions in increasing order: s_p = fma(widen(w[col, inner]), x[row, inner], s_p),
//      one correctly rounded F32 FMA per position.
//   3. out = ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), i.e. the xor-4, xor-2, xor-1
//      butterfly over the 8 lanes that hold s_0..s_7 (each step: own + partner's).
// widen() is exact. An id >= n_experts gives an all-zero row (+0.0f), without forming a weight
// address. Only NaN payloads are not pinned.
//
// Geometry (what the KernelDefs below tell the front door, and how each kernel reads its grid):
//   direct : grid [ceil(n / 8), m * top_k, 1], 64 threads. Block (x, y) computes columns
//            [8x, 8x + 8) of flat row y: 2 warps x 4 columns, 8 lanes (one per s_p) per column.
//            Where rows share experts enough, the block of the first flat row routed to an expert
//            computes that tile for every row routed there and the others exit (see
//            direct_gathered_kernel); the grid and the tile are the same either way.
//   map    : grid [1, 1, 1], threads [1024] (the spec's geometry, which receipts show). The launch
//            runs one 256-thread CTA per tile of 256 flat rows, in one kernel or three (see
//            map_count_kernel).
//   grouped: grid [ceil(m / 32), ceil(n / 64), n_experts], 256 threads. Tile (x, y, e) is routed
//            rows [32x, 32x + 32) of expert e times columns [64y, 64y + 64): 32 thread tiles of 8
//            rows x 8 columns, 8 lanes (one per s_p) per tile, K staged through shared memory in
//            slices of 64 (one chunk per s_p), double-buffered. The launch runs the tiles that hold
//            routed rows as a work list on a persistent grid (see launch_grouped).
// The host wrappers launch the direct grid flattened into x (no 65535 limit on y); which direct
// kernel runs, and in which block order, depends on the shape only (see launch_direct).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "grouped_work_list.cuh"
#include "hopper_support.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "smem_opt_in.h"

#ifndef ROUTEMM_CUDA_DENSE_MATMUL_ID_SHA256
#define ROUTEMM_CUDA_DENSE_MATMUL_ID_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kDirectCols = 8;        // columns per direct block
constexpr uint32_t kDirectThreads = 64;    // 2 warps
constexpr uint32_t kDirectUnroll = 8;      // chunk loads in flight per lane
constexpr uint32_t kGatherMaxRows = 1024;  // flat rows up to which direct gathers rows per expert
constexpr uint32_t kGatherRows = 8;        // rows a gathered direct block computes per weight pass
constexpr uint32_t kGroupRows = 32;        // routed rows per grouped block
constexpr uint32_t kGroupCols = 64;        // columns per grouped block
constexpr uint32_t kGroupThreads = 256;    // 8 warps
constexpr uint32_t kSlice = 64;            // inner positions per shared-memory slice
constexpr uint32_t kMapMaxThreads = 1024;

// ---- element access ------------------------------------------------------------------------------

struct BF16Tag {};
struct F16Tag {};

// Raw 8-element chunk of weights, widened element by element (compile-time index after unrolling).
template <typename T>
struct Chunk;

template <>
struct Chunk<float> {
  using elem = float;
  float4 a, b;
  __device__ __forceinline__ float get(int j) const {
    switch (j) {
      case 0: return a.x;
      case 1: return a.y;
      case 2: return a.z;
      case 3: return a.w;
      case 4: return b.x;
      case 5: return b.y;
      case 6: return b.z;
      default: return b.w;
    }
  }
  __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
};

__device__ __forceinline__ uint32_t word_of(const uint4& q, int i) {
  switch (i) {
    case 0: return q.x;
    case 1: return q.y;
    case 2: return q.z;
    default: return q.w;
  }
}

template <>
struct Chunk<BF16Tag> {
  using elem = uint16_t;
  uint4 q;
  __device__ __forceinline__ float get(int j) const {
    const uint32_t w = word_of(q, j >> 1);
    return __uint_as_float((j & 1) ? (w & 0xFFFF0000u) : (w << 16));
  }
  __device__ __forceinline__ void zero() { q = make_uint4(0, 0, 0, 0); }
};

template <>
struct Chunk<F16Tag> {
  using elem = uint16_t;
  uint4 q;
  __device__ __forceinline__ float get(int j) const {
    const uint32_t w = word_of(q, j >> 1);
    return __half2float(
        __ushort_as_half(static_cast<unsigned short>((j & 1) ? (w >> 16) : (w & 0xFFFFu))));
  }
  __device__ __forceinline__ void zero() { q = make_uint4(0, 0, 0, 0); }
};

// Streaming 16-byte load that does not allocate in L1 (weights are read once per use).
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}
__device__ __forceinline__ float4 ld_stream_f4(const void* p) {
  const uint4 r = ld_stream_u4(p);
  return make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                     __uint_as_float(r.w));
}

// Loads weight chunk c of one row (row = pointer to element 0 of [col, :]); positions >= k are 0.
// VEC: the row is 16-byte aligned and k % 8 == 0, so a chunk is whole or entirely past k.
template <typename T, bool VEC>
__device__ __forceinline__ Chunk<T> load_w_chunk(const void* row, uint32_t c, uint32_t k) {
  Chunk<T> ch;
  const uint32_t base = c * 8;
  if constexpr (VEC) {
    if (base < k) {
      if constexpr (sizeof(typename Chunk<T>::elem) == 4) {
        const float* p = static_cast<const float*>(row) + base;
        ch.a = ld_stream_f4(p);
        ch.b = ld_stream_f4(p + 4);
      } else {
        ch.q = ld_stream_u4(static_cast<const uint16_t*>(row) + base);
      }
    } else {
      ch.zero();
    }
  } else {
    if constexpr (sizeof(typename Chunk<T>::elem) == 4) {
      const float* p = static_cast<const float*>(row);
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (base + j < k) ? __ldg(p + base + j) : 0.f;
      ch.a = make_float4(v[0], v[1], v[2], v[3]);
      ch.b = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      const unsigned short* p = static_cast<const unsigned short*>(row);
      uint32_t v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = (base + j < k) ? __ldg(p + base + j) : 0u;
      ch.q = make_uint4(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16),
                        v[6] | (v[7] << 16));
    }
  }
  return ch;
}

// Activation chunk c of one input row (F32); positions >= k are 0.
template <bool VEC>
__device__ __forceinline__ Chunk<float> load_x_chunk(const float* row, uint32_t c, uint32_t k) {
  Chunk<float> ch;
  const uint32_t base = c * 8;
  if constexpr (VEC) {
    if (base < k) {
      ch.a = __ldg(reinterpret_cast<const float4*>(row + base));
      ch.b = __ldg(reinterpret_cast<const float4*>(row + base + 4));
    } else {
      ch.zero();
    }
  } else {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (base + j < k) ? __ldg(row + base + j) : 0.f;
    ch.a = make_float4(v[0], v[1], v[2], v[3]);
    ch.b = make_float4(v[4], v[5], v[6], v[7]);
  }
  return ch;
}

// Step 3 of the contract for one value held by the 8 lanes p = lane & 7 of a group.
__device__ __forceinline__ float reduce8(float s) {
  s = s + __shfl_xor_sync(0xFFFFFFFFu, s, 4);
  s = s + __shfl_xor_sync(0xFFFFFFFFu, s, 2);
  s = s + __shfl_xor_sync(0xFFFFFFFFu, s, 1);
  return s;
}

__device__ __forceinline__ const float* input_row(const DenseMatmulIdKernelParams& p, const char* x,
                                                  uint32_t flat) {
  const uint32_t token = flat / p.top_k;
  const uint32_t slot = flat - token * p.top_k;
  return reinterpret_cast<const float*>(x + uint64_t{token} * p.input_token_stride_bytes +
                                        uint64_t{slot} * p.input_slot_stride_bytes);
}

// ---- direct --------------------------------------------------------------------------------------

// Loads the weight chunks of slice iteration i (chunks (i + u) * 8 + part, u < kDirectUnroll);
// chunks past the row, or all of them when !active, are zero.
template <typename T, bool VEC>
__device__ __forceinline__ void load_w_slice(const void* wrow, uint32_t i, uint32_t slices,
                                             uint32_t part, uint32_t k, bool active,
                                             Chunk<T> (&wc)[kDirectUnroll]) {
#pragma unroll
  for (uint32_t u = 0; u < kDirectUnroll; ++u) {
    if (active && i + u < slices) {
      wc[u] = load_w_chunk<T, VEC>(wrow, (i + u) * 8 + part, k);
    } else {
      wc[u].zero();
    }
  }
}

// Dot product of one weight column (lane group of 8, this lane owning s_p, p = part) with one
// input row, by the numeric contract. A slice's weight and activation chunks are all loaded before
// the first FMA, so kDirectUnroll loads of each are in flight per lane.
template <typename T, bool VEC>
__device__ __forceinline__ float dot_row(const DenseMatmulIdKernelParams& p, const void* wrow,
                                         const float* xrow, uint32_t part) {
  float s = 0.f;
  const uint32_t slices = (p.k + kSlice - 1) / kSlice;  // chunks per lane
  for (uint32_t i = 0; i < slices; i += kDirectUnroll) {
    Chunk<T> wc[kDirectUnroll];
    Chunk<float> xc[kDirectUnroll];
    load_w_slice<T, VEC>(wrow, i, slices, part, p.k, true, wc);
#pragma unroll
    for (uint32_t u = 0; u < kDirectUnroll; ++u) {
      if (i + u < slices) {
        xc[u] = load_x_chunk<VEC>(xrow, (i + u) * 8 + part, p.k);
      } else {
        xc[u].zero();
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kDirectUnroll; ++u) {
      if (i + u < slices) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(wc[u].get(j), xc[u].get(j), s);
      }
    }
  }
  return s;
}

// Activations of up to kGatherRows input rows for one slice iteration of dot_rows (kDirectUnroll
// chunks per lane = 512 positions per row), split into the first and second half of every chunk so
// that the 8 lanes of a column group read 8 consecutive float4 (no bank conflicts).
struct StagedRows {
  float4 lo[kGatherRows][kDirectUnroll * 8];  // positions [8c, 8c + 4) of chunk c of the slice
  float4 hi[kGatherRows][kDirectUnroll * 8];  // positions [8c + 4, 8c + 8)
};

// Dot products of one weight column with nrows (2..kGatherRows) input rows, by the numeric contract
// for each row: every weight chunk is loaded once and applied to each row in the contract's chunk
// and position order, so a row's result is bit-identical to dot_row. Per slice iteration the whole
// block stages the rows' activations in shared memory (the weight loads already in flight), then
// computes from there; the activations are read from L2 once per block instead of once per FMA
// group with a round trip each. Vectorised path only (16-byte aligned rows, k % 8 == 0). Every
// thread of the block must call it (it synchronises); lanes of a warp past n pass active = false.
template <typename T>
__device__ __forceinline__ void dot_rows(const DenseMatmulIdKernelParams& p, const void* wrow,
                                         const char* x, const uint16_t* rows, uint32_t nrows,
                                         uint32_t part, bool active, StagedRows& st,
                                         float (&s)[kGatherRows]) {
  constexpr uint32_t kVecPerRow = kDirectUnroll * 8 * 2;  // float4s per row per slice iteration
  constexpr uint32_t kLoads = kGatherRows * kVecPerRow / kDirectThreads;
#pragma unroll
  for (uint32_t q = 0; q < kGatherRows; ++q) s[q] = 0.f;
  const uint32_t slices = (p.k + kSlice - 1) / kSlice;
  for (uint32_t i = 0; i < slices; i += kDirectUnroll) {
    Chunk<T> wc[kDirectUnroll];
    load_w_slice<T, true>(wrow, i, slices, part, p.k, active, wc);
    const uint32_t first = i * kSlice;  // first inner position of this slice iteration
    float4 v[kLoads];
#pragma unroll
    for (uint32_t j = 0; j < kLoads; ++j) {
      const uint32_t t = threadIdx.x + j * kDirectThreads;
      const uint32_t q = t / kVecPerRow, f = t % kVecPerRow, pos = first + f * 4;
      v[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (q < nrows && pos < p.k) {
        v[j] = __ldg(reinterpret_cast<const float4*>(input_row(p, x, rows[q]) + pos));
      }
    }
    __syncthreads();  // the previous iteration's reads of st are done
#pragma unroll
    for (uint32_t j = 0; j < kLoads; ++j) {
      const uint32_t t = threadIdx.x + j * kDirectThreads;
      const uint32_t q = t / kVecPerRow, f = t % kVecPerRow;
      if (q < nrows) (f & 1 ? st.hi : st.lo)[q][f >> 1] = v[j];
    }
    __syncthreads();
    if (!active) continue;
#pragma unroll
    for (uint32_t u = 0; u < kDirectUnroll; ++u) {
      if (i + u < slices) {
#pragma unroll
        for (uint32_t q = 0; q < kGatherRows; ++q) {
          if (q < nrows) {
            Chunk<float> xc;
            xc.a = st.lo[q][u * 8 + part];
            xc.b = st.hi[q][u * 8 + part];
#pragma unroll
            for (int j = 0; j < 8; ++j) s[q] = fmaf(wc[u].get(j), xc.get(j), s[q]);
          }
        }
      }
    }
  }
}

// Per-row direct kernel: every block computes one tile of one flat row. With tile_major, blocks walk
// the column tiles outermost, so the blocks of one tile -- every flat row, among them the rows
// routed to the same expert -- are launched side by side and a weight tile that several rows share
// is read from DRAM once and by the others from L2 while it is still there. Otherwise (one token,
// whose rows share no expert) blocks walk the flat rows outermost, and the blocks launched together
// read one expert's consecutive tiles.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kDirectThreads)
    direct_kernel(const DenseMatmulIdKernelParams p, const char* __restrict__ w,
                  const char* __restrict__ x, const uint32_t* __restrict__ ids,
                  float* __restrict__ out, uint32_t tiles_x, uint64_t rows, bool tile_major) {
  const uint64_t block = blockIdx.x;
  const uint64_t tile64 = tile_major ? block / rows : block % tiles_x;
  const uint64_t flat64 = tile_major ? block % rows : block / tiles_x;
  if (tile64 >= tiles_x || flat64 >= rows) return;
  const uint32_t tile = static_cast<uint32_t>(tile64);
  const uint32_t flat = static_cast<uint32_t>(flat64);
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t part = lane & 7;  // which partial sum s_p this lane owns
  const uint32_t col = tile * kDirectCols + (threadIdx.x >> 5) * 4 + (lane >> 3);
  if (tile * kDirectCols + (threadIdx.x >> 5) * 4 >= p.n) return;  // whole warp past n

  const uint32_t id = __ldg(ids + flat);
  float s = 0.f;
  if (id < p.n_experts && col < p.n) {
    const void* wrow = w + uint64_t{id} * p.expert_stride_bytes +
                       uint64_t{col} * p.k * sizeof(typename Chunk<T>::elem);
    s = dot_row<T, VEC>(p, wrow, input_row(p, x, flat), part);
  }
  s = reduce8(s);
  if (part == 0 && col < p.n) out[uint64_t{flat} * p.n + col] = s;
}

// Resident blocks per SM the gathered kernel's register budget must allow: as many as the
// tile-major kernel fits with 2-byte weights (8); 6 with F32 weights, whose chunks take twice the
// registers (7 would leave 128 per thread and spill).
template <typename T>
constexpr uint32_t gather_min_blocks() {
  return sizeof(typename Chunk<T>::elem) == 4 ? 6 : 8;
}

// Gathered direct kernel (at most kGatherMaxRows flat rows): block (tile, flat)
// is the leader of its expert when no earlier flat row holds the same valid id; the leader computes
// its tile for every flat row routed to that expert, so each weight tile is read once, and the
// other blocks of that expert exit. Blocks walk the flat rows outermost (a leader's tiles are
// consecutive in memory). A block with an invalid id writes its own row's zeros.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kDirectThreads, gather_min_blocks<T>())
    direct_gathered_kernel(const DenseMatmulIdKernelParams p, const char* __restrict__ w,
                           const char* __restrict__ x, const uint32_t* __restrict__ ids,
                           float* __restrict__ out, uint32_t tiles_x, uint32_t rows) {
  __shared__ uint16_t members[kGatherMaxRows];  // flat rows of the leader's expert
  __shared__ uint32_t member_count;
  __shared__ StagedRows staged;
  const uint32_t flat = blockIdx.x / tiles_x;
  const uint32_t tile = blockIdx.x - flat * tiles_x;
  if (flat >= rows) return;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t warp = threadIdx.x >> 5;
  const uint32_t part = lane & 7;
  const uint32_t col = tile * kDirectCols + warp * 4 + (lane >> 3);
  const uint32_t id = __ldg(ids + flat);
  if (id >= p.n_experts) {  // an invalid id: this block writes its own row's zeros
    if (part == 0 && col < p.n) out[uint64_t{flat} * p.n + col] = 0.f;
    return;
  }

  // Membership in one round trip: every thread loads its share of the ids at once. The member list
  // is in no particular order (each row's result is independent of which group computes it).
  constexpr uint32_t kIdsPerThread = kGatherMaxRows / kDirectThreads;
  if (threadIdx.x == 0) member_count = 0;
  uint32_t seen[kIdsPerThread];
#pragma unroll
  for (uint32_t j = 0; j < kIdsPerThread; ++j) {
    const uint32_t f = threadIdx.x + j * kDirectThreads;
    seen[j] = f < rows ? __ldg(ids + f) : UINT32_MAX;
  }
  bool earlier = false;
#pragma unroll
  for (uint32_t j = 0; j < kIdsPerThread; ++j) {
    earlier |= threadIdx.x + j * kDirectThreads < flat && seen[j] == id;
  }
  if (__syncthreads_or(earlier)) return;  // another block leads this expert
#pragma unroll
  for (uint32_t j = 0; j < kIdsPerThread; ++j) {
    const uint32_t f = threadIdx.x + j * kDirectThreads;
    if (f >= flat && seen[j] == id) {
      members[atomicAdd(&member_count, 1u)] = static_cast<uint16_t>(f);
    }
  }
  __syncthreads();
  const uint32_t count = member_count;
  // A warp whose columns all lie past n computes nothing but still takes part in staging.
  const bool active = tile * kDirectCols + warp * 4 < p.n;

  const void* wrow = w + uint64_t{id} * p.expert_stride_bytes +
                     uint64_t{col < p.n ? col : 0} * p.k * sizeof(typename Chunk<T>::elem);
  // A lone row (and every row on the element-wise path) takes dot_row; groups of 2..kGatherRows
  // rows take dot_rows. The group sizes depend only on count, so the branch is block-uniform.
  for (uint32_t g = 0; g < count;) {
    const uint32_t nrows = VEC ? min(kGatherRows, count - g) : 1;
    if (nrows == 1) {
      if (active) {
        const float v = reduce8(dot_row<T, VEC>(p, wrow, input_row(p, x, members[g]), part));
        if (part == 0 && col < p.n) out[uint64_t{members[g]} * p.n + col] = v;
      }
    } else if constexpr (VEC) {
      float s[kGatherRows];
      dot_rows<T>(p, wrow, x, members + g, nrows, part, active, staged, s);
#pragma unroll
      for (uint32_t q = 0; q < kGatherRows; ++q) {
        const float v = reduce8(s[q]);
        if (active && q < nrows && part == 0 && col < p.n) {
          out[uint64_t{members[g + q]} * p.n + col] = v;
        }
      }
    }
    g += nrows;
  }
}

// ---- map_distinct --------------------------------------------------------------------------------

// The map routes every flat row with a valid id, repeated ids included, into one list ordered by
// expert: expert e's rows are routed[start(e), start(e) + counts[e]) in flat-row order, start(e)
// being the counts of the experts before e (the segments the grouped work list reads, see
// grouped_work_list.cuh). The list holds at most m * top_k rows, within the scratch's
// n_experts * m entries since the grouped route needs top_k <= n_experts.
//
// It runs over tiles of kMapTileRows flat rows, one CTA per tile and one thread per flat row. Each
// CTA builds its tile's per-expert row bitmap in shared memory: bit (f - f0) of expert e's bitmap
// is set for every flat row f of the tile whose id is e.
//   - map_count_kernel writes each expert's row count in the tile to a workspace
//     (tile_base[tile][expert]) and zeroes the output rows of malformed ids;
//   - map_offsets_kernel (one CTA, a thread per expert) turns those counts into each tile's first
//     list position per expert (the expert's segment start plus its rows in the earlier tiles)
//     and writes counts[];
//   - map_scatter_kernel rebuilds the bitmap and writes every row at its tile's position plus the
//     expert's rows below it in the tile.
// With a single tile (m * top_k <= 256: decode batches) the scatter kernel runs alone: it takes the
// segment starts from its own bitmap and zeroes the malformed ids' rows itself (`zero_out`).
// Entries land in flat-row order, deterministically; the work is proportional to m * top_k plus
// 2 * n_experts * tiles workspace reads.
constexpr uint32_t kMapTileRows = 256;  // = threads per CTA
constexpr uint32_t kMapTileWords = kMapTileRows / 32;

// Builds the bitmap of the CTA's tile (bits[e * kMapTileWords + w]); ends with a CTA barrier. With
// `zero_invalid`, also zeroes the output rows of ids >= n_experts. Returns this thread's id (or
// UINT32_MAX past the last flat row).
__device__ __forceinline__ uint32_t map_tile_bitmap(const DenseMatmulIdKernelParams& p,
                                                    const uint32_t* __restrict__ ids, float* out,
                                                    bool zero_invalid, uint32_t* bits) {
  const uint32_t E = p.n_experts, tid = threadIdx.x;
  for (uint32_t i = tid; i < E * kMapTileWords; i += kMapTileRows) bits[i] = 0;
  __syncthreads();
  const uint64_t flat = uint64_t{blockIdx.x} * kMapTileRows + tid;
  uint32_t id = UINT32_MAX;
  if (flat < uint64_t{p.m} * p.top_k) {
    id = __ldg(ids + flat);
    if (id >= E) {  // malformed id: its output row is all zeros, as in direct
      if (zero_invalid) {
        float* row = out + flat * p.n;
        for (uint32_t col = 0; col < p.n; ++col) row[col] = 0.f;
      }
    } else {
      atomicOr(&bits[id * kMapTileWords + tid / 32], 1u << (tid % 32));
    }
  }
  __syncthreads();
  return id;
}

__device__ __forceinline__ uint32_t map_tile_count(const uint32_t* bits, uint32_t e) {
  uint32_t count = 0;
#pragma unroll
  for (uint32_t w = 0; w < kMapTileWords; ++w) count += __popc(bits[e * kMapTileWords + w]);
  return count;
}

__global__ void __launch_bounds__(kMapTileRows)
    map_count_kernel(const DenseMatmulIdKernelParams p, const uint32_t* __restrict__ ids,
                     float* __restrict__ out, uint32_t* __restrict__ tile_base) {
  __shared__ uint32_t bits[kMapMaxThreads * kMapTileWords];  // [expert][word]
  map_tile_bitmap(p, ids, out, true, bits);
  for (uint32_t e = threadIdx.x; e < p.n_experts; e += kMapTileRows) {
    tile_base[uint64_t{blockIdx.x} * p.n_experts + e] = map_tile_count(bits, e);
  }
}

// One CTA of kMapMaxThreads threads, thread e for expert e: tile_base[tile][e] becomes start(e)
// plus e's rows in tiles before `tile`; counts[e] = e's rows in all tiles.
__global__ void __launch_bounds__(kMapMaxThreads)
    map_offsets_kernel(const DenseMatmulIdKernelParams p, uint32_t tiles,
                       uint32_t* __restrict__ tile_base, uint32_t* __restrict__ counts) {
  const uint32_t E = p.n_experts, e = threadIdx.x;
  uint32_t rows = 0;
  if (e < E) {
    for (uint32_t tile = 0; tile < tiles; ++tile) {
      uint32_t* const slot = tile_base + uint64_t{tile} * E + e;
      const uint32_t here = *slot;
      *slot = rows;
      rows += here;
    }
    counts[e] = rows;
  }
  uint32_t all = 0;
  const uint32_t start = block_exclusive_scan<kMapMaxThreads>(rows, all);
  if (e < E) {
    for (uint32_t tile = 0; tile < tiles; ++tile) tile_base[uint64_t{tile} * E + e] += start;
  }
}

__global__ void __launch_bounds__(kMapTileRows)
    map_scatter_kernel(const DenseMatmulIdKernelParams p, const uint32_t* __restrict__ ids,
                       const uint32_t* __restrict__ tile_base, uint32_t* __restrict__ counts,
                       uint32_t* __restrict__ routed, float* __restrict__ zero_out) {
  __shared__ uint32_t bits[kMapMaxThreads * kMapTileWords];  // [expert][word]
  __shared__ uint32_t base[kMapMaxThreads];                  // the tile's first position per expert
  constexpr uint32_t kPerThread = kMapMaxThreads / kMapTileRows;
  const uint32_t E = p.n_experts, tid = threadIdx.x, tile = blockIdx.x;
  const uint32_t id = map_tile_bitmap(p, ids, zero_out, zero_out != nullptr, bits);
  if (tile_base != nullptr) {
    for (uint32_t e = tid; e < E; e += kMapTileRows) base[e] = tile_base[uint64_t{tile} * E + e];
    __syncthreads();
  } else {  // the only tile: the segment starts are this bitmap's exclusive prefix over experts
    uint32_t local[kPerThread];
    uint32_t sum = 0;
#pragma unroll
    for (uint32_t j = 0; j < kPerThread; ++j) {
      const uint32_t e = tid * kPerThread + j;
      local[j] = e < E ? map_tile_count(bits, e) : 0u;
      sum += local[j];
    }
    uint32_t all = 0;
    uint32_t run = block_exclusive_scan<kMapTileRows>(sum, all);
#pragma unroll
    for (uint32_t j = 0; j < kPerThread; ++j) {
      const uint32_t e = tid * kPerThread + j;
      if (e < E) {
        base[e] = run;
        counts[e] = local[j];
      }
      run += local[j];
    }
    __syncthreads();
  }
  if (id >= E) return;
  const uint32_t w = tid / 32, below = (1u << (tid % 32)) - 1u;
  const uint32_t* const id_bits = bits + id * kMapTileWords;
  uint32_t pos = base[id] + __popc(id_bits[w] & below);
  for (uint32_t v = 0; v < w; ++v) pos += __popc(id_bits[v]);
  routed[pos] = tile * kMapTileRows + tid;
}

// ---- grouped -------------------------------------------------------------------------------------

// One thread's slice loads in a grouped block: activation chunk `part` of the block's routed row
// `row`, weight chunk `part` of the block's columns `col` and `col` + 32 (row = col = tid / 8,
// part = tid % 8). Chunks of rows past the block's count, columns past n or positions past k are
// zero.
template <typename T, bool VEC>
struct GroupedSliceLoader {
  uint32_t row, col, part, k;
  bool x_live, w_live0, w_live1;
  const float* x_src;
  const void* w_src0;
  const void* w_src1;
  Chunk<float> xr;
  Chunk<T> wr0, wr1;

  __device__ __forceinline__ GroupedSliceLoader(const DenseMatmulIdKernelParams& p, const char* w,
                                                const char* x, const uint32_t* flat_rows,
                                                const WorkItem& b, uint32_t tid)
      : row(tid >> 3), col(tid >> 3), part(tid & 7), k(p.k) {
    using Elem = typename Chunk<T>::elem;
    const char* wexp = w + uint64_t{b.expert} * p.expert_stride_bytes;
    x_live = row < b.rows;
    x_src = x_live ? input_row(p, x, flat_rows[row]) : nullptr;
    w_live0 = b.col0 + col < p.n;
    w_live1 = b.col0 + col + 32 < p.n;
    w_src0 = wexp + uint64_t{b.col0 + col} * p.k * sizeof(Elem);
    w_src1 = wexp + uint64_t{b.col0 + col + 32} * p.k * sizeof(Elem);
  }

  __device__ __forceinline__ void load(uint32_t slice) {
    const uint32_t c = slice * 8 + part;
    if (x_live)
      xr = load_x_chunk<VEC>(x_src, c, k);
    else
      xr.zero();
    if (w_live0)
      wr0 = load_w_chunk<T, VEC>(w_src0, c, k);
    else
      wr0.zero();
    if (w_live1)
      wr1 = load_w_chunk<T, VEC>(w_src1, c, k);
    else
      wr1.zero();
  }
};

// Step 3 and the store of one thread tile: lane `part` of the group ends with row r_base + part of
// the 8 columns c_base..c_base + 7 and writes the ones inside the block's rows and n.
__device__ __forceinline__ void grouped_store_tile(const DenseMatmulIdKernelParams& p,
                                                   const float (&acc)[8][8], uint32_t part,
                                                   uint32_t r_base, uint32_t c_base, uint32_t col0,
                                                   uint32_t rows_here, const uint32_t* flat_rows,
                                                   float* out) {
  // By recursive halving: the same own + partner sums as reduce8's butterfly, with half of
  // the values exchanged per step. Afterwards lane `part` holds row r_base + part, columns 0..7.
  float v[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {  // xor 4 decides row bit 2
    const bool hi = part & 4;
    const float keep = hi ? acc[4 + i / 8][i % 8] : acc[i / 8][i % 8];
    const float send = hi ? acc[i / 8][i % 8] : acc[4 + i / 8][i % 8];
    v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, 4);
  }
  float u[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {  // xor 2 decides row bit 1 (v index bit 4)
    const bool hi = part & 2;
    const float keep = hi ? v[16 + i] : v[i];
    const float send = hi ? v[i] : v[16 + i];
    u[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, 2);
  }
  float o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // xor 1 decides row bit 0 (u index bit 3)
    const bool hi = part & 1;
    const float keep = hi ? u[8 + i] : u[i];
    const float send = hi ? u[i] : u[8 + i];
    o[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, 1);
  }
  const uint32_t r = r_base + part;
  if (r < rows_here) {
    float* dst = out + uint64_t{flat_rows[r]} * p.n + col0 + c_base;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (col0 + c_base + c < p.n) dst[c] = o[c];
    }
  }
}

// The grouped kernel. Block (x, y, e): routed rows [32x, 32x + 32) of expert e times columns
// [64y, 64y + 64), 256 threads. Thread tile = warp * 4 + group (lane / 8): 8 rows x 8 columns, and
// lane `part` (lane % 8) of the group owns s_part of all 64 outputs, so a slice of 64 positions is
// one chunk per part. Slices are staged through registers (loaded one slice ahead) into two
// shared buffers, transposed: per chunk part, position j holds the block's 32 rows (activations)
// or 64 columns (weights) side by side. A thread reads its 8 rows and 8 columns of one position
// with four 16-byte loads and does that position's 64 FMAs as an outer product, positions in
// increasing order; 16 operand registers (a layout with 16-byte quads along K needs 36), which
// leaves room for two blocks per multiprocessor. A part's run is padded by 16 bytes so that the 8
// parts of a quarter warp fall on distinct banks, for the loads and the element-wise stores alike.
// Measured against the quad layout on the H200 (bench/lab/grouped_exact_lab.cu, m = 4096): 15-24%
// faster, the same bits.
constexpr uint32_t kOuterXPart = 8 * kGroupRows * 4 + 16;  // bytes per part: 8 positions x 32 rows
constexpr uint32_t kOuterWPart = 8 * kGroupCols * 4 + 16;  // 8 positions x 64 columns
constexpr uint32_t kOuterBuffer = 8 * (kOuterXPart + kOuterWPart);
constexpr size_t kOuterDynamicShmem = 2ull * kOuterBuffer;  // double-buffered: 49.75 KiB

// Blocks per multiprocessor the grouped kernel is compiled for (at most 128 registers).
constexpr int kOuterMinBlocks = 2;

// Lists the routed rows of work item `b` in `flat_rows` (zeros past its rows), then a barrier.
__device__ __forceinline__ void load_item_rows(const DenseMatmulIdKernelParams& p,
                                               const uint32_t* __restrict__ routed,
                                               const WorkItem& b, uint32_t* flat_rows) {
  const uint32_t tid = threadIdx.x;
  if (tid < kGroupRows) flat_rows[tid] = tid < b.rows ? __ldg(routed + uint64_t{b.row0} + tid) : 0u;
  __syncthreads();
}

// One work item of the grouped kernel (block `b`, its routed rows already in `flat_rows`).
template <typename T, bool VEC>
__device__ __forceinline__ void grouped_outer_item(const DenseMatmulIdKernelParams& p,
                                                   const char* __restrict__ w,
                                                   const char* __restrict__ x,
                                                   float* __restrict__ out, const WorkItem& b,
                                                   const uint32_t* flat_rows, uint8_t* outer_smem,
                                                   uint32_t slices) {
  const uint32_t tid = threadIdx.x;
  GroupedSliceLoader<T, VEC> loads(p, w, x, flat_rows, b, tid);

  const auto xs_of = [&](int buf) { return outer_smem + buf * kOuterBuffer; };
  const auto ws_of = [&](int buf) { return outer_smem + buf * kOuterBuffer + 8 * kOuterXPart; };

  auto store_slice = [&](int buf) {
    float* xs = reinterpret_cast<float*>(xs_of(buf) + loads.part * kOuterXPart) + loads.row;
    float* ws = reinterpret_cast<float*>(ws_of(buf) + loads.part * kOuterWPart) + loads.col;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      xs[j * kGroupRows] = loads.xr.get(j);
      ws[j * kGroupCols] = loads.wr0.get(j);
      ws[j * kGroupCols + 32] = loads.wr1.get(j);
    }
  };

  // Compute roles: tile = warp * 4 + group, lane `part` owns s_part.
  const uint32_t lane = tid & 31, part = lane & 7, group = lane >> 3, warp = tid >> 5;
  const uint32_t r_base = group * 8;
  const uint32_t c_base = warp * 8;

  float acc[8][8];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;

  loads.load(0);
  store_slice(0);
  __syncthreads();
  for (uint32_t s = 0; s < slices; ++s) {
    const int buf = s & 1;
    if (s + 1 < slices) loads.load(s + 1);  // in flight during the FMAs below
    const float* xs = reinterpret_cast<const float*>(xs_of(buf) + part * kOuterXPart) + r_base;
    const float* ws = reinterpret_cast<const float*>(ws_of(buf) + part * kOuterWPart) + c_base;
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // the chunk's positions in increasing order
      const float4 x0 = *reinterpret_cast<const float4*>(xs + j * kGroupRows);
      const float4 x1 = *reinterpret_cast<const float4*>(xs + j * kGroupRows + 4);
      const float4 w0 = *reinterpret_cast<const float4*>(ws + j * kGroupCols);
      const float4 w1 = *reinterpret_cast<const float4*>(ws + j * kGroupCols + 4);
      const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const float wv[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int r = 0; r < 8; ++r)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(wv[c], xv[r], acc[r][c]);
    }
    if (s + 1 < slices)
      store_slice(buf ^ 1);  // the other buffer was last read before the previous barrier
    __syncthreads();
  }

  grouped_store_tile(p, acc, part, r_base, c_base, b.col0, b.rows, flat_rows, out);
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kGroupThreads, kOuterMinBlocks)
    grouped_outer_kernel(const DenseMatmulIdKernelParams p, const char* __restrict__ w,
                         const char* __restrict__ x, const uint32_t* __restrict__ counts,
                         const uint32_t* __restrict__ routed, float* __restrict__ out) {
  extern __shared__ __align__(16) uint8_t outer_smem[];  // buffers, then the work list
  __shared__ uint32_t flat_rows[kGroupRows];
  uint32_t* const list = reinterpret_cast<uint32_t*>(outer_smem + kOuterDynamicShmem);
  const uint32_t slices = (p.k + kSlice - 1) / kSlice;
  const uint32_t col_tiles = (p.n + kGroupCols - 1) / kGroupCols;
  build_work_list<kGroupThreads>(counts, routed_capacity(p.m, p.top_k), p.n_experts, kGroupRows,
                                 col_tiles, list);
  const uint32_t total = list[p.n_experts];

  for (uint32_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem b = decode_item(item, list, p.n_experts, kGroupRows, kGroupCols);
    load_item_rows(p, routed, b, flat_rows);
    grouped_outer_item<T, VEC>(p, w, x, out, b, flat_rows, outer_smem, slices);
    __syncthreads();  // flat_rows and the buffers are rewritten by the next item
  }
}

// ---- host wrappers -------------------------------------------------------------------------------

const BoundArg& arg(const KernelLaunch& launch, size_t slot, const char* what) {
  return kernels::launch_arg(launch, slot, what);
}

DenseMatmulIdKernelParams params_of(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  if (p.top_k == 0 || p.n == 0 || p.k == 0 || p.m == 0)
    throw Error(launch.label + ": zero dimension in params");
  return p;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// 16-byte chunk loads are legal when every weight row and input row starts 16-byte aligned and a
// chunk never straddles k.
bool vector_ok(const DenseMatmulIdKernelParams& p, const void* w, const void* x, size_t elem) {
  return p.k % 8 == 0 && aligned16(w) && aligned16(x) && p.expert_stride_bytes % 16 == 0 &&
         (uint64_t{p.k} * elem) % 16 == 0 && p.input_token_stride_bytes % 16 == 0 &&
         p.input_slot_stride_bytes % 16 == 0;
}

void check_grid(const KernelLaunch& launch, uint64_t blocks) {
  if (blocks > static_cast<uint64_t>(INT_MAX)) {
    throw Error(launch.label + ": grid of " + std::to_string(blocks) +
                " blocks exceeds the CUDA limit");
  }
}

template <typename T>
void launch_direct(const KernelLaunch& launch, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const DenseMatmulIdKernelParams p = params_of(launch);
  const char* w = static_cast<const char*>(arg(launch, 1, "weights").data);
  const char* x = static_cast<const char*>(arg(launch, 2, "input").data);
  const auto* ids = static_cast<const uint32_t*>(arg(launch, 3, "expert_ids").data);
  auto* out = static_cast<float*>(arg(launch, 4, "output").data);
  const uint64_t tiles_x = launch.grid.x, rows = launch.grid.y * launch.grid.z;
  if (tiles_x == 0 || rows == 0) return;
  if (tiles_x > UINT32_MAX) throw Error(launch.label + ": grid x too large");
  check_grid(launch, tiles_x * rows);
  const dim3 grid(static_cast<unsigned>(tiles_x * rows));
  const size_t elem = sizeof(typename Chunk<T>::elem);
  const bool vec = vector_ok(p, w, x, elem);
  const auto tx = static_cast<uint32_t>(tiles_x);
  // Kernel choice by shape only (every kernel follows the numeric contract, so the results are the
  // same bits), from the H200 measurements in
  // bench/lab/records/dense_matmul_id-h200-direct-kernels-2026-12-03.md: up to
  // kGatherMaxRows rows, the gathered kernel for F32 weights from two tokens on, and for 2-byte
  // weights once there are at least 4 rows per expert on average (below that the per-row kernel's
  // L2 sharing is faster); otherwise the per-row kernel, tile-major unless there is one token.
  const bool gather = elem == 4 ? p.m > 1 : rows >= 4 * uint64_t{p.n_experts};
  if (rows <= kGatherMaxRows && gather) {
    const auto r = static_cast<uint32_t>(rows);
    if (vec) {
      direct_gathered_kernel<T, true>
          <<<grid, kDirectThreads, 0, stream>>>(p, w, x, ids, out, tx, r);
    } else {
      direct_gathered_kernel<T, false>
          <<<grid, kDirectThreads, 0, stream>>>(p, w, x, ids, out, tx, r);
    }
    return;
  }
  const bool tile_major = p.m > 1;
  if (vec) {
    direct_kernel<T, true>
        <<<grid, kDirectThreads, 0, stream>>>(p, w, x, ids, out, tx, rows, tile_major);
  } else {
    direct_kernel<T, false>
        <<<grid, kDirectThreads, 0, stream>>>(p, w, x, ids, out, tx, rows, tile_major);
  }
}

void launch_map(const KernelLaunch& launch, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const DenseMatmulIdKernelParams p = params_of(launch);
  const auto* ids = static_cast<const uint32_t*>(arg(launch, 1, "expert_ids").data);
  auto* counts = static_cast<uint32_t*>(arg(launch, 2, "expert_counts").data);
  auto* routed = static_cast<uint32_t*>(arg(launch, 3, "routed_rows").data);
  auto* out = static_cast<float*>(arg(launch, 4, "output").data);
  if (p.n_experts == 0 || p.n_experts > kMapMaxThreads) {
    throw Error(launch.label + ": map supports 1.." + std::to_string(kMapMaxThreads) +
                " experts, got " + std::to_string(p.n_experts));
  }
  if (p.m == 0) throw Error(launch.label + ": map needs at least one token");  // validated before
  // The receipt keeps the spec's geometry (one 1024-thread group); the launch runs one CTA per
  // tile of flat rows, with the per-tile positions in a stream workspace (see map_count_kernel).
  // One tile (m * top_k <= 256: decode batches) has no earlier tiles to count: the scatter kernel
  // alone, which then also zeroes the rows of malformed ids.
  const uint64_t tiles64 = (uint64_t{p.m} * p.top_k + kMapTileRows - 1) / kMapTileRows;
  check_grid(launch, tiles64);
  const auto tiles = static_cast<uint32_t>(tiles64);
  if (tiles == 1) {
    map_scatter_kernel<<<1, kMapTileRows, 0, stream>>>(p, ids, nullptr, counts, routed, out);
    return;
  }
  const StreamWorkspace workspace(launch.label, uint64_t{tiles} * p.n_experts * sizeof(uint32_t),
                                  stream);
  auto* const tile_base = static_cast<uint32_t*>(workspace.data());
  map_count_kernel<<<tiles, kMapTileRows, 0, stream>>>(p, ids, out, tile_base);
  map_offsets_kernel<<<1, kMapMaxThreads, 0, stream>>>(p, tiles, tile_base, counts);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error(launch.label + ": launch failed: " + cudaGetErrorString(e));
  }
  map_scatter_kernel<<<tiles, kMapTileRows, 0, stream>>>(p, ids, tile_base, counts, routed,
                                                         nullptr);
}

template <typename T>
void launch_grouped(const KernelLaunch& launch, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const DenseMatmulIdKernelParams p = params_of(launch);
  const char* w = static_cast<const char*>(arg(launch, 1, "weights").data);
  const char* x = static_cast<const char*>(arg(launch, 2, "input").data);
  const auto* counts = static_cast<const uint32_t*>(arg(launch, 3, "expert_counts").data);
  const auto* routed = static_cast<const uint32_t*>(arg(launch, 4, "routed_rows").data);
  auto* out = static_cast<float*>(arg(launch, 5, "output").data);
  const uint64_t tx = launch.grid.x, ty = launch.grid.y, tz = launch.grid.z;
  if (tx == 0 || ty == 0 || tz == 0) return;
  if (p.n_experts > kMaxWorkListExperts) {
    throw Error(launch.label + ": the grouped kernel supports up to " +
                std::to_string(kMaxWorkListExperts) + " experts, got " +
                std::to_string(p.n_experts));
  }
  // The front door's grid is the spec's geometry, one block per (row tile, column tile, expert);
  // most of those hold no routed rows (row tiles cover m, an expert holds about m * top_k /
  // n_experts), and an expert named more than m times (ids repeated within tokens) holds more
  // rows than its row tiles cover. So the kernel runs persistent over the work list of the tiles that hold rows,
  // resident blocks only: two per multiprocessor, fewer when the grid is smaller.
  const uint64_t resident = 2ull * multiprocessors(launch.label);
  const auto blocks = static_cast<unsigned>(std::min<uint64_t>(tx * ty * tz, resident));
  const size_t smem = kOuterDynamicShmem + work_list_bytes(p.n_experts);
  constexpr size_t kSmemCap = kOuterDynamicShmem + work_list_bytes(kMaxWorkListExperts);
  const size_t elem = sizeof(typename Chunk<T>::elem);
  if (vector_ok(p, w, x, elem)) {
    constexpr auto kernel = &grouped_outer_kernel<T, true>;
    opt_in_dynamic_smem<kernel>(launch.label, smem, kSmemCap);
    kernel<<<blocks, kGroupThreads, smem, stream>>>(p, w, x, counts, routed, out);
  } else {
    constexpr auto kernel = &grouped_outer_kernel<T, false>;
    opt_in_dynamic_smem<kernel>(launch.label, smem, kSmemCap);
    kernel<<<blocks, kGroupThreads, smem, stream>>>(p, w, x, counts, routed, out);
  }
}

KernelDef def(std::string_view name, KernelFn fn, uint32_t threads, uint32_t tile_x,
              uint32_t tile_y, uint64_t shmem, uint64_t max_threads) {
  KernelDef d;
  d.name = std::string(name);
  d.fn = fn;
  d.check_args = kernels::kernel_arg_contract(name);
  d.max_threads_per_threadgroup = max_threads;
  d.threads_per_group = threads;
  d.tile_x = tile_x;
  d.tile_y = tile_y;
  d.threadgroup_memory_bytes = shmem;
  d.origin = "cuda_fatbin";
  d.content_sha256 = ROUTEMM_CUDA_DENSE_MATMUL_ID_SHA256;
  return d;
}

}  // namespace

void add_dense_matmul_id_kernels(std::vector<KernelDef>& out) {
  const auto& names = kDenseMatmulIdPipelineNames;
  // Shared memory of a grouped block, reported so receipts show what a block uses (the launch adds
  // 8 bytes per expert for the work list).
  constexpr uint64_t kGroupShmem = kOuterDynamicShmem + kGroupRows * 4;
  // Static shared memory of the gathered direct kernel (member list, count, staged activations).
  constexpr uint64_t kDirectShmem =
      kGatherMaxRows * sizeof(uint16_t) + sizeof(uint32_t) + sizeof(StagedRows);
  for (size_t i = 0; i < 3; ++i) {
    constexpr KernelFn fns[] = {launch_direct<float>, launch_direct<F16Tag>,
                                launch_direct<BF16Tag>};
    out.push_back(def(names[i], fns[i], kDirectThreads, kDirectCols, 1, kDirectShmem, 1024));
  }
  out.push_back(def(names[3], launch_map, kMapMaxThreads, 1, 1, 0, kMapMaxThreads));
  out.push_back(def(names[4], launch_grouped<float>, kGroupThreads, kGroupRows, kGroupCols,
                    kGroupShmem, 1024));
  out.push_back(def(names[5], launch_grouped<F16Tag>, kGroupThreads, kGroupRows, kGroupCols,
                    kGroupShmem, 1024));
  out.push_back(def(names[6], launch_grouped<BF16Tag>, kGroupThreads, kGroupRows, kGroupCols,
                    kGroupShmem, 1024));
}

}  // namespace routemm::cuda
