// CPU kernels of the GGML block-quantised dense projections (spec §5.5, §5.6): the Q4_0 mat-vec
// pipeline kernel_mul_mv_q4_0_f32 and the four Q4_0 matrix routes kernel_mul_mm_q4_0_{f32,
// tensor_f32, tensor_v2_f32, tensor_64x32_f32}, and the Q8_0 pipelines kernel_mul_mv_q8_0_f32,
// kernel_mul_mv_q8_0_f32_nr2 and kernel_mul_mm_q8_0_f32.
//
// NUMERIC CONTRACT (every pipeline here; they are therefore bit-identical to each other, and in
// particular V2 == 64x32): the one stated in ggml_block_kernels.h -- exact dequantisation, eight
// F32 lane accumulators over K in increasing order with one FMA per step, and a fixed lane
// reduction tree. Routes differ only in how the work is split: the mat-vec kernels stream the
// blocks and dequantise them in registers (nothing is written to a temporary matrix); the matrix
// kernels check the launch grid of [token tile x 64] threadgroup tiles (32 or 128 tokens), pack
// the activations once per call and work in items of 64 rows x 64 outputs, each dequantising a
// 64 x kPanelDepth weight panel into thread-local scratch once and running a register-blocked
// micro-kernel (4 x 3 AVX2, 4 x 6 AVX-512) over it. None of this changes the per-element order,
// nor does the instruction-set clone that runs (isa.h). Only NaN payloads are not pinned.
//
// The reduced-precision int8-dot pipelines (kGgmlInt8DotPipelineNames: Q4_0 and Q8_0, mat-vec and
// matrix, with the exact pipelines' geometry) follow their own contract, stated in
// ggml_int8_dot.h: activations rounded to int8 per block once per call, exact integer block dot
// products, F32 scaling and accumulation in a fixed order, so they too agree bit for bit across
// clones, work splits and thread counts.
#include "routemm/ops/q4_matmul.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/q4_0_block.h"
#include "ggml_block_kernels.h"
#include "ggml_int8_dot.h"
#include "kernels.h"
#include "routemm/error.h"
#include "thread_pool.h"

#ifndef ROUTEMM_CPU_Q4_MATMUL_SHA256
#define ROUTEMM_CPU_Q4_MATMUL_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using ggml::kMaxMvRows;
using ggml::kMmOutputTile;
using ggml::kMvChunk;
using ggml::kQK;
using ggml::Operands;
using kernels::GgmlMatmulMmParams;
using kernels::GgmlMatmulMvParams;

constexpr size_t kMvThreadgroupOutputs = 8;  // outputs per mat-vec threadgroup

// ---- Arguments ----------------------------------------------------------------------------------

[[noreturn]] void launch_error(const KernelLaunch& launch, const std::string& what) {
  throw Error(launch.label + ": " + what);
}

size_t checked_mul(size_t a, size_t b) {
  size_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Error("q4_0 cpu kernel: size overflow");
  return r;
}

// The host pointer of a bound argument holding at least `need` bytes.
void* arg_data(const KernelLaunch& launch, size_t slot, size_t need, const char* what) {
  return kernels::launch_arg(launch, slot, what, need).data;
}

// Checks the shape against the bound buffers (the front door validated it; this keeps a corrupt
// raw launch from reading out of bounds) and returns the operands.
template <class Format>
Operands bind_operands(const KernelLaunch& launch, size_t m, size_t n, size_t k, size_t weight_slot,
                       size_t input_slot, size_t output_slot) {
  if (m == 0 || n == 0 || k == 0 || k % kQK != 0) {
    launch_error(launch, "params have a zero extent or K that is not a multiple of 32");
  }
  const size_t row_bytes = k / kQK * Format::kBytes;
  const void* weight = arg_data(launch, weight_slot, checked_mul(n, row_bytes), "weight");
  const void* input = arg_data(launch, input_slot, checked_mul(checked_mul(m, k), 4), "input");
  void* output = arg_data(launch, output_slot, checked_mul(checked_mul(m, n), 4), "output");
  return Operands{static_cast<const uint8_t*>(weight),
                  static_cast<const float*>(input),
                  static_cast<float*>(output),
                  m,
                  n,
                  k,
                  row_bytes};
}

// ---- Mat-vec ------------------------------------------------------------------------------------

