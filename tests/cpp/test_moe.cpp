// MoE layer front doors on the CPU backend: validation before encoding, and the kernels' contracts
// (gate ranking and policies, silu_mul on strided views, combine's skipped slots).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/moe.h"
#include "routemm/registry.h"
#include "test_support.h"

namespace routemm {
namespace {

using test::download;
using test::upload;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(MoeGate, RanksByLogitWithTiesToTheLowerIndexAndStatedPolicies) {
  const Device device("cpu");
  KernelRegistry registry(device);
  const std::vector<float> logits = {
      1.0f,  3.0f, 3.0f,  2.0f,  // tie between 1 and 2
      kNaN,  0.0f, -kInf, 0.5f,  // NaN ranks as -inf
      0.0f,  kInf, 1.0f,  kInf,  // +inf experts share the mass
      -kInf, kNaN, -kInf, kNaN,  // no mass
  };
  const Buffer in = upload(device, logits, DType::F32);
  Buffer weights = device.alloc(4 * 2 * 4, DType::F32, {4, 2});
  Buffer ids = device.alloc(4 * 2 * 4, DType::U32, {4, 2});
  CommandEncoder encoder = device.command_encoder();
  moe_gate(encoder, registry, in, weights, ids, MoeGateParams{4, 4, 2, true});
  encoder.commit_and_wait();
  EXPECT_EQ(download<uint32_t>(ids), (std::vector<uint32_t>{1, 2, 3, 1, 1, 3, 0, 1}));
  const auto w = download<float>(weights);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[1], 0.5f);
  EXPECT_NEAR(w[2], 1.0f / (1.0f + std::exp(-0.5f)), 1e-6);
  EXPECT_EQ(w[4], 0.5f);
  EXPECT_EQ(w[5], 0.5f);
  EXPECT_EQ(w[6], 0.0f);
  EXPECT_EQ(w[7], 0.0f);
}

TEST(MoeGate, RejectsBadCallsBeforeEncoding) {
  const Device device("cpu");
  KernelRegistry registry(device);
  const Buffer logits = device.alloc(2 * 8 * 4, DType::F32, {2, 8});
  const Buffer weights = device.alloc(2 * 2 * 4, DType::F32, {2, 2});
  const Buffer ids = device.alloc(2 * 2 * 4, DType::I32, {2, 2});
  CommandEncoder encoder = device.command_encoder();
  for (uint32_t top_k : {0u, 9u}) {
    EXPECT_THROW(
        moe_gate(encoder, registry, logits, weights, ids, MoeGateParams{2, 8, top_k, false}),
        InvalidArgument);
  }
  EXPECT_THROW(moe_gate(encoder, registry, logits, weights, ids, MoeGateParams{3, 8, 2, false}),
               InvalidArgument);
  EXPECT_THROW(moe_gate(encoder, registry, logits, weights, weights, MoeGateParams{2, 8, 2, false}),
               InvalidArgument);
  EXPECT_EQ(encoder.pending_dispatches(), 0u);
}

TEST(MoeSiluMulAndCombine, StridedHalvesAndSkippedSlots) {
  const Device device("cpu");
  KernelRegistry registry(device);
  // Two rows of [gate | up], width 2.
  const Buffer gate_up = upload(device, std::vector<float>{1, -2, 3, 4, 0, 5, 6, 7}, DType::F32);
  Buffer act = device.alloc(2 * 2 * 4, DType::F32, {2, 2});
  CommandEncoder encoder = device.command_encoder();
  moe_silu_mul(encoder, registry, gate_up.view(0, 6 * 4, DType::F32, {6}),
               gate_up.view(2 * 4, 6 * 4, DType::F32, {6}), act, MoeSiluMulParams{2, 2, 4, 4});
  encoder.commit_and_wait();
  const auto silu = [](float g) { return g / (1.0f + std::exp(-g)); };
  const auto a = download<float>(act);
  EXPECT_FLOAT_EQ(a[0], silu(1) * 3);
  EXPECT_FLOAT_EQ(a[1], silu(-2) * 4);
  EXPECT_EQ(a[2], 0.0f);
  EXPECT_FLOAT_EQ(a[3], silu(5) * 7);

  // One token, three slots: the middle slot holds a sentinel id and a NaN weight.
  const Buffer rows = upload(device, std::vector<float>{1, 2, 10, 20, 100, 200}, DType::F32);
  const Buffer weights = upload(device, std::vector<float>{0.5f, kNaN, 2.0f}, DType::F32);
  const Buffer ids = upload(device, std::vector<uint32_t>{3, 4, 0}, DType::U32);
  Buffer out = device.alloc(2 * 4, DType::F32, {1, 2});
  moe_combine(encoder, registry, rows, weights, ids, out, MoeCombineParams{1, 3, 2, 4});
  encoder.commit_and_wait();
  EXPECT_EQ(download<float>(out), (std::vector<float>{200.5f, 401.0f}));
  EXPECT_THROW(
      moe_combine(encoder, registry, rows, weights, ids, rows, MoeCombineParams{1, 3, 2, 4}),
      InvalidArgument);
}

}  // namespace
}  // namespace routemm
