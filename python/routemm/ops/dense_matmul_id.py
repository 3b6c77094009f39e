"""Expert-ID matmul: params, capability, scratch, the explicit front door and `matmul_id`.

    out[t*top_k + s, :] = W[ids[t, s]] @ x[row]        (row = t, or t*top_k + s when slotted)

Weights are a stack of row-major [n, k] matrices (F32, F16 or BF16) with an explicit byte stride
between experts; activations and output are F32; IDs are U32 and an ID >= n_experts gives an
all-zero output row.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Optional

import numpy as np

from .. import _core
from ..core._core_api import DType, check_encoding, check_type, check_uint, dtype_of
from ..core._devices import _registry_for, _resolve_device
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord, dtype_from_name
from ..core._record_checks import SchemaVersioned
from .quantized_matmul import GgmlRoutingPolicy, ggml_routing_policy

SCHEMA_VERSION: int = _core.DENSE_MATMUL_ID_SCHEMA_VERSION
PIPELINE_NAMES: tuple[str, ...] = _core.DENSE_MATMUL_ID_PIPELINE_NAMES
TENSOR_PIPELINE_NAMES: tuple[str, ...] = _core.DENSE_MATMUL_ID_TENSOR_PIPELINE_NAMES
# The reduced-precision CPU routes' pipelines (direct_bf16_dot, grouped_bf16_dot): registered only
# by a CPU backend whose processor has AVX512_BF16.
BF16_DOT_PIPELINE_NAMES: tuple[str, ...] = _core.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES
DenseMatmulIdScratch = _core.DenseMatmulIdScratch

# From this many tokens on, `matmul_id` prefers grouped_prefill when IDs are distinct per token
# (the core's shape-only rule of the tensor ops uses the same bound).
AUTO_GROUPED_MIN_TOKENS = _core.DENSE_MATMUL_ID_AUTO_GROUPED_MIN_TOKENS


class DenseMatmulIdInputLayout(enum.Enum):
    SHARED_PER_TOKEN = "shared_per_token"  # one [k] row per token, shared by its top_k slots
    SLOTTED = "slotted"  # one [k] row per (token, slot)


class DenseMatmulIdMultiplicity(enum.Enum):
    # Caller declaration: no ID repeats within a token (so top_k <= n_experts). The grouped routes
    # need it (it sizes their scratch), yet their map routes every slot: a repeat still gets its row.
    DISTINCT_PER_TOKEN = "distinct_per_token"
    MAY_REPEAT = "may_repeat"


class DenseMatmulIdRoute(enum.Enum):
    DIRECT = "direct"  # one dispatch; IDs may repeat
    GROUPED_PREFILL = "grouped_prefill"  # map + grouped dispatch; declared distinct IDs, caller scratch
    # Tensor-core variants of grouped_prefill (same map, scratch and receipts); explicit opt-in,
    # with a stated tolerance instead of bit identity. Only backends with tensor cores have them.
    GROUPED_TENSOR_TF32 = "grouped_tensor_tf32"  # operands rounded to tf32, F32 accumulation
    GROUPED_TENSOR_LOWP = "grouped_tensor_lowp"  # activations rounded to the f16/bf16 weight dtype
    # Reduced-precision CPU routes for bf16 weights (explicit opt-in, stated tolerance): activations
    # rounded to bf16, AVX512_BF16 dot products accumulated in F32. Shaped as direct / grouped_prefill
    # and bit-identical to each other; only CPUs with AVX512_BF16 have them.
    DIRECT_BF16_DOT = "direct_bf16_dot"
    GROUPED_BF16_DOT = "grouped_bf16_dot"

    @property
    def is_grouped(self) -> bool:
        return self not in (DenseMatmulIdRoute.DIRECT, DenseMatmulIdRoute.DIRECT_BF16_DOT)


class _NativeParams:
    """The one mechanism of the params records the native core checks: a subclass's `_native()`
    builds its native params, raising InvalidArgumentError for a bad field. The fields are checked
    at construction, and the native params built once per (immutable) instance, at the first call."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # Built and dropped: the cached property stays empty until the first call, so the instance's
        # __dict__ holds its fields only (type(p)(**p.__dict__) rebuilds it).
        self._native()

    @functools.cached_property
    def _native_params(self):
        return self._native()


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdParams(_NativeParams, JsonRecord, SchemaVersioned):
    """Dimensions, the expert stride and the explicit route of one expert-ID product."""

    SCHEMA = "dense_matmul_id_params.schema.json"
    m: int
    n: int
    k: int
    top_k: int
    n_experts: int
    expert_stride_bytes: int
    input_layout: DenseMatmulIdInputLayout = DenseMatmulIdInputLayout.SHARED_PER_TOKEN
    id_multiplicity: DenseMatmulIdMultiplicity = DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN
    route: DenseMatmulIdRoute = DenseMatmulIdRoute.DIRECT
    schema_version: int = SCHEMA_VERSION

    def _native(self) -> _core._DenseMatmulIdParams:
        op = "dense_matmul_id"
        return _core._DenseMatmulIdParams(
            *(check_uint(op, name, getattr(self, name)) for name in ("m", "n", "k", "top_k", "n_experts")),
            check_uint(op, "expert_stride_bytes", self.expert_stride_bytes, 64),
            _enum_value(DenseMatmulIdInputLayout, self.input_layout, "input_layout"),
            _enum_value(DenseMatmulIdMultiplicity, self.id_multiplicity, "id_multiplicity"),
            _enum_value(DenseMatmulIdRoute, self.route, "route"),
        )


