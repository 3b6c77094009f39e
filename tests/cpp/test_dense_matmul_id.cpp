// Expert-ID matmul through the core alone: capability, validation, encoding and numerics on cpu.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "test_support.h"

using namespace routemm;
using routemm::test::bits;
using routemm::test::download;
using routemm::test::upload;

namespace {

DenseMatmulIdParams params_for(uint32_t m, uint32_t n, uint32_t k, uint32_t top_k, uint32_t experts,
                               DenseMatmulIdRoute route, DType dtype = DType::F32) {
  DenseMatmulIdParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.top_k = top_k;
  p.n_experts = experts;
  p.expert_stride_bytes = uint64_t{n} * k * dtype_size(dtype);
  p.route = route;
  return p;
}

std::string message_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "<no error>";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

uint16_t to_bf16(float value) {  // round to nearest even
  const uint32_t b = bits(value);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t value) {
  const uint32_t b = uint32_t{value} << 16;
  float out;
  std::memcpy(&out, &b, 4);
  return out;
}

}  // namespace

TEST(DenseMatmulIdCapability, ExactExtents) {
  auto p = params_for(9, 7, 35, 6, 8, DenseMatmulIdRoute::GroupedPrefill, DType::BF16);
  p.expert_stride_bytes = 7 * 35 * 2 + 14;
  const auto cap = dense_matmul_id_capability(DType::BF16, p);
  EXPECT_EQ(cap.schema_version, 3u);
  EXPECT_EQ(cap.required_weight_bytes, 7u * (7 * 35 * 2 + 14) + 7 * 35 * 2);
  EXPECT_EQ(cap.required_input_bytes, 9u * 35 * 4);
  EXPECT_EQ(cap.required_ids_bytes, 54u * 4);
  EXPECT_EQ(cap.required_output_bytes, 54u * 7 * 4);
  ASSERT_TRUE(cap.scratch.has_value());
  EXPECT_EQ(cap.scratch->expert_counts_bytes, 32u);
  EXPECT_EQ(cap.scratch->routed_rows_bytes, 8u * 9 * 4);
  p.input_layout = DenseMatmulIdInputLayout::Slotted;
  EXPECT_EQ(dense_matmul_id_capability(DType::BF16, p).required_input_bytes, 54u * 35 * 4);
}

TEST(DenseMatmulIdCapability, EveryRejectionInOrder) {
  auto p = params_for(9, 7, 35, 6, 8, DenseMatmulIdRoute::Direct, DType::BF16);
  auto check = [](DType dtype, DenseMatmulIdParams q, const std::string& part) {
    const std::string message = message_of([&] { dense_matmul_id_capability(dtype, q); });
    EXPECT_TRUE(contains(message, "dense_matmul_id ") && contains(message, part))
        << message << " / " << part;
  };
  auto q = p;
  q.m = 0;
  check(DType::BF16, q, "M, N, K, top_k, and n_experts must be nonzero");
  q = p;
  q.top_k = 9;
  check(DType::BF16, q, "distinct top_k 9 exceeds n_experts 8");
  check(DType::U32, p, "weights must be F32, F16, or BF16, got u32");
  q = p;
  q.expert_stride_bytes = 489;
  check(DType::BF16, q, "expert stride 489 is smaller than one 490-byte matrix");
  q = p;
  q.expert_stride_bytes = 491;
  check(DType::BF16, q, "expert stride 491 is not aligned to bf16");
  q = p;
  q.n_experts = UINT32_MAX;
  q.expert_stride_bytes = UINT64_MAX - 1;
  check(DType::BF16, q, "overflow");
  q = p;
  q.route = DenseMatmulIdRoute::GroupedPrefill;
  q.id_multiplicity = DenseMatmulIdMultiplicity::MayRepeat;
  check(DType::BF16, q, "grouped prefill requires distinct expert IDs per token");
  q = p;
  q.route = DenseMatmulIdRoute::GroupedPrefill;
  q.n_experts = 1025;
  check(DType::BF16, q, "grouped prefill supports at most 1024 experts");
  q = p;
  q.m = UINT32_MAX;
  q.top_k = 2;
  q.id_multiplicity = DenseMatmulIdMultiplicity::MayRepeat;
  check(DType::BF16, q, "flattened routed rows exceed");
}