// GroupRows output rows of one token per threadgroup: 8 for kernel_mul_mv_{q4_0,q8_0}_f32
// ([8, 8, 1] threads), kQ8_0MatVecNr2Rows for kernel_mul_mv_q8_0_f32_nr2 ([32, 4, 1] threads, 256
// bytes of threadgroup memory). The CPU checks the launch against that geometry and computes every
// output with the same arithmetic, so both Q8_0 mat-vecs give the same bits.
template <class Format, size_t GroupRows>
Operands bind_mv_launch(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<GgmlMatmulMvParams>(launch, 3);
  if (p.ne00 != p.ne10 || p.ne01 != p.ne0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 || p.r3 != 1 ||
      p.ne1 <= 0 || p.ne0 <= 0 || p.ne00 <= 0) {
    launch_error(launch, "inconsistent mat-vec params");
  }
  const Operands ops =
      bind_operands<Format>(launch, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                            static_cast<size_t>(p.ne00), 0, 1, 2);
  // The geometry of spec §5.5: [ceil(N / GroupRows), M, 1] threadgroups. Rows beyond the grid
  // would be skipped on a GPU; here a mismatch is a broken launch.
  if (launch.grid.x != (ops.n + GroupRows - 1) / GroupRows || launch.grid.y != ops.m ||
      launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the mat-vec geometry");
  }
  if constexpr (GroupRows == kQ8_0MatVecNr2Rows) {
    const bool shmem_ok = launch.threadgroup_memory.size() == 1 &&
                          launch.threadgroup_memory[0].first == 0 &&
                          launch.threadgroup_memory[0].second >= kQ8_0MatVecNr2ThreadgroupBytes;
    if (launch.threads.x != 32 || launch.threads.y != kQ8_0MatVecNr2Threads / 32 ||
        launch.threads.z != 1 || !shmem_ok) {
      launch_error(launch,
                   "nr2 mat-vec needs threads [32, 4, 1] and 256 bytes of threadgroup memory");
    }
  }
  return ops;
}

// Runs run(group, item) for every kMvChunk-column item of every group of at most kMaxMvRows rows
// (the pipeline's M <= 8 regime; larger raw launches still work, group by group).
template <class Run>
void for_each_mv_item(const Operands& ops, void* queue_native, const Run& run) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t items = (ops.n + kMvChunk - 1) / kMvChunk;
  for (size_t row0 = 0; row0 < ops.m; row0 += kMaxMvRows) {
    Operands group = ops;
    group.m = std::min(kMaxMvRows, ops.m - row0);
    group.input = ops.input + row0 * ops.k;
    group.output = ops.output + row0 * ops.n;
    const auto body = [&](size_t begin, size_t end) {
      for (size_t item = begin; item < end; ++item) {
        run(group, row0, item * kMvChunk, std::min(group.n, (item + 1) * kMvChunk));
      }
    };
    if (pool == nullptr) {
      body(0, items);
    } else {
      pool->parallel_for(items, 1, body);
    }
  }
}

template <class Format, size_t GroupRows>
void mv_kernel(const KernelLaunch& launch, void* queue_native) {
  const Operands ops = bind_mv_launch<Format, GroupRows>(launch);
  for_each_mv_item(ops, queue_native,
                   [](const Operands& group, size_t, size_t col0, size_t col_end) {
                     ggml::mv_range_for<Format>(group.m)(group, col0, col_end);
                   });
}

// Runs body(begin, end) over [0, n) on the launch's pool (or inline without one).
void parallel(void* queue_native, size_t n, const std::function<void(size_t, size_t)>& body) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  if (pool == nullptr) {
    body(0, n);
  } else {
    pool->parallel_for(n, 1, body);
  }
}

// Rounds every activation row of ops once (ggml_int8_dot.h), for `clone`.
ggml::int8::QuantizedRows quantize_activations(const Operands& ops, void* queue_native,
                                               const ggml::int8::Clone& clone) {
  ggml::int8::QuantizedRows x;
  x.resize(ops.m, ops.k);
  parallel(queue_native, ops.m, [&](size_t begin, size_t end) {
    ggml::int8::quantize_rows(ops.input, ops.k, clone.offset, x, begin, end);
  });
  return x;
}

// The int8-dot mat-vec: the launch of the exact mat-vec; every activation row is rounded once,
// then each item runs its columns for its group of rows.
template <class Format>
void mv_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  const Operands ops = bind_mv_launch<Format, kMvThreadgroupOutputs>(launch);
  const ggml::int8::Clone clone = ggml::int8::clone_for<Format>();
  const ggml::int8::QuantizedRows x = quantize_activations(ops, queue_native, clone);
  for_each_mv_item(ops, queue_native,
                   [&](const Operands& group, size_t row0, size_t col0, size_t col_end) {
                     float* out_rows[kMaxMvRows];
                     for (size_t r = 0; r < group.m; ++r) out_rows[r] = group.output + r * ops.n;
                     clone.mat_vec_item(ops, ggml::int8::QuantizedRowsView(x, row0), 0, group.m,
                                        col0, col_end - col0, out_rows);
                   });
}

