"""Expert-ID matmul over GGML block-quantised expert stacks (Q4_0, Q8_0).

    out[t*top_k + s, :] = dequantize(W[ids[t, s]]) @ x[row]    (row = t, or t*top_k + s when slotted)

The weights are the raw bytes of a GGUF expert tensor: expert e is n rows of k / 32 blocks (18
bytes each for Q4_0, 34 for Q8_0) starting e * expert_stride_bytes bytes into the U8 weight
buffer. Activations and output are F32, IDs U32; an ID >= n_experts gives an all-zero output row
and reads no weight.

Routes are explicit: ``direct`` (one dispatch, IDs may repeat: decode, and the flattened
"expert-down" form with m = tokens * top_k, top_k = 1 and a slotted input) and ``grouped`` (the
map dispatch and caller-owned DenseMatmulIdScratch of dense_matmul_id's grouped_prefill, then a
grouped dispatch; top_k <= n_experts). Both routes share one numerical contract on a backend:
exact dequantisation and F32 accumulation in a fixed order, so they agree bit for bit. The grouped
map routes every slot, so an ID repeated within a token is computed too; the NumPy front door
(routemm.matmul_id on arrays) still refuses an explicit grouped route for such IDs, while tensors
(torch.ops.routemm.quantized_matmul_id, routemm.matmul_id on PyTorch / CuPy tensors) never read
the IDs on the host and take any route for them.

``grouped_tensor_lowp`` is the grouped route's map and scratch with the multiplication on tensor
cores: block values enter as exact f16 integers, activations are rounded to f16, each block's
partial sums are scaled by its F32 scale and summed in F32. It meets a stated tolerance (1e-2
relative Frobenius error against a float64 reference, docs/numerics.md) instead of the exact
routes' bits, is taken only when named, and only backends with tensor cores (CUDA) register its
pipelines (TENSOR_PIPELINE_NAMES): elsewhere a call raises KernelNotFoundError before encoding.

``direct_int8_dot`` and ``grouped_int8_dot`` are the direct and grouped routes (their dispatches,
map, scratch and id rules) under the reduced-precision int8-dot contract of quantized_matmul_ggml's
int8-dot pipelines: each routed row's activations are rounded to int8 per 32-value block (per
256-value block for the K-quants Q4_K, Q5_K and Q6_K, as ggml's Q8_K), each block pair is an exact
integer dot product, scaled and summed in F32 in a fixed order; Q4_1, Q5_0, Q5_1 and MXFP4 refuse
these routes by name. A routed row equals that dense pipeline on its expert's matrix bit for bit,
and the two routes agree bit for bit; against the exact product they meet the bound of
docs/numerics.md. Taken only when named; only the CPU backend registers their pipelines
(INT8_DOT_PIPELINE_NAMES): elsewhere a call raises KernelNotFoundError before encoding.

GgmlRoutingPolicy.expert_q8_0_mv_nr2 (off by default) makes Q8_0's ``direct`` route run
Q8_0_NR2_PIPELINE where the backend has it (CPU, Metal; CUDA keeps its direct pipeline): the dense
``kernel_mul_mv_q8_0_f32_nr2``'s geometry and reduction order per routed row, so each routed row
equals that dense pipeline on its expert's matrix bit for bit (on the CPU both also equal the
lane-contract direct pipeline). The receipt's ``pipeline`` names the pipeline that ran.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from .. import _core
from ..core._core_api import DType, check_encoding, check_type, check_uint
from ..core._devices import _registry_for
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord
from ..core._record_checks import SchemaVersioned
from .dense_matmul_id import AUTO_GROUPED_MIN_TOKENS as _DENSE_AUTO_GROUPED_MIN_TOKENS
from .dense_matmul_id import (
    DenseMatmulIdInputLayout,
    DenseMatmulIdScratchRequirement,
    _check_shapes,
    _checked_reuse_map,
    _declarable_distinct,
    _NativeParams,
    auto_grouped,
    ids_distinct_per_token,
)
from .quantized_matmul import GgmlRoutingPolicy, GgmlType, effective_policy

SCHEMA_VERSION: int = _core.GGML_QUANTIZED_MATMUL_ID_SCHEMA_VERSION
PIPELINE_NAMES: tuple[str, ...] = _core.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES
TENSOR_PIPELINE_NAMES: tuple[str, ...] = _core.GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES
INT8_DOT_PIPELINE_NAMES: tuple[str, ...] = _core.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES
# Q8_0's direct pipeline under GgmlRoutingPolicy.expert_q8_0_mv_nr2 (CPU, Metal).
Q8_0_NR2_PIPELINE: str = _core.GGML_QUANTIZED_MATMUL_ID_Q8_0_NR2_PIPELINE
SUPPORTED_TYPES: tuple[GgmlType, ...] = tuple(
    GgmlType(name) for name in ("q4_0", "q8_0", *(f[0] for f in _core.GGML_KERNEL_FORMATS))
)


class GgmlQuantizedMatmulIdRoute(enum.Enum):
    DIRECT = "direct"  # one dispatch; IDs may repeat
    GROUPED = "grouped"  # dense_matmul_id's map + a grouped dispatch; top_k <= n_experts, caller scratch
    GROUPED_TENSOR_LOWP = "grouped_tensor_lowp"  # GROUPED on tensor cores: f16 activations, a tolerance
    DIRECT_INT8_DOT = "direct_int8_dot"  # DIRECT with int8-rounded activations (CPU): a bound
    GROUPED_INT8_DOT = "grouped_int8_dot"  # GROUPED with int8-rounded activations (CPU): a bound

    @property
    def is_grouped(self) -> bool:
        """Runs dense_matmul_id's map and needs caller-owned scratch."""
        return self not in (GgmlQuantizedMatmulIdRoute.DIRECT, GgmlQuantizedMatmulIdRoute.DIRECT_INT8_DOT)

    @property
    def is_int8_dot(self) -> bool:
        """Rounds the activations to int8 per block (the int8-dot contract, not the exact one)."""
        return self in (GgmlQuantizedMatmulIdRoute.DIRECT_INT8_DOT, GgmlQuantizedMatmulIdRoute.GROUPED_INT8_DOT)

    def pipelines(self, ggml_type: GgmlType) -> tuple[str, ...]:
        """The pipelines this route encodes for `ggml_type`, in dispatch order."""
        return tuple(_core._quantized_matmul_id_ggml_route_pipelines(GgmlType(ggml_type).value, self.value))


