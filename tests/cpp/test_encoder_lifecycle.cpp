// CommandEncoder lifecycle (async commit, wait, labels, counters, drop), tracked dispatches and the
// automatic-barrier tracker, op kinds, and CapturedGraph replay / reorder / dependencies, on the
// CPU backend with probe kernels registered for the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/graph.h"
#include "routemm/registry.h"

using namespace routemm;

namespace {

// What the probe kernels see: a gate to wait on, a log of who ran, a failure switch.
struct Probe {
  std::atomic<bool> open{true};
  std::atomic<bool> gate_timed_out{false};
  std::mutex mutex;
  std::vector<uint32_t> ran;
};

struct ProbeArgs {
  Probe* probe;
  uint32_t id;
  uint32_t fail;
};

void probe_kernel(const KernelLaunch& launch, void*) {
  ProbeArgs args{};
  std::memcpy(&args, launch.args[0].data, sizeof args);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!args.probe->open.load()) {
    if (std::chrono::steady_clock::now() > deadline) {
      args.probe->gate_timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (args.fail) throw Error("probe kernel " + std::to_string(args.id) + " failed on purpose");
  const std::lock_guard lock(args.probe->mutex);
  args.probe->ran.push_back(args.id);
}

void probe_contract(const KernelLaunch& launch) {
  if (launch.args[0].kind != BoundArg::Kind::Bytes || launch.args[0].size != sizeof(ProbeArgs))
    throw InvalidArgument("'" + launch.label + "': slot 0 must hold the probe arguments");
}

struct Fixture {
  Device device{std::string("cpu")};
  KernelRegistry registry{device};
  PipelinePtr probe_pipeline;
  Probe probe;

  Fixture() {
    KernelDef def;
    def.name = "test_probe";
    def.fn = probe_kernel;
    def.check_args = probe_contract;
    registry.register_kernel(def);
    probe_pipeline = registry.get_pipeline("test_probe");
  }

  void dispatch(CommandEncoder& encoder, uint32_t id, bool fail = false) {
    const ProbeArgs args{&probe, id, fail ? 1u : 0u};
    const std::pair<uint32_t, KernelArg> bound[] = {{0, KernelArg::pod(args)}};
    encoder.dispatch(*probe_pipeline, bound, Dim3{}, Dim3{});
  }

  // A probe dispatch that declares `reads` and `writes` (buffers it does not touch).
  void tracked(CommandEncoder& encoder, uint32_t id, std::vector<Buffer> reads,
               std::vector<Buffer> writes) {
    const ProbeArgs args{&probe, id, 0};
    const std::pair<uint32_t, KernelArg> bound[] = {{0, KernelArg::pod(args)}};
    encoder.dispatch_tracked(*probe_pipeline, bound, Dim3{}, Dim3{}, DispatchKind::ThreadGroups, {},
                             reads, writes);
  }

  std::vector<uint32_t> ran() {
    const std::lock_guard lock(probe.mutex);
    return probe.ran;
  }
};

}  // namespace

TEST(EncoderLifecycle, CommitReturnsBeforeTheWorkRunsAndWaitSeesItDone) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  f.probe.open = false;
  f.dispatch(encoder, 1);
  f.dispatch(encoder, 2);
  encoder.commit();  // would not return while the gate is closed if it ran the work itself
  EXPECT_TRUE(f.ran().empty());
  f.probe.open = true;
  encoder.wait_until_completed();
  EXPECT_FALSE(f.probe.gate_timed_out.load());
  EXPECT_EQ(f.ran(), (std::vector<uint32_t>{1, 2}));
}

TEST(EncoderLifecycle, SubmissionsRunInCommitOrderAndTheEncoderKeepsRecording) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  f.dispatch(encoder, 1);
  encoder.commit();
  f.dispatch(encoder, 2);
  encoder.commit_labeled("second");
  f.dispatch(encoder, 3);
  encoder.commit_and_wait_labeled("third");
  EXPECT_EQ(f.ran(), (std::vector<uint32_t>{1, 2, 3}));
}