// ---- Matrix routes ------------------------------------------------------------------------------

// Rows of one matrix work item: every weight panel is dequantised once per item, so wider items
// dequantise less often; 64 rows of packed activations stay in L2 beside the panel.
constexpr size_t kMmItemRows = 64;

// Every matrix route: TokenTile is the route's threadgroup token tile (32 or 128), which the launch
// grid must match. The CPU splits the work its own way (items of kMmItemRows rows x 64 outputs,
// after packing the activations once); the per-element order does not depend on the split.
// Checks a matrix launch (TokenTile: the route's threadgroup token tile, 32 or 128, which the
// launch grid must match) and returns its operands.
template <class Format, size_t TokenTile>
Operands bind_mm_launch(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<GgmlMatmulMmParams>(launch, 0);
  if (p.ne00 <= 0 || p.ne0 <= 0 || p.ne1 <= 0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 ||
      p.r3 != 1 || p.nb10 != 4 || p.nb11 != uint64_t(p.ne00) * 4 ||
      p.nb01 != uint64_t(p.ne00) / kQK * Format::kBytes) {
    launch_error(launch,
                 "inconsistent matrix params (only contiguous batch-1 inputs are supported)");
  }
  const Operands ops =
      bind_operands<Format>(launch, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                            static_cast<size_t>(p.ne00), 1, 2, 3);
  const size_t token_tiles = (ops.m + TokenTile - 1) / TokenTile;
  const size_t output_tiles = (ops.n + kMmOutputTile - 1) / kMmOutputTile;
  if (launch.grid.x != token_tiles || launch.grid.y != output_tiles || launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the route's " + std::to_string(TokenTile) +
                             " x 64 tile");
  }
  return ops;
}

// Runs run(row0, rows, col0, cols, out_rows) over items of kMmItemRows rows x 64 outputs.
template <class Run>
void for_each_mm_item(const Operands& ops, void* queue_native, const Run& run) {
  const size_t output_tiles = (ops.n + kMmOutputTile - 1) / kMmOutputTile;
  const size_t row_items = (ops.m + kMmItemRows - 1) / kMmItemRows;
  parallel(queue_native, row_items * output_tiles, [&](size_t begin, size_t end) {
    float* out_rows[kMmItemRows];
    for (size_t item = begin; item < end; ++item) {
      const size_t ri = item % row_items, ci = item / row_items;
      const size_t row0 = ri * kMmItemRows, col0 = ci * kMmOutputTile;
      const size_t rows = std::min(kMmItemRows, ops.m - row0);
      for (size_t r = 0; r < rows; ++r) out_rows[r] = ops.output + (row0 + r) * ops.n;
      run(row0, rows, col0, std::min(kMmOutputTile, ops.n - col0), out_rows);
    }
  });
}

// Every matrix route. The CPU splits the work its own way (items of kMmItemRows rows x 64 outputs,
// after packing the activations once); the per-element order does not depend on the split.
template <class Format, size_t TokenTile>
void mm_kernel(const KernelLaunch& launch, void* queue_native) {
  const Operands ops = bind_mm_launch<Format, TokenTile>(launch);
  // Pack the activations once for every item.
  checked_mul(checked_mul(ggml::PackedRows::panels(ops.k), ops.m), ggml::kPackedRowStride);
  std::vector<float> packed(ggml::PackedRows::floats(ops.m, ops.k));
  const ggml::PackedRows x{packed.data(), ops.m};
  parallel(queue_native, ops.m, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) x.pack(r, ops.input_row(r), ops.k);
  });
  const ggml::MmItem run = ggml::mm_item_for<Format>();
  for_each_mm_item(ops, queue_native,
                   [&](size_t row0, size_t rows, size_t col0, size_t cols, float* const* out) {
                     run(ops, x, row0, rows, col0, cols, out);
                   });
}

// The int8-dot matrix route: the simdgroup route's launch; every activation row is rounded once
// per call and reused by every item.
template <class Format>
void mm_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  const Operands ops = bind_mm_launch<Format, 32>(launch);
  const ggml::int8::Clone clone = ggml::int8::clone_for<Format>();
  const ggml::int8::QuantizedRows x = quantize_activations(ops, queue_native, clone);
  const ggml::int8::QuantizedRowsView view(x, 0);
  for_each_mm_item(ops, queue_native,
                   [&](size_t row0, size_t rows, size_t col0, size_t cols, float* const* out) {
                     clone.item(ops, view, row0, rows, col0, cols, out);
                   });
}

