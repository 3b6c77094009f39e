// CPU kernels of the GGML Q4_0 dense projection (spec §5.5, §5.6): the mat-vec pipeline
// kernel_mul_mv_q4_0_f32 and the four matrix routes kernel_mul_mm_q4_0_{f32, tensor_f32,
// tensor_v2_f32, tensor_64x32_f32}.
//
// NUMERIC CONTRACT (every pipeline here; they are therefore bit-identical to each other, and in
// particular V2 == 64x32): every output out[row, col] is computed as follows, whatever the thread
// count, work split, token tile, micro-kernel tile or instruction set.
//   1. Weights are dequantised exactly: w[col, i] = d * (nibble - 8) with d the block's binary16
//      scale widened to binary32. The product of an 11-bit significand and an integer in [-8, 7]
//      fits binary32, so no rounding happens (NaN/inf scales propagate as IEEE arithmetic says).
//   2. Eight lane accumulators start at +0.0f. Lane l visits i = l, l + 8, l + 16, ... < K in
//      increasing order and does acc[l] = fma(w[col, i], x[row, i], acc[l]): one correctly rounded
//      binary32 fused multiply-add per step. K is a multiple of 32, so there is no padding.
//   3. The lanes are summed once, in the fixed tree ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))
//      (simd::reduce_lanes, the same tree as the expert-ID matmul).
// Routes differ only in how the work is split: the mat-vec kernel streams the Q4_0 blocks and
// dequantises them in registers (nothing is written to a temporary matrix); the matrix kernels
// cut the output into [token tile x 64] threadgroup tiles (32 or 128 tokens, from the launch
// grid), dequantise a 64 x kPanelDepth weight panel into thread-local scratch and run a 4 x 3
// register-blocked micro-kernel over it. Neither changes the per-element order above. Only NaN
// payloads are not pinned.
#include "routemm/ops/q4_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/common/kernel_contracts.h"
#include "backend/common/launch_args.h"
#include "backend/common/q4_0_block.h"
#include "kernels.h"
#include "routemm/error.h"
#include "simd.h"
#include "thread_pool.h"

#if ROUTEMM_CPU_HAVE_AVX2
#include <immintrin.h>
#endif

#ifndef ROUTEMM_CPU_Q4_MATMUL_SHA256
#define ROUTEMM_CPU_Q4_MATMUL_SHA256 "unknown"
#endif

namespace routemm::cpu {
namespace {

using kernels::GgmlMatmulMmParams;
using kernels::GgmlMatmulMvParams;
using simd::kLanes;

constexpr size_t kQK = kernels::kQ4_0BlockValues;    // values per block
constexpr size_t kBlock = kernels::kQ4_0BlockBytes;  // bytes per block
constexpr size_t kLanesPerBlock = kQK / kLanes;      // 4 lane vectors per block
constexpr size_t kMmOutputTile = 64;                 // outputs per matrix threadgroup tile
constexpr size_t kMvThreadgroupOutputs = 8;          // outputs per mat-vec threadgroup
constexpr size_t kMaxMvRows = 8;                     // the mat-vec pipeline serves M <= 8

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

// Pointers and extents every kernel shares. Weight rows are N rows of K / 32 blocks.
struct Operands {
  const uint8_t* weight;
  const float* input;
  float* output;
  size_t m, n, k;
  size_t row_bytes;  // bytes of one weight row