_U32_FIELDS = ("m", "n", "k", "top_k", "n_experts")


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdParams(_NativeParams, JsonRecord, SchemaVersioned):
    """Dimensions, block type, expert stride, input layout and the explicit route of one call.

    m = tokens (rows of ids), n = output features per expert, k = input width (a multiple of 32),
    expert_stride_bytes = bytes from one expert's first block to the next's (n * k / 32 *
    block_bytes for a packed GGUF tensor).
    """

    SCHEMA = "ggml_quantized_matmul_id_params.schema.json"
    m: int
    n: int
    k: int
    top_k: int
    n_experts: int
    ggml_type: GgmlType
    expert_stride_bytes: int
    input_layout: DenseMatmulIdInputLayout = DenseMatmulIdInputLayout.SHARED_PER_TOKEN
    route: GgmlQuantizedMatmulIdRoute = GgmlQuantizedMatmulIdRoute.DIRECT
    schema_version: int = SCHEMA_VERSION

    def _native(self) -> _core._GgmlQuantizedMatmulIdParams:
        op = "quantized_matmul_id_ggml"
        m, n, k, top_k, n_experts = (check_uint(op, name, getattr(self, name)) for name in _U32_FIELDS)
        stride = check_uint(op, "expert_stride_bytes", self.expert_stride_bytes, 64)
        try:
            ggml_type = GgmlType(self.ggml_type)
            layout = DenseMatmulIdInputLayout(self.input_layout)
            route = GgmlQuantizedMatmulIdRoute(self.route)
        except ValueError as error:
            raise InvalidArgumentError(f"quantized_matmul_id_ggml {error}") from None
        return _core._GgmlQuantizedMatmulIdParams(
            m,
            n,
            k,
            top_k,
            n_experts,
            ggml_type.value,
            stride,
            layout.value,
            route.value,
        )


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdCapability(JsonRecord, SchemaVersioned):
    """Exact byte extents of one call (and the grouped route's scratch requirement)."""

    SCHEMA = "ggml_quantized_matmul_id_capability.schema.json"
    ggml_type: GgmlType
    route: GgmlQuantizedMatmulIdRoute
    required_weight_bytes: int
    required_input_bytes: int
    required_ids_bytes: int
    required_output_bytes: int
    scratch: DenseMatmulIdScratchRequirement | None
    schema_version: int = SCHEMA_VERSION


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdDispatchReceipt(JsonRecord, SchemaVersioned):
    """What one call encoded: block type, route, number of dispatches (1 direct, 2 for the
    grouped routes, 1 for a grouped route with a reused routing map) and the pipeline of the
    product dispatch (the route's direct or grouped pipeline; Q8_0_NR2_PIPELINE for a Q8_0 direct
    call under expert_q8_0_mv_nr2 where the backend has it)."""

    SCHEMA = "ggml_quantized_matmul_id_dispatch_receipt.schema.json"
    ggml_type: GgmlType
    route: GgmlQuantizedMatmulIdRoute
    dispatch_count: int
    pipeline: str
    schema_version: int = SCHEMA_VERSION


