// The C ABI through which a second extension module (routemm._torch_ops, the torch ops' C++
// kernels) reaches routemm's core without linking it: routemm._core exports one RoutemmTensorOpAbi
// table in a PyCapsule named ROUTEMM_TENSOR_OP_ABI_CAPSULE (the module attribute _tensor_op_abi).
// Both modules include this header; only plain C types cross it, so the two shared objects stay
// independent (each with its own C++ runtime state) and the core keeps the one copy of its state:
// the per-device table of devices and kernel registries, frozen plans and pools.
//
// Contract of every entry: it never throws and never touches Python objects; it returns
// ROUTEMM_TENSOR_OP_OK, or a failure status with a NUL-terminated message (truncated to
// error_size) written into `error`. Nothing is encoded or started when an entry fails. An entry
// called with the GIL held releases it while a host backend works.
//
// Versioning: `version` is ROUTEMM_TENSOR_OP_ABI_VERSION of the core that filled the table and
// `size` its sizeof; a consumer refuses a table of another version. Entries are only appended,
// with a version bump.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ROUTEMM_TENSOR_OP_ABI_VERSION 10
#define ROUTEMM_TENSOR_OP_ABI_CAPSULE "routemm._core._tensor_op_abi"

// DLPack device types of the devices the tensor ops run on.
#define ROUTEMM_TENSOR_OP_DEVICE_CPU 1
#define ROUTEMM_TENSOR_OP_DEVICE_CUDA 2

// Failure statuses; the consumer raises the framework's matching error.
#define ROUTEMM_TENSOR_OP_OK 0
#define ROUTEMM_TENSOR_OP_INVALID_ARGUMENT 1  // routemm.InvalidArgumentError (a ValueError)
#define ROUTEMM_TENSOR_OP_OUT_OF_MEMORY 2
#define ROUTEMM_TENSOR_OP_ERROR 3  // any other routemm error

// Which expert-ID call shape a plan is made for. Shapes are given as they come (any rank), so the
// core's shape checks name them; the route is the automatic shape-only rule.
typedef struct RoutemmMatmulIdShapes {
  int32_t device_type;    // ROUTEMM_TENSOR_OP_DEVICE_*
  int32_t device_index;   // the device's index (0 for the host)
  uint32_t weight_dtype;  // a routemm::DType value (the framework maps its dtype first)
  uint32_t weights_rank, x_rank, ids_rank;
  const int64_t* weights_shape;
  const int64_t* x_shape;
  const int64_t* ids_shape;
} RoutemmMatmulIdShapes;

// The call shape of the expert-ID product over a GGML block stack: weights [n_experts, n, k / values
// * block_bytes] uint8 (the raw bytes of a GGUF `_exps` tensor), x and ids as for matmul_id.
typedef struct RoutemmQuantizedMatmulIdShapes {
  int32_t device_type;
  int32_t device_index;
  uint32_t ggml_type;  // a routemm::GgmlType value (the core supports Q4_0 and Q8_0)
  uint32_t weights_rank, x_rank, ids_rank;
  const int64_t* weights_shape;
  const int64_t* x_shape;
  const int64_t* ids_shape;
} RoutemmQuantizedMatmulIdShapes;

// What a consumer needs to allocate a planned call's output and grouped scratch.
typedef struct RoutemmMatmulIdPlanInfo {
  uint64_t rows;       // output rows, m * top_k (the output is [rows, n] float32)
  uint64_t n;          // output features
  uint64_t m;          // tokens
  uint64_t n_experts;  // experts (ids outside [0, n_experts) give zero rows)
  uint32_t grouped;  // 1: the route needs expert_counts [n_experts] and routed_rows [n_experts * m]
} RoutemmMatmulIdPlanInfo;

// The memory of one planned call: contiguous, on the plan's device, alive until the work is done
// (on a stream: the framework's stream-ordered allocator keeps it). ids are int32 read as u32.
typedef struct RoutemmMatmulIdPointers {
  uint64_t weights, x, ids, out;
  uint64_t expert_counts, routed_rows;  // 0 unless the plan is grouped
  uint32_t has_stream;                  // 1: enqueue on `stream` and return at once
  uint64_t stream;                      // a CUDA stream handle (cudaStream_t)
} RoutemmMatmulIdPointers;