TEST(EncoderLifecycle, ErrorsSurfaceAtTheWaitNotAtCommit) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  f.dispatch(encoder, 1, /*fail=*/true);
  f.dispatch(encoder, 2);  // same submission: not run after the failure
  EXPECT_NO_THROW(encoder.commit());
  f.dispatch(encoder, 3);  // a later submission still runs
  EXPECT_NO_THROW(encoder.commit());
  try {
    encoder.wait_until_completed();
    FAIL() << "the failure did not surface at the wait";
  } catch (const CommandBufferError& e) {
    EXPECT_NE(std::string(e.what()).find("probe kernel 1 failed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(f.ran(), (std::vector<uint32_t>{3}));
  EXPECT_NO_THROW(encoder.wait_until_completed());  // reported once
}

TEST(EncoderLifecycle, DroppingAnEncoderNeverRunsItsUncommittedWork) {
  Fixture f;
  {
    CommandEncoder encoder = f.device.command_encoder();
    f.dispatch(encoder, 1);
    f.dispatch(encoder, 2);
  }
  {
    CommandEncoder encoder = f.device.command_encoder();
    f.dispatch(encoder, 3);
    encoder.commit();
    f.dispatch(encoder, 4);  // recorded after the commit: dropped
  }  // waits for submission 3 before its storages go
  CommandEncoder flush = f.device.command_encoder();
  flush.commit_and_wait();
  EXPECT_EQ(f.ran(), (std::vector<uint32_t>{3}));
}

TEST(EncoderLifecycle, CountersFollowTheSpec) {
  Fixture f;
  reset_encoder_counters();
  CommandEncoder encoder = f.device.command_encoder();
  EXPECT_EQ(encoder_counters().encoders_created, 1u);
  EXPECT_EQ(encoder_counters().command_buffers, 1u);  // owned from creation
  f.dispatch(encoder, 1);
  encoder.commit();
  EXPECT_EQ(encoder_counters().commits, 1u);
  EXPECT_EQ(encoder_counters().command_buffers, 2u);  // the next one
  EXPECT_EQ(encoder_counters().waits, 0u);
  encoder.wait_until_completed();
  const EncoderCounters c = encoder_counters();
  EXPECT_EQ(c.waits, 1u);
  EXPECT_EQ(c.host_waits, 1u);
  EXPECT_EQ(c.dispatches, 1u);
  EXPECT_EQ(c.streams_created, 0u);
  EXPECT_EQ(c.device_allocations, 0u);
}

TEST(EncoderLifecycle, LabelsAreStrict) {
  Fixture f;
  CommandEncoder encoder = f.device.command_encoder();
  const uint64_t commits = encoder_counters().commits;
  EXPECT_THROW(encoder.commit_labeled(""), InvalidArgument);
  EXPECT_THROW(encoder.commit_labeled(std::string(257, 'a')), InvalidArgument);
  EXPECT_THROW(encoder.commit_and_wait_labeled("two\nlines"), InvalidArgument);
  EXPECT_EQ(encoder_counters().commits, commits);  // refused before committing
  EXPECT_NO_THROW(encoder.commit_labeled(std::string(256, 'a')));
  encoder.wait_until_completed();
}

TEST(EncoderLifecycle, CpuBackendHasNoStreams) {
  Fixture f;
  EXPECT_THROW(f.device.command_encoder(EncoderOptions{uint64_t{7}, std::nullopt}),
               InvalidArgument);
}

TEST(AutoBarrier, OnlyConflictingTrackedDispatchesGetABarrier) {
  Fixture f;
  Buffer a = f.device.alloc(64, DType::U8, {64});
  Buffer b = f.device.alloc(64, DType::U8, {64});
  CommandEncoder encoder = f.device.command_encoder(EncoderOptions{std::nullopt, true});
  ASSERT_TRUE(encoder.auto_barrier());
  const uint64_t barriers = encoder_counters().barriers;
  f.tracked(encoder, 1, {a}, {b.view(0, 32, DType::U8, {32})});
  f.tracked(encoder, 2, {a}, {b.view(32, 32, DType::U8, {32})});  // disjoint writes, shared reads
  EXPECT_EQ(encoder_counters().barriers, barriers);
  f.tracked(encoder, 3, {b.view(0, 8, DType::U8, {8})}, {a});  // RAW on b and WAR on a
  EXPECT_EQ(encoder_counters().barriers, barriers + 1);
  f.tracked(encoder, 4, {},
            {b.view(40, 8, DType::U8, {8})});  // tracker restarted at 3: no conflict
  EXPECT_EQ(encoder_counters().barriers, barriers + 1);
  f.tracked(encoder, 5, {}, {b.view(44, 8, DType::U8, {8})});  // WAW with 4
  EXPECT_EQ(encoder_counters().barriers, barriers + 2);
  f.dispatch(encoder, 6);  // untracked: a barrier before it...
  EXPECT_EQ(encoder_counters().barriers, barriers + 3);
  f.tracked(encoder, 7, {}, {a});  // ...and one after it
  EXPECT_EQ(encoder_counters().barriers, barriers + 4);
  encoder.force_barrier_and_reset_tracker();
  EXPECT_EQ(encoder_counters().barriers, barriers + 5);
  f.tracked(encoder, 8, {}, {a});  // nothing is tracked after the forced barrier
  EXPECT_EQ(encoder_counters().barriers, barriers + 5);
  encoder.set_auto_barrier(false);
  f.tracked(encoder, 9, {}, {a});
  f.tracked(encoder, 10, {}, {a});
  EXPECT_EQ(encoder_counters().barriers, barriers + 5);
  encoder.commit_and_wait();
  EXPECT_EQ(f.ran().size(), 10u);
}

TEST(Capture, TrackedListsAndOpKindsReachTheNodes) {
  Fixture f;
  Buffer a = f.device.alloc(64, DType::U8, {64});
  Buffer b = f.device.alloc(64, DType::U8, {64});
  CommandEncoder encoder = f.device.command_encoder();
  encoder.start_capture();
  encoder.set_op_kind(OpKind::Softmax);
  f.tracked(encoder, 1, {a.view(8, 8, DType::U8, {8})}, {b});
  f.dispatch(encoder, 2);
  const auto nodes = encoder.take_capture().value();
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].op_kind, OpKind::Softmax);
  EXPECT_EQ(nodes[1].op_kind, OpKind::Other);  // the tag applies to one dispatch
  EXPECT_EQ(nodes[0].reads, (std::vector<ByteRange>{{a.address() + 8, a.address() + 16}}));
  EXPECT_EQ(nodes[0].writes, (std::vector<ByteRange>{{b.address(), b.address() + 64}}));
  EXPECT_TRUE(f.ran().empty());
  EXPECT_EQ(op_kind_from_string("sdpa"), OpKind::Sdpa);
  EXPECT_THROW(op_kind_from_string("matmul"), InvalidArgument);
  EXPECT_FALSE(is_reorderable(OpKind::Sdpa));
  EXPECT_TRUE(is_reorderable(OpKind::ElemAdd));
}

