// CUDA device decode traits of every GGML block format (csrc/backend/cuda/ggml_blocks.cuh) against
// the reference codecs (routemm/ggml_formats.h): every value bit for bit, on random blocks and on
// edge cases (subnormal, negative and zero scales, MXFP4's subnormal exponents and its "-0" code),
// blocks at odd addresses for the formats read bytewise, and the lane contract (ggml::lane_dot +
// ggml::sum8) bit for bit against the same contract evaluated on the host from the reference
// values, and the tensor-core route's view of each value (code, bias, scale, min) rebuilding it
// bit for bit. Skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml_blocks.cuh"
#include "routemm/ggml_formats.h"

namespace routemm {
namespace {

namespace gb = cuda::ggml;

bool have_device() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Value i of `blocks` consecutive blocks starting at `data`, one thread per value.
template <class F>
__global__ void decode_kernel(const uint8_t* data, uint32_t values, float* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= values) return;
  const uint8_t* block = data + size_t{i / F::kValues} * F::kBytes;
  const uint32_t sub = (i % F::kValues) / 32, l = i % 32;
  out[i] = F::value(block, F::scale(block, sub), sub, l);
}

// Value i rebuilt from the tensor-core route's view (the code, its bias, the LowpScale) with the
// dequantiser's operations: (lo or hi) * (code - bias), then + m for the formats with a min. The
// code is codes16's byte for value i (the tiles' reads); NaN where it differs from code()'s.
template <class F, bool kMin>
__global__ void lowp_decode_kernel(const uint8_t* data, uint32_t values, float* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= values) return;
  const uint8_t* block = data + size_t{i / F::kValues} * F::kBytes;
  const uint32_t sub = (i % F::kValues) / 32, l = i % 32;
  const uint32_t code = gb::byte_of(F::codes16(block, sub, l / 16), l % 16);
  if (code != F::code(block, F::scale(block, sub), sub, l)) {
    out[i] = __int_as_float(0x7fffffff);
    return;
  }
  const gb::LowpScale s = F::lowp(block, sub);
  const float integer = static_cast<float>(static_cast<int>(code) - static_cast<int>(F::kCodeBias));
  const float product = __fmul_rn(l < 16 ? s.lo : s.hi, integer);
  out[i] = kMin ? __fadd_rn(product, s.m) : product;
}

// One row of k values dotted with x under the lane contract (eight threads).
template <class F>
__global__ void dot_kernel(const uint8_t* row, const float* x, uint32_t k, float* out) {
  const float* const xs[1] = {x};
  float acc[1] = {0.0f};
  gb::lane_dot<F, 1>(row, k, xs, threadIdx.x, acc);
  const float sum = gb::sum8(acc[0]);
  if (threadIdx.x == 0) *out = sum;
}

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

void put_half(uint8_t* p, uint16_t h) {
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}

// Random bytes for `blocks` blocks of format f, with every binary16 field set to a finite value
// (random exponent in a modest range, random sign; one block in eight subnormal or zero) and, for
// MXFP4, exponents around 2^0 with the two subnormal ones included.
std::vector<uint8_t> random_blocks(const ggml_formats::Format& f, size_t blocks,
                                   std::mt19937& rng) {
  std::vector<uint8_t> data(blocks * f.block_bytes);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  const std::string name(f.name);
  // Offsets of the binary16 fields of one block.
  std::vector<size_t> halves;
  if (name == "q4_0" || name == "q8_0" || name == "q5_0") halves = {0};
  if (name == "q4_1" || name == "q5_1" || name == "q4_k" || name == "q5_k") halves = {0, 2};
  if (name == "q6_k") halves = {208};
  for (size_t b = 0; b < blocks; ++b) {
    uint8_t* block = data.data() + b * f.block_bytes;
    for (const size_t off : halves) {
      uint16_t h;
      switch (rng() % 8) {
        case 0: h = static_cast<uint16_t>(rng() % 0x400); break;  // subnormal or zero
        default: h = static_cast<uint16_t>(((rng() % 12 + 6) << 10) | (rng() % 0x400)); break;
      }
      if (rng() % 2) h |= 0x8000;
      put_half(block + off, h);
    }
    if (name == "mxfp4") {
      const uint8_t special[] = {0, 1, 2, 160};
      block[0] = rng() % 8 == 0 ? special[rng() % 4] : static_cast<uint8_t>(110 + rng() % 30);
    }
  }
  return data;
}

