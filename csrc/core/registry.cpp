// KernelRegistry: lookup, labels, identities, injected failures and freeze protection.
#include "routemm/registry.h"

#include <atomic>
#include <charconv>
#include <climits>
#include <cstdint>
#include <optional>

#include "routemm/error.h"

namespace routemm {
namespace {

std::atomic<uint64_t> g_next_authority{1};

}  // namespace

uint64_t swap_next_registry_authority_id_for_testing(uint64_t next) {
  return g_next_authority.exchange(next);
}

namespace {

// The next authority id, 1 to 2^64 - 2. Exhaustion is refused, never wrapped (the reference
// panics on checked_add): a wrapped id would give a new registry an older one's authority over its
// frozen plans. The counter stays where it is, so every later attempt is refused too.
uint64_t take_authority_id() {
  uint64_t id = g_next_authority.load();
  do {
    if (id == 0 || id == UINT64_MAX) {
      throw Error("KernelRegistry: registry authority ids are exhausted (" +
                  std::to_string(UINT64_MAX - 1) + " registries were created in this process)");
    }
  } while (!g_next_authority.compare_exchange_weak(id, id + 1));
  return id;
}

}  // namespace

std::string pipeline_label(std::string_view name,
                           std::span<const std::pair<uint32_t, int32_t>> int_constants) {
  std::string label(name);
  for (const auto& [index, value] : int_constants) {
    label.append("|").append(std::to_string(index)).append(":i").append(std::to_string(value));
  }
  return label;
}

std::string pipeline_label(std::string_view name,
                           std::span<const std::pair<uint32_t, bool>> bool_constants,
                           std::span<const std::pair<uint32_t, int32_t>> int_constants) {
  std::string label(name);
  for (const auto& [index, value] : bool_constants) {
    label.append("|").append(std::to_string(index)).append(value ? ":b1" : ":b0");
  }
  return label + pipeline_label("", int_constants);
}

namespace {

// A decimal integer in `text` that must be the whole of it: an optional '-' (when `allow_minus`)
// then digits, within [min, max]. No '+', spaces or other characters.
std::optional<int64_t> parse_decimal(std::string_view text, bool allow_minus, int64_t min,
                                     int64_t max) {
  if (text.empty() || (text.front() == '-' && !allow_minus)) return std::nullopt;
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || value < min || value > max) return std::nullopt;
  return value;
}

}  // namespace

ParsedPipelineLabel parse_pipeline_label(std::string_view label) {
  const auto malformed = [&] {
    return InvalidArgument("malformed pipeline label '" + std::string(label) +
                           "' (expected name|<index>:b<0|1>...|<index>:i<value>... with u32 "
                           "indices, boolean constants first, and i32 values)");
  };
  const size_t bar = label.find('|');
  ParsedPipelineLabel parsed{label.substr(0, bar), {}, {}};
  for (size_t pos = bar; pos != std::string_view::npos;) {
    const size_t next = label.find('|', pos + 1);
    const std::string_view part =
        label.substr(pos + 1, next == std::string_view::npos ? next : next - pos - 1);
    const size_t colon = part.find(':');
    if (colon == std::string_view::npos || colon + 1 >= part.size()) throw malformed();
    const auto index = parse_decimal(part.substr(0, colon), false, 0, UINT32_MAX);
    const char kind = part[colon + 1];
    const std::string_view value_text = part.substr(colon + 2);
    if (!index) throw malformed();
    if (kind == 'b' && (value_text == "0" || value_text == "1")) {
      parsed.bool_constants.emplace_back(static_cast<uint32_t>(*index), value_text == "1");
    } else if (kind == 'i') {
      const auto value = parse_decimal(value_text, true, INT32_MIN, INT32_MAX);
      if (!value) throw malformed();
      parsed.int_constants.emplace_back(static_cast<uint32_t>(*index),
                                        static_cast<int32_t>(*value));
    } else {
      throw malformed();
    }
    pos = next;
  }
  // One spelling per identity: leading zeros, "-0" or a boolean after an integer would name the
  // same pipeline twice.
  if (pipeline_label(parsed.name, parsed.bool_constants, parsed.int_constants) != label)
    throw malformed();
  return parsed;
}

KernelRegistry::KernelRegistry(const Device& device)
    : device_(device), authority_id_(take_authority_id()) {
  for (const KernelDef& def : device_.backend()->kernels()) kernels_.emplace(def.name, def);
}

PipelinePtr KernelRegistry::get_pipeline(
    std::string_view name, std::span<const std::pair<uint32_t, int32_t>> int_constants) {
  return get_pipeline_with_constants(name, {}, int_constants);
}

