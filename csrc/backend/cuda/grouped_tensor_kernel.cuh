// The persistent warp-MMA kernel of the expert-ID matmul's tensor-core routes (mma.sync + ldmatrix,
// sm_80+), shared by dense_matmul_id_tensor.cu (f32/f16/bf16 expert stacks) and
// quantized_matmul_id.cu (Q4_0 / Q8_0 expert stacks). Everything but the weight tiles is common:
// the work list over (expert, column tile, row tile) items, the gathered activation rows, the
// shared-memory K ring, the MMA loop and the scatter. The weight tiles come from a policy class
// (the kernel's `Tiles` parameter), which fills each stage's BN weight rows x kBK K values in the
// swizzled operand layout the MMA loop reads.
//
// Geometry: a persistent grid of 256 threads (8 warps as 2 x 4). A CTA walks items blockIdx.x,
// + gridDim.x, ...; a tile is BM routed rows x BN columns, each warp owns BM/2 x BN/4. K is staged
// through a ring of stages(), 64 bytes per operand row per stage (32 K values for lowp, 16 for
// tf32), XOR-swizzled so ldmatrix and the stores are free of bank conflicts. Activations (F32,
// gathered by routed row) are loaded 16 bytes at a time (element loads without kVec) into
// registers one stage ahead, converted, and stored.
//
// The weight-tile policy contract (a class constructed once per work item by every thread):
//   Tiles(const char* expert_weights, uint32_t col0, const DenseMatmulIdKernelParams& p,
//         uint32_t tid)
//   kAsync             weights go to shared memory by cp.async: issue(b_base, k0) starts the copy
//                      of the slice at K offset k0 into the stage whose weight tile is at b_base;
//                      otherwise load(k0) reads the slice into registers one stage ahead and
//                      store(b_base) writes it into its stage.
//   kStageExtraBytes   bytes the policy keeps after the weight tile of every stage (a multiple of
//                      16).
//   kSliceScales       each stage's products sum into a fresh F32 slice accumulator, and the slice
//                      joins the result as acc += scale[col] * slice, the F32 scale of column col
//                      being the one the policy stored at b_base + BN * kRowBytes + col * 4 (so a
//                      block-scaled weight enters the MMA as its exact integers).
//   fragment(word)     applied to every weight fragment word after ldmatrix (raw f32 -> tf32);
//                      the identity for operands already in the MMA's type.
// and, optionally (absent means the kernel does without):
//   prefetch(k0)       register-path tiles: ask L2 for the slice at K offset k0 (a no-op past k);
//                      the kernel calls it kPrefetchStages slices ahead of load(k0), whose one
//                      stage of register look-ahead cannot cover a DRAM read.
// and, optionally (both lowp only, with kSliceScales; absent means false / 1):
//   kScaleSteps        2: each of the stage's two 16-value MMA K-steps has its own scale row, the
//                      second BN * 4 bytes after the first, and its products their own slice.
//   kSliceMins         each stage also adds min[col] * rowsum[row] to the result: min[col] the
//                      F32 the policy stored kScaleSteps * BN * 4 bytes after the scale row,
//                      rowsum[row] the F32 sum of the row's stage activations as the MMA reads
//                      them (rounded), which the kernel stores right after the mins
//                      (kMaxTileRows * 4 bytes the policy counts in kStageExtraBytes). With it a
//                      block value d * q + m enters the MMA as its integer q: d * sum(q x) +
//                      m * sum(x).
// A policy must write every byte of its tile that the MMA reads (zeros past n and past k).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "backend/common/dense_matmul_id_params.h"
#include "grouped_work_list.cuh"
#include "warp_mma.cuh"