// The host's lane contract on reference values: lane l sums fma(w[i], x[i], .) for i = l, l + 8,
// ... in order; lanes reduced ((a0+a4)+(a2+a6))+((a1+a5)+(a3+a7)).
float host_lane_dot(const std::vector<float>& w, const std::vector<float>& x) {
  float a[8] = {};
  for (size_t i = 0; i < w.size(); ++i) a[i % 8] = std::fma(w[i], x[i], a[i % 8]);
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// The tensor-core route's codes, biases and scales rebuild every reference value bit for bit,
// with the blocks at offsets 0, 1, 2 and 4 from a 256-byte aligned allocation (codes16's 16-byte,
// byte-and-pair, pair and word reads), in an allocation that ends with the last block.
template <class F, bool kMin>
void check_lowp_view() {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const ggml_formats::Format& f = ggml_formats::format(F::kName);
  std::mt19937 rng(99);
  const size_t blocks = 64, values = blocks * f.block_values;
  const std::vector<uint8_t> data = random_blocks(f, blocks, rng);
  std::vector<float> ref(values), got(values);
  ggml_formats::dequantize(f, data, ref);
  for (const size_t offset : {0, 1, 2, 4}) {
    uint8_t* d_data = nullptr;
    float* d_out = nullptr;
    CUDA_OK(cudaMalloc(&d_data, data.size() + offset));
    CUDA_OK(cudaMalloc(&d_out, values * 4));
    CUDA_OK(cudaMemcpy(d_data + offset, data.data(), data.size(), cudaMemcpyHostToDevice));
    lowp_decode_kernel<F, kMin><<<static_cast<unsigned>((values + 127) / 128), 128>>>(
        d_data + offset, static_cast<uint32_t>(values), d_out);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemcpy(got.data(), d_out, values * 4, cudaMemcpyDeviceToHost));
    size_t mismatches = 0;
    for (size_t i = 0; i < values; ++i) {
      if (bits(got[i]) != bits(ref[i]) && ++mismatches <= 5) {
        ADD_FAILURE() << F::kName << " offset " << offset << " value " << i << ": rebuilt "
                      << got[i] << " reference " << ref[i];
      }
    }
    EXPECT_EQ(mismatches, 0u) << F::kName << " offset " << offset;
    CUDA_OK(cudaFree(d_data));
    CUDA_OK(cudaFree(d_out));
  }
}

template <class F>
void check_format() {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  const ggml_formats::Format& f = ggml_formats::format(F::kName);
  ASSERT_EQ(f.block_bytes, F::kBytes);
  ASSERT_EQ(f.block_values, F::kValues);
  std::mt19937 rng(1234);
  const size_t blocks = 64;
  const std::vector<uint8_t> data = random_blocks(f, blocks, rng);
  const size_t values = blocks * f.block_values;
  std::vector<float> ref(values);
  ggml_formats::dequantize(f, data, ref);
  std::vector<float> x(values);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);

  // The blocks at offset 0 and, for formats read bytewise, 1 (Q4_0 / Q8_0 read their scale as
  // one 2-byte load; their blocks are 2-byte aligned).
  const bool bytewise = std::string(F::kName) != "q4_0" && std::string(F::kName) != "q8_0";
  for (const size_t offset : bytewise ? std::vector<size_t>{0, 1, 3} : std::vector<size_t>{0, 2}) {
    SCOPED_TRACE("offset " + std::to_string(offset));
    uint8_t* d_data = nullptr;
    float *d_out = nullptr, *d_x = nullptr, *d_dot = nullptr;
    CUDA_OK(cudaMalloc(&d_data, data.size() + offset));
    CUDA_OK(cudaMalloc(&d_out, values * 4));
    CUDA_OK(cudaMalloc(&d_x, values * 4));
    CUDA_OK(cudaMalloc(&d_dot, 4));
    CUDA_OK(cudaMemcpy(d_data + offset, data.data(), data.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_x, x.data(), values * 4, cudaMemcpyHostToDevice));
    decode_kernel<F><<<static_cast<unsigned>((values + 127) / 128), 128>>>(
        d_data + offset, static_cast<uint32_t>(values), d_out);
    CUDA_OK(cudaGetLastError());
    std::vector<float> got(values);
    CUDA_OK(cudaMemcpy(got.data(), d_out, values * 4, cudaMemcpyDeviceToHost));
    size_t mismatches = 0;
    for (size_t i = 0; i < values; ++i) {
      if (bits(got[i]) != bits(ref[i]) && ++mismatches <= 5) {
        ADD_FAILURE() << F::kName << " value " << i << ": device " << got[i] << " reference "
                      << ref[i];
      }
    }
    EXPECT_EQ(mismatches, 0u);

    // Rows of 1, 2 and all blocks under the lane contract.
    for (const size_t row_blocks : {size_t{1}, size_t{2}, blocks}) {
      const auto k = static_cast<uint32_t>(row_blocks * f.block_values);
      dot_kernel<F><<<1, 8>>>(d_data + offset, d_x, k, d_dot);
      CUDA_OK(cudaGetLastError());
      float dot = 0.0f;
      CUDA_OK(cudaMemcpy(&dot, d_dot, 4, cudaMemcpyDeviceToHost));
      const float want = host_lane_dot({ref.begin(), ref.begin() + k}, {x.begin(), x.begin() + k});
      EXPECT_EQ(bits(dot), bits(want)) << F::kName << " k " << k << ": " << dot << " vs " << want;
    }
    CUDA_OK(cudaFree(d_data));
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_x));
    CUDA_OK(cudaFree(d_dot));
  }
}

