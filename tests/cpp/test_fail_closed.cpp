// Fail closed at the core's edges: checked size arithmetic, kernel argument contracts on raw
// dispatch, DLPack read-only provenance, one thread per encoder, strict pipeline labels.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "backend/common/calibration_params.h"
#include "backend/common/kernel_contracts.h"
#include "routemm/checked.h"
#include "routemm/dlpack.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/registry.h"
#include "test_support.h"

using namespace routemm;

namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

struct Fixture {
  Device device{std::string("cpu")};
  KernelRegistry registry{device};
  PipelinePtr poison = registry.get_pipeline("routemm_calibration_poison_f32");
  PipelinePtr compare = registry.get_pipeline("routemm_calibration_compare_f32");
};

// A poison dispatch of `guarded` elements over control `a` (at `offset`) and candidate `b`.
void dispatch_poison(CommandEncoder& encoder, const Pipeline& poison, const Buffer& a,
                     uint64_t offset, const Buffer& b, uint64_t guarded) {
  const kernels::CalibrationKernelParams params{guarded, guarded, 0, 0};
  const std::pair<uint32_t, KernelArg> args[] = {
      {0, KernelArg::at(a, offset)}, {1, KernelArg::of(b)}, {2, KernelArg::pod(params)}};
  encoder.dispatch(poison, args, Dim3{guarded, 1, 1}, Dim3{1, 1, 1}, DispatchKind::Threads);
}

// Host memory that the core may read but not write (a read-only mapping stands behind it in use).
Buffer read_only_buffer(const Device& device, std::vector<uint32_t>& memory) {
  auto storage =
      std::make_shared<Storage>(device.backend(), memory.data(), memory.size() * 4, false, [] {});
  return Buffer(std::move(storage), 0, memory.size() * 4, DType::U32, {memory.size()});
}

}  // namespace

TEST(Checked, ArithmeticRefusesWhatWraps) {
  EXPECT_EQ(checked_add(kMax - 1, 1, "t"), kMax);
  EXPECT_THROW(checked_add(kMax, 1, "t"), InvalidArgument);
  EXPECT_EQ(checked_mul(uint64_t{1} << 32, (uint64_t{1} << 32) - 1, "t"),
            kMax - ((1ull << 32) - 1));
  EXPECT_THROW(checked_mul(uint64_t{1} << 32, uint64_t{1} << 32, "t"), InvalidArgument);
  EXPECT_THROW(checked_product({1ull << 40, 1ull << 20, 1ull << 4}, "t"), InvalidArgument);
  EXPECT_EQ(checked_round_up(65, 64, "t"), 128u);
  EXPECT_EQ(checked_round_up(kMax - 63, 64, "t"), kMax - 63);
  EXPECT_THROW(checked_round_up(kMax - 62, 64, "t"), InvalidArgument);
}

TEST(Checked, ImpossibleAllocationIsInvalidAndHonestFailureIsOutOfMemory) {
  const Device device(std::string("cpu"));
  // The rounding to 64 bytes used to wrap to 0 here and hand out 64 bytes claiming 2^64 - 1.
  EXPECT_THROW(device.alloc(kMax, DType::U8, {}), InvalidArgument);
  EXPECT_THROW(device.alloc(kMax - 62, DType::U8, {}), InvalidArgument);
  // A size no address space allows: InvalidArgument; a possible one the host cannot back: OOM.
  EXPECT_THROW(device.alloc(uint64_t{1} << 63, DType::U8, {}), InvalidArgument);
  EXPECT_THROW(device.alloc((uint64_t{1} << 62) + 64, DType::U8, {}), OutOfMemory);
}

TEST(Checked, DlpackShapeThatOverflowsIsRefused) {
  const Device device(std::string("cpu"));
  float data[4] = {};
  int64_t shape[] = {int64_t{1} << 40, int64_t{1} << 40};
  DLManagedTensor tensor{};
  tensor.dl_tensor.data = data;
  tensor.dl_tensor.device = dlpack_device(device);
  tensor.dl_tensor.ndim = 2;
  tensor.dl_tensor.dtype = {kRoutemmDLFloat, 32, 1};
  tensor.dl_tensor.shape = shape;
  EXPECT_THROW(buffer_from_dlpack(device, &tensor), InvalidArgument);
  shape[0] = int64_t{1} << 31;
  shape[1] = int64_t{1} << 31;  // 2^62 elements: the byte size (x4) wraps
  EXPECT_THROW(buffer_from_dlpack(device, &tensor), InvalidArgument);
}

TEST(Contract, EveryBackendKernelHasOneAndRegistrationRequiresIt) {
  const Device device(std::string("cpu"));
  for (const KernelDef& def : device.backend()->kernels())
    EXPECT_NE(def.check_args, nullptr) << def.name;
  KernelRegistry registry(device);
  KernelDef def = device.backend()->kernels().front();
  def.name = "unchecked_copy";
  def.check_args = nullptr;
  EXPECT_THROW(registry.register_kernel(def), InvalidArgument);
  EXPECT_THROW(kernels::kernel_arg_contract("no_such_kernel"), Error);
}

TEST(Contract, PoisonWithAWrappingElementCountIsRefusedBeforeEncoding) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  Buffer a = f.device.alloc(64, DType::F32, {16});
  Buffer b = f.device.alloc(64, DType::F32, {16});
  const uint64_t dispatches = dispatch_count();
  // 2^62 elements: x4 wraps to 0 bytes, which the kernel used to accept and then write past 64.
  EXPECT_THROW(dispatch_poison(encoder, *f.poison, a, 0, b, uint64_t{1} << 62), InvalidArgument);
  EXPECT_THROW(dispatch_poison(encoder, *f.poison, a, 0, b, 17), InvalidArgument);  // > 64 bytes
  EXPECT_EQ(dispatch_count(), dispatches);
  EXPECT_EQ(encoder.pending_dispatches(), 0u);
  dispatch_poison(encoder, *f.poison, a, 0, b, 16);
  encoder.commit_and_wait();
  for (uint32_t word : test::download<uint32_t>(a))
    EXPECT_EQ(word, kernels::kCalibrationPoisonBits);
}

