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
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Optional, Sequence

import numpy as np

from . import _core
from . import _expert_id_plan as ex
from . import _route_plan as rp
from . import calibration as cal
from ._core_api import DType, EncodedKernelDispatch, PipelineIdentity
from ._errors import Error, InvalidArgumentError
from ._expert_id_plan import DenseMatmulIdDecisionSource, DenseMatmulIdRoutingProfile, DenseMatmulIdSelectionStatus
from ._json import JsonRecord
from .dense_matmul_id import (
    BF16_DOT_PIPELINE_NAMES,
    PIPELINE_NAMES,
    SCHEMA_VERSION,
    TENSOR_PIPELINE_NAMES,
    DenseMatmulIdDispatchReceipt,
    DenseMatmulIdInputLayout,
    DenseMatmulIdMultiplicity,
    DenseMatmulIdParams,
    DenseMatmulIdRoute,
    DenseMatmulIdScratch,
    dense_matmul_id,
    dense_matmul_id_capability,
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
POISON_BITS = 0x7FC000C7
TENSOR_TOLERANCE = {DenseMatmulIdRoute.GROUPED_TENSOR_TF32: 2e-3, DenseMatmulIdRoute.GROUPED_TENSOR_LOWP: 1e-2}
_ADVERSARIAL = np.array([1.0, -0.0, 0.0078125, -3.5, 1.0009766, -0.33333334, 6.1035156e-05, 2.75], np.float32)


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdShape(JsonRecord):
    """An exact expert-ID call shape: the weight dtype and every params field but the route (the
    plan's key). Its base (all but m) is what an undeclared m of a declared shape falls back on."""

    SCHEMA = _PLAN
    weight_dtype: DType
    m: int
    n: int
    k: int
    top_k: int
    n_experts: int
    expert_stride_bytes: int
    input_layout: DenseMatmulIdInputLayout
    id_multiplicity: DenseMatmulIdMultiplicity

    @property
    def key(self) -> tuple:
        return (
            self.weight_dtype.type_name,
            self.m,
            self.n,
            self.k,
            self.top_k,
            self.n_experts,
            self.expert_stride_bytes,
            self.input_layout.value,
            self.id_multiplicity.value,
        )

    @property
    def base_key(self) -> tuple:
        return self.key[:1] + self.key[2:]

    def params(self, route: DenseMatmulIdRoute) -> DenseMatmulIdParams:
        return DenseMatmulIdParams(
            self.m,
            self.n,
            self.k,
            self.top_k,
            self.n_experts,
            self.expert_stride_bytes,
            self.input_layout,
            self.id_multiplicity,
            route,
        )

    @classmethod
    def of(cls, weight_dtype, p: DenseMatmulIdParams) -> "DenseMatmulIdShape":
        return cls(
            weight_dtype,
            p.m,
            p.n,
            p.k,
            p.top_k,
            p.n_experts,
            p.expert_stride_bytes,
            DenseMatmulIdInputLayout(p.input_layout),
            DenseMatmulIdMultiplicity(p.id_multiplicity),
        )


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdCalibrationCase:
    weight: object  # routemm.Buffer of the expert stack
    params: DenseMatmulIdParams


@dataclasses.dataclass(frozen=True)
class DenseMatmulIdCalibrationLimits:
    max_elapsed_ms: int = 15_000
    max_cases: int = 256
    max_submissions: int = 6_145


_RECORDS = ex.ExpertIdRecords.declare(
    __name__,
    "DenseMatmulId",
    DenseMatmulIdShape,
    DenseMatmulIdRoute,
    DenseMatmulIdDispatchReceipt,
    SCHEMA_VERSION,
    "dense_matmul_id_plan_auto_receipt.schema.json",
)
DenseMatmulIdTimingDistribution = _RECORDS.timing
DenseMatmulIdRouteTiming = _RECORDS.route_timing
DenseMatmulIdCandidateProof = _RECORDS.proof
DenseMatmulIdCalibrationDecision = _RECORDS.decision
DenseMatmulIdPlanDecision = _RECORDS.plan_decision
DenseMatmulIdRoutePlan = _RECORDS.plan
DenseMatmulIdCalibrationReceipt = _RECORDS.receipt
DenseMatmulIdAutoReceipt = _RECORDS.auto_receipt


@dataclasses.dataclass(frozen=True)
class _Authority:
    """What the primary activation that made a plan bound it to (kept on the plan's origin)."""

    epoch: int
    digest: str
    shape_keys: frozenset
    build_fingerprint: str
    identities: dict  # pipeline label -> identity dict


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


# ---- Preparation / fingerprints / freeze --------------------------------------------------------


def _prepare(registry, dtypes) -> tuple[str, str, dict, None, dict]:
    """(build fp, pipeline-set fp, identities by name, None, errors by pipeline name). The proof
    runs on the host, so only the route pipelines enter the fingerprint."""
    names = set()
    for dt in dtypes:
        for route in DenseMatmulIdRoute:
            for name in _route_pipelines(route, dt):
                if name in PIPELINE_NAMES or registry.has_kernel(name):
                    names.add(name)
    identities, errors = {}, {}
    for name in sorted(names):
        try:
            identities[name] = registry.get_pipeline(name).identity
        except Error as e:
            errors[name] = str(e)
    build_fp, pset = cal.build_fingerprint(
        "routemm.dense_matmul_id_plan:" + THEOREM_SHA256, SCHEMA_VERSION, identities.values()
    )
    return build_fp, pset, identities, None, errors


def _dtypes_of(plan) -> set:
    return {
        DType(d.shape.weight_dtype) if not isinstance(d.shape.weight_dtype, DType) else d.shape.weight_dtype
        for d in plan.decisions
    }


class _DenseMatmulIdKind(rp.PlanKind):
    def protected_names(self) -> list[str]:
        return [*PIPELINE_NAMES, *TENSOR_PIPELINE_NAMES, *BF16_DOT_PIPELINE_NAMES]

    def build_fingerprint(self, registry, plan) -> str:
        return _prepare(registry, _dtypes_of(plan))[0]

    def check_plan(self, plan) -> None:
        if plan.theorem_sha256 != THEOREM_SHA256:
            _fail("dense_matmul_id route plan was made under a different value-independence theorem")

    def run(self, registry, device, epoch, limits, cases, **options):
        return _run(registry, device, epoch, limits, cases, **options)

    def declared(self, registry, device, epoch, limits, cases) -> tuple:
        entries = _validate(registry, device, epoch or 1, limits or DenseMatmulIdCalibrationLimits(), cases)
        build_fp = _prepare(registry, {e["shape"].weight_dtype for e in entries})[0]
        return build_fp, [e["shape"].key for e in entries]

    def cache_key(self, registry, device, epoch, limits, cases) -> dict:
        entries = _validate(registry, device, epoch, limits or DenseMatmulIdCalibrationLimits(), cases)
        build_fp = _prepare(registry, {e["shape"].weight_dtype for e in entries})[0]
        return {"validators": cal.plan_validators(device, build_fp), "shapes": [e["shape"].to_dict() for e in entries]}

    def explained_outcome(self, d) -> dict:
        return {"route": d.selected_route, "status": d.status, "diagnostic": d.diagnostic, "timings": d.timings}

    def unexplained_outcome(self, route) -> dict:
        direct = route is DenseMatmulIdRoute.DIRECT
        status = (
            DenseMatmulIdSelectionStatus.DIRECT_FASTEST if direct else DenseMatmulIdSelectionStatus.CALIBRATED_WINNER
        )
        return {"route": route, "status": status, "timings": ()}


KIND = _DenseMatmulIdKind(
    PLAN_KIND, "dense_matmul_id", DenseMatmulIdRoutePlan, DenseMatmulIdCalibrationReceipt, DenseMatmulIdRoute
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
    reproduced = (
        _plan_id(
            plan.build_fingerprint, plan.device_registry_id, plan.registry_authority_id, epoch, digest, plan.decisions
        )
        == plan.plan_id
    )
    if (authority is not None and digest != authority.digest) or (authority is None and not reproduced):
        _fail(
            "dense_matmul_id worker plan authority digest mismatch: the cases borrow different weight "
            "identities (address, byte_offset, nbytes) than the activation that made the plan"
        )
    if not reproduced:
        _fail("dense_matmul_id worker plan id mismatch: the plan's contents were altered after calibration")
    build_fp, _, identities, _, errors = _prepare(worker_registry, _dtypes_of(plan))
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
    plan = rp.frozen_plan(registry, PLAN_KIND)
    if plan is None:
        _fail("dense_matmul_id_auto requires a frozen activation plan")
    if (
        isinstance(activation_epoch, bool)
        or not isinstance(activation_epoch, (int, np.integer))
        or activation_epoch != plan.activation_epoch
    ):
        _fail(
            f"dense_matmul_id_auto activation epoch mismatch: caller epoch {activation_epoch!r}, "
            f"frozen plan epoch {plan.activation_epoch}"
        )
    if plan.device_registry_id != device.registry_id or plan.device_name != device.name:
        _fail("dense_matmul_id_auto plan belongs to a different device")
    if plan.theorem_sha256 != THEOREM_SHA256:
        _fail("dense_matmul_id_auto plan theorem digest mismatch")
    shape = DenseMatmulIdShape.of(weight_dtype, params)
    route = plan._lookup.get(shape.key)
    if route is not None:
        return route, DenseMatmulIdDecisionSource.FROZEN_PLAN, plan.activation_epoch
    if shape.base_key in plan._bases:
        return DenseMatmulIdRoute.DIRECT, DenseMatmulIdDecisionSource.UNDECLARED_DIRECT, plan.activation_epoch
    _fail(f"dense_matmul_id_auto shape base was not admitted at activation: {shape.key}")


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
    geometry the encoder derives from the registered kernels (spec §7.4's on CPU and Metal)."""
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


# ---- Calibration --------------------------------------------------------------------------------


class _Abort(Exception):
    pass


def _ids(shape: DenseMatmulIdShape, profile: DenseMatmulIdRoutingProfile) -> np.ndarray:
    t = np.arange(shape.m, dtype=np.int64)[:, None]
    s = np.arange(shape.top_k, dtype=np.int64)[None, :]
    if shape.id_multiplicity is DenseMatmulIdMultiplicity.MAY_REPEAT:
        ids = np.broadcast_to(t % shape.n_experts, (shape.m, shape.top_k))
    elif profile is DenseMatmulIdRoutingProfile.BALANCED:
        ids = (t + s) % shape.n_experts
    else:
        ids = np.broadcast_to(s, (shape.m, shape.top_k))
    return np.ascontiguousarray(ids, dtype=np.uint32)


def _input_rows(shape: DenseMatmulIdShape) -> int:
    return shape.m * (shape.top_k if shape.input_layout is DenseMatmulIdInputLayout.SLOTTED else 1)


class _ProofPool:
    """Device buffers one calibration reuses across its shapes and profiles (a cal.ProofScratch
    holding the adversarial inputs, the control and candidate outputs, poisoned before every proof,
    and the status words, zeroed per proof), plus one grouped scratch of the largest expert and token
    counts."""

    CANDIDATES = 3  # grouped_prefill and the two tensor routes

    def __init__(self, device, shapes):
        self._device = device
        rows: dict[int, int] = {}
        guarded = experts = tokens = 1
        for shape in shapes:
            rows[shape.k] = max(rows.get(shape.k, 0), _input_rows(shape))
            guarded = max(guarded, shape.m * shape.top_k * shape.n + cal.GUARD_ELEMENTS)
            experts, tokens = max(experts, shape.n_experts), max(tokens, shape.m)
        self._proof = cal.ProofScratch(
            device,
            rows,
            1 + self.CANDIDATES,
            guarded,
            pattern=lambda count: np.resize(_ADVERSARIAL, count),
            period=len(_ADVERSARIAL),
        )
        self._capacity = (experts, tokens)
        self._scratch = None

    def input(self, rows: int, k: int):
        return self._proof.input(rows, k)

    def outputs(self, guarded: int, count: int) -> list:
        """The control output and `count` candidate outputs, `guarded` F32 elements each."""
        return self._proof.outputs(guarded)[: 1 + count]

    def statuses(self, count: int):
        return self._proof.statuses(max(1, count))

    def scratch(self) -> DenseMatmulIdScratch:
        if self._scratch is None:
            self._scratch = DenseMatmulIdScratch(self._device, *self._capacity)
        return self._scratch


class _Calibrator:
    def __init__(self, registry, device, limits, prep, deadline, timer, pinned, pool):
        self.registry, self.device, self.limits = registry, device, limits
        self.build_fp, self.pset, self.identities, self.proof, self.errors = prep
        self.deadline, self.timer, self.pinned = deadline, timer, pinned
        self.pool = pool
        self.subs = cal.Submissions()

    def _encode(self, encoder, shape, route, weight, inp, ids, out, scratch):
        dense_matmul_id(
            encoder, self.registry, weight, inp, ids, out, scratch if route.is_grouped else None, shape.params(route)
        )

    def _buffers(self, shape, profile):
        return self.pool.input(_input_rows(shape), shape.k), self.device.from_numpy(_ids(shape, profile))

    def _submit(self, shape, route, weight, inp, ids, out, scratch) -> int:
        """One proof submission of `route` (counted immediately before its commit); returns the
        route dispatches it encoded. Encoding errors propagate with nothing submitted."""
        encoder = self.device.command_encoder()
        self._encode(encoder, shape, route, weight, inp, ids, out, scratch)
        self.subs.proof += 1
        encoder.commit_and_wait()
        return _route_dispatches(route)

    def _prove(self, shape, weight, candidates, profile):
        """Every candidate against direct on one profile: direct in one submission, each candidate
        in one of its own. Returns (proofs, route dispatches, buffers for timing)."""
        logical = shape.m * shape.top_k * shape.n
        guarded = logical + cal.GUARD_ELEMENTS
        inp, ids = self._buffers(shape, profile)
        control, *outs = self.pool.outputs(guarded, len(candidates))
        scratch = self.pool.scratch()
        poison = np.full(guarded, POISON_BITS, np.uint32).view(np.uint8)
        view = lambda b: b.view(0, logical * 4, DType.F32, [shape.m * shape.top_k, shape.n])  # noqa: E731
        control._write_bytes(poison)
        try:
            dispatches = self._submit(shape, DenseMatmulIdRoute.DIRECT, weight, inp, ids, view(control), None)
        except Error as e:
            raise _Abort(f"dense_matmul_id direct proof failed on profile {profile.value}: {e}") from None
        reference_bits = control.numpy().view(np.uint32)
        control_bits = _proof_status(reference_bits, None, logical)
        if control_bits:
            raise _Abort(
                f"dense_matmul_id direct proof failed on profile {profile.value}: {cal.status_text(control_bits)}"
            )
        reference = reference_bits[:logical].view(np.float32).astype(np.float64)
        proofs = []
        for route, out in zip(candidates, outs, strict=True):
            out._write_bytes(poison)
            tol = TENSOR_TOLERANCE.get(route, 0.0)
            try:
                dispatches += self._submit(shape, route, weight, inp, ids, view(out), scratch)
            except Error as e:
                diag = f"{route.value} failed to encode or run on profile {profile.value}: {e}"
                proofs.append(DenseMatmulIdCandidateProof(route, profile, tol, 1e300, 0, False, diag))
                continue
            got_bits = out.numpy().view(np.uint32)
            bits = _proof_status(reference_bits, got_bits, logical)
            err = 0.0
            if tol == 0.0:
                coherent = not bits & cal.STATUS_CANDIDATE_BITS
                if bits & cal.STATUS_MISMATCH:
                    err = float("nan")
            else:
                got = got_bits[:logical].view(np.float32).astype(np.float64)
                num = float(np.sqrt(np.sum((got - reference) ** 2))) if np.all(np.isfinite(got)) else math.inf
                den = float(np.sqrt(np.sum(reference**2)))
                err = num / den if den > 0 else (0.0 if num == 0 else math.inf)
                coherent = not bits & (cal.STATUS_CANDIDATE_BITS & ~cal.STATUS_MISMATCH) and err <= tol
            diag = None
            if not coherent:
                diag = f"{route.value} proof failed on profile {profile.value}: {cal.status_text(bits)}" + (
                    f", relative Frobenius error {err:.3g} > {tol:g}" if tol and err > tol else ""
                )
            proofs.append(
                DenseMatmulIdCandidateProof(
                    route, profile, tol, err if math.isfinite(err) else 1e300, bits, coherent, diag
                )
            )
        return proofs, dispatches, (inp, ids, control, scratch)

    def _time(self, shape, weight, routes, profile, bufs, done):
        """5 alternating rounds of every route, one submission each; `done` counts submissions and
        route dispatches as they happen (so a budget stop still reports what ran)."""
        inp, ids, control, scratch = bufs
        logical = shape.m * shape.top_k * shape.n
        out = control.view(0, logical * 4, DType.F32, [shape.m * shape.top_k, shape.n])

        def counted(route):
            self.subs.timing += 1
            done["submissions"] += 1
            done["dispatches"] += _route_dispatches(route)

        samples = cal.alternating_timing(
            self.device,
            routes,
            self.deadline,
            lambda enc, route: self._encode(enc, shape, route, weight, inp, ids, out, scratch),
            counted,
            self.timer,
            "dense_matmul_id ",
        )
        return {
            route: (
                DenseMatmulIdTimingDistribution(*cal.distribution(w)),
                DenseMatmulIdTimingDistribution(*cal.distribution(g)),
            )
            for route, (w, g) in samples.items()
        }

    def shape(self, shape, weight, n_identities):
        S = DenseMatmulIdSelectionStatus
        D = DenseMatmulIdRoute.DIRECT
        profiles = tuple(DenseMatmulIdRoutingProfile)
        candidates, unprepared = [], []
        for route in (DenseMatmulIdRoute.GROUPED_PREFILL, *TENSOR_TOLERANCE):
            try:
                dense_matmul_id_capability(shape.weight_dtype, shape.params(route))
            except InvalidArgumentError:
                continue
            names = _route_pipelines(route, shape.weight_dtype)
            failed = [f"{n}: {self.errors[n]}" for n in names if n in self.errors]
            if failed:
                unprepared.append(f"{route.value} pipeline preparation failed: {'; '.join(failed)}")
            elif all(n in self.identities for n in names):
                candidates.append(route)
        work = {"proof_submissions": 0, "proof_dispatches": 0, "timing_submissions": 0, "timing_dispatches": 0}

        def decision(route, status, diag, proofs=(), timings=(), hit=False):
            return DenseMatmulIdCalibrationDecision(
                shape=shape,
                selected_route=route,
                status=status,
                diagnostic=diag,
                candidates=tuple(candidates),
                proofs=tuple(proofs),
                timings=tuple(timings),
                process_cache_hit=hit,
                theorem_authorized_weight_identities=n_identities if route is not D else 0,
                **work,
                calibration_submissions=work["proof_submissions"] + work["timing_submissions"],
            )

        if not candidates:
            if unprepared:  # a legal candidate whose pipelines could not be prepared
                return decision(D, S.ERROR_FALLBACK, "; ".join(unprepared)), False
            return decision(D, S.DIRECT_ONLY, None), False
        key = (self.build_fp, self.device.name, self.device.registry_id, self.pset, shape.key)
        cached = self.pinned.get(shape.key) if self.pinned is not None else cal.PROCESS_CACHE.get(key)
        if cached is not None and cached["route"] is D:
            return decision(D, cached["status"], cached.get("diagnostic"), timings=cached["timings"], hit=True), False
        prove = [cached["route"]] if cached is not None else candidates
        # Per profile: direct and each proved candidate in a proof submission of its own, then
        # (unless cached) 5 timing rounds of direct and every candidate.
        per_profile = 1 + len(prove)
        need = len(profiles) * per_profile * (1 if cached else 1 + cal.CALIBRATION_SAMPLES)
        if self.subs.total + need > self.limits.max_submissions:
            return decision(
                D,
                S.BUDGET_FALLBACK,
                f"submission budget {self.limits.max_submissions} leaves no room for {need} calibration submissions",
            ), False
        if self.deadline.expired():
            return decision(D, S.BUDGET_FALLBACK, "calibration deadline reached before shape proof"), False
        proofs, bufs = [], {}
        for profile in profiles:
            before = self.subs.proof
            try:
                p, n, bufs[profile] = self._prove(shape, weight, prove, profile)
            finally:
                work["proof_submissions"] += self.subs.proof - before
            proofs += p
            work["proof_dispatches"] += n
        coherent = [r for r in prove if all(p.coherent for p in proofs if p.route is r)]
        if not coherent:
            failed = [p for p in proofs if not p.coherent]
            run_failure = all("failed to encode or run" in (p.diagnostic or "") for p in failed)
            status = S.ERROR_FALLBACK if run_failure else S.INCOHERENT_GROUPED
            return decision(D, status, "; ".join(p.diagnostic for p in failed), proofs), False
        if cached is not None:
            return decision(
                cached["route"], cached["status"], cached.get("diagnostic"), proofs, cached["timings"], hit=True
            ), False
        routes = (D, *coherent)
        timings, verdicts = [], {r: [] for r in coherent}
        done = {"submissions": 0, "dispatches": 0}
        try:
            for profile in profiles:
                dist = self._time(shape, weight, routes, profile, bufs[profile], done)
                for route in routes:
                    timings.append(DenseMatmulIdRouteTiming(profile, route, *dist[route]))
                for r in coherent:
                    verdicts[r].append(
                        (cal.select_winner(dist[D][0], dist[D][1], dist[r][0], dist[r][1]), dist[r][0].median_us)
                    )
        except cal.BudgetExceeded as b:
            work["timing_submissions"], work["timing_dispatches"] = done["submissions"], done["dispatches"]
            return decision(D, S.BUDGET_FALLBACK, str(b), proofs, timings), False
        except Error as e:
            raise _Abort(f"dense_matmul_id timing calibration failed after current-weight proof: {e}") from None
        work["timing_submissions"], work["timing_dispatches"] = done["submissions"], done["dispatches"]
        winners = [r for r in coherent if all(v is cal.Verdict.CANDIDATE_WINS for v, _ in verdicts[r])]
        if winners:
            route = min(winners, key=lambda r: sum(m for _, m in verdicts[r]))
            status = S.CALIBRATED_WINNER
        elif all(any(v is cal.Verdict.CONTROL_FASTEST for v, _ in verdicts[r]) for r in coherent):
            route, status = D, S.DIRECT_FASTEST
        else:
            route, status = D, S.NO_STABLE_WINNER
        if self.deadline.expired():
            return decision(D, S.BUDGET_FALLBACK, "calibration deadline reached during timing", proofs, timings), False
        cal.PROCESS_CACHE.setdefault(key, {"route": route, "status": status, "timings": tuple(timings)})
        return decision(route, status, None, proofs, timings), True


def _route_dispatches(route: DenseMatmulIdRoute) -> int:
    """Dispatches one call of `route` encodes: the direct routes 1, every grouped route map + grouped."""
    return 2 if route.is_grouped else 1


def _proof_status(control: np.ndarray, candidate: Optional[np.ndarray], logical: int) -> int:
    """The proof status bits (calibration.STATUS_*) of poisoned outputs read back as U32 words:
    in the logical range a word still holding POISON_BITS is unwritten, any other NaN/Inf is
    non-finite, and control != candidate is a mismatch; a guard word that changed is a guard hit."""
    exponent = np.uint32(0x7F800000)
    poison = np.uint32(POISON_BITS)

    def side(words, unwritten, non_finite, guard):
        body, tail = words[:logical], words[logical:]
        bits = unwritten if np.any(body == poison) else 0
        if np.any(((body & exponent) == exponent) & (body != poison)):
            bits |= non_finite
        if np.any(tail != poison):
            bits |= guard
        return bits

    bits = side(control, cal.STATUS_CONTROL_UNWRITTEN, cal.STATUS_CONTROL_NON_FINITE, cal.STATUS_CONTROL_GUARD)
    if candidate is not None:
        bits |= side(
            candidate, cal.STATUS_CANDIDATE_UNWRITTEN, cal.STATUS_CANDIDATE_NON_FINITE, cal.STATUS_CANDIDATE_GUARD
        )
        if not np.array_equal(control[:logical], candidate[:logical]):
            bits |= cal.STATUS_MISMATCH
    return bits


def _validate(registry, device, epoch, limits, cases):
    rp.check_activation(KIND, registry, epoch, (limits.max_elapsed_ms, limits.max_cases, limits.max_submissions))
    return _collect_cases(cases, limits.max_cases)


def _collect_cases(cases, max_cases: Optional[int]):
    """Validated case entries sorted by shape key: {"shape", "weights": {logical identity: buffer}}."""
    if not cases:
        _fail("dense_matmul_id calibration requires at least one case")
    shapes: dict = {}
    for case in cases:
        cap = dense_matmul_id_capability(
            case.weight.dtype, dataclasses.replace(case.params, route=DenseMatmulIdRoute.DIRECT)
        )
        w = case.weight
        if w.nbytes < cap.required_weight_bytes or w.byte_offset % w.dtype.size:
            _fail(
                f"dense_matmul_id calibration weight requires {cap.required_weight_bytes} aligned bytes, "
                f"got {w.nbytes} at offset {w.byte_offset}"
            )
        shape = DenseMatmulIdShape.of(w.dtype, case.params)
        entry = shapes.setdefault(shape.key, {"shape": shape, "weights": {}})
        entry["weights"].setdefault((w.address, w.byte_offset, w.nbytes), w)
    if max_cases is not None and len(shapes) > max_cases:
        _fail(f"dense_matmul_id calibration declares {len(shapes)} shapes; limit is {max_cases}")
    return [shapes[k] for k in sorted(shapes)]


def _authority_digest(device, epoch: int, entries) -> str:
    """The activation authority digest (spec §7.6 step 2): SHA-256 over a domain tag, the epoch, the
    device id and name, and every declared shape (canonical JSON, length-prefixed) with its sorted
    logical weight identities (address, byte_offset, nbytes) -- the weights the activation borrows."""
    parts = [
        b"routemm.dense_matmul_id.authority",
        struct.pack("<QQ", epoch, device.registry_id),
        struct.pack("<Q", len(device.name.encode())),
        device.name.encode(),
    ]
    for e in entries:
        shape = cal.canonical_json(e["shape"].to_dict()).encode()
        idents = sorted(e["weights"])
        parts += [struct.pack("<Q", len(shape)), shape, struct.pack("<Q", len(idents))]
        parts += [struct.pack("<QQQ", *ident) for ident in idents]
    return cal.sha256_hex(*parts)


def _plan_id(build_fp, device_registry_id, authority_id, epoch, digest, decisions) -> str:
    return cal.sha256_hex(
        build_fp.encode(),
        struct.pack("<QQQ", device_registry_id, authority_id, epoch),
        digest.encode(),
        cal.canonical_json([[d.shape.to_dict(), DenseMatmulIdRoute(d.route).value] for d in decisions]).encode(),
    )


def _plan(build_fp, registry, device, epoch, routes, digest):
    decisions = tuple(DenseMatmulIdPlanDecision(s, r) for s, r in sorted(routes, key=lambda t: t[0].key))
    pid = _plan_id(build_fp, device.registry_id, registry.authority_id, epoch, digest, decisions)
    return DenseMatmulIdRoutePlan(
        plan_id=pid,
        build_fingerprint=build_fp,
        device_name=device.name,
        device_registry_id=device.registry_id,
        registry_authority_id=registry.authority_id,
        activation_epoch=epoch,
        theorem_sha256=THEOREM_SHA256,
        decisions=decisions,
    )


def _run(registry, device, epoch, limits, cases, *, progress, pinned=None, _timer=None, _clock=None):
    timer, clock = _timer, _clock
    limits = limits or DenseMatmulIdCalibrationLimits()
    cases = list(cases)
    entries = _validate(registry, device, epoch, limits, cases)
    deadline = cal.Deadline(limits.max_elapsed_ms, clock or cal.time.perf_counter)
    prep = _prepare(registry, {e["shape"].weight_dtype for e in entries})
    digest = _authority_digest(device, epoch, entries)
    c = _Calibrator(
        registry, device, limits, prep, deadline, timer, pinned, _ProofPool(device, [e["shape"] for e in entries])
    )
    bar = cal.Progress(len(entries), "dense_matmul_id calibration", progress)
    decisions, fresh = [], 0
    try:
        for e in entries:
            d, was_fresh = c.shape(e["shape"], next(iter(e["weights"].values())), len(e["weights"]))
            fresh += was_fresh
            decisions.append(d)
            cal.LOGGER.debug(
                "dense_matmul_id shape %s: %s / %s%s",
                e["shape"].key,
                d.selected_route.value,
                d.status.value,
                f": {d.diagnostic}" if d.diagnostic else "",
            )
            bar.step({"shape": e["shape"].to_dict(), "route": d.selected_route.value, "status": d.status.value})
    except _Abort as a:
        if c.subs.total:
            cal.cleanup_submission(device, c.subs)
        raise InvalidArgumentError(str(a)) from None
    finally:
        bar.close()
    if c.subs.total:
        cal.cleanup_submission(device, c.subs)
    primary = _plan(prep[0], registry, device, epoch, [(d.shape, d.selected_route) for d in decisions], digest)
    late = [
        dataclasses.replace(
            d,
            selected_route=DenseMatmulIdRoute.DIRECT,
            status=DenseMatmulIdSelectionStatus.BUDGET_FALLBACK,
            diagnostic="final dense_matmul_id calibration deadline exceeded; candidates disabled",
            theorem_authorized_weight_identities=0,
        )
        if d.selected_route is not DenseMatmulIdRoute.DIRECT
        else d
        for d in decisions
    ]
    fallback = _plan(prep[0], registry, device, epoch, [(d.shape, d.selected_route) for d in late], digest)
    elapsed = deadline.elapsed_ms()
    overrun = max(0.0, elapsed - limits.max_elapsed_ms)
    plan, final = (fallback, late) if overrun > 0 else (primary, decisions)
    receipt = DenseMatmulIdCalibrationReceipt.of_calibration(
        plan,
        c.subs,
        elapsed,
        overrun,
        final,
        declared_shapes=len(final),
        calibrated_decisions=fresh,
        theorem_sha256=THEOREM_SHA256,
        direct_decisions=sum(d.selected_route is DenseMatmulIdRoute.DIRECT for d in final),
        proof_dispatches=sum(d.proof_dispatches for d in final),
        timing_dispatches=sum(d.timing_dispatches for d in final),
    )
    authority = _Authority(
        epoch,
        digest,
        frozenset(e["shape"].key for e in entries),
        prep[0],
        {label: ident.to_dict() for label, ident in prep[2].items()},
    )
    rp.set_origin(plan, rp.Origin(device, receipt, authority))
    freeze_dense_matmul_id_plan(registry, device, plan, _check_fingerprint=False)
    return plan, receipt


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
