// Environment knobs read by the C++ core. Each is read once (first use) and then fixed for the
// process; python/routemm/env.py holds the same table with types, defaults and effects.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace routemm::env {

struct Knob {
  const char* name;
  const char* type;           // "str" | "int" | "bool"
  const char* default_value;  // as text, "" for unset
  const char* effect;
};

// ROUTEMM_BACKEND: backend used by Device() when none is named.
std::optional<std::string> backend();
// ROUTEMM_CPU_THREADS: worker threads of the CPU backend (0 or unset: hardware threads).
int64_t cpu_threads();
// ROUTEMM_CPU_SPIN_US: microseconds the CPU pool's threads poll before sleeping (0..kCpuSpinUsMax,
// default kCpuSpinUsDefault). Any other value throws InvalidArgument.
inline constexpr int64_t kCpuSpinUsDefault = 200, kCpuSpinUsMax = 1000000;
int64_t cpu_spin_us();
// ROUTEMM_CPU_ISA: highest instruction-set clone the CPU kernels may use ("portable", "avx2",
// "avx512" on x86-64; "portable", "neon" on aarch64; unset: the best the CPU supports). Any other
// value throws InvalidArgument.
std::optional<std::string> cpu_isa();
// ROUTEMM_CPU_HUGE_PAGES: CPU backend buffers of 2 MiB or more ask for transparent huge pages
// ("1" or unset; "0" turns that off). Any other value throws InvalidArgument.
bool cpu_huge_pages();

// ROUTEMM_CUDA_DIRECT_PATH: the CUDA quantised expert-ID direct kernel's data path ("bulk" or
// "loads"; unset: bulk where the sm_90a image runs). Any other value throws InvalidArgument.
std::optional<std::string> cuda_direct_path();

// ROUTEMM_ENCODER_AUTO_BARRIER: encoders start with the automatic-barrier tracker on (spec §2.5).
bool encoder_auto_barrier();

// Every knob the core reads.
const Knob* knobs(size_t* count);
// Knobs set to a non-default value, as read at first use: name -> value.
std::map<std::string, std::string> non_default();

}  // namespace routemm::env
