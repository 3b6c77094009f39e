// KernelRegistry: pipelines by name and specialisation constants, with identities, a test hook for
// lookup failures, and freeze protection for route plans.
//
// A registry belongs to one device. A pipeline's label is its name followed by `|<index>:b0` or
// `|<index>:b1` for each boolean constant, then `|<index>:i<value>` for each integer constant, in
// the order given (`kernel_mul_mm_q4_0_f32|700:i1|701:i1|702:i1`); the label is the cache key, the
// receipt value and the plan key. Distinct constant sets are distinct pipelines. "Frozen" means: once a route plan of
// some kind has been installed, that kind can never be installed again with a different plan id,
// and the kernels the plan depends on can no longer be re-registered in this registry.
#pragma once

#include <any>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "routemm/backend.h"
#include "routemm/device.h"

namespace routemm {

inline constexpr uint32_t kPipelineIdentitySchemaVersion = 2;

struct PipelineIdentity {
  uint32_t schema_version = kPipelineIdentitySchemaVersion;
  std::string pipeline_label;
  std::string kernel_name;  // the label up to the first '|'
  std::string entry_point;  // the backend kernel behind the name (KernelDef::entry_point)
  std::string backend;
  std::string origin;          // KernelDef::origin
  std::string content_sha256;  // KernelDef::content_sha256
  bool operator==(const PipelineIdentity&) const = default;
};

class Pipeline {
 public:
  const std::string& label() const { return label_; }
  const std::string& kernel_name() const { return def_.name; }
  const KernelDef& def() const { return def_; }
  const std::vector<std::pair<uint32_t, int32_t>>& int_constants() const { return constants_; }
  const std::vector<std::pair<uint32_t, bool>>& bool_constants() const { return bool_constants_; }
  uint64_t max_total_threads_per_threadgroup() const { return def_.max_threads_per_threadgroup; }
  const PipelineIdentity& identity() const { return identity_; }

 private:
  friend class KernelRegistry;
  std::string label_;
  KernelDef def_;
  std::vector<std::pair<uint32_t, int32_t>> constants_;
  std::vector<std::pair<uint32_t, bool>> bool_constants_;
  PipelineIdentity identity_;
};

using PipelinePtr = std::shared_ptr<const Pipeline>;

std::string pipeline_label(std::string_view name,
                           std::span<const std::pair<uint32_t, int32_t>> int_constants);
std::string pipeline_label(std::string_view name,
                           std::span<const std::pair<uint32_t, bool>> bool_constants,
                           std::span<const std::pair<uint32_t, int32_t>> int_constants);
// A label read back into its name and constants (the name views the label).
struct ParsedPipelineLabel {
  std::string_view name;
  std::vector<std::pair<uint32_t, bool>> bool_constants;
  std::vector<std::pair<uint32_t, int32_t>> int_constants;
};
// The inverse of pipeline_label, strictly: `label` must be exactly what pipeline_label writes for
// some name and constants (decimal u32 indices, booleans before integers, decimal i32 values, no
// signs but a value's '-', no spaces or leading zeros); anything else is InvalidArgument.
ParsedPipelineLabel parse_pipeline_label(std::string_view label);

// Test hook: sets the id the next KernelRegistry takes and returns the one it replaces (to reach
// the counter's exhaustion in a test).
uint64_t swap_next_registry_authority_id_for_testing(uint64_t next);

class KernelRegistry {
 public:
  explicit KernelRegistry(const Device& device);

  const Device& device() const { return device_; }
  // Process-unique id of this registry (the "activation authority" plans are bound to).
  uint64_t authority_id() const { return authority_id_; }

  PipelinePtr get_pipeline(std::string_view name,
                           std::span<const std::pair<uint32_t, int32_t>> int_constants = {});
  // Boolean and integer specialisation constants; the label lists the booleans first.
  PipelinePtr get_pipeline_with_constants(
      std::string_view name, std::span<const std::pair<uint32_t, bool>> bool_constants,
      std::span<const std::pair<uint32_t, int32_t>> int_constants);
  // Identity of a pipeline by label, resolving it if needed.
  PipelineIdentity pipeline_identity(std::string_view label);
  bool has_kernel(std::string_view name) const;
  // The definition registered under `name` (a copy), or nullopt. Resolves nothing.
  std::optional<KernelDef> kernel_def(std::string_view name) const;
  std::vector<std::string> kernel_names() const;

  // Test hook: the next lookup of `name` fails with an error naming it (one-shot).
  void inject_next_pipeline_lookup_failure(std::string name);

  // Replaces (or adds) the kernel registered under def.name and drops its cached pipelines.
  // Fails once a frozen plan protects that name.
  void register_kernel(KernelDef def);
  // Compiles `source` with the backend's compiler and registers the result under `name`, like
  // register_kernel. A protected name is refused first; a backend that compiles no source at run
  // time (Backend::compile_kernel_source) refuses with a message naming it.
  void register_source(const std::string& name, const std::string& source);

  // Installs a plan of `plan_kind` with `plan_id` (and its serialised form, kept verbatim),
  // protecting `protected_names` from re-registration. `dispatch_table` is the plan's decoded form
  // for the C++ dispatchers (an op's own type, e.g. a shared_ptr to DenseQ4PlanRoutes), kept
  // unchanged for the registry's life. Re-freezing the same id is a no-op (the first table stays);
  // a different id is an error.
  void freeze_plan(const std::string& plan_kind, const std::string& plan_id,
                   const std::vector<std::string>& protected_names, std::string plan_document = {},
                   std::any dispatch_table = {});
  std::optional<std::string> frozen_plan_id(const std::string& plan_kind) const;
  std::optional<std::string> frozen_plan_document(const std::string& plan_kind) const;
  // The dispatch table frozen with the plan of `plan_kind` (empty when none was given).
  std::any frozen_plan_table(const std::string& plan_kind) const;
  bool is_protected(std::string_view name) const;

 private:
  Device device_;
  uint64_t authority_id_;
  mutable std::mutex mutex_;
  std::map<std::string, KernelDef, std::less<>> kernels_;
  std::map<std::string, PipelinePtr, std::less<>> pipelines_;
  std::multiset<std::string, std::less<>> injected_failures_;
  struct FrozenPlan {
    std::string id;
    std::string document;
    std::any table;
  };
  std::map<std::string, FrozenPlan> frozen_plans_;
  std::set<std::string, std::less<>> protected_;
};

}  // namespace routemm