def quantized_matmul_id_ggml_capability(params: GgmlQuantizedMatmulIdParams) -> GgmlQuantizedMatmulIdCapability:
    """Exact byte extents for `params`; raises InvalidArgumentError. Checked arithmetic, no
    allocation and no pipeline compilation."""
    params = check_type("quantized_matmul_id_ggml", "params", params, GgmlQuantizedMatmulIdParams)
    return GgmlQuantizedMatmulIdCapability.from_dict(_core._quantized_matmul_id_ggml_capability(params._native_params))


_RECEIPTS: dict[tuple[str, str, int, str], GgmlQuantizedMatmulIdDispatchReceipt] = {}


def quantized_matmul_id_ggml(
    encoder,
    registry,
    input,
    weights,
    ids,
    output,
    scratch,
    params: GgmlQuantizedMatmulIdParams,
    *,
    reuse_map: bool = False,
    routing: GgmlRoutingPolicy | None = None,
) -> GgmlQuantizedMatmulIdDispatchReceipt:
    """Encode one quantised expert-ID matmul into `encoder` (run it with commit_and_wait()).

    input: F32 [m, k] (shared) or [m * top_k, k] (slotted); weights: U8 expert stack; ids: U32
    [m, top_k]; output: F32 [m * top_k, n]; scratch: a DenseMatmulIdScratch for the grouped routes,
    None for direct. reuse_map (grouped routes): read the routing map that the last building call
    into `scratch` (this op's or dense_matmul_id's) encoded instead of building one, as
    dense_matmul_id's reuse_map. routing: the GgmlRoutingPolicy whose expert_q8_0_mv_nr2 picks
    Q8_0's direct pipeline (None: the policy frozen into `registry`, else
    GgmlRoutingPolicy.from_environment()). Every validation happens before anything is encoded;
    on error the encoder is untouched.
    """
    op = "quantized_matmul_id_ggml"
    check_encoding(op, encoder, registry, ("input", "weights", "ids", "output"), input, weights, ids, output)
    check_type(op, "scratch", scratch, _core.DenseMatmulIdScratch, optional=True)
    check_type(op, "params", params, GgmlQuantizedMatmulIdParams)
    policy = effective_policy(registry, routing, op)
    native = _core._quantized_matmul_id_ggml(
        encoder, registry, input, weights, ids, output, scratch, params._native_params,
        _checked_reuse_map("quantized_matmul_id_ggml", reuse_map), bool(policy.expert_q8_0_mv_nr2),
    )  # fmt: skip
    return _receipt_of(native)


def _receipt_of(native: tuple[str, str, int, str]) -> GgmlQuantizedMatmulIdDispatchReceipt:
    """The receipt of a native (ggml_type, route, dispatch_count, pipeline) tuple, made once per
    value."""
    receipt = _RECEIPTS.get(native)
    if receipt is None:
        ggml_type, route, count, pipeline = native
        receipt = _RECEIPTS.setdefault(
            native,
            GgmlQuantizedMatmulIdDispatchReceipt(
                GgmlType(ggml_type), GgmlQuantizedMatmulIdRoute(route), count, pipeline
            ),
        )
    return receipt


# ---- High level (routemm.matmul_id(..., ggml_type=...)) -----------------------------------------

# The automatic choice takes the grouped route from this many tokens on when IDs are distinct per
# token (on CUDA only at 256 routed rows per expert and more: dense_matmul_id.auto_grouped), one
# value for the dense and quantised ops (kept in the core).
AUTO_GROUPED_MIN_TOKENS = _DENSE_AUTO_GROUPED_MIN_TOKENS


def _element_width(w_shape, ggml_type: GgmlType) -> int:
    """k of a [E, n, k / 32 * block_bytes] uint8 block stack."""
    values, block_bytes = ggml_type.block_layout
    if len(w_shape) != 3 or int(w_shape[2]) % block_bytes != 0:
        raise InvalidArgumentError(
            f"matmul_id {ggml_type.value} weights must be uint8 [n_experts, n, k / {values} * {block_bytes}], "
            f"got shape {tuple(w_shape)}"
        )
    return int(w_shape[2]) // block_bytes * values