  const uint8_t* weight_row(size_t col) const { return weight + col * row_bytes; }
  const float* input_row(size_t row) const { return input + row * k; }
};

// Checks the shape against the bound buffers (the front door validated it; this keeps a corrupt
// raw launch from reading out of bounds) and returns the operands.
Operands bind_operands(const KernelLaunch& launch, size_t m, size_t n, size_t k, size_t weight_slot,
                       size_t input_slot, size_t output_slot) {
  if (m == 0 || n == 0 || k == 0 || k % kQK != 0) {
    launch_error(launch, "params have a zero extent or K that is not a multiple of 32");
  }
  const size_t row_bytes = k / kQK * kBlock;
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

uint16_t block_scale_bits(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);  // blocks are only 2-byte aligned; GGUF is little endian
  return bits;
}

// ---- Micro-kernels ------------------------------------------------------------------------------
//
// Two implementations of the same primitives, selected once per launch: PortableIsa (plain loops,
// any target) and Avx2Isa (x86-64 AVX2 + FMA + F16C). Both follow the contract exactly.
//
//   dequant_block(block, out)          out[0..32) = the block's exact values
//   mv_columns<R, C>(ops, col, out)    out rows 0..R, columns col..col+C, over the full K,
//                                      dequantising each block in registers
//   mm_tile<R, C>(x, ldx, w, ldw, depth, acc, acc_stride)
//                                      acc[r][c][lane] += positions [0, depth) (a multiple of 8)
//                                      for R input rows x C panel columns

// Register tile of the matrix routes: 12 eight-lane accumulators (12 of 16 AVX2 registers).
constexpr size_t kTileRows = 4;
constexpr size_t kTileCols = 3;

struct PortableIsa {
  static void dequant_block(const uint8_t* block, float* out) {
    const float d = simd::widen(simd::Half{block_scale_bits(block)});
    const uint8_t* qs = block + 2;
    for (size_t j = 0; j < kQK / 2; ++j) {
      out[j] = d * static_cast<float>(static_cast<int>(qs[j] & 0x0f) - 8);
      out[j + kQK / 2] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
    }
  }

  template <size_t R, size_t C>
  static void mv_columns(const Operands& ops, size_t col, float* const* out_rows) {
    float acc[R][C][kLanes] = {};
    float w[kQK];
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
      for (size_t c = 0; c < C; ++c) {
        dequant_block(ops.weight_row(col + c) + b * kBlock, w);
        for (size_t r = 0; r < R; ++r) {
          const float* x = ops.input_row(r) + b * kQK;
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            for (size_t l = 0; l < kLanes; ++l) {
              acc[r][c][l] = std::fma(w[s * kLanes + l], x[s * kLanes + l], acc[r][c][l]);
            }
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c] = simd::reduce_lanes(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw, size_t depth,
                      float* acc, size_t acc_stride) {
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) {
        float a[kLanes];
        float* dst = acc + r * acc_stride + c * kLanes;
        std::copy(dst, dst + kLanes, a);
        for (size_t i = 0; i < depth; i += kLanes) {
          for (size_t l = 0; l < kLanes; ++l) {
            a[l] = std::fma(w[c * ldw + i + l], x[r * ldx + i + l], a[l]);
          }
        }
        std::copy(a, a + kLanes, dst);
      }
    }
  }
};

#if ROUTEMM_CPU_HAVE_AVX2
struct Avx2Isa {
  // The block's 32 values as four 8-lane vectors: v[s] holds values 8s .. 8s+7. Values 0-15 are
  // the low nibbles of bytes 0-15, values 16-31 their high nibbles. d * q - 8d is exactly
  // d * (q - 8) (the exact value is representable), so the single rounding of the FMA is exact.
  ROUTEMM_CPU_AVX2 static void dequant(const uint8_t* block, __m256 v[kLanesPerBlock]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(block_scale_bits(block)));
    const __m256 minus_8d = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m256i first = _mm256_cvtepu8_epi32(bytes);                      // bytes 0..7
    const __m256i second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));  // bytes 8..15
    const __m256i low = _mm256_set1_epi32(0x0f);
    v[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, low)), d, minus_8d);
    v[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, low)), d, minus_8d);
    v[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), d, minus_8d);
    v[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), d, minus_8d);
  }

  ROUTEMM_CPU_AVX2 static void dequant_block(const uint8_t* block, float* out) {
    __m256 v[kLanesPerBlock];
    dequant(block, v);
    for (size_t s = 0; s < kLanesPerBlock; ++s) _mm256_storeu_ps(out + s * kLanes, v[s]);
  }

  ROUTEMM_CPU_AVX2 static float reduce(__m256 v) {
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, v);
    return simd::reduce_lanes(lanes);
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mv_columns(const Operands& ops, size_t col, float* const* out_rows) {
    __m256 acc[R][C];
#pragma GCC unroll 8
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[C];
    for (size_t c = 0; c < C; ++c) rows[c] = ops.weight_row(col + c);
    const size_t blocks = ops.k / kQK;
    for (size_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 8
      for (size_t c = 0; c < C; ++c) {
        __m256 w[kLanesPerBlock];
        dequant(rows[c] + b * kBlock, w);
#pragma GCC unroll 8
        for (size_t r = 0; r < R; ++r) {
          const float* x = ops.input_row(r) + b * kQK;
#pragma GCC unroll 4
          for (size_t s = 0; s < kLanesPerBlock; ++s) {
            acc[r][c] = _mm256_fmadd_ps(w[s], _mm256_loadu_ps(x + s * kLanes), acc[r][c]);
          }
        }
      }
    }
    for (size_t r = 0; r < R; ++r) {
      for (size_t c = 0; c < C; ++c) out_rows[r][col + c] = reduce(acc[r][c]);
    }
  }

  template <size_t R, size_t C>
  ROUTEMM_CPU_AVX2 static void mm_tile(const float* x, size_t ldx, const float* w, size_t ldw,
                                       size_t depth, float* acc, size_t acc_stride) {
    __m256 a[R][C];
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * acc_stride + c * kLanes);
    for (size_t i = 0; i < depth; i += kLanes) {
      __m256 wv[C];
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + c * ldw + i);
#pragma GCC unroll 4
      for (size_t r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
#pragma GCC unroll 4
        for (size_t c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(wv[c], xv, a[r][c]);
      }
    }
