// Kernel-level tests of the CPU expert-ID matmul (csrc/backend/cpu/dense_matmul_id.cpp), called
// through the KernelDefs that add_dense_matmul_id_kernels registers and a real ThreadPool: exact
// widening, the direct == grouped bit contract, independence from the thread count, map
// semantics, invalid ids and argument checks.
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
#include "backend/cpu/kernels.h"
#include "backend/cpu/simd.h"
#include "backend/cpu/thread_pool.h"
#include "cpu_kernel_support.h"
#include "routemm/error.h"
#include "test_support.h"

namespace routemm {
namespace {

using cpu::ThreadPool;
using Isa = cpu::CpuIsa;
using IsaLimitForTesting = cpu::CpuIsaLimitForTesting;
using kernels::DenseMatmulIdKernelParams;

enum class WeightType { F32, F16, BF16 };
const char* type_name(WeightType t) {
  return t == WeightType::F32 ? "f32" : t == WeightType::F16 ? "f16" : "bf16";
}
size_t type_size(WeightType t) { return t == WeightType::F32 ? 4 : 2; }

const KernelDef& def(const std::string& name) { return test::cpu_kernel_def(name); }
using test::bits;
using test::buffer_arg;
using test::bytes_arg;

// Independent reference widening of a 16-bit pattern (not the kernel's code path).
double widen_reference16(WeightType t, uint16_t h) {
  if (t == WeightType::BF16) return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return mantissa ? std::nan("") : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

double widen_reference(WeightType t, const unsigned char* p) {
  if (t == WeightType::F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return widen_reference16(t, h);
}

// Round-to-nearest-even narrowing used to build test weights.
uint16_t to_bf16(float f) {
  const uint32_t b = bits(f);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
uint16_t to_f16(float f) {
  // Search-free conversion for the moderate values and edge values the tests use.
  if (f == 0) return std::signbit(f) ? 0x8000 : 0;
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double a = std::fabs(f);
  if (a >= 65520.0) return sign | 0x7c00;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exponent = e - 1 + 15;
  if (exponent <= 0) return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0));
  const double scaled = std::nearbyint(std::ldexp(a, 10 - (e - 1)));  // in [1024, 2048]
  uint32_t m = static_cast<uint32_t>(scaled);
  if (m == 2048) {
    m = 1024;
    ++exponent;
  }
  if (exponent >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>((exponent << 10) | (m - 1024));
}

struct Problem {
  uint32_t m, n, k, top_k, n_experts;
  bool slotted;
  size_t pad_bytes;  // between expert matrices, filled with 0xD7
  WeightType type;
  bool edges;  // mix in ±0, ±min subnormal, ±min normal, ±max finite
};

struct Data {
  DenseMatmulIdKernelParams params{};
  std::vector<unsigned char> weights;
  std::vector<float> input;
  std::vector<uint32_t> ids;
};

float edge_value(WeightType t, uint64_t pick) {
  static const float f32[] = {0.f,       -0.f,       0x1p-149f,     -0x1p-149f,
                              0x1p-126f, -0x1p-126f, 3.4028235e38f, -3.4028235e38f};
  static const float f16[] = {0.f,      -0.f,      0x1p-24f, -0x1p-24f,
                              0x1p-14f, -0x1p-14f, 65504.f,  -65504.f};
  static const float bf16[] = {0.f,       -0.f,       0x1p-133f,     -0x1p-133f,
                               0x1p-126f, -0x1p-126f, 3.3895314e38f, -3.3895314e38f};
  const float* table = t == WeightType::F32 ? f32 : t == WeightType::F16 ? f16 : bf16;
  return table[pick % 8];
}

Data make_data(const Problem& pr, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Data d;
  const size_t es = type_size(pr.type), matrix = size_t{pr.n} * pr.k * es;
  const size_t stride = matrix + pr.pad_bytes;
  d.params = {pr.m,
              pr.n,
              pr.k,
              pr.top_k,
              pr.n_experts,
              pr.slotted ? 1u : 0u,
              stride,
              pr.slotted ? uint64_t{pr.k} * 4 * pr.top_k : uint64_t{pr.k} * 4,
              pr.slotted ? uint64_t{pr.k} * 4 : 0};
  d.weights.assign((pr.n_experts - 1) * stride + matrix, 0xD7);
  for (size_t e = 0; e < pr.n_experts; ++e) {
    for (size_t i = 0; i < size_t{pr.n} * pr.k; ++i) {
      const float v = pr.edges && rng() % 4 == 0 ? edge_value(pr.type, rng()) : normal(rng);
      unsigned char* dst = &d.weights[e * stride + i * es];
      if (pr.type == WeightType::F32) {
        std::memcpy(dst, &v, 4);
      } else {
        const uint16_t h = pr.type == WeightType::F16 ? to_f16(v) : to_bf16(v);
        std::memcpy(dst, &h, 2);
      }
    }
  }
  const size_t rows = size_t{pr.m} * pr.top_k;
  d.input.resize((pr.slotted ? rows : pr.m) * pr.k);
  for (float& v : d.input)
    v = pr.edges && rng() % 4 == 0 ? edge_value(WeightType::F32, rng()) : normal(rng);
  // Distinct ids per token, with some invalid ones (>= n_experts, including u32::MAX).
  d.ids.resize(rows);
  for (size_t t = 0; t < pr.m; ++t) {
    std::vector<uint32_t> perm(pr.n_experts);
    for (uint32_t e = 0; e < pr.n_experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (size_t s = 0; s < pr.top_k; ++s) {
      uint32_t id = perm[s];
      if (rng() % 7 == 0)
        id = rng() % 2 ? 0xFFFFFFFFu : pr.n_experts + static_cast<uint32_t>(rng() % 3);
      d.ids[t * pr.top_k + s] = id;
    }
  }
  return d;
}

constexpr float kPoison = 0x1.8p100f;

std::vector<float> run_direct(const Data& d, WeightType t, ThreadPool& pool) {
  const size_t rows = size_t{d.params.m} * d.params.top_k;
  std::vector<float> out(rows * d.params.n, kPoison);
  KernelLaunch launch;
  const std::string name = std::string("dense_matmul_id_direct_") + type_name(t) + "_f32";
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

std::vector<float> run_grouped(const Data& d, WeightType t, ThreadPool& pool,
                               Scratch* scratch = nullptr) {
  const size_t rows = size_t{d.params.m} * d.params.top_k;
  std::vector<float> out(rows * d.params.n, kPoison);
  Scratch local;
  test::run_map_then_grouped(def(std::string("dense_matmul_id_grouped_") + type_name(t) + "_f32"),
                             d, out, scratch ? *scratch : local, pool);
  return out;
}

// Checks every output against a float64 reference (finite cases) and invalid rows for +0.
void expect_matches_reference(const Problem& pr, const Data& d, const std::vector<float>& out) {
  const size_t es = type_size(pr.type);
  const double tol = pr.type == WeightType::F32 ? 2e-4 : pr.type == WeightType::F16 ? 3e-2 : 6e-2;
  int failures = 0;
  for (size_t flat = 0; flat < size_t{pr.m} * pr.top_k && failures < 5; ++flat) {
    const uint32_t id = d.ids[flat];
    const size_t token = flat / pr.top_k, slot = flat % pr.top_k;
    const float* x = reinterpret_cast<const float*>(
        reinterpret_cast<const unsigned char*>(d.input.data()) +
        token * d.params.input_token_stride_bytes + slot * d.params.input_slot_stride_bytes);
    for (size_t col = 0; col < pr.n; ++col) {
      const float got = out[flat * pr.n + col];
      if (id >= pr.n_experts) {
        if (bits(got) != 0) ++failures;
        EXPECT_EQ(bits(got), 0u) << "invalid id row " << flat;
        continue;
      }
      double want = 0, magnitude = 0;
      bool finite = true;
      for (size_t i = 0; i < pr.k; ++i) {
        const double w = widen_reference(
            pr.type, &d.weights[id * d.params.expert_stride_bytes + (col * pr.k + i) * es]);
        const double p = w * x[i];
        finite = finite && std::isfinite(p) && std::fabs(p) < 1e30;
        want += p;
        magnitude += std::fabs(p);
      }
      if (!finite) continue;  // overflow cases are covered by the bit-equality checks
      const double allowed = pr.edges ? 1e-5 * magnitude + 1e-30 : tol * 1e-2 + 1e-5 * magnitude;
      if (!(std::fabs(got - want) <= allowed)) {
        ++failures;
        ADD_FAILURE() << "row " << flat << " col " << col << ": got " << got << " want " << want;
      }
    }
  }
}

using test::expect_bit_equal;

TEST(CpuDenseMatmulIdKernels, RegistersEveryPipelineWithSpecGeometry) {
  std::vector<KernelDef> dense;
  cpu::add_dense_matmul_id_kernels(dense);
  ASSERT_EQ(dense.size(), 7u);
  for (const KernelDef& d : dense) {
    EXPECT_NE(d.fn, nullptr) << d.name;
    EXPECT_EQ(d.origin, "builtin_cpu");
    EXPECT_EQ(d.max_threads_per_threadgroup, 1024u);
    EXPECT_FALSE(d.content_sha256.empty());
  }
  for (const char* t : {"f32", "f16", "bf16"}) {
    const KernelDef& direct = def(std::string("dense_matmul_id_direct_") + t + "_f32");
    EXPECT_EQ(direct.threads_per_group, 64u);
    EXPECT_EQ(direct.tile_x, 8u);
    EXPECT_EQ(direct.tile_y, 1u);
    EXPECT_EQ(direct.threadgroup_memory_bytes, 0u);
    const KernelDef& grouped = def(std::string("dense_matmul_id_grouped_") + t + "_f32");
    EXPECT_EQ(grouped.threads_per_group, 256u);
    EXPECT_EQ(grouped.tile_x, 8u);
    EXPECT_EQ(grouped.tile_y, 8u);
    EXPECT_EQ(grouped.threadgroup_memory_bytes, 4096u);
  }
  EXPECT_EQ(def("dense_matmul_id_map_distinct").threads_per_group, 0u);
}

TEST(CpuDenseMatmulIdKernels, DirectAndGroupedAreBitIdenticalAndMatchAFloat64Reference) {
  ThreadPool pool(3);
  ThreadPool single(1);
  uint64_t seed = 1;
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    for (uint32_t m : {1u, 2u, 9u, 33u}) {
      for (uint32_t top_k : {1u, 6u}) {
        for (bool slotted : {false, true}) {
          for (bool edges : {false, true}) {
            const uint32_t n = (m + top_k) % 2 ? 7 : 13;
            const uint32_t k = m == 33 ? 300 : (m % 2 ? 35 : 16);
            const size_t pad = (slotted ? 14 : 12) / type_size(t) * type_size(t);
            const Problem pr{m, n, k, top_k, 8, slotted, pad, t, edges};
            SCOPED_TRACE(std::string(type_name(t)) + " m=" + std::to_string(m) +
                         " top_k=" + std::to_string(top_k) + " slotted=" + std::to_string(slotted) +
                         " edges=" + std::to_string(edges));
            const Data d = make_data(pr, seed++);
            const std::vector<float> direct = run_direct(d, t, pool);
            expect_bit_equal(direct, run_grouped(d, t, pool), "grouped vs direct");
            expect_bit_equal(direct, run_direct(d, t, single), "direct, 1 thread vs 3");
            expect_matches_reference(pr, d, direct);
          }
        }
      }
    }
  }
}

// Shapes past every internal block size (rows per item, columns per item, inner pass).
TEST(CpuDenseMatmulIdKernels, LargeShapesCrossEveryBlockBoundary) {
  ThreadPool pool(4);
  ThreadPool single(1);
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    SCOPED_TRACE(type_name(t));
    const Problem pr{90, 100, 517, 4, 5, false, 0, t, false};  // ~72 rows per expert
    const Data d = make_data(pr, 99);
    const std::vector<float> direct = run_direct(d, t, pool);
    expect_bit_equal(direct, run_grouped(d, t, pool), "grouped vs direct");
    expect_bit_equal(direct, run_grouped(d, t, single), "grouped, 1 thread vs 4");
    expect_matches_reference(pr, d, direct);
  }
}

// Every f16 and bf16 bit pattern goes through the vector widening path (k = 8: column [v, 0...]
// against x = [1, 0, ...]) and must come back exactly (NaN as NaN; -0 sums to +0).
TEST(CpuDenseMatmulIdKernels, WideningIsExactForEveryHalfAndBfloatPattern) {
  ThreadPool pool(2);
  for (WeightType t : {WeightType::F16, WeightType::BF16}) {
    SCOPED_TRACE(type_name(t));
    Data d;
    const uint32_t n = 65536, k = 8;
    d.params = {1, n, k, 1, 1, 0, uint64_t{n} * k * 2, k * 4, 0};
    std::vector<uint16_t> w(size_t{n} * k, 0);
    for (uint32_t v = 0; v < n; ++v) w[size_t{v} * k] = static_cast<uint16_t>(v);
    d.weights.resize(w.size() * 2);
    std::memcpy(d.weights.data(), w.data(), d.weights.size());
    d.input = {1, 0, 0, 0, 0, 0, 0, 0};
    d.ids = {0};
    const std::vector<float> direct = run_direct(d, t, pool);
    expect_bit_equal(direct, run_grouped(d, t, pool), "grouped vs direct");
    for (uint32_t v = 0; v < n; ++v) {
      const double want = widen_reference16(t, static_cast<uint16_t>(v));
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(direct[v])) << std::hex << v;
      } else {
        ASSERT_EQ(static_cast<double>(direct[v]), want) << std::hex << v;
        ASSERT_FALSE(std::signbit(direct[v]) && direct[v] == 0) << std::hex << v;
      }
    }
  }
}

using test::expect_clones_agree;
using test::isa_name;
using test::runnable_isas;

// Every clone (portable, AVX2, AVX-512) follows the one accumulation order, so each route gives
// the same bits whichever ran: shapes with k tails (k % 8, k % 32), the 32-wide bf16 step, odd
// column counts (the last column of a pair), and edge values.
TEST(CpuDenseMatmulIdKernels, EveryInstructionSetCloneGivesTheSameBits) {
  const std::vector<Isa> isas = runnable_isas();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the portable clone";
  ThreadPool pool(2);
  uint64_t seed = 500;
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    for (const auto& [m, n, k] : {std::tuple{1u, 13u, 35u},
                                  {3u, 17u, 64u},
                                  {2u, 9u, 100u},
                                  {20u, 50u, 517u},
                                  {70u, 97u, 96u}}) {
      for (bool edges : {false, true}) {
        const Problem pr{m, n, k, 4, 6, m % 2 == 0, 0, t, edges};
        SCOPED_TRACE(std::string(type_name(t)) + " m=" + std::to_string(m) +
                     " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                     " edges=" + std::to_string(edges));
        const Data d = make_data(pr, seed++);
        std::vector<float> direct0, grouped0;
        for (Isa isa : isas) {
          const IsaLimitForTesting limit(isa);
          ASSERT_EQ(cpu::cpu_isa(), isa);
          const std::vector<float> direct = run_direct(d, t, pool);
          const std::vector<float> grouped = run_grouped(d, t, pool);
          if (direct0.empty()) {
            direct0 = direct;
            grouped0 = grouped;
            expect_bit_equal(direct, grouped, "grouped vs direct");
            if (!edges) expect_matches_reference(pr, d, direct);
            continue;
          }
          SCOPED_TRACE(std::string(isa_name(isa)) + " vs portable");
          expect_bit_equal(direct, direct0, "direct");
          expect_bit_equal(grouped, grouped0, "grouped");
        }
      }
    }
  }
}

// The grouped route computes an expert's routed rows in pairs, in tile groups whose sizes depend on
// the row count and the clone; every count from 1 to 21 (odd counts leave a half-empty pair), a
// column count that ends on a narrower tile and a k tail give the same bits in every clone, equal
// to the direct route's.
TEST(CpuDenseMatmulIdKernels, GroupedEveryRowCountPerExpertGivesTheSameBitsInEveryClone) {
  ThreadPool pool(2);
  constexpr uint32_t kExperts = 21;
  uint64_t seed = 900;
  for (WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
    for (const auto& [n, k] : {std::tuple{50u, 37u}, {97u, 64u}}) {
      // Expert e is named by e + 1 tokens (top_k = 1), in an interleaved order.
      const uint32_t m = kExperts * (kExperts + 1) / 2;
      const Problem pr{m, n, k, 1, kExperts, false, 0, t, false};
      Data d = make_data(pr, seed++);
      std::vector<uint32_t> ids;
      for (uint32_t e = 0; e < kExperts; ++e) ids.insert(ids.end(), e + 1, e);
      std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
      d.ids = ids;
      SCOPED_TRACE(std::string(type_name(t)) + " n=" + std::to_string(n) +
                   " k=" + std::to_string(k));
      expect_clones_agree(
          [&] { return run_direct(d, t, pool); }, [&] { return run_grouped(d, t, pool); },
          [&](const std::vector<float>& direct) { expect_matches_reference(pr, d, direct); });
    }
  }
}

// A thread keeps the activation rows it packed for one launch's item block while it computes the
// block's other column ranges; a later launch over the same buffers, with new values in them, must
// use the new values. One expert, so both launches' blocks start at the same routed entry.
TEST(CpuDenseMatmulIdKernels, GroupedReadsEachLaunchsActivationsAfresh) {
  for (size_t threads : {1u, 2u}) {
    ThreadPool pool(threads);
    const Problem pr{12, 100, 40, 1, 1, false, 0, WeightType::F32, false};
    Data d = make_data(pr, 41);
    Scratch s;
    const std::vector<float> before = run_grouped(d, WeightType::F32, pool, &s);
    expect_bit_equal(run_direct(d, WeightType::F32, pool), before, "first launch");
    for (float& v : d.input) v = -2.0f * v + 1.0f;  // same buffer, new values
    const std::vector<float> after = run_grouped(d, WeightType::F32, pool, &s);
    expect_bit_equal(run_direct(d, WeightType::F32, pool), after, "second launch");
    expect_matches_reference(pr, d, after);
  }
}

// Every bf16 and f16 bit pattern through every clone's widening, at every position of a 32-wide
// step (the AVX-512 bf16 path widens 32 values with word permutes): weight v sits at inner
// position v % 32 of its column, every other weight is +0, and x is all ones, so the output is
// exactly the widened v.
TEST(CpuDenseMatmulIdKernels, EveryCloneWidensEveryPatternAtEveryPosition) {
  ThreadPool pool(2);
  for (Isa isa : runnable_isas()) {
    const IsaLimitForTesting limit(isa);
    for (WeightType t : {WeightType::F16, WeightType::BF16}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + type_name(t));
      Data d;
      const uint32_t n = 65536, k = 40;  // one 32-wide step and one 8-wide block
      d.params = {1, n, k, 1, 1, 0, uint64_t{n} * k * 2, k * 4, 0};
      std::vector<uint16_t> w(size_t{n} * k, 0);
      for (uint32_t v = 0; v < n; ++v) w[size_t{v} * k + v % k] = static_cast<uint16_t>(v);
      d.weights.resize(w.size() * 2);
      std::memcpy(d.weights.data(), w.data(), d.weights.size());
      d.input.assign(k, 1.0f);
      d.ids = {0};
      const std::vector<float> direct = run_direct(d, t, pool);
      expect_bit_equal(direct, run_grouped(d, t, pool), "grouped vs direct");
      for (uint32_t v = 0; v < n; ++v) {
        const double want = widen_reference16(t, static_cast<uint16_t>(v));
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(direct[v])) << std::hex << v;
        } else {
          ASSERT_EQ(static_cast<double>(direct[v]), want) << std::hex << v;
        }
      }
    }
  }
}

