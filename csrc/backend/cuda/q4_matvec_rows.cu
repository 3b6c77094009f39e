// The Q4_0 mat-vec for one or two tokens on Hopper (compute capability 9.0, sm_90a builds):
// q4_matmul.cu's mat-vec launcher runs it for m <= 2 and k % 256 == 0 (q4_matvec_rows_eligible);
// every other mat-vec keeps q4_matvec_kernel. The dispatch's recorded geometry stays the mat-vec
// pipeline's (the front door's grid); this launcher picks its own grid, as the Hopper matrix kernel
// does.
//
// WHY: at one or two tokens the mat-vec streams n * k / 32 * 18 bytes of weights and does 2 MMAs
// per 16 rows and block (the tokens' hi and lo parts share one MMA's 8 columns). q4_matvec_kernel
// (a cp.async ring per warp, 16-byte copies, a K split across clusters) took 18.3 us at 4096 x
// 14336 on the H200; this kernel moves the weights with one bulk copy per row and stage and keeps
// the arithmetic (matvec_split_columns_block: the hi / lo split numerics, two mma.sync per block).
// Measurements: bench/lab/records/q4_0_matvec_mma_rows-h200-2026-12-04.md (the lab:
// bench/lab/q4_matvec_mma_rows_lab.cu). On the H200 (CUPTI, weights rotated out of L2), 4096 x
// 14336: 14.2 / 16.9 us at m = 1 / 2 against 18.1 / 19.0 for q4_matvec_kernel; at m = 4 the
// four-token configuration (kept for the lab) took 23.1 against 20.7 us, so three and four tokens
// stay on q4_matvec_kernel. Since those runs each lane splits only its own four activations (no
// exchange between lanes; the same bytes, bench/lab/q4_split_x_model.py), 7-14% fewer static
// instructions per instantiation; that change is not yet timed
// (bench/lab/records/q4_0_matvec_split_x-2026-12-06.md).
//
// KERNEL (one producer warp and kConsumers consumer warps per CTA, two CTAs per multiprocessor):
//   - A CTA walks 16-row groups (rg = blockIdx.x, + gridDim.x, ...). A row group's K is cut into
//     slabs of 64 blocks (1152 bytes of a row; the last slab may be shorter, a multiple of 8 blocks
//     since k % 256 == 0); a stage is one slab of the group's 16 rows. The producer warp fills a
//     ring of kRing stages guarded by full / empty mbarriers: lane r < 16 copies row r's slab with
//     one bulk copy (16-byte aligned views) or, for other views, the warp copies the stage with
//     plain loads, each lane arriving once its stores are issued. A consumer lane arrives on the
//     stage's empty barrier after its own reads (mbarrier.arrive releases only the arriving
//     thread's accesses, so no lane arrives for another). Rows past n are not copied (their MMA
//     rows hold stale values and are never stored; a row of an MMA never mixes with another).
//   - Stage rows sit 1168 bytes apart: 1152 is a multiple of 128, so the 8 rows of a lane quarter
//     would share banks (8-way conflicts on every A and scale load, measured 29.8 against 14.8 us).
//   - Consumer warp w takes blocks [w * kWarpBlocks, (w + 1) * kWarpBlocks) of every stage. Its
//     slice of the tokens (kWarpBlocks blocks of each) is loaded one stage ahead into registers
//     (L2-resident after the first CTA reads it) and split into B quads in the warp's own shared
//     slice before the warp waits for the stage: no prologue and no bound on K. Per block, each
//     lane decodes its A registers of rows g and g + 8 and runs matvec_split_columns_block into two
//     accumulators (token t of the lane).
//   - After a row group's last stage the consumer warps' sums of each row and token are added in
//     warp order and stored.
//
// NUMERICS: the split numerics of the mat-vec (q4_matvec_block.cuh); each output is summed in a
// fixed order that depends only on k and the consumer-warp count (a warp's blocks of each stage in
// increasing order, stages in order, then the warps in order), never on alignment, the other
// tokens, grid or device load, so a product's bits repeat and aligned and unaligned views give the
// same bits. An MMA column's result depends only on its own token, so a token's outputs are the
// same whether it runs alone or beside others (with the same consumer-warp count). The order
// differs from q4_matvec_kernel's; both stay within the mat-vec's stated bound.
#include <algorithm>
#include <cstdint>
#include <string>