// One dense GGML Q4_0 product out[m, n] = x[m, k] @ dequantize(weight).T. m, n and k come as the
// framework has them and are checked as u32 by the core.
typedef struct RoutemmQ4MatmulCall {
  int32_t device_type;
  int32_t device_index;
  int64_t m, n, k;
  uint64_t x, x_nbytes;            // float32 [m, k]
  uint64_t weight, weight_nbytes;  // uint8 Q4_0 blocks
  uint64_t out;                    // float32 [m, n]
  uint32_t has_stream;
  uint64_t stream;
} RoutemmQ4MatmulCall;

// The call shape of the MoE experts block (routemm/ops/moe_experts.h) on framework tensors: hidden
// [m, H] float32, ids [m, top_k] int32 (read as u32), weights [m, top_k] float32, gate_up [E, 2I, H]
// (or, with split_gate_up, gate and up [E, I, H] each), down [E, H, I]; float stacks of
// weight_dtype, or uint8 GGML block stacks of ggml_type (k in bytes: k / values * block_bytes).
typedef struct RoutemmMoeExpertsShapes {
  int32_t device_type;
  int32_t device_index;
  uint32_t weight_dtype;   // a routemm::DType value (U8 for block stacks)
  int32_t ggml_type;       // a routemm::GgmlType value, or -1 for float stacks
  uint32_t split_gate_up;  // 1: gate_up is the gate stack and up a second one
  uint32_t exact;  // the route mode: 0 the default, 1 the bit-exact F32 routes only (direct /
                   // grouped_prefill), 2 (version 10) batch-invariant (MoeRouteMode)
  uint32_t hidden_rank, ids_rank, weights_rank, gate_up_rank, down_rank;
  const int64_t* hidden_shape;
  const int64_t* ids_shape;
  const int64_t* weights_shape;
  const int64_t* gate_up_shape;
  const int64_t* down_shape;
  // Version 7. The block's FFN options (routemm/ops/moe_experts.h MoeExpertsParams).
  uint32_t activation;  // 0 silu, 1 swiglu_oai
  float swiglu_alpha, swiglu_limit;
  uint32_t gate_up_bias;  // 1: the pointers carry gate_up_bias (split: and up_bias), float32
  uint32_t down_bias;     // 1: the pointers carry down_bias [E, H] float32
  uint32_t weights_before_ffn;
} RoutemmMoeExpertsShapes;

typedef struct RoutemmMoeExpertsPlanInfo {
  uint64_t m, hidden;        // the output is [m, hidden] float32
  uint64_t workspace_bytes;  // one contiguous workspace of at least this many bytes (16-aligned)
  uint32_t grouped;          // the route is grouped (one routing map for the block)
} RoutemmMoeExpertsPlanInfo;

typedef struct RoutemmMoeExpertsPointers {
  uint64_t hidden, ids, weights, gate_up, up, down, out, workspace;  // up: 0 unless split
  uint32_t has_stream;
  uint64_t stream;
  // Version 7. Biases as the plan has them (0 otherwise): gate_up_bias [E, 2I], or the gate bias
  // [E, I] and up_bias [E, I] with split stacks; down_bias [E, H]. Float32, contiguous.
  uint64_t gate_up_bias, up_bias, down_bias;
} RoutemmMoeExpertsPointers;

// One MoE gate (routemm/ops/moe.h moe_gate): logits [m, n_experts] float32 -> weights [m, top_k]
// float32 and ids [m, top_k] int32. m, n_experts, top_k and the group counts come as the framework
// has them and are checked as u32 by the core, as are scoring_func and the scaling factor.
typedef struct RoutemmMoeGateCall {
  int32_t device_type;
  int32_t device_index;
  int64_t m, n_experts, top_k;
  uint32_t renormalize;
  uint64_t logits, weights, ids;
  uint32_t has_stream;
  uint64_t stream;
  // Version 8. The routing options (moe_gate's names).
  const char* scoring_func;              // "softmax" or "sigmoid"
  uint64_t bias;                         // e_score_correction_bias float32 [n_experts], or 0
  int64_t num_expert_group, topk_group;  // both 0: no grouping
  double routed_scaling_factor;
  // Version 9. The router bias float32 [n_experts] added to the logits before scoring, or 0.
  uint64_t router_bias;
} RoutemmMoeGateCall;

