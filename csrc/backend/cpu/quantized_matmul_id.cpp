// CPU kernels of the quantised expert-ID matmul: quantized_matmul_id_direct_{q4_0,q8_0}_f32,
// quantized_matmul_id_direct_q8_0_f32_nr2 (direct's arithmetic in the nr2 geometry) and
// quantized_matmul_id_grouped_{q4_0,q8_0}_f32 (the map is dense_matmul_id's), and the int8-dot
// routes' quantized_matmul_id_{direct,grouped}_int8dot_{q4_0,q8_0}_f32.
//
// NUMERIC CONTRACT: ggml_block_kernels.h's, the same as quantized_matmul_ggml's CPU pipelines. The
// direct kernel runs the mat-vec micro-kernel on each routed row's expert; the grouped kernel
// gathers an expert's routed rows and runs the mat-vec micro-kernel over up to eight of them at a
// time (few rows) or the matrix tile over them (many). Neither changes the
// per-element order, so direct == grouped == quantized_matmul_ggml on the expert's matrix, bit for
// bit. An id >= n_experts yields an all-zero row and no weight address.
//
// The int8-dot kernels follow ggml_int8_dot.h's contract instead, as the dense int8-dot pipelines
// do: each routed row's activations are rounded once per thread that needs them (the same bytes
// whichever thread does it), and each routed row runs the dense int8-dot mat-vec item (direct;
// grouped items of few rows) or matrix item (grouped items of more rows) on its expert's matrix.
// The contract fixes every F32 operation, so direct == grouped == quantized_matmul_ggml's int8-dot
// pipelines on the expert's matrix, bit for bit.
#include "routemm/ops/quantized_matmul_id.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "ggml_block_kernels.h"
#include "ggml_int8_dot.h"
#include "grouped_items.h"
#include "kernels.h"
#include "routemm/checked.h"
#include "routemm/error.h"
#include "thread_pool.h"

#ifndef ROUTEMM_CPU_QUANTIZED_MATMUL_ID_SHA256
#define ROUTEMM_CPU_QUANTIZED_MATMUL_ID_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using ggml::kMaxMvRows;
using ggml::kMmOutputTile;
using ggml::kQK;
using ggml::Operands;
using kernels::DenseMatmulIdKernelParams;

[[noreturn]] void launch_error(const KernelLaunch& launch, const std::string& what) {
  throw Error(launch.label + ": " + what);
}

// Overflow-checked size arithmetic (routemm/checked.h): the front door and the argument contract
// validated the shapes; this keeps a corrupt launch from turning into an out-of-bounds access.
size_t checked_mul(size_t a, size_t b) {
  return routemm::checked_mul(a, b, "quantized_matmul_id cpu kernel size");
}
size_t checked_add(size_t a, size_t b) {
  return routemm::checked_add(a, b, "quantized_matmul_id cpu kernel size");
}

void* arg_data(const KernelLaunch& launch, size_t slot, size_t need, const char* what) {
  return kernels::launch_arg(launch, slot, what, need).data;
}

// The launch's params, with the shape checks every kernel needs.
DenseMatmulIdKernelParams read_params(const KernelLaunch& launch) {
  const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
  if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0 || p.k % kQK != 0) {
    launch_error(launch, "params have a zero extent or K that is not a multiple of 32");
  }
  return p;
}

// Pointers shared by both kernels; rows are addressed by flat = token * top_k + slot.
template <class Format>
struct Job {
  const uint8_t* weights;
  const unsigned char* input;
  float* output;
  DenseMatmulIdKernelParams p;
  size_t row_bytes;

  static Job bind(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p, size_t out_slot) {
    const size_t row_bytes = p.k / kQK * Format::kBytes;
    const size_t matrix = checked_mul(p.n, row_bytes);
    const size_t weight_bytes =
        checked_add(checked_mul(p.n_experts - 1, p.expert_stride_bytes), matrix);
    const size_t last_input = checked_add(checked_mul(p.m - 1, p.input_token_stride_bytes),
                                          checked_mul(p.top_k - 1, p.input_slot_stride_bytes));
    const size_t input_bytes = checked_add(last_input, checked_mul(p.k, sizeof(float)));
    const size_t rows = checked_mul(p.m, p.top_k);
    return Job{static_cast<const uint8_t*>(arg_data(launch, 1, weight_bytes, "weights")),
               static_cast<const unsigned char*>(arg_data(launch, 2, input_bytes, "input")),
               static_cast<float*>(
                   arg_data(launch, out_slot, checked_mul(checked_mul(rows, p.n), 4), "output")),
               p, row_bytes};
  }

