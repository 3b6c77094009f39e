"""Frozen, device-calibrated routing for Q4_0 dense projections (spec §6; seed dense_q4_auto.rs).

The 64x32 candidate route is never chosen from a static threshold: at model activation a caller
declares every native Q4_0 weight buffer with every row count M that can reach it
(DenseQ4CalibrationCase); calibrate_dense_q4_routes proves the candidate bit-identical to the V2
compatibility route on every exact (shape, current weight) pair, times both routes on one
representative weight per base shape, and freezes an immutable plan into the registry. Dispatch
then resolves routes with one lookup in the native dispatcher (quantized_matmul_ggml, dense_q4_auto;
select_route says what it will choose). Undeclared or late shapes keep the compatibility route.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from typing import Optional

import numpy as np

from .. import _core
from ..core._core_api import DType, EncodedKernelDispatch, PipelineIdentity, check_type
from ..core._errors import CommandBufferError, Error, InvalidArgumentError
from ..core._json import JsonRecord
from ..ops.quantized_matmul import (
    DenseQ4DecisionSource,
    DenseQ4Route,
    GgmlQuantizedMatmulParams,
    GgmlQuantizedMatmulReceipt,
    GgmlRoutingPolicy,
    GgmlType,
    effective_policy,
    encode_ggml,
    encode_q4_route,
    q4_expected_dispatch,
)
from . import _route_plan as rp
from . import calibration as cal

DENSE_Q4_ROUTE_SCHEMA_VERSION = 4  # the plan's records (and the build fingerprint)
# The calibration receipt and the dispatch trace. 5: the library version field is routemm_version
# (it was mlx_native_version); plan files that hold a version-4 receipt still load.
DENSE_Q4_RECEIPT_SCHEMA_VERSION = 5
PLAN_KIND = "dense_q4"
Q4_INT_CONSTANTS = [(700, 1), (701, 1), (702, 1)]
I32_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
BLOCK_VALUES, BLOCK_BYTES = 32, 18
COMPATIBILITY_UNPLANNED = "compatibility-unplanned"
# The pipeline identity schema this library writes (PipelineIdentity's schema_version).
IDENTITY_SCHEMA_VERSION = PipelineIdentity.__dataclass_fields__["schema_version"].default
_PLAN, _RECEIPT = "dense_q4_route_plan.schema.json", "dense_q4_calibration_receipt.schema.json"


class DenseQ4InputLayout(enum.Enum):
    CONTIGUOUS = "contiguous"


@dataclasses.dataclass(frozen=True)
class DenseQ4BaseShape(JsonRecord):
    """A Q4_0 weight's shape without the row count: what a calibration case declares."""

    SCHEMA = _PLAN
    n: int
    k: int
    batch: int = 1
    input_layout: DenseQ4InputLayout = DenseQ4InputLayout.CONTIGUOUS

    def with_m(self, m: int) -> "DenseQ4Shape":
        return DenseQ4Shape(m, self.n, self.k, self.batch, self.input_layout)

    @property
    def key(self) -> tuple:
        return (self.n, self.k, self.batch, DenseQ4InputLayout(self.input_layout).value)


@dataclasses.dataclass(frozen=True)
class DenseQ4Shape(JsonRecord):
    """An exact Q4_0 MM shape (ordered m first)."""

    SCHEMA = _PLAN
    m: int
    n: int
    k: int
    batch: int = 1
    input_layout: DenseQ4InputLayout = DenseQ4InputLayout.CONTIGUOUS

    @property
    def key(self) -> tuple:
        return (self.m, self.n, self.k, self.batch, DenseQ4InputLayout(self.input_layout).value)

    @property
    def base(self) -> DenseQ4BaseShape:
        return DenseQ4BaseShape(self.n, self.k, self.batch, self.input_layout)

    def params(self) -> GgmlQuantizedMatmulParams:
        return GgmlQuantizedMatmulParams(self.m, self.n, self.k, GgmlType.Q4_0)


def exact_shape(
    params: GgmlQuantizedMatmulParams, batch: int = 1, contiguous_input: bool = True
) -> Optional[DenseQ4Shape]:
    """The plan key of a call, or None when the call can never take a planned route."""
    ok = (
        GgmlType(params.ggml_type) is GgmlType.Q4_0
        and params.m > 8
        and params.n > 0
        and params.k >= 32
        and params.k % 32 == 0
        and batch == 1
        and contiguous_input
    )
    return DenseQ4Shape(params.m, params.n, params.k, 1) if ok else None


@dataclasses.dataclass(frozen=True)
class DenseQ4CalibrationCase:
    """One native Q4_0 weight buffer and every row count that can reach it."""

    weight: object  # routemm.Buffer (U8 Q4_0 blocks, exactly n * k / 32 * 18 bytes)
    shape: DenseQ4BaseShape
    reachable_m: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class DenseQ4CalibrationLimits:
    max_elapsed_ms: int = 15_000
    max_shapes: int = 256


class DenseQ4SelectionStatus(enum.Enum):
    CALIBRATED_WINNER = "calibrated_winner"
    COMPATIBILITY_FASTEST = "compatibility_fastest"
    NO_STABLE_WINNER = "no_stable_winner"
    CANDIDATE_UNAVAILABLE = "candidate_unavailable"
    INCOHERENT_CANDIDATE = "incoherent_candidate"
    CALIBRATION_ERROR_FALLBACK = "calibration_error_fallback"
    BUDGET_FALLBACK = "budget_fallback"


_TIMED_STATUSES = (
    DenseQ4SelectionStatus.CALIBRATED_WINNER,
    DenseQ4SelectionStatus.COMPATIBILITY_FASTEST,
    DenseQ4SelectionStatus.NO_STABLE_WINNER,
)


@dataclasses.dataclass(frozen=True)
class DenseQ4DispatchDecision(JsonRecord):
    SCHEMA = "dense_q4_plan_dispatch_trace.schema.json"
    route: DenseQ4Route
    source: DenseQ4DecisionSource


DenseQ4TimingDistribution = rp.kind_record(__name__, "DenseQ4TimingDistribution", rp.TimingDistribution, _RECEIPT)


@dataclasses.dataclass(frozen=True)
class DenseQ4RouteTiming(JsonRecord):
    """One route's wall and GPU timing distributions, with the dispatch it encoded and the
    pipeline that ran it."""

    SCHEMA = _RECEIPT
    route: DenseQ4Route
    wall: DenseQ4TimingDistribution
    gpu: DenseQ4TimingDistribution
    encoded: EncodedKernelDispatch
    pipeline: PipelineIdentity


@dataclasses.dataclass(frozen=True)
class DenseQ4CalibrationDecision(
    rp.CalibrationDecision[DenseQ4Shape, DenseQ4Route, DenseQ4SelectionStatus, DenseQ4RouteTiming], JsonRecord
):
    """Why one exact shape takes its route, and what proving and timing it cost: besides the
    common fields, how many weight buffers the proof covered and the proof's dispatches, scratch
    bytes and GPU time."""

    SCHEMA = _RECEIPT
    authorized_weight_buffers: int
    proof_route_dispatches: int
    proof_auxiliary_dispatches: int
    proof_scratch_bytes: int
    proof_gpu_us: float


