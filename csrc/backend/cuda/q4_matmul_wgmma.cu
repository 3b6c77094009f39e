// The bf16 Q4_0 matrix routes (compatibility_v2: 128 tokens, tensor_64x32: 32 tokens, 128 weight
// rows per CTA either way) on Hopper warpgroup MMA. q4_matmul.cu's launcher takes this kernel on
// compute capability 9.0 in sm_90a builds when k % 256 == 0 and the weight view is 16-byte aligned
// (q4_wgmma_eligible); every other product keeps the mma.sync kernel there. Both routes always take
// the same kernel for one product, so their results stay bit-identical.
//
// TWO LAUNCHES per dispatch, on the dispatch's stream:
//   1. q4_activations_bf16_kernel rounds the F32 activations to bf16 (round to nearest even, as
//      the mma.sync kernel does) into a stream-ordered workspace (hopper_support.h), permuting the
//      32 values of each Q4_0 block into the K order of the weight fragments (below). The bf16 copy
//      halves the bytes every CTA of a token tile reads again, and lets TMA load the activation
//      tiles already swizzled for the wgmma descriptors.
//   2. q4_wgmma_kernel: per CTA a 128-row x T-token output tile (T = 128 or 32) over one K split.
//
// DATA PATH of the kernel (256 threads = two warpgroups of 64 weight rows each; no producer
// warpgroup: thread 0 issues every TMA copy):
//   - weights: raw GGUF blocks by 2-D TMA over the view as 8-byte elements (n rows of k / 32 * 18
//     bytes), one stage = 8 blocks (144 bytes) of 128 rows, kWStages deep; rows past n arrive as
//     zeros.
//   - activations: 2-D TMA boxes of 64 bf16 values x T tokens from the workspace with the 128-byte
//     swizzle, one slot = 64 values of K, kXSlots deep; tokens past m arrive as zeros.
//   - each thread decodes its own A fragment from the raw stage straight into registers (weights
//     never pass through shared memory as bf16): for one block, row g of its warp's 16 and row
//     g + 8, the four nibble bytes 4t..4t+3 (t = lane % 4) give the K slots 2t, 2t+1, 2t+8, 2t+9
//     of the two wgmmas of the block (low nibbles: values 4t..4t+3; high: 16 + 4t..). The
//     activation workspace holds each block's values in that slot order.
//   - four wgmmas (m64 x T x 16, A from registers, B the swizzled slot) per slot of two blocks; two
//     register sets of A, so slot j + 1 is decoded while slot j's wgmmas run (wgmma.wait_group 1).
//     The loop runs per weight stage (one wait) over its four slots (unrolled: constant offsets),
//     which keeps the per-warp instruction chain short -- at two CTAs per multiprocessor the kernel
//     has four warps per scheduler, so every instruction of a block's chain shows in its time.
//   - slots and stages go back to thread 0 through "empty" mbarriers (one arrival per warp), which
//     refills them: an activation slot once the wgmmas that read it retired, a weight stage once
//     every warp decoded its last block.
// NUMERICS: the bf16 numerics of q4_matmul.cu (weights bf16(bf16(d) * (q - 8)), activations bf16(x),
// F32 accumulation by the tensor cores), summed over K in steps of 16 values in increasing block
// order within a split, the splits added in increasing order as in q4_matmul.cu. The steps differ
// from the mma.sync kernel's (K 16 per mma.sync, other internal order), so the two kernels agree
// within the route's tolerance, not bit for bit; an output element's value depends on (m, n, k) and
// its operands only, never on T, which keeps V2 == 64x32.
// K split (grid.z > 1, one cluster along z): q4_split_store.cuh, as in q4_matmul.cu -- every CTA
// parks its partial tile in its own shared memory (the ring is free by then) and CTA `rank` adds
// slice `rank` of the tile over the splits in increasing split order, then stores it.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "hopper_support.h"
#include "q4_matmul_wgmma.h"
#include "q4_nibbles.cuh"
#include "q4_split_store.cuh"
#include "routemm/error.h"
#include "smem_opt_in.h"
#include "wgmma.cuh"

