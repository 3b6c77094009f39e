"""The plan machinery every frozen route plan shares (dense_q4_plan, dense_matmul_id_plan).

A plan kind (a PlanKind subclass) names its records and overrides the hooks that differ (its
pipelines, fingerprint, checks, run and declared shapes); everything else lives here once: the
records' common parts (timing distributions, the activation identity every plan and receipt
carries, the fields every plan, plan decision, calibration decision and calibration receipt has,
lookup and saving, and `kind_record` for a kind's records that add only their schema), activation
preconditions, freezing into a registry, the frozen-plan store, the calibrate and load entry points
(the plan-cache protocol, reading a saved file and pinning its outcomes), and reloading a saved
plan file.

The common record parts are generic dataclasses: a kind's record derives from one with its own
types named as type arguments (`CalibrationDecision[DenseQ4Shape, DenseQ4Route, ...]`), adds the
fields only it has after the common ones, and mixes in JsonRecord, whose decoding reads the
inherited fields' types from those arguments.

Lifetimes: what the library keeps about a plan is owned by the registry it is frozen into or by
the plan object itself, never by a module-level table. A registry's frozen plans live in a
weak-keyed store (gone with the registry); the device, receipt and activation facts a plan was
made with travel on the plan object (`origin`; a copy of a plan finds it through the registries
its id is frozen into), so dropping registries and plans frees them all.

Reloading fails closed: a saved file is adopted only when its outer validators match this process,
its plan and receipt documents conform to their schemas, every field the plan body repeats agrees
with the validators and with the receipt, each decision names a route its kind can take, the
kind's own checks pass, and the plan id recomputed from the plan's contents is its id -- whether or
not the file holds a receipt. A receipt is read as strictly as the plan (read_receipt): numbers
within their ranges, integers written as integers, and lists and totals consistent with the rest of
the receipt. Any other file raises PlanFileMismatch, never another exception.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import typing
import weakref
from pathlib import Path
from typing import Any, ClassVar, Generic, Optional, TypeVar

from .. import _core
from ..core._errors import InvalidArgumentError
from ..core._json import JsonRecord
from . import calibration as cal

U64_MAX = 2**64 - 1


# ---- Records -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingDistribution:
    """p25 / median / p75 of one route's timing samples, in microseconds (spec §6.4)."""

    p25_us: float
    median_us: float
    p75_us: float
    samples: int

    @classmethod
    def of(cls, samples):
        return cls(*cal.distribution(samples))


@dataclasses.dataclass(frozen=True)
class ActivationIdentity:
    """What binds a plan (and the receipt it came with) to one activation: its id, the build, the
    device and the registry authority that froze it, and the activation epoch."""

    plan_id: str
    build_fingerprint: str
    device_name: str
    device_registry_id: int
    registry_authority_id: int
    activation_epoch: int

    def identity(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(ActivationIdentity))


# The types a plan kind names for the common record fields.
ShapeT = TypeVar("ShapeT")  # an exact call shape record (with a `key`)
RouteT = TypeVar("RouteT")  # the kind's route enum
StatusT = TypeVar("StatusT")  # the kind's selection status enum
TimingT = TypeVar("TimingT")  # one route's timing record
PlanDecisionT = TypeVar("PlanDecisionT")
CalibrationDecisionT = TypeVar("CalibrationDecisionT")


@dataclasses.dataclass(frozen=True)
class PlanDecision(Generic[ShapeT, RouteT]):
    """One entry of a plan: an exact shape and the route it takes."""

    shape: ShapeT
    route: RouteT


@dataclasses.dataclass(frozen=True)
class CalibrationDecision(Generic[ShapeT, RouteT, StatusT, TimingT]):
    """Why one exact shape takes its route: the status and diagnostic of its selection, the routes'
    timings, whether the process cache answered, and the submissions proving and timing it took
    (calibration_submissions is their sum). A kind adds its own proof and dispatch counts."""

    shape: ShapeT
    selected_route: RouteT
    status: StatusT
    diagnostic: Optional[str]
    timings: tuple[TimingT, ...]
    process_cache_hit: bool
    proof_submissions: int
    timing_submissions: int
    calibration_submissions: int


