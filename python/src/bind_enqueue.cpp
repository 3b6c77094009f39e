// The tensor ops' call path (routemm/ops/_tensor_ops.py, routemm.torch and its C++ kernels in
// routemm._torch_ops): a framework's tensors come in as raw pointers, and wrapping, encoding and
// starting the work happen here in one crossing, so an eager call in an engine's decode loop costs
// about one kernel launch on the host. Two doors lead to the same functions: the pybind11 entries
// (_enqueue_dense_matmul_id, _enqueue_q4_matmul, ...) for the Python kernels, and the C ABI table
// of tensor_op_abi.h (the _tensor_op_abi capsule) for the C++ kernels.
//
// Shared state: one device and one kernel registry per framework device (tensor_op_target), so
// both doors run on the same registry (its frozen plans and pools) whichever kernels a process uses.
//
// Contract with the caller: the pointers are contiguous tensors of the byte sizes given, on the
// target's device, alive until the work is done. On CUDA with a stream, the work is enqueued on that
// stream and the call returns at once; the framework's stream-ordered allocator keeps the memory
// until the stream passes it, so nothing here holds the tensors. On a host backend the call returns
// when the result is written. Every validation of the op runs before anything is encoded, exactly as
// through the encoder front door (this path calls the same op).
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "routemm/buffer.h"
#include "routemm/checked.h"
#include "routemm/device.h"
#include "routemm/dlpack.h"
#include "routemm/encoder.h"
#include "routemm/error.h"
#include "routemm/ops/dense_matmul_id.h"
#include "routemm/ops/moe.h"
#include "routemm/ops/moe_experts.h"
#include "routemm/ops/moe_experts_fused.h"
#include "routemm/ops/q4_matmul.h"
#include "routemm/ops/quantized_matmul_id.h"
#include "routemm/registry.h"
#include "tensor_op_abi.h"

