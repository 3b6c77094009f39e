// CPU kernels of the GGML block formats beyond Q4_0 / Q8_0 (ggml_formats.h kKernelFormats: Q4_1,
// Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K): the dense mat-vec and matrix pipelines
// kernel_mul_{mv,mm}_F_f32 and the expert-ID direct and grouped routes
// quantized_matmul_id_{direct,grouped}_F_f32, with the slots, params and geometry of the Q8_0
// pipelines of the same kinds.
//
// NUMERIC CONTRACT (ggml_block_kernels.h's, for every format):
//   1. Weights are the exact floats ggml's to_float gives: each block is decoded by the codec
//      table's dequantiser (ggml_formats.cpp, one definition per format, compiled without FP
//      contraction, so K-quant values are d1 * q - m1 with both roundings). K-quant super-blocks
//      are decoded whole, which is their eight 32-value sub-blocks each with its own scale/min.
//   2. Eight lane accumulators start at +0.0f; lane l visits i = l, l + 8, ... < K in increasing
//      order and does acc[l] = fma(w[col, i], x[row, i], acc[l]). K is a multiple of the block.
//   3. The lanes are summed once in simd::reduce_lanes' fixed tree.
// Every route, work split, thread count and instruction-set clone (portable, AVX2, AVX-512:
// they differ only in how many FMAs run per instruction) gives every output these bits, so
// mat-vec == matrix == direct == grouped on the same expert matrix.
//
// Work is done in items of at most 64 rows x 64 output columns: a 64 x 256 weight panel is
// decoded into thread-local scratch once per item and panel, then register tiles of rows x
// columns run the FMA loop over it. Rows are addressed through pointers, so the expert-ID routes
// read their routed rows in place. At m <= 8 (dense, direct, and grouped items of at most 8 rows)
// every format instead runs ggml_block_kernels.h's mat-vec, which decodes each 32-value (sub-)
// block into registers and uses it at once (a panel would store, reload and use each decoded
// weight once at m = 1); its decoders give the codec's floats, so the bits are the same.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "ggml_block_kernels.h"
#include "ggml_kquant_int8_dot.h"
#include "grouped_items.h"
#include "kernels.h"
#include "neon_kernels.h"
#include "routemm/checked.h"
#include "routemm/error.h"
#include "routemm/ggml_formats.h"
#include "routemm/ops/q4_matmul.h"
#include "simd.h"
#include "thread_pool.h"

#if ROUTEMM_CPU_HAVE_AVX2 || ROUTEMM_CPU_HAVE_AVX512
#include <immintrin.h>
#endif

#ifndef ROUTEMM_CPU_GGML_FORMAT_KERNELS_SHA256
#define ROUTEMM_CPU_GGML_FORMAT_KERNELS_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::DenseMatmulIdKernelParams;
using kernels::GgmlMatmulMmParams;
using kernels::GgmlMatmulMvParams;
using simd::kLanes;

// ---- Formats ------------------------------------------------------------------------------------

// A format's block geometry and its block decoder (the codec table's), looked up once.
struct BlockFormat {
  size_t values;  // per block (32, or 256 for a K-quant super-block)
  size_t bytes;   // per block
  void (*decode)(const uint8_t* block, float* out);
};

BlockFormat block_format(const ggml_formats::KernelFormat& kf) {
  const ggml_formats::Format& f = ggml_formats::format(kf.name);
  if (f.block_values != kf.block_values || f.block_bytes != kf.block_bytes) {
    throw Error("ggml format kernels: the geometry of " + std::string(kf.name) +
                " differs from the codec table's");
  }
  BlockFormat out{f.block_values, f.block_bytes, f.dequantize_block};
#if ROUTEMM_CPU_HAVE_AVX2
  // The K-quants' vector dequantiser where the clone may use AVX2: the same floats.
  if (simd::has_avx2_fma()) {
    using ggml::kint8::KFormat;
    if (kf.name == "q4_k") out.decode = ggml::kint8::dequantize_avx2<KFormat::q4_k>;
    if (kf.name == "q5_k") out.decode = ggml::kint8::dequantize_avx2<KFormat::q5_k>;
    if (kf.name == "q6_k") out.decode = ggml::kint8::dequantize_avx2<KFormat::q6_k>;
  }
#endif
  return out;
}