TEST(CudaGgmlBlocks, Q4_0MatchesReference) { check_format<gb::Q4_0Blocks>(); }
TEST(CudaGgmlBlocks, Q8_0MatchesReference) { check_format<gb::Q8_0Blocks>(); }
TEST(CudaGgmlBlocks, Q4_1MatchesReference) { check_format<gb::Q4_1Blocks>(); }
TEST(CudaGgmlBlocks, Q5_0MatchesReference) { check_format<gb::Q5_0Blocks>(); }
TEST(CudaGgmlBlocks, Q5_1MatchesReference) { check_format<gb::Q5_1Blocks>(); }
TEST(CudaGgmlBlocks, Mxfp4MatchesReference) { check_format<gb::Mxfp4Blocks>(); }
TEST(CudaGgmlBlocks, Q4_KMatchesReference) { check_format<gb::Q4_KBlocks>(); }
TEST(CudaGgmlBlocks, Q5_KMatchesReference) { check_format<gb::Q5_KBlocks>(); }
TEST(CudaGgmlBlocks, Q6_KMatchesReference) { check_format<gb::Q6_KBlocks>(); }

TEST(CudaGgmlBlocks, Q4_1LowpViewRebuildsTheValues) { check_lowp_view<gb::Q4_1Blocks, true>(); }
TEST(CudaGgmlBlocks, Q5_0LowpViewRebuildsTheValues) { check_lowp_view<gb::Q5_0Blocks, false>(); }
TEST(CudaGgmlBlocks, Q5_1LowpViewRebuildsTheValues) { check_lowp_view<gb::Q5_1Blocks, true>(); }
TEST(CudaGgmlBlocks, Mxfp4LowpViewRebuildsTheValues) { check_lowp_view<gb::Mxfp4Blocks, false>(); }
TEST(CudaGgmlBlocks, Q4_KLowpViewRebuildsTheValues) { check_lowp_view<gb::Q4_KBlocks, true>(); }
TEST(CudaGgmlBlocks, Q5_KLowpViewRebuildsTheValues) { check_lowp_view<gb::Q5_KBlocks, true>(); }
TEST(CudaGgmlBlocks, Q6_KLowpViewRebuildsTheValues) { check_lowp_view<gb::Q6_KBlocks, false>(); }

// MXFP4's code 8 ("-0") dequantises to +0.0, as ggml's table has it, not -0.0.
TEST(CudaGgmlBlocks, Mxfp4NegativeZeroCodeIsPositiveZero) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device";
  std::vector<uint8_t> block(17, 0x88);
  block[0] = 127;
  uint8_t* d_block = nullptr;
  float* d_out = nullptr;
  CUDA_OK(cudaMalloc(&d_block, 17));
  CUDA_OK(cudaMalloc(&d_out, 32 * 4));
  CUDA_OK(cudaMemcpy(d_block, block.data(), 17, cudaMemcpyHostToDevice));
  decode_kernel<gb::Mxfp4Blocks><<<1, 32>>>(d_block, 32, d_out);
  CUDA_OK(cudaGetLastError());
  std::vector<float> got(32);
  CUDA_OK(cudaMemcpy(got.data(), d_out, 32 * 4, cudaMemcpyDeviceToHost));
  for (const float v : got) EXPECT_EQ(bits(v), 0u);
  CUDA_OK(cudaFree(d_block));
  CUDA_OK(cudaFree(d_out));
}

}  // namespace
}  // namespace routemm