  const float* input_row(size_t flat) const {
    const size_t token = flat / p.top_k, slot = flat - token * p.top_k;
    return reinterpret_cast<const float*>(input + token * p.input_token_stride_bytes +
                                          slot * p.input_slot_stride_bytes);
  }
  float* output_row(size_t flat) const { return output + flat * p.n; }
  // Operands of expert `id` (valid) for `rows` contiguous input rows at `x`.
  Operands expert(uint32_t id, const float* x, size_t rows, float* out) const {
    return Operands{
        weights + size_t{id} * p.expert_stride_bytes, x, out, rows, p.n, p.k, row_bytes};
  }
};

// ---- Direct -------------------------------------------------------------------------------------

// Runs run(flat, id, col0, col_end, out) on every item of a direct launch (one routed row x a
// column chunk, item = flat * chunks + chunk) whose id is valid, on the launch's pool; an invalid
// id's row is zeroed, with no weight address formed.
template <class Format, class Run>
void for_each_direct_item(const KernelLaunch& launch, void* queue_native, const Job<Format>& job,
                          const Run& run) {
  const DenseMatmulIdKernelParams& p = job.p;
  const size_t rows = size_t{p.m} * p.top_k;
  const auto* ids =
      static_cast<const uint32_t*>(arg_data(launch, 3, checked_mul(rows, 4), "expert ids"));
  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t chunk = direct_item_columns(rows, p.n, pool == nullptr ? 1 : pool->size());
  const size_t chunks = (size_t{p.n} + chunk - 1) / chunk;
  const auto body = [&](size_t begin, size_t end) {
    for (size_t item = begin; item < end; ++item) {
      const size_t flat = item / chunks;
      const size_t col0 = (item - flat * chunks) * chunk;
      const size_t col_end = std::min<size_t>(p.n, col0 + chunk);
      float* out = job.output_row(flat);
      const uint32_t id = ids[flat];
      if (id >= p.n_experts) {
        std::fill(out + col0, out + col_end, 0.0f);
        continue;
      }
      run(flat, id, col0, col_end, out);
    }
  };
  if (pool == nullptr) {
    body(0, rows * chunks);
  } else {
    pool->parallel_for(rows * chunks, 1, body);
  }
}

template <class Format>
void direct_kernel(const KernelLaunch& launch, void* queue_native) {
  const Job<Format> job = Job<Format>::bind(launch, read_params(launch), 4);
  const ggml::MvRange run = ggml::mv_range_for<Format>(1);
  for_each_direct_item(launch, queue_native, job,
                       [&](size_t flat, uint32_t id, size_t col0, size_t col_end, float* out) {
                         run(job.expert(id, job.input_row(flat), 1, out), col0, col_end);
                       });
}

// Q8_0's nr2 direct pipeline (kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline): the launch must have the nr2
// geometry (grid [ceil(n / 2), m * top_k, 1], threads [32, 4, 1], 256 bytes at index 0). Every row
// is computed as direct_kernel computes it, so on the CPU its bits are the lane-contract direct
// pipeline's, as the CPU's nr2 mat-vec gives the lane-contract mat-vec's: each routed row equals
// kernel_mul_mv_q8_0_f32_nr2 on its expert's matrix bit for bit.
void direct_nr2_kernel(const KernelLaunch& launch, void* queue_native) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const bool shmem_ok = launch.threadgroup_memory.size() == 1 &&
                        launch.threadgroup_memory[0].first == 0 &&
                        launch.threadgroup_memory[0].second >= kQ8_0MatVecNr2ThreadgroupBytes;
  if (launch.grid.x != (uint64_t{p.n} + kQ8_0MatVecNr2Rows - 1) / kQ8_0MatVecNr2Rows ||
      launch.grid.y != uint64_t{p.m} * p.top_k || launch.grid.z != 1 || launch.threads.x != 32 ||
      launch.threads.y != kQ8_0MatVecNr2Threads / 32 || launch.threads.z != 1 || !shmem_ok) {
    launch_error(launch,
                 "nr2 direct needs grid [ceil(n / 2), m * top_k, 1], threads [32, 4, 1] and 256 "
                 "bytes of threadgroup memory");
  }
  direct_kernel<ggml::Q8_0Format>(launch, queue_native);
}

// ---- Grouped ------------------------------------------------------------------------------------