// The format's in-register block decoder (ggml_block_kernels.h: each 32-value block decoded into
// registers and used at once by the mat-vec micro-kernels), or void where it has none.
template <size_t Index>
constexpr auto mv_format_tag() {
  constexpr std::string_view name = ggml_formats::kKernelFormats[Index].name;
  if constexpr (name == "q4_1") {
    return std::type_identity<ggml::Q4_1Format>{};
  } else if constexpr (name == "q5_0") {
    return std::type_identity<ggml::Q5_0Format>{};
  } else if constexpr (name == "q5_1") {
    return std::type_identity<ggml::Q5_1Format>{};
  } else if constexpr (name == "mxfp4") {
    return std::type_identity<ggml::Mxfp4Format>{};
  } else if constexpr (name == "q4_k") {
    return std::type_identity<ggml::Q4_KFormat>{};
  } else if constexpr (name == "q5_k") {
    return std::type_identity<ggml::Q5_KFormat>{};
  } else if constexpr (name == "q6_k") {
    return std::type_identity<ggml::Q6_KFormat>{};
  } else {
    return std::type_identity<void>{};
  }
}
template <size_t Index>
using MvFormat = typename decltype(mv_format_tag<Index>())::type;

// Rows up to which a product of a format with an in-register decoder runs the mat-vec
// micro-kernels instead of decoded panels.
constexpr size_t kMvMaxRows = ggml::kMaxMvRows;

// ---- Micro-kernels ------------------------------------------------------------------------------

constexpr size_t kPanelDepth = 256;  // positions per decoded panel (a multiple of every block)
constexpr size_t kItemCols = 64;     // output columns per item
constexpr size_t kItemRows = 64;     // rows per item
constexpr size_t kPanelCols = 66;    // kItemCols rounded up to whole register tiles (3 and 6)
static_assert(kPanelCols >= kItemCols && kPanelCols % 3 == 0 && kPanelCols % 6 == 0);