#pragma GCC unroll 4
    for (size_t r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (size_t c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * acc_stride + c * kLanes, a[r][c]);
  }
};
#endif

// ---- Mat-vec ------------------------------------------------------------------------------------

// Output columns per work item: enough to amortise an item, small enough that a 4096-wide decode
// step still spreads over every thread.
constexpr size_t kMvChunk = 64;

// Columns computed together for R input rows: enough independent accumulator chains (R * C) to
// hide FMA latency, few enough to stay in registers next to the dequantised block.
template <size_t R>
constexpr size_t mv_columns_for_rows() {
  return R == 1 ? 4 : R == 2 ? 4 : R <= 4 ? 2 : 1;
}

template <class Isa, size_t R>
void mv_items(const Operands& ops, size_t begin, size_t end) {
  constexpr size_t C = mv_columns_for_rows<R>();
  float* out_rows[R];
  for (size_t r = 0; r < R; ++r) out_rows[r] = ops.output + r * ops.n;
  for (size_t item = begin; item < end; ++item) {
    const size_t col0 = item * kMvChunk;
    const size_t col_end = std::min(ops.n, col0 + kMvChunk);
    size_t col = col0;
    for (; col + C <= col_end; col += C) Isa::template mv_columns<R, C>(ops, col, out_rows);
    for (; col < col_end; ++col) Isa::template mv_columns<R, 1>(ops, col, out_rows);
  }
}

template <class Isa>
using MvRun = void (*)(const Operands&, size_t, size_t);

template <class Isa>
MvRun<Isa> mv_run_for_rows(size_t rows) {
  switch (rows) {
    case 1: return mv_items<Isa, 1>;
    case 2: return mv_items<Isa, 2>;
    case 3: return mv_items<Isa, 3>;
    case 4: return mv_items<Isa, 4>;
    case 5: return mv_items<Isa, 5>;
    case 6: return mv_items<Isa, 6>;
    case 7: return mv_items<Isa, 7>;
    default: return mv_items<Isa, 8>;
  }
}