DenseQ4PlanDecision = rp.kind_record(
    __name__, "DenseQ4PlanDecision", rp.PlanDecision[DenseQ4Shape, DenseQ4Route], _PLAN
)


@dataclasses.dataclass(frozen=True)
class DenseQ4RoutePlan(rp.RoutePlan[DenseQ4PlanDecision], JsonRecord):
    """An immutable, pointer-free plan: exact shape -> route, bound to one registry authority,
    one device and one build. Decisions are sorted by shape."""

    SCHEMA = _PLAN
    schema_version: int = DENSE_Q4_ROUTE_SCHEMA_VERSION

    def route_for(self, shape: DenseQ4Shape) -> Optional[DenseQ4Route]:
        return self._lookup.get(shape.key)

    @property
    def routes(self) -> dict:
        """{(m, n, k, batch, layout): route}."""
        return dict(self._lookup)


@dataclasses.dataclass(frozen=True)
class DenseQ4CalibrationBatchReceipt(rp.CalibrationReceipt[DenseQ4CalibrationDecision], JsonRecord):
    """What one dense Q4 calibration did: besides the common fields, how many shapes kept the
    compatibility route, the (shape, weight) pairs proved, and the proofs' dispatches, peak scratch
    bytes and GPU time."""

    SCHEMA = _RECEIPT
    compatibility_route_decisions: int
    authorized_shape_weight_pairs: int
    proof_route_dispatches: int
    proof_auxiliary_dispatches: int
    peak_proof_scratch_bytes: int
    proof_gpu_us: float
    schema_version: int = DENSE_Q4_RECEIPT_SCHEMA_VERSION


@dataclasses.dataclass(frozen=True)
class DenseQ4DispatchTrace(JsonRecord):
    """What one dense_q4_auto call encoded, with the plan (or its absence) that decided it."""

    SCHEMA = "dense_q4_plan_dispatch_trace.schema.json"
    routemm_version: str
    build_fingerprint: str
    plan_id: Optional[str]
    shape: DenseQ4Shape
    decision: DenseQ4DispatchDecision
    encoded: EncodedKernelDispatch
    pipeline: PipelineIdentity
    schema_version: int = DENSE_Q4_RECEIPT_SCHEMA_VERSION


def _fail(message: str):
    raise InvalidArgumentError(message)


# ---- Preparation and fingerprints ---------------------------------------------------------------


@dataclasses.dataclass
class _Prepared:
    v2: object
    candidate: object  # Pipeline or None
    proof: Optional[cal.ProofKernels]
    unavailable: Optional[str]
    identities: dict  # route -> PipelineIdentity
    build_fingerprint: str
    pipeline_set_fingerprint: str


def _prepare(registry) -> _Prepared:
    try:
        v2 = registry.get_pipeline(DenseQ4Route.COMPATIBILITY_V2.pipeline_name, Q4_INT_CONSTANTS)
    except Error as e:
        _fail(f"required dense Q4 compatibility V2 pipeline is unavailable: {e}")
    candidate = proof = None
    unavailable = None
    try:
        candidate = registry.get_pipeline(DenseQ4Route.TENSOR_64X32.pipeline_name, Q4_INT_CONSTANTS)
    except Error as e:
        unavailable = f"64x32 candidate pipeline unavailable: {e}"
    if candidate is not None:
        try:
            proof = cal.ProofKernels(registry)
        except Error as e:
            candidate, unavailable = None, f"dense Q4 proof pipelines unavailable: {e}"
    ids = [v2.identity]
    identities = {DenseQ4Route.COMPATIBILITY_V2: v2.identity}
    if candidate is not None:
        identities[DenseQ4Route.TENSOR_64X32] = candidate.identity
        ids += [candidate.identity] + proof.identities()
    build_fp, pset_fp = cal.build_fingerprint("routemm.dense_q4_plan", DENSE_Q4_ROUTE_SCHEMA_VERSION, ids)
    return _Prepared(v2, candidate, proof, unavailable, identities, build_fp, pset_fp)


def current_build_fingerprint(registry, device) -> str:
    return _prepare(registry).build_fingerprint


def _plan_id(build_fp: str, device_registry_id: int, authority: int, epoch: int, decisions) -> str:
    pairs = [[d.shape.to_dict(), DenseQ4Route(d.route).value] for d in decisions]
    return cal.sha256_hex(
        build_fp.encode(), struct.pack("<QQQ", device_registry_id, authority, epoch), cal.canonical_json(pairs).encode()
    )


def _make_plan(prep: _Prepared, registry, device, epoch: int, routes: dict) -> DenseQ4RoutePlan:
    decisions = tuple(
        DenseQ4PlanDecision(shape, routes[key])
        for key, shape in sorted(((s.key, s) for s in _ALL_SHAPES(routes)), key=lambda t: t[0])
    )
    plan_id = _plan_id(prep.build_fingerprint, device.registry_id, registry.authority_id, epoch, decisions)
    return DenseQ4RoutePlan(
        plan_id, prep.build_fingerprint, device.name, device.registry_id, registry.authority_id, epoch, decisions
    )


def _ALL_SHAPES(routes: dict):
    return [DenseQ4Shape(m, n, k, b, DenseQ4InputLayout(layout)) for (m, n, k, b, layout) in routes]


# ---- Freezing -----------------------------------------------------------------------------------


_PLANNABLE_ROUTES = (DenseQ4Route.COMPATIBILITY_V2, DenseQ4Route.TENSOR_64X32)


