// The Metal pipeline table (kernels.h). Names come from the core's tables, so every backend
// registers one list; the static_asserts below fail the build if a table changes under us.
#include "kernels.h"

#include <array>
#include <cstddef>
#include <utility>

#include "backend/common/kernel_contracts.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/ops/quantized_matmul_id.h"

namespace routemm::metal {
namespace {

constexpr std::string_view kCalibrationPoison = "routemm_calibration_poison_f32";
constexpr std::string_view kCalibrationCompare = "routemm_calibration_compare_f32";

// Function names in table order: the seven expert-ID pipelines, the five Q4_0 pipelines, the two
// calibration proof kernels, the three MoE layer kernels, the two Q8_0 pipelines, the four
// quantised expert-ID pipelines, the Q8_0 nr2 mat-vec, the Q8_0 nr2 expert-ID direct pipeline;
// then (kFunctions) the four pipelines of each format of ggml_formats.h's kKernelFormats.
constexpr std::array<std::string_view, 25> kBaseFunctions = {
    kDenseMatmulIdPipelineNames[0],
    kDenseMatmulIdPipelineNames[1],
    kDenseMatmulIdPipelineNames[2],
    kDenseMatmulIdPipelineNames[3],
    kDenseMatmulIdPipelineNames[4],
    kDenseMatmulIdPipelineNames[5],
    kDenseMatmulIdPipelineNames[6],
    kQ4MatmulPipelineNames[0],
    kQ4MatmulPipelineNames[1],
    kQ4MatmulPipelineNames[2],
    kQ4MatmulPipelineNames[3],
    kQ4MatmulPipelineNames[4],
    kCalibrationPoison,
    kCalibrationCompare,
    kMoePipelineNames[0],
    kMoePipelineNames[1],
    kMoePipelineNames[2],
    kQ8MatmulPipelineNames[0],
    kQ8MatmulPipelineNames[1],
    kGgmlQuantizedMatmulIdPipelineNames[0],
    kGgmlQuantizedMatmulIdPipelineNames[1],
    kGgmlQuantizedMatmulIdPipelineNames[2],
    kGgmlQuantizedMatmulIdPipelineNames[3],
    kQ8_0MatVecNr2Pipeline,
    kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline,
};
static_assert(kDenseMatmulIdPipelineNames.size() == 7 && kQ4MatmulPipelineNames.size() == 5 &&
              kMoePipelineNames.size() == 3 && kQ8MatmulPipelineNames.size() == 2 &&
              kGgmlQuantizedMatmulIdPipelineNames.size() == 4);
constexpr size_t kFormatFunctions = 4 * ggml_formats::kKernelFormats.size();
constexpr std::array<std::string_view, kBaseFunctions.size() + kFormatFunctions> kFunctions = [] {
  std::array<std::string_view, kBaseFunctions.size() + kFormatFunctions> names{};
  size_t i = 0;
  for (const std::string_view name : kBaseFunctions) names[i++] = name;
  for (const ggml_formats::KernelFormat& f : ggml_formats::kKernelFormats) {
    for (const std::string_view name : {f.mat_vec, f.matrix, f.id_direct, f.id_grouped}) {
      names[i++] = name;
    }
  }
  return names;
}();
static_assert(kFunctions[3] == kDenseMatmulIdMapPipeline && kFunctions[7] == kQ4_0MatVecPipeline);

// A KernelFn knows only its launch; one instantiation per table row carries the function name.
template <size_t I>
void launch(const KernelLaunch& launch, void* queue_native) {
  static_cast<MetalLaunchTarget*>(queue_native)->encode(kFunctions[I], launch);
}

constexpr MetalPipelineSpec spec(size_t i, KernelFn fn, MetalLibrary library, uint32_t threads,
                                 uint32_t tile_x, uint32_t tile_y, uint64_t shmem,
                                 bool q4 = false) {
  return MetalPipelineSpec{kFunctions[i], library, threads, tile_x, tile_y, shmem, q4, fn};
}

using enum MetalLibrary;

// Geometry (spec §7.4, §5.5, §5.6, §6.4):
//   direct   64 threads (2 simdgroups x 4 columns), tile_x = 8 columns per group, one flat row.
//   map      one threadgroup of 128 threads, 16400 bytes (4 x 1024 cursors and 4 totals).
//   grouped  256 threads (8 simdgroups), 8 routed rows x 8 columns, 4096 bytes (8 x 128 F32).
//   mat-vec  64 threads ([8, 8, 1]), 8 output rows x 1 token per group.
//   matrix   128 threads; tile_x = tokens per group, tile_y = 64 outputs; 8192 bytes for the
//            simdgroup and V1 routes, 4096 for V2 (128 tokens) and 64x32 (32 tokens).
//   proof    Threads dispatches, at most 256 threads per group.
//   moe      64 threads: one per token row (gate) or per output element (silu_mul, combine).
//   q8_0     as the Q4_0 mat-vec and simdgroup matrix route (the same kernels, Q8_0 blocks); the
//            nr2 mat-vec 128 threads ([32, 4, 1]), 2 output rows x 1 token per group, 256 bytes.
//   quantised expert-ID: direct as dense direct (8 columns x 1 flat row, 64 threads); grouped
//            128 threads, 32 routed rows x 64 columns per group (the simdgroup matrix route's
//            tile), 8192 bytes; the Q8_0 nr2 direct pipeline as the nr2 mat-vec (128 threads,
//            2 columns x 1 flat row per group, 256 bytes).
constexpr std::array<MetalPipelineSpec, kBaseFunctions.size()> kBaseSpecs = {
    spec(0, launch<0>, Base, 64, 8, 1, 0),
    spec(1, launch<1>, Base, 64, 8, 1, 0),
    spec(2, launch<2>, Base, 64, 8, 1, 0),
    spec(3, launch<3>, Base, 128, 1, 1, 16400),
    spec(4, launch<4>, Base, 256, 8, 8, 4096),
    spec(5, launch<5>, Base, 256, 8, 8, 4096),
    spec(6, launch<6>, Base, 256, 8, 8, 4096),
    spec(7, launch<7>, Base, 64, 8, 1, 0, true),
    spec(8, launch<8>, Base, 128, 32, 64, 8192, true),
    spec(9, launch<9>, Tensor, 128, 32, 64, 8192, true),
    spec(10, launch<10>, Tensor, 128, 128, 64, 4096, true),
    spec(11, launch<11>, Tensor, 128, 32, 64, 4096, true),
    spec(12, launch<12>, Base, 256, 1, 1, 0),
    spec(13, launch<13>, Base, 256, 1, 1, 0),
    spec(14, launch<14>, Base, 64, 1, 1, 0),
    spec(15, launch<15>, Base, 64, 1, 1, 0),
    spec(16, launch<16>, Base, 64, 1, 1, 0),
    spec(17, launch<17>, Base, 64, 8, 1, 0, true),
    spec(18, launch<18>, Base, 128, 32, 64, 8192, true),
    spec(19, launch<19>, Base, 64, 8, 1, 0),
    spec(20, launch<20>, Base, 64, 8, 1, 0),
    spec(21, launch<21>, Base, 128, 32, 64, 8192),
    spec(22, launch<22>, Base, 128, 32, 64, 8192),
    spec(23, launch<23>, Base, kQ8_0MatVecNr2Threads, kQ8_0MatVecNr2Rows, 1,
         kQ8_0MatVecNr2ThreadgroupBytes, true),
    spec(24, launch<24>, Base, kQ8_0MatVecNr2Threads, kQ8_0MatVecNr2Rows, 1,
         kQ8_0MatVecNr2ThreadgroupBytes),
};

// The four pipelines of a kKernelFormats format, with the geometry of Q8_0's of the same kinds:
// mat-vec, simdgroup-matrix route, expert-ID direct, expert-ID grouped.
template <size_t I>
constexpr MetalPipelineSpec format_spec() {
  constexpr size_t i = kBaseFunctions.size() + I;
  if constexpr (I % 4 == 0) return spec(i, launch<i>, Base, 64, 8, 1, 0, true);
  if constexpr (I % 4 == 1) return spec(i, launch<i>, Base, 128, 32, 64, 8192, true);
  if constexpr (I % 4 == 2) return spec(i, launch<i>, Base, 64, 8, 1, 0);
  return spec(i, launch<i>, Base, 128, 32, 64, 8192);
}

template <size_t... I>
constexpr std::array<MetalPipelineSpec, kFunctions.size()> all_specs(std::index_sequence<I...>) {
  std::array<MetalPipelineSpec, kFunctions.size()> specs{};
  for (size_t i = 0; i < kBaseSpecs.size(); ++i) specs[i] = kBaseSpecs[i];
  ((specs[kBaseSpecs.size() + I] = format_spec<I>()), ...);
  return specs;
}

constexpr std::array<MetalPipelineSpec, kFunctions.size()> kSpecs =
    all_specs(std::make_index_sequence<kFormatFunctions>{});

}  // namespace

std::span<const MetalPipelineSpec> metal_pipeline_specs() { return kSpecs; }

KernelDef metal_kernel_def(const MetalPipelineSpec& spec, uint64_t max_threads_per_threadgroup,
                           std::string origin, std::string content_sha256) {
  KernelDef def;
  def.name = std::string(spec.name);
  def.fn = spec.fn;
  def.check_args = kernels::kernel_arg_contract(spec.name);
  def.max_threads_per_threadgroup = max_threads_per_threadgroup;
  def.threads_per_group = spec.threads_per_group;
  def.tile_x = spec.tile_x;
  def.tile_y = spec.tile_y;
  def.threadgroup_memory_bytes = spec.threadgroup_memory_bytes;
  def.entry_point = std::string(spec.name);
  def.origin = std::move(origin);
  def.content_sha256 = std::move(content_sha256);
  return def;
}

}  // namespace routemm::metal