// The reduced-precision bf16-dot pipelines exist only where AVX512_BF16 may run, and their direct
// and grouped kernels share one accumulation order (bit-identical), with the same zero rows for
// invalid ids as the exact routes.
TEST(CpuDenseMatmulIdKernels, Bf16DotPipelinesFollowTheProcessorAndAgreeBitForBit) {
  {
    const IsaLimitForTesting limit(Isa::avx2);
    std::vector<KernelDef> none;
    cpu::add_dense_matmul_id_bf16_dot_kernels(none);
    EXPECT_TRUE(none.empty()) << "bf16-dot pipelines registered without AVX-512";
  }
  std::vector<KernelDef> lowp;
  cpu::add_dense_matmul_id_bf16_dot_kernels(lowp);
  if (!cpu::simd::has_avx512_bf16()) {
    EXPECT_TRUE(lowp.empty());
    GTEST_SKIP() << "this CPU has no AVX512_BF16";
  }
  ASSERT_EQ(lowp.size(), 2u);
  ThreadPool pool(3);
  for (const auto& [m, n, k] : {std::tuple{1u, 13u, 35u}, {5u, 70u, 64u}, {70u, 50u, 517u}}) {
    SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
    const Problem pr{m, n, k, 4, 6, false, 2, WeightType::BF16, false};
    const Data d = make_data(pr, 7 + m);
    const size_t rows = size_t{m} * pr.top_k;
    std::vector<float> direct(rows * n, kPoison), grouped(rows * n, kPoison);
    KernelLaunch launch;
    launch.label = lowp[0].name;
    launch.args[0] = bytes_arg(d.params);
    launch.args[1] = buffer_arg(d.weights.data(), d.weights.size());
    launch.args[2] = buffer_arg(d.input.data(), d.input.size() * 4);
    launch.args[3] = buffer_arg(d.ids.data(), d.ids.size() * 4);
    launch.args[4] = buffer_arg(direct.data(), direct.size() * 4);
    lowp[0].fn(launch, &pool);

    Scratch s;
    test::run_map_then_grouped(lowp[1], d, grouped, s, pool);
    expect_bit_equal(direct, grouped, "bf16-dot grouped vs direct");
    for (size_t flat = 0; flat < rows; ++flat) {
      if (d.ids[flat] >= pr.n_experts) {
        for (size_t c = 0; c < n; ++c) ASSERT_EQ(bits(direct[flat * n + c]), 0u) << flat;
      }
    }
  }
}

