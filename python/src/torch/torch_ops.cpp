// routemm._torch_ops: the C++ kernels of torch.ops.routemm.matmul_id, q4_matmul,
// quantized_matmul_id, moe_experts and moe_gate for the CPU and CUDA dispatch keys. routemm.torch defines the ops (schemas, fake kernels) and
// imports this module when it was built against the running torch; the kernels then run without
// entering Python.
//
// The core is reached only through the C ABI table routemm._core exports (tensor_op_abi.h); this
// module links torch, never routemm's core, so the core keeps one copy of its state. The checks
// here are the framework's (devices, dtypes, contiguity) with the messages of the Python kernels
// (routemm/integrations/torch.py, routemm/ops/_tensor_ops.py), in the same order; shapes, routes
// and everything the op validates are checked by the core. Invalid arguments raise ValueError (as
// routemm.InvalidArgumentError is one). Temporaries come from at::empty (the framework's caching
// allocator, so a captured CUDA graph owns them) and CUDA work goes to the current stream of the
// tensors' device, found through c10's device-guard interface so that no CUDA header is needed
// and one source serves CPU and CUDA builds of torch.
//
// Gradients: the kernels compute the forward pass only. The ops' autograd kernel (autograd_kernel)
// runs them below autograd and, when grad mode is on and an input requires grad, hands the output
// to routemm::_no_gradient (defined by routemm.torch), whose grad_fn raises routemm.UnsupportedError
// at backward, as the Python kernels' autograd kernel does.
//
// Messages are built as one std::string before they reach a check (c10::str of a single string
// returns it as is) and numbers are formatted with std::to_string: this module uses no iostreams.
// An integer streamed by an ostringstream of this module crashed inside the num_put facet (SIGSEGV)
// under torch 2.11.0+cu130, while the same code ran under torch 2.13
// (tests/python/test_torch_kernels.py keeps iostreams out of this file).
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <Python.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "routemm/ggml_formats.h"
#include "tensor_op_abi.h"

namespace {

const RoutemmTensorOpAbi* g_abi = nullptr;

constexpr size_t kErrorSize = 2048;

[[noreturn]] void raise(int status, const char* message) {
  if (status == ROUTEMM_TENSOR_OP_INVALID_ARGUMENT) TORCH_CHECK_VALUE(false, message);
  if (status == ROUTEMM_TENSOR_OP_OUT_OF_MEMORY) TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  TORCH_CHECK(false, message);
}

// Runs one ABI entry; a failure raises its error.
template <class Entry, class... Args>
void call(Entry entry, Args... args) {
  std::array<char, kErrorSize> error{};
  const int status = entry(args..., error.data(), error.size());
  if (status != ROUTEMM_TENSOR_OP_OK) raise(status, error.data());
}

std::string dtype_repr(c10::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

std::string shape_repr(c10::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + (sizes.size() == 1 ? ",)" : ")");
}

// routemm::DType values (tensor_op_abi.h): F32, F16, BF16, U8, U16, U32, I32.
uint32_t routemm_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    case at::kByte: return 3;
    case at::kInt: return 6;
    default:
      TORCH_CHECK_VALUE(false, "no routemm dtype for torch dtype " + dtype_repr(t.scalar_type()));
  }
}

// (DLPack device type, index) of a CPU or CUDA tensor (the only keys these kernels serve).
std::pair<int32_t, int32_t> place(const at::Tensor& t) {
  const c10::Device d = t.device();
  if (d.is_cpu()) return {ROUTEMM_TENSOR_OP_DEVICE_CPU, 0};
  TORCH_CHECK_VALUE(d.is_cuda(), "routemm has no backend for torch device " + d.str());
  return {ROUTEMM_TENSOR_OP_DEVICE_CUDA, d.has_index() ? d.index() : 0};
}

// The current stream of a CUDA device as a raw handle; the CUDA guard implementation is the one
// torch's CUDA library registered, so no CUDA header is included here.
void set_stream(const at::Tensor& like, uint32_t& has_stream, uint64_t& stream) {
  if (!like.is_cuda()) return;
  const c10::Device device = like.device();
  const c10::Stream current = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  has_stream = 1;
  stream = reinterpret_cast<uint64_t>(current.native_handle());
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// ---- matmul_id ----------------------------------------------------------------------------------

// A call shape: device, dtypes and sizes of weights [3 dims], x [2 or 3 dims] and ids [2 dims]
// (x's rank is a field, a missing third dimension -1), and the op (plan_of's `kind`). Shapes of
// other ranks are not planned: the core refuses them.
using PlanKey = std::array<int64_t, 12>;

struct PlanKeyHash {
  template <size_t N>
  size_t operator()(const std::array<int64_t, N>& key) const {
    size_t h = 0;
    for (int64_t v : key) h = h * 1000003u ^ std::hash<int64_t>{}(v);
    return h;
  }
};

struct Plan {
  const void* handle;
  RoutemmMatmulIdPlanInfo info;
};

std::mutex g_plans_mutex;
std::unordered_map<PlanKey, Plan, PlanKeyHash>& plans() {
  // Kept for the process, as the plans they name are.
  static auto* map = new std::unordered_map<PlanKey, Plan, PlanKeyHash>;
  return *map;
}

// The ABI's call shape of either op (RoutemmMatmulIdShapes or RoutemmQuantizedMatmulIdShapes, one
// field order), after the checks both plans start with, in the Python kernels' order: one device,
// float32 activations, then `weights_code` (which checks the weights and returns their
// routemm::DType or GgmlType value).
template <class Shapes, class WeightsCode>
Shapes call_shapes(const at::Tensor& weights, const at::Tensor& x, const at::Tensor& ids,
                   WeightsCode weights_code) {
  const auto where = place(weights);
  TORCH_CHECK_VALUE(place(x) == where && place(ids) == where,
                    "matmul_id: tensors live on different devices");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat,
                    "matmul_id activations must be float32, got " + dtype_repr(x.scalar_type()));
  const uint32_t code = weights_code();
  return Shapes{where.first,
                where.second,
                code,
                static_cast<uint32_t>(weights.dim()),
                static_cast<uint32_t>(x.dim()),
                static_cast<uint32_t>(ids.dim()),
                weights.sizes().data(),
                x.sizes().data(),
                ids.sizes().data()};
}

