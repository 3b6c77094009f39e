// Lab: the exact grouped expert-ID kernels side by side on the prefill shapes (m = 4096):
// grouped_kernel<T, true> (slices in slice_index layout) against grouped_outer_kernel (slices
// transposed, one outer product per position) compiled for one and for two blocks per
// multiprocessor. Same operands, same routing, CUDA-event medians; every variant's output must
// equal the first one's bit for bit (the numeric contract of csrc/backend/cuda/dense_matmul_id.cu),
// and every element must be written, else the lab exits 1.
//
//   nvcc -std=c++20 -arch=sm_90a -O3 --expt-relaxed-constexpr -Icsrc/include -Icsrc \
//     -Icsrc/backend/cuda -o /tmp/grouped_exact_lab bench/lab/grouped_exact_lab.cu && /tmp/grouped_exact_lab
#include <cstring>
#include <random>

#include "backend/cuda/dense_matmul_id.cu"
#include "q4_lab_common.cuh"

namespace lab {

using namespace routemm::cuda;
using routemm::kernels::DenseMatmulIdKernelParams;

struct Shape {
  const char* name;
  uint32_t experts, top_k, n, k;
};

__global__ void fill_kernel(uint16_t* p, size_t count, uint32_t seed, bool f32) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float v = (float(h & 0xFFFF) / 32768.0f - 1.0f) * 0.05f;
    if (f32) {
      reinterpret_cast<float*>(p)[i] = v;
    } else {
      p[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
    }
  }
}

template <class T>
int run(const Shape& s, uint32_t m) {
  constexpr size_t elem = sizeof(typename Chunk<T>::elem);
  const bool f32 = elem == 4;
  DenseMatmulIdKernelParams p{};
  p.m = m;
  p.n = s.n;
  p.k = s.k;
  p.top_k = s.top_k;
  p.n_experts = s.experts;
  p.input_layout = routemm::kernels::kInputSharedPerToken;
  p.expert_stride_bytes = uint64_t{s.n} * s.k * elem;
  p.input_token_stride_bytes = uint64_t{s.k} * 4;
  p.input_slot_stride_bytes = 0;

  // Distinct random experts per token, rows listed per expert in token order.
  std::mt19937 rng(7);
  std::vector<std::vector<uint32_t>> lists(s.experts);
  std::vector<uint32_t> pick(s.experts);
  for (uint32_t t = 0; t < m; ++t) {
    for (uint32_t e = 0; e < s.experts; ++e) pick[e] = e;
    for (uint32_t j = 0; j < s.top_k; ++j) {
      const uint32_t r = j + rng() % (s.experts - j);
      std::swap(pick[j], pick[r]);
      lists[pick[j]].push_back(t * s.top_k + j);
    }
  }
  std::vector<uint32_t> counts(s.experts), routed(size_t(s.experts) * m, 0);
  uint32_t max_count = 0;
  for (uint32_t e = 0; e < s.experts; ++e) {
    counts[e] = uint32_t(lists[e].size());
    max_count = std::max(max_count, counts[e]);
    std::copy(lists[e].begin(), lists[e].end(), routed.begin() + size_t(e) * m);
  }

  const size_t w_count = size_t(s.experts) * s.n * s.k, rows = size_t(m) * s.top_k;
  char *w = nullptr, *x = nullptr;
  uint32_t *d_counts = nullptr, *d_routed = nullptr;
  float* out[3] = {};
  CHECK(cudaMalloc(&w, w_count * elem));
  CHECK(cudaMalloc(&x, size_t(m) * s.k * 4));
  CHECK(cudaMalloc(&d_counts, counts.size() * 4));
  CHECK(cudaMalloc(&d_routed, routed.size() * 4));
  for (auto& o : out) CHECK(cudaMalloc(&o, rows * s.n * 4));
  fill_kernel<<<4096, 256>>>(reinterpret_cast<uint16_t*>(w), w_count, 1u, f32);
  fill_kernel<<<4096, 256>>>(reinterpret_cast<uint16_t*>(x), size_t(m) * s.k, 2u, true);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(d_counts, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_routed, routed.data(), routed.size() * 4, cudaMemcpyHostToDevice));

  const uint32_t tx = (max_count + kGroupRows - 1) / kGroupRows;
  const uint32_t ty = (s.n + kGroupCols - 1) / kGroupCols;
  const dim3 grid(tx * ty, 1, s.experts);
  CHECK(cudaFuncSetAttribute(grouped_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(kGroupDynamicShmem)));
  CHECK(cudaFuncSetAttribute(grouped_outer_kernel<T, true, 1>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kOuterDynamicShmem)));
  CHECK(cudaFuncSetAttribute(grouped_outer_kernel<T, true, 2>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kOuterDynamicShmem)));
  const auto launch = [&](int variant) {
    if (variant == 0) {
      grouped_kernel<T, true><<<grid, kGroupThreads, kGroupDynamicShmem>>>(
          p, w, x, d_counts, d_routed, out[0], tx, ty);
    } else if (variant == 1) {
      grouped_outer_kernel<T, true, 1><<<grid, kGroupThreads, kOuterDynamicShmem>>>(
          p, w, x, d_counts, d_routed, out[1], tx, ty);
    } else {
      grouped_outer_kernel<T, true, 2><<<grid, kGroupThreads, kOuterDynamicShmem>>>(
          p, w, x, d_counts, d_routed, out[2], tx, ty);
    }
  };
  const char* names[3] = {"slice layout", "outer, 1 block/SM", "outer, 2 blocks/SM"};
  const double flops = 2.0 * double(rows) * s.n * s.k;
  float us[3];
  for (int v = 0; v < 3; ++v) {
    CHECK(cudaMemset(out[v], 0xFF, rows * s.n * 4));  // NaN poison: every element must be written
    us[v] = median_event_us([&](int) { launch(v); }, 7, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  std::vector<uint32_t> ref(rows * s.n), got(rows * s.n);
  CHECK(cudaMemcpy(ref.data(), out[0], ref.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (const uint32_t v : ref) bad += v == 0xFFFFFFFFu;
  for (int v = 0; v < 3; ++v) {
    if (v > 0) {
      CHECK(cudaMemcpy(got.data(), out[v], got.size() * 4, cudaMemcpyDeviceToHost));
      if (std::memcmp(got.data(), ref.data(), got.size() * 4) != 0) ++bad;
    }
    std::printf("%-14s %-5s m=%u %-18s %9.1f us %6.2f TFLOP/s%s\n", s.name, f32 ? "f32" : "bf16", m,
                names[v], us[v], flops / us[v] * 1e-6, v == 0 ? "" : " (bits checked)");
  }
  std::printf("%s %s: %s\n", s.name, f32 ? "f32" : "bf16",
              bad == 0 ? "all variants bit-identical, every element written" : "MISMATCH");
  CHECK(cudaFree(w));
  CHECK(cudaFree(x));
  CHECK(cudaFree(d_counts));
  CHECK(cudaFree(d_routed));
  for (auto& o : out) CHECK(cudaFree(o));
  return bad;
}

}  // namespace lab

int main() {
  const lab::Shape shapes[] = {{"qwen3-30b-a3b", 128, 8, 768, 2048},
                               {"deepseek-v3", 256, 8, 2048, 7168},
                               {"mixtral-8x7b", 8, 2, 14336, 4096}};
  int bad = 0;
  for (const auto& s : shapes) {
    bad += lab::run<float>(s, 4096);
    bad += lab::run<routemm::cuda::BF16Tag>(s, 4096);
  }
  return bad == 0 ? 0 : 1;
}