// acc[r * acc_stride + c * 8 + l] += lane l's FMA steps over positions [k0, k0 + depth) of rows
// x[r] (R rows) and panel columns w + c * kPanelDepth (C columns); depth a multiple of 8.
struct PortableIsa {
  static constexpr size_t kTileRows = 4, kTileCols = 3;
  template <size_t R, size_t C>
  static void tile(const float* const* x, size_t k0, const float* w, size_t depth, float* acc,
                   size_t acc_stride) {
    for (size_t r = 0; r < R; ++r) {
      const float* xr = x[r] + k0;
      for (size_t c = 0; c < C; ++c) {
        float a[kLanes];
        float* dst = acc + r * acc_stride + c * kLanes;
        std::copy(dst, dst + kLanes, a);
        const float* wc = w + c * kPanelDepth;
        for (size_t i = 0; i < depth; i += kLanes) {
          for (size_t l = 0; l < kLanes; ++l) a[l] = std::fma(wc[i + l], xr[i + l], a[l]);
        }
        std::copy(a, a + kLanes, dst);
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
struct Avx2Isa {
  static constexpr size_t kTileRows = 4, kTileCols = 3;  // 12 of 16 registers accumulate
  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void tile(const float* const* x, size_t k0, const float* w, size_t depth,
                                    float* acc, size_t acc_stride) {
    __m256 a[R][C];
    const float* xr[R];
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r) {
      xr[r] = x[r] + k0;
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    }
    for (size_t i = 0; i < depth; i += kLanes) {
      __m256 wv[C];
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * kPanelDepth + i);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xr[r] + i);
#pragma GCC unroll 6
        for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
      }
    }
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

#if ROUTEMM_CPU_HAVE_AVX512
// The AVX2 loop with the AVX-512 register file: eight-lane accumulators still (a lane's steps are
// serial), 24 of 32 registers accumulating.
struct Avx512Isa {
  static constexpr size_t kTileRows = 4, kTileCols = 6;
  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX512 static void tile(const float* const* x, size_t k0, const float* w,
                                      size_t depth, float* acc, size_t acc_stride) {
    __m256 a[R][C];
    const float* xr[R];
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r) {
      xr[r] = x[r] + k0;
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    }
    for (size_t i = 0; i < depth; i += kLanes) {
      __m256 wv[C];
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * kPanelDepth + i);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(xr[r] + i);
#pragma GCC unroll 6
        for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
      }
    }
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 6
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

template <class Isa, size_t R = Isa::kTileRows>
void tile_rows(size_t rows, const float* const* x, size_t k0, const float* w, size_t depth,
               float* acc, size_t acc_stride) {
  if constexpr (R > 1) {
    if (rows < R) {
      tile_rows<Isa, R - 1>(rows, x, k0, w, depth, acc, acc_stride);
      return;
    }
  }
  Isa::template tile<R, Isa::kTileCols>(x, k0, w, depth, acc, acc_stride);
}

// One item: rows x[0, rows) (each k floats) times weight rows [col0, col0 + cols) of `weight`
// (row_bytes apart), written to out[r][col0 + c]; rows <= kItemRows, cols <= kItemCols.
struct Item {
  const uint8_t* weight;
  size_t row_bytes, k;
  const float* const* x;
  float* const* out;
  size_t rows, col0, cols;
};

struct Scratch {
  std::vector<float> panel, acc;
  std::vector<float> rows;  // gathered activation rows of an in-register mat-vec item
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <class Isa>
void run_item(const BlockFormat& f, const Item& it) {
  constexpr size_t kTileRows = Isa::kTileRows, kTileCols = Isa::kTileCols;
  Scratch& s = scratch();
  const size_t acc_stride = kPanelCols * kLanes;
  s.panel.resize(kPanelCols * kPanelDepth);
  s.acc.resize(std::max(s.acc.size(), it.rows * acc_stride));
  float* panel = s.panel.data();
  float* acc = s.acc.data();
  std::fill(acc, acc + it.rows * acc_stride, 0.0f);
  const size_t cols_pad = (it.cols + kTileCols - 1) / kTileCols * kTileCols;
  if (it.rows <= kTileRows) {
    // Few rows: one tile of columns at a time along all of K, its panel (kTileCols x 256 floats)
    // staying in L1 instead of the item's 64 columns going through L2. The same tiles over the
    // same panels, in another order: every output's steps are unchanged.
    for (size_t c0 = 0; c0 < cols_pad; c0 += kTileCols) {
      for (size_t k0 = 0; k0 < it.k; k0 += kPanelDepth) {
        const size_t depth = std::min(kPanelDepth, it.k - k0);
        for (size_t c = 0; c < kTileCols; ++c) {
          float* dst = panel + c * kPanelDepth;
          if (c0 + c >= it.cols) {
            std::fill(dst, dst + depth, 0.0f);  // padding: never stored
            continue;
          }
          const uint8_t* row =
              it.weight + (it.col0 + c0 + c) * it.row_bytes + k0 / f.values * f.bytes;
          for (size_t b = 0; b < depth / f.values; ++b) {
            f.decode(row + b * f.bytes, dst + b * f.values);
          }
        }
        tile_rows<Isa>(it.rows, it.x, k0, panel, depth, acc + c0 * kLanes, acc_stride);
      }
    }
  } else {
    for (size_t k0 = 0; k0 < it.k; k0 += kPanelDepth) {
      const size_t depth = std::min(kPanelDepth, it.k - k0);  // whole blocks: k % values == 0
      for (size_t c = 0; c < it.cols; ++c) {
        const uint8_t* row = it.weight + (it.col0 + c) * it.row_bytes + k0 / f.values * f.bytes;
        for (size_t b = 0; b < depth / f.values; ++b) {
          f.decode(row + b * f.bytes, panel + c * kPanelDepth + b * f.values);
        }
      }
      // Ask for the next panel's weight bytes now: a short segment of each of up to 64 rows, which
      // the hardware prefetchers do not predict, arrives while this panel's tiles run.
      if (k0 + kPanelDepth < it.k) {
        const size_t next_bytes =
            std::min(kPanelDepth, it.k - k0 - kPanelDepth) / f.values * f.bytes;
        for (size_t c = 0; c < it.cols; ++c) {
          const uint8_t* next =
              it.weight + (it.col0 + c) * it.row_bytes + (k0 + kPanelDepth) / f.values * f.bytes;
          for (size_t off = 0; off < next_bytes; off += 64) __builtin_prefetch(next + off);
          __builtin_prefetch(next + next_bytes - 1);
        }
      }
      // Padded columns are zero weights whose results are never stored.
      for (size_t c = it.cols; c < cols_pad; ++c) {
        std::fill(panel + c * kPanelDepth, panel + c * kPanelDepth + depth, 0.0f);
      }
      for (size_t c = 0; c < cols_pad; c += kTileCols) {
        for (size_t r = 0; r < it.rows; r += kTileRows) {
          tile_rows<Isa>(std::min(kTileRows, it.rows - r), it.x + r, k0, panel + c * kPanelDepth,
                         depth, acc + r * acc_stride + c * kLanes, acc_stride);
        }
      }
    }
  }
  for (size_t r = 0; r < it.rows; ++r) {
    for (size_t c = 0; c < it.cols; ++c) {
      it.out[r][it.col0 + c] = simd::reduce_lanes(acc + r * acc_stride + c * kLanes);
    }
  }
}

using RunItem = void (*)(const BlockFormat&, const Item&);

// The clone this process runs (the best the CPU has, capped by ROUTEMM_CPU_ISA).
RunItem run_item_for_isa() {
#if ROUTEMM_CPU_HAVE_AVX512
  if (simd::has_avx512()) return run_item<Avx512Isa>;
#endif
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) return run_item<Avx2Isa>;
#endif
#if ROUTEMM_CPU_HAVE_NEON
  if (simd::has_neon()) return run_item<neon::FormatTileIsa<kPanelDepth>>;
#endif
  return run_item<PortableIsa>;
}

// ---- Launch helpers -----------------------------------------------------------------------------

[[noreturn]] void launch_error(const KernelLaunch& launch, const std::string& what) {
  throw Error(launch.label + ": " + what);
}

size_t checked_mul(size_t a, size_t b) {
  return routemm::checked_mul(a, b, "ggml format cpu kernel size");
}
size_t checked_add(size_t a, size_t b) {
  return routemm::checked_add(a, b, "ggml format cpu kernel size");
}

void* arg_data(const KernelLaunch& launch, size_t slot, size_t need, const char* what) {
  return kernels::launch_arg(launch, slot, what, need).data;
}

// Runs body(begin, end) over [0, n) on the launch's pool (inline without one).
template <class Body>
void parallel(void* queue_native, size_t n, const Body& body) {
  auto* pool = static_cast<ThreadPool*>(queue_native);
  if (pool == nullptr) {
    body(size_t{0}, n);
  } else {
    pool->parallel_for(n, 1, body);
  }
}

// ---- Dense routes -------------------------------------------------------------------------------

struct Dense {
  const uint8_t* weight;
  const float* input;
  float* output;
  size_t m, n, k, row_bytes;
};

Dense bind_dense(const KernelLaunch& launch, const BlockFormat& f, size_t m, size_t n, size_t k,
                 size_t weight_slot, size_t input_slot, size_t output_slot) {
  if (m == 0 || n == 0 || k == 0 || k % f.values != 0) {
    launch_error(launch, "params have a zero extent or K that is not a multiple of the block");
  }
  const size_t row_bytes = k / f.values * f.bytes;
  return Dense{static_cast<const uint8_t*>(
                   arg_data(launch, weight_slot, checked_mul(n, row_bytes), "weight")),
               static_cast<const float*>(
                   arg_data(launch, input_slot, checked_mul(checked_mul(m, k), 4), "input")),
               static_cast<float*>(
                   arg_data(launch, output_slot, checked_mul(checked_mul(m, n), 4), "output")),
               m,
               n,
               k,
               row_bytes};
}

// Every item of a dense product (kItemRows rows x kItemCols columns), on the launch's pool.
void run_dense(const BlockFormat& f, const Dense& d, void* queue_native) {
  const RunItem run = run_item_for_isa();
  const size_t col_items = (d.n + kItemCols - 1) / kItemCols;
  const size_t row_items = (d.m + kItemRows - 1) / kItemRows;
  parallel(queue_native, row_items * col_items, [&](size_t begin, size_t end) {
    const float* x[kItemRows];
    float* out[kItemRows];
    for (size_t item = begin; item < end; ++item) {
      const size_t row0 = item % row_items * kItemRows, col0 = item / row_items * kItemCols;
      const size_t rows = std::min(kItemRows, d.m - row0);
      for (size_t r = 0; r < rows; ++r) {
        x[r] = d.input + (row0 + r) * d.k;
        out[r] = d.output + (row0 + r) * d.n;
      }
      run(f, Item{d.weight, d.row_bytes, d.k, x, out, rows, col0, std::min(kItemCols, d.n - col0)});
    }
  });
}

// The exact dense product of kKernelFormats[Index]: up to kMvMaxRows rows through the in-register
// mat-vec where the format has one (every weight is decoded once, into registers, and used at
// once), else the panel items. Same bits either way (the contract).
template <size_t Index>
void run_dense_exact(const BlockFormat& f, const Dense& d, void* queue_native) {
  using F = MvFormat<Index>;
  if constexpr (!std::is_void_v<F>) {
    if (d.m <= kMvMaxRows) {
      const ggml::MvRange mv = ggml::mv_range_for<F>(d.m);
      const ggml::Operands ops{d.weight, d.input, d.output, d.m, d.n, d.k, d.row_bytes};
      const size_t items = (d.n + kItemCols - 1) / kItemCols;
      parallel(queue_native, items, [&](size_t begin, size_t end) {
        for (size_t item = begin; item < end; ++item) {
          mv(ops, item * kItemCols, std::min(d.n, (item + 1) * kItemCols));
        }
      });
      return;
    }
  }
  run_dense(f, d, queue_native);
}

constexpr size_t kMvThreadgroupOutputs = 8;  // the Q8_0 mat-vec's geometry
constexpr size_t kMmTokenTile = 32;          // the Q8_0 matrix route's
constexpr size_t kMmOutputTile = 64;

using RunDense = void (*)(const BlockFormat&, const Dense&, void*);

// The mat-vec and matrix pipelines of Formats[Index] (kKernelFormats with run_dense, or
// kKQuantInt8DotFormats with the int8-dot runner): one launch check, the runner's arithmetic.
template <const auto& Formats, size_t Index, RunDense Run = run_dense>
void mv_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(Formats[Index]);
  const auto p = kernels::launch_params<GgmlMatmulMvParams>(launch, 3);
  if (p.ne00 != p.ne10 || p.ne01 != p.ne0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 || p.r3 != 1 ||
      p.ne1 <= 0 || p.ne0 <= 0 || p.ne00 <= 0) {
    launch_error(launch, "inconsistent mat-vec params");
  }
  const Dense d = bind_dense(launch, f, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                             static_cast<size_t>(p.ne00), 0, 1, 2);
  if (launch.grid.x != (d.n + kMvThreadgroupOutputs - 1) / kMvThreadgroupOutputs ||
      launch.grid.y != d.m || launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the mat-vec geometry");
  }
  Run(f, d, queue_native);
}