namespace routemm::python {
namespace {

// ---- the per-device table ----------------------------------------------------------------------

struct TensorOpTarget {
  Device device;
  std::shared_ptr<KernelRegistry> registry;
};

std::string python_tuple(std::span<const int64_t> values) {
  std::string out = "(";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + (values.size() == 1 ? ",)" : ")");
}

// The device and registry of DLPack device (type, index), made on first use and kept for the
// process (never destroyed: a backend torn down during static destruction could outlive its driver).
const TensorOpTarget& tensor_op_target(int32_t type, int32_t index) {
  static std::mutex mutex;
  static auto* table = new std::map<std::pair<int32_t, int32_t>, std::unique_ptr<TensorOpTarget>>;
  std::lock_guard lock(mutex);
  auto& slot = (*table)[{type, index}];
  if (!slot) {
    const char* name = type == ROUTEMM_TENSOR_OP_DEVICE_CPU    ? "cpu"
                       : type == ROUTEMM_TENSOR_OP_DEVICE_CUDA ? "cuda"
                                                               : nullptr;
    if (name == nullptr) {
      table->erase({type, index});
      throw InvalidArgument("from_dlpack: DLPack device type " + std::to_string(type) +
                            " has no routemm backend");
    }
    Device device{std::string(name)};
    const DLDevice dl = dlpack_device(device);
    if (dl.device_type != type || dl.device_id != index) {
      table->erase({type, index});
      const int64_t uses[] = {dl.device_type, dl.device_id};
      throw InvalidArgument("from_dlpack: tensor is on " + std::string(name) + " device " +
                            std::to_string(index) + ", routemm uses " + python_tuple(uses));
    }
    auto registry = std::make_shared<KernelRegistry>(device);
    slot = std::make_unique<TensorOpTarget>(TensorOpTarget{std::move(device), std::move(registry)});
  }
  return *slot;
}

// ---- matmul_id ----------------------------------------------------------------------------------

struct MatmulIdShape {
  uint64_t m, top_k, n_experts, n, k;
  bool slotted;
};

// The checks of matmul_id's shapes (weights [n_experts, n, k], x [m, k] or [m, top_k, k], ids
// [m, top_k]), in this order, for every front door that takes framework tensors or arrays.
MatmulIdShape matmul_id_shape(std::span<const int64_t> w, std::span<const int64_t> x,
                              std::span<const int64_t> ids) {
  if (w.size() != 3) {
    throw InvalidArgument("matmul_id weights must be [n_experts, n, k], got shape " +
                          python_tuple(w));
  }
  if (ids.size() != 2) {
    throw InvalidArgument("matmul_id ids must be [m, top_k], got shape " + python_tuple(ids));
  }
  const int64_t n_experts = w[0], n = w[1], k = w[2], m = ids[0], top_k = ids[1];
  const std::string kk = std::to_string(k);
  if ((x.size() != 2 && x.size() != 3) || x.back() != k) {
    throw InvalidArgument("matmul_id x must be [m, " + kk + "] or [m, top_k, " + kk +
                          "] (k = " + kk + " from the weights), got shape " + python_tuple(x));
  }
  const int64_t ids_shape[] = {m, top_k};
  if (m != x[0]) {
    throw InvalidArgument("matmul_id ids must be [m, top_k] with m = " + std::to_string(x[0]) +
                          " (the tokens of x), got shape " + python_tuple(ids_shape));
  }
  if (x.size() == 3 && x[1] != top_k) {
    throw InvalidArgument("matmul_id slotted x " + python_tuple(x) + " has " +
                          std::to_string(x[1]) + " slots per token but ids " +
                          python_tuple(ids_shape) + " has " + std::to_string(top_k));
  }
  auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  return {u(m), u(top_k), u(n_experts), u(n), u(k), x.size() == 3};
}

template <class Int>
uint32_t u32_field(const char* op, const char* name, Int value) {
  if (std::cmp_less(value, 0) || std::cmp_greater(value, 0xFFFFFFFFull)) {
    throw InvalidArgument(std::string(op) + " " + name + " must be a u32, got " +
                          std::to_string(value));
  }
  return static_cast<uint32_t>(value);
}

// One call shape of an expert-ID op (matmul_id over float stacks, or over GGML block stacks) on one
// device, made once: the frozen params, the byte sizes and what a caller allocates.
template <class Params>
struct TensorExpertIdPlan {
  const TensorOpTarget* target = nullptr;
  Params params;
  DType weight_dtype = DType::U8;  // the weights' element type (U8 for block stacks)
  uint64_t weights_nbytes = 0;
  uint64_t x_nbytes = 0;
  RoutemmMatmulIdPlanInfo info{};
};
using TensorMatmulIdPlan = TensorExpertIdPlan<DenseMatmulIdParams>;
using TensorQuantizedMatmulIdPlan = TensorExpertIdPlan<GgmlQuantizedMatmulIdParams>;

// The part of a plan both ops share: the shape fields of the params (u32-checked under `op`), the
// input layout, the byte sizes and the allocation facts. The caller sets the route and the rest.
template <class Params>
std::shared_ptr<TensorExpertIdPlan<Params>> tensor_expert_id_plan(const TensorOpTarget& target,
                                                                  const MatmulIdShape& s,
                                                                  const char* op,
                                                                  uint64_t expert_stride,
                                                                  bool grouped) {
  auto plan = std::make_shared<TensorExpertIdPlan<Params>>();
  plan->target = &target;
  Params& p = plan->params;
  p = expert_id_params<Params>(u32_field(op, "m", s.m), u32_field(op, "n", s.n),
                               u32_field(op, "k", s.k), u32_field(op, "top_k", s.top_k),
                               u32_field(op, "n_experts", s.n_experts), expert_stride);
  p.input_layout =
      s.slotted ? DenseMatmulIdInputLayout::Slotted : DenseMatmulIdInputLayout::SharedPerToken;
  plan->weights_nbytes =
      checked_mul(s.n_experts, p.expert_stride_bytes, "matmul_id weights' byte size");
  plan->x_nbytes =
      checked_product({s.slotted ? s.m * s.top_k : s.m, s.k, 4}, "matmul_id x's byte size");
  plan->info = {checked_mul(s.m, s.top_k, "matmul_id output rows"), s.n, s.m, s.n_experts,
                grouped ? 1u : 0u};
  return plan;
}

std::shared_ptr<const TensorMatmulIdPlan> plan_tensor_matmul_id(
    const TensorOpTarget& target, DType weight_dtype, std::span<const int64_t> w,
    std::span<const int64_t> x, std::span<const int64_t> ids,
    std::optional<DenseMatmulIdRoute> route) {
  const MatmulIdShape s = matmul_id_shape(w, x, ids);
  if (!route) {
    const bool grouped = expert_id_auto_grouped(target.device.backend_name(), s.m, s.top_k,
                                                s.n_experts, /*quantized=*/false);
    route = grouped ? DenseMatmulIdRoute::GroupedPrefill : DenseMatmulIdRoute::Direct;
  } else if (is_grouped(*route) && s.top_k > s.n_experts) {
    throw InvalidArgument("matmul_id " + std::string(to_string(*route)) +
                          " declares its ids distinct per token, which needs top_k <= n_experts "
                          "(got top_k " +
                          std::to_string(s.top_k) + ", n_experts " + std::to_string(s.n_experts) +
                          ")");
  }
  auto plan = tensor_expert_id_plan<DenseMatmulIdParams>(
      target, s, "dense_matmul_id",
      checked_product({s.n, s.k, dtype_size(weight_dtype)}, "matmul_id expert stride"),
      is_grouped(*route));
  plan->weight_dtype = weight_dtype;
  DenseMatmulIdParams& p = plan->params;
  // The grouped kernels route repeated ids correctly, so the call declares DISTINCT_PER_TOKEN as
  // the capacity bound it is (top_k <= n_experts) without reading the ids.
  p.id_multiplicity = is_grouped(*route) ? DenseMatmulIdMultiplicity::DistinctPerToken
                                         : DenseMatmulIdMultiplicity::MayRepeat;
  p.route = *route;
  return plan;
}

// A buffer over caller memory that releases nothing (see the file comment for why no owner is held):
// its release is a no-op, since a Storage without one would hand the memory to the backend's
// deallocator.
Buffer borrowed(const Device& device, uint64_t pointer, uint64_t nbytes, DType dtype,
                std::vector<uint64_t> shape, bool writable) {
  if (nbytes != 0 && pointer == 0) throw InvalidArgument("enqueue: null data pointer");
  if (pointer % dtype_size(dtype) != 0) {
    throw InvalidArgument("enqueue: data pointer is not aligned to " +
                          std::string(dtype_name(dtype)));
  }
  auto storage = std::make_shared<Storage>(device.backend(), reinterpret_cast<void*>(pointer),
                                           nbytes, writable, [] {});
  return Buffer(std::move(storage), 0, nbytes, dtype, std::move(shape));
}

// Commits `encoder`: on a caller's stream without waiting; otherwise to completion, with the GIL
// released (where this thread holds it) while the host backend works.
void start(CommandEncoder& encoder, bool on_stream) {
  if (on_stream) {
    encoder.commit();
  } else if (PyGILState_Check()) {
    without_gil([&] { encoder.commit_and_wait(); });
  } else {
    encoder.commit_and_wait();
  }
}

// The buffers of one planned expert-ID call (either op) over caller memory: weights [n_experts, n,
// expert stride / n elements of the plan's weight dtype], x [m, k] or [m, top_k, k] float32, ids
// [m, top_k] u32, out [m * top_k, n] float32, and the grouped routes' scratch.
struct ExpertIdIo {
  Buffer weights, x, ids, out;
  std::optional<DenseMatmulIdScratch> scratch;
};

template <class Params>
ExpertIdIo expert_id_io(const TensorExpertIdPlan<Params>& plan,
                        const RoutemmMatmulIdPointers& ptr) {
  const Device& device = plan.target->device;
  const Params& p = plan.params;
  const uint64_t m = p.m, top_k = p.top_k, n = p.n, k = p.k, e = p.n_experts;
  const uint64_t row = p.expert_stride_bytes / n / dtype_size(plan.weight_dtype);
  const bool slotted = p.input_layout == DenseMatmulIdInputLayout::Slotted;
  ExpertIdIo io{
      borrowed(device, ptr.weights, plan.weights_nbytes, plan.weight_dtype, {e, n, row}, false),
      borrowed(device, ptr.x, plan.x_nbytes, DType::F32,
               slotted ? std::vector<uint64_t>{m, top_k, k} : std::vector<uint64_t>{m, k}, false),
      borrowed(device, ptr.ids, m * top_k * 4, DType::U32, {m, top_k}, false),
      borrowed(device, ptr.out, m * top_k * n * 4, DType::F32, {m * top_k, n}, true), std::nullopt};
  if (ptr.expert_counts != 0 || ptr.routed_rows != 0) {
    io.scratch.emplace(borrowed(device, ptr.expert_counts, e * 4, DType::U32, {e}, true),
                       borrowed(device, ptr.routed_rows, e * m * 4, DType::U32, {e, m}, true),
                       p.n_experts, p.m);
  }
  return io;
}

// Encodes one planned call with `encode(encoder, registry, io)` (the op) and starts it: on the
// caller's stream without waiting, else to completion.
template <class Params, class Encode>
auto run_planned(const TensorExpertIdPlan<Params>& plan, const RoutemmMatmulIdPointers& ptr,
                 Encode encode) {
  ExpertIdIo io = expert_id_io(plan, ptr);
  const bool on_stream = ptr.has_stream != 0;
  CommandEncoder encoder = plan.target->device.command_encoder(
      EncoderOptions{on_stream ? std::optional<uint64_t>(ptr.stream) : std::nullopt, std::nullopt});
  const auto receipt = encode(encoder, *plan.target->registry, io);
  start(encoder, on_stream);
  return receipt;
}

DenseMatmulIdDispatchReceipt enqueue_matmul_id(const TensorMatmulIdPlan& plan,
                                               const RoutemmMatmulIdPointers& ptr) {
  return run_planned(plan, ptr,
                     [&](CommandEncoder& encoder, KernelRegistry& registry, const ExpertIdIo& io) {
                       return dense_matmul_id(encoder, registry, io.weights, io.x, io.ids, io.out,
                                              io.scratch ? &*io.scratch : nullptr, plan.params);
                     });
}

// ---- quantized_matmul_id ------------------------------------------------------------------------

// The plan of one call shape: the block stack's k from its row bytes, matmul_id's shape checks, the
// route (given, or the shape-only rule: the exact grouped route where expert_id_auto_grouped takes
// it, else direct) and the op's capability checks, all before anything is encoded. The grouped
// routes compute every slot when ids repeat within a token, so the plan declares no promise about
// the ids and nothing reads them on the host.
std::shared_ptr<const TensorQuantizedMatmulIdPlan> plan_tensor_quantized_matmul_id(
    const TensorOpTarget& target, GgmlType ggml_type, std::span<const int64_t> w,
    std::span<const int64_t> x, std::span<const int64_t> ids,
    std::optional<GgmlQuantizedMatmulIdRoute> route) {
  const auto [values, block_bytes] = ggml_block_layout(ggml_type);
  const std::string type_name(to_string(ggml_type));
  if (w.size() != 3 || w[2] % block_bytes != 0) {
    throw InvalidArgument("matmul_id " + type_name + " weights must be uint8 [n_experts, n, k / " +
                          std::to_string(values) + " * " + std::to_string(block_bytes) +
                          "], got shape " + python_tuple(w));
  }
  const int64_t element_shape[] = {w[0], w[1], w[2] / block_bytes * values};
  const MatmulIdShape s = matmul_id_shape(element_shape, x, ids);
  if (!route) {
    const bool grouped = expert_id_auto_grouped(target.device.backend_name(), s.m, s.top_k,
                                                s.n_experts, /*quantized=*/true);
    route = grouped ? GgmlQuantizedMatmulIdRoute::Grouped : GgmlQuantizedMatmulIdRoute::Direct;
  }
  auto plan = tensor_expert_id_plan<GgmlQuantizedMatmulIdParams>(
      target, s, "quantized_matmul_id_ggml",
      checked_mul(s.n, static_cast<uint64_t>(w[2]), "matmul_id expert stride"), is_grouped(*route));
  plan->params.ggml_type = ggml_type;
  plan->params.route = *route;
  quantized_matmul_id_ggml_capability(plan->params);  // the op's own checks, before any call
  return plan;
}

GgmlQuantizedMatmulIdDispatchReceipt enqueue_quantized_matmul_id(
    const TensorQuantizedMatmulIdPlan& plan, const RoutemmMatmulIdPointers& ptr) {
  // GgmlRoutingPolicy.expert_q8_0_mv_nr2 of the tensor ops: the environment's, read once.
  const bool q8_0_mv_nr2 = expert_q8_0_mv_nr2_from_environment();
  return run_planned(
      plan, ptr, [&](CommandEncoder& encoder, KernelRegistry& registry, const ExpertIdIo& io) {
        return quantized_matmul_id_ggml(encoder, registry, io.x, io.weights, io.ids, io.out,
                                        io.scratch ? &*io.scratch : nullptr, plan.params,
                                        DenseMatmulIdMapUse::Build, q8_0_mv_nr2);
      });
}

// ---- moe_experts --------------------------------------------------------------------------------

// One call shape of the experts block on one device: the params with the block's automatic route,
// the workspace layout and the byte size of every input.
struct TensorMoeExpertsPlan {
  const TensorOpTarget* target = nullptr;
  MoeExpertsParams params;
  MoeExpertsWorkspaceLayout layout;
  uint64_t hidden_nbytes = 0, stack_nbytes = 0, down_nbytes = 0;
  uint64_t gate_up_bias_nbytes = 0, down_bias_nbytes = 0;  // 0: no such bias
  RoutemmMoeExpertsPlanInfo info{};
};

// The [E, n, k] element shape of a stack given as the framework has it (block stacks: k from the
// row bytes), checked under `name`.
std::vector<int64_t> stack_elements(std::span<const int64_t> w, const MoeExpertsParams& p,
                                    const char* name) {
  if (w.size() != 3) {
    throw InvalidArgument(std::string("moe_experts ") + name + " must be a 3-D stack, got shape " +
                          python_tuple(w));
  }
  if (!p.ggml_type) return {w[0], w[1], w[2]};
  const auto [values, block_bytes] = ggml_block_layout(*p.ggml_type);
  if (w[2] % block_bytes != 0) {
    throw InvalidArgument(std::string("moe_experts ") + name + " must be uint8 [E, n, k / " +
                          std::to_string(values) + " * " + std::to_string(block_bytes) + "] " +
                          std::string(to_string(*p.ggml_type)) + " blocks, got shape " +
                          python_tuple(w));
  }
  return {w[0], w[1], w[2] / block_bytes * values};
}

std::shared_ptr<const TensorMoeExpertsPlan> plan_tensor_moe_experts(
    const TensorOpTarget& target, const RoutemmMoeExpertsShapes& sh) {
  const std::span<const int64_t> hidden{sh.hidden_shape, sh.hidden_rank},
      ids{sh.ids_shape, sh.ids_rank}, weights{sh.weights_shape, sh.weights_rank},
      gate_up{sh.gate_up_shape, sh.gate_up_rank}, down{sh.down_shape, sh.down_rank};
  const char* op = "moe_experts";
  if (hidden.size() != 2) {
    throw InvalidArgument("moe_experts hidden must be [m, H], got shape " + python_tuple(hidden));
  }
  const int64_t m = hidden[0], h = hidden[1];
  if (ids.size() != 2 || ids[0] != m) {
    throw InvalidArgument("moe_experts top_k_index must be [" + std::to_string(m) +
                          ", top_k], got shape " + python_tuple(ids));
  }
  if (!std::equal(weights.begin(), weights.end(), ids.begin(), ids.end())) {
    throw InvalidArgument("moe_experts top_k_weights must have the shape of top_k_index " +
                          python_tuple(ids) + ", got " + python_tuple(weights));
  }
  auto plan = std::make_shared<TensorMoeExpertsPlan>();
  plan->target = &target;
  MoeExpertsParams& p = plan->params;
  if (sh.weight_dtype >= std::size(kAllDTypes)) {
    throw InvalidArgument("moe_experts: unknown weight dtype code " +
                          std::to_string(sh.weight_dtype));
  }
  if (sh.ggml_type >= static_cast<int64_t>(std::size(kAllGgmlTypes))) {
    throw InvalidArgument("moe_experts: unknown GGML type code " + std::to_string(sh.ggml_type));
  }
  p.weight_dtype = kAllDTypes[sh.weight_dtype];
  if (sh.ggml_type >= 0) p.ggml_type = kAllGgmlTypes[static_cast<size_t>(sh.ggml_type)];
  p.split_gate_up = sh.split_gate_up != 0;
  const std::vector<int64_t> d = stack_elements(down, p, "down");
  if (d[1] != h) {
    throw InvalidArgument("moe_experts down must be [E, " + std::to_string(h) + ", I], got shape " +
                          python_tuple(d));
  }
  const int64_t e = d[0], inter = d[2];
  const std::vector<int64_t> g = stack_elements(gate_up, p, "gate_up");
  const int64_t want[] = {e, p.split_gate_up ? inter : 2 * inter, h};
  if (!std::equal(g.begin(), g.end(), std::begin(want), std::end(want))) {
    throw InvalidArgument(std::string("moe_experts ") + (p.split_gate_up ? "gate" : "gate_up") +
                          " must be " + python_tuple(want) + ", got shape " + python_tuple(g));
  }
  p.m = u32_field(op, "m", m);
  p.top_k = u32_field(op, "top_k", ids[1]);
  p.n_experts = u32_field(op, "n_experts", e);
  p.hidden = u32_field(op, "H", h);
  p.intermediate = u32_field(op, "I", inter);
  if (sh.activation > 1) {
    throw InvalidArgument("moe_experts: unknown activation code " + std::to_string(sh.activation));
  }
  p.activation = sh.activation == 1 ? MoeActivation::SwigluOai : MoeActivation::Silu;
  p.swiglu_alpha = sh.swiglu_alpha;
  p.swiglu_limit = sh.swiglu_limit;
  p.gate_up_bias = sh.gate_up_bias != 0;
  p.down_bias = sh.down_bias != 0;
  p.weights_before_ffn = sh.weights_before_ffn != 0;
  if (sh.exact > 2) {
    throw InvalidArgument("moe_experts: unknown route mode " + std::to_string(sh.exact));
  }
  moe_experts_auto_route(*target.registry, p,
                         sh.exact == 2   ? MoeRouteMode::BatchInvariant
                         : sh.exact == 1 ? MoeRouteMode::Exact
                                         : MoeRouteMode::Default);
  plan->layout = moe_experts_workspace(p);  // every extent and route check of the op
  plan->hidden_nbytes = checked_product({p.m, p.hidden, 4}, "moe_experts hidden bytes");
  plan->stack_nbytes = checked_product(
      {static_cast<uint64_t>(gate_up[0]), static_cast<uint64_t>(gate_up[1]),
       static_cast<uint64_t>(gate_up[2]), p.ggml_type ? 1u : dtype_size(p.weight_dtype)},
      "moe_experts gate_up bytes");
  plan->down_nbytes = checked_product(
      {static_cast<uint64_t>(down[0]), static_cast<uint64_t>(down[1]),
       static_cast<uint64_t>(down[2]), p.ggml_type ? 1u : dtype_size(p.weight_dtype)},
      "moe_experts down bytes");
  if (p.gate_up_bias) {
    plan->gate_up_bias_nbytes = checked_product(
        {p.n_experts, p.split_gate_up ? 1u : 2u, p.intermediate, 4}, "moe_experts gate_up_bias");
  }
  if (p.down_bias) {
    plan->down_bias_nbytes = checked_product({p.n_experts, p.hidden, 4}, "moe_experts down_bias");
  }
  plan->info = {p.m, p.hidden, plan->layout.total_bytes, moe_experts_grouped(p) ? 1u : 0u};
  return plan;
}

std::string moe_experts_route_name(const MoeExpertsParams& p) {
  return std::string(p.ggml_type ? to_string(p.block_route) : to_string(p.route));
}

MoeExpertsReceipt enqueue_moe_experts(const TensorMoeExpertsPlan& plan,
                                      const RoutemmMoeExpertsPointers& ptr) {
  const Device& device = plan.target->device;
  const MoeExpertsParams& p = plan.params;
  const uint64_t m = p.m, top_k = p.top_k, h = p.hidden;
  const DType wdtype = p.weight_dtype;
  const uint64_t esize = dtype_size(wdtype);
  auto stack = [&](uint64_t pointer, uint64_t nbytes) {
    return borrowed(device, pointer, nbytes, wdtype, {nbytes / esize}, false);
  };
  const Buffer hidden = borrowed(device, ptr.hidden, plan.hidden_nbytes, DType::F32, {m, h}, false);
  const Buffer ids = borrowed(device, ptr.ids, m * top_k * 4, DType::U32, {m, top_k}, false);
  const Buffer weights =
      borrowed(device, ptr.weights, m * top_k * 4, DType::F32, {m, top_k}, false);
  const Buffer gate_up = stack(ptr.gate_up, plan.stack_nbytes);
  std::optional<Buffer> up;
  if (p.split_gate_up) up = stack(ptr.up, plan.stack_nbytes);
  const Buffer down = stack(ptr.down, plan.down_nbytes);
  const Buffer out = borrowed(device, ptr.out, m * h * 4, DType::F32, {m, h}, true);
  const Buffer workspace = borrowed(device, ptr.workspace, plan.layout.total_bytes, DType::U8,
                                    {plan.layout.total_bytes}, true);
  // The biases the plan has (a missing pointer borrows nothing: the op then names the bias).
  std::optional<Buffer> gate_up_bias, up_bias, down_bias;
  const auto bias = [&](std::optional<Buffer>& b, uint64_t pointer, uint64_t nbytes) {
    if (nbytes != 0 && pointer != 0)
      b = borrowed(device, pointer, nbytes, DType::F32, {nbytes / 4}, false);
  };
  bias(gate_up_bias, ptr.gate_up_bias, plan.gate_up_bias_nbytes);
  if (p.split_gate_up) bias(up_bias, ptr.up_bias, plan.gate_up_bias_nbytes);
  bias(down_bias, ptr.down_bias, plan.down_bias_nbytes);
  const MoeExpertsBiases biases{gate_up_bias ? &*gate_up_bias : nullptr,
                                up_bias ? &*up_bias : nullptr, down_bias ? &*down_bias : nullptr};
  const bool on_stream = ptr.has_stream != 0;
  CommandEncoder encoder = device.command_encoder(
      EncoderOptions{on_stream ? std::optional<uint64_t>(ptr.stream) : std::nullopt, std::nullopt});
  // A refusal inside drops this encoder uncommitted: nothing of the call runs.
  const MoeExpertsReceipt receipt =
      moe_experts(encoder, *plan.target->registry, hidden, ids, weights, gate_up,
                  up ? &*up : nullptr, down, out, workspace, p, biases);
  start(encoder, on_stream);
  return receipt;
}

// ---- moe_gate -----------------------------------------------------------------------------------

void enqueue_moe_gate(const RoutemmMoeGateCall& call) {
  const char* op = "moe_gate";
  MoeGateParams p;
  p.m = u32_field(op, "m", call.m);
  p.n_experts = u32_field(op, "n_experts", call.n_experts);
  p.top_k = u32_field(op, "top_k", call.top_k);
  p.renormalize = call.renormalize != 0;
  p.scoring = parse_moe_gate_scoring(op, call.scoring_func != nullptr ? call.scoring_func : "");
  p.num_expert_group = u32_field(op, "num_expert_group", call.num_expert_group);
  p.topk_group = u32_field(op, "topk_group", call.topk_group);
  p.routed_scaling_factor = moe_gate_scaling_factor(op, call.routed_scaling_factor);
  check_moe_gate_params(p);
  const TensorOpTarget& target = tensor_op_target(call.device_type, call.device_index);
  const Device& device = target.device;
  const uint64_t m = p.m, e = p.n_experts, k = p.top_k;
  const uint64_t logits_bytes = checked_product({m, e, 4}, "moe_gate logits' byte size");
  const uint64_t slot_bytes = checked_product({m, k, 4}, "moe_gate top-k byte size");
  const Buffer logits = borrowed(device, call.logits, logits_bytes, DType::F32, {m, e}, false);
  const Buffer weights = borrowed(device, call.weights, slot_bytes, DType::F32, {m, k}, true);
  const Buffer ids = borrowed(device, call.ids, slot_bytes, DType::I32, {m, k}, true);
  std::optional<Buffer> bias;
  if (call.bias != 0) bias = borrowed(device, call.bias, e * 4, DType::F32, {e}, false);
  std::optional<Buffer> router_bias;
  if (call.router_bias != 0) {
    router_bias = borrowed(device, call.router_bias, e * 4, DType::F32, {e}, false);
  }
  const bool on_stream = call.has_stream != 0;
  CommandEncoder encoder = device.command_encoder(EncoderOptions{
      on_stream ? std::optional<uint64_t>(call.stream) : std::nullopt, std::nullopt});
  moe_gate(encoder, *target.registry, logits, weights, ids, p, bias ? &*bias : nullptr,
           router_bias ? &*router_bias : nullptr);
  start(encoder, on_stream);
}

// ---- moe_experts_fused --------------------------------------------------------------------------

DType fused_dtype(const char* name, uint32_t code) {
  if (code >= std::size(kAllDTypes)) {
    throw InvalidArgument(std::string("moe_experts: unknown ") + name + " code " +
                          std::to_string(code));
  }
  return kAllDTypes[code];
}

MoeExpertsFusedParams fused_params(const RoutemmMoeExpertsFusedCall& call) {
  const char* op = "moe_experts";
  MoeExpertsFusedParams p;
  p.m = u32_field(op, "m", call.m);
  p.top_k = u32_field(op, "top_k", call.top_k);
  p.n_experts = u32_field(op, "n_experts", call.n_experts);
  p.hidden = u32_field(op, "H", call.hidden);
  p.intermediate = u32_field(op, "I", call.intermediate);
  p.split_gate_up = call.split_gate_up != 0;
  p.dtype = fused_dtype("dtype", call.dtype);
  p.weights_dtype = fused_dtype("weights dtype", call.weights_dtype);
  p.id_bytes = call.id_bytes;
  return p;
}

bool moe_experts_fused_serves_call(const RoutemmMoeExpertsFusedCall& call) {
  const char* backend = call.device_type == ROUTEMM_TENSOR_OP_DEVICE_CUDA  ? "cuda"
                        : call.device_type == ROUTEMM_TENSOR_OP_DEVICE_CPU ? "cpu"
                                                                           : "";
  return moe_experts_fused_serves(backend, fused_params(call));
}

void enqueue_moe_experts_fused(const RoutemmMoeExpertsFusedCall& call) {
  const MoeExpertsFusedParams p = fused_params(call);
  const uint64_t act_bytes = moe_experts_fused_workspace_bytes(p);
  const TensorOpTarget& target = tensor_op_target(call.device_type, call.device_index);
  const Device& device = target.device;
  const uint64_t m = p.m, k = p.top_k, e = p.n_experts, h = p.hidden, inter = p.intermediate;
  const uint64_t es = dtype_size(p.dtype);
  const uint64_t gate_rows = p.split_gate_up ? inter : 2 * inter;
  const auto bytes = [](std::initializer_list<uint64_t> f) {
    return checked_product(f, "moe_experts byte size");
  };
  const Buffer x = borrowed(device, call.x, bytes({m, h, es}), p.dtype, {m, h}, false);
  const DType ids_dtype = p.id_bytes == 8 ? DType::U8 : DType::U32;
  const Buffer ids = borrowed(device, call.ids, bytes({m, k, p.id_bytes}), ids_dtype,
                              {m * k * p.id_bytes / dtype_size(ids_dtype)}, false);
  const Buffer weights = borrowed(device, call.weights, bytes({m, k, dtype_size(p.weights_dtype)}),
                                  p.weights_dtype, {m, k}, false);
  const Buffer gate_up = borrowed(device, call.gate_up, bytes({e, gate_rows, h, es}), p.dtype,
                                  {e, gate_rows, h}, false);
  std::optional<Buffer> up;
  if (p.split_gate_up) {
    up = borrowed(device, call.up, bytes({e, inter, h, es}), p.dtype, {e, inter, h}, false);
  }
  const Buffer down =
      borrowed(device, call.down, bytes({e, h, inter, es}), p.dtype, {e, h, inter}, false);
  const Buffer out = borrowed(device, call.out, bytes({m, h, es}), p.dtype, {m, h}, true);
  const Buffer workspace =
      borrowed(device, call.workspace, act_bytes, DType::U8, {act_bytes}, true);
  const bool on_stream = call.has_stream != 0;
  CommandEncoder encoder = device.command_encoder(EncoderOptions{
      on_stream ? std::optional<uint64_t>(call.stream) : std::nullopt, std::nullopt});
  moe_experts_fused(encoder, *target.registry, x, ids, weights, gate_up, up ? &*up : nullptr, down,
                    out, workspace, p);
  start(encoder, on_stream);
}

// ---- q4_matmul ----------------------------------------------------------------------------------

void enqueue_q4_matmul(const RoutemmQ4MatmulCall& call) {
  const char* op = "quantized_matmul_ggml";
  GgmlQuantizedMatmulParams p;
  p.m = u32_field(op, "m", call.m);
  p.n = u32_field(op, "n", call.n);
  p.k = u32_field(op, "k", call.k);
  p.ggml_type = GgmlType::Q4_0;
  // The tensor ops' routing policy: the environment's, read once (as the knobs' table says of
  // Python knobs: at first use).
  static const GgmlRoutingPolicy policy = ggml_routing_policy_from_environment();
  const TensorOpTarget& target = tensor_op_target(call.device_type, call.device_index);
  const Device& device = target.device;
  const uint64_t m = p.m, n = p.n, k = p.k;
  const Buffer x = borrowed(device, call.x, call.x_nbytes, DType::F32, {m, k}, false);
  const Buffer w =
      borrowed(device, call.weight, call.weight_nbytes, DType::U8, {call.weight_nbytes}, false);
  const Buffer out = borrowed(device, call.out, m * n * 4, DType::F32, {m, n}, true);
  const bool on_stream = call.has_stream != 0;
  CommandEncoder encoder = device.command_encoder(EncoderOptions{
      on_stream ? std::optional<uint64_t>(call.stream) : std::nullopt, std::nullopt});
  dense_q4_auto(encoder, *target.registry, device, x, w, out, p, policy);
  start(encoder, on_stream);
}

// ---- the C ABI ----------------------------------------------------------------------------------

void write_error(char* error, size_t size, const char* message) {
  if (error == nullptr || size == 0) return;
  const size_t n = std::min(size - 1, std::strlen(message));
  std::memcpy(error, message, n);
  error[n] = '\0';
}

template <class Work>
int guarded(char* error, size_t size, Work&& work) noexcept {
  try {
    work();
    return ROUTEMM_TENSOR_OP_OK;
  } catch (const InvalidArgument& e) {
    write_error(error, size, e.what());
    return ROUTEMM_TENSOR_OP_INVALID_ARGUMENT;
  } catch (const OutOfMemory& e) {
    write_error(error, size, e.what());
    return ROUTEMM_TENSOR_OP_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    write_error(error, size, e.what());
    return ROUTEMM_TENSOR_OP_ERROR;
  } catch (...) {
    write_error(error, size, "routemm: unknown error");
    return ROUTEMM_TENSOR_OP_ERROR;
  }
}

extern "C" int abi_plan_matmul_id(const RoutemmMatmulIdShapes* shapes, const void** plan,
                                  RoutemmMatmulIdPlanInfo* info, char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    if (shapes->weight_dtype >= std::size(kAllDTypes)) {
      throw InvalidArgument("matmul_id: unknown weight dtype code " +
                            std::to_string(shapes->weight_dtype));
    }
    const TensorOpTarget& target = tensor_op_target(shapes->device_type, shapes->device_index);
    auto made = plan_tensor_matmul_id(
        target, kAllDTypes[shapes->weight_dtype], {shapes->weights_shape, shapes->weights_rank},
        {shapes->x_shape, shapes->x_rank}, {shapes->ids_shape, shapes->ids_rank}, std::nullopt);
    *info = made->info;
    // Kept for the process, as the ABI promises (the consumer caches it per call shape).
    *plan = new std::shared_ptr<const TensorMatmulIdPlan>(std::move(made));
  });
}

