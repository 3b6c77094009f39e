// Lab: the exact grouped expert-ID kernels side by side on the prefill shapes (m = 4096): the
// previous layout (slice_layout_kernel: slices as 16-byte quads along K, one block per tile of the
// front door's geometry, most of them empty) against the library's kernel (transposed slices, one
// outer product per position, persistent over the work list of tiles holding rows). Same
// operands, same routing, CUDA-event medians; the library's output must equal the baseline's bit
// for bit (the numeric contract of csrc/backend/cuda/dense_matmul_id.cu), and every element must
// be written, else the lab exits 1. (The transposed layout on the front door's geometry, at one
// and two blocks per SM, is in git at 7866718.)
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

// Places the block and lists its routed rows in `flat_rows` (then a barrier). False when the block
// has nothing to compute: the whole block returns, before any barrier.
__device__ __forceinline__ bool grouped_block_begin(const DenseMatmulIdKernelParams& p,
                                                    const uint32_t* __restrict__ counts,
                                                    const uint32_t* __restrict__ routed,
                                                    uint32_t tiles_x, uint32_t tiles_y,
                                                    uint32_t* flat_rows, WorkItem& b) {
  b.expert = blockIdx.z;
  const uint32_t bx = blockIdx.x % tiles_x;
  const uint32_t by = blockIdx.x / tiles_x;
  if (by >= tiles_y || b.expert >= p.n_experts) return false;
  const uint32_t count = __ldg(counts + b.expert);
  b.row0 = bx * kGroupRows;
  b.col0 = by * kGroupCols;
  if (b.row0 >= count || b.col0 >= p.n) return false;
  b.rows = min(kGroupRows, count - b.row0);
  load_item_rows(p, routed, b, flat_rows);
  return true;
}

// The previous grouped kernel, kept here as the lab's baseline: slices in slice_index layout
// (per position run of a row, 16-byte quads along K), 8 weight quads and one activation quad
// live per 32 FMAs; one block per SM for F32 weights, two for 16-bit ones.
constexpr size_t kGroupDynamicShmem =
    2ull * (kGroupRows + kGroupCols) * kSlice * sizeof(float);  // 48 KiB

// Shared-memory slice layout, for X [32 rows][64] and W [64 cols][64] widened to F32: element
// (r, inner = 8 * part + j) sits at r * 64 + (j / 4) * 32 + part * 4 + (j % 4), so the 8 lanes of a
// group read 128 contiguous bytes with one 16-byte load each (no bank conflicts).
__device__ __forceinline__ uint32_t slice_index(uint32_t r, uint32_t part, uint32_t half) {
  return r * kSlice + half * 32 + part * 4;
}

