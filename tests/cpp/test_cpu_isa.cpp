// The CPU kernels' instruction-set clones (csrc/backend/cpu/isa.h): which clone a process runs and
// what ROUTEMM_CPU_ISA selects, on every architecture; and the clones of the GGML format kernels
// (ggml_format_kernels.cpp: every codec-table format beyond Q4_0 / Q8_0) and of the int8-dot routes
// (ggml_int8_dot.h) against the portable one, bit for bit, through their KernelDefs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/q4_0_block.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/thread_pool.h"
#include "cpu_kernel_support.h"
#include "routemm/ggml_formats.h"
#include "test_support.h"

namespace routemm {
namespace {

using cpu::CpuIsa;
using cpu::ThreadPool;
using test::buffer_arg;
using test::bytes_arg;

// The clone each architecture's CPUs have at least, and the one an unset ROUTEMM_CPU_ISA runs.
TEST(CpuIsa, EveryArchitectureRunsItsClonesAndNamesThem) {
  EXPECT_EQ(cpu::cpu_isa_name(CpuIsa::portable), "portable");
  EXPECT_EQ(cpu::cpu_isa_name(CpuIsa::avx2), "avx2");
  EXPECT_EQ(cpu::cpu_isa_name(CpuIsa::avx512), "avx512");
  EXPECT_EQ(cpu::cpu_isa_name(CpuIsa::neon), "neon");
#if defined(__aarch64__)
  EXPECT_EQ(cpu::supported_cpu_isa(), CpuIsa::neon);  // NEON is part of the architecture
  EXPECT_EQ(test::runnable_isas(), (std::vector<CpuIsa>{CpuIsa::portable, CpuIsa::neon}));
#else
  EXPECT_NE(cpu::supported_cpu_isa(), CpuIsa::neon);
#endif
  // A clone includes the portable kernels and its own; AVX-512 the AVX2 ones too; no clone
  // includes another architecture's.
  EXPECT_TRUE(cpu::cpu_isa_includes(CpuIsa::neon, CpuIsa::portable));
  EXPECT_TRUE(cpu::cpu_isa_includes(CpuIsa::neon, CpuIsa::neon));
  EXPECT_FALSE(cpu::cpu_isa_includes(CpuIsa::neon, CpuIsa::avx2));
  EXPECT_FALSE(cpu::cpu_isa_includes(CpuIsa::avx512, CpuIsa::neon));
  EXPECT_TRUE(cpu::cpu_isa_includes(CpuIsa::avx512, CpuIsa::avx2));
  EXPECT_FALSE(cpu::cpu_isa_includes(CpuIsa::portable, CpuIsa::neon));
  {
    const cpu::CpuIsaLimitForTesting limit(CpuIsa::portable);
    EXPECT_EQ(cpu::cpu_isa(), CpuIsa::portable);
    EXPECT_FALSE(cpu::cpu_isa_allows(CpuIsa::neon));
  }
  // A cap naming a clone this CPU lacks (another architecture's, or one above it) runs the best.
  for (CpuIsa cap : {CpuIsa::avx2, CpuIsa::avx512, CpuIsa::neon}) {
    const cpu::CpuIsaLimitForTesting limit(cap);
    const bool has = cpu::cpu_isa_includes(cpu::supported_cpu_isa(), cap);
    EXPECT_EQ(cpu::cpu_isa(), has ? cap : cpu::supported_cpu_isa()) << cpu::cpu_isa_name(cap);
  }
}

// ROUTEMM_CPU_ISA, as this process was started with it (tests/cross/aarch64.sh runs the suite
// with neon and with portable), selects that clone where the CPU has it.
TEST(CpuIsa, TheEnvironmentsCapSelectsTheClone) {
  const char* cap = std::getenv("ROUTEMM_CPU_ISA");
  if (cap == nullptr) {
    EXPECT_EQ(cpu::cpu_isa(), cpu::supported_cpu_isa());
    return;
  }
  const std::string want(cap);
  for (CpuIsa isa : test::runnable_isas()) {
    if (cpu::cpu_isa_name(isa) == want) {
      EXPECT_EQ(cpu::cpu_isa(), isa);
      return;
    }
  }
  EXPECT_EQ(cpu::cpu_isa(), cpu::supported_cpu_isa()) << "cap " << want;
}

// ---- The GGML format kernels' clones ------------------------------------------------------------

const KernelDef& format_def(const std::string& name) {
  static const std::vector<KernelDef> defs = [] {
    std::vector<KernelDef> out;
    cpu::add_ggml_format_kernels(out);
    return out;
  }();
  for (const KernelDef& d : defs) {
    if (d.name == name) return d;
  }
  throw std::runtime_error("no kernel " + name);
}

// `rows` weight rows of k values in format f, from seeded random blocks whose values are all
// finite (random bytes where the table has no quantiser: a block decoding to a NaN or infinity is
// drawn again).
std::vector<uint8_t> random_rows(const ggml_formats::Format& f, size_t rows, size_t k,
                                 uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t blocks = rows * (k / f.block_values);
  std::vector<uint8_t> out(blocks * f.block_bytes);
  std::vector<float> values(f.block_values);
  for (size_t b = 0; b < blocks; ++b) {
    uint8_t* block = out.data() + b * f.block_bytes;
    if (f.quantize_block != nullptr) {
      for (float& v : values) v = normal(rng);
      f.quantize_block(values.data(), block);
      continue;
    }
    for (bool finite = false; !finite;) {
      for (size_t i = 0; i < f.block_bytes; ++i) block[i] = static_cast<uint8_t>(rng());
      f.dequantize_block(block, values.data());
      finite = true;
      for (float v : values) finite = finite && std::isfinite(v);
    }
  }
  return out;
}

// Outputs of the matrix route (m x n, m = 7: register tiles of every height) and of the
// expert-ID direct route (3 tokens x 2 slots over 2 experts, one invalid id) for format kf.
std::vector<float> run_format(const ggml_formats::KernelFormat& kf, const std::vector<uint8_t>& w,
                              const std::vector<float>& x, size_t m, size_t n, size_t k,
                              ThreadPool& pool) {
  const ggml_formats::Format& f = ggml_formats::format(kf.name);
  const size_t row_bytes = k / f.block_values * f.block_bytes;
  std::vector<float> out(m * n + 6 * n, -7.0f);

  kernels::GgmlMatmulMmParams mm{};
  mm.ne00 = static_cast<int32_t>(k);
  mm.ne02 = mm.ne12 = 1;
  mm.r2 = mm.r3 = 1;
  mm.nb01 = row_bytes;
  mm.nb10 = 4;
  mm.nb11 = k * 4;
  mm.ne0 = static_cast<int32_t>(n);
  mm.ne1 = static_cast<int32_t>(m);
  KernelLaunch launch;
  launch.label = std::string(kf.matrix);
  launch.grid = {(m + 31) / 32, (n + 63) / 64, 1};
  launch.args[0] = bytes_arg(mm);
  launch.args[1] = buffer_arg(w.data(), n * row_bytes);
  launch.args[2] = buffer_arg(x.data(), m * k * 4);
  launch.args[3] = buffer_arg(out.data(), m * n * 4);
  format_def(std::string(kf.matrix)).fn(launch, &pool);

  kernels::DenseMatmulIdKernelParams id{};
  id.m = 3;
  id.n = static_cast<uint32_t>(n);
  id.k = static_cast<uint32_t>(k);
  id.top_k = 2;
  id.n_experts = 2;
  id.input_layout = kernels::kInputSlotted;
  id.expert_stride_bytes = (n / 2) * row_bytes;  // the experts overlap: rows [0, n) and [n/2, ..)
  id.input_token_stride_bytes = 2 * k * 4;
  id.input_slot_stride_bytes = k * 4;
  const std::vector<uint32_t> ids = {1, 0, 0, 9, 1, 1};
  KernelLaunch direct;
  direct.label = std::string(kf.id_direct);
  direct.args[0] = bytes_arg(id);
  direct.args[1] = buffer_arg(w.data(), w.size());
  direct.args[2] = buffer_arg(x.data(), 6 * k * 4);
  direct.args[3] = buffer_arg(ids.data(), ids.size() * 4);
  direct.args[4] = buffer_arg(out.data() + m * n, 6 * n * 4);
  format_def(std::string(kf.id_direct)).fn(direct, &pool);
  return out;
}

// Every runnable clone gives the portable clone's bits on both routes, for every format, with a
// K that ends inside a 256-value panel where the block allows it and n inside a register tile.
TEST(CpuGgmlFormatKernels, EveryCloneGivesThePortableClonesBits) {
  ThreadPool pool(2);
  uint64_t seed = 4100;
  for (const ggml_formats::KernelFormat& kf : ggml_formats::kKernelFormats) {
    const ggml_formats::Format& f = ggml_formats::format(kf.name);
    const size_t m = 7, n = 70, k = f.block_values == 32 ? 352 : 512;
    const size_t extra_rows = n / 2;  // the second expert's rows past the first's
    const std::vector<uint8_t> w = random_rows(f, n + extra_rows, k, seed++);
    std::vector<float> x(m * k);
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(rng);
    SCOPED_TRACE(std::string(kf.name));

    // The portable clone against a float64 product of the decoded weights.
    std::vector<float> first;
    for (CpuIsa isa : test::runnable_isas()) {
      const cpu::CpuIsaLimitForTesting limit(isa);
      ASSERT_EQ(cpu::cpu_isa(), isa);
      SCOPED_TRACE(test::isa_name(isa));
      const std::vector<float> out = run_format(kf, w, x, m, n, k, pool);
      if (first.empty()) {
        first = out;
        std::vector<float> row(k);
        for (size_t r = 0; r < m; ++r) {
          for (size_t c = 0; c < n; ++c) {
            ggml_formats::dequantize(f,
                                     {w.data() + c * (k / f.block_values * f.block_bytes),
                                      k / f.block_values * f.block_bytes},
                                     row);
            double want = 0.0, scale = 0.0;
            for (size_t i = 0; i < k; ++i) {
              want += double{row[i]} * x[r * k + i];
              scale += std::abs(double{row[i]} * x[r * k + i]);
            }
            ASSERT_NEAR(out[r * n + c], want, 1e-5 * scale + 1e-6) << r << "," << c;
          }
        }
        for (size_t c = 0; c < n; ++c) EXPECT_EQ(out[m * n + 3 * n + c], 0.0f);  // invalid id
      } else {
        test::expect_bit_equal(out, first, "clone vs portable");
      }
    }
  }
}

// ---- The int8-dot routes' clones -----------------------------------------------------------------

const KernelDef& q4_def(const std::string& name) {
  static const std::vector<KernelDef> defs = [] {
    std::vector<KernelDef> out;
    cpu::add_q4_matmul_kernels(out);
    return out;
  }();
  for (const KernelDef& d : defs) {
    if (d.name == name) return d;
  }
  throw std::runtime_error("no kernel " + name);
}

// The int8-dot mat-vec (m_mv rows) and matrix route (m_mm rows) of `type` ("q4_0" or "q8_0"),
// outputs one after the other.
std::vector<float> run_int8_dot(const std::string& type, const std::vector<uint8_t>& w,
                                const std::vector<float>& x, size_t m_mv, size_t m_mm, size_t n,
                                size_t k, ThreadPool& pool) {
  const size_t row_bytes = k / 32 * (type == "q4_0" ? 18 : 34);
  std::vector<float> out((m_mv + m_mm) * n, -7.0f);

  kernels::GgmlMatmulMvParams mv{};
  mv.ne00 = mv.ne10 = static_cast<int64_t>(k);
  mv.ne01 = mv.ne0 = static_cast<int64_t>(n);
  mv.ne02 = mv.ne12 = 1;
  mv.ne1 = static_cast<int64_t>(m_mv);
  mv.r2 = mv.r3 = 1;
  KernelLaunch vec;
  vec.label = "kernel_mul_mv_" + type + "_int8dot_f32";
  vec.grid = {(n + 7) / 8, m_mv, 1};
  vec.args[0] = buffer_arg(w.data(), n * row_bytes);
  vec.args[1] = buffer_arg(x.data(), m_mv * k * 4);
  vec.args[2] = buffer_arg(out.data(), m_mv * n * 4);
  vec.args[3] = bytes_arg(mv);
  q4_def(vec.label).fn(vec, &pool);

  kernels::GgmlMatmulMmParams mm{};
  mm.ne00 = static_cast<int32_t>(k);
  mm.ne02 = mm.ne12 = 1;
  mm.r2 = mm.r3 = 1;
  mm.nb01 = row_bytes;
  mm.nb10 = 4;
  mm.nb11 = k * 4;
  mm.ne0 = static_cast<int32_t>(n);
  mm.ne1 = static_cast<int32_t>(m_mm);
  KernelLaunch mat;
  mat.label = "kernel_mul_mm_" + type + "_int8dot_f32";
  mat.grid = {(m_mm + 31) / 32, (n + 63) / 64, 1};
  mat.args[0] = bytes_arg(mm);
  mat.args[1] = buffer_arg(w.data(), n * row_bytes);
  mat.args[2] = buffer_arg(x.data(), m_mm * k * 4);
  mat.args[3] = buffer_arg(out.data() + m_mv * n, m_mm * n * 4);
  q4_def(mat.label).fn(mat, &pool);
  return out;
}

// Every runnable clone of the int8-dot routes (the NEON one with SDOT where the CPU has it) gives
// the portable clone's bits on the mat-vec and the matrix route, Q4_0 and Q8_0, with n ending
// inside a column group and rows ending inside a register tile.
TEST(CpuInt8DotKernels, EveryCloneGivesThePortableClonesBits) {
  ThreadPool pool(2);
  uint64_t seed = 5100;
  for (const std::string type : {"q4_0", "q8_0"}) {
    const ggml_formats::Format& f = ggml_formats::format(type);
    const size_t m_mv = 5, m_mm = 11, n = 70, k = 320;
    const std::vector<uint8_t> w = random_rows(f, n, k, seed++);
    std::vector<float> x(m_mm * k);
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(rng);
    SCOPED_TRACE(type);
    std::vector<float> first;
    for (CpuIsa isa : test::runnable_isas()) {
      const cpu::CpuIsaLimitForTesting limit(isa);
      SCOPED_TRACE(test::isa_name(isa));
      const std::vector<float> out = run_int8_dot(type, w, x, m_mv, m_mm, n, k, pool);
      for (float v : out) ASSERT_TRUE(std::isfinite(v));
      if (first.empty()) {
        first = out;
      } else {
        test::expect_bit_equal(out, first, "clone vs portable");
      }
    }
  }
}

}  // namespace
}  // namespace routemm
