// The Metal execution model: each check fires on a seeded copy of a real shader (and stays quiet on
// the shader itself), and the model's simdgroup, dispatch and threadgroup semantics on probes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/calibration_params.h"
#include "backend/metal_emu/backend.h"
#include "backend/metal_emu/runtime.h"
#include "routemm/device.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/registry.h"

namespace routemm::metal_emu {
const ShaderLibrary& library_seeded_out_of_extent();
const ShaderLibrary& library_seeded_race();
const ShaderLibrary& library_seeded_barrier();
const ShaderLibrary& library_seeded_divergence();
const ShaderLibrary& library_seeded_tensor_view();
const ShaderLibrary& library_seeded_tensor_scope();
const ShaderLibrary& library_seeded_tensor_scope_size();
const ShaderLibrary& library_seeded_tensor_race();
const ShaderLibrary& library_probe();

namespace {

Buffer filled(const Device& device, uint64_t nbytes, DType dtype, uint8_t byte = 0) {
  Buffer b = device.alloc(nbytes, dtype, {nbytes / dtype_size(dtype)});
  std::vector<uint8_t> bytes(nbytes, byte);
  b.copy_from_host(bytes.data(), nbytes);
  return b;
}

// The message of the CommandBufferError that running `body` raises ("" when none).
template <class Body>
std::string failure_of(Body body) {
  try {
    body();
  } catch (const CommandBufferError& e) {
    return e.what();
  }
  return {};
}

void expect_names_thread_and_address(const std::string& message, const std::string& kernel) {
  EXPECT_NE(message.find("kernel " + kernel), std::string::npos) << message;
  EXPECT_NE(message.find("thread ("), std::string::npos) << message;
  EXPECT_NE(message.find("of threadgroup ("), std::string::npos) << message;
}

// ---- Seeded bugs through the real front doors ------------------------------------------------------

// Grouped prefill, m = 9 tokens x top_k 2 over 8 experts: expert row counts are not multiples of
// 8, so partial tiles have simdgroups without a routed row.
std::string run_grouped(const ShaderLibrary& library, bool complete) {
  const Device device(make_metal_emu_backend(library, complete));
  KernelRegistry registry(device);
  DenseMatmulIdParams p;
  p.m = 9;
  p.n = 7;
  p.k = 35;
  p.top_k = 2;
  p.n_experts = 8;
  p.expert_stride_bytes = uint64_t{p.n} * p.k * 4;
  p.route = DenseMatmulIdRoute::GroupedPrefill;
  const Buffer weights = filled(device, p.expert_stride_bytes * p.n_experts, DType::F32);
  const Buffer input = filled(device, uint64_t{p.m} * p.k * 4, DType::F32);
  std::vector<uint32_t> ids;
  for (uint32_t t = 0; t < p.m; ++t) {
    for (uint32_t s = 0; s < p.top_k; ++s) ids.push_back((t + 3 * s) % p.n_experts);
  }
  Buffer id_buffer = device.alloc(ids.size() * 4, DType::U32, {p.m, p.top_k});
  id_buffer.copy_from_host(ids.data(), ids.size() * 4);
  const Buffer output = filled(device, uint64_t{p.m} * p.top_k * p.n * 4, DType::F32);
  const DenseMatmulIdScratch scratch(device, 8, 9);
  return failure_of([&] {
    CommandEncoder encoder = device.command_encoder();
    dense_matmul_id(encoder, registry, weights, input, id_buffer, output, &scratch, p);
    encoder.commit_and_wait();
  });
}

TEST(MetalEmuChecks, UnseededGroupedKernelRunsClean) {
  EXPECT_EQ(run_grouped(library_base(), true), "");
}

TEST(MetalEmuChecks, RaceBetweenBarriers) {
  const std::string message = run_grouped(library_seeded_race(), false);
  EXPECT_NE(message.find("threadgroup memory race"), std::string::npos) << message;
  expect_names_thread_and_address(message, "dense_matmul_id_grouped_f32_f32");
  EXPECT_NE(message.find("of [[threadgroup(0)]]"), std::string::npos) << message;
  EXPECT_NE(message.find(" at 0x"), std::string::npos) << message;
}

TEST(MetalEmuChecks, BarrierNotReachedByEveryThread) {
  const std::string message = run_grouped(library_seeded_barrier(), false);
  EXPECT_NE(message.find("barrier not reached by every thread"), std::string::npos) << message;
  expect_names_thread_and_address(message, "dense_matmul_id_grouped_f32_f32");
  EXPECT_NE(message.find("threadgroup_barrier at dense_matmul_id.metal:"), std::string::npos)
      << message;
  EXPECT_NE(message.find("returned"), std::string::npos) << message;
}

std::string run_poison(const ShaderLibrary& library, bool complete) {
  const Device device(make_metal_emu_backend(library, complete));
  KernelRegistry registry(device);
  // 40 guarded elements in buffers of exactly that size; the grid has 64 threads.
  const Buffer control = filled(device, 40 * 4, DType::F32);
  const Buffer candidate = filled(device, 40 * 4, DType::F32);
  const kernels::CalibrationKernelParams params{32, 40, 0, 0};
  const auto poison = registry.get_pipeline("routemm_calibration_poison_f32");
  const std::pair<uint32_t, KernelArg> args[] = {
      {0, KernelArg::of(control)}, {1, KernelArg::of(candidate)}, {2, KernelArg::pod(params)}};
  return failure_of([&] {
    CommandEncoder encoder = device.command_encoder();
    encoder.dispatch(*poison, args, Dim3{64, 1, 1}, Dim3{64, 1, 1}, DispatchKind::Threads);
    encoder.commit_and_wait();
  });
}

TEST(MetalEmuChecks, UnseededPoisonKernelRunsClean) {
  EXPECT_EQ(run_poison(library_base(), true), "");
}

TEST(MetalEmuChecks, WriteOutsideBufferExtent) {
  const std::string message = run_poison(library_seeded_out_of_extent(), false);
  EXPECT_NE(message.find("buffer out of extent"), std::string::npos) << message;
  expect_names_thread_and_address(message, "routemm_calibration_poison_f32");
  // Thread 40 is the first past the 160-byte buffer bound at slot 0.
  EXPECT_NE(message.find("thread (40, 0, 0)"), std::string::npos) << message;
  EXPECT_NE(message.find("writes 4 byte(s) at 0x"), std::string::npos) << message;
  EXPECT_NE(message.find("offset 160 from [[buffer(0)]]"), std::string::npos) << message;
  EXPECT_NE(message.find("extent 160 bytes"), std::string::npos) << message;
}

std::string run_q4_matrix(const ShaderLibrary& library, bool complete,
                          DenseQ4Route route = DenseQ4Route::CompatibilitySimdgroup) {
  const Device device(make_metal_emu_backend(library, complete));
  KernelRegistry registry(device);
  const uint32_t m = 33, n = 70, k = 64;
  const Buffer weight = filled(device, uint64_t{n} * (k / 32) * 18, DType::U8);
  const Buffer input = filled(device, uint64_t{m} * k * 4, DType::F32);
  const Buffer output = filled(device, uint64_t{m} * n * 4, DType::F32);
  const GgmlQuantizedMatmulParams params{m, n, k, GgmlType::Q4_0};
  return failure_of([&] {
    CommandEncoder encoder = device.command_encoder();
    encode_q4_route(encoder, registry, input, weight, output, params, route);
    encoder.commit_and_wait();
  });
}

TEST(MetalEmuChecks, UnseededSimdgroupMatrixKernelRunsClean) {
  EXPECT_EQ(run_q4_matrix(library_base(), true), "");
}

TEST(MetalEmuChecks, SimdgroupMatrixUnderDivergentControlFlow) {
  const std::string message = run_q4_matrix(library_seeded_divergence(), false);
  EXPECT_NE(message.find("simdgroup op under divergent control flow"), std::string::npos)
      << message;
  EXPECT_NE(message.find("kernel kernel_mul_mm_q4_0_f32"), std::string::npos) << message;
  // The matrix routes' tile lives in ggml_blocks.h (the seeded copy of it beside the shader).
  EXPECT_NE(message.find("simdgroup_multiply_accumulate at ggml_blocks.h:"), std::string::npos)
      << message;
  EXPECT_NE(message.find("of threadgroup ("), std::string::npos) << message;
  EXPECT_NE(message.find("lanes 0,2,4"), std::string::npos) << message;
}

// The Metal 4 tensor-API routes (q4_matmul_tensor.metal: matmul2d over tensor views).
constexpr DenseQ4Route kTensorRoutes[] = {DenseQ4Route::CompatibilityTensorV1,
                                          DenseQ4Route::CompatibilityV2, DenseQ4Route::Tensor64x32};

TEST(MetalEmuChecks, UnseededTensorKernelsRunClean) {
  for (const DenseQ4Route route : kTensorRoutes)
    EXPECT_EQ(run_q4_matrix(library_base(), true, route), "") << to_string(route);
}

TEST(MetalEmuChecks, TensorViewPastItsBuffer) {
  for (const DenseQ4Route route : kTensorRoutes) {
    const std::string message = run_q4_matrix(library_seeded_tensor_view(), false, route);
    EXPECT_NE(message.find("tensor view out of extent"), std::string::npos) << message;
    EXPECT_NE(message.find("kernel " + std::string(dense_q4_pipeline_name(route))),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("thread ("), std::string::npos) << message;
    // The view of 34 rows x 70 outputs starts at the output, bound at slot 3 with 33 rows.
    EXPECT_NE(message.find("makes a view of 9520 byte(s) at 0x"), std::string::npos) << message;
    EXPECT_NE(message.find("offset 0 from [[buffer(3)]]"), std::string::npos) << message;
    EXPECT_NE(message.find("ends 280 byte(s) past the buffer"), std::string::npos) << message;
    EXPECT_NE(message.find("(tensor at q4_matmul_tensor.metal:"), std::string::npos) << message;
  }
}

TEST(MetalEmuChecks, TensorOpNotEnteredByEveryThreadOfItsScope) {
  for (const DenseQ4Route route : kTensorRoutes) {
    const std::string message = run_q4_matrix(library_seeded_tensor_scope(), false, route);
    EXPECT_NE(message.find("tensor op not entered by every thread of its execution scope"),
              std::string::npos)
        << message;
    expect_names_thread_and_address(message, std::string(dense_q4_pipeline_name(route)));
    EXPECT_NE(message.find("matmul2d::run at q4_matmul_tensor.metal:"), std::string::npos)
        << message;
    // Thread 64, the first to skip the op, waits at the barrier after it.
    EXPECT_NE(message.find("(index 64, simdgroup 2 lane 0)"), std::string::npos) << message;
    EXPECT_NE(message.find("which waits at threadgroup_barrier at q4_matmul_tensor.metal:"),
              std::string::npos)
        << message;
  }
}

TEST(MetalEmuChecks, TensorOpScopeOfTheWrongSize) {
  const std::string message =
      run_q4_matrix(library_seeded_tensor_scope_size(), false, DenseQ4Route::CompatibilityV2);
  EXPECT_NE(message.find("tensor op execution scope mismatch"), std::string::npos) << message;
  EXPECT_NE(message.find("execution_simdgroups<2> (64 threads)"), std::string::npos) << message;
  EXPECT_NE(message.find("has 128 threads"), std::string::npos) << message;
}

TEST(MetalEmuChecks, TensorOpReadsCountInRaces) {
  for (const DenseQ4Route route : kTensorRoutes) {
    const std::string message = run_q4_matrix(library_seeded_tensor_race(), false, route);
    EXPECT_NE(message.find("threadgroup memory race"), std::string::npos) << message;
    expect_names_thread_and_address(message, std::string(dense_q4_pipeline_name(route)));
    EXPECT_NE(message.find("of [[threadgroup(0)]]"), std::string::npos) << message;
  }
}

// ---- Model semantics on probe kernels -------------------------------------------------------------

KernelLaunch launch_of(const std::string& label, Dim3 grid, Dim3 threads, DispatchKind kind) {
  KernelLaunch launch;
  launch.label = label;
  launch.grid = grid;
  launch.threads = threads;
  launch.kind = kind;
  return launch;
}

void bind(KernelLaunch& launch, size_t slot, void* data, size_t bytes) {
  launch.args[slot] = BoundArg{BoundArg::Kind::Buffer, data, bytes};
}

const ShaderKernel& probe(const std::string& name) {
  const ShaderKernel* kernel = library_probe().find(name);
  EXPECT_NE(kernel, nullptr) << name;
  return *kernel;
}

TEST(MetalEmuModel, SimdFunctionsExchangeInLockstep) {
  std::vector<float> out(64 * 4, -1.0f);
  KernelLaunch launch =
      launch_of("probe", Dim3{1, 1, 1}, Dim3{64, 1, 1}, DispatchKind::ThreadGroups);
  bind(launch, 0, out.data(), out.size() * 4);
  run_dispatch(probe("probe_simd_functions"), launch, nullptr);
  for (uint32_t t = 0; t < 64; ++t) {
    const uint32_t lane = t % 32;
    EXPECT_EQ(out[t * 4 + 0], 528.0f) << t;  // 1 + ... + 32
    EXPECT_EQ(out[t * 4 + 1], 32.0f) << t;
    EXPECT_EQ(out[t * 4 + 2], float(lane * (lane + 1) / 2)) << t;
    EXPECT_EQ(out[t * 4 + 3], lane == 31 ? 32.0f : float(lane + 2)) << t;
  }
}

TEST(MetalEmuModel, ReductionsCoverTheActiveLanes) {
  std::vector<float> out(32, -1.0f);
  KernelLaunch launch =
      launch_of("probe", Dim3{1, 1, 1}, Dim3{32, 1, 1}, DispatchKind::ThreadGroups);
  bind(launch, 0, out.data(), out.size() * 4);
  run_dispatch(probe("probe_active_lanes"), launch, nullptr);
  for (uint32_t t = 0; t < 32; ++t) EXPECT_EQ(out[t], t < 16 ? 16.0f : -1.0f) << t;
}

TEST(MetalEmuModel, ShuffleFromAnInactiveLaneIsAnError) {
  std::vector<float> out(32, -1.0f);
  KernelLaunch launch =
      launch_of("probe", Dim3{1, 1, 1}, Dim3{32, 1, 1}, DispatchKind::ThreadGroups);
  bind(launch, 0, out.data(), out.size() * 4);
  try {
    run_dispatch(probe("probe_shuffle_inactive"), launch, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("simdgroup op under divergent control flow"), std::string::npos);
    EXPECT_NE(message.find("reads lane 16, which is not active"), std::string::npos) << message;
  }
}

TEST(MetalEmuModel, ThreadsDispatchTrimsEdgeGroups) {
  uint32_t counter = 0;
  std::vector<uint32_t> positions(100 * 2, 0);
  KernelLaunch launch = launch_of("probe", Dim3{100, 1, 1}, Dim3{64, 1, 1}, DispatchKind::Threads);
  bind(launch, 0, &counter, 4);
  bind(launch, 1, positions.data(), positions.size() * 4);
  run_dispatch(probe("probe_threads_dispatch"), launch, nullptr);
  EXPECT_EQ(counter, 100u);
  for (uint32_t t = 0; t < 100; ++t) {
    EXPECT_EQ(positions[t * 2], t / 64) << t;
    EXPECT_EQ(positions[t * 2 + 1], t < 64 ? 64u : 36u) << t;
  }
}

TEST(MetalEmuModel, ThreadgroupMemoryAfterABarrier) {
  std::vector<float> out(96, -1.0f);
  KernelLaunch launch =
      launch_of("probe", Dim3{2, 1, 1}, Dim3{48, 1, 1}, DispatchKind::ThreadGroups);
  bind(launch, 0, out.data(), out.size() * 4);
  launch.threadgroup_memory = {{0, 192}};
  run_dispatch(probe("probe_threadgroup_exchange"), launch, nullptr);
  for (uint32_t t = 0; t < 96; ++t) EXPECT_EQ(out[t], float((t / 48) * 48 + 47 - t % 48)) << t;
}

// matmul2d (model_probe.metal): left 3 x 5, right 4 x 5 used transposed, a 4 x 4 tile whose last
// row lies past the operands; each element an F32 fma chain over k = 0..4 (the model's order).
TEST(MetalEmuModel, Matmul2dModesTransposesAndEdges) {
  std::vector<float> left(15), right(20);
  for (size_t i = 0; i < left.size(); ++i) left[i] = 0.25f * float(i) - 1.5f;
  for (size_t i = 0; i < right.size(); ++i) right[i] = 0.5f - 0.125f * float(i);
  const auto product = [&](int row, int column, float start) {
    float acc = start;
    for (int k = 0; k < 5; ++k) acc = std::fma(left[row * 5 + k], right[column * 5 + k], acc);
    return acc;
  };
  for (const bool accumulate : {false, true}) {
    std::vector<float> out(12);
    for (size_t i = 0; i < out.size(); ++i) out[i] = float(i) + 0.5f;
    const std::vector<float> before = out;
    KernelLaunch launch =
        launch_of("probe", Dim3{1, 1, 1}, Dim3{32, 1, 1}, DispatchKind::ThreadGroups);
    bind(launch, 0, left.data(), left.size() * 4);
    bind(launch, 1, right.data(), right.size() * 4);
    bind(launch, 2, out.data(), out.size() * 4);
    run_dispatch(probe(accumulate ? "probe_matmul2d_accumulate" : "probe_matmul2d_multiply"),
                 launch, nullptr);
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(out[r * 4 + c], product(r, c, accumulate ? before[r * 4 + c] : 0.0f))
            << accumulate << " " << r << " " << c;
    }
  }
}

TEST(MetalEmuModel, UnboundAndUndersizedArgumentsAreRejected) {
  std::vector<float> out(32, -1.0f);
  KernelLaunch launch =
      launch_of("probe", Dim3{1, 1, 1}, Dim3{48, 1, 1}, DispatchKind::ThreadGroups);
  EXPECT_THROW(run_dispatch(probe("probe_threadgroup_exchange"), launch, nullptr), Error);
  bind(launch, 0, out.data(), out.size() * 4);
  try {
    run_dispatch(probe("probe_threadgroup_exchange"), launch, nullptr);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no threadgroup memory length encoded"), std::string::npos)
        << e.what();
  }
  launch.threadgroup_memory = {{0, 100}};
  EXPECT_THROW(run_dispatch(probe("probe_threadgroup_exchange"), launch, nullptr), Error);
}

}  // namespace
}  // namespace routemm::metal_emu