Plan make_plan(const at::Tensor& weights, const at::Tensor& x, const at::Tensor& ids) {
  const auto shapes =
      call_shapes<RoutemmMatmulIdShapes>(weights, x, ids, [&] { return routemm_dtype(weights); });
  Plan plan{};
  call(g_abi->plan_matmul_id, &shapes, &plan.handle, &plan.info);
  return plan;
}

// The plan of a call shape, made by make(weights, x, ids) on first sight. `kind` tells the ops'
// plans apart: 0 for matmul_id, 1 + the GGML type code for quantized_matmul_id.
template <class Make>
Plan plan_of(const at::Tensor& weights, const at::Tensor& x, const at::Tensor& ids, int64_t kind,
             Make make) {
  if (weights.dim() != 3 || (x.dim() != 2 && x.dim() != 3) || ids.dim() != 2) {
    return make(weights, x, ids);  // raises: the core refuses these ranks
  }
  const auto d = x.device();
  const auto w = weights.sizes(), xs = x.sizes(), is = ids.sizes();
  const PlanKey key{
      static_cast<int64_t>(d.type()) * 65536 + d.index(),
      static_cast<int64_t>(weights.scalar_type()) * 256 + static_cast<int64_t>(x.scalar_type()),
      w[0],
      w[1],
      w[2],
      x.dim(),
      xs[0],
      xs[1],
      x.dim() == 3 ? xs[2] : -1,
      is[0],
      is[1],
      kind};
  {
    std::lock_guard lock(g_plans_mutex);
    const auto found = plans().find(key);
    if (found != plans().end()) return found->second;
  }
  const Plan plan = make(weights, x, ids);
  std::lock_guard lock(g_plans_mutex);
  return plans().emplace(key, plan).first->second;
}

// ids as int32 read as u32, every id outside [0, n_experts) staying outside it: int32 contiguous
// ids as they are (a negative one reads as 2**31 or more); any other 8- to 64-bit integer dtype
// converted to int64 and clamped to [-1, n_experts] there, so that no value wraps into range (a
// clamp in uint8 would turn -1 into 255; a uint64 id of 2**63 or more reads as a negative int64,
// which stays invalid). Bool and floating ids are refused. Computed on the ids' device.
at::Tensor ids_u32(const at::Tensor& ids, uint64_t n_experts) {
  if (ids.scalar_type() == at::kInt && ids.is_contiguous()) return ids;
  const auto type = ids.scalar_type();
  TORCH_CHECK_VALUE(c10::isIntegralType(type, /*includeBool=*/false),
                    "matmul_id ids must be integers, got " + dtype_repr(type));
  return at::clamp(ids.to(at::kLong), -1, static_cast<int64_t>(n_experts))
      .to(at::kInt)
      .contiguous();
}

// One planned expert-ID call (either op): the per-call checks, the ids, output and grouped scratch
// from at::empty, then the core's enqueue entry on the tensors' current stream.
template <class Enqueue>
at::Tensor run_planned(const Plan& plan, Enqueue enqueue, const at::Tensor& weights,
                       const at::Tensor& x, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(weights.device() == x.device() && ids.device() == x.device(),
                    "matmul_id: tensors live on different devices");
  TORCH_CHECK_VALUE(weights.is_contiguous() && x.is_contiguous(),
                    "matmul_id: weights and x must be contiguous");
  const at::Tensor ids32 = ids_u32(ids, plan.info.n_experts);
  const auto options = x.options();
  at::Tensor out =
      at::empty({static_cast<int64_t>(plan.info.rows), static_cast<int64_t>(plan.info.n)},
                options.dtype(at::kFloat));
  RoutemmMatmulIdPointers ptr{
      address(weights), address(x), address(ids32), address(out), 0, 0, 0, 0};
  at::Tensor counts, rows;
  if (plan.info.grouped) {
    counts = at::empty({static_cast<int64_t>(plan.info.n_experts)}, options.dtype(at::kInt));
    rows = at::empty({static_cast<int64_t>(plan.info.n_experts * plan.info.m)},
                     options.dtype(at::kInt));
    ptr.expert_counts = address(counts);
    ptr.routed_rows = address(rows);
  }
  set_stream(x, ptr.has_stream, ptr.stream);
  call(enqueue, plan.handle, &ptr);
  return out;
}