@dataclasses.dataclass(frozen=True)
class CalibrationReceipt(ActivationIdentity, Generic[CalibrationDecisionT]):
    """What one calibration did: the activation it made its plan for, the library version, how
    many shapes were declared, freshly calibrated or answered by the process cache, the
    submissions of every stage (calibration_submissions is their sum), the elapsed time and how far
    it ran past its deadline, and every shape's decision, sorted by shape."""

    routemm_version: str
    declared_shapes: int
    calibrated_decisions: int
    process_cache_hits: int
    proof_submissions: int
    timing_submissions: int
    cleanup_submissions: int
    calibration_submissions: int
    elapsed_ms: float
    deadline_overrun_ms: float
    decisions: tuple[CalibrationDecisionT, ...]

    @classmethod
    def of_calibration(cls, plan, subs: cal.Submissions, elapsed_ms: float, overrun_ms: float, decisions, **own):
        """The receipt of the calibration that made `plan` with `decisions`: the plan's activation
        identity, this library's version, the cache hits among `decisions` and the submissions
        `subs` counted; `own` gives declared_shapes, calibrated_decisions and the kind's own fields."""
        identity = {f.name: getattr(plan, f.name) for f in dataclasses.fields(ActivationIdentity)}
        return cls(
            **identity,
            routemm_version=_core.version(),
            process_cache_hits=sum(d.process_cache_hit for d in decisions),
            proof_submissions=subs.proof,
            timing_submissions=subs.timing,
            cleanup_submissions=subs.cleanup,
            calibration_submissions=subs.total,
            elapsed_ms=elapsed_ms,
            deadline_overrun_ms=overrun_ms,
            decisions=tuple(decisions),
            **own,
        )


@dataclasses.dataclass(frozen=True)
class Origin:
    """How a plan was made in this process: its device, the receipt of its calibration and, for
    kinds that keep one, what its activation bound it to. Held by the plan object only."""

    device: Any
    receipt: Any = None
    authority: Any = None


@dataclasses.dataclass(frozen=True)
class RoutePlan(ActivationIdentity, Generic[PlanDecisionT]):
    """A frozen plan: its activation identity and its decisions (PlanDecision records, sorted by
    shape), with lookup and saving. A kind's plan class sets KIND."""

    KIND: ClassVar["PlanKind"]

    decisions: tuple[PlanDecisionT, ...]

    @functools.cached_property
    def _lookup(self) -> dict:
        route = self.KIND.route_type
        return {d.shape.key: route(d.route) for d in self.decisions}

    def decision_count(self) -> int:
        return len(self.decisions)

    @property
    def origin(self) -> Optional["Origin"]:
        """How this plan was made or frozen in this process: its own, or that of the plan with its
        id frozen into a live registry (a copy made with dataclasses.replace or from JSON); None
        for a plan this process never made or froze."""
        return origin_of(self.KIND.name, self)

    def save(self, path, receipt=None) -> Path:
        """Write this plan (and the receipt it came with) as a versioned plan file."""
        origin = self.origin
        if origin is None:
            raise InvalidArgumentError(f"{self.KIND.label} route plan was not made by this process; cannot save it")
        receipt = receipt or origin.receipt
        return cal.write_plan_file(
            path,
            self.KIND.name,
            cal.plan_validators(origin.device, self.build_fingerprint),
            self.to_dict(),
            receipt.to_dict() if receipt is not None else None,
        )


def set_origin(plan, origin: Origin) -> None:
    """Attach `origin` to a (frozen) plan object; it is not part of the record's value or JSON."""
    object.__setattr__(plan, "_origin", origin)


def kind_record(module: str, name: str, base, schema: str, *, schema_version: Optional[int] = None) -> type:
    """The record class `name` of `module` that adds nothing to `base` (a generic record with its
    type arguments) but its schema file and, where given, its schema_version field: the per-kind
    name under which a schema's `$defs` describe it and JSON decoding finds its field types."""

    def body(ns):
        ns.update(__module__=module, __qualname__=name, SCHEMA=schema)
        ns["__doc__"] = f"{getattr(typing.get_origin(base) or base, '__doc__', '')}".strip() or None
        if schema_version is not None:
            ns["__annotations__"] = {"schema_version": int}
            ns["schema_version"] = schema_version

    return dataclasses.dataclass(frozen=True)(types.new_class(name, (base, JsonRecord), exec_body=body))