namespace {

// A capture of probe dispatches: id i reads `reads[i]` and writes `writes[i]` (buffer indices).
struct GraphCase {
  Fixture f;
  std::vector<Buffer> buffers;
  GraphCase() {
    for (int i = 0; i < 4; ++i) buffers.push_back(f.device.alloc(64, DType::U8, {64}));
  }
  CapturedGraph capture(const std::vector<std::pair<std::vector<int>, std::vector<int>>>& rw,
                        const std::vector<size_t>& barriers_after = {},
                        const std::vector<OpKind>& kinds = {}) {
    CommandEncoder encoder = f.device.command_encoder();
    encoder.start_capture();
    for (size_t i = 0; i < rw.size(); ++i) {
      std::vector<Buffer> r, w;
      for (int x : rw[i].first) r.push_back(buffers[x]);
      for (int x : rw[i].second) w.push_back(buffers[x]);
      if (i < kinds.size()) encoder.set_op_kind(kinds[i]);
      f.tracked(encoder, static_cast<uint32_t>(i), r, w);
      if (std::find(barriers_after.begin(), barriers_after.end(), i) != barriers_after.end())
        encoder.memory_barrier();
    }
    return CapturedGraph(encoder.take_capture().value());
  }
  std::vector<uint32_t> order(const CapturedGraph& g) {
    std::vector<uint32_t> ids;
    for (const auto& n : g.nodes()) {
      if (n.kind == CapturedNode::Kind::Dispatch) {
        ProbeArgs args{};
        std::memcpy(&args, n.command->launch.args[0].data, sizeof args);
        ids.push_back(args.id);
      }
    }
    return ids;
  }
};

}  // namespace