TEST(CpuDenseMatmulIdKernels, MapListsEveryRowByExpertAndZeroesInvalidRows) {
  ThreadPool pool(2);
  Data d;
  // 4 tokens x 3 slots, 4 experts; token 2 names expert 1 twice, and both slots are routed.
  d.ids = {1, 0, 7, 3, 1, 0xFFFFFFFFu, 1, 1, 2, 0, 3, 4};
  d.params = {4, 5, 3, 3, 4, 0, 5 * 3 * 4, 3 * 4, 0};
  d.weights.assign(4 * 5 * 3 * 4, 0);
  d.input.assign(4 * 3, 1.0f);
  Scratch s;
  const std::vector<float> out = run_grouped(d, WeightType::F32, pool, &s);
  EXPECT_EQ(s.counts, (std::vector<uint32_t>{2, 4, 1, 2}));
  // One list, expert after expert, each segment in flat-row order.
  EXPECT_EQ(std::vector<uint32_t>(s.routed.begin(), s.routed.begin() + 9),
            (std::vector<uint32_t>{1, 9, 0, 4, 6, 7, 8, 3, 10}));
  for (size_t flat : {2u, 5u, 11u}) {
    for (size_t col = 0; col < 5; ++col) EXPECT_EQ(bits(out[flat * 5 + col]), 0u) << flat;
  }
}