def _quantized_route(route, distinct: bool, m: int, device, top_k: int, n_experts: int) -> GgmlQuantizedMatmulIdRoute:
    """`route` parsed, or with None the automatic choice (dense_matmul_id.auto_grouped for block
    stacks) when the ids are distinct per token, else direct."""
    if route is None:
        grouped = distinct and auto_grouped(device, m, top_k, n_experts, quantized=True)
        return GgmlQuantizedMatmulIdRoute.GROUPED if grouped else GgmlQuantizedMatmulIdRoute.DIRECT
    try:
        return GgmlQuantizedMatmulIdRoute(route if not isinstance(route, enum.Enum) else route.value)
    except ValueError:
        raise InvalidArgumentError(
            "matmul_id with ggml_type takes route "
            + ", ".join(repr(r.value) for r in GgmlQuantizedMatmulIdRoute)
            + f" (GgmlQuantizedMatmulIdRoute), got {route!r}"
        ) from None


def _supported_type(ggml_type) -> GgmlType:
    """matmul_id's ggml_type as a GgmlType of the block stacks it runs (SUPPORTED_TYPES)."""
    ggml_type = GgmlType(ggml_type)
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(t.value for t in SUPPORTED_TYPES)
        raise InvalidArgumentError(f"matmul_id does not support {ggml_type.value} weights (supported: {supported})")
    return ggml_type


def _matmul_id_numpy(weights, x, ids, ggml_type: GgmlType, route, out, device):
    """routemm.matmul_id on NumPy arrays with a uint8 block stack of `ggml_type` (a supported
    GgmlType), on `device` (a routemm.Device); returns (result, receipt)."""
    weights, x, ids = np.asarray(weights), np.asarray(x), np.asarray(ids)
    if weights.dtype != np.uint8:
        raise InvalidArgumentError(f"matmul_id {ggml_type.value} weights must be uint8 blocks, got {weights.dtype}")
    k = _element_width(weights.shape, ggml_type)
    m, top_k, n_experts, n, _, layout = _check_shapes((*weights.shape[:2], k), x.shape, ids.shape)
    if x.dtype != np.float32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(f"matmul_id ids must be integers, got {ids.dtype}")
    stride = weights.shape[1] * weights.shape[2]
    # The extents every route shares, from the shapes alone: nothing is copied before them.
    direct = GgmlQuantizedMatmulIdRoute.DIRECT
    quantized_matmul_id_ggml_capability(_quantized_params(m, n, k, top_k, n_experts, ggml_type, stride, layout, direct))
    ids64 = ids.astype(np.int64, copy=False)
    ids_u32 = np.where((ids64 >= 0) & (ids64 < n_experts), ids64, 0xFFFFFFFF).astype(np.uint32)
    distinct = _declarable_distinct(ids_distinct_per_token(ids64, n_experts), top_k, n_experts)
    route = _quantized_route(route, distinct, m, device, top_k, n_experts)
    if route.is_grouped and not distinct:
        raise InvalidArgumentError("matmul_id grouped route needs ids distinct per token")
    if out is not None and not (
        isinstance(out, np.ndarray)
        and out.dtype == np.float32
        and out.shape == (m * top_k, n)
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        raise InvalidArgumentError(
            f"matmul_id out must be a writable C-contiguous float32 array of shape {(m * top_k, n)}"
        )
    params = _quantized_params(m, n, k, top_k, n_experts, ggml_type, stride, layout, route)
    quantized_matmul_id_ggml_capability(params)  # the route's own rules, before allocating anything
    out_buf = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
    w_buf = device.from_numpy(np.ascontiguousarray(weights))
    receipt = _run_quantized(
        device,
        _registry_for(device),
        params,
        w_buf,
        device.from_numpy(np.ascontiguousarray(x)),
        device.from_numpy(ids_u32),
        out_buf,
    )
    result = out_buf.numpy()
    if out is not None:
        out[...] = result
        return out, receipt
    return result, receipt


def _quantized_params(m, n, k, top_k, n_experts, ggml_type, stride, layout, route) -> GgmlQuantizedMatmulIdParams:
    return GgmlQuantizedMatmulIdParams(
        m=m,
        n=n,
        k=k,
        top_k=top_k,
        n_experts=n_experts,
        ggml_type=ggml_type,
        expert_stride_bytes=int(stride),
        input_layout=layout,
        route=route,
    )


def _run_quantized(device, registry, params, w_buf, x_buf, id_buf, out_buf) -> GgmlQuantizedMatmulIdDispatchReceipt:
    scratch = _core.DenseMatmulIdScratch(device, params.n_experts, params.m) if params.route.is_grouped else None
    encoder = device.command_encoder()
    receipt = quantized_matmul_id_ggml(encoder, registry, x_buf, w_buf, id_buf, out_buf, scratch, params)
    encoder.commit_and_wait()
    return receipt