at::Tensor matmul_id(const at::Tensor& weights, const at::Tensor& x, const at::Tensor& ids) {
  return run_planned(plan_of(weights, x, ids, 0, make_plan), g_abi->enqueue_matmul_id, weights, x,
                     ids);
}

// ---- quantized_matmul_id ------------------------------------------------------------------------

// The block stack types the ops take: Q4_0 and Q8_0, then routemm/ggml_formats.h's kKernelFormats,
// as (name, routemm::GgmlType code) (tensor_op_abi.h).
std::vector<std::pair<std::string, uint32_t>> block_types() {
  std::vector<std::pair<std::string, uint32_t>> types = {{"q4_0", 0}, {"q8_0", 3}};
  for (const routemm::ggml_formats::KernelFormat& f : routemm::ggml_formats::kKernelFormats) {
    types.emplace_back(std::string(f.name), f.ggml_type);
  }
  return types;
}

// The code of block stack type `name`, or -1 with `names` listing the types ("'q4_0', ...").
int32_t block_type_code(const std::string& name, std::string& names) {
  for (const auto& [known, code] : block_types()) {
    if (known == name) return static_cast<int32_t>(code);
    names += (names.empty() ? "'" : ", '") + known + "'";
  }
  return -1;
}

uint32_t ggml_type_code(const std::string& name) {
  std::string names;
  const int32_t code = block_type_code(name, names);
  TORCH_CHECK_VALUE(
      code >= 0, "quantized_matmul_id ggml_type must be one of " + names + ", got '" + name + "'");
  return static_cast<uint32_t>(code);
}

Plan make_quantized_plan(const at::Tensor& weights, const at::Tensor& x, const at::Tensor& ids,
                         const std::string& ggml_type) {
  const auto shapes = call_shapes<RoutemmQuantizedMatmulIdShapes>(weights, x, ids, [&] {
    TORCH_CHECK_VALUE(weights.scalar_type() == at::kByte,
                      "matmul_id " + ggml_type + " weights must be uint8 blocks, got " +
                          dtype_repr(weights.scalar_type()));
    return ggml_type_code(ggml_type);
  });
  Plan plan{};
  call(g_abi->plan_quantized_matmul_id, &shapes, &plan.handle, &plan.info);
  return plan;
}

// The schema's `str ggml_type` binds to a string view.
at::Tensor quantized_matmul_id(const at::Tensor& weights, const at::Tensor& x,
                               const at::Tensor& ids, c10::string_view ggml_type) {
  const std::string type(ggml_type.data(), ggml_type.size());
  const int64_t kind = 1 + ggml_type_code(type);
  const auto make = [&](const at::Tensor& w, const at::Tensor& xs, const at::Tensor& is) {
    return make_quantized_plan(w, xs, is, type);
  };
  return run_planned(plan_of(weights, x, ids, kind, make), g_abi->enqueue_quantized_matmul_id,
                     weights, x, ids);
}

// ---- q4_matmul ----------------------------------------------------------------------------------

// n and k, each in [1, 2**32 - 1] with k a multiple of 32, against the weight's byte size (n rows
// of k / 32 blocks of 18 bytes), before the output is allocated (the Python kernels'
// _tensor_ops.check_q4_extents). n * (k / 32) * 18 < 2**64 once n and k are u32 values.
void check_q4_extents(int64_t n, int64_t k, uint64_t weight_nbytes) {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"n", n}, {"k", k}}) {
    TORCH_CHECK_VALUE(value >= 1 && value <= 0xFFFFFFFFll, std::string("q4_matmul ") + name +
                                                               " must be in [1, 4294967295], got " +
                                                               std::to_string(value));
  }
  TORCH_CHECK_VALUE(k % 32 == 0, "q4_matmul k must be a multiple of 32, got " + std::to_string(k));
  const uint64_t need = static_cast<uint64_t>(n) * static_cast<uint64_t>(k / 32) * 18;
  TORCH_CHECK_VALUE(weight_nbytes >= need,
                    "q4_matmul weight must hold n = " + std::to_string(n) + " rows of " +
                        std::to_string(k / 32) + " Q4_0 blocks (" + std::to_string(need) +
                        " bytes), got " + std::to_string(weight_nbytes) + " bytes");
}

// n and k arrive as plain integers: the schema's SymInt arguments bind to int64_t (a symbolic value
// is guarded to its hint by the dispatcher).
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t n, int64_t k) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, "q4_matmul x must be [m, " + std::to_string(k) +
                                                        "], got shape " + shape_repr(x.sizes()));
  TORCH_CHECK_VALUE(
      weight.scalar_type() == at::kByte,
      "q4_matmul weight must be uint8 Q4_0 blocks, got " + dtype_repr(weight.scalar_type()));
  const auto where = place(x);
  TORCH_CHECK_VALUE(place(weight) == where, "q4_matmul: tensors live on different devices");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat,
                    "q4_matmul x must be float32, got " + dtype_repr(x.scalar_type()));
  TORCH_CHECK_VALUE(x.is_contiguous(), "q4_matmul: x must be contiguous");
  TORCH_CHECK_VALUE(weight.is_contiguous(), "q4_matmul: weight must be contiguous");
  check_q4_extents(n, k, static_cast<uint64_t>(weight.nbytes()));
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  RoutemmQ4MatmulCall q{where.first,
                        where.second,
                        m,
                        n,
                        k,
                        address(x),
                        static_cast<uint64_t>(x.nbytes()),
                        address(weight),
                        static_cast<uint64_t>(weight.nbytes()),
                        address(out),
                        0,
                        0};
  set_stream(x, q.has_stream, q.stream);
  call(g_abi->enqueue_q4_matmul, &q);
  return out;
}