class _DenseQ4Kind(rp.PlanKind):
    def protected_names(self) -> list[str]:
        return [
            DenseQ4Route.COMPATIBILITY_V2.pipeline_name,
            DenseQ4Route.TENSOR_64X32.pipeline_name,
            *cal.PROOF_PIPELINES,
        ]

    def build_fingerprint(self, registry, plan) -> str:
        return _prepare(registry).build_fingerprint

    def recompute_plan_id(self, plan) -> str:
        identity = (plan.device_registry_id, plan.registry_authority_id, plan.activation_epoch)
        return _plan_id(plan.build_fingerprint, *identity, plan.decisions)

    def check_receipt(self, receipt) -> None:
        """A dense Q4 receipt's own totals, and what each decision's structure implies (see
        _Calibrator.shape): at most one proof submission, of two route and two auxiliary dispatches
        per authorised weight, and no proof work without it; timings of both routes, in order, or
        none, and both with the submissions they took where the shape was timed here (not a cache
        hit); the candidate selected exactly when the status is calibrated_winner."""
        V2, C = DenseQ4Route.COMPATIBILITY_V2, DenseQ4Route.TENSOR_64X32
        decisions = receipt.decisions

        def fail(field: str, message: str):
            _fail(f"dense Q4 calibration receipt {field} {message}")

        for i, d in enumerate(decisions):
            at = f"decisions[{i}]"
            if (d.selected_route is C) != (d.status is DenseQ4SelectionStatus.CALIBRATED_WINNER):
                fail(f"{at}.selected_route", f"{d.selected_route.value} disagrees with its status {d.status.value}")
            proved = d.proof_submissions == 1
            if d.proof_submissions > 1 or proved != (d.authorized_weight_buffers > 0):
                fail(f"{at}.proof_submissions", f"is {d.proof_submissions} for {d.authorized_weight_buffers} weights")
            for name in ("proof_route_dispatches", "proof_auxiliary_dispatches"):
                if getattr(d, name) != 2 * d.authorized_weight_buffers:
                    fail(f"{at}.{name}", f"is not two per authorised weight ({d.authorized_weight_buffers})")
            if not proved and (d.proof_scratch_bytes or d.proof_gpu_us):
                fail(f"{at}.proof_scratch_bytes", "and proof_gpu_us are not zero without a proof submission")
            routes = tuple(t.route for t in d.timings)
            if routes not in ((), (V2, C)):
                fail(f"{at}.timings", f"time {[r.value for r in routes]}, not both routes in order or none")
            if d.process_cache_hit and d.timing_submissions:
                fail(f"{at}.timing_submissions", "of a cache hit are not zero")
            if not d.process_cache_hit and d.status in _TIMED_STATUSES:
                if routes != (V2, C):
                    fail(f"{at}.timings", f"are missing from a shape timed in this calibration ({d.status.value})")
                if d.timing_submissions != 2 * cal.CALIBRATION_SAMPLES:
                    fail(f"{at}.timing_submissions", f"is {d.timing_submissions}, not {2 * cal.CALIBRATION_SAMPLES}")

        totals = {
            "compatibility_route_decisions": sum(d.selected_route is V2 for d in decisions),
            "authorized_shape_weight_pairs": sum(d.authorized_weight_buffers for d in decisions),
            "proof_route_dispatches": sum(d.proof_route_dispatches for d in decisions),
            "proof_auxiliary_dispatches": sum(d.proof_auxiliary_dispatches for d in decisions),
            "peak_proof_scratch_bytes": max((d.proof_scratch_bytes for d in decisions), default=0),
        }
        for name, total in totals.items():
            if getattr(receipt, name) != total:
                fail(name, f"is {getattr(receipt, name)}, but its decisions give {total}")
        gpu_us = math.fsum(d.proof_gpu_us for d in decisions)
        if not math.isclose(receipt.proof_gpu_us, gpu_us, rel_tol=1e-9, abs_tol=1e-9):
            fail("proof_gpu_us", f"is {receipt.proof_gpu_us}, but its decisions add up to {gpu_us}")

    def upgrade_receipt(self, doc: dict) -> dict:
        """A version-4 receipt document (its library version named mlx_native_version) as version 5."""
        if doc.get("schema_version") != 4 or "mlx_native_version" not in doc or "routemm_version" in doc:
            return doc
        upgraded = {name: value for name, value in doc.items() if name != "mlx_native_version"}
        upgraded.update(routemm_version=doc["mlx_native_version"], schema_version=DENSE_Q4_RECEIPT_SCHEMA_VERSION)
        return upgraded

    def freeze_native(self, registry, plan: DenseQ4RoutePlan, protected: list) -> None:
        """Freeze the plan together with its decisions, which the native dispatcher reads."""
        decisions = []
        for d in plan.decisions:
            shape = d.shape
            if shape.batch != 1 or DenseQ4InputLayout(shape.input_layout) is not DenseQ4InputLayout.CONTIGUOUS:
                _fail(f"dense Q4 route plan decides a shape no call can take: {shape}")
            decisions.append((shape.m, shape.n, shape.k, DenseQ4Route(d.route).value))
        identity = (plan.device_name, plan.device_registry_id, plan.registry_authority_id)
        _core._freeze_dense_q4_plan_routes(registry, plan.plan_id, *identity, decisions, protected, plan.to_json())

    def run(self, registry, device, epoch, limits, cases, **options):
        return _run(registry, device, epoch, limits, cases, **options)

    def declared(self, registry, device, epoch, limits, cases) -> tuple:
        # Cases are validated by the run; a file is read only for shapes its cases spell out.
        keys = {(int(m), c.shape.n, c.shape.k, 1, "contiguous") for c in cases for m in c.reachable_m}
        return _prepare(registry).build_fingerprint, keys

    def cache_key(self, registry, device, epoch, limits, cases) -> dict:
        _validate_cases(epoch, registry, limits or DenseQ4CalibrationLimits(), cases, device)
        shapes = sorted({(c.shape.n, c.shape.k, int(m)) for c in cases for m in c.reachable_m})
        validators = cal.plan_validators(device, _prepare(registry).build_fingerprint)
        return {"kind": PLAN_KIND, "validators": validators, "shapes": shapes}

    def explained_outcome(self, d) -> dict:
        wall = {t.route.value: dataclasses.astuple(t.wall) for t in d.timings}
        gpu = {t.route.value: dataclasses.astuple(t.gpu) for t in d.timings}
        return {"route": d.selected_route, "status": d.status, "diagnostic": d.diagnostic, "wall": wall, "gpu": gpu}

    def unexplained_outcome(self, route) -> dict:
        compatibility = route is DenseQ4Route.COMPATIBILITY_V2
        status = DenseQ4SelectionStatus.NO_STABLE_WINNER if compatibility else DenseQ4SelectionStatus.CALIBRATED_WINNER
        return {"route": route, "status": status, "wall": {}, "gpu": {}}


KIND = _DenseQ4Kind(
    PLAN_KIND, "dense Q4", DenseQ4RoutePlan, DenseQ4CalibrationBatchReceipt, DenseQ4Route, _PLANNABLE_ROUTES
)


def freeze_dense_q4_plan(registry, device, plan: DenseQ4RoutePlan) -> None:
    """Freeze `plan` into `registry`: same authority and device, one-shot (the same plan id again
    is a no-op), and the build/pipeline fingerprint recomputed now must equal the plan's. The
    pipelines the plan depends on can no longer be re-registered afterwards."""
    rp.freeze(KIND, registry, device, plan)


def dense_q4_plan(registry) -> Optional[DenseQ4RoutePlan]:
    return rp.frozen_plan(registry, PLAN_KIND)


_core.KernelRegistry.freeze_dense_q4_plan = lambda self, device, plan: freeze_dense_q4_plan(self, device, plan)
_core.KernelRegistry.dense_q4_plan = lambda self: dense_q4_plan(self)


# ---- Request-time selection and dispatch --------------------------------------------------------


