// Tensor-core kernels of the expert-ID matmul's opt-in routes (grouped_tensor_tf32,
// grouped_tensor_lowp). They consume the map_distinct output of the grouped route (expert counts and
// routed rows, same scratch, same barrier pattern) and use warp-level MMA (mma.sync + ldmatrix +
// cp.async, sm_80+). On Hopper, when the build carries the sm_90a image, aligned views take the
// warpgroup-MMA kernel of dense_matmul_id_wgmma.cu instead (same numerics contract, its own K steps);
// this file's kernel then serves only views that are not 16-byte aligned or have k % 8 != 0.
//
// NUMERICS (not bit-identical to the scalar routes; a stated tolerance instead):
//   tf32: activations rounded to tf32 (cvt.rna: round to nearest, ties away); weights rounded to
//         tf32 too, which is exact for f16 and bf16 weights; products summed in F32 by the tensor
//         cores. Tested within 2e-3 relative Frobenius error of a float64 reference.
//   lowp: activations rounded to the weight dtype (f16 or bf16, round to nearest even); weights
//         exact; F32 accumulation. Tested within 1e-2 relative Frobenius error.
// In this kernel each output element's sum runs over K in slices (32 for lowp, 16 for tf32) in
// increasing order, within a slice in the tensor core's own order; the result depends on K only,
// not on m, the tile size or the tile position.
// An id >= n_experts gives an all-zero row: the map dispatch writes it, these kernels never see it.
//
// Geometry: a persistent grid (multiprocessors x resident CTAs, at most one per possible work item)
// of 256 threads (8 warps as 2 x 4). Work items are (expert, column tile, row tile) for the row tiles
// an expert actually holds: each CTA builds the prefix sum of ceil(count / BM) * ceil(n / 128) over
// the experts in shared memory, then walks items blockIdx.x, + gridDim.x, ... Items run expert by
// expert, column tile by column tile, so CTAs resident together share weight tiles and activation
// rows in L2. A CTA tile is BM (128, or 64 when experts hold few rows) routed rows x 128 columns;
// each warp owns BM/2 x 32. K is staged through a 4-stage shared-memory ring, 64 bytes per row per
// stage (32 K values for lowp, 16 for tf32), XOR-swizzled so ldmatrix and the stores are free of bank
// conflicts. Weights arrive by cp.async (16 bytes, zero-filled past n and k) when they are stored in
// the MMA's operand type; activations (F32, gathered by routed row) are loaded 16 bytes at a time
// into registers one stage ahead, converted, and stored; so are f16/bf16 weights of the tf32 route.
// Rows that are not 16-byte aligned or k % 8 != 0 take the same kernel with element loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "dense_matmul_id_wgmma.h"
#include "grouped_work_list.cuh"
#include "hopper_support.h"
#include "kernels.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "smem_opt_in.h"
#include "warp_mma.cuh"

#ifndef ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256
#define ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256 "unknown"
#endif

namespace routemm::cuda {
namespace {

using kernels::DenseMatmulIdKernelParams;

constexpr uint32_t kThreads = 256;
constexpr uint32_t kTileCols = 128;  // smallest BN
constexpr uint32_t kRowBytes = 64;   // bytes per operand row per stage: 4 chunks of 16
constexpr uint32_t kMaxTileRows = 128;

// Stages of the shared-memory ring, and resident CTAs per multiprocessor, per tile shape.
template <uint32_t BM, uint32_t BN>
constexpr uint32_t stages() {
  return BN == 256 && BM == 128 ? 6 : 4;
}
template <uint32_t BM, uint32_t BN>
constexpr uint32_t min_blocks() {
  return BN == 256 && BM == 128 ? 1 : 2;
}
template <uint32_t BM, uint32_t BN>
constexpr uint32_t stage_bytes() {
  return (BM + BN) * kRowBytes;
}
template <uint32_t BM, uint32_t BN>
constexpr uint32_t pipe_bytes() {
  return stages<BM, BN>() * stage_bytes<BM, BN>();
}
template <uint32_t BM, uint32_t BN>
constexpr uint64_t smem_bytes(uint32_t experts) {
  return uint64_t{pipe_bytes<BM, BN>()} + kMaxTileRows * 4 + work_list_bytes(experts);
}

enum class Mode { Tf32, LowpF16, LowpBf16 };

template <class W>
__device__ __forceinline__ float widen(W value);
template <>
__device__ __forceinline__ float widen<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ float widen<__half>(__half value) {
  return __half2float(value);
}
template <>
__device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

__device__ __forceinline__ uint32_t to_tf32(float value) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(value));
  return out;
}