namespace routemm::cuda::grouped_tensor {

using kernels::DenseMatmulIdKernelParams;

inline constexpr uint32_t kThreads = 256;
inline constexpr uint32_t kTileCols = 128;  // smallest BN
inline constexpr uint32_t kRowBytes = 64;   // bytes per operand row per stage: 4 chunks of 16
inline constexpr uint32_t kMaxTileRows = 128;
// Slices between a register-path policy's prefetch(k0) and its load(k0): about a DRAM latency
// of MMA loop iterations.
inline constexpr uint32_t kPrefetchStages = 8;

// Asks L2 to fetch the line holding p; no register waits for it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// Whether policy Tiles has prefetch(k0).
template <class Tiles, class = void>
struct HasPrefetch : std::false_type {};
template <class Tiles>
struct HasPrefetch<Tiles, std::void_t<decltype(std::declval<const Tiles&>().prefetch(0u))>>
    : std::true_type {};

// Stages of the shared-memory ring, and resident CTAs per multiprocessor, per tile shape.
template <uint32_t BM, uint32_t BN>
constexpr uint32_t stages() {
  return BN == 256 && BM == 128 ? 6 : 4;
}
template <uint32_t BM, uint32_t BN>
constexpr uint32_t min_blocks() {
  return BN == 256 && BM == 128 ? 1 : 2;
}
// kExtra: the weight-tile policy's own bytes per stage (kStageExtraBytes).
template <uint32_t BM, uint32_t BN, uint32_t kExtra = 0>
constexpr uint32_t stage_bytes() {
  return (BM + BN) * kRowBytes + kExtra;
}
template <uint32_t BM, uint32_t BN, uint32_t kExtra = 0>
constexpr uint32_t pipe_bytes() {
  return stages<BM, BN>() * stage_bytes<BM, BN, kExtra>();
}
template <uint32_t BM, uint32_t BN, uint32_t kExtra = 0>
constexpr uint64_t smem_bytes(uint32_t experts) {
  return uint64_t{pipe_bytes<BM, BN, kExtra>()} + kMaxTileRows * 4 + work_list_bytes(experts);
}

// A weight-tile policy's optional kScaleSteps / kSliceMins (see the contract above).
template <class Tiles>
constexpr uint32_t scale_steps() {
  if constexpr (requires { Tiles::kScaleSteps; }) {
    return Tiles::kScaleSteps;
  } else {
    return 1;
  }
}
template <class Tiles>
constexpr bool slice_mins() {
  if constexpr (requires { Tiles::kSliceMins; }) {
    return Tiles::kSliceMins;
  } else {
    return false;
  }
}

// Multiprocessors of device 0, for the persistent grid a KernelDef declares when the backend opens
// (132, an H100/H200's count, where the runtime cannot say).
inline uint32_t device0_multiprocessors() {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) {
    (void)cudaGetLastError();
    return 132;
  }
  return static_cast<uint32_t>(sms);
}

enum class Mode { Tf32, LowpF16, LowpBf16 };

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

// The F32 sum of the two 16-bit values of a packed operand word.
template <Mode M>
__device__ __forceinline__ float pair_sum(uint32_t word) {
  if constexpr (M == Mode::LowpF16) {
    __half2 h;
    memcpy(&h, &word, 4);
    const float2 f = __half22float2(h);
    return __fadd_rn(f.x, f.y);
  } else {
    __nv_bfloat162 h;
    memcpy(&h, &word, 4);
    const float2 f = __bfloat1622float2(h);
    return __fadd_rn(f.x, f.y);
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

// Tiles: the weight-tile policy (above); M: route; BM: routed rows per tile; kVec: 16-byte
// activation loads allowed (every input row 16-byte aligned and k % 8 == 0), else element loads
// with the same staging.
template <class Tiles, Mode M, uint32_t BM, uint32_t BN, bool kVec>
__global__ void __launch_bounds__(kThreads, min_blocks<BM, BN>())
    grouped_tensor_kernel(DenseMatmulIdKernelParams p, const char* __restrict__ weights,
                          const char* __restrict__ input, const uint32_t* __restrict__ counts,
                          const uint32_t* __restrict__ routed, float* __restrict__ output,
                          bool out_vec2) {
  constexpr bool kTf32 = M == Mode::Tf32;
  constexpr uint32_t kBK = kTf32 ? 16 : 32;    // K values per stage
  constexpr uint32_t kPiecesPerRow = kBK / 4;  // float4 activation pieces per row
  constexpr uint32_t kAPieces = BM * kPiecesPerRow / kThreads;
  constexpr uint32_t kARowStep = kThreads / kPiecesPerRow;
  constexpr uint32_t kMI = BM / 32;  // 16-row MMA tiles per warp (warp tile BM/2 x BN/4)
  constexpr uint32_t kNI = BN / 32;  // 8-column MMA tiles per warp
  constexpr uint32_t kStages = stages<BM, BN>();
  constexpr uint32_t kExtra = Tiles::kStageExtraBytes;
  constexpr uint32_t kStageBytes = stage_bytes<BM, BN, kExtra>();
  constexpr uint32_t kTileABytes = BM * kRowBytes;
  constexpr bool kScaled = Tiles::kSliceScales;
  constexpr uint32_t kSteps = scale_steps<Tiles>();
  constexpr bool kMins = slice_mins<Tiles>();
  // Offsets after the weight tile: scale rows, mins, row sums.
  constexpr uint32_t kMinsOffset = kSteps * BN * 4, kRowSumOffset = kMinsOffset + BN * 4;
  static_assert(kAPieces >= 1 && kAPieces * kThreads == BM * kPiecesPerRow, "activation split");
  static_assert(kExtra % 16 == 0 && (!kScaled || kExtra >= kSteps * BN * 4),
                "policy bytes per stage");
  static_assert((kSteps == 1 || (kSteps == 2 && kScaled && !kTf32)) &&
                    (!kMins || (kScaled && !kTf32 && kExtra >= kRowSumOffset + kMaxTileRows * 4)),
                "scale steps and mins need the lowp slice scales and their bytes");

  extern __shared__ __align__(128) unsigned char smem[];
  uint32_t* row_flat = reinterpret_cast<uint32_t*>(smem + pipe_bytes<BM, BN, kExtra>());
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
    Tiles tiles(weights + expert * p.expert_stride_bytes, col0, p, tid);

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
      const uint32_t base = smem_base + stage * kStageBytes;
#pragma unroll
      for (uint32_t i = 0; i < kAPieces; ++i) {
        const uint32_t r = tid / kPiecesPerRow + i * kARowStep;
        if constexpr (kTf32) {
          sts128(base + swz(r, a_kq), to_tf32(areg[i][0]), to_tf32(areg[i][1]), to_tf32(areg[i][2]),
                 to_tf32(areg[i][3]));
        } else {
          const uint32_t lo = pack_pair<M>(areg[i][0], areg[i][1]);
          const uint32_t hi = pack_pair<M>(areg[i][2], areg[i][3]);
          sts64(base + swz(r, a_kq >> 1) + (a_kq & 1) * 8, lo, hi);
          if constexpr (kMins) {
            // The row's 32 stage values as the MMA reads them, summed over its 8 pieces (8
            // consecutive lanes) in a fixed tree.
            float sum = __fadd_rn(pair_sum<M>(lo), pair_sum<M>(hi));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
            sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 4));
            if (a_kq == 0) {
              asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + kTileABytes + BN * kRowBytes +
                                                             kRowSumOffset + r * 4),
                           "f"(sum)
                           : "memory");
            }
          }
        }
      }
    };
    auto b_base = [&](uint32_t stage) { return smem_base + stage * kStageBytes + kTileABytes; };
    auto load_b = [&](uint32_t k0) {
      if constexpr (!Tiles::kAsync) tiles.load(k0);
    };
    auto store_b = [&](uint32_t stage) {
      if constexpr (!Tiles::kAsync) tiles.store(b_base(stage));
    };
    auto prefetch_b = [&](uint32_t k0) {
      if constexpr (HasPrefetch<Tiles>::value) tiles.prefetch(k0);
    };

    float acc[kMI][kNI][4];