// ---- moe_experts --------------------------------------------------------------------------------

// A call shape of the block: device, the stacks' dtype, every input's sizes, split, type, route mode,
// then the FFN options (activation, alpha and limit bits, gate_up bias, down bias, weights first).
using MoePlanKey = std::array<int64_t, 23>;

// The block's FFN options as the op takes them (routemm/ops/moe_experts.h).
struct MoeFfnOptions {
  uint32_t activation = 0;  // 0 silu, 1 swiglu_oai
  float alpha = 1.702f, limit = 7.0f;
  bool gate_up_bias = false, down_bias = false, weights_before_ffn = false;
  bool plain() const {
    return activation == 0 && !gate_up_bias && !down_bias && !weights_before_ffn;
  }
};

int64_t float_bits(float v) {
  uint32_t bits = 0;
  std::memcpy(&bits, &v, 4);
  return bits;
}

struct MoePlan {
  const void* handle;
  RoutemmMoeExpertsPlanInfo info;
};

std::unordered_map<MoePlanKey, MoePlan, PlanKeyHash>& moe_plans() {
  static auto* map = new std::unordered_map<MoePlanKey, MoePlan, PlanKeyHash>;
  return *map;
}

// The GGML type code of an optional ggml_type argument (-1: float stacks).
int32_t moe_ggml_code(const std::optional<c10::string_view>& ggml_type) {
  if (!ggml_type) return -1;
  const std::string name(ggml_type->data(), ggml_type->size());
  std::string names;
  const int32_t code = block_type_code(name, names);
  TORCH_CHECK_VALUE(
      code >= 0, "moe_experts ggml_type must be None or one of " + names + ", got '" + name + "'");
  return code;
}

// The plan's checks in the Python kernels' order: one device, float32 hidden states and routing
// weights (after the model-dtype conversion), one dtype for the stacks, uint8 block stacks, then
// the core's shape, route and capability checks.
MoePlan make_moe_plan(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w,
                      const at::Tensor& gate_up, const at::Tensor& down,
                      const std::optional<at::Tensor>& up, int32_t ggml_code, uint32_t mode,
                      const MoeFfnOptions& o) {
  const auto where = place(x);
  bool same = place(ids) == where && place(w) == where && place(gate_up) == where &&
              place(down) == where && (!up || place(*up) == where);
  TORCH_CHECK_VALUE(same, "moe_experts: tensors live on different devices");
  const auto stack_type = gate_up.scalar_type();
  TORCH_CHECK_VALUE(down.scalar_type() == stack_type && (!up || up->scalar_type() == stack_type),
                    "moe_experts weight stacks must share one dtype");
  if (ggml_code >= 0) {
    TORCH_CHECK_VALUE(
        stack_type == at::kByte,
        "moe_experts block stacks must be uint8 blocks, got " + dtype_repr(stack_type));
  }
  const RoutemmMoeExpertsShapes shapes{where.first,
                                       where.second,
                                       routemm_dtype(gate_up),
                                       ggml_code,
                                       up ? 1u : 0u,
                                       mode,
                                       static_cast<uint32_t>(x.dim()),
                                       static_cast<uint32_t>(ids.dim()),
                                       static_cast<uint32_t>(w.dim()),
                                       static_cast<uint32_t>(gate_up.dim()),
                                       static_cast<uint32_t>(down.dim()),
                                       x.sizes().data(),
                                       ids.sizes().data(),
                                       w.sizes().data(),
                                       gate_up.sizes().data(),
                                       down.sizes().data(),
                                       o.activation,
                                       o.alpha,
                                       o.limit,
                                       o.gate_up_bias ? 1u : 0u,
                                       o.down_bias ? 1u : 0u,
                                       o.weights_before_ffn ? 1u : 0u};
  MoePlan plan{};
  call(g_abi->plan_moe_experts, &shapes, &plan.handle, &plan.info);
  return plan;
}