# ---- Plan kinds ----------------------------------------------------------------------------------


class PlanKind:
    """What differs between plan kinds, as the shared machinery needs it: a kind subclasses this,
    overrides the hooks that differ (the defaults suit a kind whose plan carries no more than its
    decisions) and is made once per module with its names and record types."""

    max_epoch: int = U64_MAX

    def __init__(self, name: str, label: str, plan_type: type, receipt_type: type, route_type: type, routes=()):
        self.name = name  # registry plan kind and plan-file kind, e.g. "dense_q4"
        self.label = label  # how messages name it, e.g. "dense Q4"
        self.plan_type, self.receipt_type, self.route_type = plan_type, receipt_type, route_type
        self.plannable_routes = tuple(routes or route_type)  # routes a saved decision may name
        plan_type.KIND = self

    def fail(self, message: str):
        raise InvalidArgumentError(f"{self.label} {message}")

    # -- Freezing and reloading
    def protected_names(self) -> list:
        """The pipelines a frozen plan depends on (re-registering them is refused afterwards)."""
        raise NotImplementedError

    def build_fingerprint(self, registry, plan) -> str:
        """The build fingerprint of `registry` now, for the plan's weight formats."""
        raise NotImplementedError

    def check_plan(self, plan) -> None:
        """Extra checks of a plan (or its receipt) before it is frozen or reloaded: raise
        InvalidArgumentError."""

    def recompute_plan_id(self, plan) -> str:
        """The plan id recomputed from the plan's own fields: every kind's plan carries all its id
        covers, so a reloaded plan's id is checked whether or not its file holds a receipt."""
        raise NotImplementedError

    def check_receipt(self, receipt) -> None:
        """The kind's own consistency checks of a saved receipt (its own totals and each decision's
        candidates, proofs and timings), after the common ones of check_receipt: raise
        InvalidArgumentError naming the field."""

    def upgrade_receipt(self, doc: dict) -> dict:
        """A saved receipt document of an earlier schema version rewritten as the current one, so
        plan files saved by earlier releases still load (documents it does not recognise pass
        unchanged)."""
        return doc

    def freeze_native(self, registry, plan, protected: list) -> None:
        """Freeze `plan` into the native registry; by default its id and document only. A kind
        whose native dispatcher reads the plan passes its decisions as well."""
        registry.freeze_plan(self.name, plan.plan_id, protected, plan.to_json())

    # -- Calibration (calibrate and load below drive these)
    def run(self, registry, device, epoch, limits, cases, *, progress, pinned=None, **test_hooks):
        """Validate `cases`, prove and time (or, with `pinned`, only prove) every declared shape,
        freeze the plan into `registry`; returns (plan, receipt)."""
        raise NotImplementedError

    def declared(self, registry, device, epoch, limits, cases) -> tuple:
        """(build fingerprint now, the exact shape keys `cases` declare); refuses bad cases."""
        raise NotImplementedError

    def cache_key(self, registry, device, epoch, limits, cases) -> Any:
        """What names the saved plan of `cases` under ROUTEMM_PLAN_CACHE_DIR."""
        raise NotImplementedError

    def explained_outcome(self, decision) -> dict:
        """The pinned outcome of a saved receipt's decision (route, status and its evidence)."""
        raise NotImplementedError

    def unexplained_outcome(self, route) -> dict:
        """The pinned outcome of a saved plan decision that no receipt explains."""
        raise NotImplementedError


# ---- The frozen-plan store -----------------------------------------------------------------------


@dataclasses.dataclass
class _RegistryPlans:
    frozen: dict = dataclasses.field(default_factory=dict)  # plan kind -> plan
    installed_for_worker: set = dataclasses.field(default_factory=set)  # (plan kind, plan id)


_STORE: "weakref.WeakKeyDictionary[Any, _RegistryPlans]" = weakref.WeakKeyDictionary()
_STORE_LOCK = threading.Lock()


