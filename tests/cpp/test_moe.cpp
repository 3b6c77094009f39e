// MoE layer front doors on the CPU backend: validation before encoding, and the kernels' contracts
// (gate ranking and policies, silu_mul on strided views, combine's skipped slots).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/moe_experts.h"
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

TEST(MoeGate, GroupedSigmoidWithBiasSelectsByBiasAndWeighsWithoutIt) {
  // 8 experts in 4 groups of 2, sigmoid scores, DeepSeek-V3's order. The bias lifts experts 6 and
  // 7 above expert 2 for selection; group scores (top-2 sums of biased scores) keep groups 3 and 1
  // (topk_group 2), so expert 4 of group 2 loses to expert 3 although its score is higher. The
  // weights are the unbiased sigmoids, renormalised, times 2.
  const Device device("cpu");
  KernelRegistry registry(device);
  const std::vector<float> logits = {-1.0f, -1.0f, 1.0f, -1.0f, 0.9f, -5.0f, -2.0f, -1.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 1.5f};
  const Buffer in = upload(device, logits, DType::F32);
  const Buffer b = upload(device, bias, DType::F32);
  Buffer weights = device.alloc(4 * 4, DType::F32, {1, 4});
  Buffer ids = device.alloc(4 * 4, DType::U32, {1, 4});
  MoeGateParams p{1, 8, 4, true};
  p.scoring = MoeGateScoring::Sigmoid;
  p.num_expert_group = 4;
  p.topk_group = 2;
  p.routed_scaling_factor = 2.0f;
  CommandEncoder encoder = device.command_encoder();
  moe_gate(encoder, registry, in, weights, ids, p, &b);
  encoder.commit_and_wait();
  EXPECT_EQ(download<uint32_t>(ids), (std::vector<uint32_t>{7, 6, 2, 3}));
  const auto sigmoid = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  const double scores[] = {sigmoid(-1.0), sigmoid(-2.0), sigmoid(1.0), sigmoid(-1.0)};
  const double total = scores[0] + scores[1] + scores[2] + scores[3];
  const auto w = download<float>(weights);
  for (int s = 0; s < 4; ++s) EXPECT_NEAR(w[s], 2.0 * scores[s] / total, 1e-6) << s;
}