TEST(CapturedGraph, BarriersOnlyWhereRangesConflict) {
  GraphCase c;
  // 0: b0 -> b1; 1: b0 -> b2 (independent); 2: b1 -> b3 (RAW on 0); 3: b2 -> b0 (WAR on 0 and 1,
  // which the barrier before 2 already orders; RAW on 1 likewise). The graph's edges say the same
  // without barriers: 3 after 0 and 1, 2 after 0.
  const CapturedGraph g = c.capture({{{0}, {1}}, {{0}, {2}}, {{1}, {3}}, {{2}, {0}}});
  EXPECT_EQ(g.barriers_before(), (std::vector<bool>{false, false, true, false}));
  const auto deps = g.dependencies();
  EXPECT_EQ(deps[0], (std::vector<size_t>{}));
  EXPECT_EQ(deps[1], (std::vector<size_t>{}));
  EXPECT_EQ(deps[2], (std::vector<size_t>{0}));
  EXPECT_EQ(deps[3], (std::vector<size_t>{0, 1}));
  CommandEncoder encoder = c.f.device.command_encoder();
  const uint64_t barriers = encoder_counters().barriers;
  g.encode_with_barriers(encoder);
  EXPECT_EQ(encoder_counters().barriers, barriers + 1);
  encoder.commit_and_wait();
  EXPECT_EQ(c.f.ran(), (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(g.instantiate(*c.f.device.backend()), nullptr);  // no graph object on the CPU
}

TEST(CapturedGraph, RecordedBarriersAndUnknownRangesOrderEverything) {
  GraphCase c;
  const CapturedGraph g = c.capture({{{0}, {1}}, {{0}, {2}}, {{0}, {3}}, {{3}, {}}, {{0}, {1}}},
                                    /*barriers_after=*/{0});
  // nodes: d0, barrier, d1, d2, d3 (no writes: unknown), d4
  EXPECT_EQ(g.barriers_before(), (std::vector<bool>{false, false, false, false, true, true}));
  const auto deps = g.dependencies();
  EXPECT_EQ(deps[1], (std::vector<size_t>{0}));
  EXPECT_EQ(deps[2], (std::vector<size_t>{0}));
  EXPECT_EQ(deps[3], (std::vector<size_t>{1, 2}));
  EXPECT_EQ(deps[4], (std::vector<size_t>{3}));
  try {
    (void)g.reordered();
    FAIL() << "a dispatch without write ranges was reordered";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("complete hazard ranges"), std::string::npos);
  }
}

TEST(CapturedGraph, ReorderPullsIndependentDispatchesForwardAndStopsAtSdpa) {
  GraphCase c;
  // 0: b0 -> b1; 1: b1 -> b2 (needs 0); 2: b0 -> b3 (independent: joins 0's group)
  const CapturedGraph g = c.capture({{{0}, {1}}, {{1}, {2}}, {{0}, {3}}});
  const CapturedGraph r = g.reordered();
  EXPECT_EQ(c.order(r), (std::vector<uint32_t>{0, 2, 1}));
  EXPECT_EQ(r.barriers_before(), (std::vector<bool>{false, false, true}));
  // A dispatch reading what a skipped one writes stays behind it.
  const CapturedGraph chain = c.capture({{{0}, {1}}, {{1}, {2}}, {{2}, {3}}});
  EXPECT_EQ(c.order(chain.reordered()), (std::vector<uint32_t>{0, 1, 2}));
  // A non-reorderable dispatch ends the lookahead.
  const CapturedGraph sdpa =
      c.capture({{{0}, {1}}, {{1}, {2}}, {{0}, {3}}}, {}, {OpKind::Other, OpKind::Sdpa});
  EXPECT_EQ(c.order(sdpa.reordered()), (std::vector<uint32_t>{0, 1, 2}));
  CommandEncoder encoder = c.f.device.command_encoder();
  r.encode_with_barriers(encoder);
  encoder.commit_and_wait();
  EXPECT_EQ(c.f.ran(), (std::vector<uint32_t>{0, 2, 1}));
}

TEST(CapturedGraph, SessionReplaysOnFinish) {
  GraphCase c;
  CommandEncoder encoder = c.f.device.command_encoder();
  GraphSession session(encoder);
  c.f.tracked(session.encoder(), 5, {c.buffers[0]}, {c.buffers[1]});
  EXPECT_TRUE(c.f.ran().empty());
  session.finish_with_reorder();
  EXPECT_EQ(c.f.ran(), (std::vector<uint32_t>{5}));
  EXPECT_FALSE(encoder.is_capturing());
}
