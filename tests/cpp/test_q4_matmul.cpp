// C++ tests of the Q4_0 format and the quantized_matmul_ggml / encode_q4_route front doors on the
// CPU backend: quantiser edge cases, binary16 rounding, routing, geometry, the shared numeric
// contract (all routes bit-identical, V2 == 64x32) and nothing-encoded-on-failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/common/q4_0_block.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/q4_0.h"
#include "routemm/registry.h"
#include "test_support.h"

namespace routemm {
namespace {

using test::bits;
using test::download;
using test::upload;

TEST(Q4Format, HalfConversionRoundsToNearestEven) {
  EXPECT_EQ(q4_0::float_to_half_bits(1.0f), 0x3c00);
  EXPECT_EQ(q4_0::float_to_half_bits(-2.0f), 0xc000);
  EXPECT_EQ(q4_0::float_to_half_bits(65504.0f), 0x7bff);
  EXPECT_EQ(q4_0::float_to_half_bits(65519.0f), 0x7bff);
  EXPECT_EQ(q4_0::float_to_half_bits(65520.0f), 0x7c00);         // the midpoint rounds to infinity
  EXPECT_EQ(q4_0::float_to_half_bits(1.0f + 0x1p-11f), 0x3c00);  // tie -> even
  EXPECT_EQ(q4_0::float_to_half_bits(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(q4_0::float_to_half_bits(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(q4_0::float_to_half_bits(0x1p-25f), 0x0000);  // half of it: tie -> even (zero)
  EXPECT_EQ(q4_0::float_to_half_bits(0x1.8p-25f), 0x0001);
  EXPECT_EQ(q4_0::float_to_half_bits(-0.0f), 0x8000);
  // Every binary16 value survives a round trip through binary32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7fff) > 0x7c00) continue;  // NaNs
    ASSERT_EQ(q4_0::float_to_half_bits(q4_0::half_bits_to_float(static_cast<uint16_t>(h))), h);
  }
}

TEST(Q4Format, QuantiseKnownBlock) {
  // max = -8 gives d = 1: nibble = trunc(x + 8.5), clipped to 15.
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;
  x[1] = 0.5f;   // 9.0 -> 9
  x[2] = -0.5f;  // 8.0 -> 8
  x[3] = 7.5f;   // 16.0 -> clipped to 15
  x[16] = 3.0f;  // 11.5 -> 11, high nibble of byte 0
  std::vector<uint8_t> blocks(18);
  q4_0::quantize(x, blocks);
  EXPECT_EQ(blocks[0], 0x00);
  EXPECT_EQ(blocks[1], 0x3c);  // d = 1.0
  EXPECT_EQ(blocks[2], 0x00 | (11 << 4));
  EXPECT_EQ(blocks[3], 9 | (8 << 4));
  EXPECT_EQ(blocks[4], 8 | (8 << 4));
  EXPECT_EQ(blocks[5], 15 | (8 << 4));
  std::vector<float> back(32);
  q4_0::dequantize(blocks, back);
  EXPECT_EQ(back[0], -8.0f);
  EXPECT_EQ(back[1], 1.0f);
  EXPECT_EQ(back[3], 7.0f);
  EXPECT_EQ(back[16], 3.0f);
  std::vector<float> odd(33);
  EXPECT_THROW(q4_0::quantize(odd, blocks), InvalidArgument);
}

TEST(Q4Format, NegativeZeroBlockStoresPositiveZeroScale) {
  std::vector<float> x(32, -0.0f);
  std::vector<uint8_t> blocks(18);
  q4_0::quantize(x, blocks);
  EXPECT_EQ(blocks[0], 0);
  EXPECT_EQ(blocks[1], 0);
  for (size_t j = 2; j < 18; ++j) EXPECT_EQ(blocks[j], 0x88);
}

struct Fixture {
  Device device{std::string("cpu")};
  KernelRegistry registry{device};
  uint32_t m, n, k;
  Buffer input, weight, output;
  std::vector<float> x, w;  // w: dequantised [n, k]

  Fixture(uint32_t m_, uint32_t n_, uint32_t k_) : m(m_), n(n_), k(k_) {
    std::mt19937 gen(m * 131 + n * 7 + k);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> raw(size_t{n} * k);
    for (float& v : raw) v = dist(gen);
    x.resize(size_t{m} * k);
    for (float& v : x) v = dist(gen);
    std::vector<uint8_t> blocks(q4_0::quantized_bytes(raw.size()));
    q4_0::quantize(raw, blocks);
    w.resize(raw.size());
    q4_0::dequantize(blocks, w);
    input = upload(device, x, DType::F32);
    weight = upload(device, blocks, DType::U8);
    output = device.alloc(size_t{m} * n * 4, DType::F32, {m, n});
  }

  GgmlQuantizedMatmulParams params() const { return {m, n, k, GgmlType::Q4_0}; }

  std::vector<float> run(std::optional<DenseQ4Route> forced, GgmlQuantizedMatmulReceipt* receipt,
                         GgmlRoutingPolicy policy = {}) {
    CommandEncoder encoder = device.command_encoder();
    const GgmlQuantizedMatmulReceipt r =
        forced ? encode_q4_route(encoder, registry, input, weight, output, params(), *forced)
               : quantized_matmul_ggml(encoder, registry, input, weight, output, params(), policy);
    encoder.commit_and_wait();
    if (receipt != nullptr) *receipt = r;
    return download<float>(output);
  }
};

TEST(Q4Matmul, EveryRouteMatchesReferenceAndEachOther) {
  Fixture f(37, 70, 288);
  std::vector<std::vector<float>> outs;
  for (DenseQ4Route route : kAllDenseQ4Routes) {
    GgmlQuantizedMatmulReceipt receipt;
    outs.push_back(f.run(route, &receipt));
    EXPECT_EQ(receipt.dispatch, q4_expected_dispatch(route, f.m, f.n));
    EXPECT_EQ(receipt.decision, DenseQ4DecisionSource::ForcedTest);
  }
  for (size_t r = 0; r < f.m; ++r) {
    for (size_t c = 0; c < f.n; ++c) {
      double ref = 0, magnitude = 0;
      for (size_t i = 0; i < f.k; ++i) {
        const double p = double(f.x[r * f.k + i]) * double(f.w[c * f.k + i]);
        ref += p;
        magnitude += std::fabs(p);
      }
      ASSERT_NEAR(outs[0][r * f.n + c], ref, 1e-6 * magnitude + 1e-30) << r << "," << c;
    }
  }
  for (const auto& out : outs) {
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(bits(out[i]), bits(outs[0][i])) << i;
  }
}

TEST(Q4Matmul, MatVecMatchesMatrixRoutesBitForBit) {
  Fixture mm(9, 21, 96);
  const std::vector<float> full = mm.run(DenseQ4Route::CompatibilityV2, nullptr);
  Fixture mv(9, 21, 96);  // same seed, same data
  mv.m = 8;
  mv.output = mv.device.alloc(8 * 21 * 4, DType::F32, {8, 21});
  GgmlQuantizedMatmulReceipt receipt;
  const std::vector<float> decode = mv.run(std::nullopt, &receipt);
  EXPECT_FALSE(receipt.route.has_value());
  EXPECT_EQ(receipt.pipeline_label, "kernel_mul_mv_q4_0_f32|700:i1|701:i1|702:i1");
  EXPECT_EQ(receipt.dispatch.grid, (std::array<uint64_t, 3>{3, 8, 1}));
  EXPECT_EQ(receipt.dispatch.threads_per_threadgroup, (std::array<uint64_t, 3>{8, 8, 1}));
  for (size_t i = 0; i < decode.size(); ++i) ASSERT_EQ(bits(decode[i]), bits(full[i])) << i;
}

TEST(Q4Matmul, RoutingWithoutPlan) {
  Fixture f(129, 769, 32);
  struct Case {
    GgmlRoutingPolicy policy;
    DenseQ4Route route;
    DenseQ4DecisionSource decision;
  };
  const Case cases[] = {
      {{}, DenseQ4Route::CompatibilityV2, DenseQ4DecisionSource::NoPlanCompatibilityFallback},
      {{GgmlTensorMmPreference::ForceSimd, true},
       DenseQ4Route::CompatibilitySimdgroup,
       DenseQ4DecisionSource::IneligibleCompatibilityFallback},
      {{GgmlTensorMmPreference::AutoProbe, false},
       DenseQ4Route::CompatibilityTensorV1,
       DenseQ4DecisionSource::IneligibleCompatibilityFallback},
  };
  for (const Case& c : cases) {
    GgmlQuantizedMatmulReceipt receipt;
    f.run(std::nullopt, &receipt, c.policy);
    ASSERT_TRUE(receipt.route.has_value());
    EXPECT_EQ(*receipt.route, c.route);
    EXPECT_EQ(receipt.decision, c.decision);
    EXPECT_EQ(receipt.policy, c.policy);
    EXPECT_EQ(receipt.dispatch, q4_expected_dispatch(c.route, 129, 769));
  }
  // Spec §6.2 example.
  EXPECT_EQ(q4_expected_dispatch(DenseQ4Route::CompatibilitySimdgroup, 129, 769).grid,
            (std::array<uint64_t, 3>{5, 13, 1}));
  EXPECT_EQ(q4_expected_dispatch(DenseQ4Route::CompatibilityTensorV1, 129, 769).grid,
            (std::array<uint64_t, 3>{5, 13, 1}));
  EXPECT_EQ(q4_expected_dispatch(DenseQ4Route::CompatibilityV2, 129, 769).grid,
            (std::array<uint64_t, 3>{2, 13, 1}));
  EXPECT_EQ(q4_expected_dispatch(DenseQ4Route::Tensor64x32, 129, 769).grid,
            (std::array<uint64_t, 3>{5, 13, 1}));
}

// Spec §6.2 steps 4-6 in the C++ dispatcher: a frozen plan's exact shape takes the plan's route and
// says frozen_plan; other shapes say why they did not (undeclared, ineligible); a candidate whose
// pipeline fails to resolve at dispatch runs V2 and says ineligible, never frozen_plan.
TEST(Q4Matmul, DispatcherConsultsTheFrozenPlan) {
  Fixture f(9, 70, 64);
  using enum DenseQ4DecisionSource;
  GgmlQuantizedMatmulReceipt receipt;
  f.run(std::nullopt, &receipt);
  EXPECT_EQ(receipt.decision, NoPlanCompatibilityFallback);

  const Device& device = f.registry.device();
  DenseQ4PlanRoutes plan{"plan-a",
                         device.name(),
                         device.registry_id(),
                         f.registry.authority_id(),
                         {{DenseQ4Shape{9, 70, 64}, DenseQ4Route::Tensor64x32}}};
  DenseQ4PlanRoutes foreign = plan;
  foreign.registry_authority_id += 1;
  EXPECT_THROW(freeze_dense_q4_plan_routes(f.registry, foreign, {}), InvalidArgument);
  foreign = plan;
  foreign.device_name += " (another)";
  EXPECT_THROW(freeze_dense_q4_plan_routes(f.registry, foreign, {}), InvalidArgument);
  EXPECT_FALSE(f.registry.frozen_plan_id(std::string(kDenseQ4PlanKind)).has_value());
  freeze_dense_q4_plan_routes(f.registry, plan, {"kernel_mul_mm_q4_0_tensor_64x32_f32"});
  EXPECT_TRUE(f.registry.is_protected("kernel_mul_mm_q4_0_tensor_64x32_f32"));

  const std::vector<float> planned = f.run(std::nullopt, &receipt);
  EXPECT_EQ(receipt.route, DenseQ4Route::Tensor64x32);
  EXPECT_EQ(receipt.decision, FrozenPlan);
  EXPECT_EQ(receipt.dispatch, q4_expected_dispatch(DenseQ4Route::Tensor64x32, 9, 70));

  f.registry.inject_next_pipeline_lookup_failure("kernel_mul_mm_q4_0_tensor_64x32_f32");
  const std::vector<float> fallback = f.run(std::nullopt, &receipt);
  EXPECT_EQ(receipt.route, DenseQ4Route::CompatibilityV2);
  EXPECT_EQ(receipt.decision, IneligibleCompatibilityFallback);
  for (size_t i = 0; i < planned.size(); ++i) ASSERT_EQ(bits(planned[i]), bits(fallback[i])) << i;

  GgmlQuantizedMatmulParams undeclared = f.params();
  undeclared.m = 10;
  EXPECT_EQ(select_dense_q4_route(f.registry, device, undeclared, {}).decision,
            UndeclaredCompatibilityFallback);
  EXPECT_EQ(select_dense_q4_route(f.registry, device, f.params(),
                                  {GgmlTensorMmPreference::AutoProbe, false})
                .decision,
            IneligibleCompatibilityFallback);
}

TEST(Q4Matmul, FailuresEncodeNothing) {
  Fixture f(9, 5, 64);
  const auto expect_failure = [&](const GgmlQuantizedMatmulParams& p, const Buffer& out,
                                  std::optional<DenseQ4Route> forced, const std::string& text) {
    CommandEncoder encoder = f.device.command_encoder();
    encoder.start_encoded_dispatch_receipt(1);
    const uint64_t before = dispatch_count();
    try {
      if (forced) {
        encode_q4_route(encoder, f.registry, f.input, f.weight, out, p, *forced);
      } else {
        quantized_matmul_ggml(encoder, f.registry, f.input, f.weight, out, p, {});
      }
      ADD_FAILURE() << "no error for " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
    EXPECT_EQ(dispatch_count(), before);
    EXPECT_TRUE(encoder.take_encoded_dispatch_receipt().empty());
  };
  expect_failure({9, 5, 48, GgmlType::Q4_0}, f.output, std::nullopt,
                 "K (48) must be divisible by block QK (32)");
  expect_failure({9, 5, 64, GgmlType::Q2_K}, f.output, std::nullopt, "does not support q2_k");
  expect_failure({9, 5, 64, GgmlType::Q6_K}, f.output, std::nullopt,
                 "K (64) must be divisible by block QK (256)");
  expect_failure({0, 5, 64, GgmlType::Q4_0}, f.output, std::nullopt, "M, K, and N must all be > 0");
  expect_failure({9, 5, 1u << 31, GgmlType::Q4_0}, f.output, std::nullopt,
                 "exceeds the signed kernel ABI");
  expect_failure({9, 6, 64, GgmlType::Q4_0}, f.output, std::nullopt, "Weight buffer too small");
  expect_failure({9, 5, 64, GgmlType::Q4_0}, f.output.view(0, 16, DType::F32, {4}), std::nullopt,
                 "Output buffer too small");
  expect_failure({8, 5, 64, GgmlType::Q4_0}, f.output, DenseQ4Route::Tensor64x32,
                 "forced dense Q4 MM route requires Q4_0 and M > 8");
}

TEST(Q4Matmul, KernelDefsCarryTheSpecGeometry) {
  Device device(std::string("cpu"));
  KernelRegistry registry(device);
  for (DenseQ4Route route : kAllDenseQ4Routes) {
    const PipelinePtr p =
        registry.get_pipeline(dense_q4_pipeline_name(route), kQ4PipelineConstants);
    const EncodedKernelDispatch expected = q4_expected_dispatch(route, 1, 1);
    EXPECT_EQ(p->label(), expected.pipeline_label);
    EXPECT_EQ(p->def().tile_y, 64u);
    EXPECT_EQ(p->def().threads_per_group, 128u);
    EXPECT_EQ(p->def().threadgroup_memory_bytes, expected.threadgroup_memory[0].second);
    EXPECT_EQ(p->identity().content_sha256.size(), 64u);
  }
  const PipelinePtr mv = registry.get_pipeline(kQ4_0MatVecPipeline, kQ4PipelineConstants);
  EXPECT_EQ(mv->def().tile_x, 8u);
  EXPECT_EQ(mv->def().threadgroup_memory_bytes, 0u);
}

}  // namespace
}  // namespace routemm
