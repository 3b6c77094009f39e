// The mixture-of-experts layer's own kernels, beside the expert-ID matmuls they connect:
//
//   moe_gate     router logits [m, E] -> top-k weights F32 [m, top_k] and expert ids [m, top_k]
//   moe_silu_mul SiLU(gate) * up, row by row, where gate and up may be views of one buffer
//   moe_combine  out[t, :] = sum over slots s = 0 .. top_k - 1, in that order, of
//                weight[t, s] * rows[t * top_k + s, :]
//
// Each front door validates every buffer (dtype, logical extent, alignment, device, output
// writability and overlap) and resolves its pipeline before it touches the encoder, then encodes
// exactly one dispatch. Like the expert-ID matmul's direct route, none of them encodes a barrier:
// a caller that chains them orders the steps with CommandEncoder::memory_barrier().
//
// NUMERIC CONTRACT (every backend):
//   gate     Logits are read as F32. In order:
//            0. With a router bias (gpt-oss's ffn_gate_inp.bias): l_e = logit_e + router_bias_e
//               in F32, as llama.cpp adds it to the router matmul's output; every later step
//               (scores, selection, weights) reads these l_e. Without one l_e = logit_e. A NaN
//               l_e counts as -inf.
//            1. Scores. softmax, with max the largest logit: finite max: s_e = exp(l_e - max) /
//               sum_e' exp(l_e' - max), the sum taken over e' in increasing order in F32; max =
//               +inf: the +inf experts share the mass equally, every other expert gets 0; no logit
//               above -inf (every logit -inf or NaN): every s_e = 0. sigmoid: s_e = 1 / (1 +
//               exp(-l_e)).
//            2. Selection scores c_e = s_e + bias_e in F32 (NaN counts as -inf); c_e = s_e
//               without a bias.
//            3. Groups (num_expert_group G > 0): the experts form G contiguous groups of n / G;
//               a group's score is the sum of its two largest c_e (its one c_e for groups of
//               one); the topk_group best groups (score descending, ties to the lower group
//               index) are kept and the other groups' experts are never selected.
//            4. Selection: the top_k experts of the kept groups by c_e descending, ties to the
//               lower expert index; without a bias by logit instead (every scoring function is
//               monotonic, so this is the ranking of the scores without their rounding). A row
//               with no logit above -inf (softmax) thus gets ids the lowest top_k kept indexes.
//            5. Weights, from the unbiased scores: p_s = s_{id_s}; renormalize: p_s / (p_0 + ... +
//               p_{top_k-1}) (slots summed in order; left as is when that sum is 0); then
//               weight_s = p_s * routed_scaling_factor.
//   silu_mul The gated activation of the row's inputs g and u, in F32. Each input first becomes
//            fma(w, v, b) with the row's weight w (scale_rows) and its expert's bias b (a bias
//            buffer; a row whose id is >= n_experts takes none), w * v or v + b with one of the two,
//            v with neither. Then silu: out = (g / (1 + exp(-g))) * u; swiglu_oai (gpt-oss):
//            g = min(g, limit), u = clamp(u, -limit, limit), out = (g / (1 + exp(-(alpha * g))))
//            * (u + 1), each operation rounded to F32 as written (a NaN input stays NaN).
//   combine  acc starts at +0.0f; for s = 0, 1, ..., top_k - 1: a slot whose id is >= n_experts
//            (an invalid or expert-parallel sentinel id) is skipped, so it contributes exactly
//            nothing whatever its weight and row hold; otherwise acc = fma(weight, row, acc), with
//            row + bias[id] (rounded) for row given a bias, and weight 1 with unit_weights. No
//            atomics: the result does not depend on the grid or thread count.
// exp() is the backend's F32 exponential (not bit-identical across backends), so gate and
// silu_mul agree across backends within a few F32 ulps, combine bit for bit. (With a bias or
// groups the gate ranks rounded scores, so experts whose scores tie within those ulps may be
// chosen differently by different backends.)
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "routemm/buffer.h"
#include "routemm/encoder.h"
#include "routemm/registry.h"