TEST(DenseMatmulId, TraceGeometryAndBarrierPattern) {
  Device device(std::string("cpu"));
  KernelRegistry registry(device);
  auto p = params_for(9, 7, 35, 6, 8, DenseMatmulIdRoute::Direct);
  Buffer w = device.alloc(8 * 7 * 35 * 4, DType::F32, {});
  Buffer x = device.alloc(9 * 35 * 4, DType::F32, {});
  Buffer ids = device.alloc(54 * 4, DType::U32, {});
  Buffer out = device.alloc(54 * 7 * 4, DType::F32, {});
  DenseMatmulIdScratch scratch(device, 8, 9);

  CommandEncoder encoder = device.command_encoder();
  encoder.start_encoded_dispatch_receipt(2);
  EXPECT_EQ(dense_matmul_id(encoder, registry, w, x, ids, out, nullptr, p).dispatch_count, 1u);
  auto direct = encoder.take_encoded_dispatch_receipt();
  ASSERT_EQ(direct.size(), 1u);
  EXPECT_EQ(direct[0].pipeline_label, "dense_matmul_id_direct_f32_f32");
  EXPECT_EQ(direct[0].grid, (std::array<uint64_t, 3>{1, 54, 1}));
  EXPECT_EQ(direct[0].threads_per_threadgroup, (std::array<uint64_t, 3>{64, 1, 1}));
  EXPECT_TRUE(direct[0].threadgroup_memory.empty());

  p.route = DenseMatmulIdRoute::GroupedPrefill;
  encoder.start_encoded_dispatch_receipt(2);
  EXPECT_EQ(dense_matmul_id(encoder, registry, w, x, ids, out, &scratch, p).dispatch_count, 2u);
  auto grouped = encoder.take_encoded_dispatch_receipt();
  ASSERT_EQ(grouped.size(), 2u);
  EXPECT_EQ(grouped[0].grid, (std::array<uint64_t, 3>{1, 1, 1}));
  EXPECT_EQ(grouped[0].threads_per_threadgroup, (std::array<uint64_t, 3>{8, 1, 1}));
  EXPECT_EQ(grouped[1].grid, (std::array<uint64_t, 3>{2, 1, 8}));
  EXPECT_EQ(grouped[1].threads_per_threadgroup, (std::array<uint64_t, 3>{256, 1, 1}));
  EXPECT_EQ(grouped[1].threadgroup_memory, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 4096}}));

  // A receipt without room for both grouped dispatches fails before anything is encoded.
  encoder.start_encoded_dispatch_receipt(1);
  const uint64_t before = dispatch_count();
  EXPECT_THROW(dense_matmul_id(encoder, registry, w, x, ids, out, &scratch, p), InvalidArgument);
  EXPECT_EQ(dispatch_count(), before);
  EXPECT_TRUE(encoder.take_encoded_dispatch_receipt().empty());

  encoder.start_capture();
  dense_matmul_id(encoder, registry, w, x, ids, out, &scratch, p);
  dense_matmul_id(encoder, registry, w, x, ids, out, &scratch, p);
  auto nodes = encoder.take_capture().value();
  ASSERT_EQ(nodes.size(), 8u);
  for (size_t i = 0; i < nodes.size(); ++i) {
    EXPECT_EQ(nodes[i].kind,
              i % 2 == 0 ? CapturedNode::Kind::Barrier : CapturedNode::Kind::Dispatch)
        << i;
    if (nodes[i].kind == CapturedNode::Kind::Dispatch) {
      EXPECT_FALSE(nodes[i].reads.empty());
      EXPECT_FALSE(nodes[i].writes.empty());
    }
  }
  const auto out_range = out.logical_range();
  EXPECT_EQ(nodes[3].writes, (std::vector<ByteRange>{{out_range.first, out_range.second}}));
}

TEST(DenseMatmulId, FailedPipelineLookupLeavesTheEncoderUntouched) {
  Device device(std::string("cpu"));
  KernelRegistry registry(device);
  auto p = params_for(9, 7, 35, 2, 4, DenseMatmulIdRoute::GroupedPrefill);
  Buffer w = device.alloc(4 * 7 * 35 * 4, DType::F32, {});
  Buffer x = device.alloc(9 * 35 * 4, DType::F32, {});
  Buffer ids = device.alloc(18 * 4, DType::U32, {});
  Buffer out = device.alloc(18 * 7 * 4, DType::F32, {});
  DenseMatmulIdScratch scratch(device, 4, 9);
  CommandEncoder encoder = device.command_encoder();
  encoder.start_capture();
  registry.inject_next_pipeline_lookup_failure("dense_matmul_id_grouped_f32_f32");
  EXPECT_THROW(dense_matmul_id(encoder, registry, w, x, ids, out, &scratch, p), KernelNotFound);
  EXPECT_TRUE(encoder.take_capture().value().empty());
}