namespace routemm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = 128;                            // weight rows per CTA: 64 per warpgroup
constexpr int kStageBlocks = 8;                       // Q4_0 blocks of K per weight stage
constexpr int kStageRowBytes = 18 * kStageBlocks;     // 144 = 9 x 16: one TMA box row
constexpr int kWStageBytes = kRows * kStageRowBytes;  // 18432
constexpr int kSliceK = 64;                           // K values per activation slot (128 bytes)

// Ring depths: two CTAs per multiprocessor for both tiles (four warpgroups interleave their
// decoding with the tensor cores).
template <int kTokens>
struct Cfg;
template <>
struct Cfg<128> {
  static constexpr int kWStages = 2, kXSlots = 4, kMinBlocks = 2;
};
template <>
struct Cfg<32> {
  static constexpr int kWStages = 4, kXSlots = 8, kMinBlocks = 2;
};

template <int kTokens>
struct Layout {
  using C = Cfg<kTokens>;
  static constexpr int kXSlotBytes = kTokens * 128;
  static constexpr int kXBytes = C::kXSlots * kXSlotBytes;  // first: 1024-byte aligned slots
  static constexpr int kWBytes = C::kWStages * kWStageBytes;
  static constexpr int kBarOffset = kXBytes + kWBytes;
  static constexpr int kBars = 2 * (C::kWStages + C::kXSlots);
  static constexpr int kSmem = 1024 + kBarOffset + 8 * kBars;  // + alignment slack
  static constexpr int kPartialStride = kRows + 4;             // floats per token: no bank clash
  static_assert(kXSlotBytes % 1024 == 0 && kWStageBytes % 128 == 0);
  static_assert(kTokens * kPartialStride * 4 <= kBarOffset, "partials reuse the ring");
};

// The activation pass is a grid-stride loop; more groups than this add nothing on any GPU of this
// class (a few waves of 256-thread groups) and only cost launch time.
constexpr uint64_t kConvertGroupsMax = 2048;

struct WgArgs {
  float* output;
  int32_t n, m, k_blocks, blocks_per_split;
};

