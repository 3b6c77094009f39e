"""The op front doors on PyTorch / CuPy tensors, in place, on the framework's current stream.

Shared by `routemm.matmul_id` (tensors in, tensor out) and the `torch.ops.routemm.*` custom ops
(routemm.torch). The call path is what an engine's decode loop needs: tensors are wrapped by
pointer (no DLPack stream handshake), temporaries and grouped scratch come from the framework's
allocator (so a CUDA graph captured around the call owns them), work is enqueued on the
framework's current stream with no stream created and no host wait, and the route depends on the
shapes only (device data is never read on the host). CPU tensors run on the CPU backend and the
call returns when the result is written, as framework CPU ops do.
"""

from __future__ import annotations

import functools
from typing import Optional

from .. import _core
from ..core._core_api import DType
from ..core._errors import InvalidArgumentError, UnsupportedError
from .dense_matmul_id import _pick_route, _receipt_of

_DL_CPU, _DL_CUDA = 1, 2
_U32_MAX = 2**32 - 1


def _target(device_type: int, index: int) -> tuple[_core.Device, _core.KernelRegistry]:
    """The device and kernel registry of a DLPack device: one pair per process, kept by the core
    and shared with the torch ops' C++ kernels (routemm._torch_ops)."""
    return _core._tensor_op_target(device_type, index)


class Framework:
    """What the call path needs from one tensor framework."""

    name = ""
    f32 = u8 = None  # the framework's float32 and uint8 dtypes
    tensor_type: type = object  # the framework's tensor class

    def __init__(self):
        # matmul_id's per-shape plans of this framework's calls (see _MatmulIdPlan).
        self.matmul_id_plans: dict = {}

    def dtype(self, t) -> DType:
        raise NotImplementedError

    def place(self, t, name: str = "") -> tuple[int, int]:
        """(DLPack device type, device index) of `t`; a device routemm has no backend for is
        refused, naming the argument `name` when given."""
        raise NotImplementedError

    def stream(self, t) -> int:
        """The current stream handle of `t`'s CUDA device."""
        raise NotImplementedError

    def device_key(self, t):
        """A cheap hashable name of `t`'s device (the per-call device check compares these)."""
        raise NotImplementedError

    def stream_of_key(self, key) -> Optional[int]:
        """The current stream handle of the device `key` names, or None for a host device."""
        raise NotImplementedError

    def empty(self, shape, dtype_name: str, like):
        raise NotImplementedError

    def nbytes(self, t) -> int:
        raise NotImplementedError

    def pointer(self, t) -> int:
        raise NotImplementedError

    def contiguous(self, t) -> bool:
        raise NotImplementedError

    def ids_u32(self, ids, n_experts: int, what: str = "matmul_id ids"):
        """`ids` as int32 bit patterns read as u32, every id outside [0, n_experts) staying outside
        it (a zero row): contiguous int32 ids as they are (a negative one reads as a u32 of 2**31
        or more, and n_experts < 2**31); any other integer dtype converted to int64 and clamped
        to [-1, n_experts] there, so that no value wraps into range (a clamp in the ids' own
        dtype would turn uint8's -1 into 255; a uint64 id of 2**63 or more reads as a negative
        int64, which stays invalid). Bool and floating ids are refused, naming `what`. Computed
        on the ids' device; nothing is read on the host."""
        raise NotImplementedError

    def forward_only(self, op: str, out, named):
        """`out`, the result of `op`, which has no gradient (routemm's kernels compute the forward
        pass only). `named`: the call's (argument name, value) pairs. Where the framework records
        gradients, grad mode is on and an argument requires grad, `out` gets a grad_fn whose
        backward raises UnsupportedError naming `op` and those arguments, so that no output claims
        a gradient it never delivers while a forward with such inputs still runs."""
        return out