extern "C" int abi_enqueue_matmul_id(const void* plan, const RoutemmMatmulIdPointers* pointers,
                                     char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    enqueue_matmul_id(**static_cast<const std::shared_ptr<const TensorMatmulIdPlan>*>(plan),
                      *pointers);
  });
}

extern "C" int abi_enqueue_moe_gate(const RoutemmMoeGateCall* call, char* error,
                                    size_t error_size) {
  return guarded(error, error_size, [&] { enqueue_moe_gate(*call); });
}

extern "C" int abi_enqueue_q4_matmul(const RoutemmQ4MatmulCall* call, char* error,
                                     size_t error_size) {
  return guarded(error, error_size, [&] { enqueue_q4_matmul(*call); });
}

extern "C" int abi_plan_quantized_matmul_id(const RoutemmQuantizedMatmulIdShapes* shapes,
                                            const void** plan, RoutemmMatmulIdPlanInfo* info,
                                            char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    if (shapes->ggml_type >= std::size(kAllGgmlTypes)) {
      throw InvalidArgument("matmul_id: unknown GGML type code " +
                            std::to_string(shapes->ggml_type));
    }
    const TensorOpTarget& target = tensor_op_target(shapes->device_type, shapes->device_index);
    auto made = plan_tensor_quantized_matmul_id(
        target, kAllGgmlTypes[shapes->ggml_type], {shapes->weights_shape, shapes->weights_rank},
        {shapes->x_shape, shapes->x_rank}, {shapes->ids_shape, shapes->ids_rank}, std::nullopt);
    *info = made->info;
    *plan = new std::shared_ptr<const TensorQuantizedMatmulIdPlan>(std::move(made));
  });
}

