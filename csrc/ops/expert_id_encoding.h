// Encoding shared by the two expert-ID matmul front doors (dense_matmul_id and
// quantized_matmul_id_ggml): both pass the same kernel-argument struct, the same buffer slots,
// the same map pipeline and caller-owned scratch, and the same dispatch sequence
//   direct:  one dispatch, grid [ceil(n / tile_x), m * top_k, 1];
//   grouped: barrier (scratch WAR), map, barrier (map -> grouped RAW), grouped dispatch, grid
//            [ceil(m / tile_x), ceil(n / tile_y), n_experts] (or the pipeline's persistent grid);
//            with DenseMatmulIdMapUse::Reuse the grouped dispatch alone, reading the scratch's map.
// Callers validate first; these helpers resolve every pipeline before touching the encoder, so a
// failed lookup or launch-shape check leaves no barrier, pending range or dispatch behind, and the
// grouped sequence is one CommandEncoder::Transaction: refused partway, it leaves nothing either.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "routemm/buffer.h"
#include "routemm/encoder.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/registry.h"

namespace routemm::expert_id {

// The kernel arguments of one call. Strides: shared input (k * 4, 0), slotted (k * 4 * top_k,
// k * 4). `op` prefixes any error message.
kernels::DenseMatmulIdKernelParams kernel_params(std::string_view op, uint32_t m, uint32_t n,
                                                 uint32_t k, uint32_t top_k, uint32_t n_experts,
                                                 uint64_t expert_stride_bytes,
                                                 DenseMatmulIdInputLayout input_layout);

struct Buffers {
  const Buffer& weights;
  const Buffer& input;
  const Buffer& expert_ids;
  const Buffer& output;
};

// Checks the encoder, registry and weights share one backend and that an open receipt has room for
// `dispatches`; throws InvalidArgument prefixed with `op`.
void check_encoder(std::string_view op, std::string_view route, const CommandEncoder& encoder,
                   const KernelRegistry& registry, const Buffer& weights, uint32_t dispatches);

// The dispatches a call encodes: 1 direct, 2 grouped, 1 grouped reusing a map.
uint32_t dispatch_count(bool grouped, DenseMatmulIdMapUse map);

// Checks `map` against the call: Reuse needs a grouped route and a scratch whose recorded map was
// built from the same ids view with the same m, top_k and n_experts. Throws InvalidArgument
// prefixed with `op`.
void check_map_use(std::string_view op, DenseMatmulIdMapUse map, bool grouped,
                   const DenseMatmulIdScratch* scratch, const Buffer& expert_ids,
                   const kernels::DenseMatmulIdKernelParams& gpu);

// The map's launch: one threadgroup of one thread per expert, unless the backend's map uses a
// fixed block (threads_per_group > 1), with the threadgroup memory its KernelDef declares (index
// 0). Both front doors encode and predict the map with it.
struct MapLaunch {
  Dim3 threads;
  std::vector<std::pair<uint64_t, uint64_t>> shmem;
};
MapLaunch map_launch(const KernelDef& map, uint32_t n_experts);

// Encodes the direct route: one dispatch of `pipeline_name`.
void encode_direct(CommandEncoder& encoder, KernelRegistry& registry,
                   std::string_view pipeline_name, const kernels::DenseMatmulIdKernelParams& gpu,
                   const Buffers& buffers);

// Encodes the grouped route: the shared map (recorded in the scratch), then `grouped_name`, with
// the barriers above; with Reuse (checked by check_map_use first) `grouped_name` alone.
void encode_grouped(std::string_view op, CommandEncoder& encoder, KernelRegistry& registry,
                    std::string_view grouped_name, const kernels::DenseMatmulIdKernelParams& gpu,
                    const Buffers& buffers, const DenseMatmulIdScratch& scratch,
                    DenseMatmulIdMapUse map);

}  // namespace routemm::expert_id