TEST(CpuDenseMatmulIdKernels, GroupedRoutesRepeatedIdsBitIdenticalToDirect) {
  // Ids that repeat within a token (expert 2 named by every slot of every third token, so it holds
  // more rows than there are tokens): every slot's row is written, and equals the direct route's
  // bit for bit, in both input layouts.
  ThreadPool pool(3);
  for (const bool slotted : {false, true}) {
    for (const WeightType t : {WeightType::F32, WeightType::F16, WeightType::BF16}) {
      const Problem pr{70, 19, 35, 4, 5, slotted, 0, t, false};
      Data d = make_data(pr, 11);
      for (size_t token = 0; token < pr.m; token += 3) {
        for (size_t slot = 0; slot < pr.top_k; ++slot) d.ids[token * pr.top_k + slot] = 2;
      }
      const std::vector<float> grouped = run_grouped(d, t, pool);
      for (const float v : grouped) ASSERT_NE(bits(v), bits(kPoison)) << "a row was not written";
      expect_bit_equal(run_direct(d, t, pool), grouped, "repeated ids: grouped vs direct");
      expect_matches_reference(pr, d, grouped);
    }
  }
}

TEST(CpuDenseMatmulIdKernels, GroupedRejectsCountsBeyondTheFlatRows) {
  // A stale or foreign scratch whose counts add up to more than m * top_k rows is refused before
  // anything is read from the routed list or written to the output.
  ThreadPool pool(1);
  const Problem pr{2, 3, 4, 2, 2, false, 0, WeightType::F32, false};
  const Data d = make_data(pr, 5);
  std::vector<float> out(2 * 2 * 3, kPoison);
  std::vector<uint32_t> counts = {4, 1}, routed(4, 0);
  KernelLaunch launch;
  launch.label = "dense_matmul_id_grouped_f32_f32";
  launch.args[0] = bytes_arg(d.params);
  launch.args[1] = buffer_arg(d.weights.data(), d.weights.size());
  launch.args[2] = buffer_arg(d.input.data(), d.input.size() * 4);
  launch.args[3] = buffer_arg(counts.data(), counts.size() * 4);
  launch.args[4] = buffer_arg(routed.data(), routed.size() * 4);
  launch.args[5] = buffer_arg(out.data(), out.size() * 4);
  EXPECT_THROW(def("dense_matmul_id_grouped_f32_f32").fn(launch, &pool), Error);
  for (const float v : out) EXPECT_EQ(bits(v), bits(kPoison));
}

TEST(CpuDenseMatmulIdKernels, UnboundOrShortArgumentsThrow) {
  ThreadPool pool(1);
  const Problem pr{2, 3, 4, 2, 2, false, 0, WeightType::F32, false};
  const Data d = make_data(pr, 5);
  std::vector<float> out(2 * 2 * 3);
  KernelLaunch launch;
  launch.label = "dense_matmul_id_direct_f32_f32";
  launch.args[0] = bytes_arg(d.params);
  launch.args[1] = buffer_arg(d.weights.data(), d.weights.size());
  launch.args[2] = buffer_arg(d.input.data(), d.input.size() * 4);
  launch.args[4] = buffer_arg(out.data(), out.size() * 4);
  const KernelFn fn = def("dense_matmul_id_direct_f32_f32").fn;
  EXPECT_THROW(fn(launch, &pool), Error);  // ids slot unbound
  launch.args[3] = buffer_arg(d.ids.data(), d.ids.size() * 4 - 1);
  EXPECT_THROW(fn(launch, &pool), Error);  // ids one byte short
  launch.args[3] = buffer_arg(d.ids.data(), d.ids.size() * 4);
  EXPECT_NO_THROW(fn(launch, &pool));
}

}  // namespace
}  // namespace routemm