@functools.lru_cache(maxsize=None)
def _define_refuse_backward():
    """Defines routemm::_refuse_backward (once per process; returns its library), the backward of
    the node that _Torch.forward_only puts under an output: it raises
    routemm.UnsupportedError(message) when it runs. An op rather than a raise in the node, so that
    torch.compile, which traces the backward while compiling a forward whose inputs require grad,
    compiles it (inference with parameters that require grad runs) and the refusal comes when the
    backward runs; taking `grad` keeps it in the backward graph. A fragment of the routemm
    namespace, whose library (routemm.torch) defines the public ops."""
    import torch

    def refuse(grad, inputs, message):
        raise UnsupportedError(message)

    def fake(grad, inputs, message):
        return [torch.empty_like(t) for t in inputs]

    library = torch.library.Library("routemm", "FRAGMENT")
    library.define("_refuse_backward(Tensor grad, Tensor[] inputs, str message) -> Tensor[]")
    library.impl("_refuse_backward", refuse, "CompositeExplicitAutograd")
    torch.library.register_fake("routemm::_refuse_backward", fake, lib=library)
    return library


class _Torch(Framework):
    name = "torch"

    def __init__(self):
        import torch

        super().__init__()
        self.torch = torch
        self._cuda_index: dict = {}  # torch.device -> CUDA device index, or -1 for a host device
        self.dtypes = {
            torch.float32: DType.F32,
            torch.float16: DType.F16,
            torch.bfloat16: DType.BF16,
            torch.uint8: DType.U8,
            torch.int32: DType.I32,
        }
        self.by_name = {"f32": torch.float32, "i32": torch.int32, "u8": torch.uint8}
        self.f32, self.u8 = torch.float32, torch.uint8
        self.tensor_type = torch.Tensor
        # The dtypes of expert ids (ids_u32): every 8- to 64-bit integer.
        self.id_dtypes = frozenset(
            (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64)
        )

        self._refusal = _define_refuse_backward()

        class RoutemmForwardOnly(torch.autograd.Function):
            """The node forward_only puts under an output: its backward is routemm::_refuse_backward,
            which raises UnsupportedError(message) when it runs."""

            @staticmethod
            def forward(ctx, message, result, *inputs):
                ctx.message = message
                ctx.save_for_backward(*inputs)
                return result()

            @staticmethod
            def backward(ctx, grad):
                return None, None, *torch.ops.routemm._refuse_backward(grad, list(ctx.saved_tensors), ctx.message)

        self._forward_only = RoutemmForwardOnly

    def dtype(self, t):
        try:
            return self.dtypes[t.dtype]
        except KeyError:
            raise InvalidArgumentError(f"no routemm dtype for torch dtype {t.dtype}") from None

    def place(self, t, name=""):
        if t.device.type == "cpu":
            return _DL_CPU, 0
        if t.device.type == "cuda":
            return _DL_CUDA, t.device.index or 0
        raise InvalidArgumentError(f"{name}{': ' if name else ''}routemm has no backend for torch device {t.device}")

    def stream(self, t):
        return self.torch.cuda.current_stream(t.device).cuda_stream

    def device_key(self, t):
        return t.device

    def stream_of_key(self, key):
        # torch.device.type builds a new string per read (about 0.6 us), so the answer is kept
        # per device.
        index = self._cuda_index.get(key)
        if index is None:
            index = self._cuda_index.setdefault(key, (key.index or 0) if key.type == "cuda" else -1)
        # The raw handle without building a torch.cuda.Stream object (several microseconds).
        return None if index < 0 else self._raw_stream(index)

    def _raw_stream(self, index: int) -> int:
        raw = getattr(self.torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            return self.torch.cuda.current_stream(index).cuda_stream
        return raw(index)

    def empty(self, shape, dtype_name, like):
        dtype = self.by_name[dtype_name]
        if like.dtype is dtype:
            return like.new_empty(shape)  # half the host cost of torch.empty(..., device=)
        return self.torch.empty(shape, dtype=dtype, device=like.device)

    def nbytes(self, t):
        return t.numel() * t.element_size()

    def pointer(self, t):
        return t.data_ptr()

    def contiguous(self, t):
        return t.is_contiguous()

    def ids_u32(self, ids, n_experts, what="matmul_id ids"):
        torch = self.torch
        if ids.dtype is torch.int32 and ids.is_contiguous():
            return ids  # negative ids read as u32 are >= 2**31 > n_experts: already invalid
        if ids.dtype not in self.id_dtypes:
            raise InvalidArgumentError(f"{what} must be integers, got {ids.dtype}")
        return torch.clamp(ids.to(torch.int64), -1, n_experts).to(torch.int32).contiguous()

    def forward_only(self, op, out, named):
        torch = self.torch
        if not torch.is_grad_enabled():
            return out
        needs = [(name, t) for name, t in named if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs:
            return out
        message = (
            f"{op} has no gradient: routemm computes the forward pass only, so backward cannot reach "
            f"{', '.join(name for name, _ in needs)}; train with another implementation, or run the "
            "forward under torch.no_grad() or torch.inference_mode()"
        )
        # `out` is handed over by a closure, not as an argument, so that it becomes the node's
        # output itself (an argument would come back as a view of it).
        return self._forward_only.apply(message, lambda: out, *(t for _, t in needs))


class _CuPy(Framework):
    name = "cupy"

    def __init__(self):
        import cupy
        import numpy as np

        super().__init__()
        self.cupy = cupy
        self.np = np
        self.f32, self.u8 = np.dtype(np.float32), np.dtype(np.uint8)
        self.tensor_type = cupy.ndarray

    def dtype(self, t):
        from ..core._core_api import dtype_of

        return dtype_of(t.dtype)

    def place(self, t, name=""):
        return _DL_CUDA, int(t.device.id)

    def stream(self, t):
        return self.cupy.cuda.get_current_stream().ptr

    def device_key(self, t):
        return int(t.device.id)

    def stream_of_key(self, key):
        with self.cupy.cuda.Device(key):
            return self.cupy.cuda.get_current_stream().ptr

    def empty(self, shape, dtype_name, like):
        dtypes = {"f32": self.np.float32, "i32": self.np.int32, "u8": self.np.uint8}
        return self.cupy.empty(shape, dtype=dtypes[dtype_name])

    def nbytes(self, t):
        return int(t.nbytes)

    def pointer(self, t):
        return int(t.data.ptr)

    def contiguous(self, t):
        return bool(t.flags.c_contiguous)

    def ids_u32(self, ids, n_experts, what="matmul_id ids"):
        cupy = self.cupy
        if not self.np.issubdtype(ids.dtype, self.np.integer):
            raise InvalidArgumentError(f"{what} must be integers, got {ids.dtype}")
        if ids.dtype == self.np.int32 and ids.flags.c_contiguous:
            return ids
        return cupy.ascontiguousarray(cupy.clip(ids.astype(cupy.int64), -1, n_experts).astype(cupy.int32))


@functools.lru_cache(maxsize=None)
def framework(name: str) -> Framework:
    return _Torch() if name == "torch" else _CuPy()


def _places(fw: Framework, weights, x, ids) -> set:
    """The (device type, index) pairs of a call's tensors, after checking that each one is a tensor
    of the framework (x's): arrays of another framework mixed in are refused by name."""
    for name, t in (("weights", weights), ("x", x), ("ids", ids)):
        if not isinstance(t, fw.tensor_type):
            raise InvalidArgumentError(
                f"matmul_id: x is a {fw.name} tensor, so {name} must be one too, got {type(t).__module__}."
                f"{type(t).__name__}"
            )
    return {fw.place(t) for t in (weights, x, ids)}


def one_place(fw: Framework, op: str, named) -> tuple[int, int]:
    """The (DLPack device type, index) of a call's tensors, `named` as (argument name, value)
    pairs with the call's lead tensor first: each must be a tensor of the lead's framework, on a
    device routemm has a backend for (not meta, say), and all on the lead's device. A refusal
    names the argument; nothing is read or allocated."""
    lead_name = named[0][0]
    lead = None
    for name, t in named:
        if not isinstance(t, fw.tensor_type):
            raise InvalidArgumentError(
                f"{op}: {lead_name} is a {fw.name} tensor, so {name} must be one too, got "
                f"{type(t).__module__}.{type(t).__name__}"
            )
        place = fw.place(t, f"{op} {name}")
        if lead is None:
            lead = place
        elif place != lead:
            raise InvalidArgumentError(f"{op}: {name} lives on another device than {lead_name}")
    return lead


def _plan(fw: Framework, weights, x, ids, route):
    """matmul_id's plan of one call shape (the core's _TensorMatmulIdPlan): validated shapes, the
    frozen params, the route and the device's shared registry. Checks in this order: one framework,
    one device, float32 activations, the weight dtype, then the core's shape and route checks."""
    places = _places(fw, weights, x, ids)
    if len(places) != 1:
        raise InvalidArgumentError("matmul_id: tensors live on different devices")
    if x.dtype != fw.f32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    wdtype = fw.dtype(weights)
    if route is not None:
        route = _pick_route(route, True, 0).value
    shape = [int(d) for d in weights.shape], [int(d) for d in x.shape], [int(d) for d in ids.shape]
    return _core._plan_tensor_matmul_id(*places.pop(), wdtype, *shape, route)


def _enqueue_planned(fw: Framework, enqueue, plan, device_key, weights, x, ids, out):
    """The per-call half of both expert-ID ops once the shape's plan is known: the checks that
    cannot be cached (one device, contiguity), the ids as u32, the output and grouped scratch from
    the framework's allocator, then `enqueue` (the core's entry for the plan's op) on the current
    stream. Returns (out, the native receipt tuple)."""
    try:
        same_device = fw.device_key(weights) == device_key and fw.device_key(ids) == device_key
    except AttributeError:  # not a tensor at all
        same_device = False
    if not same_device:
        _places(fw, weights, x, ids)  # names an argument of another framework
        raise InvalidArgumentError("matmul_id: tensors live on different devices")
    if not (fw.contiguous(weights) and fw.contiguous(x)):
        raise InvalidArgumentError("matmul_id: weights and x must be contiguous")
    ids32 = fw.ids_u32(ids, plan.n_experts)
    out = _checked_out(fw, out, plan, device_key, x)
    counts = rows = None
    if plan.grouped:
        counts = fw.empty((plan.n_experts,), "i32", x)
        rows = fw.empty((plan.n_experts * plan.m,), "i32", x)
    native = enqueue(
        plan,
        fw.pointer(weights),
        fw.pointer(x),
        fw.pointer(ids32),
        fw.pointer(out),
        0 if counts is None else fw.pointer(counts),
        0 if rows is None else fw.pointer(rows),
        fw.stream_of_key(device_key),
    )
    return out, native


def _checked_out(fw: Framework, out, plan, device_key, x):
    """A new [rows, n] float32 output, or the caller's `out` once checked against the plan."""
    if out is None:
        return fw.empty((plan.rows, plan.n), "f32", x)
    if (
        not isinstance(out, fw.tensor_type)
        or tuple(out.shape) != (plan.rows, plan.n)
        or fw.dtype(out) != DType.F32
        or not fw.contiguous(out)
        or fw.device_key(out) != device_key
    ):
        raise InvalidArgumentError(
            f"matmul_id out must be a contiguous float32 tensor of shape {(plan.rows, plan.n)} on the inputs' device"
        )
    return out


def matmul_id(
    fw: Framework, weights, x, ids, route=None, out=None, *, with_receipt: bool = False, op_kernel: bool = False
):
    """The expert-ID product on framework tensors (see routemm.matmul_id); returns `out` or a new
    [m * top_k, n] float32 tensor (with `with_receipt`, the pair of it and the dispatch receipt).
    The result refuses gradients (fw.forward_only), except as a torch op's kernel (`op_kernel`),
    which runs below autograd, where the op's autograd kernel does the same.

    route None picks by shape only: grouped_prefill from AUTO_GROUPED_MIN_TOKENS tokens on when
    top_k <= n_experts, else direct. The grouped kernels route repeated ids correctly (each slot
    is computed, bit-identical to direct), so the call declares DISTINCT_PER_TOKEN for them as the
    capacity bound it is (top_k <= n_experts) without reading the ids.

    The hot path: one dictionary lookup for the shape's plan, the per-call checks that cannot be
    cached (contiguity, one device), the output and scratch from the framework's allocator, and one
    call into the extension that wraps, encodes and starts the work (_core._enqueue_dense_matmul_id).
    """
    # Shapes as the framework gives them (torch.Size is a tuple), so building the key copies nothing.
    device_key = fw.device_key(x)
    key = (device_key, weights.shape, weights.dtype, x.shape, x.dtype, ids.shape, route)
    plans = fw.matmul_id_plans
    plan = plans.get(key)
    if plan is None:
        plan = plans.setdefault(key, _plan(fw, weights, x, ids, route))
    out, native = _enqueue_planned(fw, _core._enqueue_dense_matmul_id, plan, device_key, weights, x, ids, out)
    if not op_kernel:
        out = fw.forward_only("routemm.matmul_id", out, (("weights", weights), ("x", x)))
    if with_receipt:
        return out, _receipt_of(native)
    return out


def _quantized_plan(fw: Framework, weights, x, ids, ggml_type: str, route):
    """quantized_matmul_id's plan of one call shape (the core's _TensorQuantizedMatmulIdPlan).
    Checks in this order: one framework, one device, float32 activations, uint8 blocks, then the
    core's shape, route and capability checks."""
    places = _places(fw, weights, x, ids)
    if len(places) != 1:
        raise InvalidArgumentError("matmul_id: tensors live on different devices")
    if x.dtype != fw.f32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    if weights.dtype != fw.u8:
        raise InvalidArgumentError(f"matmul_id {ggml_type} weights must be uint8 blocks, got {weights.dtype}")
    shape = [int(d) for d in weights.shape], [int(d) for d in x.shape], [int(d) for d in ids.shape]
    return _core._plan_tensor_quantized_matmul_id(*places.pop(), ggml_type, *shape, route)


def quantized_matmul_id(
    fw: Framework, weights, x, ids, ggml_type: str, route=None, out=None, *, with_receipt=False, op_kernel=False
):
    """The expert-ID product over a GGML block stack (uint8 [n_experts, n, k / 32 * block_bytes],
    the raw bytes of a GGUF `_exps` tensor) on framework tensors, with matmul_id's call path: one
    plan per call shape, output and scratch from the framework's allocator, one call into the
    extension on the current stream, no host sync. `ggml_type` and `route` are value strings
    (route None: the exact grouped route where the shape-only rule takes it, else direct); ids
    are never read on the host, and repeated ids are computed by every route. Returns `out` or a
    new [m * top_k, n] float32 tensor (with `with_receipt`, the pair of it and the native receipt
    tuple). Gradients as for matmul_id."""
    device_key = fw.device_key(x)
    key = (device_key, weights.shape, weights.dtype, x.shape, x.dtype, ids.shape, ggml_type, route)
    plans = fw.matmul_id_plans
    plan = plans.get(key)
    if plan is None:
        plan = plans.setdefault(key, _quantized_plan(fw, weights, x, ids, ggml_type, route))
    out, native = _enqueue_planned(fw, _core._enqueue_quantized_matmul_id, plan, device_key, weights, x, ids, out)
    if not op_kernel:
        out = fw.forward_only("routemm.matmul_id", out, (("weights", weights), ("x", x)))
    return (out, native) if with_receipt else out


def check_q4_extents(n: int, k: int, weight_nbytes: int) -> None:
    """q4_matmul's n and k, each in [1, 2**32 - 1] with k a multiple of 32, against the weight's
    byte size (n rows of k / 32 blocks of 18 bytes), before anything is allocated: an output of
    [m, n] is never made for an n the weight cannot hold."""
    for name, value in (("n", n), ("k", k)):
        if not 1 <= value <= _U32_MAX:
            raise InvalidArgumentError(f"q4_matmul {name} must be in [1, {_U32_MAX}], got {value}")
    if k % 32:
        raise InvalidArgumentError(f"q4_matmul k must be a multiple of 32, got {k}")
    need = n * (k // 32) * 18
    if weight_nbytes < need:
        raise InvalidArgumentError(
            f"q4_matmul weight must hold n = {n} rows of {k // 32} Q4_0 blocks ({need} bytes), got {weight_nbytes} bytes"
        )


def q4_matmul(fw: Framework, x, weight, n: int, k: int, out=None):
    """out[m, n] = x[m, k] @ dequantize(weight).T for raw GGUF Q4_0 blocks `weight` (uint8, n rows
    of k / 32 blocks of 18 bytes), routed by the GgmlRoutingPolicy the environment gives (read once);
    returns `out` or a new float32 tensor. One call into the extension wraps, encodes and starts
    the work (_core._enqueue_q4_matmul), as for matmul_id."""
    if len(x.shape) != 2:
        raise InvalidArgumentError(f"q4_matmul x must be [m, k], got shape {tuple(x.shape)}")
    m = int(x.shape[0])
    if int(x.shape[1]) != k:
        raise InvalidArgumentError(f"q4_matmul x must be [m, {k}], got shape {tuple(x.shape)}")
    places = {fw.place(t) for t in (x, weight) + (() if out is None else (out,))}
    if len(places) != 1:
        raise InvalidArgumentError("q4_matmul: tensors live on different devices")
    if x.dtype != fw.f32:
        raise InvalidArgumentError(f"q4_matmul x must be float32, got {x.dtype}")
    if weight.dtype != fw.u8:
        raise InvalidArgumentError(f"q4_matmul weight must be uint8 Q4_0 blocks, got {weight.dtype}")
    for name, t in (("x", x), ("weight", weight)):
        if not fw.contiguous(t):
            raise InvalidArgumentError(f"q4_matmul: {name} must be contiguous")
    check_q4_extents(n, k, fw.nbytes(weight))
    if out is None:
        out = fw.empty((m, n), "f32", x)
    elif tuple(out.shape) != (m, n) or fw.dtype(out) != DType.F32:
        raise InvalidArgumentError(f"q4_matmul out must be float32 of shape {(m, n)}")
    elif not fw.contiguous(out):
        raise InvalidArgumentError("q4_matmul: out must be contiguous")
    place = places.pop()
    _core._enqueue_q4_matmul(
        *place,
        m,
        n,
        k,
        fw.pointer(x),
        fw.nbytes(x),
        fw.pointer(weight),
        fw.nbytes(weight),
        fw.pointer(out),
        fw.stream_of_key(fw.device_key(x)),
    )
    return out


def moe_gate(
    fw: Framework,
    logits,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    bias=None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    router_bias=None,
):
    """Router scores and top-k selection on framework tensors (see routemm.moe_gate): (weights
    float32 [m, top_k], ids int32 [m, top_k]), on the logits' device and current stream, one call
    into the extension, no host wait. The checks and messages of the C++ kernel, in its order: a
    2-D tensor on a device routemm has, float32, top_k in [1, n_experts], the group counts None or
    positive and given together, each bias (e_score_correction_bias, then router_bias) a float32
    (n_experts,) tensor on the logits' device; then the core's checks of the routing options,
    before anything is allocated."""
    from .moe import _check_routing

    if len(logits.shape) != 2:
        raise InvalidArgumentError(f"moe_gate router_logits must be 2-D, got shape {tuple(logits.shape)}")
    place = one_place(fw, "moe_gate", [("router_logits", logits)])
    if logits.dtype != fw.f32:
        raise InvalidArgumentError(f"moe_gate router_logits must be float32, got {logits.dtype}")
    m, n_experts = (int(d) for d in logits.shape)
    if not 1 <= top_k <= n_experts:
        raise InvalidArgumentError(f"moe_gate top_k {top_k} must be in [1, n_experts = {n_experts}]")
    routing = _check_routing(scoring_func, num_expert_group, topk_group, routed_scaling_factor)

    def expert_vector(name, v):
        if v is None:
            return None
        one_place(fw, "moe_gate", [("router_logits", logits), (name, v)])
        if v.dtype != fw.f32:
            raise InvalidArgumentError(f"moe_gate {name} must be float32, got {v.dtype}")
        if tuple(v.shape) != (n_experts,):
            raise InvalidArgumentError(
                f"moe_gate {name} must have shape (n_experts,) = ({n_experts},), got {tuple(v.shape)}"
            )
        return v if fw.contiguous(v) else v.contiguous()

    bias = expert_vector("e_score_correction_bias", bias)
    router_bias = expert_vector("router_bias", router_bias)
    _core._check_moe_gate_params(m, n_experts, top_k, bool(renormalize), *routing.core_args())
    x = logits if fw.contiguous(logits) else logits.contiguous()
    weights = fw.empty((m, top_k), "f32", x)
    ids = fw.empty((m, top_k), "i32", x)
    _core._enqueue_moe_gate(
        *place, m, n_experts, top_k, bool(renormalize), fw.pointer(x), fw.pointer(weights), fw.pointer(ids),
        fw.stream_of_key(fw.device_key(x)), routing.scoring_func, 0 if bias is None else fw.pointer(bias),
        routing.num_expert_group, routing.topk_group, routing.routed_scaling_factor,
        0 if router_bias is None else fw.pointer(router_bias),
    )  # fmt: skip
    return weights, ids


def _route_mode(exact, batch_invariant) -> int:
    """The core's route mode (tensor_op_abi.h): 1 the exact routes, 2 batch-invariant, 0 the default."""
    return 1 if exact else 2 if batch_invariant else 0


def _moe_experts_plan(
    fw: Framework, hidden, ids, weights, gate_up, down, up, ggml_type, exact, ffn=None, batch_invariant=False
):
    """moe_experts' plan of one call shape (the core's _TensorMoeExpertsPlan): one framework, one
    device, float32 hidden states and routing weights, the stacks' dtype, then the core's shape,
    route and capability checks."""
    tensors = {"hidden": hidden, "top_k_index": ids, "top_k_weights": weights, "gate_up": gate_up, "down": down}
    if up is not None:
        tensors["up"] = up
    for name, t in tensors.items():
        if not isinstance(t, fw.tensor_type):
            raise InvalidArgumentError(
                f"moe_experts: hidden is a {fw.name} tensor, so {name} must be one too, got "
                f"{type(t).__module__}.{type(t).__name__}"
            )
    if len({fw.place(t) for t in tensors.values()}) != 1:
        raise InvalidArgumentError("moe_experts: tensors live on different devices")
    for name in ("hidden", "top_k_weights"):
        if tensors[name].dtype != fw.f32:
            raise InvalidArgumentError(f"moe_experts {name} must be float32 here, got {tensors[name].dtype}")
    stacks = [t for name, t in tensors.items() if name in ("gate_up", "up", "down")]
    if len({t.dtype for t in stacks}) != 1:
        raise InvalidArgumentError("moe_experts weight stacks must share one dtype")
    if ggml_type is not None and gate_up.dtype != fw.u8:
        raise InvalidArgumentError(f"moe_experts block stacks must be uint8 blocks, got {gate_up.dtype}")
    wdtype = fw.dtype(gate_up)
    shapes = [[int(d) for d in t.shape] for t in (hidden, ids, weights, gate_up, down)]
    (place,) = {fw.place(hidden)}
    return _core._plan_tensor_moe_experts(
        *place, wdtype, ggml_type, up is not None, _route_mode(exact, batch_invariant), *shapes, **(ffn or {})
    )


def moe_experts(
    fw: Framework,
    hidden,
    ids,
    weights,
    gate_up,
    down,
    up=None,
    ggml_type=None,
    exact=False,
    out=None,
    ffn=None,
    biases=(None, None, None),
    batch_invariant=False,
):
    """The MoE experts block on framework tensors (see routemm/ops/moe_experts.h): hidden float32
    [m, H], ids integers [m, top_k], weights float32 [m, top_k], gate_up [E, 2I, H] (or the gate
    stack, with `up` the up stack), down [E, H, I]; float stacks, or uint8 GGML block stacks of
    `ggml_type` (a value string). One plan per call shape (route: the block's shape-only rule, the
    exact routes with `exact`), the output and one workspace from the framework's allocator, one
    call into the extension on the current stream, no host sync. Returns `out` or a new float32
    [m, H] tensor. `ffn`: the plan's FFN options (the core binding's activation, swiglu_alpha,
    swiglu_limit, gate_up_bias, down_bias and weights_before_ffn keywords, the biases as flags);
    `biases`: the float32 contiguous gate_up (or gate), up and down biases the options name, or
    None."""
    device_key = fw.device_key(hidden)
    ffn = dict(ffn or {})
    key = (
        "moe_experts", device_key, hidden.shape, ids.shape, weights.shape, gate_up.shape, gate_up.dtype,
        down.shape, None if up is None else up.shape, ggml_type, _route_mode(exact, batch_invariant),
        tuple(sorted(ffn.items())),
    )  # fmt: skip
    plans = fw.matmul_id_plans
    plan = plans.get(key)
    if plan is None:
        plan = plans.setdefault(
            key, _moe_experts_plan(fw, hidden, ids, weights, gate_up, down, up, ggml_type, exact, ffn, batch_invariant)
        )
    tensors = (hidden, ids, weights, gate_up, down) + (() if up is None else (up,))
    try:
        same_device = all(fw.device_key(t) == device_key for t in tensors)
    except AttributeError:
        same_device = False
    if not same_device or down.dtype != gate_up.dtype or (up is not None and up.dtype != gate_up.dtype):
        _moe_experts_plan(
            fw, hidden, ids, weights, gate_up, down, up, ggml_type, exact, ffn, batch_invariant
        )  # names it
        raise InvalidArgumentError("moe_experts: tensors live on different devices")
    if any(b is not None and fw.device_key(b) != device_key for b in biases):
        raise InvalidArgumentError("moe_experts: tensors live on different devices")
    for name, t in (("hidden", hidden), ("top_k_weights", weights), ("gate_up", gate_up), ("down", down), ("up", up)):
        if t is not None and not fw.contiguous(t):
            raise InvalidArgumentError(f"moe_experts: {name} must be contiguous")
    ids32 = fw.ids_u32(ids, int(down.shape[0]))
    if out is None:
        out = fw.empty((plan.m, plan.hidden), "f32", hidden)
    elif (
        not isinstance(out, fw.tensor_type)
        or tuple(out.shape) != (plan.m, plan.hidden)
        or fw.dtype(out) != DType.F32
        or not fw.contiguous(out)
        or fw.device_key(out) != device_key
    ):
        raise InvalidArgumentError(
            f"moe_experts out must be a contiguous float32 tensor of shape {(plan.m, plan.hidden)} on the inputs' device"
        )
    workspace = fw.empty((plan.workspace_bytes,), "u8", hidden)
    _core._enqueue_moe_experts(
        plan, fw.pointer(hidden), fw.pointer(ids32), fw.pointer(weights), fw.pointer(gate_up),
        0 if up is None else fw.pointer(up), fw.pointer(down), fw.pointer(out), fw.pointer(workspace),
        fw.stream_of_key(device_key), *(0 if b is None else fw.pointer(b) for b in biases),
    )  # fmt: skip
    return out


def moe_combine(fw: Framework, rows, weights, ids, n_experts: int):
    """out[t] = the ordered sum over slots s = 0 .. top_k - 1 of weights[t, s] * rows[t * top_k + s]
    (routemm::moe_combine, the moe_experts block's last step, so the same bits): rows float32
    [m * top_k, H], weights float32 [m, top_k], ids integers [m, top_k] whose slots outside
    [0, n_experts) contribute nothing. Returns a new float32 [m, H] tensor. The extension has no
    pointer entry for the combine, so the tensors go through DLPack buffers and an encoder of
    routemm's own, and the call waits on the host until the result is written."""
    from ..core._interop import from_dlpack

    op = "moe_combine"
    place = one_place(fw, op, [("rows", rows), ("weights", weights), ("ids", ids)])
    if len(rows.shape) != 2 or len(weights.shape) != 2 or tuple(ids.shape) != tuple(weights.shape):
        raise InvalidArgumentError(
            f"{op}: rows must be [m * top_k, H] and weights, ids [m, top_k], got shapes {tuple(rows.shape)}, "
            f"{tuple(weights.shape)}, {tuple(ids.shape)}"
        )
    m, top_k = (int(d) for d in weights.shape)
    hidden = int(rows.shape[1])
    if int(rows.shape[0]) != m * top_k:
        raise InvalidArgumentError(f"{op}: rows has {int(rows.shape[0])} rows, weights says m * top_k = {m * top_k}")
    for name, t in (("rows", rows), ("weights", weights)):
        if t.dtype != fw.f32:
            raise InvalidArgumentError(f"{op} {name} must be float32, got {t.dtype}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or not 1 <= n_experts <= _U32_MAX:
        raise InvalidArgumentError(f"{op} n_experts must be an int in [1, 2**32 - 1], got {n_experts!r}")
    if m == 0 or top_k == 0 or hidden == 0:
        return fw.empty((m, hidden), "f32", rows)
    for name, value in (("m", m), ("top_k", top_k), ("hidden", hidden)):
        if value > _U32_MAX:
            raise InvalidArgumentError(f"{op} {name} {value} exceeds 2**32 - 1")
    keep = [t if fw.contiguous(t) else t.contiguous() for t in (rows, weights, fw.ids_u32(ids, n_experts, f"{op} ids"))]
    out = fw.empty((m, hidden), "f32", rows)
    device, registry = _target(*place)
    bufs = [from_dlpack(t, device) for t in (*keep, out)]
    encoder = device.command_encoder()
    _core._moe_combine(encoder, registry, *bufs, m, top_k, hidden, n_experts)
    encoder.commit_and_wait()
    return out
