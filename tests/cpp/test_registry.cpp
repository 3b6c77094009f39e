// KernelRegistry: labels, identities, injected failures and freeze protection.
#include <gtest/gtest.h>

#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/registry.h"

using namespace routemm;

TEST(Registry, LabelsCarryConstantsInOrder) {
  const std::pair<uint32_t, int32_t> constants[] = {{700, 1}, {701, 1}, {702, 1}};
  EXPECT_EQ(pipeline_label("kernel_mul_mm_q4_0_f32", constants),
            "kernel_mul_mm_q4_0_f32|700:i1|701:i1|702:i1");
  EXPECT_EQ(pipeline_label("plain", {}), "plain");
}

TEST(Registry, EveryExpertIdPipelineResolvesWithAnIdentity) {
  const Device device(std::string("cpu"));
  KernelRegistry registry(device);
  // The origin names the clone the kernels run, as the device's "isa" property does.
  const std::string origin = "builtin_cpu:" + device.backend()->properties().at("isa");
  for (auto name : kDenseMatmulIdPipelineNames) {
    PipelinePtr pipeline = registry.get_pipeline(name);
    EXPECT_EQ(pipeline->label(), name);
    const PipelineIdentity& id = pipeline->identity();
    EXPECT_EQ(id.kernel_name, name);
    EXPECT_EQ(id.backend, "cpu");
    EXPECT_EQ(id.origin, origin);
    EXPECT_EQ(id.content_sha256.size(), 64u);
    EXPECT_EQ(registry.pipeline_identity(std::string(name)), id);
  }
  const std::pair<uint32_t, int32_t> constants[] = {{700, 2}};
  auto specialised = registry.get_pipeline("dense_matmul_id_map_distinct", constants);
  EXPECT_EQ(specialised->label(), "dense_matmul_id_map_distinct|700:i2");
  EXPECT_EQ(registry.pipeline_identity("dense_matmul_id_map_distinct|700:i2").pipeline_label,
            "dense_matmul_id_map_distinct|700:i2");
  EXPECT_THROW(registry.pipeline_identity("dense_matmul_id_map_distinct|700:x"), InvalidArgument);
  EXPECT_THROW(registry.get_pipeline("no_such_kernel"), KernelNotFound);
}

TEST(Registry, InjectedFailureIsOneShotAndNamesThePipeline) {
  KernelRegistry registry(Device(std::string("cpu")));
  registry.inject_next_pipeline_lookup_failure("dense_matmul_id_grouped_f32_f32");
  try {
    registry.get_pipeline("dense_matmul_id_grouped_f32_f32");
    FAIL() << "injected failure did not fire";
  } catch (const KernelNotFound& error) {
    EXPECT_NE(std::string(error.what()).find("dense_matmul_id_grouped_f32_f32"), std::string::npos);
  }
  EXPECT_NO_THROW(registry.get_pipeline("dense_matmul_id_grouped_f32_f32"));
}

TEST(Registry, FreezeIsOneShotAndProtectsItsPipelines) {
  Device device(std::string("cpu"));
  KernelRegistry registry(device);
  KernelRegistry other(device);
  EXPECT_NE(registry.authority_id(), other.authority_id());

  KernelDef def = device.backend()->kernels().front();
  EXPECT_NO_THROW(registry.register_kernel(def));  // allowed before any freeze
  registry.freeze_plan("dense_matmul_id", "plan-a", {def.name});
  EXPECT_NO_THROW(registry.freeze_plan("dense_matmul_id", "plan-a", {def.name}));  // idempotent
  EXPECT_THROW(registry.freeze_plan("dense_matmul_id", "plan-b", {}), InvalidArgument);
  EXPECT_EQ(registry.frozen_plan_id("dense_matmul_id"), "plan-a");
  EXPECT_TRUE(registry.is_protected(def.name));
  EXPECT_THROW(registry.register_kernel(def), InvalidArgument);
  EXPECT_NO_THROW(other.register_kernel(def));  // protection is per registry
}