// Routed rows per work item (one item covers them x kMmOutputTile columns).
constexpr size_t kItemRows = 64;
// Items of at most this many rows run the mat-vec micro-kernel in passes of at most kMaxMvRows
// rows: each weight block is dequantised in registers once per pass and feeds every row of the
// pass, with nothing stored. Larger items run the matrix tile, which dequantises a weight panel
// into memory once for all the item's rows (up to 64), worth its stores and reloads only then.
// Both follow the contract, so the choice changes no bits. 16: with AVX-512 the passes keep up
// with the tile at any row count, but the AVX2 clone's eight-row pass has room for one column
// only, and there the tile is about a fifth faster at 32 rows per item.
constexpr size_t kMvItemRows = 16;

// Per-thread gathered rows, reused across items and launches. They belong to the item block
// (launch, row0): the items of one block differ only in their columns, and a thread that takes
// several of them (the list keeps them adjacent) gathers the rows once.
struct GroupedScratch {
  uint64_t launch = 0;
  uint32_t row0 = 0;
  std::vector<float> rows;  // mat-vec items: [rows, k] row after row; others: ggml::PackedRows
};
GroupedScratch& grouped_scratch() {
  thread_local GroupedScratch scratch;
  return scratch;
}

// The work of a grouped launch: the map's routed-row list and the items over it.
struct GroupedWork {
  const uint32_t* routed = nullptr;
  std::vector<GroupedItem> items;
};

// Reads the map's list (dense_matmul_id's map kernel): expert e's flat rows are the segment
// routed[start(e), start(e) + counts[e]), start(e) the counts of the experts before it. The
// scratch comes from the map; it is checked anyway, since a stale or foreign buffer would
// otherwise index out of bounds: the segments together hold at most every flat row once. Items
// cover at most kItemRows rows x kMmOutputTile columns of one expert, largest first.
GroupedWork grouped_work(const KernelLaunch& launch, const DenseMatmulIdKernelParams& p) {
  const size_t rows = size_t{p.m} * p.top_k;
  const size_t experts = p.n_experts;
  const auto* counts =
      static_cast<const uint32_t*>(arg_data(launch, 3, checked_mul(experts, 4), "expert counts"));
  size_t routed_total = 0;
  for (size_t e = 0; e < experts; ++e) {
    routed_total += counts[e];
    if (routed_total > rows) launch_error(launch, "expert counts exceed the flat rows");
  }
  GroupedWork work;
  work.routed = static_cast<const uint32_t*>(
      arg_data(launch, 4, checked_mul(routed_total, 4), "routed rows"));
  for (size_t i = 0; i < routed_total; ++i) {
    if (work.routed[i] >= rows) launch_error(launch, "routed row out of range");
  }
  size_t start = 0;
  for (size_t e = 0; e < experts; ++e) {
    const size_t count = counts[e];
    for (size_t row0 = 0; row0 < count; row0 += kItemRows) {
      const auto item_rows = static_cast<uint32_t>(std::min(kItemRows, count - row0));
      for (size_t col0 = 0; col0 < p.n; col0 += kMmOutputTile) {
        work.items.push_back({static_cast<uint32_t>(e), static_cast<uint32_t>(start + row0),
                              item_rows, static_cast<uint32_t>(col0)});
      }
    }
    start += count;
  }
  // Largest items first, handed out one at a time: balances uneven expert counts.
  std::stable_sort(work.items.begin(), work.items.end(),
                   [](const GroupedItem& a, const GroupedItem& b) { return a.rows > b.rows; });
  return work;
}