def _enum_value(kind: type[enum.Enum], value, name: str) -> str:
    """The string value of `value` as a member of `kind` (a member or its value)."""
    try:
        return kind(value).value
    except (ValueError, TypeError):
        choices = ", ".join(repr(m.value) for m in kind)
        raise InvalidArgumentError(f"dense_matmul_id {name} must be one of {choices}, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdScratchRequirement(JsonRecord):
    SCHEMA = "dense_matmul_id_capability.schema.json"
    expert_counts_bytes: int
    routed_rows_bytes: int


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdCapability(JsonRecord, SchemaVersioned):
    """Exact byte extents of one call (and the grouped route's scratch requirement)."""

    SCHEMA = "dense_matmul_id_capability.schema.json"
    weight_dtype: DType
    route: DenseMatmulIdRoute
    required_weight_bytes: int
    required_input_bytes: int
    required_ids_bytes: int
    required_output_bytes: int
    scratch: Optional[DenseMatmulIdScratchRequirement]
    schema_version: int = SCHEMA_VERSION


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdDispatchReceipt(JsonRecord, SchemaVersioned):
    """What one call encoded: weight dtype, route and number of dispatches (1 direct, 2 grouped, 1
    grouped with a reused routing map)."""

    SCHEMA = "dense_matmul_id_dispatch_receipt.schema.json"
    weight_dtype: DType
    route: DenseMatmulIdRoute
    dispatch_count: int
    schema_version: int = SCHEMA_VERSION


def _capability_from_native(d: dict) -> DenseMatmulIdCapability:
    return DenseMatmulIdCapability.from_dict(d)


def dense_matmul_id_capability(weight_dtype: DType, params: DenseMatmulIdParams) -> DenseMatmulIdCapability:
    """Exact byte extents for `params` with `weight_dtype` weights; raises InvalidArgumentError.

    Checked arithmetic, no allocation and no pipeline compilation.
    """
    check_type("dense_matmul_id", "weight_dtype", weight_dtype, DType)
    return _capability_from_native(_core._dense_matmul_id_capability(weight_dtype, _checked_params(params)))


def _checked_params(params) -> _core._DenseMatmulIdParams:
    return check_type("dense_matmul_id", "params", params, DenseMatmulIdParams)._native_params


def dense_matmul_id(
    encoder,
    registry,
    weights,
    input,
    expert_ids,
    output,
    scratch,
    params: DenseMatmulIdParams,
    *,
    reuse_map: bool = False,
) -> DenseMatmulIdDispatchReceipt:
    """Encode one expert-ID matmul into `encoder` (run it with encoder.commit_and_wait()).

    Every validation happens before anything is encoded; on error the encoder is untouched.
    `scratch` is a DenseMatmulIdScratch for grouped_prefill and may be None for direct.
    reuse_map (grouped routes): a routing map (the scratch's expert counts and routed rows)
    depends only on the ids and on m, top_k and n_experts, so grouped calls over the same ids --
    of any n, k and input layout, dense or quantised -- can share one: the first call builds it,
    the later ones pass reuse_map=True and encode their grouped dispatch alone (receipt
    dispatch_count 1). A reusing call must name the same ids buffer view with the same m, top_k
    and n_experts as the last building call into its scratch (checked), and the ids and scratch
    must stay unchanged in between. The map is also what zeroes the output rows of invalid ids, so
    a reusing call leaves those rows of its output unwritten.
    """
    check_encoding("dense_matmul_id", encoder, registry, _BUFFER_NAMES, weights, input, expert_ids, output)
    check_type("dense_matmul_id", "scratch", scratch, DenseMatmulIdScratch, optional=True)
    native = _core._dense_matmul_id(
        encoder, registry, weights, input, expert_ids, output, scratch, _checked_params(params),
        _checked_reuse_map("dense_matmul_id", reuse_map),
    )  # fmt: skip
    return _receipt_of(native)


_BUFFER_NAMES = ("weights", "input", "expert_ids", "output")


def _receipt_of(native: tuple[str, str, int]) -> DenseMatmulIdDispatchReceipt:
    """The receipt of a native result tuple (weight dtype name, route value, dispatch count).

    Receipts are immutable and few distinct ones exist: one cached instance per native result keeps
    the per-call hot path free of enum and dataclass construction."""
    receipt = _DISPATCH_RECEIPTS.get(native)
    if receipt is None:
        dtype_name, route, count = native
        receipt = _DISPATCH_RECEIPTS.setdefault(
            native, DenseMatmulIdDispatchReceipt(dtype_from_name(dtype_name), DenseMatmulIdRoute(route), count)
        )
    return receipt


_DISPATCH_RECEIPTS: dict[tuple[str, str, int], DenseMatmulIdDispatchReceipt] = {}


def _checked_reuse_map(op: str, reuse_map) -> bool:
    """The reuse_map flag of the expert-ID front doors (see dense_matmul_id), checked to be a bool."""
    if type(reuse_map) is not bool:
        raise InvalidArgumentError(f"{op} reuse_map must be a bool, got {reuse_map!r}")
    return reuse_map


# ---- High level (the NumPy half of routemm.matmul_id, whose front door is ops/matmul_id.py) -----


def ids_distinct_per_token(ids: np.ndarray, n_experts: Optional[int] = None) -> bool:
    """True when no row of the [m, top_k] id matrix repeats a valid id.

    With `n_experts`, ids outside [0, n_experts) never count as repeats: they match no expert and
    give zero rows on every route.
    """
    ids = np.asarray(ids).astype(np.int64)
    if ids.ndim != 2 or ids.shape[1] <= 1:
        return True
    if n_experts is not None:
        invalid = (ids < 0) | (ids >= n_experts)
        ids = np.where(invalid, -1 - np.arange(ids.shape[1]), ids)  # a distinct sentinel per slot
    s = np.sort(ids, axis=1)
    return not bool(np.any(s[:, 1:] == s[:, :-1]))


def _framework(obj) -> str:
    module = type(obj).__module__.split(".")[0]
    return module if module in ("torch", "cupy") else "numpy"


def _matmul_id_numpy(weights, x, ids, route, out, device):
    """routemm.matmul_id on NumPy arrays: copied to `device` (None, a routemm.Device or a backend
    name), run there, and the result copied back as a NumPy array; returns (result, receipt)."""
    weights = np.asarray(weights)
    x = np.asarray(x)
    ids = np.asarray(ids)
    m, top_k, n_experts, n, k, layout = _check_shapes(weights.shape, x.shape, ids.shape)
    if x.dtype != np.float32:
        raise InvalidArgumentError(f"matmul_id activations must be float32, got {x.dtype}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(f"matmul_id ids must be integers, got {ids.dtype}")
    wdtype = dtype_of(weights.dtype)
    # The extents every route shares, from the shapes alone: nothing is copied before them (a
    # zero-stride array of 2^33 tokens is refused here, not after a 128 GiB copy of its ids).
    dense_matmul_id_capability(
        wdtype, _params(m, n, k, top_k, n_experts, wdtype, layout, False, DenseMatmulIdRoute.DIRECT)
    )
    # Anything outside [0, n_experts) is an invalid id: map it to 0xFFFFFFFF (a zero row).
    ids64 = ids.astype(np.int64, copy=False)
    ids_u32 = np.where((ids64 >= 0) & (ids64 < n_experts), ids64, 0xFFFFFFFF).astype(np.uint32)
    distinct = _declarable_distinct(ids_distinct_per_token(ids64, n_experts), top_k, n_experts)
    device = _resolve_device(device)
    route = _pick_route(route, distinct, m, device, top_k, n_experts)
    if out is not None:
        if not (
            isinstance(out, np.ndarray)
            and out.dtype == np.float32
            and out.shape == (m * top_k, n)
            and out.flags.c_contiguous
            and out.flags.writeable
        ):
            raise InvalidArgumentError(
                f"matmul_id out must be a writable C-contiguous float32 array of shape {(m * top_k, n)}"
            )
    params = _params(m, n, k, top_k, n_experts, wdtype, layout, distinct, route)
    dense_matmul_id_capability(wdtype, params)  # the route's own rules, before allocating anything
    out_buf = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
    receipt = _run(
        device, params, device.from_numpy(weights), device.from_numpy(x), device.from_numpy(ids_u32), out_buf
    )
    result = out_buf.numpy()
    if out is not None:
        out[...] = result
        result = out
    return result, receipt


def _check_shapes(w_shape, x_shape, ids_shape):
    """(m, top_k, n_experts, n, k, layout) of a call's shapes; the checks and their messages are the
    core's, shared with the tensor ops' kernels."""
    m, top_k, n_experts, n, k, slotted = _core._matmul_id_shapes(
        [int(d) for d in w_shape], [int(d) for d in x_shape], [int(d) for d in ids_shape]
    )
    layout = DenseMatmulIdInputLayout.SLOTTED if slotted else DenseMatmulIdInputLayout.SHARED_PER_TOKEN
    return m, top_k, n_experts, n, k, layout


def _declarable_distinct(distinct: bool, top_k: int, n_experts: int) -> bool:
    """Whether a call may declare DISTINCT_PER_TOKEN: its valid ids are distinct per token and
    top_k <= n_experts (the capability's rule). With more slots than experts the valid ids can
    still be distinct (the rest out of range); such a call is declared MAY_REPEAT instead."""
    return distinct and top_k <= n_experts


def auto_grouped(
    device, m: int, top_k: int, n_experts: int, *, quantized: bool = False, mm_threshold: Optional[int] = None
) -> bool:
    """Whether the automatic expert-ID route (no route given) is the exact grouped one for these
    shapes on `device` (a routemm.Device or a backend name), for ids that may be declared distinct
    per token: for more than `mm_threshold` tokens (GgmlRoutingPolicy.expert_mm_threshold; None
    takes the policy frozen into the device's registry, else the environment's, so 8 by default);
    on CUDA also only from 8 routed rows per expert on average (256 for GGML block stacks), where
    grouping pays there. The core's rule (routemm::expert_id_auto_grouped), the one the tensor and
    torch ops use (they read the threshold from the environment once)."""
    backend = device if isinstance(device, str) else device.backend
    if mm_threshold is None:
        # The rule is pure: a backend this build lacks still has one, under the environment's policy.
        available = not isinstance(device, str) or device in _core.available_backends()
        registry = _registry_for(_resolve_device(device, "auto_grouped")) if available else None
        frozen = ggml_routing_policy(registry) if registry is not None else None
        mm_threshold = (frozen or GgmlRoutingPolicy.from_environment()).expert_mm_threshold
    threshold = check_uint("auto_grouped", "mm_threshold", mm_threshold)
    return _core._expert_id_auto_grouped(backend, int(m), int(top_k), int(n_experts), bool(quantized), threshold)


def _pick_route(
    route, distinct: bool, m: int, device=None, top_k: int = 0, n_experts: int = 0, *, quantized: bool = False
) -> DenseMatmulIdRoute:
    """The route to run: `route` parsed, or with None the automatic choice (auto_grouped) when the
    ids are distinct per token, else direct."""
    if route is None:
        grouped = distinct and auto_grouped(device, m, top_k, n_experts, quantized=quantized)
        return DenseMatmulIdRoute.GROUPED_PREFILL if grouped else DenseMatmulIdRoute.DIRECT
    return DenseMatmulIdRoute(_enum_value(DenseMatmulIdRoute, route, "route"))


def _params(m, n, k, top_k, n_experts, wdtype, layout, distinct, route) -> DenseMatmulIdParams:
    return DenseMatmulIdParams(
        m=m,
        n=n,
        k=k,
        top_k=top_k,
        n_experts=n_experts,
        expert_stride_bytes=n * k * wdtype.size,
        input_layout=layout,
        id_multiplicity=(
            DenseMatmulIdMultiplicity.DISTINCT_PER_TOKEN if distinct else DenseMatmulIdMultiplicity.MAY_REPEAT
        ),
        route=route,
    )


def _run(device, params, w_buf, x_buf, id_buf, out_buf) -> DenseMatmulIdDispatchReceipt:
    scratch = DenseMatmulIdScratch(device, params.n_experts, params.m) if params.route.is_grouped else None
    encoder = device.command_encoder()
    receipt = dense_matmul_id(encoder, _registry_for(device), w_buf, x_buf, id_buf, out_buf, scratch, params)
    encoder.commit_and_wait()
    return receipt
