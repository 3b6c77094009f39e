"""Frozen, device-calibrated route plans for the quantised expert-ID matmul (quantized_matmul_id_ggml).

At activation a caller declares every exact call shape (GgmlQuantizedMatmulIdCalibrationCase: a
Q4_0 / Q8_0 expert stack buffer + params; params.route is ignored). For each shape the candidates
-- grouped and, where the backend registers it, grouped_tensor_lowp -- are proved against direct
on two routing profiles and timed, exactly as the dense expert-ID plan does (_expert_id_plan: the
same proof pool, poisoned outputs and guards, submission accounting, selection, plan id and
authority digest). A candidate is selected only if it is coherent on both profiles and wins both.

Routing profiles: balanced ((token + slot) mod E, with the last slot of every odd token set to the
out-of-range id E) and maximally skewed (every token on experts 0..top_k-1). The out-of-range ids
prove that a candidate writes the zero rows direct writes for them. A shape with top_k > n_experts
has no grouped candidate (the grouped routes need distinct ids per token) and keeps direct.

Coherence, per candidate:
* grouped on CPU and CUDA: bit-identical to direct (both sum in the same order);
* grouped on Metal (and its model, metal_emu): the simdgroup-matrix order is unspecified, so every
  element must lie within the F32 accumulation bound of direct's, computed on the host from the
  dequantised weights (`_pairwise_bound`, docs/numerics.md); the proof records the bound's relative
  Frobenius size as its tolerance;
* grouped_tensor_lowp: relative Frobenius error <= 1e-2, as the dense tensor-core candidates.

The plan is frozen into the registry (one-shot; the pipelines it depends on are protected) and
quantized_matmul_id_ggml_auto dispatches by it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _core
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord
from ..formats import q4_0, q8_0
from ..ops.dense_matmul_id import DenseMatmulIdInputLayout
from ..ops.quantized_matmul import GgmlType
from ..ops.quantized_matmul_id import (
    PIPELINE_NAMES,
    SCHEMA_VERSION,
    TENSOR_PIPELINE_NAMES,
    GgmlQuantizedMatmulIdDispatchReceipt,
    GgmlQuantizedMatmulIdParams,
    GgmlQuantizedMatmulIdRoute,
    quantized_matmul_id_ggml,
    quantized_matmul_id_ggml_capability,
)
from . import _expert_id_plan as ex
from . import _route_plan as rp
from . import calibration as cal
from ._expert_id_plan import DenseMatmulIdRoutingProfile

PLAN_KIND = "quantized_matmul_id"
_PLAN = "ggml_quantized_matmul_id_route_plan.schema.json"
QUANTIZED_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM = (
    "quantized_matmul_id_ggml value independence: for a fixed block type, shape, expert stride and input "
    "layout, direct and grouped dequantise every block exactly and evaluate every output element with the "
    "same F32 FMA sequence and the same fixed reduction tree on CPU and CUDA, independent of the block, "
    "activation and id values; a grouped route proved bit-identical on one weight is therefore identical on "
    "every weight of the shape. Metal's grouped route and the tensor-core route carry no such theorem and "
    "are re-proved against their bound or tolerance on every activation."
)
THEOREM_SHA256 = cal.sha256_hex(QUANTIZED_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM.encode())
LOWP_TOLERANCE = 1e-2
# Backends whose grouped route sums in an order the hardware does not specify (simdgroup matrices).
BOUNDED_GROUPED_BACKENDS = ("metal", "metal_emu")
_FORMATS = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
_U = 2.0**-24  # unit roundoff of F32
_SUBNORMAL_HALF_ULP = 2.0**-150


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdShape(ex.ExpertIdShape, JsonRecord):
    """An exact quantised expert-ID call shape: every params field but the route (the plan's key):
    the block type, the routing (m tokens, top_k of n_experts), one expert's matrix (n x k at
    expert_stride_bytes) and the input layout."""

    SCHEMA = _PLAN
    PARAMS = GgmlQuantizedMatmulIdParams
    ggml_type: GgmlType
    m: int
    top_k: int
    n_experts: int
    n: int
    k: int
    expert_stride_bytes: int
    input_layout: DenseMatmulIdInputLayout


_RECORDS = ex.ExpertIdRecords.declare(
    __name__,
    "GgmlQuantizedMatmulId",
    GgmlQuantizedMatmulIdShape,
    GgmlQuantizedMatmulIdRoute,
    GgmlQuantizedMatmulIdDispatchReceipt,
    SCHEMA_VERSION,
)
GgmlQuantizedMatmulIdRoutePlan, GgmlQuantizedMatmulIdCalibrationReceipt = _RECORDS.plan, _RECORDS.receipt
GgmlQuantizedMatmulIdCalibrationDecision, GgmlQuantizedMatmulIdCandidateProof = _RECORDS.decision, _RECORDS.proof
GgmlQuantizedMatmulIdAutoReceipt = _RECORDS.auto_receipt


def _dequantized_expert(shape, raw: np.ndarray, expert: int) -> np.ndarray:
    """Expert `expert` of the expert stack bytes `raw`, dequantised exactly (F64 [n, k])."""
    values, block_bytes = GgmlType(shape.ggml_type).block_layout
    row_bytes = shape.k // values * block_bytes
    start = expert * shape.expert_stride_bytes
    blocks = raw[start : start + shape.n * row_bytes].reshape(shape.n, row_bytes)
    return _FORMATS[GgmlType(shape.ggml_type)].dequantize(blocks, (shape.n, shape.k)).astype(np.float64)


def _pairwise_bound(shape, weight, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Element-wise bound on |grouped - direct| when both are F32 sums of the exactly dequantised
    products in orders the hardware may choose: each is within gamma(k + 2) * sum|w * x| plus the
    underflow term (k + 8) * 2^-150 of the exact value (any summation order, Higham §3.1, the two
    extra roundings covering a per-block scale), so their difference is within twice that. A row
    of an out-of-range id is exactly zero on both: bound 0. The weights are read back once and
    dequantised one routed expert at a time."""
    m, top_k = ids.shape
    depth = shape.k + 2
    gamma = depth * _U / (1 - depth * _U)
    slotted = DenseMatmulIdInputLayout(shape.input_layout) is DenseMatmulIdInputLayout.SLOTTED
    ax = np.abs(x.astype(np.float64))
    rows_x = ax if slotted else np.repeat(ax, top_k, axis=0)  # the input row of every output row
    flat = ids.reshape(-1).astype(np.int64)
    raw = np.ascontiguousarray(weight.numpy()).view(np.uint8).reshape(-1)
    bound = np.zeros((m * top_k, shape.n), np.float64)
    for expert in np.unique(flat[flat < shape.n_experts]):
        rows = np.nonzero(flat == expert)[0]
        magnitude = rows_x[rows] @ np.abs(_dequantized_expert(shape, raw, int(expert))).T
        bound[rows] = 2 * (gamma * magnitude + (shape.k + 8) * _SUBNORMAL_HALF_ULP)
    return bound