// ---- Registration -------------------------------------------------------------------------------

KernelDef make_def(std::string_view name, KernelFn fn, uint32_t threads, uint32_t tile_x,
                   uint32_t tile_y, uint64_t shmem) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.check_args = kernels::kernel_arg_contract(name);
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = threads;
  def.tile_x = tile_x;
  def.tile_y = tile_y;
  def.threadgroup_memory_bytes = shmem;
  def.origin = "builtin_cpu";
  def.content_sha256 = ROUTEMM_CPU_Q4_MATMUL_SHA256;
  return def;
}

}  // namespace

void add_q4_matmul_kernels(std::vector<KernelDef>& out) {
  // The CPU backend adopts the geometry of spec §5.5/§5.6 so that receipts read the same on every
  // backend: mat-vec 64 threads (8 x 8), 8 outputs x 1 token per threadgroup; matrix routes 128
  // threads, token tile x 64 outputs, threadgroup memory as the Metal kernels declare it.
  using ggml::Q4_0Format;
  using ggml::Q8_0Format;
  constexpr auto names = kQ4MatmulPipelineNames;
  static_assert(names[0] == kQ4_0MatVecPipeline && names[1] == "kernel_mul_mm_q4_0_f32" &&
                names[2] == "kernel_mul_mm_q4_0_tensor_f32" &&
                names[3] == "kernel_mul_mm_q4_0_tensor_v2_f32" &&
                names[4] == "kernel_mul_mm_q4_0_tensor_64x32_f32");
  out.push_back(make_def(names[0], mv_kernel<Q4_0Format, kMvThreadgroupOutputs>, 64,
                         kMvThreadgroupOutputs, 1, 0));
  out.push_back(make_def(names[1], mm_kernel<Q4_0Format, 32>, 128, 32, kMmOutputTile, 8192));
  out.push_back(make_def(names[2], mm_kernel<Q4_0Format, 32>, 128, 32, kMmOutputTile, 8192));
  out.push_back(make_def(names[3], mm_kernel<Q4_0Format, 128>, 128, 128, kMmOutputTile, 4096));
  out.push_back(make_def(names[4], mm_kernel<Q4_0Format, 32>, 128, 32, kMmOutputTile, 4096));
  // Q8_0: the mat-vec and the simdgroup-compatible matrix route, with the Q4_0 geometry.
  constexpr auto q8 = kQ8MatmulPipelineNames;
  static_assert(q8[0] == "kernel_mul_mv_q8_0_f32" && q8[1] == "kernel_mul_mm_q8_0_f32");
  out.push_back(make_def(q8[0], mv_kernel<Q8_0Format, kMvThreadgroupOutputs>, 64,
                         kMvThreadgroupOutputs, 1, 0));
  out.push_back(make_def(q8[1], mm_kernel<Q8_0Format, 32>, 128, 32, kMmOutputTile, 8192));
  // Spec §5.5's default Q8_0 mat-vec: 2 rows x 1 token per [32, 4, 1] threadgroup, 256 bytes.
  out.push_back(make_def(kQ8_0MatVecNr2Pipeline, mv_kernel<Q8_0Format, kQ8_0MatVecNr2Rows>,
                         kQ8_0MatVecNr2Threads, kQ8_0MatVecNr2Rows, 1,
                         kQ8_0MatVecNr2ThreadgroupBytes));
  // The int8-dot routes, with the exact mat-vec's and simdgroup route's geometry. Every CPU has
  // them (the portable clone is exact integer arithmetic too).
  constexpr auto i8 = kGgmlInt8DotPipelineNames;
  static_assert(
      i8[0] == "kernel_mul_mv_q4_0_int8dot_f32" && i8[1] == "kernel_mul_mm_q4_0_int8dot_f32" &&
      i8[2] == "kernel_mul_mv_q8_0_int8dot_f32" && i8[3] == "kernel_mul_mm_q8_0_int8dot_f32");
  out.push_back(make_def(i8[0], mv_int8_kernel<Q4_0Format>, 64, kMvThreadgroupOutputs, 1, 0));
  out.push_back(make_def(i8[1], mm_int8_kernel<Q4_0Format>, 128, 32, kMmOutputTile, 8192));
  out.push_back(make_def(i8[2], mv_int8_kernel<Q8_0Format>, 64, kMvThreadgroupOutputs, 1, 0));
  out.push_back(make_def(i8[3], mm_int8_kernel<Q8_0Format>, 128, 32, kMmOutputTile, 8192));
}

}  // namespace routemm::cpu
