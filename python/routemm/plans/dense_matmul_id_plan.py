"""Frozen, device-calibrated route plans for the expert-ID matmul (spec §7.6).

At activation a caller declares every exact call shape (DenseMatmulIdCalibrationCase: weight
buffer + params; params.route is ignored). For each shape the candidates -- grouped_prefill and,
where the backend has them, the tensor-core routes grouped_tensor_tf32 / grouped_tensor_lowp -- are
proved against direct on two routing profiles (balanced and maximally skewed ids) and timed. A
candidate is selected only if it is coherent on both profiles and wins both (material, stable, no
contrary GPU evidence; calibration.select_winner).

Coherence: grouped_prefill must be bit-identical to direct (the compare kernel's Mismatch bit).
The tensor routes have a documented tolerance instead: relative Frobenius error <= 2e-3 (tf32) or
<= 1e-2 (lowp) on both profiles. Their error is computed on the host after the proof submission
(the outputs are read back); the compare kernel still checks that direct wrote every element
finitely and that neither route touched the guard elements.

Proof and timing (spec §7.6): per routing profile, direct runs in a submission of its own and
then each candidate in one of its own, into outputs the host poisoned with POISON_BITS (a quiet NaN
no kernel produces) plus GUARD_ELEMENTS guard elements; the host then checks that direct overwrote
every logical element finitely, that no guard changed, and compares each candidate with direct.
Per fully calibrated shape with C candidates: 2 x (1 + C) proof submissions and 2 x 5 x (1 + C)
timing submissions -- with grouped_prefill alone 24, with 36 route dispatches (direct 1, grouped 2
each) -- and one cleanup submission per activation that submitted anything. A cache hit re-proves
the cached winner: 4 submissions, 6 dispatches.

The calibration itself (proof pool, calibrator, authority digest, plan id, auto resolution) is
_expert_id_plan's, shared with the quantised expert-ID kind; this module gives it the op's hooks
(_DenseMatmulIdOp) and adds the worker install and the dispatch traces.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..core._core_api import DType, EncodedKernelDispatch, PipelineIdentity
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord
from ..ops.dense_matmul_id import (
    BF16_DOT_PIPELINE_NAMES,
    PIPELINE_NAMES,
    SCHEMA_VERSION,
    TENSOR_PIPELINE_NAMES,
    DenseMatmulIdDispatchReceipt,
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    dense_matmul_id,
    dense_matmul_id_capability,
)
from . import _expert_id_plan as ex
from . import _route_plan as rp
from . import calibration as cal
from ._expert_id_plan import (  # the shared enums, re-exported here
    DenseMatmulIdDecisionSource,
    DenseMatmulIdRoutingProfile,  # noqa: F401
    DenseMatmulIdSelectionStatus,  # noqa: F401
)

PLAN_KIND = "dense_matmul_id"
_PLAN, _RECEIPT = "dense_matmul_id_route_plan.schema.json", "dense_matmul_id_calibration_receipt.schema.json"
DENSE_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM = (
    "dense_matmul_id value independence: for a fixed weight dtype, shape, expert stride, input layout and "
    "id multiplicity, direct and grouped_prefill evaluate every output element with the same widening, the "
    "same F32 FMA sequence and the same fixed reduction tree, independent of the weight, activation and id "
    "values; a route proved bit-identical on one weight is therefore identical on every weight of the shape. "
    "Tensor-core routes carry no such theorem and are re-proved against their tolerance on every activation."
)
THEOREM_SHA256 = cal.sha256_hex(DENSE_MATMUL_ID_VALUE_INDEPENDENCE_THEOREM.encode())
# Every output element and guard element is set to this before a proof submission (spec §7.6).
POISON_BITS = ex.POISON_BITS
TENSOR_TOLERANCE = {DenseMatmulIdRoute.GROUPED_TENSOR_TF32: 2e-3, DenseMatmulIdRoute.GROUPED_TENSOR_LOWP: 1e-2}


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdShape(ex.ExpertIdShape, JsonRecord):
    """An exact expert-ID call shape: the weight dtype and every params field but the route (the
    plan's key). Its base (all but m) is what an undeclared m of a declared shape falls back on."""

    SCHEMA = _PLAN
    PARAMS = DenseMatmulIdParams
    weight_dtype: DType
    m: int
    n: int
    k: int
    top_k: int
    n_experts: int
    expert_stride_bytes: int
    input_layout: DenseMatmulIdInputLayout
    id_multiplicity: DenseMatmulIdMultiplicity

    @classmethod
    def of(cls, weight_dtype, p: DenseMatmulIdParams) -> "DenseMatmulIdShape":
        return cls.from_params(p, weight_dtype=weight_dtype)


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdCalibrationCase(ex.ExpertIdCalibrationCase):
    """A declared expert-ID shape: the F32 / F16 / BF16 expert stack and its DenseMatmulIdParams."""


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdCalibrationLimits(ex.ExpertIdCalibrationLimits):
    """Bounds of one dense expert-ID calibration (elapsed time, declared shapes, submissions)."""


_RECORDS = ex.ExpertIdRecords.declare(
    __name__,
    "DenseMatmulId",
    DenseMatmulIdShape,
    DenseMatmulIdRoute,
    DenseMatmulIdDispatchReceipt,
    SCHEMA_VERSION,
)
DenseMatmulIdTimingDistribution = _RECORDS.timing
DenseMatmulIdRouteTiming = _RECORDS.route_timing
DenseMatmulIdCandidateProof = _RECORDS.proof
DenseMatmulIdCalibrationDecision = _RECORDS.decision
DenseMatmulIdPlanDecision = _RECORDS.plan_decision
DenseMatmulIdRoutePlan = _RECORDS.plan
DenseMatmulIdCalibrationReceipt = _RECORDS.receipt
DenseMatmulIdAutoReceipt = _RECORDS.auto_receipt


def _fail(msg):
    raise InvalidArgumentError(msg)


def _tensor_pipeline(route: DenseMatmulIdRoute, dtype: DType) -> str:
    kind = "tf32" if route is DenseMatmulIdRoute.GROUPED_TENSOR_TF32 else "lowp"
    return f"dense_matmul_id_grouped_{kind}_{dtype.type_name}_f32"


def _route_pipelines(route: DenseMatmulIdRoute, dtype: DType) -> list[str]:
    if route is DenseMatmulIdRoute.DIRECT:
        return [f"dense_matmul_id_direct_{dtype.type_name}_f32"]
    if route is DenseMatmulIdRoute.GROUPED_PREFILL:
        return ["dense_matmul_id_map_distinct", f"dense_matmul_id_grouped_{dtype.type_name}_f32"]
    if route is DenseMatmulIdRoute.DIRECT_BF16_DOT:
        return [f"dense_matmul_id_direct_bf16dot_{dtype.type_name}_f32"]
    if route is DenseMatmulIdRoute.GROUPED_BF16_DOT:
        return ["dense_matmul_id_map_distinct", f"dense_matmul_id_grouped_bf16dot_{dtype.type_name}_f32"]
    return ["dense_matmul_id_map_distinct", _tensor_pipeline(route, dtype)]


# ---- The op hooks, fingerprints, freeze --------------------------------------------------------


class _DenseMatmulIdOp(ex.ExpertIdOp):
    label = "dense_matmul_id"
    theorem_sha256 = THEOREM_SHA256
    schema_version = SCHEMA_VERSION
    direct = DenseMatmulIdRoute.DIRECT
    candidates = (DenseMatmulIdRoute.GROUPED_PREFILL, *TENSOR_TOLERANCE)
    tensor_routes = tuple(TENSOR_TOLERANCE)
    known_pipelines = PIPELINE_NAMES
    records = _RECORDS

    def checked_case(self, case) -> DenseMatmulIdShape:
        w = case.weight
        cap = dense_matmul_id_capability(w.dtype, dataclasses.replace(case.params, route=DenseMatmulIdRoute.DIRECT))
        if w.nbytes < cap.required_weight_bytes or w.byte_offset % w.dtype.size:
            _fail(
                f"dense_matmul_id calibration weight requires {cap.required_weight_bytes} aligned bytes, "
                f"got {w.nbytes} at offset {w.byte_offset}"
            )
        return DenseMatmulIdShape.of(w.dtype, case.params)

    def weight_format(self, shape):
        dtype = shape.weight_dtype
        return dtype if isinstance(dtype, DType) else DType(dtype)

    def capability(self, shape, route) -> None:
        dense_matmul_id_capability(shape.weight_dtype, shape.params(route))

    def route_pipelines(self, route, fmt) -> list[str]:
        return _route_pipelines(route, fmt)

    def encode(self, registry, encoder, shape, route, weight, inp, ids, out, scratch) -> None:
        dense_matmul_id(encoder, registry, weight, inp, ids, out, scratch, shape.params(route))

    def ids(self, shape, profile) -> np.ndarray:
        if shape.id_multiplicity is DenseMatmulIdMultiplicity.MAY_REPEAT:
            t = np.arange(shape.m, dtype=np.int64)[:, None]
            return np.ascontiguousarray(np.broadcast_to(t % shape.n_experts, (shape.m, shape.top_k)), np.uint32)
        return super().ids(shape, profile)

    def tolerance(self, device, route) -> float:
        return TENSOR_TOLERANCE.get(route, 0.0)


OP = _DenseMatmulIdOp(PLAN_KIND)


KIND = ex.ExpertIdKind(
    OP,
    PLAN_KIND,
    DenseMatmulIdCalibrationLimits,
    (*PIPELINE_NAMES, *TENSOR_PIPELINE_NAMES, *BF16_DOT_PIPELINE_NAMES),
    lambda *args, **kw: freeze_dense_matmul_id_plan(*args, **kw),
)


def freeze_dense_matmul_id_plan(registry, device, plan: DenseMatmulIdRoutePlan, *, _check_fingerprint=True) -> None:
    if rp.installed_for_worker(registry, KIND, plan):
        return  # already installed on this worker by freeze_dense_matmul_id_plan_for_cases
    rp.freeze(KIND, registry, device, plan, check_fingerprint=_check_fingerprint)


def _key_text(keys, limit: int = 3) -> str:
    keys = sorted(keys)
    text = ", ".join(str(k) for k in keys[:limit])
    return text + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def freeze_dense_matmul_id_plan_for_cases(
    worker_registry,
    device,
    plan: DenseMatmulIdRoutePlan,
    cases: Sequence[DenseMatmulIdCalibrationCase],
    *,
    activation_epoch: Optional[int] = None,
) -> None:
    """Install a plan calibrated on a primary registry into a worker registry (spec §7.6, Dispatch).

    Plans are bound to the registry activation authority that calibrated them, and
    freeze_dense_matmul_id_plan refuses any other registry. This is the one documented exception: a
    worker registry (another KernelRegistry of the same device, e.g. one per serving thread) may
    carry the primary's plan without re-calibrating, but only for the same activation:

    * device: the worker registry and `device` are the plan's device (same name and registry id);
    * epoch: the plan's activation epoch is the one its primary activation recorded and, when
      `activation_epoch` is given, the worker's epoch;
    * case union: `cases` declare exactly the set of shapes the plan holds (no missing, no extra);
    * authority digest: recomputed from `cases` exactly as calibration computes it (epoch, device,
      every shape with its sorted logical weight identities), it equals the primary's -- the worker
      borrows the very same weight buffers the candidates were proved on; the plan id, which hashes
      the digest, must also be reproduced;
    * pipeline identities: the build/pipeline fingerprint computed on the worker equals the plan's
      (no kernel the plan relies on was re-registered differently on the worker).

    Each mismatch raises InvalidArgumentError "dense_matmul_id worker plan <what> mismatch: ...".
    Installation is one-shot like the primary freeze: installing the same plan again (after the same
    checks) is a no-op, a different plan is refused, and a refused install freezes nothing. Once
    installed, the plan's pipelines are protected on the worker and dense_matmul_id_auto resolves
    on the worker exactly as on the primary (dispatch checks device and theorem, not the authority id).
    """
    worker_device = worker_registry.device
    if (worker_device.registry_id, worker_device.name) != (device.registry_id, device.name) or (
        plan.device_registry_id,
        plan.device_name,
    ) != (device.registry_id, device.name):
        _fail(
            f"dense_matmul_id worker plan device mismatch: plan is for {plan.device_name!r} "
            f"(id {plan.device_registry_id}), worker registry is on {worker_device.name!r} "
            f"(id {worker_device.registry_id}), device is {device.name!r} (id {device.registry_id})"
        )
    if plan.theorem_sha256 != THEOREM_SHA256:
        _fail("dense_matmul_id worker plan theorem digest mismatch")
    epoch = plan.activation_epoch
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= 0:
        _fail(f"dense_matmul_id worker plan epoch mismatch: plan epoch {epoch!r} is not a valid activation epoch")
    authority = plan.origin.authority if plan.origin is not None else None
    if authority is not None and authority.epoch != epoch:
        _fail(
            f"dense_matmul_id worker plan epoch mismatch: plan says epoch {epoch}, its activation "
            f"was epoch {authority.epoch}"
        )
    if activation_epoch is not None and activation_epoch != epoch:
        _fail(f"dense_matmul_id worker plan epoch mismatch: worker epoch {activation_epoch!r}, plan epoch {epoch}")
    existing = worker_registry.frozen_plan_id(PLAN_KIND)
    if existing is not None and existing != plan.plan_id:
        _fail(f"dense_matmul_id route plan is already frozen as {existing} on the worker registry")
    cases = list(cases)
    entries = _collect_cases(cases, None) if cases else []
    declared = {e["shape"].key for e in entries}
    planned = set(plan._lookup) if authority is None else set(authority.shape_keys)
    if declared != planned or declared != set(plan._lookup):
        missing, extra = planned - declared, declared - planned
        _fail(
            "dense_matmul_id worker plan case union mismatch: "
            + "; ".join(
                f"{label} {len(keys)} shape(s): {_key_text(keys)}"
                for label, keys in (("cases miss", missing), ("cases add", extra))
                if keys
            )
        )
    digest = _authority_digest(device, epoch, entries)
    if digest != plan.authority_digest or (authority is not None and digest != authority.digest):
        _fail(
            "dense_matmul_id worker plan authority digest mismatch: the cases borrow different weight "
            "identities (address, byte_offset, nbytes) than the activation that made the plan"
        )
    if KIND.recompute_plan_id(plan) != plan.plan_id:
        _fail("dense_matmul_id worker plan id mismatch: the plan's contents were altered after calibration")
    build_fp, _, identities, _, errors = ex.prepare(
        OP, worker_registry, ex.formats_of(OP, [d.shape for d in plan.decisions])
    )
    if build_fp != plan.build_fingerprint:
        differing = []
        if authority is not None:
            now = {ident.pipeline_label: ident.to_dict() for ident in identities.values()}
            differing = sorted(
                label
                for label in set(now) | set(authority.identities)
                if now.get(label) != authority.identities.get(label)
            )
        detail = (f": {', '.join(differing)} differ" if differing else "") + (
            f" (lookup errors: {errors})" if errors else ""
        )
        _fail(f"dense_matmul_id worker plan build/pipeline identity mismatch{detail}")
    if existing == plan.plan_id:
        return
    if plan.origin is None:
        rp.set_origin(plan, rp.Origin(device))
    rp.install(worker_registry, KIND, plan, worker=True)


_core.KernelRegistry.freeze_dense_matmul_id_plan = lambda self, device, plan: freeze_dense_matmul_id_plan(
    self, device, plan
)
_core.KernelRegistry.freeze_dense_matmul_id_plan_for_cases = lambda self, device, plan, cases, **kw: (
    freeze_dense_matmul_id_plan_for_cases(self, device, plan, cases, **kw)
)
_core.KernelRegistry.dense_matmul_id_plan = lambda self: rp.frozen_plan(self, PLAN_KIND)


# ---- Dispatch -----------------------------------------------------------------------------------


def resolve_dense_matmul_id_auto_route(
    registry, device, weight_dtype, params: DenseMatmulIdParams, *, activation_epoch: int
) -> tuple[DenseMatmulIdRoute, DenseMatmulIdDecisionSource, int]:
    """(route, source, epoch) from the frozen plan; read-only, no GPU work. `activation_epoch` is
    the epoch the caller activated with: a plan of another epoch is refused (spec §7.6), so a
    caller holding a registry of an earlier activation cannot dispatch by its plan."""
    return ex.resolve_auto(
        OP, PLAN_KIND, registry, device, DenseMatmulIdShape.of(weight_dtype, params), activation_epoch
    )


def dense_matmul_id_auto(
    encoder,
    registry,
    device,
    weights,
    input,
    expert_ids,
    output,
    scratch,
    params: DenseMatmulIdParams,
    *,
    activation_epoch: int,
) -> DenseMatmulIdAutoReceipt:
    """dense_matmul_id with the route the frozen plan chose (params.route is ignored); the plan must
    belong to the caller's `activation_epoch` (resolve_dense_matmul_id_auto_route)."""
    route, source, epoch = resolve_dense_matmul_id_auto_route(
        registry, device, weights.dtype, params, activation_epoch=activation_epoch
    )
    primitive = dense_matmul_id(
        encoder, registry, weights, input, expert_ids, output, scratch, dataclasses.replace(params, route=route)
    )
    return DenseMatmulIdAutoReceipt(route, source, epoch, primitive)


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdDispatchTrace(JsonRecord):
    """What one expert-ID call encoded, checked against the route's expected geometry (spec §7.4,
    §7.6): at most 2 dispatches. `plan_id`, `activation_epoch` and `decision_source` are set for
    an auto call and None for an explicit one; `theorem_sha256` names the value-independence
    theorem the route choice rests on."""

    SCHEMA = "dense_matmul_id_dispatch_trace.schema.json"
    routemm_version: str
    theorem_sha256: str
    plan_id: Optional[str]
    activation_epoch: Optional[int]
    decision_source: Optional[DenseMatmulIdDecisionSource]
    shape: DenseMatmulIdShape
    route: DenseMatmulIdRoute
    encoded: tuple[EncodedKernelDispatch, ...]
    pipelines: tuple[PipelineIdentity, ...]
    schema_version: int = SCHEMA_VERSION


def dense_matmul_id_expected_dispatches(registry, weight_dtype, params: DenseMatmulIdParams) -> list:
    """The dispatches a call of params.route encodes on `registry`'s backend, in order, with the
    geometry the encoder derives from the registered kernels: spec §7.4's on the CPU; on Metal
    the same but for the map (one threadgroup of 128 threads with 16400 bytes); CUDA's own tiles."""
    return [
        EncodedKernelDispatch._from_core(d)
        for d in _core._dense_matmul_id_expected_dispatches(registry, weight_dtype, params._native())
    ]


def _trace(encoder, registry, device, weights, params, run) -> tuple:
    if encoder.device_registry_id != device.registry_id:
        _fail("dense_matmul_id trace encoder/device mismatch")
    encoder.start_encoded_dispatch_receipt(2)
    try:
        result = run()
    finally:
        encoded = tuple(encoder.take_encoded_dispatch_receipt())
    route = result.route if isinstance(result, DenseMatmulIdAutoReceipt) else DenseMatmulIdRoute(params.route)
    expected = tuple(
        dense_matmul_id_expected_dispatches(registry, weights.dtype, dataclasses.replace(params, route=route))
    )
    if encoded != expected:
        _fail(
            f"dense_matmul_id {route.value} trace encoded {len(encoded)} dispatch(es) that differ from the "
            f"expected geometry: {encoded} != {expected}"
        )
    pipelines = tuple(registry.pipeline_identity(d.pipeline_label) for d in encoded)
    return result, route, encoded, pipelines


def trace_dense_matmul_id(
    encoder, registry, device, weights, input, expert_ids, output, scratch, params: DenseMatmulIdParams
) -> DenseMatmulIdDispatchTrace:
    """dense_matmul_id with its explicit route, recorded (at most 2 dispatches) and checked against
    the expected geometry; fail-closed, and refused while the encoder captures."""
    _, route, encoded, pipelines = _trace(
        encoder,
        registry,
        device,
        weights,
        params,
        lambda: dense_matmul_id(encoder, registry, weights, input, expert_ids, output, scratch, params),
    )
    return DenseMatmulIdDispatchTrace(
        _core.version(),
        THEOREM_SHA256,
        None,
        None,
        None,
        DenseMatmulIdShape.of(weights.dtype, params),
        route,
        encoded,
        pipelines,
    )


def trace_dense_matmul_id_auto(
    encoder,
    registry,
    device,
    weights,
    input,
    expert_ids,
    output,
    scratch,
    params: DenseMatmulIdParams,
    *,
    activation_epoch: int,
) -> DenseMatmulIdDispatchTrace:
    """dense_matmul_id_auto (for the caller's `activation_epoch`), recorded and checked like
    trace_dense_matmul_id; the trace carries the frozen plan's id, epoch and the decision source."""
    receipt, route, encoded, pipelines = _trace(
        encoder,
        registry,
        device,
        weights,
        params,
        lambda: dense_matmul_id_auto(
            encoder,
            registry,
            device,
            weights,
            input,
            expert_ids,
            output,
            scratch,
            params,
            activation_epoch=activation_epoch,
        ),
    )
    plan = rp.frozen_plan(registry, PLAN_KIND)
    return DenseMatmulIdDispatchTrace(
        _core.version(),
        plan.theorem_sha256,
        plan.plan_id,
        receipt.activation_epoch,
        receipt.decision_source,
        DenseMatmulIdShape.of(weights.dtype, params),
        route,
        encoded,
        pipelines,
    )


def _collect_cases(cases, max_cases: Optional[int]):
    return ex.collect_cases(OP, cases, max_cases)


def _authority_digest(device, epoch: int, entries) -> str:
    return ex.authority_digest(OP, device, epoch, entries)


def calibrate_dense_matmul_id_routes(registry, device, activation_epoch, limits=None, cases=(), **options):
    """Prove, time and freeze expert-ID routes for every declared exact shape; returns
    (DenseMatmulIdRoutePlan, DenseMatmulIdCalibrationReceipt), the plan frozen into `registry`.

    `limits` is a DenseMatmulIdCalibrationLimits, `cases` DenseMatmulIdCalibrationCase entries.
    Options: `progress(done, total, info)`, called after each exact shape, and the test hooks
    `_timer` and `_clock` (timing values, the deadline clock). With ROUTEMM_PLAN_CACHE_DIR set, a
    matching saved plan is reloaded and fresh plans are saved."""
    return rp.calibrate(KIND, registry, device, activation_epoch, limits, cases, **options)


def load_dense_matmul_id_plan(path, registry, device, cases, **options):
    """Reload a saved expert-ID plan (options: activation_epoch, limits, progress): validators must
    match, candidates are re-proved, timing is skipped. Returns (plan, receipt)."""
    return rp.load(KIND, path, registry, device, cases, **options)