def select_route(
    registry,
    device,
    params: GgmlQuantizedMatmulParams,
    batch: int = 1,
    contiguous_input: bool = True,
    routing: Optional[GgmlRoutingPolicy] = None,
) -> DenseQ4DispatchDecision:
    """Spec §6.2: the planned route of one call, as the dispatcher selects it; no GPU work."""
    if exact_shape(params, batch, contiguous_input) is None:
        return DenseQ4DispatchDecision(
            DenseQ4Route.COMPATIBILITY_V2, DenseQ4DecisionSource.INELIGIBLE_COMPATIBILITY_FALLBACK
        )
    routing = effective_policy(registry, routing, "dense Q4 route selection")
    route, source = _core._select_dense_q4_planned_route(registry, device, params._native(), *routing._native())
    return DenseQ4DispatchDecision(DenseQ4Route(route), DenseQ4DecisionSource(source))


def dense_q4_auto(
    encoder,
    registry,
    device,
    input,
    weight,
    output,
    params: GgmlQuantizedMatmulParams,
    routing: Optional[GgmlRoutingPolicy] = None,
) -> GgmlQuantizedMatmulReceipt:
    """quantized_matmul_ggml for an explicit device: the plan frozen into `registry` is honoured
    only when it was made on `device`. A call that cannot take the selected route (the
    candidate's pipeline fails to resolve at dispatch, or the backend lacks the tensor pipelines)
    says ineligible_compatibility_fallback, never no_plan."""
    policy = effective_policy(registry, routing, "dense_q4_auto")
    params._native()  # validates m, n, k
    return encode_ggml(encoder, registry, input, weight, output, params, policy, device=device)


def trace_dense_q4_auto(
    encoder, registry, device, input, weight, output, params: GgmlQuantizedMatmulParams, routing: GgmlRoutingPolicy
) -> DenseQ4DispatchTrace:
    """Encode one ordinary Q4 call through dense_q4_auto and check it against the frozen plan.

    `routing` is the exact policy production dispatch uses: the trace never substitutes the
    registry's or the environment's, so None is refused like any other non-policy."""
    check_type("trace_dense_q4_auto", "routing", routing, GgmlRoutingPolicy)
    shape = exact_shape(params, 1, True)
    if shape is None:
        _fail("dense Q4 auto trace requires eligible Q4_0 MM shape")
    planned = select_route(registry, device, params, 1, True, routing)
    if encoder.device_registry_id != device.registry_id:
        _fail("dense Q4 trace encoder/device mismatch")
    encoder.start_encoded_dispatch_receipt(1)
    try:
        dense_q4_auto(encoder, registry, device, input, weight, output, params, routing)
    finally:
        encoded = encoder.take_encoded_dispatch_receipt()
    if len(encoded) != 1:
        _fail(f"dense Q4 auto route encoded {len(encoded)} dispatches, expected one")
    encoded = encoded[0]
    kernel = encoded.pipeline_label.split("|")[0]
    actual = next((r for r in DenseQ4Route if r.pipeline_name == kernel), None)
    if actual is None:
        _fail(f"dense Q4 auto trace encoded unexpected pipeline {encoded.pipeline_label}")
    decision = (
        planned
        if actual is planned.route
        else DenseQ4DispatchDecision(actual, DenseQ4DecisionSource.INELIGIBLE_COMPATIBILITY_FALLBACK)
    )
    if encoded != q4_expected_dispatch(decision.route, shape.m, shape.n, registry=registry, k=shape.k):
        _fail(f"dense Q4 auto route {decision.route.value} encoded unexpected geometry: {encoded}")
    pipeline = registry.pipeline_identity(encoded.pipeline_label)
    if pipeline.pipeline_label != encoded.pipeline_label or pipeline.kernel_name != decision.route.pipeline_name:
        _fail("dense Q4 auto route encoded an unexpected pipeline")
    plan = rp.frozen_plan(registry, PLAN_KIND)
    if decision.route is DenseQ4Route.TENSOR_64X32 and (
        plan is None or plan.route_for(shape) is not DenseQ4Route.TENSOR_64X32
    ):
        _fail("dense Q4 candidate trace lacks a frozen exact-shape decision")
    return DenseQ4DispatchTrace(
        _core.version(),
        plan.build_fingerprint if plan else COMPATIBILITY_UNPLANNED,
        plan.plan_id if plan else None,
        shape,
        decision,
        encoded,
        pipeline,
    )


# ---- Calibration --------------------------------------------------------------------------------


class _HardFailure(Exception):
    pass


@dataclasses.dataclass
class _ShapeOutcome:
    decision: DenseQ4CalibrationDecision
    proof_failed: bool  # the candidate was not proved for every weight (Cartesian downgrade)
    fresh_timing: bool