template <const auto& Formats, size_t Index, RunDense Run = run_dense>
void mm_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(Formats[Index]);
  const auto p = kernels::launch_params<GgmlMatmulMmParams>(launch, 0);
  if (p.ne00 <= 0 || p.ne0 <= 0 || p.ne1 <= 0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 ||
      p.r3 != 1 || p.nb10 != 4 || p.nb11 != uint64_t(p.ne00) * 4 ||
      p.nb01 != uint64_t(p.ne00) / f.values * f.bytes) {
    launch_error(launch,
                 "inconsistent matrix params (only contiguous batch-1 inputs are supported)");
  }
  const Dense d = bind_dense(launch, f, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                             static_cast<size_t>(p.ne00), 1, 2, 3);
  if (launch.grid.x != (d.m + kMmTokenTile - 1) / kMmTokenTile ||
      launch.grid.y != (d.n + kMmOutputTile - 1) / kMmOutputTile || launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the route's 32 x 64 tile");
  }
  Run(f, d, queue_native);
}

// ---- Expert-ID routes ---------------------------------------------------------------------------

// The launch's expert-ID params and operands; rows are addressed by flat = token * top_k + slot.
struct Experts {
  const uint8_t* weights;
  const unsigned char* input;
  float* output;
  DenseMatmulIdKernelParams p;
  size_t row_bytes;

