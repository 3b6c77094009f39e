// Which instruction-set clone of the CPU kernels runs: the best the CPU (and OS) supports, capped by
// ROUTEMM_CPU_ISA. Every clone follows its kernel's numerical contract exactly (only operations
// with exactly specified results: fma, add, mul, exact conversions, permutes), so the choice changes
// the speed and never a bit of any output; the cap exists to test that and to compare the clones.
#pragma once

#include <string_view>

// x86-64 AVX-512 (F, BW, VL, DQ) kernels next to the AVX2 ones, under the same condition.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ROUTEMM_CPU_PORTABLE_ONLY)
#define ROUTEMM_CPU_HAVE_AVX512 1
#define ROUTEMM_CPU_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define ROUTEMM_CPU_HAVE_AVX512 0
#endif

// aarch64 NEON (Advanced SIMD) kernels, on every aarch64 CPU (the architecture requires NEON); the
// int8-dot routes use the dot-product instructions (SDOT) where the CPU has them.
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ROUTEMM_CPU_PORTABLE_ONLY)
#define ROUTEMM_CPU_HAVE_NEON 1
#else
#define ROUTEMM_CPU_HAVE_NEON 0
#endif

namespace routemm::cpu {

// The x86-64 clones are ordered (avx512 may use everything avx2 does); neon is aarch64's only
// clone beside the portable one. One build has the clones of one architecture only.
enum class CpuIsa { portable = 0, avx2 = 1, avx512 = 2, neon = 3 };

// "portable", "avx2", "avx512", "neon".
std::string_view cpu_isa_name(CpuIsa isa);

// True when a process running clone `selected` may use `isa`'s kernels: the portable ones always,
// a clone its own, and avx512 the avx2 ones too.
constexpr bool cpu_isa_includes(CpuIsa selected, CpuIsa isa) {
  return isa == CpuIsa::portable || isa == selected ||
         (selected == CpuIsa::avx512 && isa == CpuIsa::avx2);
}

// The clone the kernels use in this process: the best one the CPU supports, capped by
// ROUTEMM_CPU_ISA (read once). A cap above what the CPU supports selects the best supported one.
CpuIsa cpu_isa();

// True when the kernels may use `isa`'s clone (cpu_isa_includes(cpu_isa(), isa)).
inline bool cpu_isa_allows(CpuIsa isa) { return cpu_isa_includes(cpu_isa(), isa); }

// The best clone the CPU (and OS) supports, whatever the cap.
CpuIsa supported_cpu_isa();

// Pins the cap to `limit` for the object's lifetime, in place of ROUTEMM_CPU_ISA (C++ tests that
// compare the clones bit for bit in one process); not for use while other threads launch kernels.
class CpuIsaLimitForTesting {
 public:
  explicit CpuIsaLimitForTesting(CpuIsa limit);
  ~CpuIsaLimitForTesting();
  CpuIsaLimitForTesting(const CpuIsaLimitForTesting&) = delete;
  CpuIsaLimitForTesting& operator=(const CpuIsaLimitForTesting&) = delete;

 private:
  int previous_;
};

}  // namespace routemm::cpu