def _validate_cases(epoch, registry, limits, cases, device):
    rp.check_activation(KIND, registry, epoch, (limits.max_elapsed_ms, limits.max_shapes))
    cases = list(cases)
    if not cases:
        _fail("dense Q4 calibration requires at least one case")
    bases: dict[tuple, dict] = {}
    for case in cases:
        s = case.shape
        if not isinstance(s, DenseQ4BaseShape) or not (
            s.n > 0
            and s.k >= 32
            and s.k % 32 == 0
            and s.batch == 1
            and DenseQ4InputLayout(s.input_layout) is DenseQ4InputLayout.CONTIGUOUS
        ):
            _fail(f"invalid dense Q4 calibration base shape: {s}")
        if s.n > I32_MAX or s.k > I32_MAX:
            _fail(f"dense Q4 calibration base shape exceeds i32::MAX: {s}")
        w = case.weight
        if w.dtype != DType.U8 or w.byte_offset % 2 != 0:
            _fail(
                f"dense Q4 calibration weight must be aligned native U8 Q4_0 storage (got {w.dtype}, "
                f"byte offset {w.byte_offset})"
            )
        if w.device.backend != device.backend:
            _fail("dense Q4 calibration weight lives on a different device")
        need = s.n * (s.k // BLOCK_VALUES) * BLOCK_BYTES
        if w.nbytes != need:
            _fail(f"dense Q4 calibration weight must be exactly {need} bytes, got {w.nbytes}")
        ms = list(case.reachable_m)
        if not ms or any(
            isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 9 <= m <= I32_MAX for m in ms
        ):
            _fail(f"dense Q4 calibration reachable M must be non-empty and within 9..={I32_MAX}, got {ms}")
        entry = bases.setdefault(s.key, {"base": DenseQ4BaseShape(s.n, s.k, 1), "ms": set(), "weights": {}})
        entry["ms"].update(int(m) for m in ms)
        entry["weights"].setdefault((w.address, w.byte_offset, w.nbytes), w)
    declared = sum(len(e["ms"]) for e in bases.values())
    if not 1 <= declared <= limits.max_shapes:
        _fail(f"dense Q4 calibration declares {declared} exact shapes; limits allow 1..={limits.max_shapes}")
    return [bases[k] for k in sorted(bases)], declared


class _Calibrator:
    def __init__(self, registry, device, epoch, limits, prep, deadline, timer, fault, pinned, scratch):
        self.registry, self.device, self.epoch, self.limits = registry, device, epoch, limits
        self.prep, self.deadline, self.timer, self.fault, self.pinned = prep, deadline, timer, fault, pinned
        self.scratch = scratch
        self.subs = cal.Submissions()

    # -- one route dispatch, traced
    def _encode_traced(self, encoder, route, shape, inp, weight, out):
        encoder.start_encoded_dispatch_receipt(1)
        try:
            encode_q4_route(encoder, self.registry, inp, weight, out, shape.params(), route)
        finally:
            encoded = encoder.take_encoded_dispatch_receipt()
        if len(encoded) != 1:
            raise _TraceError(f"{route.value} encoded {len(encoded)} dispatches, expected one")
        if encoded[0] != q4_expected_dispatch(route, shape.m, shape.n, registry=self.registry, k=shape.k):
            raise _TraceError(f"{route.value} encoded unexpected geometry: {encoded[0]}")
        identity = self.registry.pipeline_identity(encoded[0].pipeline_label)
        if identity != self.prep.identities[route]:
            raise _TraceError(f"{route.value} pipeline identity differs from the prepared one")
        return encoded[0]

    def shape(self, shape: DenseQ4Shape, weights: list) -> _ShapeOutcome:
        S = DenseQ4SelectionStatus
        V2, C = DenseQ4Route.COMPATIBILITY_V2, DenseQ4Route.TENSOR_64X32

        def fallback(status, diag, proof_failed=True, **work):
            fields = dict(
                proof_submissions=0,
                proof_route_dispatches=0,
                proof_auxiliary_dispatches=0,
                proof_scratch_bytes=0,
                proof_gpu_us=0.0,
                timing_submissions=0,
            )
            fields.update(work)
            d = DenseQ4CalibrationDecision(
                shape=shape,
                selected_route=V2,
                status=status,
                diagnostic=diag,
                timings=fields.pop("timings", ()),
                process_cache_hit=False,
                authorized_weight_buffers=len(weights) if fields["proof_submissions"] else 0,
                **fields,
                calibration_submissions=fields["proof_submissions"] + fields["timing_submissions"],
            )
            return _ShapeOutcome(d, proof_failed, False)

        if self.prep.candidate is None:
            return fallback(S.CANDIDATE_UNAVAILABLE, self.prep.unavailable)
        if self.deadline.expired():
            return fallback(S.BUDGET_FALLBACK, "calibration deadline reached before shape proof")
        m, n, k = shape.m, shape.n, shape.k
        logical = m * n
        guarded = logical + cal.GUARD_ELEMENTS
        if guarded > U32_MAX:
            return fallback(S.CALIBRATION_ERROR_FALLBACK, f"dense Q4 proof output of {guarded} elements exceeds u32")
        dev = self.device
        inp = self.scratch.input(m, k)
        control, candidate = self.scratch.outputs(guarded)
        statuses = self.scratch.statuses(len(weights))
        scratch = inp.nbytes + control.nbytes + candidate.nbytes + statuses.nbytes
        faulty_input = None
        encoder = dev.command_encoder()
        route_dispatches = aux = 0
        first_encoded = None
        for i, w in enumerate(weights):
            if self.deadline.expired():
                return fallback(S.BUDGET_FALLBACK, "calibration deadline reached while encoding shape proof batch")
            self.prep.proof.encode_poison(encoder, control, candidate, logical, guarded)
            encoder.memory_barrier()
            try:
                v2_encoded = self._encode_traced(encoder, V2, shape, inp, w, control)
            except (_TraceError, Error) as e:
                raise _HardFailure(f"required dense Q4 compatibility V2 proof failed for weight {i}: {e}") from None
            cand_input = inp
            if self.fault is not None and self.fault(i, shape):
                if faulty_input is None:
                    values = cal.proof_input(m * k)
                    values[0] += np.float32(1.0)  # visible through any route's rounding of activations
                    faulty_input = dev.from_numpy(values.reshape(m, k))
                cand_input = faulty_input
            try:
                self._encode_traced(encoder, C, shape, cand_input, w, candidate)
            except (_TraceError, Error) as e:
                # The batch is abandoned uncommitted: a mis-traced candidate is never run.
                return fallback(
                    S.INCOHERENT_CANDIDATE, f"optional dense Q4 candidate proof failed for weight {i}: trace: {e}"
                )
            first_encoded = first_encoded or v2_encoded
            encoder.memory_barrier()
            self.prep.proof.encode_compare(encoder, control, candidate, statuses, i, logical, guarded)
            encoder.memory_barrier()
            route_dispatches += 2
            aux += 2
        self.subs.proof += 1
        try:
            start, end = encoder.commit_wait_with_gpu_time()
        except Error as e:
            # Backends that run launches at commit (CPU) report a kernel that rejects the call here.
            # Launches run in encode order, so the first failure is the first weight's; a failing
            # candidate launch is an incoherent candidate, anything else breaks the required route.
            if isinstance(e, CommandBufferError) and e.pipeline_label == C.pipeline_label:
                return fallback(
                    S.INCOHERENT_CANDIDATE,
                    f"optional dense Q4 candidate proof failed for weight 0: launch: {e}",
                    proof_submissions=1,
                    proof_route_dispatches=route_dispatches,
                    proof_auxiliary_dispatches=aux,
                    proof_scratch_bytes=scratch,
                    proof_gpu_us=1e-3,
                )
            raise _HardFailure(f"required dense Q4 compatibility V2 proof failed: {e}") from None
        try:
            proof_gpu_us = cal.gpu_interval_us(start, end, f"the dense Q4 proof of {shape.key}")
        except Error as e:
            raise _HardFailure(str(e)) from None
        work = dict(
            proof_submissions=1,
            proof_route_dispatches=route_dispatches,
            proof_auxiliary_dispatches=aux,
            proof_scratch_bytes=scratch,
            proof_gpu_us=proof_gpu_us,
        )
        words = statuses.numpy().tolist()
        cand_failure = None
        for i, bits in enumerate(words):
            if bits & ~cal.STATUS_KNOWN_BITS:
                raise _HardFailure(f"dense Q4 proof for weight {i} returned unknown status bits 0x{bits:x}")
            if bits & cal.STATUS_CONTROL_BITS:
                raise _HardFailure(
                    f"required dense Q4 compatibility V2 proof failed for weight {i}: {cal.status_text(bits)}"
                )
            if bits & cal.STATUS_CANDIDATE_BITS and cand_failure is None:
                cand_failure = f"optional dense Q4 candidate proof failed for weight {i}: {cal.status_text(bits)}"
        if cand_failure is not None:
            return fallback(S.INCOHERENT_CANDIDATE, cand_failure, **work)

        # Timing, through the process cache (or the pinned outcome of a reloaded plan file).
        def materialise(outcome, cache_hit, timing_subs):
            timings = tuple(
                DenseQ4RouteTiming(
                    route,
                    DenseQ4TimingDistribution(*outcome["wall"][route.value]),
                    DenseQ4TimingDistribution(*outcome["gpu"][route.value]),
                    first_encoded if route is V2 else q4_expected_dispatch(C, m, n, registry=self.registry, k=k),
                    self.prep.identities[route],
                )
                for route in (V2, C)
                if route.value in outcome["wall"]
            )
            d = DenseQ4CalibrationDecision(
                shape=shape,
                selected_route=outcome["route"],
                status=outcome["status"],
                diagnostic=outcome.get("diagnostic"),
                timings=timings,
                process_cache_hit=cache_hit,
                authorized_weight_buffers=len(weights),
                **work,
                timing_submissions=timing_subs,
                calibration_submissions=1 + timing_subs,
            )
            return d

        if self.pinned is not None:
            outcome = self.pinned.get(shape.key)
            if outcome is None:
                raise _HardFailure(f"dense Q4 plan file has no decision for {shape}")
            return _ShapeOutcome(materialise(outcome, True, 0), False, False)
        key = (
            self.prep.build_fingerprint,
            self.device.name,
            self.device.registry_id,
            self.prep.pipeline_set_fingerprint,
            shape.key,
        )
        cached = cal.PROCESS_CACHE.get(key)
        if cached is not None:
            return _ShapeOutcome(materialise(cached, True, 0), False, False)
        timing_subs = 0
        rep = weights[0]

        def counted(route):
            nonlocal timing_subs
            self.subs.timing += 1
            timing_subs += 1

        try:
            samples = cal.alternating_timing(
                dev,
                (V2, C),
                self.deadline,
                lambda enc, route: encode_q4_route(enc, self.registry, inp, rep, control, shape.params(), route),
                counted,
                self.timer,
                "",
            )
        except cal.BudgetExceeded as b:
            cal.PROCESS_CACHE.evict(key)
            return fallback(S.BUDGET_FALLBACK, str(b), proof_failed=False, timing_submissions=timing_subs, **work)
        except Error as e:
            cal.PROCESS_CACHE.evict(key)
            raise _HardFailure(f"dense Q4 timing calibration failed after current-weight proof: {e}") from None
        dist = {
            route: (DenseQ4TimingDistribution.of(samples[route][0]), DenseQ4TimingDistribution.of(samples[route][1]))
            for route in (V2, C)
        }
        verdict = cal.select_winner(dist[V2][0], dist[V2][1], dist[C][0], dist[C][1])
        route, status = {
            cal.Verdict.CANDIDATE_WINS: (C, S.CALIBRATED_WINNER),
            cal.Verdict.CONTROL_FASTEST: (V2, S.COMPATIBILITY_FASTEST),
            cal.Verdict.NO_STABLE_WINNER: (V2, S.NO_STABLE_WINNER),
        }[verdict]
        outcome = {
            "route": route,
            "status": status,
            "wall": {r.value: dataclasses.astuple(dist[r][0]) for r in (V2, C)},
            "gpu": {r.value: dataclasses.astuple(dist[r][1]) for r in (V2, C)},
        }
        outcome = cal.PROCESS_CACHE.setdefault(key, outcome)
        return _ShapeOutcome(materialise(outcome, False, timing_subs), False, True)


class _TraceError(Exception):
    pass


def _run(registry, device, activation_epoch, limits, cases, *, progress, pinned=None, **hooks):
    """The run of KIND; hooks: _timer, _candidate_fault, _clock."""
    timer, fault, clock = (hooks.pop(name, None) for name in ("_timer", "_candidate_fault", "_clock"))
    if hooks:
        raise TypeError(f"dense Q4 calibration got unexpected options {sorted(hooks)}")
    limits = limits or DenseQ4CalibrationLimits()
    bases, declared = _validate_cases(activation_epoch, registry, limits, cases, device)
    deadline = cal.Deadline(limits.max_elapsed_ms, clock or cal.time.perf_counter)
    prep = _prepare(registry)
    rows_by_width: dict = {}
    for entry in bases:
        k = entry["base"].k
        rows_by_width[k] = max(rows_by_width.get(k, 0), max(entry["ms"]))
    outputs = [m * e["base"].n + cal.GUARD_ELEMENTS for e in bases for m in e["ms"]]
    scratch = cal.ProofScratch(device, rows_by_width, 2, max([g for g in outputs if g <= U32_MAX], default=0))
    c = _Calibrator(registry, device, activation_epoch, limits, prep, deadline, timer, fault, pinned, scratch)
    bar = cal.Progress(declared, "dense Q4 calibration", progress)
    decisions: list[DenseQ4CalibrationDecision] = []
    fresh = 0
    try:
        for entry in bases:
            weights = list(entry["weights"].values())
            outcomes = []
            for m in sorted(entry["ms"]):
                shape = entry["base"].with_m(m)
                o = c.shape(shape, weights)
                outcomes.append(o)
                cal.LOGGER.debug(
                    "dense Q4 shape m=%d n=%d k=%d: %s / %s%s%s",
                    m,
                    shape.n,
                    shape.k,
                    o.decision.selected_route.value,
                    o.decision.status.value,
                    " (process cache hit)" if o.decision.process_cache_hit else "",
                    f": {o.decision.diagnostic}" if o.decision.diagnostic else "",
                )
                bar.step(
                    {
                        "shape": shape.to_dict(),
                        "route": o.decision.selected_route.value,
                        "status": o.decision.status.value,
                    }
                )
            first = next((o for o in outcomes if o.proof_failed), None)
            for o in outcomes:
                d = o.decision
                if first is not None:
                    note = f"base-shape Cartesian proof failure: {first.decision.diagnostic}"
                    d = dataclasses.replace(
                        d,
                        selected_route=DenseQ4Route.COMPATIBILITY_V2,
                        status=first.decision.status,
                        diagnostic=f"{d.diagnostic}; {note}" if d.diagnostic else note,
                    )
                elif o.fresh_timing:
                    fresh += 1
                decisions.append(d)
        total_proof = sum(d.proof_submissions for d in decisions)
        total_timing = sum(d.timing_submissions for d in decisions)
        if total_proof + total_timing != c.subs.proof + c.subs.timing:
            raise _HardFailure("aggregate submission receipt is inconsistent")
    except _HardFailure as e:
        cal.cleanup_submission(device, c.subs)
        msg = str(e)
        if msg.startswith("required dense Q4 compatibility V2 proof failed for"):
            msg = f"required dense Q4 compatibility V2 proof failed: {msg}"
        raise InvalidArgumentError(msg) from None
    finally:
        bar.close()
    cal.cleanup_submission(device, c.subs)

    # Two complete plans before sampling the clock: the candidate plan and compatibility-only.
    routes = {d.shape.key: d.selected_route for d in decisions}
    primary = _make_plan(prep, registry, device, activation_epoch, routes)
    compat_routes = {key: DenseQ4Route.COMPATIBILITY_V2 for key in routes}
    compat = _make_plan(prep, registry, device, activation_epoch, compat_routes)
    compat_decisions = [
        dataclasses.replace(
            d,
            selected_route=DenseQ4Route.COMPATIBILITY_V2,
            status=DenseQ4SelectionStatus.BUDGET_FALLBACK,
            diagnostic="final dense Q4 calibration deadline exceeded; candidate disabled",
        )
        if d.selected_route is DenseQ4Route.TENSOR_64X32
        else d
        for d in decisions
    ]
    elapsed = deadline.elapsed_ms()
    overrun = max(0.0, elapsed - limits.max_elapsed_ms)
    plan, final = (compat, compat_decisions) if overrun > 0 else (primary, decisions)
    final = sorted(final, key=lambda d: d.shape.key)
    receipt = DenseQ4CalibrationBatchReceipt.of_calibration(
        plan,
        c.subs,
        elapsed,
        overrun,
        final,
        declared_shapes=declared,
        calibrated_decisions=fresh
        if overrun == 0
        else sum(1 for d in final if d.timing_submissions and d.status in _TIMED_STATUSES),
        compatibility_route_decisions=sum(d.selected_route is DenseQ4Route.COMPATIBILITY_V2 for d in final),
        authorized_shape_weight_pairs=sum(d.authorized_weight_buffers for d in final),
        proof_route_dispatches=sum(d.proof_route_dispatches for d in final),
        proof_auxiliary_dispatches=sum(d.proof_auxiliary_dispatches for d in final),
        peak_proof_scratch_bytes=max((d.proof_scratch_bytes for d in final), default=0),
        proof_gpu_us=sum(d.proof_gpu_us for d in final),
    )
    rp.set_origin(plan, rp.Origin(device, receipt))
    rp.freeze(KIND, registry, device, plan, check_fingerprint=False)
    return plan, receipt


def calibrate_dense_q4_routes(registry, device, activation_epoch, limits=None, cases=(), **options):
    """Prove, time and freeze dense Q4 routes for every declared exact shape (spec §6.4); returns
    (DenseQ4RoutePlan, DenseQ4CalibrationBatchReceipt), the plan frozen into `registry`.

    `limits` is a DenseQ4CalibrationLimits, `cases` DenseQ4CalibrationCase entries. Options:
    `progress(done, total, info)`, called after each exact shape, and the test hooks `_timer`,
    `_candidate_fault` and `_clock` (timing values, a forced candidate mismatch, the deadline clock).
    With ROUTEMM_PLAN_CACHE_DIR set, a matching saved plan is reloaded (proof re-run, timing
    skipped) and fresh plans are saved."""
    return rp.calibrate(KIND, registry, device, activation_epoch, limits, cases, **options)


def load_dense_q4_plan(path, registry, device, cases, **options):
    """Reload a saved dense Q4 plan (options: activation_epoch, limits, progress): every validator
    must match (else PlanFileMismatch), the declared shapes must equal the saved ones, the
    current-weight proof is re-run (timing is skipped), and a plan with the saved decisions is
    frozen into `registry` (new authority, so a new plan id). Returns (plan, receipt)."""
    return rp.load(KIND, path, registry, device, cases, **options)


# ---- Acceptance ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DenseQ4CartesianAcceptanceRequirements:
    expected_base_shapes: int
    expected_weight_buffers_per_base: int
    reachable_m: tuple[int, ...]
    required_compatibility_m: tuple[int, ...]
    minimum_candidate_decisions: int
    maximum_elapsed_ms: float


_HEX64 = frozenset("0123456789abcdef")


def _is_hex64(s) -> bool:
    return isinstance(s, str) and len(s) == 64 and set(s) <= _HEX64


def _expected_dispatch_for(backend: str, registries: dict):
    """q4_expected_dispatch as the receipts' backend encodes it: a registry of that backend opened
    in this process (the geometry comes from its registered kernels; on the CPU backend it is
    spec §6.2's reference geometry)."""
    if backend not in registries:
        try:
            registries[backend] = _core.KernelRegistry(_core.Device(backend))
        except Error as e:
            raise InvalidArgumentError(
                f"dense Q4 Cartesian acceptance failed: cannot derive {backend} geometry here: {e}"
            ) from None
    return registries[backend]


def validate_dense_q4_cartesian_acceptance(
    cold: DenseQ4CalibrationBatchReceipt,
    reactivation: DenseQ4CalibrationBatchReceipt,
    requirements: DenseQ4CartesianAcceptanceRequirements,
    *,
    registry=None,
) -> None:
    """Fail-closed publication gate over a cold and a cache-hit reactivation receipt (spec §6.5).

    Each timing's encoded dispatch must equal its route's expected dispatch: derived from
    `registry` when given, else from a registry of the backend the receipts' pipeline identities
    name (which must be available in this process)."""
    prefix = "dense Q4 Cartesian acceptance failed: "
    registries = {} if registry is None else {registry.device.backend: registry}

    def need(ok, message):
        if not ok:
            raise InvalidArgumentError(prefix + message)

    r = requirements
    need(
        r.expected_base_shapes > 0
        and r.expected_weight_buffers_per_base > 0
        and r.minimum_candidate_decisions > 0
        and r.maximum_elapsed_ms > 0,
        "requirement counts must be nonzero",
    )
    reach = list(r.reachable_m)
    need(
        reach and len(set(reach)) == len(reach) and all(m > 8 for m in reach),
        "reachable M must be non-empty, unique and all > 8",
    )
    need(
        len(set(r.required_compatibility_m)) == len(r.required_compatibility_m)
        and set(r.required_compatibility_m) <= set(reach),
        "required compatibility M must be unique and reachable",
    )
    declared = r.expected_base_shapes * len(reach)
    need(r.minimum_candidate_decisions <= declared, "minimum candidate decisions exceed declared shapes")
    pairs = declared * r.expected_weight_buffers_per_base
    W = r.expected_weight_buffers_per_base
    geometries: dict = {}  # (shape key, route) -> the cold calibration's encoded dispatch
    for label, rec, is_cold in (("cold", cold, True), ("reactivation", reactivation, False)):
        need(rec.schema_version == DENSE_Q4_RECEIPT_SCHEMA_VERSION, f"{label} receipt schema version")
        need(bool(rec.routemm_version), f"{label} receipt has no version")
        need(_is_hex64(rec.build_fingerprint) and _is_hex64(rec.plan_id), f"{label} fingerprint/plan id not 64-hex")
        need(
            bool(rec.device_name) and rec.activation_epoch != 0 and rec.registry_authority_id != 0,
            f"{label} receipt identity fields",
        )
        need(
            rec.declared_shapes == declared and len(rec.decisions) == declared,
            f"{label} declared shapes {rec.declared_shapes} / decisions {len(rec.decisions)}, expected {declared}",
        )
        need(rec.calibrated_decisions == (declared if is_cold else 0), f"{label} calibrated decisions")
        need(rec.process_cache_hits == (0 if is_cold else declared), f"{label} process cache hits")
        need(
            rec.authorized_shape_weight_pairs == pairs,
            f"{label} authorized pairs {rec.authorized_shape_weight_pairs}, expected {pairs}",
        )
        need(rec.proof_submissions == declared, f"{label} proof submissions")
        need(
            rec.proof_route_dispatches == 2 * pairs and rec.proof_auxiliary_dispatches == 2 * pairs,
            f"{label} proof dispatch counts",
        )
        timing = declared * 2 * cal.CALIBRATION_SAMPLES if is_cold else 0
        need(rec.timing_submissions == timing, f"{label} timing submissions")
        need(rec.cleanup_submissions == 1, f"{label} cleanup submissions")
        need(rec.calibration_submissions == declared + timing + 1, f"{label} calibration submissions")
        need(rec.peak_proof_scratch_bytes > 0, f"{label} peak proof scratch")
        need(math.isfinite(rec.proof_gpu_us) and rec.proof_gpu_us > 0, f"{label} proof GPU time")
        need(
            math.isfinite(rec.elapsed_ms) and 0 < rec.elapsed_ms <= r.maximum_elapsed_ms,
            f"{label} elapsed {rec.elapsed_ms} ms exceeds {r.maximum_elapsed_ms} ms",
        )
        need(rec.deadline_overrun_ms == 0, f"{label} deadline overrun {rec.deadline_overrun_ms} ms")
        seen = set()
        bases = set()
        candidates = compat = 0
        for d in rec.decisions:
            s = d.shape
            need(s.m in reach, f"{label} non-Cartesian shape M={s.m}")
            need(s.key not in seen, f"{label} duplicate shape {s.key}")
            seen.add(s.key)
            bases.add(s.key[1:])
            need(d.authorized_weight_buffers == W, f"{label} authorized buffers at M={s.m}")
            need(
                d.proof_submissions == 1
                and d.proof_route_dispatches == 2 * W
                and d.proof_auxiliary_dispatches == 2 * W,
                f"{label} proof work at M={s.m}",
            )
            t = 2 * cal.CALIBRATION_SAMPLES if is_cold else 0
            need(d.timing_submissions == t and d.calibration_submissions == 1 + t, f"{label} submissions at M={s.m}")
            need(d.process_cache_hit == (not is_cold), f"{label} cache-hit flag at M={s.m}")
            need(d.proof_scratch_bytes > 0 and d.proof_gpu_us > 0, f"{label} proof evidence at M={s.m}")
            pair = (d.selected_route, d.status)
            need(
                pair
                in (
                    (DenseQ4Route.TENSOR_64X32, DenseQ4SelectionStatus.CALIBRATED_WINNER),
                    (DenseQ4Route.COMPATIBILITY_V2, DenseQ4SelectionStatus.COMPATIBILITY_FASTEST),
                    (DenseQ4Route.COMPATIBILITY_V2, DenseQ4SelectionStatus.NO_STABLE_WINNER),
                )
                and d.diagnostic is None,
                f"{label} fallback decision at M={s.m}: {d.status.value} {d.diagnostic}",
            )
            need(
                len(d.timings) == 2
                and {t.route for t in d.timings} == {DenseQ4Route.COMPATIBILITY_V2, DenseQ4Route.TENSOR_64X32},
                f"{label} timings at M={s.m}",
            )
            for t in d.timings:
                for dist in (t.wall, t.gpu):
                    need(
                        dist.samples == cal.CALIBRATION_SAMPLES
                        and all(math.isfinite(v) for v in (dist.p25_us, dist.median_us, dist.p75_us))
                        and 0 < dist.p25_us <= dist.median_us <= dist.p75_us,
                        f"{label} timing distribution at M={s.m}",
                    )
                p = t.pipeline
                need(
                    p.schema_version == IDENTITY_SCHEMA_VERSION,
                    f"{label} pipeline identity schema_version {p.schema_version} at M={s.m}, "
                    f"expected {IDENTITY_SCHEMA_VERSION}",
                )
                # Origin-hash rule (spec §3.2, routemm's identities): whatever the origin, the
                # content hash is a 64-hex SHA-256 of the code the pipeline runs.
                need(bool(p.origin) and _is_hex64(p.content_sha256), f"{label} pipeline origin/hash at M={s.m}")
                need(t.encoded.pipeline_label == t.route.pipeline_label, f"{label} encoded pipeline at M={s.m}")
                reg = _expected_dispatch_for(p.backend, registries)
                need(
                    t.encoded == q4_expected_dispatch(t.route, s.m, s.n, registry=reg, k=s.k),
                    f"{label} {t.route.value} encoded geometry {t.encoded.grid} at M={s.m} is not the route's "
                    "expected dispatch",
                )
                cold_geometry = geometries.setdefault((s.key, t.route), t.encoded)
                need(t.encoded == cold_geometry, f"{label} geometry change at M={s.m}")
                need(
                    p.pipeline_label == t.route.pipeline_label
                    and p.kernel_name == t.route.pipeline_name
                    and p.pipeline_label.split("|")[0] == p.kernel_name,
                    f"{label} pipeline identity at M={s.m}",
                )
            if s.m in r.required_compatibility_m:
                need(
                    d.selected_route is DenseQ4Route.COMPATIBILITY_V2,
                    f"{label} selected the short-row candidate at required compatibility M={s.m}",
                )
            candidates += d.selected_route is DenseQ4Route.TENSOR_64X32
            compat += d.selected_route is DenseQ4Route.COMPATIBILITY_V2
        need(
            len(bases) == r.expected_base_shapes,
            f"{label} has {len(bases)} base shapes, expected {r.expected_base_shapes}",
        )
        need(all((m,) + b in seen for b in bases for m in reach), f"{label} is not Cartesian")
        need(candidates >= r.minimum_candidate_decisions, f"{label} has {candidates} candidate decisions")
        need(compat == rec.compatibility_route_decisions, f"{label} compatibility count")
    need(
        cold.build_fingerprint == reactivation.build_fingerprint
        and cold.routemm_version == reactivation.routemm_version
        and cold.device_name == reactivation.device_name
        and cold.device_registry_id == reactivation.device_registry_id,
        "receipts come from different builds/devices",
    )
    need(
        cold.activation_epoch != reactivation.activation_epoch
        and cold.registry_authority_id != reactivation.registry_authority_id
        and cold.plan_id != reactivation.plan_id,
        "reactivation must use a new epoch, authority and plan",
    )
    need(
        {d.shape.key: (d.selected_route, d.status) for d in cold.decisions}
        == {d.shape.key: (d.selected_route, d.status) for d in reactivation.decisions},
        "cold and reactivation decisions differ",
    )
