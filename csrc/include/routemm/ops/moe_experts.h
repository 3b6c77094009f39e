// The experts block of a mixture-of-experts layer as one op: for every token t and slot s whose
// expert e = ids[t, s] lies in [0, n_experts),
//
//   h      = SiLU(W_gate[e] @ x[t]) * (W_up[e] @ x[t])                  (F32, [intermediate])
//   out[t] = sum over s = 0 .. top_k - 1, in order, of weights[t, s] * (W_down[e] @ h)
//
// and with the params' options: activation swiglu_oai (gpt-oss's clamped SwiGLU) in place of
// SiLU(g) * u; expert biases added to the gate/up products (before the activation) and to the
// down product (in the combine); weights_before_ffn (Llama-4) scales the expert's input by the
// weight and combines with weight 1, out[t] = sum_s FFN_e(w x) -- computed as W (w x) = w (W x),
// the weight applied to the gate/up product rows, exact up to F32 rounding. Each per-element
// formula and its rounding are moe_silu_mul's and moe_combine's (routemm/ops/moe.h).
//
// encoded as the expert-ID matmul of gate and up (one [E, 2I, H] stack, or a gate and an up
// stack), moe_silu_mul, the down matmul on the slotted rows and moe_combine, with barriers between
// the steps. One routing map serves every matmul of a grouped route: the first builds it in the
// workspace's scratch, the others reuse it. An id outside [0, n_experts) (an invalid id or an
// expert-parallel sentinel) contributes exactly nothing and reads no weight.
//
// Float stacks (F32, F16, BF16) run dense_matmul_id's `route`; GGML block stacks (U8 with
// `ggml_type`) run quantized_matmul_id_ggml's `block_route`. Every matmul of a grouped route is
// declared DISTINCT_PER_TOKEN as the capacity bound it is (top_k <= n_experts): the grouped kernels
// compute every slot also when ids repeat within a token, so nothing reads the ids on the host.
//
// Memory: hidden F32 [m, H]; ids U32 or I32 [m, top_k] (an I32 id is read as its U32 bit
// pattern, so a negative one is invalid); weights F32 [m, top_k]; output F32 [m, H]; workspace a
// writable buffer of at least moe_experts_workspace_bytes(params) bytes (any dtype), which the op
// carves into the intermediates (gate/up rows, activations, down rows) and the grouped routes'
// scratch. The workspace must outlive the submission; it may be reused once that completed.
//
// Fail closed: every buffer, extent, pipeline and receipt slot is checked before the encoder is
// touched, and the steps are encoded inside one CommandEncoder::Transaction, so a refused call
// leaves the encoder exactly as it was.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "routemm/buffer.h"
#include "routemm/encoder.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/ops/quantized_matmul_id.h"
#include "routemm/registry.h"