template <class Format>
void grouped_kernel(const KernelLaunch& launch, void* queue_native) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const Job<Format> job = Job<Format>::bind(launch, p, 5);
  const GroupedWork work = grouped_work(launch, p);
  if (work.items.empty()) return;

  const uint64_t launch_id = next_launch_number();
  const ggml::MmItem run_tile = ggml::mm_item_for<Format>();
  const auto run_item = [&](const GroupedItem& item) {
    const uint32_t* flats = work.routed + item.row0;  // row0: the item's first entry of the list
    const bool mat_vec = item.rows <= kMvItemRows;
    GroupedScratch& s = grouped_scratch();
    if (s.launch != launch_id || s.row0 != item.row0) {
      const size_t floats = mat_vec ? item.rows * p.k : ggml::PackedRows::floats(item.rows, p.k);
      s.rows.resize(std::max(s.rows.size(), floats));
      const ggml::PackedRows packed{s.rows.data(), item.rows};
      for (size_t r = 0; r < item.rows; ++r) {
        if (mat_vec) {
          std::memcpy(s.rows.data() + r * p.k, job.input_row(flats[r]), p.k * sizeof(float));
        } else {
          packed.pack(r, job.input_row(flats[r]), p.k);
        }
      }
      s.launch = launch_id;
      s.row0 = item.row0;
    }
    float* out_rows[kItemRows];
    for (size_t r = 0; r < item.rows; ++r) out_rows[r] = job.output_row(flats[r]);
    const size_t col_end = std::min<size_t>(p.n, item.col0 + kMmOutputTile);
    if (!mat_vec) {
      run_tile(job.expert(item.expert, nullptr, item.rows, nullptr),
               ggml::PackedRows{s.rows.data(), item.rows}, 0, item.rows, item.col0,
               col_end - item.col0, out_rows);
      return;
    }
    // Passes as even as possible (12 rows run as 6 + 6, not 8 + 4): every pass fills its tile.
    const size_t passes = (item.rows + kMaxMvRows - 1) / kMaxMvRows;
    for (size_t g = 0, r0 = 0; g < passes; ++g) {
      const size_t pass_rows = item.rows / passes + (g < item.rows % passes ? 1 : 0);
      Operands ops = job.expert(item.expert, s.rows.data() + r0 * p.k, pass_rows, nullptr);
      ops.output_rows = out_rows + r0;
      ggml::mv_range_for<Format>(pass_rows)(ops, item.col0, col_end);
      r0 += pass_rows;
    }
  };
  run_grouped_items(queue_native, work.items, run_item);
}

// ---- Int8-dot routes ----------------------------------------------------------------------------

// Per-thread rounded activation rows, reused across items and launches: the rows of key `key`
// (direct: a source row; grouped: an item block's first list entry) of launch `launch`. Whichever
// thread rounds a row writes the same bytes (ggml_int8_dot.h, step 1), so each thread keeps its
// own copy and nothing is shared.
struct Int8RowsScratch {
  uint64_t launch = 0;
  size_t key = 0;
  ggml::int8::QuantizedRows rows;
};
Int8RowsScratch& int8_rows_scratch() {
  thread_local Int8RowsScratch scratch;
  return scratch;
}

// Rounds the input rows of the routed rows flats[0, count) into this thread's scratch, unless it
// already holds them (same launch and key). QuantizedRows::resize keeps its capacity, so a thread
// allocates only when a launch needs more rows or K than any before it.
template <class Format>
const ggml::int8::QuantizedRows& rounded_rows(const Job<Format>& job, const uint32_t* flats,
                                              size_t count, uint64_t launch, size_t key,
                                              int32_t offset) {
  Int8RowsScratch& s = int8_rows_scratch();
  if (s.launch != launch || s.key != key) {
    s.rows.resize(count, job.p.k);
    for (size_t r = 0; r < count; ++r) {
      ggml::int8::quantize_row(job.input_row(flats[r]), job.p.k, offset, s.rows, r);
    }
    s.launch = launch;
    s.key = key;
  }
  return s.rows;
}

// Direct's launch and items (one routed row x a column chunk); each routed row runs the dense
// int8-dot mat-vec item on its expert. A thread's items are adjacent, so it rounds each source row
// it meets once (a token's top_k slots share one source row unless the input is slotted).
template <class Format>
void direct_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  const Job<Format> job = Job<Format>::bind(launch, read_params(launch), 4);
  const ggml::int8::Clone clone = ggml::int8::clone_for<Format>();
  const uint64_t launch_id = next_launch_number();
  const bool shared_rows = job.p.input_slot_stride_bytes == 0;
  for_each_direct_item(launch, queue_native, job,
                       [&](size_t flat, uint32_t id, size_t col0, size_t col_end, float* out) {
                         const auto flat32 = static_cast<uint32_t>(flat);
                         const size_t source = shared_rows ? flat / job.p.top_k : flat;
                         const ggml::int8::QuantizedRows& x =
                             rounded_rows(job, &flat32, 1, launch_id, source, clone.offset);
                         clone.mat_vec_item(job.expert(id, nullptr, 1, nullptr),
                                            ggml::int8::QuantizedRowsView(x, 0), 0, 1, col0,
                                            col_end - col0, &out);
                       });
}

