// The fused experts block (routemm/ops/moe_experts_fused.h) on every available backend that has
// it (CPU here; CUDA on a GPU machine): against a float64 reference on exactly representable
// inputs, every output element written, sentinel ids, both id widths, and refusals before encoding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/moe_experts_fused.h"
#include "routemm/registry.h"
#include "test_support.h"

namespace routemm {
namespace {

using test::download;

std::vector<std::string> fused_backends() {
  std::vector<std::string> out;
  for (const std::string& name : available_backends()) {
    if (name == "cpu" || name == "cuda") out.push_back(name);
  }
  return out;
}

// Values k / 64 with |k| <= 64: exact in f32, f16 and bf16.
std::vector<float> draw(std::mt19937& rng, size_t n) {
  std::uniform_int_distribution<int> pick(-64, 64);
  std::vector<float> out(n);
  for (float& v : out) v = static_cast<float>(pick(rng)) / 64.0f;
  return out;
}

// The raw bytes of `values` in `dtype` (exact for draw()'s values).
std::vector<uint8_t> encode(const std::vector<float>& values, DType dtype) {
  std::vector<uint8_t> out(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
    if (dtype == DType::F32) {
      std::memcpy(&out[i * 4], &bits, 4);
    } else if (dtype == DType::BF16) {
      const uint16_t b = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&out[i * 2], &b, 2);
    } else {  // F16: sign, exponent rebiased, 10 mantissa bits (draw()'s values are normal or 0)
      const uint32_t sign = (bits >> 16) & 0x8000u, mag = bits & 0x7fffffffu;
      const uint16_t h =
          mag == 0
              ? static_cast<uint16_t>(sign)
              : static_cast<uint16_t>(sign | (((mag >> 23) - 112u) << 10) | ((mag >> 13) & 0x3ffu));
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

double decode(const uint8_t* p, DType dtype) {
  if (dtype == DType::F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, p, 2);
  if (dtype == DType::BF16) return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
  const int exponent = (b >> 10) & 0x1f, mantissa = b & 0x3ff;
  const double sign = (b & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return mantissa ? std::nan("") : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// A buffer of `dtype` holding `bytes`.
Buffer upload_bytes(const Device& device, const std::vector<uint8_t>& bytes, DType dtype) {
  Buffer buffer = device.alloc(bytes.size(), dtype, {bytes.size() / dtype_size(dtype)});
  buffer.copy_from_host(bytes.data(), bytes.size());
  return buffer;
}

struct Case {
  uint32_t m, top_k, n_experts, hidden, intermediate;
  bool split;
  DType dtype, weights_dtype;
  uint32_t id_bytes;
};

void run_case(const std::string& backend, const Case& c) {
  SCOPED_TRACE(backend + " dtype " + std::string(dtype_name(c.dtype)) + " ids " +
               std::to_string(c.id_bytes) + (c.split ? " split" : " packed"));
  const Device device(backend);
  KernelRegistry registry(device);
  std::mt19937 rng(c.m * 131 + c.hidden + c.id_bytes + (c.split ? 7 : 0));
  const uint64_t m = c.m, k = c.top_k, e = c.n_experts, h = c.hidden, inter = c.intermediate;
  const std::vector<float> x = draw(rng, m * h), gate = draw(rng, e * inter * h),
                           upw = draw(rng, e * inter * h), down = draw(rng, e * h * inter),
                           weights = draw(rng, m * k);
  // gate_up packed [E, 2I, H]: gate rows then up rows per expert.
  std::vector<float> packed;
  for (uint64_t x_e = 0; x_e < e; ++x_e) {
    packed.insert(packed.end(), gate.begin() + x_e * inter * h,
                  gate.begin() + (x_e + 1) * inter * h);
    packed.insert(packed.end(), upw.begin() + x_e * inter * h, upw.begin() + (x_e + 1) * inter * h);
  }
  // Ids: valid, repeated, and invalid (n_experts, -1) slots.
  std::vector<int64_t> ids(m * k);
  std::uniform_int_distribution<int64_t> pick(0, e - 1);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = pick(rng);
  ids[1 % ids.size()] = e;
  if (ids.size() > 3) ids[3] = -1;
  std::vector<uint8_t> id_bytes(ids.size() * c.id_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (c.id_bytes == 8) {
      std::memcpy(&id_bytes[i * 8], &ids[i], 8);
    } else {
      const int32_t v = static_cast<int32_t>(ids[i]);
      std::memcpy(&id_bytes[i * 4], &v, 4);
    }
  }
  const Buffer xb = upload_bytes(device, encode(x, c.dtype), c.dtype);
  const Buffer idb = upload_bytes(device, id_bytes, DType::U8);
  const Buffer wb = upload_bytes(device, encode(weights, c.weights_dtype), c.weights_dtype);
  const Buffer gub = upload_bytes(device, encode(c.split ? gate : packed, c.dtype), c.dtype);
  const Buffer upb = upload_bytes(device, encode(upw, c.dtype), c.dtype);
  const Buffer downb = upload_bytes(device, encode(down, c.dtype), c.dtype);
  const uint64_t es = dtype_size(c.dtype);
  // Output poisoned with NaN bytes (0xff), so an element left unwritten shows.
  Buffer out = upload_bytes(device, std::vector<uint8_t>(m * h * es, 0xff), c.dtype);
  MoeExpertsFusedParams p{c.m,     c.top_k, c.n_experts,     c.hidden,  c.intermediate,
                          c.split, c.dtype, c.weights_dtype, c.id_bytes};
  Buffer workspace = device.alloc(moe_experts_fused_workspace_bytes(p), DType::U8,
                                  {moe_experts_fused_workspace_bytes(p)});
  CommandEncoder encoder = device.command_encoder();
  moe_experts_fused(encoder, registry, xb, idb, wb, gub, c.split ? &upb : nullptr, downb, out,
                    workspace, p);
  encoder.commit_and_wait();
  const std::vector<uint8_t> got = download<uint8_t>(out);
  for (uint64_t t = 0; t < m; ++t) {
    for (uint64_t col = 0; col < h; ++col) {
      double ref = 0, scale = 0;
      for (uint64_t s = 0; s < k; ++s) {
        const int64_t id = ids[t * k + s];
        if (id < 0 || id >= int64_t(e)) continue;
        double dsum = 0, dscale = 0;
        for (uint64_t j = 0; j < inter; ++j) {
          double g = 0, u = 0, gs = 0, us = 0;
          for (uint64_t i = 0; i < h; ++i) {
            const double xi = x[t * h + i];
            g += gate[(id * inter + j) * h + i] * xi;
            u += upw[(id * inter + j) * h + i] * xi;
            gs += std::fabs(gate[(id * inter + j) * h + i] * xi);
            us += std::fabs(upw[(id * inter + j) * h + i] * xi);
          }
          const double a = g / (1 + std::exp(-g)) * u;
          const double dw = down[(id * h + col) * inter + j];
          dsum += dw * a;
          dscale += std::fabs(dw) * (std::fabs(a) + gs + us);
        }
        ref += weights[t * k + s] * dsum;
        scale += std::fabs(weights[t * k + s]) * dscale;
      }
      const double value = decode(&got[(t * h + col) * es], c.dtype);
      const double unit = c.dtype == DType::F32   ? 0x1p-24
                          : c.dtype == DType::F16 ? 0x1p-11
                                                  : 0x1p-8;
      const double bound = unit * std::fabs(ref) + 1e-5 * (scale + 1);
      ASSERT_TRUE(std::isfinite(value)) << "token " << t << " column " << col << " unwritten";
      ASSERT_LE(std::fabs(value - ref), bound) << "token " << t << " column " << col;
    }
  }
}

TEST(MoeExpertsFused, MatchesFloat64OnEveryBackendDtypeAndIdWidth) {
  for (const std::string& backend : fused_backends()) {
    for (const DType dtype : {DType::F32, DType::F16, DType::BF16}) {
      for (const uint32_t id_bytes : {4u, 8u}) {
        for (const bool split : {false, true}) {
          run_case(backend, {3, 4, 5, 24, 16, split, dtype, DType::F32, id_bytes});
        }
      }
      run_case(backend, {1, 8, 12, 64, 40, false, dtype, DType::BF16, 8});
      run_case(backend, {2, 2, 3, 16, 8, true, dtype, DType::F16, 4});
    }
  }
}

TEST(MoeExpertsFused, RefusesBeforeEncoding) {
  const Device device("cpu");
  KernelRegistry registry(device);
  const MoeExpertsFusedParams good{2, 2, 4, 16, 8, false, DType::BF16, DType::F32, 4};
  const auto make = [&](uint64_t bytes, DType dtype) {
    return device.alloc(bytes, dtype, {bytes / dtype_size(dtype)});
  };
  const Buffer x = make(2 * 16 * 2, DType::BF16), ids = make(2 * 2 * 4, DType::I32),
               w = make(2 * 2 * 4, DType::F32), gu = make(4 * 16 * 16 * 2, DType::BF16),
               down = make(4 * 16 * 8 * 2, DType::BF16), out = make(2 * 16 * 2, DType::BF16),
               ws = make(moe_experts_fused_workspace_bytes(good), DType::U8);
  CommandEncoder encoder = device.command_encoder();
  auto refused = [&](MoeExpertsFusedParams p, const Buffer& output, const Buffer& weights) {
    EXPECT_THROW(
        moe_experts_fused(encoder, registry, x, ids, weights, gu, nullptr, down, output, ws, p),
        InvalidArgument);
    EXPECT_EQ(encoder.pending_dispatches(), 0u);
  };
  MoeExpertsFusedParams p = good;
  p.hidden = 12;  // not a multiple of 8
  refused(p, out, w);
  p = good;
  p.top_k = kMoeExpertsFusedMaxTopK + 1;
  refused(p, out, w);
  p = good;
  p.id_bytes = 2;
  refused(p, out, w);
  p = good;
  p.dtype = DType::F16;  // the buffers are bf16
  refused(p, out, w);
  refused(good, x, w);                      // output overlaps hidden
  refused(good, out, make(4, DType::F32));  // weights too small
  p = good;
  p.m = 3;  // hidden too small for three tokens
  refused(p, out, w);
  EXPECT_NO_THROW(
      moe_experts_fused(encoder, registry, x, ids, w, gu, nullptr, down, out, ws, good));
  EXPECT_EQ(encoder.pending_dispatches(), 2u);
}

TEST(MoeExpertsFused, ServesDecodeShapesOnCpuAndCudaOnly) {
  const MoeExpertsFusedParams qwen{1, 8, 128, 2048, 768, false, DType::BF16, DType::BF16, 8};
  EXPECT_TRUE(moe_experts_fused_serves("cuda", qwen));
  EXPECT_TRUE(moe_experts_fused_serves("cpu", qwen));
  EXPECT_FALSE(moe_experts_fused_serves("metal", qwen));
  MoeExpertsFusedParams rows = qwen;
  rows.m = 4;  // 32 rows for 128 experts: a quarter of a row per expert, the last fused shape
  EXPECT_TRUE(moe_experts_fused_serves("cuda", rows));
  rows.m = 5;  // past it: the direct route re-reads less
  EXPECT_FALSE(moe_experts_fused_serves("cuda", rows));
  MoeExpertsFusedParams prefill = qwen;
  prefill.m = 512;  // 4096 rows for 128 experts: the tensor-core route's side of the crossover
  EXPECT_FALSE(moe_experts_fused_serves("cuda", prefill));
  MoeExpertsFusedParams odd = qwen;
  odd.hidden = 2044;
  EXPECT_FALSE(moe_experts_fused_serves("cuda", odd));
}

}  // namespace
}  // namespace routemm