// Step 2 for one half-slice: the thread's 8 x 8 tile takes the 4 positions of `half` of its chunk
// (part) from the weight quads `wv` (columns c_base..c_base + 7) and the activation slice `xs`
// (slice_index layout, rows r_base..r_base + 7), in increasing position order.
__device__ __forceinline__ void grouped_fma_half(float (&acc)[8][8], const float4 (&wv)[8],
                                                 const float* xs, uint32_t r_base, uint32_t part,
                                                 uint32_t half) {
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const float4 xv = *reinterpret_cast<const float4*>(&xs[slice_index(r_base + r, part, half)]);
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      acc[r][c] = fmaf(wv[c].x, xv.x, acc[r][c]);
      acc[r][c] = fmaf(wv[c].y, xv.y, acc[r][c]);
      acc[r][c] = fmaf(wv[c].z, xv.z, acc[r][c]);
      acc[r][c] = fmaf(wv[c].w, xv.w, acc[r][c]);
    }
  }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kGroupThreads, sizeof(typename Chunk<T>::elem) == 2 ? 2 : 1)
    slice_layout_kernel(const DenseMatmulIdKernelParams p, const char* __restrict__ w,
                        const char* __restrict__ x, const uint32_t* __restrict__ counts,
                        const uint32_t* __restrict__ routed, float* __restrict__ out,
                        uint32_t tiles_x, uint32_t tiles_y) {
  extern __shared__ float4
      grouped_smem[];  // kGroupDynamicShmem bytes: xs[2][32 * 64], ws[2][64 * 64]
  float (*xs)[kGroupRows * kSlice] = reinterpret_cast<float (*)[kGroupRows * kSlice]>(grouped_smem);
  float (*ws)[kGroupCols * kSlice] = reinterpret_cast<float (*)[kGroupCols * kSlice]>(
      reinterpret_cast<float*>(grouped_smem) + 2 * kGroupRows * kSlice);
  __shared__ uint32_t flat_rows[kGroupRows];
  WorkItem blk;
  if (!grouped_block_begin(p, counts, routed, tiles_x, tiles_y, flat_rows, blk)) return;
  const uint32_t tid = threadIdx.x;
  const uint32_t slices = (p.k + kSlice - 1) / kSlice;
  GroupedSliceLoader<T, VEC> loads(p, w, x, flat_rows, blk, tid);
  const uint32_t x_row = loads.row, x_part = loads.part, w_col0 = loads.col, w_part = loads.part;
  const Chunk<float>& xr = loads.xr;
  const Chunk<T>& wr0 = loads.wr0;
  const Chunk<T>& wr1 = loads.wr1;
  const auto load_slice = [&](uint32_t slice) { loads.load(slice); };

  auto store_slice = [&](int buf) {
    *reinterpret_cast<float4*>(&xs[buf][slice_index(x_row, x_part, 0)]) = xr.a;
    *reinterpret_cast<float4*>(&xs[buf][slice_index(x_row, x_part, 1)]) = xr.b;
    float4 a, b;
    a = make_float4(wr0.get(0), wr0.get(1), wr0.get(2), wr0.get(3));
    b = make_float4(wr0.get(4), wr0.get(5), wr0.get(6), wr0.get(7));
    *reinterpret_cast<float4*>(&ws[buf][slice_index(w_col0, w_part, 0)]) = a;
    *reinterpret_cast<float4*>(&ws[buf][slice_index(w_col0, w_part, 1)]) = b;
    a = make_float4(wr1.get(0), wr1.get(1), wr1.get(2), wr1.get(3));
    b = make_float4(wr1.get(4), wr1.get(5), wr1.get(6), wr1.get(7));
    *reinterpret_cast<float4*>(&ws[buf][slice_index(w_col0 + 32, w_part, 0)]) = a;
    *reinterpret_cast<float4*>(&ws[buf][slice_index(w_col0 + 32, w_part, 1)]) = b;
  };

  // Compute roles: tile = warp * 4 + group; in a warp the 4 groups share the column tile.
  const uint32_t lane = tid & 31, part = lane & 7, group = lane >> 3, warp = tid >> 5;
  const uint32_t r_base = group * 8;  // row tile (0..3) * 8
  const uint32_t c_base = warp * 8;   // column tile (0..7) * 8

  float acc[8][8];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;

  load_slice(0);
  store_slice(0);
  __syncthreads();
  for (uint32_t s = 0; s < slices; ++s) {
    const int buf = s & 1;
    if (s + 1 < slices) load_slice(s + 1);  // in flight during the FMAs below
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
      float4 wv[8];
#pragma unroll
      for (int c = 0; c < 8; ++c)
        wv[c] = *reinterpret_cast<const float4*>(&ws[buf][slice_index(c_base + c, part, half)]);
      grouped_fma_half(acc, wv, xs[buf], r_base, part, half);
    }
    if (s + 1 < slices)
      store_slice(buf ^ 1);  // the other buffer was last read before the previous barrier
    __syncthreads();
  }

  grouped_store_tile(p, acc, part, r_base, c_base, blk.col0, blk.rows, flat_rows, out);
}

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
  for (uint32_t e = 0; e < s.experts; ++e) {
    counts[e] = uint32_t(lists[e].size());
    std::copy(lists[e].begin(), lists[e].end(), routed.begin() + size_t(e) * m);
  }

  const size_t w_count = size_t(s.experts) * s.n * s.k, rows = size_t(m) * s.top_k;
  char *w = nullptr, *x = nullptr;
  uint32_t *d_counts = nullptr, *d_routed = nullptr;
  float* out[2] = {};
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

  // The baseline on the front door's geometry (row tiles over m, most of them empty); the library
  // kernel persistent over the work list, on two blocks per multiprocessor.
  const uint32_t tx = (m + kGroupRows - 1) / kGroupRows;
  const uint32_t ty = (s.n + kGroupCols - 1) / kGroupCols;
  const dim3 grid(tx * ty, 1, s.experts);
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned persistent = unsigned(std::min<uint64_t>(uint64_t{tx} * ty * s.experts, 2 * sms));
  const size_t outer_smem = kOuterDynamicShmem + (size_t{s.experts} + 1) * 4;
  CHECK(cudaFuncSetAttribute(slice_layout_kernel<T, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(kGroupDynamicShmem)));
  CHECK(cudaFuncSetAttribute(grouped_outer_kernel<T, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(outer_smem)));
  const auto launch = [&](int variant) {
    if (variant == 0) {
      slice_layout_kernel<T, true><<<grid, kGroupThreads, kGroupDynamicShmem>>>(
          p, w, x, d_counts, d_routed, out[0], tx, ty);
    } else {
      grouped_outer_kernel<T, true>
          <<<persistent, kGroupThreads, outer_smem>>>(p, w, x, d_counts, d_routed, out[1]);
    }
  };
  const char* names[2] = {"slice layout", "library (work list)"};
  const double flops = 2.0 * double(rows) * s.n * s.k;
  float us[2];
  for (int v = 0; v < 2; ++v) {
    CHECK(cudaMemset(out[v], 0xFF, rows * s.n * 4));  // NaN poison: every element must be written
    us[v] = median_event_us([&](int) { launch(v); }, 7, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  }
  std::vector<uint32_t> ref(rows * s.n), got(rows * s.n);
  CHECK(cudaMemcpy(ref.data(), out[0], ref.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (const uint32_t v : ref) bad += v == 0xFFFFFFFFu;
  for (int v = 0; v < 2; ++v) {
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