PipelinePtr KernelRegistry::get_pipeline_with_constants(
    std::string_view name, std::span<const std::pair<uint32_t, bool>> bool_constants,
    std::span<const std::pair<uint32_t, int32_t>> int_constants) {
  std::lock_guard lock(mutex_);
  if (auto injected = injected_failures_.find(name); injected != injected_failures_.end()) {
    injected_failures_.erase(injected);
    throw KernelNotFound("pipeline lookup failed for '" + std::string(name) +
                         "' (injected failure)");
  }
  // Without constants the label is the name: look it up without building a string (hot path).
  if (int_constants.empty() && bool_constants.empty()) {
    if (auto cached = pipelines_.find(name); cached != pipelines_.end()) return cached->second;
  }
  std::string label = pipeline_label(name, bool_constants, int_constants);
  if (auto cached = pipelines_.find(label); cached != pipelines_.end()) return cached->second;
  auto def = kernels_.find(name);
  if (def == kernels_.end()) {
    throw KernelNotFound("kernel '" + std::string(name) + "' is not registered on backend '" +
                         device_.backend_name() + "'");
  }
  auto pipeline = std::make_shared<Pipeline>();
  pipeline->label_ = label;
  pipeline->def_ = def->second;
  pipeline->constants_.assign(int_constants.begin(), int_constants.end());
  pipeline->bool_constants_.assign(bool_constants.begin(), bool_constants.end());
  const std::string& entry =
      def->second.entry_point.empty() ? def->second.name : def->second.entry_point;
  pipeline->identity_ = PipelineIdentity{kPipelineIdentitySchemaVersion,
                                         label,
                                         def->second.name,
                                         entry,
                                         device_.backend_name(),
                                         def->second.origin,
                                         def->second.content_sha256};
  pipelines_.emplace(label, pipeline);
  return pipeline;
}

PipelineIdentity KernelRegistry::pipeline_identity(std::string_view label) {
  const ParsedPipelineLabel parsed = parse_pipeline_label(label);
  return get_pipeline_with_constants(parsed.name, parsed.bool_constants, parsed.int_constants)
      ->identity();
}

bool KernelRegistry::has_kernel(std::string_view name) const {
  std::lock_guard lock(mutex_);
  return kernels_.find(name) != kernels_.end();
}

std::optional<KernelDef> KernelRegistry::kernel_def(std::string_view name) const {
  std::lock_guard lock(mutex_);
  const auto it = kernels_.find(name);
  if (it == kernels_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> KernelRegistry::kernel_names() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, def] : kernels_) names.push_back(name);
  return names;
}

void KernelRegistry::inject_next_pipeline_lookup_failure(std::string name) {
  std::lock_guard lock(mutex_);
  injected_failures_.insert(std::move(name));
}

void KernelRegistry::register_kernel(KernelDef def) {
  std::lock_guard lock(mutex_);
  if (protected_.count(def.name) != 0) {
    throw InvalidArgument("kernel '" + def.name +
                          "' is protected by a frozen route plan and cannot be re-registered");
  }
  if (def.fn == nullptr) throw InvalidArgument("kernel '" + def.name + "' has no entry point");
  if (def.check_args == nullptr)
    throw InvalidArgument("kernel '" + def.name + "' has no argument contract");
  for (auto it = pipelines_.begin(); it != pipelines_.end();) {
    it = it->second->kernel_name() == def.name ? pipelines_.erase(it) : std::next(it);
  }
  kernels_.insert_or_assign(def.name, std::move(def));
}

void KernelRegistry::register_source(const std::string& name, const std::string& source) {
  if (is_protected(name)) {
    throw InvalidArgument("kernel '" + name +
                          "' is protected by a frozen route plan and cannot be re-registered");
  }
  KernelDef def = device_.backend()->compile_kernel_source(name, source);
  def.name = name;
  register_kernel(std::move(def));
}

void KernelRegistry::freeze_plan(const std::string& plan_kind, const std::string& plan_id,
                                 const std::vector<std::string>& protected_names,
                                 std::string plan_document, std::any dispatch_table) {
  std::lock_guard lock(mutex_);
  if (plan_id.empty()) throw InvalidArgument(plan_kind + " route plan needs a non-empty id");
  if (auto frozen = frozen_plans_.find(plan_kind); frozen != frozen_plans_.end()) {
    if (frozen->second.id == plan_id) return;
    throw InvalidArgument(plan_kind + " route plan is already frozen as " + frozen->second.id);
  }
  frozen_plans_.emplace(plan_kind,
                        FrozenPlan{plan_id, std::move(plan_document), std::move(dispatch_table)});
  protected_.insert(protected_names.begin(), protected_names.end());
}

std::optional<std::string> KernelRegistry::frozen_plan_id(const std::string& plan_kind) const {
  std::lock_guard lock(mutex_);
  if (auto frozen = frozen_plans_.find(plan_kind); frozen != frozen_plans_.end())
    return frozen->second.id;
  return std::nullopt;
}

std::optional<std::string> KernelRegistry::frozen_plan_document(
    const std::string& plan_kind) const {
  std::lock_guard lock(mutex_);
  if (auto frozen = frozen_plans_.find(plan_kind); frozen != frozen_plans_.end())
    return frozen->second.document;
  return std::nullopt;
}

std::any KernelRegistry::frozen_plan_table(const std::string& plan_kind) const {
  std::lock_guard lock(mutex_);
  if (auto frozen = frozen_plans_.find(plan_kind); frozen != frozen_plans_.end())
    return frozen->second.table;
  return {};
}

bool KernelRegistry::is_protected(std::string_view name) const {
  std::lock_guard lock(mutex_);
  return protected_.find(name) != protected_.end();
}

}  // namespace routemm
