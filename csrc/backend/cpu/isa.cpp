// Instruction-set selection of the CPU kernels (see isa.h).
#include "isa.h"

#include <atomic>

#include "routemm/env.h"

namespace routemm::cpu {
namespace {

// -1: no test pin; otherwise the CpuIsa value a CpuIsaLimitForTesting holds.
std::atomic<int> pinned_limit{-1};

}  // namespace

CpuIsa supported_cpu_isa() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return CpuIsa::avx512;
  }
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(ROUTEMM_CPU_PORTABLE_ONLY)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return CpuIsa::avx2;
  }
#endif
#if ROUTEMM_CPU_HAVE_NEON
  return CpuIsa::neon;  // every aarch64 CPU has NEON
#endif
  return CpuIsa::portable;
}

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::neon: return "neon";
    case CpuIsa::portable: break;
  }
  return "portable";
}

CpuIsa cpu_isa() {
  // `limit` where the best supported clone includes it, else the best (a cap above the CPU).
  const auto capped = [](CpuIsa limit) {
    const CpuIsa best = supported_cpu_isa();
    return cpu_isa_includes(best, limit) ? limit : best;
  };
  if (const int pinned = pinned_limit.load(std::memory_order_relaxed); pinned >= 0) {
    return capped(static_cast<CpuIsa>(pinned));
  }
  static const CpuIsa selected = [&capped] {
    const std::optional<std::string> cap = env::cpu_isa();  // a name of this architecture's
    if (!cap) return supported_cpu_isa();
    CpuIsa limit = CpuIsa::avx512;
    if (*cap == "portable") limit = CpuIsa::portable;
    if (*cap == "avx2") limit = CpuIsa::avx2;
    if (*cap == "neon") limit = CpuIsa::neon;
    return capped(limit);
  }();
  return selected;
}

CpuIsaLimitForTesting::CpuIsaLimitForTesting(CpuIsa limit)
    : previous_(pinned_limit.exchange(static_cast<int>(limit))) {}

CpuIsaLimitForTesting::~CpuIsaLimitForTesting() { pinned_limit.store(previous_); }

}  // namespace routemm::cpu