// Quad q of the flat m x k activations (x[4q..4q+3], inside one 32-value block at quad c = q % 8:
// half h = c / 4, lane quarter u = c % 4) goes to bf16 positions 16h + 2u (x0, x1) and 16h + 8 + 2u
// (x2, x3) of the same block: the K slots of the weight fragments (file comment).
__global__ void q4_activations_bf16_kernel(const float* __restrict__ x, uint32_t* __restrict__ out,
                                           uint64_t quads, bool vec) {
  const uint64_t step = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t q = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; q < quads; q += step) {
    float4 v;
    if (vec) {
      v = __ldg(reinterpret_cast<const float4*>(x) + q);
    } else {
      v = make_float4(__ldg(x + 4 * q), __ldg(x + 4 * q + 1), __ldg(x + 4 * q + 2),
                      __ldg(x + 4 * q + 3));
    }
    const uint32_t c = static_cast<uint32_t>(q % 8), h = c / 4, u = c % 4;
    uint32_t* const block = out + (q / 8) * 16;
    block[8 * h + u] = bits_of(__floats2bfloat162_rn(v.x, v.y));
    block[8 * h + 4 + u] = bits_of(__floats2bfloat162_rn(v.z, v.w));
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The A registers of both wgmmas of one block for rows g and g + 8 (`row_g` points at row g's block
// in the raw stage; row g + 8 is 8 stage rows further): lo[] the low-nibble wgmma, hi[] the high.
__device__ __forceinline__ void decode_block(const unsigned char* row_g, uint32_t t,
                                             uint32_t (&lo)[4], uint32_t (&hi)[4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const auto* words = reinterpret_cast<const uint16_t*>(row_g + half * 8 * kStageRowBytes);
    const float d = __half2float(__ushort_as_half(words[0]));
    const __nv_bfloat162 d2 = __floats2bfloat162_rn(d, d);
    const uint32_t bytes = uint32_t{words[1 + 2 * t]} | (uint32_t{words[2 + 2 * t]} << 16);
    uint32_t l01, h01, l23, h23;
    nibble_pairs<0x4140>(bytes, l01, h01);
    nibble_pairs<0x4342>(bytes, l23, h23);
    lo[half] = scale_pair(l01, d2);
    lo[2 + half] = scale_pair(l23, d2);
    hi[half] = scale_pair(h01, d2);
    hi[2 + half] = scale_pair(h23, d2);
  }
}

template <int kTokens>
__device__ __forceinline__ void wgmma_block_half(float (&acc)[kTokens / 2], const uint32_t (&a)[4],
                                                 uint64_t desc) {
  if constexpr (kTokens == 128) {
    sm90::wgmma_m64n128k16_bf16_rs(acc, a, desc);
  } else {
    sm90::wgmma_m64n32k16_bf16_rs(acc, a, desc);
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <int kTokens>
__global__ void __launch_bounds__(kThreads, Cfg<kTokens>::kMinBlocks)
    q4_wgmma_kernel(const __grid_constant__ CUtensorMap weight_map,
                    const __grid_constant__ CUtensorMap input_map, const WgArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Cfg<kTokens>;
  using L = Layout<kTokens>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw_base + 1023u) & ~1023u;
  unsigned char* const base_ptr = smem_raw + (base - raw_base);
  const uint32_t x_ring = base, w_ring = base + L::kXBytes, bars = base + L::kBarOffset;
  const auto w_full = [&](int s) { return bars + 8 * s; };
  const auto w_empty = [&](int s) { return bars + 8 * (C::kWStages + s); };
  const auto x_full = [&](int s) { return bars + 8 * (2 * C::kWStages + s); };
  const auto x_empty = [&](int s) { return bars + 8 * (2 * C::kWStages + C::kXSlots + s); };

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tok0 = static_cast<int>(blockIdx.x) * kTokens;
  const int row0 = static_cast<int>(blockIdx.y) * kRows;
  const int kb_begin = static_cast<int>(blockIdx.z) * a.blocks_per_split;
  // A whole number of stages: k % 256 == 0 and blocks_per_split % kStageBlocks == 0.
  const int blocks = max(0, min(a.k_blocks, kb_begin + a.blocks_per_split) - kb_begin);
  const int stages = blocks / kStageBlocks, slots = blocks / 2;

  if (tid == 0) {
    for (int s = 0; s < C::kWStages; ++s) {
      sm90::mbar_init(w_full(s), 1);
      sm90::mbar_init(w_empty(s), 8);  // one arrival per warp
    }
    for (int s = 0; s < C::kXSlots; ++s) {
      sm90::mbar_init(x_full(s), 1);
      sm90::mbar_init(x_empty(s), 8);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();

  // Thread 0 only.
  const auto issue_weights = [&](int s) {
    const int pos = s % C::kWStages;
    sm90::mbar_arrive_expect_tx(w_full(pos), kWStageBytes);
    sm90::tma_load_2d(w_ring + pos * kWStageBytes, &weight_map, w_full(pos),
                      (kb_begin + s * kStageBlocks) * 18 / 8, row0);
  };
  const auto issue_inputs = [&](int j) {
    const int pos = j % C::kXSlots;
    sm90::mbar_arrive_expect_tx(x_full(pos), L::kXSlotBytes);
    sm90::tma_load_2d(x_ring + pos * L::kXSlotBytes, &input_map, x_full(pos),
                      kb_begin * 32 + j * kSliceK, tok0);
  };
  if (tid == 0) {
    sm90::prefetch_tensor_map(&weight_map);
    sm90::prefetch_tensor_map(&input_map);
    // In the order the consumers need them: a stage's activation slots (L2-resident, small), then
    // its weights (from DRAM), so the first slots do not queue behind the whole weight ring.
    for (int s = 0; s < min(C::kWStages, stages); ++s) {
      for (int j = 4 * s; j < min(4 * s + 4, min(C::kXSlots, slots)); ++j) issue_inputs(j);
      issue_weights(s);
    }
    for (int j = 4 * C::kWStages; j < min(C::kXSlots, slots); ++j) issue_inputs(j);
  }

  const int wg = warp >> 2, wg_warp = warp & 3;
  const int row_off = (wg * 64 + wg_warp * 16 + g) * kStageRowBytes;
  float acc[kTokens / 2];
#pragma unroll
  for (int i = 0; i < kTokens / 2; ++i) acc[i] = 0.0f;
  // A registers of one slot (two blocks): [register set][block of the slot][low / high nibble
  // wgmma][register]. Slot j is decoded into set j % 2 while slot j - 1's wgmmas run.
  uint32_t frag[2][2][2][4];
  // This thread's row g in the weight ring (row g + 8 is 8 stage rows further).
  const unsigned char* const w_thread = base_ptr + L::kXBytes + row_off;
  const uint32_t quarter = static_cast<uint32_t>(t);

  // Slot q (0..3, a compile-time constant) of weight stage s: blocks 2q and 2q + 1 of the stage.
  const auto slot_step = [&](int s, const unsigned char* w_stage, auto slot_in_stage) {
    constexpr int kQ = decltype(slot_in_stage)::value;
    constexpr int kSet = kQ & 1;
    const int j = 4 * s + kQ;
    const int x_pos = j % C::kXSlots;
    sm90::mbar_wait(x_full(x_pos), (j / C::kXSlots) & 1);
    decode_block(w_stage + (2 * kQ) * 18, quarter, frag[kSet][0][0], frag[kSet][0][1]);
    decode_block(w_stage + (2 * kQ + 1) * 18, quarter, frag[kSet][1][0], frag[kSet][1][1]);
    const uint64_t desc = sm90::smem_desc_k128(x_ring + x_pos * L::kXSlotBytes);
    sm90::wgmma_fence();
    sm90::fence_operands(acc);
    wgmma_block_half<kTokens>(acc, frag[kSet][0][0], desc);
    wgmma_block_half<kTokens>(acc, frag[kSet][0][1], desc + 2);
    wgmma_block_half<kTokens>(acc, frag[kSet][1][0], desc + 4);
    wgmma_block_half<kTokens>(acc, frag[kSet][1][1], desc + 6);
    sm90::wgmma_commit();
    sm90::fence_operands(acc);
    if (kQ == 3) {  // this warp read the stage for the last time
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(w_empty(s % C::kWStages));
    }
    sm90::wgmma_wait<1>();  // slot j - 1's wgmmas retired: its registers and slot are free
    sm90::fence_operands(acc);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      sm90::fence_operands(frag[kSet ^ 1][b][0]);
      sm90::fence_operands(frag[kSet ^ 1][b][1]);
    }
    if (j > 0) {
      const int done = (j - 1) % C::kXSlots;
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(x_empty(done));
      if (tid == 0 && j - 1 + C::kXSlots < slots) {
        sm90::mbar_wait(x_empty(done), ((j - 1) / C::kXSlots) & 1);
        issue_inputs(j - 1 + C::kXSlots);
      }
    }
    if (kQ == 3 && tid == 0 && s + C::kWStages < stages) {
      sm90::mbar_wait(w_empty(s % C::kWStages), (s / C::kWStages) & 1);
      issue_weights(s + C::kWStages);
    }
  };
  for (int s = 0; s < stages; ++s) {
    const int w_pos = s % C::kWStages;
    sm90::mbar_wait(w_full(w_pos), (s / C::kWStages) & 1);
    const unsigned char* const w_stage = w_thread + w_pos * kWStageBytes;
    slot_step(s, w_stage, std::integral_constant<int, 0>{});
    slot_step(s, w_stage, std::integral_constant<int, 1>{});
    slot_step(s, w_stage, std::integral_constant<int, 2>{});
    slot_step(s, w_stage, std::integral_constant<int, 3>{});
  }
  sm90::wgmma_wait<0>();
  sm90::fence_operands(acc);

  // acc[4 jj + i]: tile row 64 wg + 16 wg_warp + g + 8 (i / 2), tile token 8 jj + 2t + i % 2.
  const int rows_valid = min(kRows, a.n - row0), toks_valid = min(kTokens, a.m - tok0);
  const auto for_each = [&](auto&& visit) {
#pragma unroll
    for (int jj = 0; jj < kTokens / 8; ++jj)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        visit(wg * 64 + wg_warp * 16 + g + 8 * (i >> 1), 8 * jj + 2 * t + (i & 1), acc[4 * jj + i]);
  };
  store_q4_tile<kRows, kTokens, kThreads, L::kPartialStride>(a.output, a.n, base_ptr, row0, tok0,
                                                             rows_valid, toks_valid, for_each);
#else
  __trap();  // launched only where the sm_90a image exists (q4_wgmma_eligible)
#endif
}

template <int kTokens>
void launch_tile(const std::string& label, cudaStream_t stream, const Q4WgmmaProblem& p,
                 const uint32_t* activations) {
  using L = Layout<kTokens>;
  constexpr auto kernel = &q4_wgmma_kernel<kTokens>;
  opt_in_dynamic_smem<kernel>(label, L::kSmem, L::kSmem);
  const uint64_t row_bytes = uint64_t{p.k} / 32 * 18;
  // The blocks as 8-byte elements (row_bytes % 16 == 0 keeps rows whole): 18 elements per row run
  // instead of 144 bytes (measured on the H200: the same time either way).
  const CUtensorMap weight_map = encode_tensor_map_2d(
      label, "weights", CU_TENSOR_MAP_DATA_TYPE_UINT64, const_cast<uint8_t*>(p.weight),
      row_bytes / 8, p.n, row_bytes, kStageRowBytes / 8, kRows, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap input_map = encode_tensor_map_2d(
      label, "activations", CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, const_cast<uint32_t*>(activations),
      p.k, p.m, uint64_t{p.k} * 2, kSliceK, kTokens, CU_TENSOR_MAP_SWIZZLE_128B);
  WgArgs a{};
  a.output = p.output;
  a.n = static_cast<int32_t>(p.n);
  a.m = static_cast<int32_t>(p.m);
  a.k_blocks = static_cast<int32_t>(p.k / 32);
  const int per_split = (a.k_blocks + static_cast<int>(p.splits) - 1) / static_cast<int>(p.splits);
  a.blocks_per_split = (per_split + kStageBlocks - 1) / kStageBlocks * kStageBlocks;

  const dim3 grid((p.m + kTokens - 1) / kTokens, (p.n + kRows - 1) / kRows, p.splits);
  if (const cudaError_t e =
          launch_k_split(kernel, grid, kThreads, L::kSmem, stream, weight_map, input_map, a);
      e != cudaSuccess) {
    throw Error("'" + label + "': launch failed: " + cudaGetErrorString(e));
  }
}

}  // namespace

bool q4_wgmma_eligible(int device, const void* weight, uint64_t k) {
  return k > 0 && k % 256 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
         hopper_kernels_available(device);
}

uint64_t q4_wgmma_smem_bytes(int tokens) {
  return tokens == 128 ? Layout<128>::kSmem : Layout<32>::kSmem;
}

void launch_q4_wgmma(const std::string& label, cudaStream_t stream, const Q4WgmmaProblem& p,
                     int tokens) {
  if (tokens != 128 && tokens != 32) throw Error("'" + label + "': no Hopper kernel for this tile");
  // The workspace is freed on the stream after both launches (or at once if a launch fails).
  const uint64_t quads = uint64_t{p.m} * p.k / 4;
  const StreamWorkspace workspace(label, quads * 8, stream);
  auto* const activations = static_cast<uint32_t*>(workspace.data());
  const bool vec = reinterpret_cast<uintptr_t>(p.input) % 16 == 0;
  const uint64_t groups = std::min<uint64_t>((quads + 255) / 256, kConvertGroupsMax);
  q4_activations_bf16_kernel<<<static_cast<unsigned>(groups), 256, 0, stream>>>(
      p.input, activations, quads, vec);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + label + "': activation conversion launch failed: " + cudaGetErrorString(e));
  }
  if (tokens == 128) {
    launch_tile<128>(label, stream, p, activations);
  } else {
    launch_tile<32>(label, stream, p, activations);
  }
}

}  // namespace routemm::cuda