void mv_kernel(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<GgmlMatmulMvParams>(launch, 3);
  if (p.ne00 != p.ne10 || p.ne01 != p.ne0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 || p.r3 != 1 ||
      p.ne1 <= 0 || p.ne0 <= 0 || p.ne00 <= 0) {
    launch_error(launch, "inconsistent mat-vec params");
  }
  const Operands ops = bind_operands(launch, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                                     static_cast<size_t>(p.ne00), 0, 1, 2);
  // The geometry of spec §5.5: [ceil(N/8), M, 1] threadgroups. Rows beyond the grid would be
  // skipped on a GPU; here a mismatch is a broken launch.
  if (launch.grid.x != (ops.n + kMvThreadgroupOutputs - 1) / kMvThreadgroupOutputs ||
      launch.grid.y != ops.m || launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the mat-vec geometry");
  }

  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t items = (ops.n + kMvChunk - 1) / kMvChunk;
  // Rows are processed in groups of at most eight (the pipeline's M <= 8 regime; larger raw
  // launches still work, group by group).
  for (size_t row0 = 0; row0 < ops.m; row0 += kMaxMvRows) {
    Operands group = ops;
    group.m = std::min(kMaxMvRows, ops.m - row0);
    group.input = ops.input + row0 * ops.k;
    group.output = ops.output + row0 * ops.n;
    void (*run)(const Operands&, size_t, size_t) = mv_run_for_rows<PortableIsa>(group.m);
#if ROUTEMM_CPU_HAVE_AVX2
    if (simd::has_avx2_fma()) run = mv_run_for_rows<Avx2Isa>(group.m);
#endif
    if (pool == nullptr) {
      run(group, 0, items);
    } else {
      pool->parallel_for(items, 1, [&](size_t begin, size_t end) { run(group, begin, end); });
    }
  }
}

// ---- Matrix routes ------------------------------------------------------------------------------

// Inner positions per panel: a 64-column panel is 64 KiB of f32, resident in L2 while the tile's
// token rows go by, and each micro-kernel call runs 32 FMA steps per accumulator load.
constexpr size_t kPanelDepth = 256;
static_assert(kPanelDepth % kQK == 0);
constexpr size_t kPanelCols = (kMmOutputTile + kTileCols - 1) / kTileCols * kTileCols;  // 66

struct MmScratch {
  std::vector<float> panel, acc;
};
MmScratch& mm_scratch() {
  thread_local MmScratch scratch;
  return scratch;
}

template <class Isa>
void mm_tile_rows(size_t rows, const float* x, size_t ldx, const float* w, size_t ldw, size_t depth,
                  float* acc, size_t acc_stride) {
  switch (rows) {
    case 1: Isa::template mm_tile<1, kTileCols>(x, ldx, w, ldw, depth, acc, acc_stride); break;
    case 2: Isa::template mm_tile<2, kTileCols>(x, ldx, w, ldw, depth, acc, acc_stride); break;
    case 3: Isa::template mm_tile<3, kTileCols>(x, ldx, w, ldw, depth, acc, acc_stride); break;
    default: Isa::template mm_tile<4, kTileCols>(x, ldx, w, ldw, depth, acc, acc_stride); break;
  }
}

// One threadgroup tile: tokens [row0, row0 + rows) x outputs [col0, col0 + cols).
template <class Isa>
void mm_item(const Operands& ops, size_t row0, size_t rows, size_t col0, size_t cols) {
  MmScratch& s = mm_scratch();
  const size_t acc_stride = kPanelCols * kLanes;
  s.panel.resize(kPanelCols * kPanelDepth);
  s.acc.resize(std::max(s.acc.size(), rows * acc_stride));
  float* panel = s.panel.data();
  float* acc = s.acc.data();
  std::fill(acc, acc + rows * acc_stride, 0.0f);
  const size_t cols_pad = (cols + kTileCols - 1) / kTileCols * kTileCols;

  for (size_t k0 = 0; k0 < ops.k; k0 += kPanelDepth) {
    const size_t depth = std::min(kPanelDepth, ops.k - k0);
    // Dequantise the panel; padded columns are zero weights whose results are never stored.
    for (size_t c = 0; c < cols; ++c) {
      const uint8_t* blocks = ops.weight_row(col0 + c) + k0 / kQK * kBlock;
      for (size_t b = 0; b < depth / kQK; ++b) {
        Isa::dequant_block(blocks + b * kBlock, panel + c * kPanelDepth + b * kQK);
      }
    }
    for (size_t c = cols; c < cols_pad; ++c) {
      std::fill(panel + c * kPanelDepth, panel + c * kPanelDepth + depth, 0.0f);
    }
    for (size_t c = 0; c < cols_pad; c += kTileCols) {
      for (size_t r = 0; r < rows; r += kTileRows) {
        mm_tile_rows<Isa>(std::min(kTileRows, rows - r), ops.input_row(row0 + r) + k0, ops.k,
                          panel + c * kPanelDepth, kPanelDepth, depth,
                          acc + r * acc_stride + c * kLanes, acc_stride);
      }
    }
  }
  for (size_t r = 0; r < rows; ++r) {
    float* out = ops.output + (row0 + r) * ops.n + col0;
    for (size_t c = 0; c < cols; ++c)
      out[c] = simd::reduce_lanes(acc + r * acc_stride + c * kLanes);
  }
}

