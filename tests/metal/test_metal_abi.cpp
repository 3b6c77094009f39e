// Kernel-argument ABI as the shaders see it: csrc/backend/common/*.h compiled in "Metal mode"
// (__METAL_VERSION__ defined, MSL scalar types from msl_shim.h) must lay out exactly as the host
// structs the front doors fill (the host-mode static_asserts live in the headers themselves).
// MSL scalars have C's natural size and alignment (uint 4, ulong 8, short 2, ushort 2, uchar 1),
// which msl_shim.h mirrors; a field added, reordered or retyped on one side fails here.
// The shim comes first, so the shared headers below compile in Metal mode.
// clang-format off
#include "msl_shim.h"
// clang-format on

#include "backend/common/calibration_params.h"
#include "backend/common/dense_matmul_id_params.h"
#include "backend/common/moe_params.h"
#include "backend/common/q4_0_block.h"

namespace k = routemm::kernels;

#define ROUTEMM_EXPECT_FIELD(type, field, offset) \
  static_assert(offsetof(k::type, field) == (offset), #type "." #field)

static_assert(sizeof(k::DenseMatmulIdKernelParams) == 48);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, m, 0);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, n, 4);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, k, 8);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, top_k, 12);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, n_experts, 16);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, input_layout, 20);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, expert_stride_bytes, 24);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, input_token_stride_bytes, 32);
ROUTEMM_EXPECT_FIELD(DenseMatmulIdKernelParams, input_slot_stride_bytes, 40);
static_assert(k::kInputSharedPerToken == 0 && k::kInputSlotted == 1);

static_assert(sizeof(k::MoeGateKernelParams) == 40);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, renormalize, 12);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, scoring, 16);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, has_bias, 20);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, num_expert_group, 24);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, topk_group, 28);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, routed_scaling_factor, 32);
ROUTEMM_EXPECT_FIELD(MoeGateKernelParams, has_router_bias, 36);
static_assert(sizeof(k::MoeSiluMulKernelParams) == 48);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, width, 4);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, gate_row_stride, 8);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, up_row_stride, 16);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, activation, 24);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, flags, 28);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, alpha, 32);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, limit, 36);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, n_experts, 40);
ROUTEMM_EXPECT_FIELD(MoeSiluMulKernelParams, bias_row_stride, 44);
static_assert(sizeof(k::MoeCombineKernelParams) == 24);
ROUTEMM_EXPECT_FIELD(MoeCombineKernelParams, n_experts, 12);
ROUTEMM_EXPECT_FIELD(MoeCombineKernelParams, flags, 16);

static_assert(sizeof(k::BlockQ4_0) == 18 && alignof(k::BlockQ4_0) == 2);
ROUTEMM_EXPECT_FIELD(BlockQ4_0, qs, 2);
static_assert(k::kQ4_0BlockValues == 32 && k::kQ4_0BlockBytes == 18);

static_assert(sizeof(k::GgmlMatmulMvParams) == 64);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne00, 0);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne01, 8);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne02, 16);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne10, 24);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne12, 32);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne0, 40);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, ne1, 48);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, r2, 56);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMvParams, r3, 60);

static_assert(sizeof(k::GgmlMatmulMmParams) == 88);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, ne00, 0);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, ne02, 4);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb01, 8);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb02, 16);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb03, 24);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, ne12, 32);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, pad0, 36);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb10, 40);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb11, 48);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb12, 56);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, nb13, 64);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, ne0, 72);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, ne1, 76);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, r2, 80);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, r3, 82);
ROUTEMM_EXPECT_FIELD(GgmlMatmulMmParams, pad1, 84);

static_assert(sizeof(k::CalibrationKernelParams) == 24);
ROUTEMM_EXPECT_FIELD(CalibrationKernelParams, logical_elements, 0);
ROUTEMM_EXPECT_FIELD(CalibrationKernelParams, guarded_elements, 8);
ROUTEMM_EXPECT_FIELD(CalibrationKernelParams, status_index, 16);
ROUTEMM_EXPECT_FIELD(CalibrationKernelParams, pad, 20);
static_assert(k::kCalibrationPoisonBits == 0xFFFFFFFFu &&
              k::kCalibrationCandidateGuard == (1u << 6));

// Compiled as a test program: the checks above are the test; running it only reports success.
int main() { return 0; }