// The fused experts block (routemm/ops/moe_experts_fused.h) for a CUDA call it serves: hidden and
// the float stacks of one dtype, int32/int64 ids and the routing weights read as they are, the
// output made in hidden's dtype, two launches and no conversion. Returns nullopt (nothing started)
// for any call outside that shape: the planned block then takes it, with its checks and messages.
std::optional<at::Tensor> moe_experts_fused(const at::Tensor& hidden, const at::Tensor& ids,
                                            const at::Tensor& weights, const at::Tensor& gate_up,
                                            const at::Tensor& down,
                                            const std::optional<at::Tensor>& up) {
  if (!hidden.is_cuda() || hidden.dim() != 2 || ids.dim() != 2 || weights.dim() != 2 ||
      gate_up.dim() != 3 || down.dim() != 3 || (up && up->dim() != 3)) {
    return std::nullopt;
  }
  const auto type = hidden.scalar_type();
  const auto wtype = weights.scalar_type();
  const auto itype = ids.scalar_type();
  const bool float_type = type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
  const bool weights_type = wtype == at::kFloat || wtype == at::kHalf || wtype == at::kBFloat16;
  if (!float_type || !weights_type || (itype != at::kInt && itype != at::kLong) ||
      gate_up.scalar_type() != type || down.scalar_type() != type ||
      (up && up->scalar_type() != type)) {
    return std::nullopt;
  }
  const int64_t m = hidden.size(0), h = hidden.size(1), k = ids.size(1);
  const int64_t e = down.size(0), inter = down.size(2);
  const bool shapes = ids.size(0) == m && weights.sizes() == ids.sizes() && down.size(1) == h &&
                      gate_up.size(0) == e && gate_up.size(1) == (up ? inter : 2 * inter) &&
                      gate_up.size(2) == h &&
                      (!up || (up->size(0) == e && up->size(1) == inter && up->size(2) == h));
  if (!shapes || m == 0) return std::nullopt;
  const c10::Device device = hidden.device();
  for (const at::Tensor* t : {&hidden, &ids, &weights, &gate_up, &down, up ? &*up : &down}) {
    if (t->device() != device || !t->is_contiguous() || address(*t) % 16 != 0) return std::nullopt;
  }
  const auto [device_type, device_index] = place(hidden);
  RoutemmMoeExpertsFusedCall fc{};
  fc.device_type = device_type;
  fc.device_index = device_index;
  fc.dtype = routemm_dtype(hidden);
  fc.weights_dtype = routemm_dtype(weights);
  fc.id_bytes = itype == at::kLong ? 8 : 4;
  fc.split_gate_up = up ? 1 : 0;
  fc.m = m;
  fc.top_k = k;
  fc.n_experts = e;
  fc.hidden = h;
  fc.intermediate = inter;
  if (g_abi->moe_experts_fused_serves(&fc) == 0) return std::nullopt;
  at::Tensor out = at::empty({m, h}, hidden.options());
  const at::Tensor workspace = at::empty({m * k * inter * 4}, hidden.options().dtype(at::kByte));
  fc.x = address(hidden);
  fc.ids = address(ids);
  fc.weights = address(weights);
  fc.gate_up = address(gate_up);
  fc.up = up ? address(*up) : 0;
  fc.down = address(down);
  fc.out = address(out);
  fc.workspace = address(workspace);
  set_stream(hidden, fc.has_stream, fc.stream);
  call(g_abi->enqueue_moe_experts_fused, &fc);
  return out;
}

// The FFN options checked in the Python kernel's order and words (integrations/torch.py
// _check_ffn_options): the activation and its parameters, then each bias's dtype and shape against
// the stacks'. Returns the options and the biases as float32 contiguous tensors.
MoeFfnOptions check_ffn_options(c10::string_view activation, double alpha, double limit,
                                const std::optional<at::Tensor>& gate_up_bias,
                                const std::optional<at::Tensor>& up_bias,
                                const std::optional<at::Tensor>& down_bias, bool weights_before_ffn,
                                const at::Tensor& gate_up, const at::Tensor& down,
                                const std::optional<at::Tensor>& up) {
  MoeFfnOptions o;
  const std::string act(activation.data(), activation.size());
  TORCH_CHECK_VALUE(act == "silu" || act == "swiglu_oai",
                    "moe_experts activation must be 'silu' or 'swiglu_oai', got '" + act + "'");
  o.activation = act == "swiglu_oai" ? 1u : 0u;
  o.alpha = static_cast<float>(alpha);
  o.limit = static_cast<float>(limit);
  TORCH_CHECK_VALUE(std::isfinite(o.alpha),
                    "moe_experts swiglu_alpha must be finite, got " + std::to_string(alpha));
  TORCH_CHECK_VALUE(o.limit > 0.0f,
                    "moe_experts swiglu_limit must be > 0, got " + std::to_string(limit));
  const bool split = up.has_value();
  const auto expect = [](const char* name, const at::Tensor& b, std::vector<int64_t> want) {
    TORCH_CHECK_VALUE(b.is_floating_point(), std::string("moe_experts ") + name +
                                                 " must be a float tensor, got " +
                                                 dtype_repr(b.scalar_type()));
    TORCH_CHECK_VALUE(b.sizes().vec() == want, std::string("moe_experts ") + name + " must be " +
                                                   shape_repr(want) + ", got shape " +
                                                   shape_repr(b.sizes()));
  };
  if (gate_up.dim() == 3 && down.dim() == 3) {
    // E and I from the gate/up stack's rows (values also for block stacks), H from down's.
    const int64_t e = gate_up.size(0), h = down.size(1);
    const int64_t inter = split ? gate_up.size(1) : gate_up.size(1) / 2;
    if (gate_up_bias) expect("gate_up_bias", *gate_up_bias, {e, split ? inter : 2 * inter});
    if (up_bias) {
      TORCH_CHECK_VALUE(split && gate_up_bias,
                        "moe_experts up_bias goes with split stacks (up) and gate_up_bias");
      expect("up_bias", *up_bias, {e, inter});
    }
    TORCH_CHECK_VALUE(
        !split || !gate_up_bias || up_bias,
        "moe_experts split stacks take gate_up_bias (the gate's) and up_bias together");
    if (down_bias) expect("down_bias", *down_bias, {e, h});
  }
  o.gate_up_bias = gate_up_bias.has_value();
  o.down_bias = down_bias.has_value();
  o.weights_before_ffn = weights_before_ffn;
  return o;
}