def _plans_of(registry) -> _RegistryPlans:
    with _STORE_LOCK:
        entry = _STORE.get(registry)
        if entry is None:
            entry = _STORE[registry] = _RegistryPlans()
        return entry


def frozen_plan(registry, kind: str):
    """The plan frozen into `registry` for `kind`, or None."""
    entry = _STORE.get(registry)
    return None if entry is None else entry.frozen.get(kind)


def store_size() -> int:
    """How many live registries hold a frozen plan (the store empties as registries are dropped)."""
    return len(_STORE)


def origin_of(kind: str, plan) -> Optional[Origin]:
    own = plan.__dict__.get("_origin")
    if own is not None:
        return own
    with _STORE_LOCK:
        entries = list(_STORE.values())
    for entry in entries:
        frozen = entry.frozen.get(kind)
        if frozen is not None and frozen.plan_id == plan.plan_id and "_origin" in frozen.__dict__:
            return frozen.__dict__["_origin"]
    return None


def install(registry, kind: PlanKind, plan, *, worker: bool = False) -> None:
    """Freeze `plan` into `registry` (one-shot per kind; the same id again is a no-op) and protect
    the pipelines it depends on."""
    entry = _plans_of(registry)
    with _STORE_LOCK:
        protected = sorted(set(kind.protected_names()))
        kind.freeze_native(registry, plan, protected)
        entry.frozen.setdefault(kind.name, plan)
        if worker:
            entry.installed_for_worker.add((kind.name, plan.plan_id))


def installed_for_worker(registry, kind: PlanKind, plan) -> bool:
    entry = _STORE.get(registry)
    return (
        entry is not None
        and (kind.name, plan.plan_id) in entry.installed_for_worker
        and registry.frozen_plan_id(kind.name) == plan.plan_id
    )


# ---- Activation preconditions and freezing -------------------------------------------------------


def check_activation(kind: PlanKind, registry, epoch, limits: tuple) -> None:
    """Refuse a bad epoch, a registry that already holds a plan of this kind, and zero limits."""
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 < epoch <= kind.max_epoch:
        if epoch == 0 and not isinstance(epoch, bool):
            kind.fail("activation epoch must be nonzero (got 0)")
        kind.fail(f"activation epoch must be an integer within 1..={kind.max_epoch}, got {epoch!r}")
    frozen = registry.frozen_plan_id(kind.name)
    if frozen is not None:
        kind.fail(f"route plan is already frozen as {frozen}; calibration is one-shot")
    if any(limit <= 0 for limit in limits):
        kind.fail("calibration limits must be nonzero")


def check_device(kind: PlanKind, device, plan) -> None:
    if plan.device_registry_id != device.registry_id or plan.device_name != device.name:
        kind.fail("route plan belongs to a different device")


def freeze(kind: PlanKind, registry, device, plan, *, check_fingerprint: bool = True) -> None:
    """Freeze `plan` into `registry`: the plan's own registry authority and device, the kind's
    checks, one-shot (the same plan id again is a no-op), and -- unless the caller just computed
    it -- the build/pipeline fingerprint recomputed now must equal the plan's."""
    if not isinstance(plan, kind.plan_type):
        kind.fail(f"freeze needs a {kind.plan_type.__name__}, got {type(plan).__name__}")
    if plan.registry_authority_id != registry.authority_id:
        kind.fail("route plan belongs to a different registry activation authority")
    check_device(kind, device, plan)
    kind.check_plan(plan)
    existing = registry.frozen_plan_id(kind.name)
    if existing is not None:
        if existing == plan.plan_id:
            return
        kind.fail(f"route plan is already frozen as {existing}")
    if check_fingerprint and kind.build_fingerprint(registry, plan) != plan.build_fingerprint:
        kind.fail("route plan build/pipeline identity mismatch")
    if plan.origin is None:
        set_origin(plan, Origin(device))
    install(registry, kind, plan)


# ---- Plan files ----------------------------------------------------------------------------------


