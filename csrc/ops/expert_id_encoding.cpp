// Dispatch sequences shared by the expert-ID matmul front doors (see expert_id_encoding.h).
#include "ops/expert_id_encoding.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "routemm/error.h"
#include "routemm/ops/quantized_matmul_id.h"

namespace routemm::expert_id {
namespace {

ByteRange logical_range(const Buffer& buffer) {
  const auto [start, end] = buffer.logical_range();
  return {start, end};
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

DenseMatmulIdScratch::MapKey map_key(const Buffer& expert_ids,
                                     const kernels::DenseMatmulIdKernelParams& gpu) {
  const auto [start, end] = expert_ids.logical_range();
  return {start, end, gpu.m, gpu.top_k, gpu.n_experts};
}

}  // namespace

uint32_t dispatch_count(bool grouped, DenseMatmulIdMapUse map) {
  return grouped && map == DenseMatmulIdMapUse::Build ? 2 : 1;
}

void check_map_use(std::string_view op, DenseMatmulIdMapUse map, bool grouped,
                   const DenseMatmulIdScratch* scratch, const Buffer& expert_ids,
                   const kernels::DenseMatmulIdKernelParams& gpu) {
  if (map == DenseMatmulIdMapUse::Build) return;
  if (!grouped) {
    throw InvalidArgument(std::string(op) + " map reuse needs a grouped route (direct has no map)");
  }
  // The front doors validate the scratch before this check; a grouped call always has one.
  const std::optional<DenseMatmulIdScratch::MapKey> built = scratch->map_key();
  if (!built) throw InvalidArgument(std::string(op) + " map reuse: the scratch holds no map");
  const DenseMatmulIdScratch::MapKey wanted = map_key(expert_ids, gpu);
  if (*built != wanted) {
    throw InvalidArgument(
        std::string(op) + " map reuse: the scratch's map was built from other ids (m/top_k/E " +
        std::to_string(built->m) + "/" + std::to_string(built->top_k) + "/" +
        std::to_string(built->n_experts) + ", this call " + std::to_string(wanted.m) + "/" +
        std::to_string(wanted.top_k) + "/" + std::to_string(wanted.n_experts) +
        (built->ids_start == wanted.ids_start && built->ids_end == wanted.ids_end
             ? ")"
             : ", another ids view)"));
  }
}

kernels::DenseMatmulIdKernelParams kernel_params(std::string_view op, uint32_t m, uint32_t n,
                                                 uint32_t k, uint32_t top_k, uint32_t n_experts,
                                                 uint64_t expert_stride_bytes,
                                                 DenseMatmulIdInputLayout input_layout) {
  const uint64_t row_bytes = uint64_t{k} * 4;
  kernels::DenseMatmulIdKernelParams gpu{};
  gpu.m = m;
  gpu.n = n;
  gpu.k = k;
  gpu.top_k = top_k;
  gpu.n_experts = n_experts;
  gpu.expert_stride_bytes = expert_stride_bytes;
  if (input_layout == DenseMatmulIdInputLayout::SharedPerToken) {
    gpu.input_layout = kernels::kInputSharedPerToken;
    gpu.input_token_stride_bytes = row_bytes;
    gpu.input_slot_stride_bytes = 0;
  } else {
    if (top_k != 0 && row_bytes > std::numeric_limits<uint64_t>::max() / top_k) {
      throw InvalidArgument(std::string(op) + " slotted input token stride byte extent overflow");
    }
    gpu.input_layout = kernels::kInputSlotted;
    gpu.input_token_stride_bytes = row_bytes * top_k;
    gpu.input_slot_stride_bytes = row_bytes;
  }
  return gpu;
}

void check_encoder(std::string_view op, std::string_view route, const CommandEncoder& encoder,
                   const KernelRegistry& registry, const Buffer& weights, uint32_t dispatches) {
  if (registry.device().backend() != encoder.backend() || weights.backend() != encoder.backend()) {
    throw InvalidArgument(
        std::string(op) +
        " encoder, registry and buffers must belong to one device (encoder/device mismatch)");
  }
  if (encoder.receipt_slots_left() < dispatches) {
    throw InvalidArgument(std::string(op) + " open dispatch receipt has room for " +
                          std::to_string(encoder.receipt_slots_left()) + " dispatches, the " +
                          std::string(route) + " route needs " + std::to_string(dispatches));
  }
}

MapLaunch map_launch(const KernelDef& map, uint32_t n_experts) {
  MapLaunch launch;
  const uint64_t threads = map.threads_per_group > 1 ? map.threads_per_group : uint64_t{n_experts};
  launch.threads = Dim3{threads, 1, 1};
  if (map.threadgroup_memory_bytes != 0) launch.shmem.emplace_back(0, map.threadgroup_memory_bytes);
  return launch;
}

void encode_direct(CommandEncoder& encoder, KernelRegistry& registry,
                   std::string_view pipeline_name, const kernels::DenseMatmulIdKernelParams& gpu,
                   const Buffers& b) {
  const PipelinePtr pipeline = registry.get_pipeline(pipeline_name);
  const KernelDef& def = pipeline->def();
  if (encoder.is_capturing()) {
    encoder.set_pending_buffer_ranges(
        {logical_range(b.weights), logical_range(b.input), logical_range(b.expert_ids)},
        {logical_range(b.output)});
  }
  const std::pair<uint32_t, KernelArg> args[] = {{0, KernelArg::pod(gpu)},
                                                 {1, KernelArg::of(b.weights)},
                                                 {2, KernelArg::of(b.input)},
                                                 {3, KernelArg::of(b.expert_ids)},
                                                 {4, KernelArg::of(b.output)}};
  const uint64_t total_rows = uint64_t{gpu.m} * gpu.top_k;
  std::vector<std::pair<uint64_t, uint64_t>> shmem;
  if (def.threadgroup_memory_bytes != 0) shmem.emplace_back(0, def.threadgroup_memory_bytes);
  // The Q8_0 nr2 pipeline's threadgroup is [32, 4, 1], as the dense nr2 mat-vec's.
  const Dim3 threads = pipeline_name == kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline
                           ? Dim3{32, def.threads_per_group / 32, 1}
                           : Dim3{def.threads_per_group, 1, 1};
  encoder.dispatch(*pipeline, args, Dim3{ceil_div(gpu.n, def.tile_x), total_rows, 1}, threads,
                   DispatchKind::ThreadGroups, std::move(shmem));
}

void encode_grouped(std::string_view op, CommandEncoder& encoder, KernelRegistry& registry,
                    std::string_view grouped_name, const kernels::DenseMatmulIdKernelParams& gpu,
                    const Buffers& b, const DenseMatmulIdScratch& scratch,
                    DenseMatmulIdMapUse map_use) {
  // Resolve and check every pipeline before touching the encoder: a failed lookup must leave no
  // barrier, pending ranges or map dispatch behind.
  const bool build = map_use == DenseMatmulIdMapUse::Build;
  const PipelinePtr map = build ? registry.get_pipeline(kDenseMatmulIdMapPipeline) : nullptr;
  const PipelinePtr group = registry.get_pipeline(grouped_name);
  if (build && gpu.n_experts > map->max_total_threads_per_threadgroup()) {
    throw InvalidArgument(std::string(op) + " n_experts " + std::to_string(gpu.n_experts) +
                          " exceeds map threadgroup limit " +
                          std::to_string(map->max_total_threads_per_threadgroup()));
  }
  const KernelDef& gdef = group->def();
  if (gdef.threads_per_group > group->max_total_threads_per_threadgroup()) {
    throw InvalidArgument(std::string(op) + " grouped threads " +
                          std::to_string(gdef.threads_per_group) + " exceed pipeline limit " +
                          std::to_string(group->max_total_threads_per_threadgroup()));
  }
  const Buffer& counts = scratch.expert_counts();
  const Buffer& routed = scratch.routed_rows();
  const KernelArg params_arg = KernelArg::pod(gpu);

  // The barriers and dispatches below are one unit: if the grouped dispatch is refused after the
  // map was encoded, the map goes too (a later commit must not run half a call).
  CommandEncoder::Transaction transaction(encoder, "grouped expert-ID route");
  if (build) {
    // A previous grouped call may still read the scratch this call overwrites (WAR edge).
    encoder.memory_barrier();
    if (encoder.is_capturing()) {
      encoder.set_pending_buffer_ranges(
          {logical_range(b.expert_ids)},
          {logical_range(counts), logical_range(routed), logical_range(b.output)});
    }
    const std::pair<uint32_t, KernelArg> map_args[] = {{0, params_arg},
                                                       {1, KernelArg::of(b.expert_ids)},
                                                       {2, KernelArg::of(counts)},
                                                       {3, KernelArg::of(routed)},
                                                       {4, KernelArg::of(b.output)}};
    MapLaunch ml = map_launch(map->def(), gpu.n_experts);
    encoder.dispatch(*map, map_args, Dim3{1, 1, 1}, ml.threads, DispatchKind::ThreadGroups,
                     std::move(ml.shmem));
    // The grouped dispatch (and every later one, a reusing call's included) reads what the map
    // wrote (RAW edge).
    encoder.memory_barrier();
  }
  if (encoder.is_capturing()) {
    encoder.set_pending_buffer_ranges({logical_range(b.weights), logical_range(b.input),
                                       logical_range(counts), logical_range(routed)},
                                      {logical_range(b.output)});
  }
  const std::pair<uint32_t, KernelArg> group_args[] = {{0, params_arg},
                                                       {1, KernelArg::of(b.weights)},
                                                       {2, KernelArg::of(b.input)},
                                                       {3, KernelArg::of(counts)},
                                                       {4, KernelArg::of(routed)},
                                                       {5, KernelArg::of(b.output)}};
  std::vector<std::pair<uint64_t, uint64_t>> shmem;
  if (gdef.threadgroup_memory_bytes != 0) shmem.emplace_back(0, gdef.threadgroup_memory_bytes);
  const Dim3 tiles{ceil_div(gpu.m, gdef.tile_x), ceil_div(gpu.n, gdef.tile_y), gpu.n_experts};
  const Dim3 grid =
      gdef.persistent_groups == 0
          ? tiles
          : Dim3{std::min<uint64_t>(gdef.persistent_groups, tiles.x * tiles.y * tiles.z), 1, 1};
  encoder.dispatch(*group, group_args, grid, Dim3{gdef.threads_per_group, 1, 1},
                   DispatchKind::ThreadGroups, std::move(shmem));
  transaction.commit();
  // Only an encoded map is one that a reusing call may read.
  if (build) scratch.record_map(map_key(b.expert_ids, gpu));
}

}  // namespace routemm::expert_id