class _QuantizedMatmulIdOp(ex.ExpertIdOp):
    label = "quantized_matmul_id_ggml"
    theorem_sha256 = THEOREM_SHA256
    schema_version = SCHEMA_VERSION
    direct = GgmlQuantizedMatmulIdRoute.DIRECT
    candidates = (GgmlQuantizedMatmulIdRoute.GROUPED, GgmlQuantizedMatmulIdRoute.GROUPED_TENSOR_LOWP)
    tensor_routes = (GgmlQuantizedMatmulIdRoute.GROUPED_TENSOR_LOWP,)
    known_pipelines = PIPELINE_NAMES
    records = _RECORDS

    def checked_case(self, case) -> GgmlQuantizedMatmulIdShape:
        if not isinstance(case, GgmlQuantizedMatmulIdCalibrationCase):
            raise InvalidArgumentError(
                "quantized_matmul_id_ggml calibration cases must be GgmlQuantizedMatmulIdCalibrationCase, "
                f"got {type(case).__name__}"
            )
        if not isinstance(case.params, GgmlQuantizedMatmulIdParams):
            raise InvalidArgumentError(
                f"quantized_matmul_id_ggml calibration params must be GgmlQuantizedMatmulIdParams, "
                f"got {type(case.params).__name__}"
            )
        direct = dataclasses.replace(case.params, route=GgmlQuantizedMatmulIdRoute.DIRECT)
        cap = quantized_matmul_id_ggml_capability(direct)
        w = case.weight
        if w.dtype != _core.DType.U8 or w.nbytes < cap.required_weight_bytes:
            raise InvalidArgumentError(
                f"quantized_matmul_id_ggml calibration weight must be a U8 buffer of at least "
                f"{cap.required_weight_bytes} bytes, got {w.dtype.type_name} of {w.nbytes} bytes"
            )
        return GgmlQuantizedMatmulIdShape.from_params(direct)

    def weight_format(self, shape) -> GgmlType:
        return GgmlType(shape.ggml_type)

    def capability(self, shape, route) -> None:
        quantized_matmul_id_ggml_capability(shape.params(route))

    def route_pipelines(self, route, fmt) -> list[str]:
        return list(GgmlQuantizedMatmulIdRoute(route).pipelines(fmt))

    def encode(self, registry, encoder, shape, route, weight, inp, ids, out, scratch) -> None:
        quantized_matmul_id_ggml(encoder, registry, inp, weight, ids, out, scratch, shape.params(route))

    def ids(self, shape, profile) -> np.ndarray:
        ids = super().ids(shape, profile)
        if profile is DenseMatmulIdRoutingProfile.BALANCED:
            ids[1::2, -1] = shape.n_experts  # out of range: a zero row that reads no weight
        return ids

    def tolerance(self, device, route):
        if route is GgmlQuantizedMatmulIdRoute.GROUPED_TENSOR_LOWP:
            return LOWP_TOLERANCE
        return ex.ELEMENTWISE_BOUND if device.backend in BOUNDED_GROUPED_BACKENDS else 0.0

    def proof_bound(self, shape, weight, x, ids) -> np.ndarray:
        return _pairwise_bound(shape, weight, x, ids)