extern "C" int abi_enqueue_quantized_matmul_id(const void* plan,
                                               const RoutemmMatmulIdPointers* pointers, char* error,
                                               size_t error_size) {
  return guarded(error, error_size, [&] {
    enqueue_quantized_matmul_id(
        **static_cast<const std::shared_ptr<const TensorQuantizedMatmulIdPlan>*>(plan), *pointers);
  });
}

extern "C" int abi_plan_moe_experts(const RoutemmMoeExpertsShapes* shapes, const void** plan,
                                    RoutemmMoeExpertsPlanInfo* info, char* error,
                                    size_t error_size) {
  return guarded(error, error_size, [&] {
    const TensorOpTarget& target = tensor_op_target(shapes->device_type, shapes->device_index);
    auto made = plan_tensor_moe_experts(target, *shapes);
    *info = made->info;
    *plan = new std::shared_ptr<const TensorMoeExpertsPlan>(std::move(made));
  });
}

extern "C" int abi_enqueue_moe_experts(const void* plan, const RoutemmMoeExpertsPointers* pointers,
                                       char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    enqueue_moe_experts(**static_cast<const std::shared_ptr<const TensorMoeExpertsPlan>*>(plan),
                        *pointers);
  });
}

extern "C" int abi_moe_experts_fused_serves(const RoutemmMoeExpertsFusedCall* call) {
  try {
    return moe_experts_fused_serves_call(*call) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

extern "C" int abi_enqueue_moe_experts_fused(const RoutemmMoeExpertsFusedCall* call, char* error,
                                             size_t error_size) {
  return guarded(error, error_size, [&] { enqueue_moe_experts_fused(*call); });
}

const RoutemmTensorOpAbi kTensorOpAbi = {
    ROUTEMM_TENSOR_OP_ABI_VERSION,
    sizeof(RoutemmTensorOpAbi),
    &abi_plan_matmul_id,
    &abi_enqueue_matmul_id,
    &abi_enqueue_q4_matmul,
    &abi_plan_quantized_matmul_id,
    &abi_enqueue_quantized_matmul_id,
    &abi_plan_moe_experts,
    &abi_enqueue_moe_experts,
    &abi_enqueue_moe_gate,
    &abi_moe_experts_fused_serves,
    &abi_enqueue_moe_experts_fused,
};

// The ABI's pointer record of the Python kernels' call (stream: the framework's current stream, or
// None for a host device).
RoutemmMatmulIdPointers pointers(uint64_t weights, uint64_t x, uint64_t ids, uint64_t output,
                                 uint64_t expert_counts, uint64_t routed_rows,
                                 std::optional<uint64_t> stream) {
  return {weights,           x, ids, output, expert_counts, routed_rows, stream ? 1u : 0u,
          stream.value_or(0)};
}

// A plan class for Python: what the Python kernels allocate from (rows, n, m, n_experts, grouped)
// and the route it runs.
template <class Params>
void bind_plan(py::module_& m, const char* name) {
  using Plan = TensorExpertIdPlan<Params>;
  py::class_<Plan, std::shared_ptr<Plan>>(m, name)
      .def_property_readonly("rows", [](const Plan& p) { return p.info.rows; })
      .def_property_readonly("n", [](const Plan& p) { return p.info.n; })
      .def_property_readonly("m", [](const Plan& p) { return p.info.m; })
      .def_property_readonly("n_experts", [](const Plan& p) { return p.info.n_experts; })
      .def_property_readonly("grouped", [](const Plan& p) { return p.info.grouped != 0; })
      .def_property_readonly("route",
                             [](const Plan& p) { return std::string(to_string(p.params.route)); });
}

}  // namespace

void init_enqueue(py::module_& m) {
  static_assert(std::size(kAllDTypes) == 7, "the ABI's dtype codes are routemm::DType values");
  static_assert(kAllGgmlTypes[0] == GgmlType::Q4_0 && kAllGgmlTypes[3] == GgmlType::Q8_0,
                "the ABI's GGML type codes are routemm::GgmlType values");
  m.attr("DENSE_MATMUL_ID_AUTO_GROUPED_MIN_TOKENS") = kExpertIdAutoGroupedMinTokens;
  m.def(
      "_expert_id_auto_grouped",
      [](const std::string& backend, uint64_t tokens, uint64_t top_k, uint64_t n_experts,
         bool quantized, uint64_t mm_threshold) {
        return expert_id_auto_grouped(backend, tokens, top_k, n_experts, quantized, mm_threshold);
      },
      "The automatic expert-ID route (routemm::expert_id_auto_grouped) under the policy's "
      "expert_mm_threshold: True for the exact grouped route.");
  m.attr("TENSOR_OP_ABI_VERSION") = ROUTEMM_TENSOR_OP_ABI_VERSION;
  m.attr("_tensor_op_abi") =
      py::capsule(static_cast<const void*>(&kTensorOpAbi), ROUTEMM_TENSOR_OP_ABI_CAPSULE);

  m.def(
      "_tensor_op_target",
      [](int32_t type, int32_t index) {
        const TensorOpTarget& t = tensor_op_target(type, index);
        return py::make_tuple(t.device, t.registry);
      },
      py::arg("device_type"), py::arg("device_index"),
      "(Device, KernelRegistry) of a DLPack device: one pair per process, shared by the Python "
      "and the C++ kernels of the tensor ops.");
  m.def(
      "_matmul_id_shapes",
      [](const std::vector<int64_t>& w, const std::vector<int64_t>& x,
         const std::vector<int64_t>& ids) {
        const MatmulIdShape s = matmul_id_shape(w, x, ids);
        return py::make_tuple(s.m, s.top_k, s.n_experts, s.n, s.k, s.slotted);
      },
      py::arg("weights_shape"), py::arg("x_shape"), py::arg("ids_shape"),
      "matmul_id's shape checks: (m, top_k, n_experts, n, k, slotted).");

  bind_plan<DenseMatmulIdParams>(m, "_TensorMatmulIdPlan");
  m.def(
      "_plan_tensor_matmul_id",
      [](int32_t type, int32_t index, DType weight_dtype, const std::vector<int64_t>& w,
         const std::vector<int64_t>& x, const std::vector<int64_t>& ids,
         const std::optional<std::string>& route) {
        std::optional<DenseMatmulIdRoute> parsed;
        if (route) {
          parsed = parse_enum(
              "matmul_id", *route,
              std::array{DenseMatmulIdRoute::Direct, DenseMatmulIdRoute::GroupedPrefill,
                         DenseMatmulIdRoute::GroupedTensorTf32,
                         DenseMatmulIdRoute::GroupedTensorLowp, DenseMatmulIdRoute::DirectBf16Dot,
                         DenseMatmulIdRoute::GroupedBf16Dot},
              "route");
        }
        auto plan =
            plan_tensor_matmul_id(tensor_op_target(type, index), weight_dtype, w, x, ids, parsed);
        return std::const_pointer_cast<TensorMatmulIdPlan>(plan);
      },
      py::arg("device_type"), py::arg("device_index"), py::arg("weight_dtype"),
      py::arg("weights_shape"), py::arg("x_shape"), py::arg("ids_shape"), py::arg("route"),
      "The plan of one matmul_id call shape (route value or None: the shape-only rule).");
  m.def(
      "_enqueue_dense_matmul_id",
      [](const TensorMatmulIdPlan& plan, uint64_t weights, uint64_t x, uint64_t ids,
         uint64_t output, uint64_t expert_counts, uint64_t routed_rows,
         std::optional<uint64_t> stream) {
        const auto r = enqueue_matmul_id(
            plan, pointers(weights, x, ids, output, expert_counts, routed_rows, stream));
        return py::make_tuple(dtype_name(r.weight_dtype), to_string(r.route), r.dispatch_count);
      },
      py::arg("plan"), py::arg("weights"), py::arg("input"), py::arg("ids"), py::arg("output"),
      py::arg("expert_counts"), py::arg("routed_rows"), py::arg("stream"),
      "One planned matmul_id call on caller memory given by pointers, encoded and started "
      "(returns the native receipt tuple of _dense_matmul_id).");
  bind_plan<GgmlQuantizedMatmulIdParams>(m, "_TensorQuantizedMatmulIdPlan");
  m.def(
      "_plan_tensor_quantized_matmul_id",
      [](int32_t type, int32_t index, const std::string& ggml_type, const std::vector<int64_t>& w,
         const std::vector<int64_t>& x, const std::vector<int64_t>& ids,
         const std::optional<std::string>& route) {
        const GgmlType parsed_type = parse_enum("matmul_id", ggml_type, kAllGgmlTypes, "GGML type");
        std::optional<GgmlQuantizedMatmulIdRoute> parsed;
        if (route)
          parsed = parse_enum("matmul_id", *route, kAllGgmlQuantizedMatmulIdRoutes, "route");
        auto plan = plan_tensor_quantized_matmul_id(tensor_op_target(type, index), parsed_type, w,
                                                    x, ids, parsed);
        return std::const_pointer_cast<TensorQuantizedMatmulIdPlan>(plan);
      },
      py::arg("device_type"), py::arg("device_index"), py::arg("ggml_type"),
      py::arg("weights_shape"), py::arg("x_shape"), py::arg("ids_shape"), py::arg("route"),
      "The plan of one matmul_id call shape over a GGML block stack (route value or None: the "
      "shape-only rule).");
  m.def(
      "_enqueue_quantized_matmul_id",
      [](const TensorQuantizedMatmulIdPlan& plan, uint64_t weights, uint64_t x, uint64_t ids,
         uint64_t output, uint64_t expert_counts, uint64_t routed_rows,
         std::optional<uint64_t> stream) {
        const auto r = enqueue_quantized_matmul_id(
            plan, pointers(weights, x, ids, output, expert_counts, routed_rows, stream));
        return py::make_tuple(std::string(to_string(r.ggml_type)), std::string(to_string(r.route)),
                              r.dispatch_count, std::string(r.pipeline));
      },
      py::arg("plan"), py::arg("weights"), py::arg("input"), py::arg("ids"), py::arg("output"),
      py::arg("expert_counts"), py::arg("routed_rows"), py::arg("stream"),
      "One planned block-stack matmul_id call on caller memory given by pointers, encoded and "
      "started (returns the native receipt tuple of _quantized_matmul_id_ggml).");
  py::class_<TensorMoeExpertsPlan, std::shared_ptr<TensorMoeExpertsPlan>>(m,
                                                                          "_TensorMoeExpertsPlan")
      .def_property_readonly("m", [](const TensorMoeExpertsPlan& p) { return p.info.m; })
      .def_property_readonly("hidden", [](const TensorMoeExpertsPlan& p) { return p.info.hidden; })
      .def_property_readonly("workspace_bytes",
                             [](const TensorMoeExpertsPlan& p) { return p.info.workspace_bytes; })
      .def_property_readonly("grouped",
                             [](const TensorMoeExpertsPlan& p) { return p.info.grouped != 0; })
      .def_property_readonly(
          "route", [](const TensorMoeExpertsPlan& p) { return moe_experts_route_name(p.params); });
  m.def(
      "_plan_tensor_moe_experts",
      [](int32_t type, int32_t index, DType weight_dtype, std::optional<std::string> ggml_type,
         bool split_gate_up, uint32_t route_mode, std::vector<int64_t> hidden,
         std::vector<int64_t> ids, std::vector<int64_t> weights, std::vector<int64_t> gate_up,
         std::vector<int64_t> down, const std::string& activation, float swiglu_alpha,
         float swiglu_limit, bool gate_up_bias, bool down_bias, bool weights_before_ffn) {
        int32_t type_code = -1;
        if (ggml_type) {
          const GgmlType parsed = parse_enum("moe_experts", *ggml_type, kAllGgmlTypes, "ggml_type");
          type_code = static_cast<int32_t>(parsed);
        }
        const auto rank = [](const std::vector<int64_t>& v) {
          return static_cast<uint32_t>(v.size());
        };
        if (activation != "silu" && activation != "swiglu_oai") {
          throw InvalidArgument("moe_experts activation must be 'silu' or 'swiglu_oai', got '" +
                                activation + "'");
        }
        const RoutemmMoeExpertsShapes shapes{type,
                                             index,
                                             static_cast<uint32_t>(weight_dtype),
                                             type_code,
                                             split_gate_up ? 1u : 0u,
                                             route_mode,
                                             rank(hidden),
                                             rank(ids),
                                             rank(weights),
                                             rank(gate_up),
                                             rank(down),
                                             hidden.data(),
                                             ids.data(),
                                             weights.data(),
                                             gate_up.data(),
                                             down.data(),
                                             activation == "swiglu_oai" ? 1u : 0u,
                                             swiglu_alpha,
                                             swiglu_limit,
                                             gate_up_bias ? 1u : 0u,
                                             down_bias ? 1u : 0u,
                                             weights_before_ffn ? 1u : 0u};
        auto plan = plan_tensor_moe_experts(tensor_op_target(type, index), shapes);
        return std::const_pointer_cast<TensorMoeExpertsPlan>(plan);
      },
      py::arg("device_type"), py::arg("device_index"), py::arg("weight_dtype"),
      py::arg("ggml_type"), py::arg("split_gate_up"), py::arg("route_mode"),
      py::arg("hidden_shape"), py::arg("ids_shape"), py::arg("weights_shape"),
      py::arg("gate_up_shape"), py::arg("down_shape"), py::arg("activation") = "silu",
      py::arg("swiglu_alpha") = 1.702f, py::arg("swiglu_limit") = 7.0f,
      py::arg("gate_up_bias") = false, py::arg("down_bias") = false,
      py::arg("weights_before_ffn") = false,
      "The plan of one moe_experts call shape (the block's shape-only route; route_mode 0 the "
      "default, 1 the exact routes, 2 batch-invariant).");
  m.def(
      "_enqueue_moe_experts",
      [](const TensorMoeExpertsPlan& plan, uint64_t hidden, uint64_t ids, uint64_t weights,
         uint64_t gate_up, uint64_t up, uint64_t down, uint64_t output, uint64_t workspace,
         std::optional<uint64_t> stream, uint64_t gate_up_bias, uint64_t up_bias,
         uint64_t down_bias) {
        const RoutemmMoeExpertsPointers ptr{
            hidden,       ids,     weights,   gate_up,          up,
            down,         output,  workspace, stream ? 1u : 0u, stream.value_or(0),
            gate_up_bias, up_bias, down_bias};
        const MoeExpertsReceipt r = enqueue_moe_experts(plan, ptr);
        return py::make_tuple(moe_experts_route_name(plan.params), r.dispatch_count);
      },
      py::arg("plan"), py::arg("hidden"), py::arg("ids"), py::arg("weights"), py::arg("gate_up"),
      py::arg("up"), py::arg("down"), py::arg("output"), py::arg("workspace"), py::arg("stream"),
      py::arg("gate_up_bias") = 0, py::arg("up_bias") = 0, py::arg("down_bias") = 0,
      "One planned moe_experts call on caller memory given by pointers, encoded and started "
      "(returns (route, dispatch count)).");
  m.def(
      "_enqueue_moe_gate",
      [](int32_t type, int32_t index, int64_t m_, int64_t n_experts, int64_t top_k,
         bool renormalize, uint64_t logits, uint64_t weights, uint64_t ids,
         std::optional<uint64_t> stream, const std::string& scoring_func, uint64_t bias,
         int64_t num_expert_group, int64_t topk_group, double routed_scaling_factor,
         uint64_t router_bias) {
        const RoutemmMoeGateCall call{type,
                                      index,
                                      m_,
                                      n_experts,
                                      top_k,
                                      renormalize ? 1u : 0u,
                                      logits,
                                      weights,
                                      ids,
                                      stream ? 1u : 0u,
                                      stream.value_or(0),
                                      scoring_func.c_str(),
                                      bias,
                                      num_expert_group,
                                      topk_group,
                                      routed_scaling_factor,
                                      router_bias};
        enqueue_moe_gate(call);
      },
      py::arg("device_type"), py::arg("device_index"), py::arg("m"), py::arg("n_experts"),
      py::arg("top_k"), py::arg("renormalize"), py::arg("logits"), py::arg("weights"),
      py::arg("ids"), py::arg("stream"), py::arg("scoring_func"), py::arg("bias"),
      py::arg("num_expert_group"), py::arg("topk_group"), py::arg("routed_scaling_factor"),
      py::arg("router_bias") = 0,
      "One moe_gate call on caller memory given by pointers, encoded and started.");
  m.def(
      "_enqueue_q4_matmul",
      [](int32_t type, int32_t index, int64_t m_, int64_t n, int64_t k, uint64_t x,
         uint64_t x_nbytes, uint64_t weight, uint64_t weight_nbytes, uint64_t output,
         std::optional<uint64_t> stream) {
        const RoutemmQ4MatmulCall call{type,
                                       index,
                                       m_,
                                       n,
                                       k,
                                       x,
                                       x_nbytes,
                                       weight,
                                       weight_nbytes,
                                       output,
                                       stream ? 1u : 0u,
                                       stream.value_or(0)};
        enqueue_q4_matmul(call);
      },
      py::arg("device_type"), py::arg("device_index"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("input"), py::arg("input_nbytes"), py::arg("weight"), py::arg("weight_nbytes"),
      py::arg("output"), py::arg("stream"),
      "One dense Q4_0 product on caller memory, encoded and started (the environment's policy).");
}

}  // namespace routemm::python