  static Experts bind(const KernelLaunch& launch, const BlockFormat& f, size_t out_slot) {
    const auto p = kernels::launch_params<DenseMatmulIdKernelParams>(launch, 0);
    if (p.m == 0 || p.n == 0 || p.k == 0 || p.top_k == 0 || p.n_experts == 0 ||
        p.k % f.values != 0) {
      launch_error(launch, "params have a zero extent or K that is not a multiple of the block");
    }
    const size_t row_bytes = p.k / f.values * f.bytes;
    const size_t matrix = checked_mul(p.n, row_bytes);
    const size_t weight_bytes =
        checked_add(checked_mul(p.n_experts - 1, p.expert_stride_bytes), matrix);
    const size_t last_input = checked_add(checked_mul(p.m - 1, p.input_token_stride_bytes),
                                          checked_mul(p.top_k - 1, p.input_slot_stride_bytes));
    const size_t input_bytes = checked_add(last_input, checked_mul(p.k, sizeof(float)));
    const size_t rows = checked_mul(p.m, p.top_k);
    return Experts{static_cast<const uint8_t*>(arg_data(launch, 1, weight_bytes, "weights")),
                   static_cast<const unsigned char*>(arg_data(launch, 2, input_bytes, "input")),
                   static_cast<float*>(arg_data(launch, out_slot,
                                                checked_mul(checked_mul(rows, p.n), 4), "output")),
                   p, row_bytes};
  }

  const float* input_row(size_t flat) const {
    const size_t token = flat / p.top_k, slot = flat - token * p.top_k;
    return reinterpret_cast<const float*>(input + token * p.input_token_stride_bytes +
                                          slot * p.input_slot_stride_bytes);
  }
  float* output_row(size_t flat) const { return output + flat * p.n; }
  const uint8_t* expert(uint32_t id) const { return weights + size_t{id} * p.expert_stride_bytes; }
};