OP = _QuantizedMatmulIdOp(PLAN_KIND)


# ---- Calibration, freezing and plan files ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdCalibrationCase(ex.ExpertIdCalibrationCase):
    """A declared quantised shape: the U8 Q4_0 / Q8_0 expert stack and its GgmlQuantizedMatmulIdParams."""


@dataclasses.dataclass(frozen=True)
class GgmlQuantizedMatmulIdCalibrationLimits(ex.ExpertIdCalibrationLimits):
    """Bounds of one quantised expert-ID calibration (elapsed time, declared shapes, submissions)."""


def freeze_quantized_matmul_id_plan(
    registry, device, plan: GgmlQuantizedMatmulIdRoutePlan, *, _check_fingerprint=True
) -> None:
    """Freeze `plan` into `registry` (its own activation authority and device; one-shot, the same
    plan again is a no-op); the pipelines it depends on are protected afterwards."""
    rp.freeze(KIND, registry, device, plan, check_fingerprint=_check_fingerprint)


KIND = ex.ExpertIdKind(
    OP,
    PLAN_KIND,
    GgmlQuantizedMatmulIdCalibrationLimits,
    (*PIPELINE_NAMES, *TENSOR_PIPELINE_NAMES, "dense_matmul_id_map_distinct"),
    freeze_quantized_matmul_id_plan,
)

_core.KernelRegistry.quantized_matmul_id_plan = lambda self: rp.frozen_plan(self, PLAN_KIND)


def calibrate_quantized_matmul_id_routes(registry, device, activation_epoch, limits=None, cases=(), **options):
    """Prove, time and freeze quantised expert-ID routes for every declared exact shape; returns
    (GgmlQuantizedMatmulIdRoutePlan, GgmlQuantizedMatmulIdCalibrationReceipt), the plan frozen into
    `registry`.

    `limits` is a GgmlQuantizedMatmulIdCalibrationLimits, `cases` GgmlQuantizedMatmulIdCalibrationCase
    entries. Options: `progress(done, total, info)`, called after each exact shape, and the test
    hooks `_timer` and `_clock`. With ROUTEMM_PLAN_CACHE_DIR set, a matching saved plan is reloaded
    (candidates re-proved, timing skipped) and fresh plans are saved."""
    return rp.calibrate(KIND, registry, device, activation_epoch, limits, cases, **options)


def load_quantized_matmul_id_plan(path, registry, device, cases, **options):
    """Reload a saved quantised expert-ID plan (options: activation_epoch, limits, progress):
    validators must match, candidates are re-proved, timing is skipped. Returns (plan, receipt)."""
    return rp.load(KIND, path, registry, device, cases, **options)


# ---- Dispatch ---------------------------------------------------------------------------------------


def resolve_quantized_matmul_id_auto_route(registry, device, params: GgmlQuantizedMatmulIdParams, *, activation_epoch):
    """(route, source, epoch) from the frozen plan; read-only, no device work. A plan of another
    epoch than the caller's `activation_epoch` is refused; an undeclared m of a declared shape's
    base takes direct; any other shape is refused."""
    if not isinstance(params, GgmlQuantizedMatmulIdParams):
        raise InvalidArgumentError(
            f"quantized_matmul_id_ggml_auto params must be a GgmlQuantizedMatmulIdParams, got {type(params).__name__}"
        )
    shape = GgmlQuantizedMatmulIdShape.from_params(params)
    return ex.resolve_auto(OP, PLAN_KIND, registry, device, shape, activation_epoch)


def quantized_matmul_id_ggml_auto(
    encoder,
    registry,
    device,
    input,
    weights,
    ids,
    output,
    scratch,
    params: GgmlQuantizedMatmulIdParams,
    *,
    activation_epoch: int,
) -> GgmlQuantizedMatmulIdAutoReceipt:
    """quantized_matmul_id_ggml with the route the frozen plan chose (params.route is ignored); the
    plan must belong to the caller's `activation_epoch`. `scratch` (a DenseMatmulIdScratch) is used
    when the plan chose a grouped route and may be None when every declared shape keeps direct."""
    route, source, epoch = resolve_quantized_matmul_id_auto_route(
        registry, device, params, activation_epoch=activation_epoch
    )
    primitive = quantized_matmul_id_ggml(
        encoder,
        registry,
        input,
        weights,
        ids,
        output,
        scratch if route.is_grouped else None,
        dataclasses.replace(params, route=route),
    )
    return GgmlQuantizedMatmulIdAutoReceipt(route, source, epoch, primitive)