TEST(MoeGate, RefusesBadRoutingBeforeEncoding) {
  const Device device("cpu");
  KernelRegistry registry(device);
  const Buffer logits = device.alloc(2 * 8 * 4, DType::F32, {2, 8});
  const Buffer weights = device.alloc(2 * 4 * 4, DType::F32, {2, 4});
  const Buffer ids = device.alloc(2 * 4 * 4, DType::I32, {2, 4});
  const Buffer short_bias = device.alloc(4 * 4, DType::F32, {4});
  const Buffer f16_bias = device.alloc(8 * 2, DType::F16, {8});
  CommandEncoder encoder = device.command_encoder();
  const auto refused = [&](const MoeGateParams& p, const Buffer* bias, const char* what) {
    try {
      moe_gate(encoder, registry, logits, weights, ids, p, bias);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  MoeGateParams p{2, 8, 4, true};
  p.num_expert_group = 3;
  p.topk_group = 1;
  refused(p, nullptr, "num_expert_group 3 must divide n_experts = 8");
  p.num_expert_group = 4;
  p.topk_group = 5;
  refused(p, nullptr, "topk_group 5 must be in [1, num_expert_group = 4]");
  p.topk_group = 1;
  refused(p, nullptr, "top_k 4 exceeds the 2 experts of the topk_group = 1 kept groups");
  p.num_expert_group = 0;
  refused(p, nullptr, "topk_group needs num_expert_group");
  p.topk_group = 0;
  p.routed_scaling_factor = kInf;
  refused(p, nullptr, "routed_scaling_factor must be finite as a float32, got inf");
  p.routed_scaling_factor = 1.0f;
  p.scoring = static_cast<MoeGateScoring>(2);
  refused(p, nullptr, "scoring_func must be 'softmax' or 'sigmoid'");
  p.scoring = MoeGateScoring::Sigmoid;
  refused(p, &short_bias, "e_score_correction_bias requires 32 logical bytes");
  refused(p, &f16_bias, "e_score_correction_bias must be f32");
  EXPECT_THROW(parse_moe_gate_scoring("moe_gate", "relu"), InvalidArgument);
  const Buffer flat_bias = device.alloc(8 * 4, DType::F32, {2, 4});
  for (const auto& [bias, what] :
       {std::pair{&short_bias, "router_bias requires 32 logical bytes, got 16"},
        std::pair{&f16_bias, "router_bias must be f32, got f16"},
        std::pair{&flat_bias, "router_bias must have shape [n_experts = 8], got [2, 4]"}}) {
    try {
      moe_gate(encoder, registry, logits, weights, ids, p, nullptr, bias);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(encoder.pending_dispatches(), 0u);
}

TEST(MoeGate, RouterBiasJoinsTheLogitsBeforeScoring) {
  // gpt-oss's router: the biased logits {2, 5, 3, 1} select experts 1 and 2, and softmax over
  // those two logits weighs them (renormalize); the selection bias alone would leave the weights
  // those of the unbiased logits.
  const Device device("cpu");
  KernelRegistry registry(device);
  const Buffer in = upload(device, std::vector<float>{2.0f, 0.0f, -1.0f, 1.0f}, DType::F32);
  const Buffer router_bias = upload(device, std::vector<float>{0.0f, 5.0f, 4.0f, 0.0f}, DType::F32);
  Buffer weights = device.alloc(2 * 4, DType::F32, {1, 2});
  Buffer ids = device.alloc(2 * 4, DType::U32, {1, 2});
  CommandEncoder encoder = device.command_encoder();
  moe_gate(encoder, registry, in, weights, ids, MoeGateParams{1, 4, 2, true}, nullptr,
           &router_bias);
  encoder.commit_and_wait();
  EXPECT_EQ(download<uint32_t>(ids), (std::vector<uint32_t>{1, 2}));
  const auto w = download<float>(weights);
  EXPECT_NEAR(w[0], 1.0 / (1.0 + std::exp(-2.0)), 1e-6);
  EXPECT_NEAR(w[1], 1.0 / (1.0 + std::exp(2.0)), 1e-6);
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

// The experts block as one op against the same steps encoded one by one, on one small case
// (E 3, H 4, I 2, top-2; one invalid id): the same bits, and a refused call leaves the encoder as
// it was.
struct BlockCase {
  static constexpr uint32_t kM = 3, kTopK = 2, kE = 3, kH = 4, kI = 2;
  Device device{"cpu"};
  KernelRegistry registry{device};
  Buffer hidden, ids, weights, gate_up, down;
  BlockCase() {
    std::vector<float> x(kM * kH), gu(kE * 2 * kI * kH), dn(kE * kH * kI);
    for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    for (size_t i = 0; i < gu.size(); ++i) gu[i] = 0.125f * static_cast<float>(i % 5) - 0.25f;
    for (size_t i = 0; i < dn.size(); ++i) dn[i] = 0.0625f * static_cast<float>(i % 9) - 0.25f;
    hidden = upload(device, x, DType::F32);
    gate_up = upload(device, gu, DType::F32);
    down = upload(device, dn, DType::F32);
    ids = upload(device, std::vector<uint32_t>{0, 2, 1, 0xFFFFFFFFu, 2, 1}, DType::U32);
    weights = upload(device, std::vector<float>{0.25f, 0.75f, 1.0f, 0.5f, 0.5f, 0.5f}, DType::F32);
  }
  MoeExpertsParams params(DenseMatmulIdRoute route) const {
    MoeExpertsParams p;
    p.m = kM;
    p.top_k = kTopK;
    p.n_experts = kE;
    p.hidden = kH;
    p.intermediate = kI;
    p.weight_dtype = DType::F32;
    p.route = route;
    return p;
  }
};

TEST(MoeExperts, MatchesTheStepsOneByOne) {
  BlockCase c;
  for (const auto route : {DenseMatmulIdRoute::Direct, DenseMatmulIdRoute::GroupedPrefill}) {
    const MoeExpertsParams p = c.params(route);
    const MoeExpertsWorkspaceLayout layout = moe_experts_workspace(p);
    Buffer workspace = c.device.alloc(layout.total_bytes, DType::U8, {layout.total_bytes});
    Buffer out = c.device.alloc(c.kM * c.kH * 4, DType::F32, {c.kM, c.kH});
    CommandEncoder encoder = c.device.command_encoder();
    const MoeExpertsReceipt receipt = moe_experts(encoder, c.registry, c.hidden, c.ids, c.weights,
                                                  c.gate_up, nullptr, c.down, out, workspace, p);
    encoder.commit_and_wait();
    EXPECT_EQ(receipt.grouped, is_grouped(route));
    EXPECT_EQ(receipt.dispatch_count, is_grouped(route) ? 5u : 4u);

    // The same block, step by step on the direct route.
    const uint32_t rows = c.kM * c.kTopK;
    Buffer gu_rows = c.device.alloc(rows * 2 * c.kI * 4, DType::F32, {rows, 2 * c.kI});
    Buffer act = c.device.alloc(rows * c.kI * 4, DType::F32, {rows, c.kI});
    Buffer down_rows = c.device.alloc(rows * c.kH * 4, DType::F32, {rows, c.kH});
    Buffer want = c.device.alloc(c.kM * c.kH * 4, DType::F32, {c.kM, c.kH});
    CommandEncoder steps = c.device.command_encoder();
    DenseMatmulIdParams d{c.kM, 2 * c.kI, c.kH, c.kTopK, c.kE, 2 * c.kI * c.kH * 4u};
    d.id_multiplicity = DenseMatmulIdMultiplicity::MayRepeat;
    dense_matmul_id(steps, c.registry, c.gate_up, c.hidden, c.ids, gu_rows, nullptr, d);
    steps.memory_barrier();
    const uint64_t span = (rows - 1) * 2 * c.kI + c.kI;
    moe_silu_mul(steps, c.registry, gu_rows.view(0, span * 4, DType::F32, {span}),
                 gu_rows.view(c.kI * 4, span * 4, DType::F32, {span}), act,
                 MoeSiluMulParams{rows, c.kI, 2 * c.kI, 2 * c.kI});
    steps.memory_barrier();
    DenseMatmulIdParams dd{c.kM, c.kH, c.kI, c.kTopK, c.kE, c.kH * c.kI * 4u};
    dd.input_layout = DenseMatmulIdInputLayout::Slotted;
    dd.id_multiplicity = DenseMatmulIdMultiplicity::MayRepeat;
    dense_matmul_id(steps, c.registry, c.down, act, c.ids, down_rows, nullptr, dd);
    steps.memory_barrier();
    moe_combine(steps, c.registry, down_rows, c.weights, c.ids, want,
                MoeCombineParams{c.kM, c.kTopK, c.kH, c.kE});
    steps.commit_and_wait();
    EXPECT_EQ(download<float>(out), download<float>(want));
  }
}

TEST(MoeExperts, RefusedCallsLeaveTheEncoderAsItWas) {
  BlockCase c;
  const MoeExpertsParams p = c.params(DenseMatmulIdRoute::GroupedPrefill);
  const MoeExpertsWorkspaceLayout layout = moe_experts_workspace(p);
  Buffer workspace = c.device.alloc(layout.total_bytes, DType::U8, {layout.total_bytes});
  Buffer small = c.device.alloc(16, DType::U8, {16});
  Buffer out = c.device.alloc(c.kM * c.kH * 4, DType::F32, {c.kM, c.kH});
  CommandEncoder encoder = c.device.command_encoder();
  // A workspace too small, a down stack of the wrong dtype, an output overlapping the workspace,
  // a missing up stack for split params, and zero extents.
  EXPECT_THROW(moe_experts(encoder, c.registry, c.hidden, c.ids, c.weights, c.gate_up, nullptr,
                           c.down, out, small, p),
               InvalidArgument);
  EXPECT_THROW(moe_experts(encoder, c.registry, c.hidden, c.ids, c.weights, c.gate_up, nullptr,
                           c.ids, out, workspace, p),
               InvalidArgument);
  EXPECT_THROW(moe_experts(encoder, c.registry, c.hidden, c.ids, c.weights, c.gate_up, nullptr,
                           c.down, workspace, workspace, p),
               InvalidArgument);
  MoeExpertsParams split = p;
  split.split_gate_up = true;
  EXPECT_THROW(moe_experts(encoder, c.registry, c.hidden, c.ids, c.weights, c.gate_up, nullptr,
                           c.down, out, workspace, split),
               InvalidArgument);
  MoeExpertsParams empty = p;
  empty.intermediate = 0;
  EXPECT_THROW(moe_experts_workspace(empty), InvalidArgument);
  EXPECT_EQ(encoder.pending_dispatches(), 0u);
}

}  // namespace
}  // namespace routemm