// Runs run(flat, id, col0, cols, out) on every item of a direct launch (one routed row x a column
// chunk of `chunk`, item = flat * chunks + chunk index) whose id is valid, on the launch's pool; an
// id >= n_experts zeroes its row and forms no weight address.
template <class Run>
void for_each_direct_item(const KernelLaunch& launch, void* queue_native, const Experts& e,
                          size_t chunk, const Run& run) {
  const size_t rows = size_t{e.p.m} * e.p.top_k;
  const auto* ids =
      static_cast<const uint32_t*>(arg_data(launch, 3, checked_mul(rows, 4), "expert ids"));
  const size_t chunks = (size_t{e.p.n} + chunk - 1) / chunk;
  parallel(queue_native, rows * chunks, [&](size_t begin, size_t end) {
    for (size_t item = begin; item < end; ++item) {
      const size_t flat = item / chunks;
      const size_t col0 = (item - flat * chunks) * chunk;
      const size_t cols = std::min<size_t>(e.p.n - col0, chunk);
      float* out = e.output_row(flat);
      const uint32_t id = ids[flat];
      if (id >= e.p.n_experts) {
        std::fill(out + col0, out + col0 + cols, 0.0f);
        continue;
      }
      run(flat, id, col0, cols, out);
    }
  });
}

// One routed row x a column chunk per item (for_each_direct_item).
template <size_t Index>
void direct_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(ggml_formats::kKernelFormats[Index]);
  const Experts e = Experts::bind(launch, f, 4);
  const size_t rows = size_t{e.p.m} * e.p.top_k;
  using F = MvFormat<Index>;
  // In-register formats: one row's mat-vec over a column chunk (quantized_matmul_id.cpp's
  // split); the others: panel items of kItemCols columns.
  constexpr bool kMv = !std::is_void_v<F>;
  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t chunk =
      kMv ? direct_item_columns(rows, e.p.n, pool == nullptr ? 1 : pool->size()) : kItemCols;
  const RunItem run = run_item_for_isa();
  ggml::MvRange mv = nullptr;
  if constexpr (kMv) mv = ggml::mv_range_for<F>(1);
  for_each_direct_item(launch, queue_native, e, chunk,
                       [&](size_t flat, uint32_t id, size_t col0, size_t cols, float* out) {
                         const float* x = e.input_row(flat);
                         if constexpr (kMv) {
                           mv(ggml::Operands{e.expert(id), x, out, 1, e.p.n, e.p.k, e.row_bytes},
                              col0, col0 + cols);
                         } else {
                           run(f, Item{e.expert(id), e.row_bytes, e.p.k, &x, &out, 1, col0, cols});
                         }
                       });
}

// The map's routed-row list (dense_matmul_id's map kernel: expert e's flat rows are the segment
// after the counts of the experts before it), checked against the flat rows since a stale or
// foreign scratch would otherwise index out of bounds, cut into items of at most kItemRows rows x
// kItemCols columns of one expert, largest first.
std::vector<GroupedItem> grouped_items(const KernelLaunch& launch,
                                       const DenseMatmulIdKernelParams& p,
                                       const uint32_t*& routed) {
  const size_t rows = size_t{p.m} * p.top_k;
  const auto* counts = static_cast<const uint32_t*>(
      arg_data(launch, 3, checked_mul(p.n_experts, 4), "expert counts"));
  size_t total = 0;
  for (size_t e = 0; e < p.n_experts; ++e) {
    total += counts[e];
    if (total > rows) launch_error(launch, "expert counts exceed the flat rows");
  }
  routed = static_cast<const uint32_t*>(arg_data(launch, 4, checked_mul(total, 4), "routed rows"));
  for (size_t i = 0; i < total; ++i) {
    if (routed[i] >= rows) launch_error(launch, "routed row out of range");
  }
  std::vector<GroupedItem> items;
  size_t start = 0;
  for (size_t e = 0; e < p.n_experts; ++e) {
    const size_t count = counts[e];
    for (size_t row0 = 0; row0 < count; row0 += kItemRows) {
      const auto item_rows = static_cast<uint32_t>(std::min(kItemRows, count - row0));
      for (size_t col0 = 0; col0 < p.n; col0 += kItemCols) {
        items.push_back({static_cast<uint32_t>(e), static_cast<uint32_t>(start + row0), item_rows,
                         static_cast<uint32_t>(col0)});
      }
    }
    start += count;
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const GroupedItem& a, const GroupedItem& b) { return a.rows > b.rows; });
  return items;
}

