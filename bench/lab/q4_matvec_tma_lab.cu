// Lab: the experimental TMA-fed Q4_0 mat-vec (q4_matvec_tma_kernel.cuh) over CTA shapes (warps x
// CTAs per SM) and K splits, beside the cluster capacity the driver reports for each launch, and
// stream-only TMA rings over box shapes (what the data path alone delivers). Weights rotate over
// 8 copies (> 2x L2); CUDA events per launch (an empty kernel's event time is printed for the
// overhead). The shape sweep runs with LAB_SWEEP=1.
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -DROUTEMM_CUDA_HAS_SM90A=1 \
//        -Icsrc/include -Icsrc -Icsrc/backend/cuda -o /tmp/mvlab bench/lab/q4_matvec_tma_lab.cu \
//        csrc/backend/cuda/hopper_support.cu && /tmp/mvlab
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "q4_lab_common.cuh"
#include "q4_matvec_tma_kernel.cuh"

using namespace routemm::cuda;

__global__ void empty_kernel() {}

// Stream-only: the weight ring of the kernel above with nothing but the waits (all threads wait for
// a stage, one arrival per warp frees it, thread 0 refills it at once): what 2-D TMA boxes of
// kRowsPerBox rows x kBoxBytes bytes deliver by themselves.
template <int kRowsPerBox, int kBoxBytes, int kStages>
__global__ void __launch_bounds__(256)
    tma_stream_kernel(const __grid_constant__ CUtensorMap map, int blocks_per_split, int k_blocks,
                      uint32_t* sink) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 127) & ~127u;
  constexpr int kStageBytes = kRowsPerBox * kBoxBytes;
  const uint32_t bars = base + kStages * kStageBytes;
  const int kb0 = blockIdx.z * blocks_per_split;
  const int blocks = max(0, min(k_blocks, kb0 + blocks_per_split) - kb0);
  const int stages = blocks * 18 / kBoxBytes;
  const int row0 = blockIdx.x * kRowsPerBox;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbar_init(bars + 8 * i, 1);
      sm90::mbar_init(bars + 8 * (kStages + i), 8);
    }
    sm90::fence_mbar_init();
  }
  __syncthreads();
  const auto issue = [&](int s) {
    const int pos = s % kStages;
    sm90::mbar_arrive_expect_tx(bars + 8 * pos, kStageBytes);
    sm90::tma_load_2d(base + pos * kStageBytes, &map, bars + 8 * pos,
                      (kb0 * 18 + s * kBoxBytes) / 8, row0);
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < min(kStages, stages); ++s) issue(s);
  uint32_t acc = 0;
  for (int s = 0; s < stages; ++s) {
    const int pos = s % kStages;
    sm90::mbar_wait(bars + 8 * pos, (s / kStages) & 1);
    acc += smem_raw[(base - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw))) +
                    pos * kStageBytes + threadIdx.x * 4];
    __syncwarp();
    if ((threadIdx.x & 31) == 0) sm90::mbar_arrive(bars + 8 * (kStages + pos));
    if (threadIdx.x == 0 && s + kStages < stages) {
      sm90::mbar_wait(bars + 8 * (kStages + pos), (s / kStages) & 1);
      issue(s + kStages);
    }
  }
  if (acc == 0xFFFFFFFFu) sink[0] = acc;
}