#pragma unroll
    for (uint32_t mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (uint32_t ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (uint32_t j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;

    const uint32_t ktiles = (k + kBK - 1) / kBK;
    // Prologue: async weights for stages 0..S-2 in flight, activations (and register-path weights)
    // of slice 0 stored, slice 1 loading.
#pragma unroll
    for (uint32_t s = 0; s + 1 < kStages; ++s) {
      if constexpr (Tiles::kAsync) {
        if (s < ktiles) tiles.issue(b_base(s), s * kBK);
      }
      cp_async_commit();
    }
    // Slices 2 .. kPrefetchStages + 1 asked of L2 (0 and 1 load now).
#pragma unroll
    for (uint32_t s = 2; s < 2 + kPrefetchStages; ++s) prefetch_b(s * kBK);
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
      if constexpr (Tiles::kAsync) {
        const uint32_t next = kt + kStages - 1;
        if (next < ktiles) tiles.issue(b_base(next % kStages), next * kBK);
      }
      cp_async_commit();

      const uint32_t a_base = smem_base + (kt % kStages) * kStageBytes;
      const uint32_t w_base = a_base + kTileABytes;
      // With slice scales the stage's products gather in `slice`, else straight in `acc`.
      float slice[kScaled ? kMI : 1][kScaled ? kNI : 1][4];
      if constexpr (kScaled) {
#pragma unroll
        for (uint32_t mi = 0; mi < kMI; ++mi)
#pragma unroll
          for (uint32_t ni = 0; ni < kNI; ++ni)
#pragma unroll
            for (uint32_t j = 0; j < 4; ++j) slice[mi][ni][j] = 0.0f;
      }
#pragma unroll
      for (uint32_t s = 0; s < 2; ++s) {  // two MMA K-steps per stage (16 bf16 or 8 tf32 each)
        uint32_t bf[kNI][2];
#pragma unroll
        for (uint32_t nj = 0; nj < kNI / 2; ++nj) {
          ldmatrix_x4(w_base + swz(warp_col + nj * 16 + b_lrow, 2 * s + b_lchunk), bf[2 * nj][0],
                      bf[2 * nj][1], bf[2 * nj + 1][0], bf[2 * nj + 1][1]);
        }
#pragma unroll
        for (uint32_t ni = 0; ni < kNI; ++ni) {
          bf[ni][0] = Tiles::fragment(bf[ni][0]);
          bf[ni][1] = Tiles::fragment(bf[ni][1]);
        }
#pragma unroll
        for (uint32_t mi = 0; mi < kMI; ++mi) {
          uint32_t af[4];
          ldmatrix_x4(a_base + swz(warp_row + mi * 16 + a_lrow, 2 * s + a_lchunk), af[0], af[1],
                      af[2], af[3]);
#pragma unroll
          for (uint32_t ni = 0; ni < kNI; ++ni) {
            float (&d)[4] = kScaled ? slice[kScaled ? mi : 0][kScaled ? ni : 0] : acc[mi][ni];
            if constexpr (kTf32) {
              mma_tf32(d, af, bf[ni]);
            } else {
              mma_lowp<M>(d, af, bf[ni]);
            }
          }
        }
        if constexpr (kScaled && kSteps == 2) {
          // This K-step's products join the result with its own scale row; the slice restarts.
          const auto* scales = reinterpret_cast<const float*>(
              smem + (kt % kStages) * kStageBytes + kTileABytes + BN * kRowBytes + s * BN * 4);
#pragma unroll
          for (uint32_t ni = 0; ni < kNI; ++ni) {
            const float2 sc =
                *reinterpret_cast<const float2*>(scales + warp_col + ni * 8 + 2 * quad);
#pragma unroll
            for (uint32_t mi = 0; mi < kMI; ++mi) {
              acc[mi][ni][0] = __fmaf_rn(sc.x, slice[mi][ni][0], acc[mi][ni][0]);
              acc[mi][ni][1] = __fmaf_rn(sc.y, slice[mi][ni][1], acc[mi][ni][1]);
              acc[mi][ni][2] = __fmaf_rn(sc.x, slice[mi][ni][2], acc[mi][ni][2]);
              acc[mi][ni][3] = __fmaf_rn(sc.y, slice[mi][ni][3], acc[mi][ni][3]);
#pragma unroll
              for (uint32_t j = 0; j < 4; ++j) slice[mi][ni][j] = 0.0f;
            }
          }
        }
      }
      if constexpr (kScaled && kSteps == 1) {
        // Accumulator (mi, ni, j) is column warp_col + ni*8 + 2*quad + j%2 (see the scatter).
        const auto* scales = reinterpret_cast<const float*>(smem + (kt % kStages) * kStageBytes +
                                                            kTileABytes + BN * kRowBytes);
#pragma unroll
        for (uint32_t ni = 0; ni < kNI; ++ni) {
          const float2 sc = *reinterpret_cast<const float2*>(scales + warp_col + ni * 8 + 2 * quad);
#pragma unroll
          for (uint32_t mi = 0; mi < kMI; ++mi) {
            acc[mi][ni][0] = __fmaf_rn(sc.x, slice[mi][ni][0], acc[mi][ni][0]);
            acc[mi][ni][1] = __fmaf_rn(sc.y, slice[mi][ni][1], acc[mi][ni][1]);
            acc[mi][ni][2] = __fmaf_rn(sc.x, slice[mi][ni][2], acc[mi][ni][2]);
            acc[mi][ni][3] = __fmaf_rn(sc.y, slice[mi][ni][3], acc[mi][ni][3]);
          }
        }
      }
      if constexpr (kMins) {
        // acc += min[col] * rowsum[row], after the stage's scaled products.
        const unsigned char* extra =
            smem + (kt % kStages) * kStageBytes + kTileABytes + BN * kRowBytes;
        const auto* mins = reinterpret_cast<const float*>(extra + kMinsOffset);
        const auto* sums = reinterpret_cast<const float*>(extra + kRowSumOffset);
#pragma unroll
        for (uint32_t ni = 0; ni < kNI; ++ni) {
          const float2 mn = *reinterpret_cast<const float2*>(mins + warp_col + ni * 8 + 2 * quad);
#pragma unroll
          for (uint32_t mi = 0; mi < kMI; ++mi) {
            const float s0 = sums[warp_row + mi * 16 + group];
            const float s1 = sums[warp_row + mi * 16 + group + 8];
            acc[mi][ni][0] = __fmaf_rn(mn.x, s0, acc[mi][ni][0]);
            acc[mi][ni][1] = __fmaf_rn(mn.y, s0, acc[mi][ni][1]);
            acc[mi][ni][2] = __fmaf_rn(mn.x, s1, acc[mi][ni][2]);
            acc[mi][ni][3] = __fmaf_rn(mn.y, s1, acc[mi][ni][3]);
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
          prefetch_b((kt + 2 + kPrefetchStages) * kBK);
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

}  // namespace routemm::cuda::grouped_tensor
