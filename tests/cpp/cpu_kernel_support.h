// Helpers of the CPU kernel-level tests: the CPU backend's KernelDefs looked up by name, and the
// bound arguments a launch passes them (buffers by pointer and size, params by bytes).
#pragma once

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/thread_pool.h"
#include "routemm/backend.h"
#include "test_support.h"

namespace routemm::test {

// Every KernelDef of the expert-ID families (dense, whose map the quantised grouped route uses,
// and quantised), built once.
inline const std::vector<KernelDef>& cpu_expert_id_kernel_defs() {
  static const std::vector<KernelDef> list = [] {
    std::vector<KernelDef> out;
    cpu::add_dense_matmul_id_kernels(out);
    cpu::add_quantized_matmul_id_kernels(out);
    return out;
  }();
  return list;
}

inline const KernelDef& cpu_kernel_def(const std::string& name) {
  for (const KernelDef& d : cpu_expert_id_kernel_defs()) {
    if (d.name == name) return d;
  }
  throw std::runtime_error("no kernel " + name);
}

inline BoundArg buffer_arg(const void* data, size_t size) {
  BoundArg arg;
  arg.kind = BoundArg::Kind::Buffer;
  arg.data = const_cast<void*>(data);
  arg.size = size;
  return arg;
}

template <class Params>
BoundArg bytes_arg(const Params& params) {
  BoundArg arg;
  arg.kind = BoundArg::Kind::Bytes;
  arg.data = const_cast<Params*>(&params);
  arg.size = sizeof(params);
  return arg;
}

// The grouped routes' caller scratch: expert counts and the routed-row list of the map kernel.
struct GroupedScratch {
  std::vector<uint32_t> counts, routed;
};

// Runs the map kernel over d.ids into `s` (poisoned first), then the grouped kernel `grouped`
// over d's weights (bytes) and input into `out`, both on `pool`. d: params, ids, weights, input.
template <class Data>
void run_map_then_grouped(const KernelDef& grouped_def, const Data& d, std::vector<float>& out,
                          GroupedScratch& s, cpu::ThreadPool& pool) {
  s.counts.assign(d.params.n_experts, 0xAAAAAAAAu);
  s.routed.assign(size_t{d.params.n_experts} * d.params.m, 0xAAAAAAAAu);
  KernelLaunch map;
  map.label = "dense_matmul_id_map_distinct";
  map.args[0] = bytes_arg(d.params);
  map.args[1] = buffer_arg(d.ids.data(), d.ids.size() * 4);
  map.args[2] = buffer_arg(s.counts.data(), s.counts.size() * 4);
  map.args[3] = buffer_arg(s.routed.data(), s.routed.size() * 4);
  map.args[4] = buffer_arg(out.data(), out.size() * 4);
  cpu_kernel_def("dense_matmul_id_map_distinct").fn(map, &pool);

  KernelLaunch grouped;
  grouped.label = grouped_def.name;
  grouped.args[0] = bytes_arg(d.params);
  grouped.args[1] = buffer_arg(d.weights.data(), d.weights.size());
  grouped.args[2] = buffer_arg(d.input.data(), d.input.size() * 4);
  grouped.args[3] = buffer_arg(s.counts.data(), s.counts.size() * 4);
  grouped.args[4] = buffer_arg(s.routed.data(), s.routed.size() * 4);
  grouped.args[5] = buffer_arg(out.data(), out.size() * 4);
  grouped_def.fn(grouped, &pool);
}

// The instruction-set clones this CPU can run, lowest first (the portable one always).
inline std::vector<cpu::CpuIsa> runnable_isas() {
  std::vector<cpu::CpuIsa> out;
  for (cpu::CpuIsa isa :
       {cpu::CpuIsa::portable, cpu::CpuIsa::avx2, cpu::CpuIsa::avx512, cpu::CpuIsa::neon}) {
    if (cpu::cpu_isa_includes(cpu::supported_cpu_isa(), isa)) out.push_back(isa);
  }
  return out;
}
inline const char* isa_name(cpu::CpuIsa isa) { return cpu::cpu_isa_name(isa).data(); }

// Every element of `a` has the bits of `b`'s (the first mismatch is reported).
inline void expect_bit_equal(const std::vector<float>& a, const std::vector<float>& b,
                             const char* what) {
  ASSERT_EQ(a.size(), b.size());
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (bits(a[i]) != bits(b[i]) && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << what << ": first at " << first << " (" << a[first] << " vs "
                            << b[first] << ")";
}

// Every runnable clone, portable first, each under its IsaLimitForTesting: run_grouped() must give
// run_direct()'s bits, the first clone's direct result must pass check_reference, and every
// later clone must give the first one's bits.
template <class Direct, class Grouped, class Reference>
void expect_clones_agree(const Direct& run_direct, const Grouped& run_grouped,
                         const Reference& check_reference) {
  std::vector<float> first;
  for (cpu::CpuIsa isa : runnable_isas()) {
    const cpu::CpuIsaLimitForTesting limit(isa);
    ASSERT_EQ(cpu::cpu_isa(), isa);  // the limit took effect
    SCOPED_TRACE(isa_name(isa));
    const std::vector<float> direct = run_direct();
    expect_bit_equal(run_grouped(), direct, "grouped vs direct");
    if (first.empty()) {
      first = direct;
      check_reference(direct);
    } else {
      expect_bit_equal(direct, first, "clone vs portable");
    }
  }
}

}  // namespace routemm::test
