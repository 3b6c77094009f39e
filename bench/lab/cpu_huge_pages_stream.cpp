// The bf16-dot decode pattern (m = 1: 8 experts x 768 x 2048 bf16, 25 MB per call, 8 rotated
// copies, two threads, two weight streams per thread) from 4 KiB pages against huge pages
// (madvise MADV_HUGEPAGE on a 2 MiB aligned mapping), alternating over 8 rounds. Linux, AVX512_BF16:
//   g++ -O2 -std=c++20 -pthread bench/lab/cpu_huge_pages_stream.cpp -o /tmp/thp && /tmp/thp
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>
constexpr size_t K = 2048, N = 768, E = 8, COPIES = 8;
constexpr size_t BYTES = COPIES * E * N * K * 2;
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"))) void tile2(const uint16_t* x,
                                                                           const uint16_t* w0,
                                                                           const uint16_t* w1,
                                                                           float* o0, float* o1) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (size_t i = 0; i < K; i += 32) {
    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + i), xv);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + i), xv);
  }
  *o0 = _mm512_reduce_add_ps(a0);
  *o1 = _mm512_reduce_add_ps(a1);
}
uint16_t* alloc(bool huge) {
  void* p =
      mmap(nullptr, BYTES + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uintptr_t a = (reinterpret_cast<uintptr_t>(p) + (2 << 20) - 1) & ~uintptr_t((2 << 20) - 1);
  if (huge)
    madvise(reinterpret_cast<void*>(a), BYTES, MADV_HUGEPAGE);
  else
    madvise(reinterpret_cast<void*>(a), BYTES, MADV_NOHUGEPAGE);
  auto* w = reinterpret_cast<uint16_t*>(a);
  for (size_t i = 0; i < BYTES / 2; ++i) w[i] = 0x3f80 + (i % 7);
  return w;
}
long anon_huge_kb() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string line;
  long kb = 0;
  while (std::getline(f, line))
    if (line.rfind("AnonHugePages:", 0) == 0) kb = std::stol(line.substr(14));
  return kb;
}
double run(uint16_t* W, int reps) {
  std::vector<uint16_t> x(K, 0x3f80);
  std::vector<float> out(E * N);
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    int copy = r % COPIES;
    const uint16_t* w = W + copy * E * N * K;
    auto t0 = std::chrono::steady_clock::now();
    auto work = [&](int t) {
      // each thread: half of each expert's columns, as two segments (2 streams)
      for (size_t e = 0; e < E; ++e) {
        const uint16_t* we = w + e * N * K;
        size_t half = N / 2, c0 = t * half, seg = half / 2;
        for (size_t j = 0; j < seg; ++j)
          tile2(x.data(), we + (c0 + j) * K, we + (c0 + seg + j) * K, &out[e * N + c0 + j],
                &out[e * N + c0 + seg + j]);
      }
    };
    std::thread th(work, 1);
    work(0);
    th.join();
    double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, us);
  }
  return best;
}
int main() {
  uint16_t* a = alloc(false);
  long h0 = anon_huge_kb();
  uint16_t* b = alloc(true);
  long h1 = anon_huge_kb();
  printf("huge pages: %ld kB after plain, %ld kB after madvised (of %zu MB)\n", h0, h1,
         BYTES >> 20);
  for (int round = 0; round < 8; ++round) {
    double p, h;
    if (round % 2) {
      h = run(b, 64);
      p = run(a, 64);
    } else {
      p = run(a, 64);
      h = run(b, 64);
    }
    printf("round %d: 4K pages %.0f us, huge pages %.0f us (min of 64, 25 MB per call)\n", round, p,
           h);
  }
}