// The block's workspace (uninitialised bytes). On CUDA a fresh one from the caching allocator. On the
// CPU the call returns when the result is written, so one workspace per thread serves every call:
// a fresh allocation of this size comes from the OS and is zeroed page by page on first touch,
// which cost 15% of the Qwen3-30B-A3B block at m = 512 on a 2-core Zen 4 (185 -> 157 ms per call
// kept). Workspaces above kCpuWorkspaceKeepBytes are not kept (a process should not hold more).
constexpr int64_t kCpuWorkspaceKeepBytes = int64_t{1} << 30;

at::Tensor moe_workspace(int64_t bytes, const at::TensorOptions& options) {
  const auto byte_options = options.dtype(at::kByte);
  if (!options.device().is_cpu() || bytes > kCpuWorkspaceKeepBytes) {
    return at::empty({bytes}, byte_options);
  }
  thread_local at::Tensor kept;
  if (!kept.defined() || kept.numel() < bytes) kept = at::empty({bytes}, byte_options);
  return kept;
}

// The experts block (routemm/ops/moe_experts.h) in the model's dtype: hidden and top_k_weights
// float32, float16 or bfloat16; the block runs in F32 and the result comes back in hidden's dtype.
at::Tensor moe_experts(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down,
                       const std::optional<at::Tensor>& up,
                       std::optional<c10::string_view> ggml_type, bool exact,
                       c10::string_view activation, double swiglu_alpha, double swiglu_limit,
                       const std::optional<at::Tensor>& gate_up_bias,
                       const std::optional<at::Tensor>& up_bias,
                       const std::optional<at::Tensor>& down_bias, bool weights_before_ffn,
                       bool batch_invariant) {
  // The route mode (tensor_op_abi.h): exact, else batch_invariant (one per-row accumulation
  // order at every m, never the fused route), else the default's shape rule.
  const uint32_t mode = exact ? 1u : batch_invariant ? 2u : 0u;
  const auto model_type = hidden.scalar_type();
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"hidden", &hidden},
                                {"top_k_weights", &weights}}) {
    const auto type = t->scalar_type();
    TORCH_CHECK_VALUE(type == at::kFloat || type == at::kHalf || type == at::kBFloat16,
                      std::string("moe_experts ") + name +
                          " must be float32, float16 or bfloat16, got " + dtype_repr(type));
  }
  const int32_t ggml_code = moe_ggml_code(ggml_type);
  const MoeFfnOptions ffn =
      check_ffn_options(activation, swiglu_alpha, swiglu_limit, gate_up_bias, up_bias, down_bias,
                        weights_before_ffn, gate_up, down, up);
  if (ggml_code < 0 && mode == 0 && ffn.plain()) {
    if (auto fused = moe_experts_fused(hidden, ids, weights, gate_up, down, up)) return *fused;
  }
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  MoePlan plan{};
  const bool plannable =
      x.dim() == 2 && ids.dim() == 2 && w.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3;
  if (!plannable) {
    plan = make_moe_plan(x, ids, w, gate_up, down, up, ggml_code, mode, ffn);  // raises
  } else {
    const auto d = x.device();
    const MoePlanKey key{static_cast<int64_t>(d.type()) * 65536 + d.index(),
                         static_cast<int64_t>(gate_up.scalar_type()),
                         x.size(0),
                         x.size(1),
                         ids.size(0),
                         ids.size(1),
                         w.size(0),
                         w.size(1),
                         gate_up.size(0),
                         gate_up.size(1),
                         gate_up.size(2),
                         down.size(0),
                         down.size(1),
                         down.size(2),
                         up ? 1 : 0,
                         ggml_code,
                         mode,
                         ffn.activation,
                         float_bits(ffn.alpha),
                         float_bits(ffn.limit),
                         ffn.gate_up_bias ? 1 : 0,
                         ffn.down_bias ? 1 : 0,
                         ffn.weights_before_ffn ? 1 : 0};
    std::unique_lock lock(g_plans_mutex);
    const auto found = moe_plans().find(key);
    if (found != moe_plans().end()) {
      plan = found->second;
    } else {
      lock.unlock();
      plan = make_moe_plan(x, ids, w, gate_up, down, up, ggml_code, mode, ffn);
      lock.lock();
      moe_plans().emplace(key, plan);
    }
  }
  const c10::Device device = x.device();
  TORCH_CHECK_VALUE(ids.device() == device && w.device() == device && gate_up.device() == device &&
                        down.device() == device && (!up || up->device() == device),
                    "moe_experts: tensors live on different devices");
  TORCH_CHECK_VALUE(down.scalar_type() == gate_up.scalar_type() &&
                        (!up || up->scalar_type() == gate_up.scalar_type()),
                    "moe_experts weight stacks must share one dtype");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gate_up", &gate_up},
                                {"down", &down},
                                {"up", up ? &*up : nullptr}}) {
    TORCH_CHECK_VALUE(t == nullptr || t->is_contiguous(),
                      std::string("moe_experts: ") + name + " must be contiguous");
  }
  const at::Tensor ids32 = ids_u32(ids, static_cast<uint64_t>(down.size(0)));
  const auto options = x.options();
  at::Tensor out = at::empty(
      {static_cast<int64_t>(plan.info.m), static_cast<int64_t>(plan.info.hidden)}, options);
  const at::Tensor workspace =
      moe_workspace(static_cast<int64_t>(plan.info.workspace_bytes), options);
  const auto f32 = [&](const std::optional<at::Tensor>& b) {
    TORCH_CHECK_VALUE(!b || b->device() == device,
                      "moe_experts: tensors live on different devices");
    return b ? std::optional<at::Tensor>(b->to(at::kFloat).contiguous()) : std::nullopt;
  };
  const auto gate_up_bias32 = f32(gate_up_bias), up_bias32 = f32(up_bias),
             down_bias32 = f32(down_bias);
  RoutemmMoeExpertsPointers ptr{address(x),
                                address(ids32),
                                address(w),
                                address(gate_up),
                                up ? address(*up) : 0,
                                address(down),
                                address(out),
                                address(workspace),
                                0,
                                0,
                                gate_up_bias32 ? address(*gate_up_bias32) : 0,
                                up_bias32 ? address(*up_bias32) : 0,
                                down_bias32 ? address(*down_bias32) : 0};
  set_stream(x, ptr.has_stream, ptr.stream);
  call(g_abi->enqueue_moe_experts, plan.handle, &ptr);
  return model_type == at::kFloat ? out : out.to(model_type);
}