// Grouped's map, list and items; an item's rows are rounded once per thread that takes one of
// its column blocks, then run the dense int8-dot mat-vec item (few rows) or matrix item.
template <class Format>
void grouped_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  const DenseMatmulIdKernelParams p = read_params(launch);
  const Job<Format> job = Job<Format>::bind(launch, p, 5);
  const GroupedWork work = grouped_work(launch, p);
  if (work.items.empty()) return;
  const ggml::int8::Clone clone = ggml::int8::clone_for<Format>();
  const uint64_t launch_id = next_launch_number();
  const auto run_item = [&](const GroupedItem& item) {
    const uint32_t* flats = work.routed + item.row0;
    const ggml::int8::QuantizedRows& x =
        rounded_rows(job, flats, item.rows, launch_id, item.row0, clone.offset);
    float* out_rows[kItemRows];
    for (size_t r = 0; r < item.rows; ++r) out_rows[r] = job.output_row(flats[r]);
    const size_t cols = std::min<size_t>(p.n, item.col0 + kMmOutputTile) - item.col0;
    const Operands ops = job.expert(item.expert, nullptr, item.rows, nullptr);
    const ggml::int8::Item run = item.rows <= kMaxMvRows ? clone.mat_vec_item : clone.item;
    run(ops, ggml::int8::QuantizedRowsView(x, 0), 0, item.rows, item.col0, cols, out_rows);
  };
  run_grouped_items(queue_native, work.items, run_item);
}

// ---- Registration -------------------------------------------------------------------------------

KernelDef make_def(std::string_view name, KernelFn fn, uint32_t threads, uint32_t tile_x,
                   uint32_t tile_y, uint64_t shmem) {
  KernelDef def;
  def.name = std::string(name);
  def.fn = fn;
  def.max_threads_per_threadgroup = 1024;
  def.threads_per_group = threads;
  def.tile_x = tile_x;
  def.tile_y = tile_y;
  def.threadgroup_memory_bytes = shmem;
  def.origin = "builtin_cpu";
  def.content_sha256 = ROUTEMM_CPU_QUANTIZED_MATMUL_ID_SHA256;
  def.check_args = kernels::kernel_arg_contract(name);
  return def;
}

// Registers one route set's kernels, named in the order direct Q4_0, direct Q8_0, grouped Q4_0,
// grouped Q8_0, with the geometry of dense_matmul_id's pipelines (the front door sizes grids from
// it; the CPU kernels split the work their own way): direct 64 threads, 8 columns x 1 flat row per
// group; grouped 256 threads, 8 routed rows x 8 columns x 1 expert, 4096 bytes.
void add_route_set(std::vector<KernelDef>& out, const std::array<std::string_view, 4>& names,
                   const std::array<KernelFn, 4>& fns) {
  for (size_t i = 0; i < names.size(); ++i) {
    out.push_back(i < 2 ? make_def(names[i], fns[i], 64, 8, 1, 0)
                        : make_def(names[i], fns[i], 256, 8, 8, 4096));
  }
}

}  // namespace

void add_quantized_matmul_id_kernels(std::vector<KernelDef>& out) {
  using ggml::Q4_0Format;
  using ggml::Q8_0Format;
  constexpr auto names = kGgmlQuantizedMatmulIdPipelineNames;
  static_assert(names[0] == "quantized_matmul_id_direct_q4_0_f32" &&
                names[1] == "quantized_matmul_id_direct_q8_0_f32" &&
                names[2] == "quantized_matmul_id_grouped_q4_0_f32" &&
                names[3] == "quantized_matmul_id_grouped_q8_0_f32");
  add_route_set(out, names,
                {direct_kernel<Q4_0Format>, direct_kernel<Q8_0Format>, grouped_kernel<Q4_0Format>,
                 grouped_kernel<Q8_0Format>});
  out.push_back(make_def(kGgmlQuantizedMatmulIdQ8_0Nr2Pipeline, direct_nr2_kernel,
                         kQ8_0MatVecNr2Threads, kQ8_0MatVecNr2Rows, 1,
                         kQ8_0MatVecNr2ThreadgroupBytes));
  // The int8-dot routes, with the exact routes' geometry. Every CPU has them (the portable clone
  // is exact integer arithmetic too).
  constexpr auto i8 = kGgmlQuantizedMatmulIdInt8DotPipelineNames;
  static_assert(i8[0] == "quantized_matmul_id_direct_int8dot_q4_0_f32" &&
                i8[1] == "quantized_matmul_id_direct_int8dot_q8_0_f32" &&
                i8[2] == "quantized_matmul_id_grouped_int8dot_q4_0_f32" &&
                i8[3] == "quantized_matmul_id_grouped_int8dot_q8_0_f32");
  add_route_set(out, i8,
                {direct_int8_kernel<Q4_0Format>, direct_int8_kernel<Q8_0Format>,
                 grouped_int8_kernel<Q4_0Format>, grouped_int8_kernel<Q8_0Format>});
}

}  // namespace routemm::cpu