template <int kRowsPerBox, int kBoxBytes, int kStages>
void stream_case(const Q4LabOperands& ops, uint32_t* sink, uint32_t n, uint32_t k,
                 uint32_t splits) {
  constexpr auto kernel = &tma_stream_kernel<kRowsPerBox, kBoxBytes, kStages>;
  const int smem = 128 + kStages * kRowsPerBox * kBoxBytes + 16 * kStages;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const uint64_t row_bytes = uint64_t{k} / 32 * 18;
  const int k_blocks = static_cast<int>(k / 32);
  // Whole boxes per split.
  const int box_blocks = kBoxBytes / 18;
  const int per = (k_blocks + static_cast<int>(splits) - 1) / static_cast<int>(splits);
  const int blocks_per_split = (per + box_blocks - 1) / box_blocks * box_blocks;
  std::vector<CUtensorMap> maps;
  for (uint8_t* w : ops.weights) {
    maps.push_back(encode_tensor_map_2d("lab", "weights", CU_TENSOR_MAP_DATA_TYPE_UINT64, w,
                                        row_bytes / 8, n, row_bytes, kBoxBytes / 8, kRowsPerBox,
                                        CU_TENSOR_MAP_SWIZZLE_NONE));
  }
  const dim3 grid(n / kRowsPerBox, 1, splits);
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem));
  const float us = median_event_us(
      [&](int i) {
        kernel<<<grid, 256, smem>>>(maps[i % maps.size()], blocks_per_split, k_blocks, sink);
      },
      100);
  std::printf(
      "stream rows=%3d box=%4d B stages=%d n=%u k=%5u splits=%u ctas=%4u per_sm=%d  "
      "events median %6.2f us\n",
      kRowsPerBox, kBoxBytes, kStages, n, k, splits, grid.x * grid.z, per_sm, us);
}

int main() {
  const Q4LabOperands ops(4096, 14336, 8, lab_weight_copies());
  std::printf("empty kernel: events median %.2f us\n",
              median_event_us([&](int) { empty_kernel<<<1, 32>>>(); }, 200));
  struct Shape {
    uint32_t n, k;
  };
  const auto sweep = [&](auto shape_tag, const char* name) {
    using S = decltype(shape_tag);
    for (const Shape s : {Shape{4096, 14336}, Shape{4096, 2048}}) {
      for (uint32_t m : {1u, 8u}) {
        for (uint32_t splits : {2u, 4u, 8u}) {
          const MvLayout l = layout_for<S>(static_cast<int>(std::min(m, 8u)));
          cudaLaunchAttribute attribute;
          const cudaLaunchConfig_t config =
              k_split_config(dim3((s.n + S::kRows - 1) / S::kRows, (m + 7) / 8, splits),
                             S::kThreads, l.smem_bytes(), nullptr, attribute);
          CHECK(cudaFuncSetAttribute(q4_matvec_tma_kernel<S>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem_bytes_of<S>())));
          int clusters = 0;
          CHECK(cudaOccupancyMaxActiveClusters(&clusters, q4_matvec_tma_kernel<S>, &config));
          const float us = median_event_us(
              [&](int i) {
                const Q4MatVecTmaProblem p{ops.weight(i), ops.input, ops.output, m,
                                           s.n,           s.k,       splits};
                launch_shape<S>("lab", nullptr, p);
              },
              100);
          std::printf(
              "%-10s n=%u k=%5u m=%u splits=%u ctas=%4u clusters=%3u smem=%6d w_stages=%d "
              "x_slots=%d max_clusters=%3d  events median %6.2f us\n",
              name, s.n, s.k, m, splits, config.gridDim.x * config.gridDim.z, config.gridDim.x,
              l.smem_bytes(), l.w_stages, l.x_slots, clusters, us);
        }
      }
    }
  };
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 16));
  stream_case<128, 144, 3>(ops, sink, 4096, 14336, 8);
  stream_case<128, 144, 6>(ops, sink, 4096, 14336, 8);
  stream_case<64, 144, 6>(ops, sink, 4096, 14336, 8);
  stream_case<32, 144, 8>(ops, sink, 4096, 14336, 8);
  stream_case<128, 288, 3>(ops, sink, 4096, 14336, 8);
  stream_case<64, 288, 4>(ops, sink, 4096, 14336, 8);
  stream_case<32, 576, 4>(ops, sink, 4096, 14336, 4);
  stream_case<16, 1008, 4>(ops, sink, 4096, 14336, 8);
  stream_case<16, 2016, 2>(ops, sink, 4096, 14336, 4);
  stream_case<8, 2016, 4>(ops, sink, 4096, 14336, 4);
  if (std::getenv("LAB_SWEEP") != nullptr) {
    sweep(MvShape<8, 3>{}, "8w x 3/SM");
    sweep(MvShape<4, 5>{}, "4w x 5/SM");
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