// ---- moe_gate -----------------------------------------------------------------------------------

// Router scores and top-k selection on the tensors' current stream: (weights float32 [m, top_k],
// ids int32 [m, top_k]). The checks of the Python kernel, in its order; the core checks
// scoring_func, the group counts against the experts and the scaling factor.
std::tuple<at::Tensor, at::Tensor> moe_gate(const at::Tensor& logits, int64_t top_k,
                                            bool renormalize, c10::string_view scoring_func,
                                            const std::optional<at::Tensor>& bias,
                                            std::optional<int64_t> num_expert_group,
                                            std::optional<int64_t> topk_group,
                                            double routed_scaling_factor,
                                            const std::optional<at::Tensor>& router_bias) {
  TORCH_CHECK_VALUE(logits.dim() == 2,
                    "moe_gate router_logits must be 2-D, got shape " + shape_repr(logits.sizes()));
  const auto where = place(logits);
  TORCH_CHECK_VALUE(
      logits.scalar_type() == at::kFloat,
      "moe_gate router_logits must be float32, got " + dtype_repr(logits.scalar_type()));
  const int64_t m = logits.size(0), n_experts = logits.size(1);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= n_experts,
                    "moe_gate top_k " + std::to_string(top_k) +
                        " must be in [1, n_experts = " + std::to_string(n_experts) + "]");
  const auto repr = [](std::optional<int64_t> v) {
    return v ? std::to_string(*v) : std::string("None");
  };
  for (const auto& [name, value] :
       {std::pair{"num_expert_group", num_expert_group}, std::pair{"topk_group", topk_group}}) {
    TORCH_CHECK_VALUE(!value || *value >= 1, "moe_gate " + std::string(name) +
                                                 " must be None or a positive integer, got " +
                                                 repr(value));
  }
  TORCH_CHECK_VALUE(num_expert_group.has_value() == topk_group.has_value(),
                    "moe_gate num_expert_group and topk_group must be given together, got " +
                        repr(num_expert_group) + " and " + repr(topk_group));
  // A float32 (n_experts,) tensor on the logits' device, contiguous; undefined when absent.
  const auto expert_vector = [&](const char* name, const std::optional<at::Tensor>& v) {
    if (!v) return at::Tensor();
    const std::string what = std::string("moe_gate ") + name;
    TORCH_CHECK_VALUE(place(*v) == where, "moe_gate: " + std::string(name) +
                                              " lives on another device than router_logits");
    TORCH_CHECK_VALUE(v->scalar_type() == at::kFloat,
                      what + " must be float32, got " + dtype_repr(v->scalar_type()));
    TORCH_CHECK_VALUE(v->dim() == 1 && v->size(0) == n_experts,
                      what + " must have shape (n_experts,) = (" + std::to_string(n_experts) +
                          ",), got " + shape_repr(v->sizes()));
    return v->contiguous();
  };
  const at::Tensor b = expert_vector("e_score_correction_bias", bias);
  const at::Tensor rb = expert_vector("router_bias", router_bias);
  const at::Tensor x = logits.contiguous();
  at::Tensor weights = at::empty({m, top_k}, x.options());
  at::Tensor ids = at::empty({m, top_k}, x.options().dtype(at::kInt));
  const std::string scoring(scoring_func);
  RoutemmMoeGateCall call{where.first,
                          where.second,
                          m,
                          n_experts,
                          top_k,
                          renormalize ? 1u : 0u,
                          address(x),
                          address(weights),
                          address(ids),
                          0,
                          0,
                          scoring.c_str(),
                          bias ? address(b) : 0,
                          num_expert_group.value_or(0),
                          topk_group.value_or(0),
                          routed_scaling_factor,
                          router_bias ? address(rb) : 0};
  set_stream(x, call.has_stream, call.stream);
  ::call(g_abi->enqueue_moe_gate, &call);
  return {weights, ids};
}

