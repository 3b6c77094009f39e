// Environment knobs: read once, validated, recorded when not default.
#include "routemm/env.h"

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <string_view>

#include "routemm/error.h"

namespace routemm::env {
namespace {

constexpr Knob kKnobs[] = {
    {"ROUTEMM_BACKEND", "str", "", "backend Device() opens when none is named: cpu, cuda or metal"},
    {"ROUTEMM_CPU_THREADS", "int", "0",
     "worker threads of the CPU backend; 0 uses every hardware thread"},
    {"ROUTEMM_CPU_SPIN_US", "int", "200",
     "microseconds the CPU backend's threads poll before they sleep: a worker for the next kernel, "
     "the calling thread for the workers' last chunks (waking a sleeping thread costs tens of "
     "microseconds); 0: they sleep at once. No polling when ROUTEMM_CPU_THREADS exceeds the "
     "hardware threads"},
    {"ROUTEMM_CPU_ISA", "str", "",
     "highest instruction set the CPU kernels may use: avx512, avx2 or portable on x86-64, neon "
     "or portable on aarch64 (unset: the best the CPU has); exact routes give the same bits under "
     "every value, and reduced-precision "
     "routes whose instructions are excluded are not registered"},
    {"ROUTEMM_CPU_HUGE_PAGES", "bool", "1",
     "0: CPU backend buffers of 2 MiB or more are not asked for transparent huge pages (1: they "
     "are mapped on 2 MiB boundaries with madvise(MADV_HUGEPAGE), Linux only)"},
    {"ROUTEMM_CUDA_DIRECT_PATH", "str", "",
     "data path of the CUDA quantised expert-ID direct kernel (every block format; a 16-byte "
     "aligned stack and input rows): bulk (the copy engine stages weights and activations in "
     "shared memory, each row's stage as the 16-byte units around it; sm_90a devices only) or "
     "loads (the block's threads copy the weights through shared memory); unset: bulk where the "
     "device runs the sm_90a image. Both give the same bits"},
    {"ROUTEMM_ENCODER_AUTO_BARRIER", "bool", "0",
     "1: command encoders start with the automatic-barrier tracker on (a barrier before each "
     "dispatch_tracked whose ranges conflict with those since the last barrier)"},
};

// The table's default of an integer knob, as a number (compile time): the documented default and
// the one the reader falls back to are checked against each other below.
constexpr int64_t table_default(std::string_view name) {
  for (const Knob& knob : kKnobs) {
    if (name != knob.name) continue;
    int64_t value = 0;
    for (const char* c = knob.default_value; *c != '\0'; ++c) value = value * 10 + (*c - '0');
    return value;
  }
  return -1;
}
static_assert(table_default("ROUTEMM_CPU_SPIN_US") == kCpuSpinUsDefault);
static_assert(table_default("ROUTEMM_CPU_THREADS") == 0);

std::optional<std::string> read(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// A 0/1 knob: unset gives `fallback`; any other value throws InvalidArgument.
bool read_flag(const char* name, bool fallback) {
  const auto text = read(name);
  if (!text) return fallback;
  if (*text == "0" || *text == "1") return *text == "1";
  throw InvalidArgument(std::string(name) + " must be 0 or 1, got '" + *text + "'");
}

// An integer knob in [lo, hi]: unset gives `fallback`; anything else throws InvalidArgument.
int64_t read_int(const char* name, int64_t lo, int64_t hi, int64_t fallback) {
  const auto text = read(name);
  if (!text) return fallback;
  // Digits with an optional minus sign only: strtoll alone would also take leading blanks and '+'.
  const char first = text->front();
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(text->c_str(), &end, 10);
  if ((first != '-' && (first < '0' || first > '9')) || end == text->c_str() || *end != '\0' ||
      errno == ERANGE || parsed < lo || parsed > hi) {
    throw InvalidArgument(std::string(name) + " must be an integer in [" + std::to_string(lo) +
                          ", " + std::to_string(hi) + "], got '" + *text + "'");
  }
  return static_cast<int64_t>(parsed);
}

}  // namespace

std::optional<std::string> backend() {
  static const std::optional<std::string> value = read("ROUTEMM_BACKEND");
  return value;
}

int64_t cpu_threads() {
  static const int64_t value = read_int("ROUTEMM_CPU_THREADS", 0, 4096, 0);
  return value;
}

int64_t cpu_spin_us() {
  static const int64_t value = read_int("ROUTEMM_CPU_SPIN_US", 0, kCpuSpinUsMax, kCpuSpinUsDefault);
  return value;
}

std::optional<std::string> cpu_isa() {
  static const std::optional<std::string> value = [] {
    const auto text = read("ROUTEMM_CPU_ISA");
    // The clones of the architecture this library was built for (backend/cpu/isa.h).
#if defined(__aarch64__)
    if (text && *text != "portable" && *text != "neon") {
      throw InvalidArgument("ROUTEMM_CPU_ISA must be portable or neon, got '" + *text + "'");
    }
#else
    if (text && *text != "portable" && *text != "avx2" && *text != "avx512") {
      throw InvalidArgument("ROUTEMM_CPU_ISA must be portable, avx2 or avx512, got '" + *text +
                            "'");
    }
#endif
    return text;
  }();
  return value;
}

bool cpu_huge_pages() {
  static const bool value = read_flag("ROUTEMM_CPU_HUGE_PAGES", true);
  return value;
}

std::optional<std::string> cuda_direct_path() {
  static const std::optional<std::string> value = [] {
    const auto text = read("ROUTEMM_CUDA_DIRECT_PATH");
    if (text && *text != "bulk" && *text != "loads") {
      throw InvalidArgument("ROUTEMM_CUDA_DIRECT_PATH must be bulk or loads, got '" + *text + "'");
    }
    return text;
  }();
  return value;
}

bool encoder_auto_barrier() {
  static const bool value = read_flag("ROUTEMM_ENCODER_AUTO_BARRIER", false);
  return value;
}

const Knob* knobs(size_t* count) {
  *count = sizeof(kKnobs) / sizeof(kKnobs[0]);
  return kKnobs;
}

std::map<std::string, std::string> non_default() {
  std::map<std::string, std::string> out;
  if (const auto value = backend()) out["ROUTEMM_BACKEND"] = *value;
  if (cpu_threads() != 0) out["ROUTEMM_CPU_THREADS"] = std::to_string(cpu_threads());
  if (cpu_spin_us() != kCpuSpinUsDefault)
    out["ROUTEMM_CPU_SPIN_US"] = std::to_string(cpu_spin_us());
  if (const auto value = cpu_isa()) out["ROUTEMM_CPU_ISA"] = *value;
  if (!cpu_huge_pages()) out.emplace("ROUTEMM_CPU_HUGE_PAGES", std::string(1, '0'));
  if (const auto value = cuda_direct_path()) out["ROUTEMM_CUDA_DIRECT_PATH"] = *value;
  if (encoder_auto_barrier()) out.emplace("ROUTEMM_ENCODER_AUTO_BARRIER", std::string(1, '1'));
  return out;
}

}  // namespace routemm::env