template <size_t Index>
void grouped_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(ggml_formats::kKernelFormats[Index]);
  const Experts e = Experts::bind(launch, f, 5);
  const uint32_t* routed = nullptr;
  const std::vector<GroupedItem> items = grouped_items(launch, e.p, routed);
  if (items.empty()) return;
  const RunItem run = run_item_for_isa();
  using F = MvFormat<Index>;
  const auto run_one = [&](const GroupedItem& item) {
    const float* x[kItemRows];
    float* out[kItemRows];
    for (size_t r = 0; r < item.rows; ++r) {
      x[r] = e.input_row(routed[item.row0 + r]);
      out[r] = e.output_row(routed[item.row0 + r]);
    }
    const size_t cols = std::min<size_t>(kItemCols, e.p.n - item.col0);
    if constexpr (!std::is_void_v<F>) {
      if (item.rows <= kMvMaxRows) {
        // The mat-vec reads its rows k floats apart: the item's rows gathered first.
        std::vector<float>& rows = scratch().rows;
        rows.resize(std::max(rows.size(), size_t{item.rows} * e.p.k));
        for (size_t r = 0; r < item.rows; ++r) {
          std::memcpy(rows.data() + r * e.p.k, x[r], size_t{e.p.k} * sizeof(float));
        }
        ggml::Operands ops{
            e.expert(item.expert), rows.data(), nullptr, item.rows, e.p.n, e.p.k, e.row_bytes};
        ops.output_rows = out;
        ggml::mv_range_for<F>(item.rows)(ops, item.col0, item.col0 + cols);
        return;
      }
    }
    run(f, Item{e.expert(item.expert), e.row_bytes, e.p.k, x, out, item.rows, item.col0, cols});
  };
  run_grouped_items(queue_native, items, run_one);
}

// ---- K-quant int8-dot routes (ggml_kquant_int8_dot.h) -------------------------------------------
//
// Every route rounds each distinct activation row once per call (contract step 1), then runs the
// clone's item, which computes every output from its weight row and its rounded activation row
// alone: dense == direct == grouped bit for bit, whatever the split.

using ggml::kint8::KFormat;
static_assert(kItemRows <= ggml::kint8::kMaxItemRows && kItemCols <= ggml::kint8::kMaxItemCols);

template <size_t Index>
constexpr KFormat kint8_format() {
  constexpr std::string_view name = ggml_formats::kKQuantInt8DotFormats[Index].name;
  static_assert(name == "q4_k" || name == "q5_k" || name == "q6_k");
  return name == "q4_k" ? KFormat::q4_k : name == "q5_k" ? KFormat::q5_k : KFormat::q6_k;
}

template <size_t Index>
void run_dense_int8(const BlockFormat& f, const Dense& d, void* queue_native) {
  ggml::kint8::Rows x;
  x.resize(d.m, d.k);
  parallel(queue_native, d.m, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r) ggml::kint8::quantize_row(d.input + r * d.k, d.k, x, r);
  });
  const ggml::kint8::Item run = ggml::kint8::item_for_isa<kint8_format<Index>()>();
  const size_t col_items = (d.n + kItemCols - 1) / kItemCols;
  const size_t row_items = (d.m + kItemRows - 1) / kItemRows;
  parallel(queue_native, row_items * col_items, [&](size_t begin, size_t end) {
    size_t rows_of[kItemRows];
    float* out[kItemRows];
    for (size_t item = begin; item < end; ++item) {
      const size_t row0 = item % row_items * kItemRows, col0 = item / row_items * kItemCols;
      const size_t rows = std::min(kItemRows, d.m - row0);
      for (size_t r = 0; r < rows; ++r) {
        rows_of[r] = row0 + r;
        out[r] = d.output + (row0 + r) * d.n;
      }
      run(d.weight, d.row_bytes, f.bytes, x, rows_of, rows, out, col0,
          std::min(kItemCols, d.n - col0));
    }
  });
}

// The routed rows' activations, rounded once: one row per token when every slot reads the token's
// row (slot stride 0), else one per flat row.
struct RoundedInputs {
  ggml::kint8::Rows rows;
  bool per_token = false;
  uint32_t top_k = 1;

  RoundedInputs(const Experts& e, void* queue_native)
      : per_token(e.p.input_slot_stride_bytes == 0), top_k(e.p.top_k) {
    const size_t count = per_token ? size_t{e.p.m} : size_t{e.p.m} * e.p.top_k;
    rows.resize(count, e.p.k);
    parallel(queue_native, count, [&](size_t begin, size_t end) {
      for (size_t r = begin; r < end; ++r) {
        ggml::kint8::quantize_row(e.input_row(per_token ? r * top_k : r), e.p.k, rows, r);
      }
    });
  }
  size_t index(size_t flat) const { return per_token ? flat / top_k : flat; }
};