// Two consecutive K values packed into one 32-bit word of the 16-bit operand layout.
template <Mode M>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (M == Mode::LowpF16) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t out;
    memcpy(&out, &h, 4);
    return out;
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t out;
    memcpy(&out, &h, 4);
    return out;
  }
}

template <Mode M>
__device__ __forceinline__ void mma_lowp(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  if constexpr (M == Mode::LowpF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Byte offset of 16-byte chunk `chunk` (0..3) of operand row `row` inside one stage's tile.
__device__ __forceinline__ uint32_t swz(uint32_t row, uint32_t chunk) {
  return row * kRowBytes + ((chunk ^ ((row >> 1) & 3u)) << 4);
}

__device__ __forceinline__ uint16_t load_u16(const void* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

// W: weight element type; M: route; BM: routed rows per tile; kVec: 16-byte loads allowed (every
// row 16-byte aligned and k % 8 == 0), else element loads with the same staging.
template <class W, Mode M, uint32_t BM, uint32_t BN, bool kVec>
__global__ void __launch_bounds__(kThreads, min_blocks<BM, BN>())
    grouped_tensor_kernel(DenseMatmulIdKernelParams p, const W* __restrict__ weights,
                          const char* __restrict__ input, const uint32_t* __restrict__ counts,
                          const uint32_t* __restrict__ routed, float* __restrict__ output,
                          bool out_vec2) {
  constexpr bool kTf32 = M == Mode::Tf32;
  constexpr bool kWFloat = sizeof(W) == 4;
  constexpr uint32_t kBK = kTf32 ? 16 : 32;    // K values per stage
  constexpr uint32_t kPiecesPerRow = kBK / 4;  // float4 activation pieces per row
  constexpr uint32_t kAPieces = BM * kPiecesPerRow / kThreads;
  constexpr uint32_t kARowStep = kThreads / kPiecesPerRow;
  // Weights stored in the operand type go straight to shared memory by cp.async.
  constexpr bool kBAsync = kVec && (!kTf32 || kWFloat);
  constexpr uint32_t kMI = BM / 32;  // 16-row MMA tiles per warp (warp tile BM/2 x BN/4)
  constexpr uint32_t kNI = BN / 32;  // 8-column MMA tiles per warp
  constexpr uint32_t kStages = stages<BM, BN>();
  constexpr uint32_t kTileABytes = BM * kRowBytes;
  static_assert(kAPieces >= 1 && kAPieces * kThreads == BM * kPiecesPerRow, "activation split");

  extern __shared__ __align__(128) unsigned char smem[];
  uint32_t* row_flat = reinterpret_cast<uint32_t*>(smem + pipe_bytes<BM, BN>());
  uint32_t* list = row_flat + kMaxTileRows;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t n_experts = p.n_experts, m = p.m, n = p.n, k = p.k;
  const uint32_t col_tiles = (n + BN - 1) / BN;

  build_work_list<kThreads>(counts, routed_capacity(m, p.top_k), n_experts, BM, col_tiles, list);
  const uint32_t total = list[n_experts];

  const uint32_t warp_row = (warp >> 2) * (BM / 2), warp_col = (warp & 3) * (BN / 4);
  const uint32_t group = lane >> 2, quad = lane & 3;
  // ldmatrix source rows/chunks of this lane (see the fragment layouts of m16n8k16 / m16n8k8).
  const uint32_t a_lrow = (lane & 7) + ((lane >> 3) & 1) * 8, a_lchunk = lane >> 4;
  const uint32_t b_lrow = (lane & 7) + (lane >> 4) * 8, b_lchunk = (lane >> 3) & 1;

  for (uint32_t item = blockIdx.x; item < total; item += gridDim.x) {
    const WorkItem w = decode_item(item, list, n_experts, BM, BN);
    const uint32_t expert = w.expert, col0 = w.col0, rows = w.rows;
    const uint32_t* expert_routed = routed + w.row0;

    cp_async_wait<0>();
    __syncthreads();  // the previous item is done with the stages and row_flat
    if (tid < BM) row_flat[tid] = tid < rows ? expert_routed[tid] : 0u;

    // Activation rows of this thread's pieces.
    const uint32_t a_kq = tid % kPiecesPerRow;
    const char* a_src[kAPieces];
#pragma unroll
    for (uint32_t i = 0; i < kAPieces; ++i) {
      const uint32_t r = tid / kPiecesPerRow + i * kARowStep;
      a_src[i] = nullptr;
      if (r < rows) {
        const uint32_t flat = expert_routed[r];
        const uint32_t token = flat / p.top_k, slot = flat - token * p.top_k;
        a_src[i] = input + token * p.input_token_stride_bytes + slot * p.input_slot_stride_bytes;
      }
    }
    const char* w_expert = reinterpret_cast<const char*>(weights) + expert * p.expert_stride_bytes;

    float areg[kAPieces][4];
    auto load_a = [&](uint32_t k0) {
#pragma unroll
      for (uint32_t i = 0; i < kAPieces; ++i) {
        const uint32_t kk = k0 + a_kq * 4;
        const float* src = reinterpret_cast<const float*>(a_src[i]) + kk;
        if constexpr (kVec) {
          float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
          if (a_src[i] != nullptr && kk < k) v = __ldg(reinterpret_cast<const float4*>(src));
          areg[i][0] = v.x;
          areg[i][1] = v.y;
          areg[i][2] = v.z;
          areg[i][3] = v.w;
        } else {
#pragma unroll
          for (uint32_t j = 0; j < 4; ++j)
            areg[i][j] = a_src[i] != nullptr && kk + j < k ? src[j] : 0.0f;
        }
      }
    };
    auto store_a = [&](uint32_t stage) {
      const uint32_t base = smem_base + stage * stage_bytes<BM, BN>();
#pragma unroll
      for (uint32_t i = 0; i < kAPieces; ++i) {
        const uint32_t r = tid / kPiecesPerRow + i * kARowStep;
        if constexpr (kTf32) {
          sts128(base + swz(r, a_kq), to_tf32(areg[i][0]), to_tf32(areg[i][1]), to_tf32(areg[i][2]),
                 to_tf32(areg[i][3]));
        } else {
          sts64(base + swz(r, a_kq >> 1) + (a_kq & 1) * 8, pack_pair<M>(areg[i][0], areg[i][1]),
                pack_pair<M>(areg[i][2], areg[i][3]));
        }
      }
    };
    // Weights by cp.async: BN/64 chunks per thread, rows tid/4 + 64i, chunk tid % 4.
    auto issue_b = [&](uint32_t stage, uint32_t k0) {
      const uint32_t base = smem_base + stage * stage_bytes<BM, BN>() + kTileABytes;
      constexpr uint32_t kPerChunk = 16 / sizeof(W);
#pragma unroll
      for (uint32_t i = 0; i < BN / 64; ++i) {
        const uint32_t r = tid / 4 + i * 64, ch = tid % 4;
        const uint32_t col = col0 + r, kk = k0 + ch * kPerChunk;
        const bool valid = col < n && kk < k;
        const char* src =
            valid ? w_expert + (static_cast<uint64_t>(col) * k + kk) * sizeof(W) : w_expert;
        cp_async_16(base + swz(r, ch), src, valid);
      }
    };
    // Weights through registers: rows tid/2 + 128h, chunks 2*(tid&1) and +1 (8 tf32 words or 16
    // halves each).
    constexpr uint32_t kBH = BN / 128;
    uint32_t bregs[kBAsync ? 1 : kBH][8];
    auto load_b = [&](uint32_t k0) {
      if constexpr (!kBAsync) {
#pragma unroll
        for (uint32_t hh = 0; hh < kBH; ++hh) {
          uint32_t (&breg)[8] = bregs[hh];
          const uint32_t r = (tid >> 1) + 128 * hh, col = col0 + r;
          constexpr uint32_t kElems = kTf32 ? 8 : 16;
          const uint32_t kk = k0 + (tid & 1) * kElems;
          const char* src = w_expert + (static_cast<uint64_t>(col) * k + kk) * sizeof(W);
          if constexpr (kTf32 && !kWFloat && kVec) {
            uint4 v = make_uint4(0, 0, 0, 0);
            if (col < n && kk < k) v = __ldg(reinterpret_cast<const uint4*>(src));
            const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (uint32_t j = 0; j < 4; ++j) {
              W lo16, hi16;
              const uint16_t l = static_cast<uint16_t>(words[j] & 0xFFFFu),
                             h = static_cast<uint16_t>(words[j] >> 16);
              memcpy(&lo16, &l, 2);
              memcpy(&hi16, &h, 2);
              breg[2 * j] = to_tf32(widen(lo16));
              breg[2 * j + 1] = to_tf32(widen(hi16));
            }
          } else if constexpr (kTf32) {
#pragma unroll
            for (uint32_t j = 0; j < 8; ++j) {
              float v = 0.0f;
              if (col < n && kk + j < k) {
                if constexpr (kWFloat) {
                  v = widen(reinterpret_cast<const float*>(src)[j]);
                } else {
                  W h;
                  const uint16_t bits = load_u16(src + j * 2);
                  memcpy(&h, &bits, 2);
                  v = widen(h);
                }
              }
              breg[j] = to_tf32(v);
            }
          } else {
#pragma unroll
            for (uint32_t j = 0; j < 8; ++j) {
              const uint32_t lo16 = col < n && kk + 2 * j < k ? load_u16(src + 4 * j) : 0u;
              const uint32_t hi16 = col < n && kk + 2 * j + 1 < k ? load_u16(src + 4 * j + 2) : 0u;
              breg[j] = lo16 | (hi16 << 16);
            }
          }
        }
      }
    };
    auto store_b = [&](uint32_t stage) {
      if constexpr (!kBAsync) {
        const uint32_t base = smem_base + stage * stage_bytes<BM, BN>() + kTileABytes;
#pragma unroll
        for (uint32_t hh = 0; hh < kBH; ++hh) {
          const uint32_t r = (tid >> 1) + 128 * hh, ch = (tid & 1) * 2;
          const uint32_t (&breg)[8] = bregs[hh];
          sts128(base + swz(r, ch), breg[0], breg[1], breg[2], breg[3]);
          sts128(base + swz(r, ch + 1), breg[4], breg[5], breg[6], breg[7]);
        }
      }
    };

    float acc[kMI][kNI][4];
#pragma unroll
    for (uint32_t mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (uint32_t ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;

    const uint32_t ktiles = (k + kBK - 1) / kBK;
    // Prologue: weights for stages 0..S-2 in flight, activations of slice 0 stored, slice 1 loading.
#pragma unroll
    for (uint32_t s = 0; s + 1 < kStages; ++s) {
      if constexpr (kBAsync) {
        if (s < ktiles) issue_b(s, s * kBK);
      }
      cp_async_commit();
    }
    load_a(0);
    load_b(0);
    store_a(0);
    store_b(0);
    if (ktiles > 1) {
      load_a(kBK);
      load_b(kBK);
    }

    for (uint32_t kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // slice kt complete in its stage; stage (kt - 1) % S free
      if constexpr (kBAsync) {
        const uint32_t next = kt + kStages - 1;
        if (next < ktiles) issue_b(next % kStages, next * kBK);
      }
      cp_async_commit();

      const uint32_t a_base = smem_base + (kt % kStages) * stage_bytes<BM, BN>();
      const uint32_t b_base = a_base + kTileABytes;
#pragma unroll
      for (uint32_t s = 0; s < 2; ++s) {  // two MMA K-steps per stage (16 bf16 or 8 tf32 each)
        uint32_t bf[kNI][2];
#pragma unroll
        for (uint32_t nj = 0; nj < kNI / 2; ++nj) {
          ldmatrix_x4(b_base + swz(warp_col + nj * 16 + b_lrow, 2 * s + b_lchunk), bf[2 * nj][0],
                      bf[2 * nj][1], bf[2 * nj + 1][0], bf[2 * nj + 1][1]);
        }
        if constexpr (kTf32 && kWFloat && kBAsync) {  // raw f32 weights: round to tf32 here
#pragma unroll
          for (uint32_t ni = 0; ni < kNI; ++ni) {
            bf[ni][0] = to_tf32(__uint_as_float(bf[ni][0]));
            bf[ni][1] = to_tf32(__uint_as_float(bf[ni][1]));
          }
        }
#pragma unroll
        for (uint32_t mi = 0; mi < kMI; ++mi) {
          uint32_t af[4];
          ldmatrix_x4(a_base + swz(warp_row + mi * 16 + a_lrow, 2 * s + a_lchunk), af[0], af[1],
                      af[2], af[3]);
#pragma unroll
          for (uint32_t ni = 0; ni < kNI; ++ni) {
            if constexpr (kTf32) {
              mma_tf32(acc[mi][ni], af, bf[ni]);
            } else {
              mma_lowp<M>(acc[mi][ni], af, bf[ni]);
            }
          }
        }
      }

      if (kt + 1 <
          ktiles) {  // slice kt+1 into its stage (last read at kt+1-S, behind this barrier)
        store_a((kt + 1) % kStages);
        store_b((kt + 1) % kStages);
        if (kt + 2 < ktiles) {
          load_a((kt + 2) * kBK);
          load_b((kt + 2) * kBK);
        }
      }
    }
    __syncthreads();  // row_flat visible even when k == 0

    // Scatter: accumulator (mi, ni, j) is row warp_row + mi*16 + group + 8*(j/2), column
    // warp_col + ni*8 + 2*quad + j%2.
#pragma unroll
    for (uint32_t mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (uint32_t half = 0; half < 2; ++half) {
        const uint32_t r = warp_row + mi * 16 + group + 8 * half;
        if (r >= rows) continue;
        float* out_row = output + static_cast<uint64_t>(row_flat[r]) * n;
#pragma unroll
        for (uint32_t ni = 0; ni < kNI; ++ni) {
          const uint32_t col = col0 + warp_col + ni * 8 + 2 * quad;
          if (out_vec2) {
            if (col < n) {
              *reinterpret_cast<float2*>(out_row + col) =
                  make_float2(acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]);
            }
          } else {
            if (col < n) out_row[col] = acc[mi][ni][2 * half];
            if (col + 1 < n) out_row[col + 1] = acc[mi][ni][2 * half + 1];
          }
        }
      }
    }
  }
}

template <class W, Mode M, uint32_t BM, uint32_t BN, bool kVec>
void launch_instance(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p,
                     cudaStream_t stream, bool out_vec2) {
  constexpr auto kernel = &grouped_tensor_kernel<W, M, BM, BN, kVec>;
  const uint64_t smem = smem_bytes<BM, BN>(p.n_experts);
  opt_in_dynamic_smem<kernel>(launch.label, smem, smem_bytes<BM, BN>(kMaxWorkListExperts));
  const auto blocks = static_cast<unsigned>(launch.grid.x);
  kernel<<<blocks, kThreads, static_cast<size_t>(smem), stream>>>(
      p, static_cast<const W*>(launch.args[1].data), static_cast<const char*>(launch.args[2].data),
      static_cast<const uint32_t*>(launch.args[3].data),
      static_cast<const uint32_t*>(launch.args[4].data), static_cast<float*>(launch.args[5].data),
      out_vec2);
}

template <class W, Mode M>
void launch_grouped_tensor(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  for (int slot = 1; slot <= 5; ++slot) {
    if (kernels::launch_arg(launch, slot, "buffer").kind != BoundArg::Kind::Buffer) {
      throw Error("'" + launch.label + "': slot " + std::to_string(slot) + " must be a buffer");
    }
  }
  if (p.n_experts > kMaxWorkListExperts) {
    throw Error("'" + launch.label + "': n_experts " + std::to_string(p.n_experts) + " exceeds " +
                std::to_string(kMaxWorkListExperts));
  }
  // The persistent grid the front door encoded (KernelDef::persistent_groups, capped by the tile
  // count); CTAs beyond the work items find none and exit.
  if (launch.grid.x == 0 || launch.grid.x > 0x7fffffffu || launch.grid.y != 1 ||
      launch.grid.z != 1) {
    throw Error("'" + launch.label + "': expected a 1-D persistent grid");
  }
  auto stream = static_cast<cudaStream_t>(queue_native);
  const auto addr = [&](int slot) { return reinterpret_cast<uintptr_t>(launch.args[slot].data); };
  const bool vec = p.k % 8 == 0 && addr(1) % 16 == 0 && p.expert_stride_bytes % 16 == 0 &&
                   addr(2) % 16 == 0 && p.input_token_stride_bytes % 16 == 0 &&
                   p.input_slot_stride_bytes % 16 == 0;
  const bool out_vec2 = p.n % 2 == 0 && addr(5) % 8 == 0;
  if (int device = 0;
      vec && p.k > 0 && cudaGetDevice(&device) == cudaSuccess && hopper_kernels_available(device)) {
    constexpr WgmmaOperands kOperands = M == Mode::LowpF16                 ? WgmmaOperands::LowpF16
                                        : M == Mode::LowpBf16              ? WgmmaOperands::LowpBf16
                                        : std::is_same_v<W, __half>        ? WgmmaOperands::Tf32F16
                                        : std::is_same_v<W, __nv_bfloat16> ? WgmmaOperands::Tf32Bf16
                                                                           : WgmmaOperands::Tf32F32;
    launch_grouped_wgmma(launch, p, stream, kOperands, out_vec2);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
      throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
    }
    return;
  }
  // Experts holding few rows on average take 64-row tiles (less padding), others 128.
  const bool small = uint64_t{p.m} * p.top_k < uint64_t{100} * p.n_experts;
  // 128 x 256 tiles (1 CTA per multiprocessor) measured no faster than 128 x 128 on the H200 and
  // slower for tf32, so every shape takes 128 columns.
  if (!vec) {
    launch_instance<W, M, 64, 128, false>(launch, p, stream, out_vec2);
  } else if (small) {
    launch_instance<W, M, 64, 128, true>(launch, p, stream, out_vec2);
  } else {
    launch_instance<W, M, 128, 128, true>(launch, p, stream, out_vec2);
  }
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + launch.label + "': launch failed: " + cudaGetErrorString(e));
  }
}

KernelDef tensor_def(std::string_view name, KernelFn fn, uint32_t persistent_groups) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = kThreads;
  // A persistent kernel: the tile fields bound the work items (64-row tiles, the smaller of the two
  // heights), and the front door encodes min(persistent_groups, tiles) groups.
  def.persistent_groups = persistent_groups;
  def.tile_x = 64;
  def.tile_y = kTileCols;
  // The 128-row variant's stages plus the row indices; the work list adds 8 bytes per expert.
  // (The launch sizes its dynamic shared memory itself.)
  def.threadgroup_memory_bytes = uint64_t{pipe_bytes<128, kTileCols>()} + kMaxTileRows * 4;
  def.origin = "cuda_fatbin";
  def.content_sha256 = ROUTEMM_CUDA_DENSE_MATMUL_ID_TENSOR_SHA256;
  return def;
}

}  // namespace