// Every matrix route: TokenTile is the route's threadgroup token tile (32 or 128). The work split
// follows the launch grid, one item per threadgroup; the per-element order does not depend on it.
template <size_t TokenTile>
void mm_kernel(const KernelLaunch& launch, void* queue_native) {
  const auto p = kernels::launch_params<GgmlMatmulMmParams>(launch, 0);
  if (p.ne00 <= 0 || p.ne0 <= 0 || p.ne1 <= 0 || p.ne02 != 1 || p.ne12 != 1 || p.r2 != 1 ||
      p.r3 != 1 || p.nb10 != 4 || p.nb11 != uint64_t(p.ne00) * 4 ||
      p.nb01 != uint64_t(p.ne00) / kQK * kBlock) {
    launch_error(launch,
                 "inconsistent matrix params (only contiguous batch-1 inputs are supported)");
  }
  const Operands ops = bind_operands(launch, static_cast<size_t>(p.ne1), static_cast<size_t>(p.ne0),
                                     static_cast<size_t>(p.ne00), 1, 2, 3);
  const size_t token_tiles = (ops.m + TokenTile - 1) / TokenTile;
  const size_t output_tiles = (ops.n + kMmOutputTile - 1) / kMmOutputTile;
  if (launch.grid.x != token_tiles || launch.grid.y != output_tiles || launch.grid.z != 1) {
    launch_error(launch, "launch grid does not match the route's " + std::to_string(TokenTile) +
                             " x 64 tile");
  }

  void (*run)(const Operands&, size_t, size_t, size_t, size_t) = mm_item<PortableIsa>;
#if ROUTEMM_CPU_HAVE_AVX2
  if (simd::has_avx2_fma()) run = mm_item<Avx2Isa>;
#endif
  const auto body = [&](size_t begin, size_t end) {
    for (size_t item = begin; item < end; ++item) {
      const size_t tx = item % token_tiles, ty = item / token_tiles;
      const size_t row0 = tx * TokenTile, col0 = ty * kMmOutputTile;
      run(ops, row0, std::min(TokenTile, ops.m - row0), col0,
          std::min(kMmOutputTile, ops.n - col0));
    }
  };
  auto* pool = static_cast<ThreadPool*>(queue_native);
  const size_t items = token_tiles * output_tiles;
  if (pool == nullptr) {
    body(0, items);
  } else {
    pool->parallel_for(items, 1, body);
  }
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
  constexpr auto names = kQ4MatmulPipelineNames;
  static_assert(names[0] == kQ4_0MatVecPipeline && names[1] == "kernel_mul_mm_q4_0_f32" &&
                names[2] == "kernel_mul_mm_q4_0_tensor_f32" &&
                names[3] == "kernel_mul_mm_q4_0_tensor_v2_f32" &&
                names[4] == "kernel_mul_mm_q4_0_tensor_64x32_f32");
  out.push_back(make_def(names[0], mv_kernel, 64, kMvThreadgroupOutputs, 1, 0));
  out.push_back(make_def(names[1], mm_kernel<32>, 128, 32, kMmOutputTile, 8192));
  out.push_back(make_def(names[2], mm_kernel<32>, 128, 32, kMmOutputTile, 8192));
  out.push_back(make_def(names[3], mm_kernel<128>, 128, 128, kMmOutputTile, 4096));
  out.push_back(make_def(names[4], mm_kernel<32>, 128, 32, kMmOutputTile, 4096));
}

}  // namespace routemm::cpu