#include "hopper_support.h"
#include "q4_matvec_rows.cuh"
#include "q4_matvec_rows.h"
#include "routemm/error.h"
#include "smem_opt_in.h"

namespace routemm::cuda {
namespace {

template <class C>
void launch_rows(const std::string& label, cudaStream_t stream, const RowsArgs& a, int grid) {
  constexpr auto kernel = &q4_matvec_rows_kernel<C>;
  opt_in_dynamic_smem<kernel>(label, C::kSmem, C::kSmem);
  q4_matvec_rows_kernel<C><<<grid, C::kThreads, C::kSmem, stream>>>(a);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) {
    throw Error("'" + label + "': launch failed: " + cudaGetErrorString(e));
  }
}

}  // namespace

bool q4_matvec_rows_eligible(int device, uint64_t m, uint64_t k) {
  return m >= 1 && m <= 2 && k > 0 && k % 256 == 0 && k / 32 <= INT32_MAX &&
         hopper_kernels_available(device);
}

void launch_q4_matvec_rows(const std::string& label, cudaStream_t stream,
                           const Q4MatVecRowsProblem& p) {
  RowsArgs a{};
  a.weight = p.weight;
  a.input = p.input;
  a.output = p.output;
  a.m = static_cast<int32_t>(p.m);
  a.n = static_cast<int32_t>(p.n);
  a.k_blocks = static_cast<int32_t>(p.k / 32);
  a.row_groups = static_cast<int32_t>((uint64_t{p.n} + kRowsPerGroup - 1) / kRowsPerGroup);
  // Rows start row_bytes (a multiple of 144) apart and slabs 1152 bytes into a row, so the view's
  // own alignment decides every copy's.
  const auto w_address = reinterpret_cast<uintptr_t>(p.weight);
  a.w_grain = w_address % 16 == 0 ? 16 : w_address % 4 == 0 ? 4 : w_address % 2 == 0 ? 2 : 1;
  a.x_vector = reinterpret_cast<uintptr_t>(p.input) % 16 == 0 ? 1 : 0;
  if (a.n <= 0) return;
  const int sms = static_cast<int>(multiprocessors(label));
  const int grid = std::min(a.row_groups, kRowsCtasPerSm * sms);
  // One token: 8 consumer warps when there are fewer row groups than multiprocessors (one CTA per SM
  // or less: more warps shorten each stage's arithmetic), else 4. Lab runs 5 and 6 (ncu, us, 4
  // warps against 8): 2048 x 4096 6.5 / 6.1 and 512 x 2048 5.4 / 4.9 (whole-K token quads, 3
  // stages); 4096 x 14336 15.1 / 15.7 (the same). Two tokens: always 8, whose warps split each
  // stage's two token slices more ways (run 7, events, us, 4 warps against 8: 4096 x 14336 18.2 /
  // 17.6, 4096 x 2048 4.70 / 4.56, 2048 x 4096 5.44 / 4.99, 512 x 2048 3.77 / 3.70).
  const bool eight = a.row_groups < sms;
  if (p.m == 1) {
    eight ? launch_rows<RowsConfig<8, 3, 64, 1>>(label, stream, a, grid)
          : launch_rows<RowsConfig<4, 3, 64, 1>>(label, stream, a, grid);
  } else {
    launch_rows<RowsConfig<8, 3, 64, 2>>(label, stream, a, grid);
  }
}

}  // namespace routemm::cuda