template <size_t Index>
void direct_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(ggml_formats::kKQuantInt8DotFormats[Index]);
  const Experts e = Experts::bind(launch, f, 4);
  const RoundedInputs x(e, queue_native);
  const ggml::kint8::Item run = ggml::kint8::item_for_isa<kint8_format<Index>()>();
  for_each_direct_item(launch, queue_native, e, kItemCols,
                       [&](size_t flat, uint32_t id, size_t col0, size_t cols, float* out) {
                         const size_t row = x.index(flat);
                         run(e.expert(id), e.row_bytes, f.bytes, x.rows, &row, 1, &out, col0, cols);
                       });
}

template <size_t Index>
void grouped_int8_kernel(const KernelLaunch& launch, void* queue_native) {
  static const BlockFormat f = block_format(ggml_formats::kKQuantInt8DotFormats[Index]);
  const Experts e = Experts::bind(launch, f, 5);
  const uint32_t* routed = nullptr;
  const std::vector<GroupedItem> items = grouped_items(launch, e.p, routed);
  if (items.empty()) return;
  const RoundedInputs x(e, queue_native);
  const ggml::kint8::Item run = ggml::kint8::item_for_isa<kint8_format<Index>()>();
  const auto run_one = [&](const GroupedItem& item) {
    size_t rows_of[kItemRows];
    float* out[kItemRows];
    for (size_t r = 0; r < item.rows; ++r) {
      rows_of[r] = x.index(routed[item.row0 + r]);
      out[r] = e.output_row(routed[item.row0 + r]);
    }
    run(e.expert(item.expert), e.row_bytes, f.bytes, x.rows, rows_of, item.rows, out, item.col0,
        std::min<size_t>(kItemCols, e.p.n - item.col0));
  };
  run_grouped_items(queue_native, items, run_one);
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
  def.content_sha256 = ROUTEMM_CPU_GGML_FORMAT_KERNELS_SHA256;
  return def;
}

template <size_t Index>
void add_format(std::vector<KernelDef>& out) {
  const ggml_formats::KernelFormat& kf = ggml_formats::kKernelFormats[Index];
  block_format(kf);  // the codec table has the format, with this geometry
  // The geometry of the Q8_0 pipelines of the same kinds (q4_matmul.cpp, quantized_matmul_id.cpp).
  constexpr auto& formats = ggml_formats::kKernelFormats;
  constexpr RunDense run = run_dense_exact<Index>;
  out.push_back(
      make_def(kf.mat_vec, mv_kernel<formats, Index, run>, 64, kMvThreadgroupOutputs, 1, 0));
  out.push_back(
      make_def(kf.matrix, mm_kernel<formats, Index, run>, 128, kMmTokenTile, kMmOutputTile, 8192));
  out.push_back(make_def(kf.id_direct, direct_kernel<Index>, 64, 8, 1, 0));
  out.push_back(make_def(kf.id_grouped, grouped_kernel<Index>, 256, 8, 8, 4096));
}

// The K-quant int8-dot pipelines, with the geometry of the format's exact ones.
template <size_t Index>
void add_int8_format(std::vector<KernelDef>& out) {
  constexpr auto& formats = ggml_formats::kKQuantInt8DotFormats;
  const ggml_formats::KernelFormat& kf = formats[Index];
  block_format(kf);
  constexpr RunDense run = run_dense_int8<Index>;
  out.push_back(
      make_def(kf.mat_vec, mv_kernel<formats, Index, run>, 64, kMvThreadgroupOutputs, 1, 0));
  out.push_back(
      make_def(kf.matrix, mm_kernel<formats, Index, run>, 128, kMmTokenTile, kMmOutputTile, 8192));
  out.push_back(make_def(kf.id_direct, direct_int8_kernel<Index>, 64, 8, 1, 0));
  out.push_back(make_def(kf.id_grouped, grouped_int8_kernel<Index>, 256, 8, 8, 4096));
}

template <size_t... I>
void add_formats(std::vector<KernelDef>& out, std::index_sequence<I...>) {
  (add_format<I>(out), ...);
}

template <size_t... I>
void add_int8_formats(std::vector<KernelDef>& out, std::index_sequence<I...>) {
  (add_int8_format<I>(out), ...);
}

}  // namespace

void add_ggml_format_kernels(std::vector<KernelDef>& out) {
  add_formats(out, std::make_index_sequence<ggml_formats::kKernelFormats.size()>{});
  add_int8_formats(out, std::make_index_sequence<ggml_formats::kKQuantInt8DotFormats.size()>{});
}

}  // namespace routemm::cpu