void add_dense_matmul_id_tensor_kernels(std::vector<KernelDef>& out) {
  // Two resident CTAs per multiprocessor of device 0 (the 128x128 variant's occupancy).
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) {
    (void)cudaGetLastError();
    sms = 132;
  }
  // Where the Hopper kernel serves these routes: one CTA per multiprocessor (its shared memory and
  // registers), so a persistent grid of one wave; the mma.sync fallback (unaligned views) runs its
  // persistent loop on that grid too.
  const bool hopper = hopper_kernels_available(0);
  const auto groups = static_cast<uint32_t>(hopper ? sms : 2 * sms);
  const auto& names = kDenseMatmulIdTensorPipelineNames;
  const KernelFn fns[5] = {
      &launch_grouped_tensor<float, Mode::Tf32>,
      &launch_grouped_tensor<__half, Mode::Tf32>,
      &launch_grouped_tensor<__nv_bfloat16, Mode::Tf32>,
      &launch_grouped_tensor<__half, Mode::LowpF16>,
      &launch_grouped_tensor<__nv_bfloat16, Mode::LowpBf16>,
  };
  for (size_t i = 0; i < names.size(); ++i) {
    KernelDef def = tensor_def(names[i], fns[i], groups);
    if (hopper) {
      def.threadgroup_memory_bytes =
          std::max(def.threadgroup_memory_bytes, wgmma_grouped_smem_bytes(0));
    }
    out.push_back(std::move(def));
  }
}

}  // namespace routemm::cuda