namespace routemm {

struct MoeExpertsParams {
  uint32_t m = 0;                     // tokens
  uint32_t top_k = 0;                 // expert slots per token
  uint32_t n_experts = 0;             // experts in every stack
  uint32_t hidden = 0;                // H: the model width (gate/up input, down output)
  uint32_t intermediate = 0;          // I: the experts' width (gate/up output, down input)
  bool split_gate_up = false;         // gate and up in two [E, I, H] stacks, else one [E, 2I, H]
  DType weight_dtype = DType::BF16;   // F32, F16 or BF16; U8 for block stacks
  std::optional<GgmlType> ggml_type;  // set for block stacks (weight_dtype U8)
  // Block stacks of mixed types: the up stack's (split gate/up; one gate_up stack has one type) and
  // the down stack's. Unset: ggml_type, the gate_up (or gate) stack's.
  std::optional<GgmlType> up_ggml_type, down_ggml_type;
  DenseMatmulIdRoute route = DenseMatmulIdRoute::Direct;                        // float stacks
  GgmlQuantizedMatmulIdRoute block_route = GgmlQuantizedMatmulIdRoute::Direct;  // block stacks
  MoeActivation activation = MoeActivation::Silu;  // the gated activation (routemm/ops/moe.h)
  float swiglu_alpha = 1.702f;                     // swiglu_oai's alpha (finite)
  float swiglu_limit = 7.0f;                       // swiglu_oai's limit (> 0)
  bool gate_up_bias = false;        // biases of the gate/up product (MoeExpertsBiases)
  bool down_bias = false;           // bias of the down product
  bool weights_before_ffn = false;  // scale the expert's input by the weight, combine with 1
  // GgmlRoutingPolicy.expert_q8_0_mv_nr2 for the Q8_0 stacks' direct route
  // (quantized_matmul_id_ggml's q8_0_mv_nr2). Unset: expert_q8_0_mv_nr2_from_environment().
  std::optional<bool> q8_0_mv_nr2;
  bool operator==(const MoeExpertsParams&) const = default;
};

// The experts' biases, F32, present exactly when the params ask: gate_up_bias [E, 2I] (one
// gate_up stack) or gate_up_bias = the gate bias [E, I] and up the up bias [E, I] (split stacks);
// down [E, H].
struct MoeExpertsBiases {
  const Buffer* gate_up = nullptr;
  const Buffer* up = nullptr;
  const Buffer* down = nullptr;
};

// Where the op puts its intermediates inside the workspace (byte offsets, each 16-byte aligned).
struct MoeExpertsWorkspaceLayout {
  uint64_t gate_up_offset = 0, gate_up_bytes = 0;  // F32 [rows, 2I] (split: gate rows then up rows)
  uint64_t act_offset = 0, act_bytes = 0;          // F32 [rows, I]
  uint64_t down_offset = 0, down_bytes = 0;        // F32 [rows, H]
  uint64_t counts_offset = 0, counts_bytes = 0;    // U32 [n_experts] (grouped routes)
  uint64_t rows_offset = 0, rows_bytes = 0;        // U32 [n_experts, m] (grouped routes)
  uint64_t total_bytes = 0;
};

struct MoeExpertsReceipt {
  bool grouped = false;         // a grouped route (one routing map for the block)
  uint32_t dispatch_count = 0;  // every dispatch the block encoded
};

// The block's automatic route, from the shapes and the backend only (never the ids). Exact mode: the
// exact expert-ID rule (expert_id_auto_grouped: grouped_prefill / grouped, else direct). Otherwise,
// on CUDA, the tensor-core route grouped_tensor_lowp (activations rounded to the weights' 16-bit
// type, F32 accumulation) once the rows routed per expert reach kMoeLowpRowsPerExpert (f16/bf16
// stacks: measured on an H200, Qwen3-30B-A3B bf16, direct 145 us against lowp 95 us at 2 rows per
// expert, 43 against 56 at 0.5) or kMoeQuantizedLowpRowsPerExpert (block stacks: lowp was 6-12x the
// exact grouped route at 32 and 256 rows per expert on an H100; the crossover below is not yet
// measured). On a CPU whose backend registers the bf16-dot pipelines (AVX512_BF16), BF16 stacks
// take the exact rule's choice in its bf16-dot form (direct_bf16_dot / grouped_bf16_dot:
// activations rounded to bf16, F32 accumulation), faster at every m (Qwen3-30B-A3B block on a
// 2-core Zen 4, m = 512: grouped_prefill 270 ms, grouped_bf16_dot 189 ms). F32 stacks and the
// other backends keep the exact rule. Sets route / block_route.
// tensor_mm: GgmlRoutingPolicy.expert_tensor_mm is auto_probe; false (force_simd) keeps the exact
// rule as the exact mode does. bf16_dot: the backend registers kDenseMatmulIdBf16DotPipelineNames.
// The registry overload reads the backend name and bf16_dot from the registry, and tensor_mm from
// the environment (expert_tensor_mm_from_environment).
//
// MoeRouteMode::BatchInvariant keeps every token's per-row accumulation order the same at every m:
// on CUDA the stacks that have the tensor-core route take it at every m (its result depends on K
// only: no split-K, nothing that depends on the tile or the grid), and the other stacks and
// backends take the default, which there is the exact rule or the bf16-dot family (direct and
// grouped bit-identical within each). It never takes the fused decode route.
inline constexpr uint64_t kMoeLowpRowsPerExpert = 2;
inline constexpr uint64_t kMoeQuantizedLowpRowsPerExpert = 16;
enum class MoeRouteMode : uint8_t { Default, Exact, BatchInvariant };
void moe_experts_auto_route(std::string_view backend, MoeExpertsParams& params, MoeRouteMode mode,
                            bool tensor_mm, bool bf16_dot = false);
void moe_experts_auto_route(const KernelRegistry& registry, MoeExpertsParams& params,
                            MoeRouteMode mode);

// The grouped-ness of the params' route (of the stacks' kind).
bool moe_experts_grouped(const MoeExpertsParams& params);

// Checks the params (nonzero extents, u32 rows, a supported dtype/type and route, each matmul's
// capability) and returns the workspace layout; no allocation, no compilation.
MoeExpertsWorkspaceLayout moe_experts_workspace(const MoeExpertsParams& params);

// Validates everything, resolves every pipeline, then encodes the block (see the file comment).
// up: the up stack when params.split_gate_up (gate_up is then the gate stack), else nullptr.
MoeExpertsReceipt moe_experts(CommandEncoder& encoder, KernelRegistry& registry,
                              const Buffer& hidden, const Buffer& ids, const Buffer& weights,
                              const Buffer& gate_up, const Buffer* up, const Buffer& down,
                              const Buffer& output, const Buffer& workspace,
                              const MoeExpertsParams& params, const MoeExpertsBiases& biases = {});

}  // namespace routemm