TEST(Contract, MisalignedOrReadOnlyBindingsAreRefused) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  Buffer a = f.device.alloc(64, DType::F32, {16});
  Buffer b = f.device.alloc(64, DType::F32, {16});
  EXPECT_THROW(dispatch_poison(encoder, *f.poison, a, 2, b, 4), InvalidArgument);  // not 4-aligned
  EXPECT_NO_THROW(dispatch_poison(encoder, *f.poison, a, 4, b, 4));
  std::vector<uint32_t> memory(16, 7u);
  Buffer read_only = read_only_buffer(f.device, memory);
  EXPECT_THROW(dispatch_poison(encoder, *f.poison, read_only, 0, b, 4), InvalidArgument);
  encoder.commit_and_wait();
  for (uint32_t word : memory) EXPECT_EQ(word, 7u);

  // The compare kernel reads both outputs (read-only is fine) but writes its status word.
  const kernels::CalibrationKernelParams params{4, 4, 16, 0};  // status index past 64 bytes
  const std::pair<uint32_t, KernelArg> args[] = {{0, KernelArg::of(read_only)},
                                                 {1, KernelArg::of(b)},
                                                 {2, KernelArg::of(a)},
                                                 {3, KernelArg::pod(params)}};
  EXPECT_THROW(encoder.dispatch(*f.compare, args, Dim3{4, 1, 1}, Dim3{1, 1, 1}), InvalidArgument);
}

TEST(Contract, BindingsTheKernelDoesNotTakeAreRefused) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  Buffer a = f.device.alloc(64, DType::F32, {16});
  const kernels::CalibrationKernelParams params{4, 4, 0, 0};
  const std::pair<uint32_t, KernelArg> args[] = {{0, KernelArg::of(a)},
                                                 {1, KernelArg::of(a)},
                                                 {2, KernelArg::pod(params)},
                                                 {5, KernelArg::of(a)}};
  EXPECT_THROW(encoder.dispatch(*f.poison, args, Dim3{4, 1, 1}, Dim3{1, 1, 1}), InvalidArgument);
}

TEST(Dlpack, ReadOnlySurvivesEveryRoundTrip) {
  const Device device(std::string("cpu"));
  std::vector<uint32_t> memory(4, 1u);
  const Buffer read_only = read_only_buffer(device, memory);

  DLManagedTensorVersioned* versioned = buffer_to_dlpack_versioned(read_only);
  EXPECT_EQ(versioned->version.major, 1u);
  EXPECT_NE(versioned->flags & kRoutemmDLFlagReadOnly, 0u);
  EXPECT_FALSE(buffer_from_dlpack(device, versioned).writable());

  // A legacy capsule cannot say read-only; routemm's own export keeps its provenance.
  EXPECT_FALSE(buffer_from_dlpack(device, buffer_to_dlpack(read_only)).writable());
  const Buffer writable = device.alloc(16, DType::U32, {4});
  EXPECT_TRUE(buffer_from_dlpack(device, buffer_to_dlpack(writable)).writable());
  DLManagedTensorVersioned* flagless = buffer_to_dlpack_versioned(writable);
  EXPECT_EQ(flagless->flags & kRoutemmDLFlagReadOnly, 0u);
  flagless->deleter(flagless);
}

TEST(EncoderThreads, ASecondThreadIsRefusedWhileOneHoldsTheEncoder) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  {
    const CommandEncoder::Use hold(encoder, "test");
    EXPECT_NO_THROW(encoder.memory_barrier());  // nested use by the holder is free
    bool refused = false;
    std::thread other([&] {
      try {
        encoder.commit_and_wait();
      } catch (const Error& e) {
        refused = std::string(e.what()).find("in use by another thread") != std::string::npos;
      }
    });
    other.join();
    EXPECT_TRUE(refused);
  }
  std::thread after([&] { encoder.commit_and_wait(); });  // released: any thread may take it
  after.join();
}

TEST(Labels, ParseStrictlyAndRoundTrip) {
  KernelRegistry registry(Device(std::string("cpu")));
  const std::string good = "routemm_calibration_poison_f32|700:i1|701:i-2147483648";
  EXPECT_EQ(registry.pipeline_identity(good).pipeline_label, good);
  for (const char* bad :
       {"routemm_calibration_poison_f32|-1:i1", "routemm_calibration_poison_f32|+700:i1",
        "routemm_calibration_poison_f32|700:i 1", "routemm_calibration_poison_f32|700:i+1",
        "routemm_calibration_poison_f32| 700:i1", "routemm_calibration_poison_f32|4294967996:i1",
        "routemm_calibration_poison_f32|700:i4294967297",
        "routemm_calibration_poison_f32|700:i2147483648", "routemm_calibration_poison_f32|0700:i1",
        "routemm_calibration_poison_f32|700:i-0", "routemm_calibration_poison_f32|700:i",
        "routemm_calibration_poison_f32|:i1", "routemm_calibration_poison_f32|700:i1|",
        "routemm_calibration_poison_f32|700"}) {
    EXPECT_THROW(registry.pipeline_identity(bad), InvalidArgument) << bad;
  }
}