// One call of the experts block fused into two launches (routemm/ops/moe_experts_fused.h): hidden
// [m, H], the stacks and the output [m, H] of `dtype`; ids [m, top_k] of id_bytes (4: int32, 8:
// int64); routing weights [m, top_k] of weights_dtype; workspace >= m * top_k * I * 4 bytes.
// Contiguous, 16-byte aligned tensors. Extents come as the framework has them (checked as u32).
typedef struct RoutemmMoeExpertsFusedCall {
  int32_t device_type;
  int32_t device_index;
  uint32_t dtype;          // a routemm::DType value: F32, F16 or BF16
  uint32_t weights_dtype;  // a routemm::DType value: F32, F16 or BF16
  uint32_t id_bytes;       // 4 or 8
  uint32_t split_gate_up;  // 1: gate_up is the gate stack and up a second one
  int64_t m, top_k, n_experts, hidden, intermediate;
  uint64_t x, ids, weights, gate_up, up, down, out, workspace;  // up: 0 unless split
  uint32_t has_stream;
  uint64_t stream;
} RoutemmMoeExpertsFusedCall;

typedef struct RoutemmTensorOpAbi {
  uint32_t version;
  uint32_t size;
  // Validates a call shape and makes its plan: the frozen params, the route (shape-only) and the
  // device's shared registry. *plan stays valid until the process exits.
  int (*plan_matmul_id)(const RoutemmMatmulIdShapes* shapes, const void** plan,
                        RoutemmMatmulIdPlanInfo* info, char* error, size_t error_size);
  // Encodes and starts one planned call: on a stream without waiting, else to completion.
  int (*enqueue_matmul_id)(const void* plan, const RoutemmMatmulIdPointers* pointers, char* error,
                           size_t error_size);
  // Encodes and starts one Q4_0 product under the routing policy the environment gave at first use.
  int (*enqueue_q4_matmul)(const RoutemmQ4MatmulCall* call, char* error, size_t error_size);
  // Version 2. plan_matmul_id and enqueue_matmul_id for GGML block stacks: the route is the
  // shape-only rule (the exact grouped route where the core's automatic rule takes it, else
  // direct); the ids are never read on the host.
  int (*plan_quantized_matmul_id)(const RoutemmQuantizedMatmulIdShapes* shapes, const void** plan,
                                  RoutemmMatmulIdPlanInfo* info, char* error, size_t error_size);
  int (*enqueue_quantized_matmul_id)(const void* plan, const RoutemmMatmulIdPointers* pointers,
                                     char* error, size_t error_size);
  // Version 3. The MoE experts block: the route is the shape-only rule of the block
  // (moe_experts_auto_route); the ids are never read on the host.
  int (*plan_moe_experts)(const RoutemmMoeExpertsShapes* shapes, const void** plan,
                          RoutemmMoeExpertsPlanInfo* info, char* error, size_t error_size);
  int (*enqueue_moe_experts)(const void* plan, const RoutemmMoeExpertsPointers* pointers,
                             char* error, size_t error_size);
  // Version 4. The MoE gate, encoded and started (no plan: one dispatch, checked per call); its
  // call record grew the routing options in version 8 and the router bias in version 9.
  int (*enqueue_moe_gate)(const RoutemmMoeGateCall* call, char* error, size_t error_size);
  // Version 5. The fused experts block: whether it serves a call's shape and dtypes on its device
  // (1 or 0; never fails: a call it does not serve takes the planned block), then the call itself
  // (pointers unread by the first).
  int (*moe_experts_fused_serves)(const RoutemmMoeExpertsFusedCall* call);
  int (*enqueue_moe_experts_fused)(const RoutemmMoeExpertsFusedCall* call, char* error,
                                   size_t error_size);
} RoutemmTensorOpAbi;

#ifdef __cplusplus
}  // extern "C"
#endif
