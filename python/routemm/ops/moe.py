"""The MoE layer: router gate and experts block, built from the op front doors.

    weights, ids = moe_gate(router_logits, top_k, renormalize=...)
    out = moe_experts(hidden, ids, weights, gate_up, down)

`moe_experts` computes, for every token t and slot s with a valid expert e = ids[t, s]:

    h = SiLU(W_gate[e] @ x[t]) * (W_up[e] @ x[t])            (F32, [I])
    out[t] = sum over s = 0 .. top_k - 1, in order, of weights[t, s] * (W_down[e] @ h)

as one encoder submission: the gate/up expert-ID matmul (one [E, 2I, H] stack, or a gate and an
up stack), SiLU(gate) * up, the down matmul on the slotted rows, and the ordered weighted combine
(no atomics, so the result is deterministic). An id outside [0, E) -- an invalid id or an
expert-parallel sentinel -- contributes zero and reads no weight. Both matmuls take the same ids,
the same route and, on grouped_prefill, the same scratch, and one routing map serves them all: the
first matmul builds it, the others reuse it (reuse_map), so a block encodes one map dispatch.

Numeric contracts of the gate and the two small kernels are in csrc/include/routemm/ops/moe.h.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

import numpy as np

from .. import _core
from ..core._core_api import _NUMPY_TO_DTYPE, DType, check_encoding, check_uint
from ..core._devices import _registry_for, _resolve_device
from ..core._errors import InvalidArgumentError
from .dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    _enum_value,
    _framework,
    _pick_route,
    dense_matmul_id_capability,
    ids_distinct_per_token,
)
from .quantized_matmul import GgmlRoutingPolicy, GgmlType, ggml_routing_policy
from .quantized_matmul_id import SUPPORTED_TYPES as QUANTIZED_EXPERT_TYPES
from .quantized_matmul_id import (
    GgmlQuantizedMatmulIdParams,
    GgmlQuantizedMatmulIdRoute,
    quantized_matmul_id_ggml_capability,
)

MOE_PIPELINE_NAMES: tuple[str, ...] = _core.MOE_PIPELINE_NAMES

_INVALID_ID = 0xFFFFFFFF


# ---- Explicit front doors (encode into a caller's encoder) --------------------------------------


def encode_moe_gate(
    encoder,
    registry,
    logits,
    weights,
    ids,
    *,
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias=None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    router_bias=None,
) -> None:
    """Encode the gate: logits F32 [m, E] -> weights F32 [m, top_k], ids U32/I32 [m, top_k];
    the routing options as moe_gate's (e_score_correction_bias and router_bias: None or an F32 [E]
    Buffer).

    One dispatch, no barrier (order it after the logits' producer with encoder.memory_barrier()).
    """
    names, buffers = ("logits", "weights", "ids"), (logits, weights, ids)
    for name, buffer in (("e_score_correction_bias", e_score_correction_bias), ("router_bias", router_bias)):
        if buffer is not None:
            names, buffers = (*names, name), (*buffers, buffer)
    check_encoding("moe_gate", encoder, registry, names, *buffers)
    m, n_experts = _matrix_shape("moe_gate logits", logits.shape)
    _check_top_k(top_k, n_experts)
    renormalize = _check_bool(renormalize)
    routing = _check_routing(scoring_func, num_expert_group, topk_group, routed_scaling_factor)
    _core._moe_gate(
        encoder, registry, logits, weights, ids, m, n_experts, int(top_k), renormalize, routing.scoring_func,
        e_score_correction_bias, routing.num_expert_group, routing.topk_group, routing.routed_scaling_factor,
        router_bias,
    )  # fmt: skip


def encode_moe_silu_mul(
    encoder, registry, gate, up, output, *, rows: int, width: int, gate_row_stride: int, up_row_stride: int
) -> None:
    """Encode output[r, c] = SiLU(gate[r * gate_row_stride + c]) * up[r * up_row_stride + c] (F32)."""
    op = "moe_silu_mul"
    check_encoding(op, encoder, registry, ("gate", "up", "output"), gate, up, output)
    _core._moe_silu_mul(
        encoder, registry, gate, up, output, check_uint(op, "rows", rows), check_uint(op, "width", width),
        check_uint(op, "gate_row_stride", gate_row_stride, 64), check_uint(op, "up_row_stride", up_row_stride, 64),
    )  # fmt: skip


def encode_moe_combine(encoder, registry, rows, weights, ids, output, *, n_experts: int) -> None:
    """Encode output[t] = ordered sum over valid slots of weights[t, s] * rows[t * top_k + s].

    rows F32 [m * top_k, hidden], weights F32 [m, top_k], ids U32/I32 [m, top_k] (ids >= n_experts
    are skipped), output F32 [m, hidden].
    """
    check_encoding("moe_combine", encoder, registry, ("rows", "weights", "ids", "output"), rows, weights, ids, output)
    m, top_k = _matrix_shape("moe_combine weights", weights.shape)
    hidden = check_uint("moe_combine", "hidden (output.shape[-1])", int(output.shape[-1]))
    n_experts = check_uint("moe_combine", "n_experts", n_experts)
    _core._moe_combine(encoder, registry, rows, weights, ids, output, m, top_k, hidden, n_experts)


def _matrix_shape(what: str, shape) -> tuple[int, int]:
    """The two extents of a 2-D shape, each a u32 (the kernels' params): checked on the shape, so a
    NumPy front door refuses a zero-stride array of 2^32 + 1 columns before copying it."""
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2:
        raise InvalidArgumentError(f"{what} must be 2-D, got shape {shape}")
    if max(shape) > 0xFFFFFFFF:
        raise InvalidArgumentError(f"{what} shape {shape} has an extent over the kernels' u32 limit")
    return shape


def _check_top_k(top_k, n_experts: int, what: str = "moe_gate top_k", experts: str = "n_experts") -> int:
    """top_k as an int in [1, n_experts]: an integer, never a bool, float or string (no coercion).
    `what` and `experts` name the argument (or metadata key) and the expert count in the refusal
    (MoeLayer shares this check)."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an integer, got {top_k!r}")
    if not 1 <= top_k <= n_experts:
        raise InvalidArgumentError(f"{what} {top_k} must be in [1, {experts} = {n_experts}]")
    return int(top_k)


def _check_bool(value, what: str = "moe_gate renormalize") -> bool:
    """`value` as a bool: a bool or numpy bool only (a truthy string or list is refused)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{what} must be a bool, got {value!r}")
    return bool(value)


# ---- moe_gate -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GateRouting:
    """moe_gate's routing options past top_k and renormalize, checked (see moe_gate): vLLM's
    names, with num_expert_group = topk_group = 0 for no grouping. MoeLayer keeps one."""

    scoring_func: str = "softmax"
    num_expert_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0

    def core_args(self) -> tuple:
        """The positional tail of the core's gate bindings after renormalize (less the bias)."""
        return self.scoring_func, self.num_expert_group, self.topk_group, self.routed_scaling_factor


def _check_routing(
    scoring_func="softmax", num_expert_group=None, topk_group=None, routed_scaling_factor=1.0, what="moe_gate"
) -> GateRouting:
    """The routing options' types, never coerced: scoring_func a str (its value the core checks),
    num_expert_group and topk_group None or positive u32 integers given together, the scaling
    factor a real number (the core refuses one not finite as a float32). `what` prefixes refusals
    (MoeLayer shares this check)."""
    if not isinstance(scoring_func, str):
        raise InvalidArgumentError(f"{what} scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    groups = []
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if value is None:
            groups.append(0)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidArgumentError(f"{what} {name} must be None or a positive integer, got {value!r}")
        groups.append(check_uint(what, name, value))
    if (num_expert_group is None) != (topk_group is None):
        raise InvalidArgumentError(
            f"{what} num_expert_group and topk_group must be given together, got {num_expert_group!r} "
            f"and {topk_group!r}"
        )
    if isinstance(routed_scaling_factor, bool) or not isinstance(
        routed_scaling_factor, (int, float, np.integer, np.floating)
    ):
        raise InvalidArgumentError(f"{what} routed_scaling_factor must be a real number, got {routed_scaling_factor!r}")
    return GateRouting(scoring_func, groups[0], groups[1], float(routed_scaling_factor))


def _check_bias_array(bias, n_experts: int, framework: str, name: str = "e_score_correction_bias"):
    """A per-expert vector (e_score_correction_bias, router_bias) for NumPy logits: a float32 NumPy
    array of shape (n_experts,)."""
    if framework != "numpy" or not isinstance(bias, np.ndarray):
        raise InvalidArgumentError(f"moe_gate {name} must be a NumPy array for NumPy logits, got {type(bias).__name__}")
    if bias.dtype != np.float32:
        raise InvalidArgumentError(f"moe_gate {name} must be float32, got {bias.dtype}")
    if tuple(bias.shape) != (n_experts,):
        raise InvalidArgumentError(
            f"moe_gate {name} must have shape (n_experts,) = ({n_experts},), got {tuple(bias.shape)}"
        )
    return bias


def moe_gate(
    router_logits,
    top_k: int,
    *,
    renormalize: bool,
    scoring_func: str = "softmax",
    e_score_correction_bias=None,
    num_expert_group: Optional[int] = None,
    topk_group: Optional[int] = None,
    routed_scaling_factor: float = 1.0,
    router_bias=None,
    device=None,
):
    """Router scores and top-k selection: returns (weights float32 [m, top_k], ids int32 [m, top_k]).

    router_logits: float32 [m, n_experts]. In order (docs/moe.md, "Routing"):
    router_bias (None or float32 [n_experts], gpt-oss's ffn_gate_inp.bias) is added to the logits
    first (one float32 add, as llama.cpp adds it to the router matmul's output), so it moves both the
    selection and the weights; every later step reads the biased logits;
    scores = softmax(logits) over experts, or sigmoid(logits) with scoring_func="sigmoid";
    e_score_correction_bias (None or float32 [n_experts], DeepSeek-V3's) is added to the scores for
    selection only; num_expert_group / topk_group (None or both given) keep the topk_group best of
    num_expert_group equal contiguous groups, a group scored by the sum of its two largest
    (biased) scores; top_k experts of the kept groups by (biased) score, ties to the lower index;
    weights are the unbiased scores of those experts, divided by their sum with renormalize
    (Mixtral, Qwen3-MoE with norm_topk_prob; softmax over the selected logits, as gpt-oss does, is
    the same), then multiplied by routed_scaling_factor. A NaN logit ranks as -inf; with softmax a
    row with no logit above -inf gets weights 0 and the lowest kept ids.
    NumPy input runs on `device` (default: the best backend) and returns NumPy arrays; a PyTorch
    tensor is used in place on its own device and the results are tensors there (no host sync).
    """
    framework = _framework(router_logits)
    if framework == "cupy":
        raise InvalidArgumentError("moe_gate takes NumPy arrays or PyTorch tensors")
    if framework == "numpy":
        router_logits = np.asarray(router_logits)  # a list too; no copy of an array
    m, n_experts = _matrix_shape("moe_gate router_logits", router_logits.shape)
    top_k = _check_top_k(top_k, n_experts)
    renormalize = _check_bool(renormalize)
    routing = _check_routing(scoring_func, num_expert_group, topk_group, routed_scaling_factor)
    bias = e_score_correction_bias
    if framework == "torch":
        from . import _tensor_ops

        # torch.ops.routemm.moe_gate's call path: one crossing, the current stream, no host wait.
        fw = _tensor_ops.framework("torch")

        def detached(t):
            return t.detach() if isinstance(t, fw.tensor_type) else t

        weights, ids = _tensor_ops.moe_gate(
            fw, router_logits.detach(), top_k, renormalize, scoring_func, detached(bias), num_expert_group, topk_group,
            routed_scaling_factor, detached(router_bias),
        )  # fmt: skip
        named = [("router_logits", router_logits), ("e_score_correction_bias", bias), ("router_bias", router_bias)]
        return fw.forward_only("routemm.moe_gate", weights, named), ids
    logits = np.asarray(router_logits)
    if logits.dtype != np.float32:
        raise InvalidArgumentError(f"moe_gate router_logits must be float32, got {logits.dtype}")
    if bias is not None:
        bias = _check_bias_array(bias, n_experts, framework)
    if router_bias is not None:
        router_bias = _check_bias_array(router_bias, n_experts, framework, "router_bias")
    _core._check_moe_gate_params(m, n_experts, top_k, renormalize, *routing.core_args())
    device = _resolve_device(device, "moe_gate")
    logits_buf = device.from_numpy(np.ascontiguousarray(logits))
    bias_buf = None if bias is None else device.from_numpy(np.ascontiguousarray(bias))
    router_bias_buf = None if router_bias is None else device.from_numpy(np.ascontiguousarray(router_bias))
    weights_buf = device.alloc(m * top_k * 4, DType.F32, [m, top_k])
    ids_buf = device.alloc(m * top_k * 4, DType.I32, [m, top_k])
    _submit(
        device,
        lambda enc, reg: _core._moe_gate(
            enc, reg, logits_buf, weights_buf, ids_buf, m, n_experts, top_k, renormalize,
            routing.scoring_func, bias_buf, routing.num_expert_group, routing.topk_group,
            routing.routed_scaling_factor, router_bias_buf,
        ),
    )  # fmt: skip
    return weights_buf.numpy(), ids_buf.numpy()


def _submit(device, encode) -> None:
    encoder = device.command_encoder()
    encode(encoder, _registry_for(device))
    encoder.commit_and_wait()


# ---- moe_experts --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ExpertShapes:
    m: int
    top_k: int
    n_experts: int
    hidden: int
    intermediate: int
    stacked: bool  # gate_up is one [E, 2I, H] stack


def _shape_of(w, ggml_type: Optional[GgmlType] = None) -> tuple[int, ...]:
    """The logical [E, n, k] shape of a weight stack (k in values, also for uint8 block stacks)."""
    shape = tuple(int(d) for d in w.shape)
    if ggml_type is None:
        return shape
    values, block_bytes = ggml_type.block_layout
    if len(shape) != 3 or shape[2] % block_bytes != 0:
        raise InvalidArgumentError(
            f"moe_experts {ggml_type.value} weights must be uint8 [E, n, k / {values} * {block_bytes}], got shape {shape}"
        )
    return (*shape[:2], shape[2] // block_bytes * values)


def _expert_shapes(hidden_shape, ids_shape, weights_shape, gate_up, down, ggml_type=None) -> _ExpertShapes:
    hidden_shape, ids_shape, weights_shape = (
        tuple(int(d) for d in s) for s in (hidden_shape, ids_shape, weights_shape)
    )
    if len(hidden_shape) != 2:
        raise InvalidArgumentError(f"moe_experts hidden must be [m, H], got shape {hidden_shape}")
    m, h = hidden_shape
    if len(ids_shape) != 2 or ids_shape[0] != m:
        raise InvalidArgumentError(f"moe_experts top_k_index must be [{m}, top_k], got shape {ids_shape}")
    top_k = ids_shape[1]
    if weights_shape != ids_shape:
        raise InvalidArgumentError(
            f"moe_experts top_k_weights must have the shape of top_k_index {ids_shape}, got {weights_shape}"
        )
    gate_type, up_type, down_type = _stack_types(ggml_type)
    down_shape = _shape_of(down, down_type)
    if len(down_shape) != 3 or down_shape[1] != h:
        raise InvalidArgumentError(f"moe_experts down must be [E, {h}, I], got shape {down_shape}")
    n_experts, _, inter = down_shape
    if isinstance(gate_up, (tuple, list)):
        if len(gate_up) != 2:
            raise InvalidArgumentError("moe_experts gate_up must be one [E, 2I, H] stack or a (gate, up) pair")
        for name, w, t in zip(("gate", "up"), gate_up, (gate_type, up_type), strict=True):
            if _shape_of(w, t) != (n_experts, inter, h):
                raise InvalidArgumentError(
                    f"moe_experts {name} must be [{n_experts}, {inter}, {h}], got shape {_shape_of(w, t)}"
                )
        stacked = False
    else:
        if gate_type != up_type:
            raise InvalidArgumentError(
                f"moe_experts one gate_up stack has one block type, got gate {gate_type.value} and up {up_type.value}"
            )
        if _shape_of(gate_up, gate_type) != (n_experts, 2 * inter, h):
            raise InvalidArgumentError(
                f"moe_experts gate_up must be [{n_experts}, {2 * inter}, {h}], got shape {_shape_of(gate_up, gate_type)}"
            )
        stacked = True
    if m == 0 or top_k == 0 or h == 0 or inter == 0 or n_experts == 0:
        raise InvalidArgumentError(f"moe_experts extents must be nonzero, got m={m}, top_k={top_k}, H={h}, I={inter}")
    return _ExpertShapes(m, top_k, n_experts, h, inter, stacked)


ACTIVATIONS: tuple[str, ...] = ("silu", "swiglu_oai")


@dataclasses.dataclass(frozen=True)
class _FfnOptions:
    """moe_experts' FFN options, checked: the activation and its parameters, which biases the
    call has (the arrays travel separately) and where the routing weight applies."""

    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    gate_up_bias: bool = False
    down_bias: bool = False
    weights_before_ffn: bool = False

    def core_kwargs(self) -> dict:
        return {
            "activation": self.activation,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "weights_before_ffn": self.weights_before_ffn,
        }


def _checked_ffn_options(
    activation, swiglu_alpha, swiglu_limit, weights_before_ffn, gate_up_bias: bool, down_bias: bool
) -> _FfnOptions:
    """The options checked (InvalidArgumentError naming the argument): activation one of
    ACTIVATIONS, swiglu_alpha a finite real, swiglu_limit a real > 0 (inf: no clamp), and
    weights_before_ffn a bool."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"moe_experts activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise InvalidArgumentError(f"moe_experts {name} must be a real number, got {value!r}")
    alpha, limit = float(swiglu_alpha), float(swiglu_limit)
    if not np.isfinite(alpha) or not np.isfinite(np.float32(alpha)):
        raise InvalidArgumentError(f"moe_experts swiglu_alpha must be finite, got {swiglu_alpha!r}")
    if not limit > 0:
        raise InvalidArgumentError(f"moe_experts swiglu_limit must be > 0, got {swiglu_limit!r}")
    weights_before_ffn = _check_bool(weights_before_ffn, "moe_experts weights_before_ffn")
    return _FfnOptions(activation, alpha, limit, gate_up_bias, down_bias, weights_before_ffn)


def _check_bias_shapes(s: "_ExpertShapes", gate_up_bias, gate_bias, up_bias, down_bias) -> None:
    """The biases' shapes against the stacks': gate_up_bias [E, 2I] with one gate_up stack,
    gate_bias and up_bias [E, I] (both or neither) with a (gate, up) pair, down_bias [E, H]."""
    e, i, h = s.n_experts, s.intermediate, s.hidden

    def shape(b):
        return tuple(int(d) for d in b.shape)

    if s.stacked:
        if gate_bias is not None or up_bias is not None:
            raise InvalidArgumentError(
                "moe_experts gate_bias/up_bias go with a (gate, up) pair; one gate_up stack takes gate_up_bias"
            )
        if gate_up_bias is not None and shape(gate_up_bias) != (e, 2 * i):
            raise InvalidArgumentError(
                f"moe_experts gate_up_bias must be [{e}, {2 * i}], got shape {shape(gate_up_bias)}"
            )
    else:
        if gate_up_bias is not None:
            raise InvalidArgumentError(
                "moe_experts gate_up_bias goes with one gate_up stack; a (gate, up) pair takes gate_bias and up_bias"
            )
        if (gate_bias is None) != (up_bias is None):
            raise InvalidArgumentError("moe_experts gate_bias and up_bias come together (both or neither)")
        for name, b in (("gate_bias", gate_bias), ("up_bias", up_bias)):
            if b is not None and shape(b) != (e, i):
                raise InvalidArgumentError(f"moe_experts {name} must be [{e}, {i}], got shape {shape(b)}")
    if down_bias is not None and shape(down_bias) != (e, h):
        raise InvalidArgumentError(f"moe_experts down_bias must be [{e}, {h}], got shape {shape(down_bias)}")


def _encode_experts(
    encoder,
    registry,
    device,
    s: _ExpertShapes,
    route: Union[DenseMatmulIdRoute, GgmlQuantizedMatmulIdRoute],
    distinct: bool,
    x_buf,
    ids_buf,
    weights_buf,
    gate_up_bufs,
    down_buf,
    alloc,
    out_buf,
    ggml_type: Optional[GgmlType] = None,
    options: _FfnOptions = _FfnOptions(),
    bias_bufs: tuple = (None, None, None),
) -> None:
    """Encode the whole experts block through the core's one op (routemm::moe_experts, see
    csrc/include/routemm/ops/moe_experts.h); `alloc(shape)` returns a fresh F32 buffer, of which
    one is the op's workspace (its intermediates and the grouped routes' scratch).

    Float stacks run dense_matmul_id's route, block-quantised ones (ggml_type)
    quantized_matmul_id_ggml's; every matmul takes the same ids and route, and on a grouped route
    the first builds the routing map and the others reuse it. `distinct` was checked by the caller
    for a grouped route (the op's grouped kernels compute repeated ids as well). All or nothing:
    the op checks every step before it encodes one, inside an encoder transaction, so a refused
    block leaves `encoder` as it was. `options` and `bias_bufs` (gate_up or gate, up, down; F32
    buffers or None) are the FFN options. Block stacks run under the policy frozen into
    `registry`, else the environment's (GgmlRoutingPolicy.expert_q8_0_mv_nr2: Q8_0's direct
    pipeline)."""
    del device, distinct  # the op checks and carves everything itself
    block_route = _block_stack_route(route) if ggml_type is not None else route
    gate_type, up_type, down_type = _stack_types(ggml_type)
    params = (
        s.m, s.top_k, s.n_experts, s.hidden, s.intermediate, not s.stacked, gate_up_bufs[0].dtype,
        None if ggml_type is None else gate_type.value, block_route.value,
    )  # fmt: skip
    kwargs = options.core_kwargs()
    if isinstance(ggml_type, tuple):  # mixed block stacks: the up and down stacks' own types
        kwargs.update(up_ggml_type=up_type.value, down_ggml_type=down_type.value)
    workspace = alloc([(_core._moe_experts_workspace_bytes(*params, **kwargs) + 3) // 4])
    up_buf = None if s.stacked else gate_up_bufs[1]
    if ggml_type is not None:
        policy = ggml_routing_policy(registry) or GgmlRoutingPolicy.from_environment()
        kwargs.update(q8_0_mv_nr2=bool(policy.expert_q8_0_mv_nr2))
    _core._moe_experts(
        encoder, registry, x_buf, ids_buf, weights_buf, gate_up_bufs[0], up_buf, down_buf, out_buf, workspace, *params,
        gate_up_bias=bias_bufs[0], up_bias=bias_bufs[1], down_bias=bias_bufs[2], **kwargs,
    )  # fmt: skip


WeightStack = Union[np.ndarray, "_core.Buffer"]


def moe_experts(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    *,
    ggml_type=None,
    route: Union[DenseMatmulIdRoute, GgmlQuantizedMatmulIdRoute, str, None] = None,
    device=None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    gate_up_bias=None,
    gate_bias=None,
    up_bias=None,
    down_bias=None,
    weights_before_ffn: bool = False,
    shared_gate_up=None,
    shared_down=None,
    shared_gate=None,
):
    """The experts block of a MoE layer; returns float32 [m, H].

    hidden: float32 [m, H]. top_k_index: integers [m, top_k]; ids outside [0, E) contribute zero
    and read no weight. top_k_weights: float32 [m, top_k].
    gate_up: one [E, 2I, H] stack (gate rows, then up rows, as transformers stores it) or a pair
    (gate [E, I, H], up [E, I, H]) as GGUF stores it; down: [E, H, I]. Float32, float16 or bfloat16
    weights (NumPy arrays, routemm.Buffer views such as gguf_tensor's, or tensors), or with
    ggml_type uint8 block stacks [E, n, k / block_values * block_bytes] of a GgmlType of
    QUANTIZED_EXPERT_TYPES (routemm.quantize quantises along the last axis; gguf_tensor loads them),
    whose matmuls run quantized_matmul_id_ggml: one type for every stack, or a (gate, up, down)
    tuple for stacks of mixed types (one gate_up stack has one type).
    route: the expert-ID matmul route of both matmuls; None picks grouped_prefill when ids are
    distinct per token and dense_matmul_id.auto_grouped says so for the shapes and backend (m > 8;
    on CUDA also 8 routed rows per expert on average, 256 for block stacks), else direct (with
    tensors, passing it avoids a device-to-host distinctness check). Block stacks take a
    GgmlQuantizedMatmulIdRoute (its value, or grouped_prefill for grouped), the CPU's
    reduced-precision direct_int8_dot / grouped_int8_dot included.
    NumPy inputs run on `device` (default: the best backend) and the result is a NumPy array;
    PyTorch tensors are used in place on their device and the result is a tensor there.

    FFN options (docs/moe.md), defaults as above: activation "silu" (SiLU(g) * u) or "swiglu_oai"
    (gpt-oss: g = min(g, swiglu_limit), u = clamp(u, -swiglu_limit, swiglu_limit),
    g * sigmoid(swiglu_alpha * g) * (u + 1); gate = the first I rows of gate_up, or the gate
    stack). Expert biases, float32 (any float dtype on the torch path): gate_up_bias [E, 2I] with
    one gate_up stack, gate_bias and up_bias [E, I] with a (gate, up) pair, down_bias [E, H], each
    added after its product. weights_before_ffn: the routing weight scales the expert's input
    (Llama-4: out = sum_s FFN_e(w x)) and the slots are summed with weight 1. A shared expert:
    shared_gate_up ([2I_s, H], or a (gate, up) pair [I_s, H]) and shared_down [H, I_s], of the
    routed stacks' kind (dtype or ggml_type), run for every token through the same block with one
    expert and added to the routed output; shared_gate [H] (optional) weighs it per token by
    sigmoid(x . shared_gate) (Qwen2-MoE), without it by 1 (DeepSeek). The shared expert takes the
    activation, no biases, and its weight after the FFN.
    """
    ggml_type = _checked_ggml_type(ggml_type)
    framework = _framework(hidden)
    options = _checked_ffn_options(
        activation, swiglu_alpha, swiglu_limit, weights_before_ffn,
        gate_up_bias is not None or gate_bias is not None, down_bias is not None,
    )  # fmt: skip
    biases = (gate_up_bias, gate_bias, up_bias, down_bias)
    shared = (shared_gate_up, shared_down, shared_gate)
    if framework == "torch":
        return _moe_experts_torch(
            hidden, top_k_index, top_k_weights, gate_up, down, route, ggml_type, options, biases, shared
        )
    if framework == "cupy":
        raise InvalidArgumentError("moe_experts takes NumPy arrays, routemm buffers or PyTorch tensors")
    hidden = np.asarray(hidden)
    ids = np.asarray(top_k_index)
    weights = np.asarray(top_k_weights)
    if isinstance(gate_up, (tuple, list)):
        gate_up = tuple(_stack_array(w) for w in gate_up)
    else:
        gate_up = _stack_array(gate_up)
    down = _stack_array(down)
    s = _expert_shapes(hidden.shape, ids.shape, weights.shape, gate_up, down, ggml_type)
    bias_arrays = tuple(None if b is None else np.asarray(b) for b in biases)
    _check_bias_shapes(s, *bias_arrays)
    for name, b in zip(("gate_up_bias", "gate_bias", "up_bias", "down_bias"), bias_arrays, strict=True):
        if b is not None and b.dtype != np.float32:
            raise InvalidArgumentError(f"moe_experts {name} must be float32, got {b.dtype}")
    shared_s, shared_arrays = _shared_expert(s, hidden.shape, *shared, ggml_type)
    if hidden.dtype != np.float32:
        raise InvalidArgumentError(f"moe_experts hidden must be float32, got {hidden.dtype}")
    if weights.dtype != np.float32:
        raise InvalidArgumentError(f"moe_experts top_k_weights must be float32, got {weights.dtype}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(f"moe_experts top_k_index must be integers, got {ids.dtype}")
    stacks = tuple(gate_up) if not s.stacked else (gate_up,)
    _check_extents(s, stacks[0], ggml_type)
    ids64 = ids.astype(np.int64, copy=False)
    ids_u32 = np.where((ids64 >= 0) & (ids64 < s.n_experts), ids64, _INVALID_ID).astype(np.uint32)
    distinct = ids_distinct_per_token(ids64, s.n_experts)
    device = _resolve_device(device, "moe_experts")
    route = _checked_route(route, distinct, s, device, ggml_type)
    gate_up_bufs = tuple(_weight_buffer(device, w) for w in stacks)
    down_buf = _weight_buffer(device, down)
    _check_weight_dtypes(gate_up_bufs + (down_buf,), ggml_type)
    out_buf = device.alloc(s.m * s.hidden * 4, DType.F32, [s.m, s.hidden])
    gate_up_b, gate_b, up_b, down_b = (
        None if b is None else device.from_numpy(np.ascontiguousarray(b)) for b in bias_arrays
    )
    bias_bufs = (gate_up_b if s.stacked else gate_b, None if s.stacked else up_b, down_b)
    x_buf = device.from_numpy(np.ascontiguousarray(hidden))
    shared_call = None
    if shared_s is not None:
        sg_up, s_down, s_gate = shared_arrays
        s_stacks = tuple(_weight_buffer(device, w) for w in sg_up)
        s_down_buf = _weight_buffer(device, s_down)
        _check_weight_dtypes(gate_up_bufs + (down_buf,) + s_stacks + (s_down_buf,), ggml_type)
        shared_call = (s_stacks, s_down_buf, device.from_numpy(_shared_gate_weights(hidden, s_gate)))
    shared_out = device.alloc(s.m * s.hidden * 4, DType.F32, [s.m, s.hidden]) if shared_call else None

    def alloc(shape):
        return device.alloc(int(np.prod(shape)) * 4, DType.F32, list(shape))

    encoder = device.command_encoder()
    registry = _registry_for(device)
    _encode_experts(
        encoder, registry, device, s, route, distinct, x_buf, device.from_numpy(ids_u32),
        device.from_numpy(np.ascontiguousarray(weights)), gate_up_bufs, down_buf, alloc, out_buf, ggml_type,
        options, bias_bufs,
    )  # fmt: skip
    if shared_call is not None:
        s_stacks, s_down_buf, s_weights_buf = shared_call
        s_ids = device.from_numpy(np.zeros((s.m, 1), dtype=np.uint32))
        _encode_shared_expert(
            encoder, registry, device, shared_s, x_buf, s_ids, s_weights_buf, s_stacks, s_down_buf, alloc, shared_out,
            ggml_type, options,
        )  # fmt: skip
    encoder.commit_and_wait()
    if shared_out is None:
        return out_buf.numpy()
    return out_buf.numpy() + shared_out.numpy()


def _shared_gate_weights(hidden: np.ndarray, gate: Optional[np.ndarray]) -> np.ndarray:
    """The shared expert's per-token weight, float32 [m, 1]: 1 without a gate, else
    sigmoid(x . gate) (the dot product and sigmoid in float64, rounded once to float32)."""
    m = int(hidden.shape[0])
    if gate is None:
        return np.ones((m, 1), dtype=np.float32)
    z = np.asarray(hidden, np.float64) @ np.asarray(gate, np.float64).reshape(-1)
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-z))).astype(np.float32).reshape(m, 1)


def _encode_shared_expert(
    encoder, registry, device, shapes: _ExpertShapes, x_buf, ids_buf, weights_buf, stacks, down_buf, alloc, out_buf,
    ggml_type, options: _FfnOptions,
) -> None:  # fmt: skip
    """Encode a shared expert as the experts block with one expert every token selects (ids 0,
    weights_buf [m, 1] the per-token weight): the routed block's activation, no biases, the weight
    applied after the FFN. Its route is the automatic one for its shapes."""
    route = _checked_route(None, True, shapes, device, ggml_type)
    _encode_experts(
        encoder, registry, device, shapes, route, True, x_buf, ids_buf, weights_buf, stacks, down_buf, alloc, out_buf,
        ggml_type, _FfnOptions(options.activation, options.swiglu_alpha, options.swiglu_limit),
    )  # fmt: skip


def _shared_expert(s: _ExpertShapes, hidden_shape, shared_gate_up, shared_down, shared_gate, ggml_type):
    """The shared expert's block shapes (one expert, every token's only slot) and its stacks as
    [1, n, k] arrays or buffers, or (None, None) without one; checks that shared_gate_up and
    shared_down come together, their shapes against hidden's width, and shared_gate's [H]."""
    if shared_gate_up is None and shared_down is None:
        if shared_gate is not None:
            raise InvalidArgumentError("moe_experts shared_gate needs shared_gate_up and shared_down")
        return None, None
    if shared_gate_up is None or shared_down is None:
        raise InvalidArgumentError("moe_experts shared_gate_up and shared_down come together (both or neither)")

    def one_expert(w, name):
        w = w if _framework(w) == "torch" else _stack_array(w)
        if len(w.shape) != 2:
            raise InvalidArgumentError(f"moe_experts {name} must be a 2-D matrix, got shape {tuple(w.shape)}")
        if isinstance(w, _core.Buffer):
            return w.view(0, w.nbytes, w.dtype, [1, *(int(d) for d in w.shape)])
        return w.reshape(1, *w.shape)

    if isinstance(shared_gate_up, (tuple, list)):
        if len(shared_gate_up) != 2:
            raise InvalidArgumentError("moe_experts shared_gate_up must be one [2I, H] matrix or a (gate, up) pair")
        stacks = tuple(one_expert(w, f"shared_gate_up[{i}]") for i, w in enumerate(shared_gate_up))
        pair = stacks
    else:
        stacks = (one_expert(shared_gate_up, "shared_gate_up"),)
        pair = stacks[0]
    down = one_expert(shared_down, "shared_down")
    m, h = (int(d) for d in hidden_shape)
    shapes = _expert_shapes((m, h), (m, 1), (m, 1), pair, down, ggml_type)
    gate = None
    if shared_gate is not None:
        gate = shared_gate if _framework(shared_gate) == "torch" else np.asarray(shared_gate)
        floating = gate.dtype.is_floating_point if _framework(gate) == "torch" else gate.dtype.kind == "f"
        if tuple(gate.shape) not in ((h,), (1, h)) or not floating:
            raise InvalidArgumentError(
                f"moe_experts shared_gate must be a float vector [{h}] (or [1, {h}]), got {gate.dtype} {tuple(gate.shape)}"
            )
        gate = gate.reshape(h)
    del s
    return shapes, (stacks, down, gate)


def _stack_array(w):
    """A weight stack of the NumPy path: a routemm.Buffer as it is, anything else as an array (a
    list too; no copy of an array)."""
    return w if isinstance(w, _core.Buffer) else np.asarray(w)


def _check_extents(s: _ExpertShapes, stack, ggml_type: Optional[GgmlType]) -> None:
    """The extents of the block's two matmul shapes (u32 fields, u32 routed rows, u64 byte extents),
    checked on the shapes before anything is copied: zero-stride arrays of 2^33 tokens or experts
    are refused here. `stack` (an array or buffer) gives a float stack's element size."""
    shared, slotted = DenseMatmulIdInputLayout.SHARED_PER_TOKEN, DenseMatmulIdInputLayout.SLOTTED
    gate_up_rows = 2 * s.intermediate if s.stacked else s.intermediate
    gate_type, up_type, down_type = _stack_types(ggml_type)
    steps = [(gate_up_rows, s.hidden, shared, gate_type), (s.hidden, s.intermediate, slotted, down_type)]
    if up_type != gate_type:
        steps.append((s.intermediate, s.hidden, shared, up_type))
    for n, k, layout, stack_type in steps:
        if stack_type is None:
            dtype = stack.dtype if isinstance(stack, _core.Buffer) else _NUMPY_TO_DTYPE.get(stack.dtype)
            dtype = dtype if dtype in (DType.F32, DType.F16, DType.BF16) else DType.F32  # refused later
            params = DenseMatmulIdParams(
                s.m, n, k, s.top_k, s.n_experts, n * k * dtype.size, layout, DenseMatmulIdMultiplicity.MAY_REPEAT
            )
            dense_matmul_id_capability(dtype, params)
        else:
            values, block_bytes = stack_type.block_layout
            stride = n * (k // values) * block_bytes
            quantized_matmul_id_ggml_capability(
                GgmlQuantizedMatmulIdParams(s.m, n, k, s.top_k, s.n_experts, stack_type, stride, layout)
            )


def _block_stack_route(route) -> GgmlQuantizedMatmulIdRoute:
    """The quantised expert-ID route of block stacks for `route`: a GgmlQuantizedMatmulIdRoute (or
    its value), or a DenseMatmulIdRoute that has a block-stack counterpart (direct; grouped_prefill,
    which is grouped there; grouped_tensor_lowp)."""
    value = route.value if isinstance(route, enum.Enum) else route
    if value == DenseMatmulIdRoute.GROUPED_PREFILL.value:
        return GgmlQuantizedMatmulIdRoute.GROUPED
    try:
        return GgmlQuantizedMatmulIdRoute(value)
    except ValueError:
        choices = ", ".join(repr(r.value) for r in GgmlQuantizedMatmulIdRoute)
        raise InvalidArgumentError(
            f"moe_experts with ggml_type takes route {choices} (GgmlQuantizedMatmulIdRoute) or "
            f"'grouped_prefill', got {route!r}"
        ) from None


def _parsed_route(route, ggml_type):
    """`route` (not None) as the route type of the stacks: GgmlQuantizedMatmulIdRoute for block
    stacks, else DenseMatmulIdRoute."""
    if ggml_type is not None:
        return _block_stack_route(route)
    return DenseMatmulIdRoute(_enum_value(DenseMatmulIdRoute, route, "route"))


def _checked_route(route, distinct: bool, s, device, ggml_type):
    """`route` parsed (_parsed_route), or the automatic choice for the shapes `s` on `device`; a
    grouped route needs ids distinct per token."""
    if route is None:
        route = _pick_route(None, distinct, s.m, device, s.top_k, s.n_experts, quantized=ggml_type is not None)
    route = _parsed_route(route, ggml_type)
    if route.is_grouped and not distinct:
        raise InvalidArgumentError(f"moe_experts route {route.value} needs ids distinct per token")
    return route


def _weight_buffer(device, w):
    if isinstance(w, _core.Buffer):
        if w.device.backend != device.backend:
            raise InvalidArgumentError(
                f"moe_experts weight buffer lives on {w.device.backend}, the call runs on {device.backend}"
            )
        return w
    w = np.asarray(w)
    return device.from_numpy(np.ascontiguousarray(w))


def _checked_ggml_type(ggml_type, what: str = "moe_experts ggml_type"):
    """None (float stacks), one GgmlType of QUANTIZED_EXPERT_TYPES (every block stack), or, for
    block stacks of mixed types, a (gate, up, down) tuple of them (the gate_up stack's, or the gate
    and up stacks', and the down stack's); a tuple of one type three times is that type."""
    if ggml_type is None:
        return None
    names = ", ".join(t.value for t in QUANTIZED_EXPERT_TYPES)

    def parse(value):
        try:
            parsed = GgmlType(value)
        except ValueError:
            parsed = None
        if parsed not in QUANTIZED_EXPERT_TYPES:
            raise InvalidArgumentError(
                f"{what} must be None (float weights), one of {names} or a (gate, up, down) tuple of them, "
                f"got {ggml_type!r}"
            )
        return parsed

    if isinstance(ggml_type, (tuple, list)):
        if len(ggml_type) != 3:
            raise InvalidArgumentError(f"{what} as a tuple must name (gate, up, down) types, got {ggml_type!r}")
        types = tuple(parse(t) for t in ggml_type)
        return types[0] if len(set(types)) == 1 else types
    return parse(ggml_type)


def _stack_types(ggml_type) -> tuple:
    """(gate, up, down) block types of a checked ggml_type (None three times for float stacks)."""
    return tuple(ggml_type) if isinstance(ggml_type, tuple) else (ggml_type,) * 3


def _type_name(ggml_type) -> str:
    """A checked ggml_type as messages name it: "q4_k", or "q4_k/q4_k/q6_k" for mixed stacks."""
    return "/".join(t.value for t in ggml_type) if isinstance(ggml_type, tuple) else ggml_type.value


def _check_weight_dtypes(bufs, ggml_type: Optional[GgmlType] = None, what: str = "moe_experts") -> None:
    dtypes = {b.dtype for b in bufs}
    if ggml_type is not None:
        if dtypes != {DType.U8}:
            raise InvalidArgumentError(
                f"{what} {_type_name(ggml_type)} weights must be uint8 block stacks, got {sorted(d.name.lower() for d in dtypes)}"
            )
        return
    if len(dtypes) != 1 or not dtypes <= {DType.F32, DType.F16, DType.BF16}:
        raise InvalidArgumentError(
            f"{what} weights must share one of f32, f16, bf16, got {sorted(d.name.lower() for d in dtypes)}"
        )


def _moe_experts_torch(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    route,
    ggml_type,
    options=_FfnOptions(),
    biases=(None,) * 4,
    shared=(None,) * 3,
):
    import torch

    from ..core._interop import from_dlpack
    from . import _tensor_ops

    fw = _tensor_ops.framework("torch")
    if isinstance(gate_up, (tuple, list)):
        gate_up_named = [(f"gate_up[{i}]", w) for i, w in enumerate(gate_up)]
    else:
        gate_up_named = [("gate_up", gate_up)]
    named = [("hidden", hidden), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights), *gate_up_named]
    named.append(("down", down))
    bias_names = ("gate_up_bias", "gate_bias", "up_bias", "down_bias")
    named += [(n, b) for n, b in zip(bias_names, biases, strict=True) if b is not None]
    shared_gate_up, shared_down, shared_gate = shared
    if isinstance(shared_gate_up, (tuple, list)):
        named += [(f"shared_gate_up[{i}]", w) for i, w in enumerate(shared_gate_up)]
    named += [(n, w) for n, w in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down),
                                  ("shared_gate", shared_gate)) if w is not None and not isinstance(w, (tuple, list))]  # fmt: skip
    # Every argument a tensor on hidden's device, one routemm has a backend for, before anything else.
    _tensor_ops.one_place(fw, "moe_experts", named)
    s = _expert_shapes(hidden.shape, top_k_index.shape, top_k_weights.shape, gate_up, down, ggml_type)
    _check_bias_shapes(s, *biases[:4])
    for name, b in zip(bias_names, biases, strict=True):
        if b is not None and not b.dtype.is_floating_point:
            raise InvalidArgumentError(f"moe_experts {name} must be a float tensor, got {b.dtype}")
    shared_s, shared_stacks = _shared_expert(s, hidden.shape, *shared, ggml_type)
    if hidden.dtype != torch.float32 or top_k_weights.dtype != torch.float32:
        raise InvalidArgumentError(
            f"moe_experts hidden and top_k_weights must be float32, got {hidden.dtype} and {top_k_weights.dtype}"
        )
    dev = hidden.device
    # int32 bit patterns read as u32, every invalid id outside [0, E) there (the matmul_id rule).
    ids32 = fw.ids_u32(top_k_index, s.n_experts, "moe_experts top_k_index")
    distinct = True
    if route is None or _parsed_route(route, ggml_type).is_grouped:
        valid = (ids32 >= 0) & (ids32 < s.n_experts)
        slots = torch.arange(s.top_k, device=dev)
        keyed = torch.where(valid, ids32, -1 - slots)
        sorted_ids = torch.sort(keyed, dim=1).values
        distinct = s.top_k <= 1 or not bool((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any())

    keep = []  # tensors that must outlive the submission

    def buf(t):
        t = t.detach().contiguous()
        keep.append(t)
        return from_dlpack(t)

    x_buf = buf(hidden)
    device = x_buf.device
    route = _checked_route(route, distinct, s, device, ggml_type)
    id_i32 = buf(ids32)
    ids_buf = id_i32.view(0, id_i32.nbytes, DType.U32, [s.m, s.top_k])
    weights_buf = buf(top_k_weights)
    stacks = tuple(gate_up) if not s.stacked else (gate_up,)
    gate_up_bufs = tuple(buf(w) for w in stacks)
    down_buf = buf(down)
    _check_weight_dtypes(gate_up_bufs + (down_buf,), ggml_type)
    out = torch.empty((s.m, s.hidden), dtype=torch.float32, device=dev)
    gate_up_b, gate_b, up_b, down_b = (None if b is None else buf(b.float()) for b in biases)
    bias_bufs = (gate_up_b if s.stacked else gate_b, None if s.stacked else up_b, down_b)
    shared_call = None
    if shared_s is not None:
        sg_up, s_down, s_gate = shared_stacks
        s_bufs = tuple(buf(w) for w in sg_up)
        s_down_buf = buf(s_down)
        _check_weight_dtypes(gate_up_bufs + (down_buf,) + s_bufs + (s_down_buf,), ggml_type)
        if s_gate is None:
            s_weights = torch.ones((s.m, 1), dtype=torch.float32, device=dev)
        else:
            s_weights = torch.sigmoid(hidden.detach().double() @ s_gate.detach().double().reshape(-1))
            s_weights = s_weights.float().reshape(s.m, 1)
        s_ids = torch.zeros((s.m, 1), dtype=torch.int32, device=dev)
        s_ids_i32 = buf(s_ids)
        shared_call = (
            s_bufs, s_down_buf, buf(s_weights), s_ids_i32.view(0, s_ids_i32.nbytes, DType.U32, [s.m, 1]),
            torch.empty((s.m, s.hidden), dtype=torch.float32, device=dev),
        )  # fmt: skip

    def alloc(shape):
        return buf(torch.empty(shape, dtype=torch.float32, device=dev))

    encoder = device.command_encoder()
    registry = _registry_for(device)
    _encode_experts(
        encoder, registry, device, s, route, distinct, x_buf, ids_buf, weights_buf,
        gate_up_bufs, down_buf, alloc, from_dlpack(out), ggml_type, options, bias_bufs,
    )  # fmt: skip
    if shared_call is not None:
        s_bufs, s_down_buf, s_w_buf, s_ids_buf, shared_out = shared_call
        _encode_shared_expert(
            encoder, registry, device, shared_s, x_buf, s_ids_buf, s_w_buf, s_bufs, s_down_buf, alloc,
            from_dlpack(shared_out), ggml_type, options,
        )  # fmt: skip
    encoder.commit_and_wait()
    if shared_call is not None:
        out = out + shared_call[4]
    return fw.forward_only("routemm.moe_experts", out, named)