def calibrate(kind: PlanKind, registry, device, activation_epoch, limits=None, cases=(), *, progress=None, **hooks):
    """The calibrate entry point of every kind: prove, time and freeze the kind's routes for every
    declared case; returns (plan, receipt). With ROUTEMM_PLAN_CACHE_DIR set, a saved plan for the
    same cases, build and device is reloaded (proof re-run, timing skipped; a mismatching file is
    logged and ignored) and a fresh plan is saved there. `progress(done, total, info)` is called
    after each exact shape; `hooks` are the kind's test hooks (`_timer`, `_clock`, ...)."""
    cases = list(cases)
    knob_set = bool(cal.os.environ.get(cal.PLAN_CACHE_DIR_KNOB, "").strip())
    path = None
    if knob_set and cases:
        path = cal.plan_cache_path(kind.name, kind.cache_key(registry, device, activation_epoch, limits, cases))
    if path is not None and path.exists():
        try:
            return load(
                kind, path, registry, device, cases, activation_epoch=activation_epoch, limits=limits, progress=progress
            )
        except cal.PlanFileMismatch as e:
            cal.LOGGER.warning("ignoring saved %s plan: %s", kind.label, e)
    plan, receipt = kind.run(registry, device, activation_epoch, limits, cases, progress=progress, **hooks)
    if path is not None:
        plan.save(path, receipt)
    return plan, receipt


def load(kind: PlanKind, path, registry, device, cases, *, activation_epoch=None, limits=None, progress=None):
    """The load entry point of every kind: reload a saved plan file. Every validator must match
    (else PlanFileMismatch), the declared exact shapes must equal the saved ones, the current-weight
    proof is re-run (timing is skipped: the saved receipt's outcomes are pinned), and a plan with
    the saved decisions is frozen into `registry` (a new authority, so a new plan id). Without
    `activation_epoch` the saved plan's epoch is reused."""
    cases = list(cases)
    build_fp, keys = kind.declared(registry, device, activation_epoch, limits, cases)
    saved, receipt = read_saved_plan(kind, path, cal.plan_validators(device, build_fp))
    if not keys or set(keys) != set(saved._lookup):
        raise cal.PlanFileMismatch(f"route plan file {path} was made for different shapes than the cases declare")
    pinned = {d.shape.key: kind.explained_outcome(d) for d in (receipt.decisions if receipt is not None else ())}
    for d in saved.decisions:
        pinned.setdefault(d.shape.key, kind.unexplained_outcome(d.route))["route"] = d.route  # the plan decides
    epoch = saved.activation_epoch if activation_epoch is None else activation_epoch
    return kind.run(registry, device, epoch, limits, cases, progress=progress, pinned=pinned)


def read_saved_plan(kind: PlanKind, path, validators: dict):
    """(plan, receipt or None) of the plan file at `path`, adopted only when it is whole and
    consistent (see the module docstring); otherwise PlanFileMismatch."""
    plan_doc, receipt_doc = cal.read_plan_file(path, kind.name, validators)
    what = "malformed plan"
    try:
        plan = kind.plan_type.from_dict(plan_doc, exact_integers=True)
        what = "malformed calibration receipt"
        receipt = None if receipt_doc is None else read_receipt(kind, receipt_doc)
        what = "plan altered after it was saved"
        _check_saved(kind, plan, receipt, validators)
    except InvalidArgumentError as e:
        raise cal.PlanFileMismatch(f"route plan file {path} holds a {what}: {e}") from None
    return plan, receipt


