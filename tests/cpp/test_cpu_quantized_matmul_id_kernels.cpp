// Kernel-level tests of the CPU quantised expert-ID matmul (csrc/backend/cpu/quantized_matmul_id.cpp),
// called through the KernelDefs that add_quantized_matmul_id_kernels registers (the map kernel is
// dense_matmul_id's) and a real ThreadPool: the grouped route gives the direct route's bits (the
// mat-vec micro-kernel's) for every routed-row count per expert, column tail and instruction-set
// clone, and reads each launch's activations afresh.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/thread_pool.h"
#include "cpu_kernel_support.h"
#include "test_support.h"

namespace routemm {
namespace {

using cpu::ThreadPool;
using Isa = cpu::CpuIsa;
using IsaLimitForTesting = cpu::CpuIsaLimitForTesting;
using kernels::DenseMatmulIdKernelParams;

enum class Format { Q4_0, Q8_0 };
const char* format_name(Format f) { return f == Format::Q4_0 ? "q4_0" : "q8_0"; }
size_t block_bytes(Format f) { return f == Format::Q4_0 ? 18 : 34; }

const KernelDef& def(const std::string& name) { return test::cpu_kernel_def(name); }
using test::bits;
using test::buffer_arg;
using test::bytes_arg;

// A binary16 scale's value (normal patterns only, as the tests build).
double half_value(uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  return sign * std::ldexp(1024 + (h & 0x3ff), ((h >> 10) & 0x1f) - 25);
}

// Value i (0..31) of a block, read independently of the kernels' dequantisation.
double block_value(Format f, const unsigned char* block, size_t i) {
  uint16_t scale;
  std::memcpy(&scale, block, 2);
  const double d = half_value(scale);
  if (f == Format::Q8_0) return d * static_cast<int8_t>(block[2 + i]);
  const unsigned char byte = block[2 + i % 16];
  return d * ((i < 16 ? byte & 0x0f : byte >> 4) - 8);
}

struct Data {
  DenseMatmulIdKernelParams params{};
  std::vector<unsigned char> weights;
  std::vector<float> input;
  std::vector<uint32_t> ids;
};

// n x k expert matrices of random blocks (normal binary16 scales of either sign, every quant
// byte), input ~ N(0, 1), one expert slot per token (ids set by the caller).
Data make_data(Format f, uint32_t m, uint32_t n, uint32_t k, uint32_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Data d;
  const size_t matrix = size_t{n} * (k / 32) * block_bytes(f);
  d.params = {m, n, k, 1, experts, 0, matrix, uint64_t{k} * 4, 0};
  d.weights.resize(experts * matrix);
  for (size_t b = 0; b < d.weights.size(); b += block_bytes(f)) {
    const auto scale =
        static_cast<uint16_t>((rng() % 2 ? 0x8000 : 0) | (9 + rng() % 4) << 10 | (rng() % 1024));
    std::memcpy(&d.weights[b], &scale, 2);
    for (size_t i = 2; i < block_bytes(f); ++i)
      d.weights[b + i] = static_cast<unsigned char>(rng());
  }
  d.input.resize(size_t{m} * k);
  for (float& v : d.input) v = normal(rng);
  d.ids.assign(m, 0);
  return d;
}

constexpr float kPoison = 0x1.8p100f;

std::vector<float> run_direct(const Data& d, Format f, ThreadPool& pool) {
  std::vector<float> out(size_t{d.params.m} * d.params.n, kPoison);
  KernelLaunch launch;
  const std::string name = std::string("quantized_matmul_id_direct_") + format_name(f) + "_f32";
  launch.label = name;
  launch.args[0] = bytes_arg(d.params);
  launch.args[1] = buffer_arg(d.weights.data(), d.weights.size());
  launch.args[2] = buffer_arg(d.input.data(), d.input.size() * 4);
  launch.args[3] = buffer_arg(d.ids.data(), d.ids.size() * 4);
  launch.args[4] = buffer_arg(out.data(), out.size() * 4);
  def(name).fn(launch, &pool);
  return out;
}

using Scratch = test::GroupedScratch;

std::vector<float> run_grouped(const Data& d, Format f, ThreadPool& pool, Scratch& s) {
  std::vector<float> out(size_t{d.params.m} * d.params.n, kPoison);
  test::run_map_then_grouped(
      def(std::string("quantized_matmul_id_grouped_") + format_name(f) + "_f32"), d, out, s, pool);
  return out;
}

using test::expect_bit_equal;

// Every output within a float32 accumulation bound of a float64 reference (the bit checks pin the
// exact order; this catches a wrong weight, row or column).
void expect_near_reference(const Data& d, Format f, const std::vector<float>& out) {
  const DenseMatmulIdKernelParams& p = d.params;
  const size_t row_bytes = p.k / 32 * block_bytes(f);
  int failures = 0;
  for (size_t row = 0; row < p.m && failures < 5; ++row) {
    const unsigned char* matrix = &d.weights[d.ids[row] * p.expert_stride_bytes];
    for (size_t col = 0; col < p.n; ++col) {
      double want = 0, magnitude = 0;
      for (size_t i = 0; i < p.k; ++i) {
        const double w = block_value(f, matrix + col * row_bytes + i / 32 * block_bytes(f), i % 32);
        want += w * d.input[row * p.k + i];
        magnitude += std::fabs(w * d.input[row * p.k + i]);
      }
      const float got = out[row * p.n + col];
      if (!(std::fabs(got - want) <= 1e-5 * magnitude + 1e-30)) {
        ++failures;
        ADD_FAILURE() << "row " << row << " col " << col << ": got " << got << " want " << want;
      }
    }
  }
}

using test::expect_clones_agree;
using test::isa_name;
using test::runnable_isas;

// Expert e is named by e + 1 rows (1 .. 21 routed rows: single mat-vec passes, split passes and
// the matrix tile), in an interleaved order; column counts that end inside a register tile and
// inside the 64-column item (50, 97), and K of 2, 3 and 9 blocks (one and two activation panels).
// Grouped must give direct's bits in every clone, and every clone the portable clone's bits.
TEST(CpuQuantizedMatmulIdKernels, GroupedEveryRowCountPerExpertGivesDirectsBitsInEveryClone) {
  ThreadPool pool(2);
  constexpr uint32_t kExperts = 21;
  constexpr uint32_t kRows = kExperts * (kExperts + 1) / 2;
  uint64_t seed = 1700;
  for (Format f : {Format::Q4_0, Format::Q8_0}) {
    for (const auto& [n, k] : {std::tuple{50u, 64u}, {97u, 96u}, {13u, 288u}}) {
      Data d = make_data(f, kRows, n, k, kExperts, seed++);
      d.ids.clear();
      for (uint32_t e = 0; e < kExperts; ++e) d.ids.insert(d.ids.end(), e + 1, e);
      std::shuffle(d.ids.begin(), d.ids.end(), std::mt19937_64(seed));
      SCOPED_TRACE(std::string(format_name(f)) + " n=" + std::to_string(n) +
                   " k=" + std::to_string(k));
      expect_clones_agree(
          [&] { return run_direct(d, f, pool); },
          [&] {
            Scratch s;
            return run_grouped(d, f, pool, s);
          },
          [&](const std::vector<float>& direct) { expect_near_reference(d, f, direct); });
    }
  }
}

// A thread keeps the rows it gathered for one launch's item block while it computes the block's
// other column ranges; a later launch over the same buffers, with new values in them, must use
// the new values. One expert, so both launches' blocks start at the same routed entry; 6 rows take
// the mat-vec passes, 40 the matrix tile.
TEST(CpuQuantizedMatmulIdKernels, GroupedReadsEachLaunchsActivationsAfresh) {
  for (size_t threads : {1u, 2u}) {
    ThreadPool pool(threads);
    for (uint32_t m : {6u, 40u}) {
      for (Format f : {Format::Q4_0, Format::Q8_0}) {
        SCOPED_TRACE(std::string(format_name(f)) + " m=" + std::to_string(m) +
                     " threads=" + std::to_string(threads));
        Data d = make_data(f, m, 200, 64, 1, 41 + m);
        Scratch s;
        expect_bit_equal(run_grouped(d, f, pool, s), run_direct(d, f, pool), "first launch");
        for (float& v : d.input) v = -2.0f * v + 1.0f;  // same buffer, new values
        const std::vector<float> after = run_grouped(d, f, pool, s);
        expect_bit_equal(after, run_direct(d, f, pool), "second launch");
        expect_near_reference(d, f, after);
      }
    }
  }
}

}  // namespace
}  // namespace routemm