TEST(DenseMatmulId, RoutesAreBitIdenticalAndMatchADoubleReference) {
  Device device(std::string("cpu"));
  KernelRegistry registry(device);
  const uint32_t m = 33, n = 7, k = 35, top_k = 6, experts = 8;
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  for (DType dtype : {DType::F32, DType::BF16}) {
    auto p = params_for(m, n, k, top_k, experts, DenseMatmulIdRoute::Direct, dtype);
    std::vector<float> w(experts * n * k), x(m * k);
    for (auto& v : w) v = normal(rng);
    for (auto& v : x) v = normal(rng);
    std::vector<uint16_t> w16(w.size());
    if (dtype == DType::BF16) {
      for (size_t i = 0; i < w.size(); ++i) {
        w16[i] = to_bf16(w[i]);
        w[i] = from_bf16(w16[i]);  // the exact value the kernel widens
      }
    }
    std::vector<uint32_t> ids(m * top_k);
    for (uint32_t t = 0; t < m; ++t)
      for (uint32_t s = 0; s < top_k; ++s) ids[t * top_k + s] = (t + s) % experts;
    ids[5] = 0xFFFFFFFFu;  // invalid ids give zero rows
    ids[13] = experts;
    Buffer wb =
        dtype == DType::F32 ? upload(device, w, DType::F32) : upload(device, w16, DType::BF16);
    Buffer xb = upload(device, x, DType::F32);
    Buffer ib = upload(device, ids, DType::U32);
    DenseMatmulIdScratch scratch(device, experts, m);
    std::vector<std::vector<float>> results;
    for (auto route : {DenseMatmulIdRoute::Direct, DenseMatmulIdRoute::GroupedPrefill}) {
      p.route = route;
      Buffer ob = upload(device, std::vector<float>(m * top_k * n, std::nanf("")), DType::F32);
      CommandEncoder encoder = device.command_encoder();
      dense_matmul_id(encoder, registry, wb, xb, ib, ob, &scratch, p);
      encoder.commit_and_wait();
      results.push_back(download<float>(ob));
    }
    for (size_t i = 0; i < results[0].size(); ++i) {
      ASSERT_EQ(bits(results[0][i]), bits(results[1][i])) << "element " << i;
    }
    for (uint32_t flat = 0; flat < m * top_k; ++flat) {
      for (uint32_t col = 0; col < n; ++col) {
        double want = 0;
        if (ids[flat] < experts) {
          for (uint32_t i = 0; i < k; ++i) {
            want += double(w[(ids[flat] * n + col) * k + i]) * x[(flat / top_k) * k + i];
          }
        }
        const float got = results[0][flat * n + col];
        if (ids[flat] >= experts) {
          EXPECT_EQ(bits(got), 0u);
        } else {
          EXPECT_NEAR(got, want, 1e-5 * (1 + std::abs(want))) << flat << "," << col;
        }
      }
    }
  }
}

TEST(DenseMatmulIdAutoRoute, TokenThresholdEverywhereRowsPerExpertOnCuda) {
  // Below nine tokens: direct on every backend.
  for (const char* backend : {"cpu", "metal", "cuda"}) {
    EXPECT_FALSE(expert_id_auto_grouped(backend, 8, 2, 8, false)) << backend;
    EXPECT_FALSE(expert_id_auto_grouped(backend, 8, 2, 8, true)) << backend;
  }
  // CPU and Metal: grouped from nine tokens, whatever the reuse.
  EXPECT_TRUE(expert_id_auto_grouped("cpu", 9, 8, 128, false));
  EXPECT_TRUE(expert_id_auto_grouped("metal", 9, 8, 128, true));
  // CUDA, dense: grouped from 8 routed rows per expert (m * top_k >= 8 * n_experts).
  EXPECT_FALSE(expert_id_auto_grouped("cuda", 127, 8, 128, false));  // 7.9 rows per expert
  EXPECT_TRUE(expert_id_auto_grouped("cuda", 128, 8, 128, false));   // 8
  EXPECT_FALSE(expert_id_auto_grouped("cuda", 31, 2, 8, false));
  EXPECT_TRUE(expert_id_auto_grouped("cuda", 32, 2, 8, false));
  EXPECT_FALSE(expert_id_auto_grouped("cuda", 9, 2, 1, false));  // top_k > n_experts
  EXPECT_TRUE(expert_id_auto_grouped("cuda", 9, 1, 1, false));   // 9 rows per expert
  // CUDA, GGML block stacks: from 256 rows per expert.
  EXPECT_FALSE(expert_id_auto_grouped("cuda", 4095, 8, 128, true));
  EXPECT_TRUE(expert_id_auto_grouped("cuda", 4096, 8, 128, true));
  // No slots, more slots than experts, or a threshold past 64 bits: direct, never an overflow.
  EXPECT_FALSE(expert_id_auto_grouped("cpu", 64, 0, 8, false));
  EXPECT_FALSE(expert_id_auto_grouped("cpu", 64, 9, 8, false));
  EXPECT_FALSE(expert_id_auto_grouped("cuda", UINT64_MAX, 1, UINT64_MAX, true));
  EXPECT_TRUE(expert_id_auto_grouped("cuda", UINT64_MAX, 8, uint64_t{1} << 40, false));
}