// ---- autograd ------------------------------------------------------------------------------------

// The ops' autograd kernel, for every autograd key (routemm.torch's _autograd_kernel in C++): the op
// runs below autograd; when grad mode is on and an input requires grad, an op with a backward
// (routemm::_<name>_grad registered) takes the call through that op, and any other op's output goes
// through routemm::_no_gradient with the op's name and those inputs' names. A call whose inputs
// need no gradient never enters Python.
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  std::vector<at::Tensor> needs;
  std::string names;
  if (c10::GradMode::is_enabled()) {
    const auto args = torch::jit::last(*stack, arguments.size());
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].isTensor() || !args[i].toTensor().requires_grad()) continue;
      needs.push_back(args[i].toTensor());
      names += (names.empty() ? "" : ", ") + arguments[i].name();
    }
  }
  if (!needs.empty()) {
    // An op with a backward takes the call through routemm::_<name>_grad (registered by
    // routemm.torch), which records its gradients.
    const auto grad = c10::Dispatcher::singleton().findSchema(
        {"routemm::_" + op.schema().name().substr(std::string_view("routemm::").size()) + "_grad",
         ""});
    if (grad) {
      grad->callBoxed(stack);
      return;
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (needs.empty()) return;
  static const auto no_gradient = c10::Dispatcher::singleton()
                                      .findSchemaOrThrow("routemm::_no_gradient", "")
                                      .typed<at::Tensor(const at::Tensor&, at::TensorList,
                                                        c10::string_view, c10::string_view)>();
  // Every floating-point output gets the refusing grad_fn (an index output has no gradient).
  const size_t outputs = op.schema().returns().size();
  for (size_t i = stack->size() - outputs; i < stack->size(); ++i) {
    if (!(*stack)[i].isTensor()) continue;
    const at::Tensor out = (*stack)[i].toTensor();
    if (!at::isFloatingType(out.scalar_type())) continue;
    (*stack)[i] = no_gradient.call(out, needs, op.schema().name(), names);
  }
}

// ---- the module ---------------------------------------------------------------------------------

PyObject* plan_cache_size(PyObject*, PyObject*) {
  std::lock_guard lock(g_plans_mutex);
  return PyLong_FromSize_t(plans().size() + moe_plans().size());
}

PyMethodDef kMethods[] = {
    {"plan_cache_size", plan_cache_size, METH_NOARGS,
     "How many call shapes (matmul_id, quantized_matmul_id and moe_experts) the C++ kernels have "
     "planned in this process."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT,
                       "_torch_ops",
                       "The C++ kernels of torch.ops.routemm.matmul_id, q4_matmul, "
                       "quantized_matmul_id, moe_experts and moe_gate (CPU, CUDA).",
                       -1,
                       kMethods,
                       nullptr,
                       nullptr,
                       nullptr,
                       nullptr};

// Registers the kernels (CPU, CUDA, autograd) once the core's table is known to fit (so a failed import leaves no kernel
// registered). The libraries live for the process, as TORCH_LIBRARY_IMPL's static ones do.
void register_kernels() {
  for (const auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    auto* lib = new torch::Library(torch::Library::IMPL, "routemm", key, __FILE__, __LINE__);
    lib->impl("matmul_id", TORCH_FN(matmul_id));
    lib->impl("q4_matmul", TORCH_FN(q4_matmul));
    lib->impl("quantized_matmul_id", TORCH_FN(quantized_matmul_id));
    lib->impl("moe_experts", TORCH_FN(moe_experts));
    lib->impl("moe_gate", TORCH_FN(moe_gate));
  }
  auto* autograd = new torch::Library(torch::Library::IMPL, "routemm", c10::DispatchKey::Autograd,
                                      __FILE__, __LINE__);
  for (const char* name :
       {"matmul_id", "q4_matmul", "quantized_matmul_id", "moe_experts", "moe_gate"}) {
    autograd->impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  }
}

}  // namespace

PyMODINIT_FUNC PyInit__torch_ops() {
  void* table = PyCapsule_Import(ROUTEMM_TENSOR_OP_ABI_CAPSULE, 0);
  if (table == nullptr) return nullptr;
  const auto* abi = static_cast<const RoutemmTensorOpAbi*>(table);
  if (abi->version != ROUTEMM_TENSOR_OP_ABI_VERSION || abi->size < sizeof(RoutemmTensorOpAbi)) {
    PyErr_Format(PyExc_ImportError,
                 "routemm._torch_ops needs the tensor-op ABI version %d, routemm._core has %u",
                 ROUTEMM_TENSOR_OP_ABI_VERSION, abi->version);
    return nullptr;
  }
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  if (PyModule_AddStringConstant(module, "TORCH_VERSION", ROUTEMM_BUILT_TORCH_VERSION) < 0 ||
      PyModule_AddObject(module, "OPS",
                         Py_BuildValue("(sssss)", "matmul_id", "q4_matmul", "quantized_matmul_id",
                                       "moe_experts", "moe_gate")) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  if (g_abi == nullptr) {
    g_abi = abi;
    try {
      register_kernels();
    } catch (const std::exception& e) {
      PyErr_Format(PyExc_ImportError, "routemm._torch_ops could not register its kernels: %s",
                   e.what());
      Py_DECREF(module);
      return nullptr;
    }
  }
  return module;
}