namespace routemm {

// Every pipeline name these ops own, in registration order.
inline constexpr std::array<std::string_view, 3> kMoePipelineNames = {
    "moe_gate_softmax_topk_f32",
    "moe_silu_mul_f32",
    "moe_combine_f32",
};
inline constexpr std::string_view kMoeGatePipeline = kMoePipelineNames[0];
inline constexpr std::string_view kMoeSiluMulPipeline = kMoePipelineNames[1];
inline constexpr std::string_view kMoeCombinePipeline = kMoePipelineNames[2];

// How the gate turns a logit into an expert's score.
enum class MoeGateScoring : uint32_t { Softmax = 0, Sigmoid = 1 };

// "softmax" or "sigmoid"; anything else is refused naming `op` and scoring_func.
MoeGateScoring parse_moe_gate_scoring(std::string_view op, std::string_view name);

struct MoeGateParams {
  uint32_t m = 0;          // tokens (rows of logits)
  uint32_t n_experts = 0;  // logits per row
  uint32_t top_k = 0;      // 1 <= top_k <= experts of the kept groups
  bool renormalize = false;
  MoeGateScoring scoring = MoeGateScoring::Softmax;
  uint32_t num_expert_group = 0;       // 0: no grouping; else it divides n_experts
  uint32_t topk_group = 0;             // 0 without grouping; else in [1, num_expert_group]
  float routed_scaling_factor = 1.0f;  // finite
};

// Refuses (InvalidArgument naming the field) params moe_gate would refuse: zero extents, top_k
// outside [1, n_experts] or above the kept groups' experts, an unknown scoring, groups that do
// not divide n_experts, topk_group outside [1, num_expert_group] (or set without groups), and a
// non-finite routed_scaling_factor.
void check_moe_gate_params(const MoeGateParams& params);

// `value` as the F32 routed_scaling_factor; refused unless finite as a float32.
float moe_gate_scaling_factor(std::string_view op, double value);

// logits: F32 [m, n_experts]; weights: F32 [m, top_k] (written); ids: U32 or I32 [m, top_k]
// (written, values in [0, n_experts)); bias (optional, e_score_correction_bias): F32 [n_experts],
// added to the scores for selection only; router_bias (optional): F32 [n_experts], added to the
// logits before scoring, so it moves the selection and the weights (step 0 above).
void moe_gate(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& logits,
              const Buffer& weights, const Buffer& ids, const MoeGateParams& params,
              const Buffer* bias = nullptr, const Buffer* router_bias = nullptr);

enum class MoeActivation : uint32_t { Silu = 0, SwigluOai = 1 };

struct MoeSiluMulParams {
  uint32_t rows = 0;
  uint32_t width = 0;            // elements per output row
  uint64_t gate_row_stride = 0;  // elements from one gate row to the next (>= width)
  uint64_t up_row_stride = 0;    // elements from one up row to the next (>= width)
  MoeActivation activation = MoeActivation::Silu;
  float alpha = 1.702f;          // swiglu_oai only: finite
  float limit = 7.0f;            // swiglu_oai only: > 0 (inf: no clamp)
  uint32_t n_experts = 0;        // with a bias: ids >= n_experts take none
  uint32_t bias_row_stride = 0;  // with a bias: elements from one expert's bias to the next
};

// The optional per-row inputs of moe_silu_mul (null: not used). ids U32 or I32 [rows] picks each
// row's bias row; scale_rows F32 [rows] scales both inputs; gate_bias and up_bias F32 views of
// n_experts rows of width elements, bias_row_stride apart (they may share storage).
struct MoeSiluMulInputs {
  const Buffer* ids = nullptr;
  const Buffer* scale_rows = nullptr;
  const Buffer* gate_bias = nullptr;
  const Buffer* up_bias = nullptr;
};

// gate, up: F32 views (they may share storage, e.g. the two halves of a [rows, 2 * width]
// gate_up product); output: F32 [rows, width], contiguous, overlapping no input.
void moe_silu_mul(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& gate,
                  const Buffer& up, const Buffer& output, const MoeSiluMulParams& params,
                  const MoeSiluMulInputs& inputs = {});

struct MoeCombineParams {
  uint32_t m = 0;
  uint32_t top_k = 0;
  uint32_t hidden = 0;        // elements per row
  uint32_t n_experts = 0;     // ids >= n_experts are skipped
  bool unit_weights = false;  // every valid slot weighs 1 (weights is not read)
};

// rows: F32 [m * top_k, hidden]; weights: F32 [m, top_k]; ids: U32 or I32 [m, top_k] (an I32 id
// is read as its U32 bit pattern, so a negative one counts as invalid); output: F32 [m, hidden];
// bias: null, or F32 [n_experts, hidden] added to each valid slot's row.
void moe_combine(CommandEncoder& encoder, KernelRegistry& registry, const Buffer& rows,
                 const Buffer& weights, const Buffer& ids, const Buffer& output,
                 const MoeCombineParams& params, const Buffer* bias = nullptr);

}  // namespace routemm