def _check_saved(kind: PlanKind, plan, receipt, validators: dict) -> None:
    repeated = {
        "build_fingerprint": plan.build_fingerprint,
        "device_name": plan.device_name,
        "device_registry_id": plan.device_registry_id,
    }
    for name, value in repeated.items():
        if validators.get(name) != value:
            kind.fail(f"plan body says {name} {value!r}, its file's validators {validators.get(name)!r}")
    for name, low in (("device_registry_id", 0), ("registry_authority_id", 0), ("activation_epoch", 1)):
        if not low <= getattr(plan, name) <= U64_MAX:
            kind.fail(f"plan {name} {getattr(plan, name)} is outside {low}..={U64_MAX}")
    kind.check_plan(plan)
    keys = [d.shape.key for d in plan.decisions]
    if keys != sorted(set(keys)):
        kind.fail("plan decisions are not sorted by shape, or repeat a shape")
    for d in plan.decisions:
        if kind.route_type(d.route) not in kind.plannable_routes:
            kind.fail(f"plan decides {kind.route_type(d.route).value}, which no calibration chooses")
    if kind.recompute_plan_id(plan) != plan.plan_id:
        kind.fail("plan id does not match the plan's contents")
    if receipt is None:
        return
    kind.check_plan(receipt)
    if receipt.identity() != plan.identity():
        kind.fail("receipt was made by another activation than the plan (plan id, build, device or authority)")
    chosen = {d.shape.key: kind.route_type(d.selected_route) for d in receipt.decisions}
    if chosen != plan._lookup:
        kind.fail("receipt decisions differ from the plan's")


# ---- Saved receipts --------------------------------------------------------------------------------


def read_receipt(kind: PlanKind, doc):
    """The calibration receipt of a saved receipt document, adopted only when it is whole and
    consistent: rewritten from an earlier schema version where the kind can, conforming to its
    schema (numbers within their ranges) with every integer written as an integer, and consistent
    with itself (check_receipt). Otherwise InvalidArgumentError naming the field."""
    receipt = kind.receipt_type.from_dict(kind.upgrade_receipt(doc), exact_integers=True)
    check_receipt(kind, receipt)
    return receipt


def check_receipt(kind: PlanKind, receipt) -> None:
    """What every calibration receipt's own structure implies, then the kind's own checks: one
    decision per declared shape, sorted by shape; its totals the sums of its decisions'; at most one
    cleanup submission; no more fresh calibrations than decisions that were not cache hits; an
    overrun within the elapsed time; each decision's submissions adding up; and every timing
    distribution ordered (p25 <= median <= p75)."""

    def fail(field: str, message: str):
        kind.fail(f"calibration receipt {field} {message}")

    decisions = receipt.decisions
    if receipt.declared_shapes != len(decisions):
        fail("declared_shapes", f"is {receipt.declared_shapes}, but the receipt holds {len(decisions)} decisions")
    keys = [d.shape.key for d in decisions]
    if keys != sorted(set(keys)):
        fail("decisions", "are not sorted by shape, or repeat a shape")
    totals = {
        "process_cache_hits": sum(d.process_cache_hit for d in decisions),
        "proof_submissions": sum(d.proof_submissions for d in decisions),
        "timing_submissions": sum(d.timing_submissions for d in decisions),
    }
    for name, total in totals.items():
        if getattr(receipt, name) != total:
            fail(name, f"is {getattr(receipt, name)}, but its decisions add up to {total}")
    if receipt.cleanup_submissions > 1:
        fail("cleanup_submissions", f"is {receipt.cleanup_submissions}; a calibration submits at most one")
    total = receipt.proof_submissions + receipt.timing_submissions + receipt.cleanup_submissions
    if receipt.calibration_submissions != total:
        fail("calibration_submissions", f"is {receipt.calibration_submissions}, not proof + timing + cleanup = {total}")
    fresh = sum(not d.process_cache_hit for d in decisions)
    if receipt.calibrated_decisions > fresh:
        fail(
            "calibrated_decisions", f"is {receipt.calibrated_decisions}, but only {fresh} decisions were not cache hits"
        )
    if receipt.deadline_overrun_ms > receipt.elapsed_ms:
        fail("deadline_overrun_ms", f"{receipt.deadline_overrun_ms} exceeds elapsed_ms {receipt.elapsed_ms}")
    for i, d in enumerate(decisions):
        if d.calibration_submissions != d.proof_submissions + d.timing_submissions:
            fail(f"decisions[{i}].calibration_submissions", "is not proof_submissions + timing_submissions")
        for j, t in enumerate(d.timings):
            for clock in ("wall", "gpu"):
                dist = getattr(t, clock)
                if not dist.p25_us <= dist.median_us <= dist.p75_us:
                    fail(f"decisions[{i}].timings[{j}].{clock}.p25_us", "median_us and p75_us are not in order")
    kind.check_receipt(receipt)
