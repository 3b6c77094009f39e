// CommandEncoder: barriers, capture nodes and ranges, receipts, counters.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/common/calibration_params.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/registry.h"

using namespace routemm;

namespace {

struct Fixture {
  Device device{std::string("cpu")};
  KernelRegistry registry{device};
  PipelinePtr map = registry.get_pipeline("dense_matmul_id_map_distinct");
  PipelinePtr poison = registry.get_pipeline("routemm_calibration_poison_f32");
};

}  // namespace

TEST(Encoder, BarrierBeforeAnyDispatchIsANoOpButIsCaptured) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  const uint64_t before = encoder_counters().barriers;
  encoder.memory_barrier();
  EXPECT_EQ(encoder_counters().barriers, before);
  encoder.start_capture();
  encoder.memory_barrier();
  auto nodes = encoder.take_capture();
  ASSERT_TRUE(nodes.has_value());
  ASSERT_EQ(nodes->size(), 1u);
  EXPECT_EQ((*nodes)[0].kind, CapturedNode::Kind::Barrier);
  EXPECT_FALSE(encoder.take_capture().has_value());  // capture ended
}

TEST(Encoder, CaptureRecordsBindingsAndPendingRangesWithoutExecuting) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  Buffer a = f.device.alloc(64, DType::U32, {16});
  Buffer b = f.device.alloc(64, DType::U32, {16});
  const kernels::CalibrationKernelParams params{2, 2, 0, 0};
  encoder.start_capture();
  encoder.set_pending_buffer_ranges({{1, 2}}, {{3, 4}});
  const std::pair<uint32_t, KernelArg> args[] = {
      {2, KernelArg::pod(params)}, {0, KernelArg::at(a, 8)}, {1, KernelArg::of(b)}};
  const uint64_t dispatches = dispatch_count();
  encoder.dispatch(*f.poison, args, Dim3{2, 1, 1}, Dim3{2, 1, 1}, DispatchKind::Threads);
  EXPECT_EQ(dispatch_count(), dispatches + 1);
  encoder.dispatch(*f.poison, args, Dim3{2, 1, 1}, Dim3{2, 1, 1}, DispatchKind::Threads);
  auto nodes = encoder.take_capture().value();
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].dispatch.pipeline_label, "routemm_calibration_poison_f32");
  EXPECT_EQ(nodes[0].reads, (std::vector<ByteRange>{{1, 2}}));
  EXPECT_EQ(nodes[0].writes, (std::vector<ByteRange>{{3, 4}}));
  EXPECT_TRUE(nodes[1].reads.empty());  // pending ranges apply to one dispatch only
  ASSERT_EQ(nodes[0].bindings.size(), 3u);
  EXPECT_TRUE(nodes[0].bindings[0].is_bytes);
  EXPECT_EQ(nodes[0].bindings[1].address, a.address());
  EXPECT_EQ(nodes[0].bindings[1].offset, 8u);
  EXPECT_EQ(encoder.pending_dispatches(), 0u);  // nothing reached the queue
}

TEST(Encoder, ReceiptRulesAndCapacity) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  EXPECT_THROW(encoder.take_encoded_dispatch_receipt(), InvalidArgument);
  EXPECT_THROW(encoder.start_encoded_dispatch_receipt(0), InvalidArgument);
  encoder.start_capture();
  EXPECT_THROW(encoder.start_encoded_dispatch_receipt(2), InvalidArgument);
  encoder.take_capture();
  encoder.start_encoded_dispatch_receipt(1);
  EXPECT_THROW(encoder.start_capture(), InvalidArgument);
  EXPECT_THROW(encoder.start_encoded_dispatch_receipt(1), InvalidArgument);
  EXPECT_EQ(encoder.receipt_slots_left(), 1u);
}

TEST(Encoder, GpuTimeIsAnOrderedInterval) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  const GpuInterval t = encoder.commit_wait_with_gpu_time();
  EXPECT_TRUE(std::isfinite(t.start_s) && std::isfinite(t.end_s));
  EXPECT_GE(t.end_s, t.start_s);
}

TEST(Encoder, BuffersOfAnotherBackendAreRefused) {
  // Every buffer here is on cpu; a buffer with no storage stands in for a foreign one.
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  const std::pair<uint32_t, KernelArg> args[] = {{1, KernelArg::of(Buffer())}};
  const uint64_t dispatches = dispatch_count();
  EXPECT_THROW(encoder.dispatch(*f.map, args, Dim3{}, Dim3{}), InvalidArgument);
  EXPECT_EQ(dispatch_count(), dispatches);
}
