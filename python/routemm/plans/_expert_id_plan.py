"""The records and the calibration every expert-ID plan kind shares (dense_matmul_id_plan,
quantized_matmul_id_plan).

An expert-ID calibration proves each candidate route against direct on two routing profiles and
times them; its receipts and plan carry the same evidence whatever the weight format. The records
here are generic over a kind's shape, route, timing, proof, decision and primitive-receipt types;
`ExpertIdRecords.declare` makes one kind's concrete record classes (named for its schema files)
in one call, so a kind module declares only its shape record and its routes.

The calibration (the proof pool, the calibrator, proof status, authority digest, plan id, the run
hook and auto resolution) is written once against ExpertIdOp, the hooks through which a kind names
its op: how a case becomes a shape, which candidates a shape can take, the pipelines and encoding
of a route, the ids of each routing profile, and each candidate's coherence policy -- bit identity
with direct, a relative Frobenius tolerance, or an element-wise bound computed on the host.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import struct
import typing
from typing import ClassVar, Generic, Optional, TypeVar

import numpy as np

from ..core._core_api import DType
from ..core._errors import Error, InvalidArgumentError
from ..ops.dense_matmul_id import DenseMatmulIdInputLayout, DenseMatmulIdScratch
from ..ops.quantized_matmul import GgmlRoutingPolicy, GgmlTensorMmPreference, ggml_routing_policy
from . import _route_plan as rp
from . import calibration as cal


class DenseMatmulIdRoutingProfile(enum.Enum):
    BALANCED = "balanced"  # ids (token + slot) mod E
    MAXIMALLY_SKEWED_DISTINCT = "maximally_skewed_distinct"  # ids = slot: every token on the same experts


class DenseMatmulIdSelectionStatus(enum.Enum):
    CALIBRATED_WINNER = "calibrated_winner"
    DIRECT_FASTEST = "direct_fastest"
    NO_STABLE_WINNER = "no_stable_winner"
    DIRECT_ONLY = "direct_only"
    INCOHERENT_GROUPED = "incoherent_grouped"
    BUDGET_FALLBACK = "budget_fallback"
    ERROR_FALLBACK = "error_fallback"


class DenseMatmulIdDecisionSource(enum.Enum):
    FROZEN_PLAN = "frozen_plan"
    UNDECLARED_DIRECT = "undeclared_direct"


def _key_part(value):
    """A shape field as its plan key holds it: a DType by its type name, an enum by its value."""
    if hasattr(value, "type_name"):
        return value.type_name
    return value.value if isinstance(value, enum.Enum) else value


class ExpertIdShape:
    """What every expert-ID kind's exact-shape record (a frozen dataclass of the weight format, m,
    then the other params fields but the route) gives the plan: its key (the fields in order, as
    _key_part writes them), its base (the key without m: what an undeclared m of a declared shape
    falls back on) and the params of a route. PARAMS names the op's params record."""

    PARAMS: ClassVar[type]

    @property
    def key(self) -> tuple:
        return tuple(_key_part(getattr(self, f.name)) for f in dataclasses.fields(self))

    @property
    def base_key(self) -> tuple:
        return self.key[:1] + self.key[2:]

    def params(self, route):
        """The op's params for this shape and `route`."""
        taken = {f.name for f in dataclasses.fields(self.PARAMS)}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in taken}
        return self.PARAMS(**fields, route=route)

    @classmethod
    def from_params(cls, params, **given):
        """The shape of a call with `params`, and `given` the fields its params lack (the weight
        dtype of a dense call); enum fields are coerced to their enums."""
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            value = given[f.name] if f.name in given else getattr(params, f.name)
            kind = hints.get(f.name)
            values[f.name] = kind(value) if isinstance(kind, type) and issubclass(kind, enum.Enum) else value
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ExpertIdCalibrationCase:
    """One declared exact shape: the expert stack buffer it runs on and the op's params (their
    route is ignored)."""

    weight: object  # routemm.Buffer of the expert stack
    params: object


@dataclasses.dataclass(frozen=True)
class ExpertIdCalibrationLimits:
    """Bounds of one expert-ID calibration: its elapsed time, declared shapes and submissions."""

    max_elapsed_ms: int = 15_000
    max_cases: int = 256
    max_submissions: int = 6_145


ShapeT, RouteT, TimingT = TypeVar("ShapeT"), TypeVar("RouteT"), TypeVar("TimingT")
ProofT, PlanDecisionT, DecisionT, PrimitiveT = (
    TypeVar("ProofT"),
    TypeVar("PlanDecisionT"),
    TypeVar("DecisionT"),
    TypeVar("PrimitiveT"),
)


@dataclasses.dataclass(frozen=True)
class ExpertIdRouteTiming(Generic[RouteT, TimingT]):
    """One route's wall and GPU timing distributions on one routing profile."""

    profile: DenseMatmulIdRoutingProfile
    route: RouteT
    wall: TimingT
    gpu: TimingT


@dataclasses.dataclass(frozen=True)
class ExpertIdCandidateProof(Generic[RouteT]):
    """One candidate on one profile: bit-exact (tolerance 0) or within its documented tolerance."""

    route: RouteT
    profile: DenseMatmulIdRoutingProfile
    tolerance: float
    rel_frobenius_error: float
    status_bits: int
    coherent: bool
    diagnostic: Optional[str]


@dataclasses.dataclass(frozen=True)
class ExpertIdCalibrationDecision(
    rp.CalibrationDecision[ShapeT, RouteT, DenseMatmulIdSelectionStatus, TimingT],
    Generic[ShapeT, RouteT, TimingT, ProofT],
):
    """Why one exact shape takes its route: besides the common fields, the candidates it had and
    their proofs, how many weight identities the value-independence theorem authorised, and the
    proof and timing dispatches."""

    candidates: tuple[RouteT, ...]
    proofs: tuple[ProofT, ...]
    theorem_authorized_weight_identities: int
    proof_dispatches: int
    timing_dispatches: int


@dataclasses.dataclass(frozen=True)
class ExpertIdRoutePlan(rp.RoutePlan[PlanDecisionT]):
    """A frozen expert-ID plan: besides the common fields, the authority digest of the activation
    that made it (which its plan id covers, so the id can be recomputed from the plan alone) and
    the value-independence theorem its decisions rest on."""

    authority_digest: str
    theorem_sha256: str

    @functools.cached_property
    def _bases(self) -> frozenset:
        return frozenset(d.shape.base_key for d in self.decisions)


@dataclasses.dataclass(frozen=True)
class ExpertIdCalibrationReceipt(rp.CalibrationReceipt[DecisionT]):
    """What one expert-ID calibration did: besides the common fields, the theorem it relied on,
    how many shapes kept the direct route, and the proof and timing dispatches."""

    theorem_sha256: str
    direct_decisions: int
    proof_dispatches: int
    timing_dispatches: int


@dataclasses.dataclass(frozen=True)
class ExpertIdAutoReceipt(Generic[RouteT, PrimitiveT]):
    """What an auto call did: the route, why (frozen plan or undeclared direct), the plan's epoch
    and the primitive call's receipt."""

    route: RouteT
    decision_source: DenseMatmulIdDecisionSource
    activation_epoch: int
    primitive: PrimitiveT


@dataclasses.dataclass(frozen=True)
class ExpertIdRecords:
    """One expert-ID kind's concrete record classes."""

    timing: type
    route_timing: type
    proof: type
    decision: type
    plan_decision: type
    plan: type
    receipt: type
    auto_receipt: type

    @classmethod
    def declare(cls, module: str, prefix: str, shape, route, primitive, schema_version: int):
        """The records of the kind whose classes are named `prefix` + the record's role (as its
        schema files' `$defs` name them), in `module`; the plan in `{schema}_route_plan`, the
        calibration evidence in `{schema}_calibration_receipt`, the auto receipt in
        `{schema}_plan_auto_receipt` (schema: the prefix's snake case, e.g. dense_matmul_id)."""
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in prefix).lstrip("_")
        plan_s, receipt_s = f"{snake}_route_plan.schema.json", f"{snake}_calibration_receipt.schema.json"
        auto_schema = f"{snake}_plan_auto_receipt.schema.json"

        def record(role, base, schema, versioned=False):
            return rp.kind_record(
                module, prefix + role, base, schema, schema_version=schema_version if versioned else None
            )

        timing = record("TimingDistribution", rp.TimingDistribution, receipt_s)
        proof = record("CandidateProof", ExpertIdCandidateProof[route], receipt_s)
        route_timing = record("RouteTiming", ExpertIdRouteTiming[route, timing], receipt_s)
        decision = record(
            "CalibrationDecision", ExpertIdCalibrationDecision[shape, route, route_timing, proof], receipt_s
        )
        plan_decision = record("PlanDecision", rp.PlanDecision[shape, route], plan_s)
        plan = record("RoutePlan", ExpertIdRoutePlan[plan_decision], plan_s, True)
        receipt = record("CalibrationReceipt", ExpertIdCalibrationReceipt[decision], receipt_s, True)
        auto = record("AutoReceipt", ExpertIdAutoReceipt[route, primitive], auto_schema, True)
        return cls(timing, route_timing, proof, decision, plan_decision, plan, receipt, auto)


# ---- The calibration every expert-ID kind runs ------------------------------------------------------

# Every output element and guard element is set to this before a proof submission (spec §7.6).
POISON_BITS = 0x7FC000C7
# The proof input: a fixed pattern of edge values (signed zero, a tiny normal, non-dyadic fractions),
# repeated over the flat index, so an (m, k) input is the first m * k values of the longest one.
ADVERSARIAL = np.array([1.0, -0.0, 0.0078125, -3.5, 1.0009766, -0.33333334, 6.1035156e-05, 2.75], np.float32)
# A coherence policy that is neither bit identity (0.0) nor a relative Frobenius tolerance: every
# element of the candidate within ExpertIdOp.proof_bound of direct's.
ELEMENTWISE_BOUND = "elementwise_bound"


class ExpertIdOp:
    """What an expert-ID kind's calibration needs of its op: a kind subclasses this, sets the
    attributes and overrides the hooks. `fmt` is a shape's weight format (a DType or a GgmlType).
    Made with the kind's plan name, which names its authority digest's and build fingerprint's
    domain tags."""

    label: str  # how messages name the op, e.g. "dense_matmul_id"
    theorem_sha256: str
    schema_version: int
    direct: enum.Enum  # the direct route (its enum is the kind's route type)
    candidates: tuple  # the routes proved against direct, in preference order
    tensor_routes: tuple = ()  # the candidates on tensor-core kernels (GgmlRoutingPolicy.expert_tensor_mm)
    known_pipelines: tuple  # pipelines every backend registers (the rest count only where registered)
    records: ExpertIdRecords

    def __init__(self, plan_kind: str):
        self.digest_tag = f"routemm.{plan_kind}.authority".encode()
        self.fingerprint_tag = f"routemm.{plan_kind}_plan"
        self.route_type = type(self.direct)

    def checked_case(self, case):
        """The exact shape of a calibration case (its params' route ignored); refuses a weight
        buffer too small or misaligned for it."""
        raise NotImplementedError

    def weight_format(self, shape):
        raise NotImplementedError

    def capability(self, shape, route) -> None:
        """Raise InvalidArgumentError where `route` cannot take `shape` (e.g. distinct ids with
        top_k > n_experts)."""
        raise NotImplementedError

    def route_pipelines(self, route, fmt) -> list:
        raise NotImplementedError

    def encode(self, registry, encoder, shape, route, weight, inp, ids, out, scratch) -> None:
        raise NotImplementedError

    def ids(self, shape, profile: DenseMatmulIdRoutingProfile) -> np.ndarray:
        """The U32 [m, top_k] ids of `profile`: balanced (token + slot) mod E, maximally skewed the
        slot index (every token on the same experts)."""
        t = np.arange(shape.m, dtype=np.int64)[:, None]
        s = np.arange(shape.top_k, dtype=np.int64)[None, :]
        ids = (t + s) % shape.n_experts if profile is DenseMatmulIdRoutingProfile.BALANCED else s + 0 * t
        return np.ascontiguousarray(ids, dtype=np.uint32)

    def tolerance(self, device, route):
        """The coherence policy of `route` on `device`: 0.0 (bit identity with direct), a relative
        Frobenius tolerance, or ELEMENTWISE_BOUND."""
        raise NotImplementedError

    def proof_bound(self, shape, weight, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The element-wise bound on |candidate - direct| (F64 [m * top_k, n]) of an
        ELEMENTWISE_BOUND route for input `x` and `ids`."""
        raise NotImplementedError


def input_rows(shape) -> int:
    return shape.m * (shape.top_k if shape.input_layout is DenseMatmulIdInputLayout.SLOTTED else 1)


def route_dispatches(route) -> int:
    """Dispatches one call of `route` encodes: the direct routes 1, every grouped route map + grouped."""
    return 2 if route.is_grouped else 1


@dataclasses.dataclass(frozen=True)
class Authority:
    """What the primary activation that made a plan bound it to (kept on the plan's origin)."""

    epoch: int
    digest: str
    shape_keys: frozenset
    build_fingerprint: str
    identities: dict  # pipeline label -> identity dict


class Abort(Exception):
    """A failure that ends a calibration (after its cleanup submission) with InvalidArgumentError."""


def prepare(op: ExpertIdOp, registry, formats) -> tuple:
    """(build fp, pipeline-set fp, identities by name, None, errors by pipeline name). The proof
    runs on the host, so only the route pipelines enter the fingerprint."""
    names = set()
    for fmt in formats:
        for route in op.route_type:
            for name in op.route_pipelines(route, fmt):
                if name in op.known_pipelines or registry.has_kernel(name):
                    names.add(name)
    identities, errors = {}, {}
    for name in sorted(names):
        try:
            identities[name] = registry.get_pipeline(name).identity
        except Error as e:
            errors[name] = str(e)
    build_fp, pset = cal.build_fingerprint(
        op.fingerprint_tag + ":" + op.theorem_sha256, op.schema_version, identities.values()
    )
    return build_fp, pset, identities, None, errors


def formats_of(op: ExpertIdOp, shapes) -> set:
    return {op.weight_format(s) for s in shapes}


def collect_cases(op: ExpertIdOp, cases, max_cases: Optional[int]) -> list:
    """Validated case entries sorted by shape key: {"shape", "weights": {logical identity: buffer}}."""
    if not cases:
        raise InvalidArgumentError(f"{op.label} calibration requires at least one case")
    shapes: dict = {}
    for case in cases:
        shape = op.checked_case(case)
        w = case.weight
        entry = shapes.setdefault(shape.key, {"shape": shape, "weights": {}})
        entry["weights"].setdefault((w.address, w.byte_offset, w.nbytes), w)
    if max_cases is not None and len(shapes) > max_cases:
        raise InvalidArgumentError(f"{op.label} calibration declares {len(shapes)} shapes; limit is {max_cases}")
    return [shapes[k] for k in sorted(shapes)]


def authority_digest(op: ExpertIdOp, device, epoch: int, entries) -> str:
    """The activation authority digest (spec §7.6 step 2): SHA-256 over the op's domain tag, the
    epoch, the device id and name, and every declared shape (canonical JSON, length-prefixed) with
    its sorted logical weight identities (address, byte_offset, nbytes) -- the weights the
    activation borrows."""
    parts = [
        op.digest_tag,
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


def plan_id(op: ExpertIdOp, build_fp, device_registry_id, authority_id, epoch, digest, decisions) -> str:
    return cal.sha256_hex(
        build_fp.encode(),
        struct.pack("<QQQ", device_registry_id, authority_id, epoch),
        digest.encode(),
        cal.canonical_json([[d.shape.to_dict(), op.route_type(d.route).value] for d in decisions]).encode(),
    )


def make_plan(op: ExpertIdOp, build_fp, registry, device, epoch, routes, digest):
    decisions = tuple(op.records.plan_decision(s, r) for s, r in sorted(routes, key=lambda t: t[0].key))
    pid = plan_id(op, build_fp, device.registry_id, registry.authority_id, epoch, digest, decisions)
    return op.records.plan(
        plan_id=pid,
        build_fingerprint=build_fp,
        device_name=device.name,
        device_registry_id=device.registry_id,
        registry_authority_id=registry.authority_id,
        activation_epoch=epoch,
        authority_digest=digest,
        theorem_sha256=op.theorem_sha256,
        decisions=decisions,
    )


def proof_status(control: np.ndarray, candidate: Optional[np.ndarray], logical: int) -> int:
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


def _rel_frobenius(got: np.ndarray, reference: np.ndarray) -> float:
    num = float(np.sqrt(np.sum((got - reference) ** 2))) if np.all(np.isfinite(got)) else math.inf
    den = float(np.sqrt(np.sum(reference**2)))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


class ProofPool:
    """Device buffers one calibration reuses across its shapes and profiles (a cal.ProofScratch
    holding the adversarial inputs, the control and candidate outputs, poisoned before every proof,
    and the status words, zeroed per proof), plus one grouped scratch of the largest expert and token
    counts."""

    def __init__(self, device, shapes, candidates: int):
        self._device = device
        rows: dict[int, int] = {}
        guarded = experts = tokens = 1
        for shape in shapes:
            rows[shape.k] = max(rows.get(shape.k, 0), input_rows(shape))
            guarded = max(guarded, shape.m * shape.top_k * shape.n + cal.GUARD_ELEMENTS)
            experts, tokens = max(experts, shape.n_experts), max(tokens, shape.m)
        self._proof = cal.ProofScratch(
            device,
            rows,
            1 + candidates,
            guarded,
            pattern=lambda count: np.resize(ADVERSARIAL, count),
            period=len(ADVERSARIAL),
        )
        self._capacity = (experts, tokens)
        self._scratch = None

    def input(self, rows: int, k: int):
        return self._proof.input(rows, k)

    @staticmethod
    def input_values(rows: int, k: int) -> np.ndarray:
        """The values `input(rows, k)` holds, on the host."""
        return np.resize(ADVERSARIAL, rows * k).reshape(rows, k)

    def outputs(self, guarded: int, count: int) -> list:
        """The control output and `count` candidate outputs, `guarded` F32 elements each."""
        return self._proof.outputs(guarded)[: 1 + count]

    def statuses(self, count: int):
        return self._proof.statuses(max(1, count))

    def scratch(self) -> DenseMatmulIdScratch:
        if self._scratch is None:
            self._scratch = DenseMatmulIdScratch(self._device, *self._capacity)
        return self._scratch


class Calibrator:
    """Proves and times one calibration's shapes (spec §7.6): per routing profile direct in a
    submission of its own, then each candidate in one of its own, into poisoned outputs; the
    coherent candidates are timed against direct and one is selected only if it wins both profiles."""

    def __init__(self, op: ExpertIdOp, registry, device, limits, prep, deadline, timer, pinned, pool):
        self.op = op
        self.registry, self.device, self.limits = registry, device, limits
        self.build_fp, self.pset, self.identities, self.proof, self.errors = prep
        self.deadline, self.timer, self.pinned = deadline, timer, pinned
        self.pool = pool
        self.subs = cal.Submissions()
        # GgmlRoutingPolicy.expert_tensor_mm (spec §4.1), the registry's frozen policy, else the
        # environment's: force_simd keeps the tensor-core candidates out of the calibration.
        policy = ggml_routing_policy(registry) or GgmlRoutingPolicy.from_environment()
        self.tensor_mm = GgmlTensorMmPreference(policy.expert_tensor_mm) is GgmlTensorMmPreference.AUTO_PROBE

    def _encode(self, encoder, shape, route, weight, inp, ids, out, scratch):
        self.op.encode(
            self.registry, encoder, shape, route, weight, inp, ids, out, scratch if route.is_grouped else None
        )

    def _submit(self, shape, route, weight, inp, ids, out, scratch) -> int:
        """One proof submission of `route` (counted immediately before its commit); returns the
        route dispatches it encoded. Encoding errors propagate with nothing submitted."""
        encoder = self.device.command_encoder()
        self._encode(encoder, shape, route, weight, inp, ids, out, scratch)
        self.subs.proof += 1
        encoder.commit_and_wait()
        return route_dispatches(route)

    def _prove(self, shape, weight, candidates, profile):
        """Every candidate against direct on one profile: direct in one submission, each candidate
        in one of its own. Returns (proofs, route dispatches, buffers for timing)."""
        op, label = self.op, self.op.label
        logical = shape.m * shape.top_k * shape.n
        guarded = logical + cal.GUARD_ELEMENTS
        host_ids = op.ids(shape, profile)
        inp, ids = self.pool.input(input_rows(shape), shape.k), self.device.from_numpy(host_ids)
        control, *outs = self.pool.outputs(guarded, len(candidates))
        scratch = self.pool.scratch()
        poison = np.full(guarded, POISON_BITS, np.uint32).view(np.uint8)
        view = lambda b: b.view(0, logical * 4, DType.F32, [shape.m * shape.top_k, shape.n])  # noqa: E731
        control._write_bytes(poison)
        try:
            dispatches = self._submit(shape, op.direct, weight, inp, ids, view(control), None)
        except Error as e:
            raise Abort(f"{label} direct proof failed on profile {profile.value}: {e}") from None
        reference_bits = control.numpy().view(np.uint32)
        control_bits = proof_status(reference_bits, None, logical)
        if control_bits:
            raise Abort(f"{label} direct proof failed on profile {profile.value}: {cal.status_text(control_bits)}")
        reference = reference_bits[:logical].view(np.float32).astype(np.float64)
        bound = None
        proofs = []
        for route, out in zip(candidates, outs, strict=True):
            out._write_bytes(poison)
            policy = op.tolerance(self.device, route)
            tol = 0.0 if policy == ELEMENTWISE_BOUND else policy
            try:
                dispatches += self._submit(shape, route, weight, inp, ids, view(out), scratch)
            except Error as e:
                diag = f"{route.value} failed to encode or run on profile {profile.value}: {e}"
                proofs.append(op.records.proof(route, profile, tol, 1e300, 0, False, diag))
                continue
            got_bits = out.numpy().view(np.uint32)
            bits = proof_status(reference_bits, got_bits, logical)
            err, beyond = 0.0, ""
            if policy == 0.0:
                coherent = not bits & cal.STATUS_CANDIDATE_BITS
                if bits & cal.STATUS_MISMATCH:
                    err = float("nan")
            else:
                got = got_bits[:logical].view(np.float32).astype(np.float64)
                err = _rel_frobenius(got, reference)
                coherent = not bits & (cal.STATUS_CANDIDATE_BITS & ~cal.STATUS_MISMATCH)
                if policy == ELEMENTWISE_BOUND:
                    if bound is None:
                        x = self.pool.input_values(input_rows(shape), shape.k)
                        bound = op.proof_bound(shape, weight, x, host_ids).reshape(-1)
                    tol = _rel_frobenius(reference + bound, reference)  # the bound's own Frobenius size
                    over = int(np.count_nonzero(~(np.abs(got - reference) <= bound)))
                    coherent = coherent and not over
                    beyond = f", {over} element(s) beyond the F32 accumulation bound" if over else ""
                else:
                    coherent = coherent and err <= tol
                    beyond = f", relative Frobenius error {err:.3g} > {tol:g}" if err > tol else ""
            diag = None
            if not coherent:
                diag = f"{route.value} proof failed on profile {profile.value}: {cal.status_text(bits)}{beyond}"
            proofs.append(
                op.records.proof(route, profile, tol, err if math.isfinite(err) else 1e300, bits, coherent, diag)
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
            done["dispatches"] += route_dispatches(route)

        samples = cal.alternating_timing(
            self.device,
            routes,
            self.deadline,
            lambda enc, route: self._encode(enc, shape, route, weight, inp, ids, out, scratch),
            counted,
            self.timer,
            f"{self.op.label} ",
        )
        timing = self.op.records.timing
        return {
            route: (timing(*cal.distribution(w)), timing(*cal.distribution(g))) for route, (w, g) in samples.items()
        }

    def _candidates(self, shape) -> tuple[list, list]:
        """(candidates whose pipelines are prepared, diagnostics of those that could not be)."""
        candidates, unprepared = [], []
        fmt = self.op.weight_format(shape)
        for route in self.op.candidates:
            if route in self.op.tensor_routes and not self.tensor_mm:
                continue
            try:
                self.op.capability(shape, route)
            except InvalidArgumentError:
                continue
            names = self.op.route_pipelines(route, fmt)
            failed = [f"{n}: {self.errors[n]}" for n in names if n in self.errors]
            if failed:
                unprepared.append(f"{route.value} pipeline preparation failed: {'; '.join(failed)}")
            elif all(n in self.identities for n in names):
                candidates.append(route)
        return candidates, unprepared

    def shape(self, shape, weight, n_identities):
        S = DenseMatmulIdSelectionStatus
        D = self.op.direct
        profiles = tuple(DenseMatmulIdRoutingProfile)
        candidates, unprepared = self._candidates(shape)
        work = {"proof_submissions": 0, "proof_dispatches": 0, "timing_submissions": 0, "timing_dispatches": 0}

        def decision(route, status, diag, proofs=(), timings=(), hit=False):
            return self.op.records.decision(
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
        # The outcome holds for this candidate set only: the policy's tensor choice is in the key.
        key = (self.build_fp, self.device.name, self.device.registry_id, self.pset, shape.key, self.tensor_mm)
        cached = self.pinned.get(shape.key) if self.pinned is not None else cal.PROCESS_CACHE.get(key)
        if cached is not None and cached["route"] is not D and cached["route"] not in candidates:
            cached = None  # a winner the policy now keeps out is not re-proved: calibrate afresh
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
                    timings.append(self.op.records.route_timing(profile, route, *dist[route]))
                for r in coherent:
                    verdicts[r].append(
                        (cal.select_winner(dist[D][0], dist[D][1], dist[r][0], dist[r][1]), dist[r][0].median_us)
                    )
        except cal.BudgetExceeded as b:
            work["timing_submissions"], work["timing_dispatches"] = done["submissions"], done["dispatches"]
            return decision(D, S.BUDGET_FALLBACK, str(b), proofs, timings), False
        except Error as e:
            raise Abort(f"{self.op.label} timing calibration failed after current-weight proof: {e}") from None
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


def run(op: ExpertIdOp, kind: "ExpertIdKind", freeze, registry, device, epoch, limits, cases, *, progress, pinned=None,
        _timer=None, _clock=None):  # fmt: skip
    """One calibration of `kind` (the calibrate / load entry points' run hook): validate `cases`,
    prove and time (or, with `pinned`, only prove) every declared shape, build the plan (all
    candidates disabled when the final deadline passed) and its receipt, and `freeze` it into
    `registry`; returns (plan, receipt)."""
    entries = kind.validated(registry, epoch, limits, list(cases))
    deadline = cal.Deadline(limits.max_elapsed_ms, _clock or cal.time.perf_counter)
    prep = prepare(op, registry, formats_of(op, [e["shape"] for e in entries]))
    digest = authority_digest(op, device, epoch, entries)
    pool = ProofPool(device, [e["shape"] for e in entries], len(op.candidates))
    c = Calibrator(op, registry, device, limits, prep, deadline, _timer, pinned, pool)
    bar = cal.Progress(len(entries), f"{op.label} calibration", progress)
    decisions, fresh = [], 0
    try:
        for e in entries:
            d, was_fresh = c.shape(e["shape"], next(iter(e["weights"].values())), len(e["weights"]))
            fresh += was_fresh
            decisions.append(d)
            cal.LOGGER.debug(
                "%s shape %s: %s / %s%s",
                op.label,
                e["shape"].key,
                d.selected_route.value,
                d.status.value,
                f": {d.diagnostic}" if d.diagnostic else "",
            )
            bar.step({"shape": e["shape"].to_dict(), "route": d.selected_route.value, "status": d.status.value})
    except Abort as a:
        if c.subs.total:
            cal.cleanup_submission(device, c.subs)
        raise InvalidArgumentError(str(a)) from None
    finally:
        bar.close()
    if c.subs.total:
        cal.cleanup_submission(device, c.subs)
    primary = make_plan(op, prep[0], registry, device, epoch, [(d.shape, d.selected_route) for d in decisions], digest)
    late = [
        dataclasses.replace(
            d,
            selected_route=op.direct,
            status=DenseMatmulIdSelectionStatus.BUDGET_FALLBACK,
            diagnostic=f"final {op.label} calibration deadline exceeded; candidates disabled",
            theorem_authorized_weight_identities=0,
        )
        if d.selected_route is not op.direct
        else d
        for d in decisions
    ]
    fallback = make_plan(op, prep[0], registry, device, epoch, [(d.shape, d.selected_route) for d in late], digest)
    elapsed = deadline.elapsed_ms()
    overrun = max(0.0, elapsed - limits.max_elapsed_ms)
    plan, final = (fallback, late) if overrun > 0 else (primary, decisions)
    receipt = op.records.receipt.of_calibration(
        plan,
        c.subs,
        elapsed,
        overrun,
        final,
        declared_shapes=len(final),
        calibrated_decisions=fresh,
        theorem_sha256=op.theorem_sha256,
        direct_decisions=sum(d.selected_route is op.direct for d in final),
        proof_dispatches=sum(d.proof_dispatches for d in final),
        timing_dispatches=sum(d.timing_dispatches for d in final),
    )
    authority = Authority(
        epoch,
        digest,
        frozenset(e["shape"].key for e in entries),
        prep[0],
        {label: ident.to_dict() for label, ident in prep[2].items()},
    )
    rp.set_origin(plan, rp.Origin(device, receipt, authority))
    freeze(registry, device, plan, _check_fingerprint=False)
    return plan, receipt


def resolve_auto(op: ExpertIdOp, kind_name: str, registry, device, shape, activation_epoch) -> tuple:
    """(route, source, epoch) of `shape` from the frozen plan of `kind_name`; read-only, no GPU
    work. A plan of another epoch than the caller's `activation_epoch` is refused (spec §7.6); an
    undeclared m of a declared shape's base takes direct; any other shape is refused."""
    auto = f"{op.label}_auto"
    plan = rp.frozen_plan(registry, kind_name)
    if plan is None:
        raise InvalidArgumentError(f"{auto} requires a frozen activation plan")
    if (
        isinstance(activation_epoch, bool)
        or not isinstance(activation_epoch, (int, np.integer))
        or activation_epoch != plan.activation_epoch
    ):
        raise InvalidArgumentError(
            f"{auto} activation epoch mismatch: caller epoch {activation_epoch!r}, "
            f"frozen plan epoch {plan.activation_epoch}"
        )
    if plan.device_registry_id != device.registry_id or plan.device_name != device.name:
        raise InvalidArgumentError(f"{auto} plan belongs to a different device")
    if plan.theorem_sha256 != op.theorem_sha256:
        raise InvalidArgumentError(f"{auto} plan theorem digest mismatch")
    route = plan._lookup.get(shape.key)
    if route is not None:
        return route, DenseMatmulIdDecisionSource.FROZEN_PLAN, plan.activation_epoch
    if shape.base_key in plan._bases:
        return op.direct, DenseMatmulIdDecisionSource.UNDECLARED_DIRECT, plan.activation_epoch
    raise InvalidArgumentError(f"{auto} shape base was not admitted at activation: {shape.key}")


# The statuses of a decision whose candidates were all proved in its own calibration (the first
# three also timed), unless it was a cache hit.
_PROVED_STATUSES = (
    DenseMatmulIdSelectionStatus.CALIBRATED_WINNER,
    DenseMatmulIdSelectionStatus.DIRECT_FASTEST,
    DenseMatmulIdSelectionStatus.NO_STABLE_WINNER,
    DenseMatmulIdSelectionStatus.INCOHERENT_GROUPED,
)


def _profile_blocks(fail, field: str, pairs: list, leading: tuple, allowed: list) -> tuple:
    """(routes, profiles) of a decision's proofs or timings as (profile, route) pairs: one block per
    routing profile, for a prefix of the profiles in order, each naming the same routes -- `leading`
    first, then distinct routes of `allowed` in its order. Anything else is refused as `field`."""
    profiles = tuple(DenseMatmulIdRoutingProfile)
    routes = [r for p, r in pairs if p is profiles[0]]
    rest = routes[len(leading) :]
    if pairs and (tuple(routes[: len(leading)]) != leading or rest != [r for r in allowed if r in rest]):
        fail(field, f"name routes {[r.value for r in routes]}, not {[r.value for r in (*leading, *allowed)]} in order")
    count = len(pairs) // max(1, len(routes))
    if list(pairs) != [(p, r) for p in profiles[:count] for r in routes]:
        fail(field, "are not one entry per route and routing profile, profile by profile")
    return routes, count


class ExpertIdKind(rp.PlanKind):
    """The plan kind of an expert-ID op: the PlanKind hooks written once over `op`. `limits_type`
    is the kind's calibration limits record (its defaults stand in for None), `protected` the
    pipelines a frozen plan protects, `freeze(registry, device, plan, _check_fingerprint=...)` the
    kind's public freeze."""

    def __init__(self, op: ExpertIdOp, name: str, limits_type: type, protected, freeze):
        super().__init__(name, op.label, op.records.plan, op.records.receipt, op.route_type)
        self.op, self.limits_type, self._protected, self._freeze = op, limits_type, tuple(protected), freeze

    def protected_names(self) -> list[str]:
        return list(self._protected)

    def build_fingerprint(self, registry, plan) -> str:
        return prepare(self.op, registry, formats_of(self.op, [d.shape for d in plan.decisions]))[0]

    def check_plan(self, plan) -> None:
        if plan.theorem_sha256 != self.op.theorem_sha256:
            self.fail("route plan was made under a different value-independence theorem")

    def recompute_plan_id(self, plan) -> str:
        identity = (plan.device_registry_id, plan.registry_authority_id, plan.activation_epoch)
        return plan_id(self.op, plan.build_fingerprint, *identity, plan.authority_digest, plan.decisions)

    def check_receipt(self, receipt) -> None:
        """An expert-ID receipt's own totals, and what each decision's structure implies (see
        Calibrator.shape): its candidates distinct and in the op's preference order; its proofs one
        per (profile, route) of every candidate, or of the one route a cache hit or pinned outcome
        re-proves; its timings whole profile blocks of direct and candidates; a decision proved and
        timed here (not a cache hit) carrying every proof and timing with the submissions and
        dispatches they took; a candidate selected exactly when the status is calibrated_winner."""
        D, S = self.op.direct, DenseMatmulIdSelectionStatus
        n_profiles = len(DenseMatmulIdRoutingProfile)

        def fail(field: str, message: str):
            self.fail(f"calibration receipt {field} {message}")

        for i, d in enumerate(receipt.decisions):
            at = f"decisions[{i}]"
            candidates = list(d.candidates)
            if candidates != [r for r in self.op.candidates if r in candidates]:
                fail(f"{at}.candidates", f"{[r.value for r in candidates]} are not distinct and in preference order")
            if (d.selected_route is not D) != (d.status is S.CALIBRATED_WINNER):
                fail(f"{at}.selected_route", f"{d.selected_route.value} disagrees with its status {d.status.value}")
            if d.selected_route is not D and d.selected_route not in candidates:
                fail(f"{at}.selected_route", f"{d.selected_route.value} is not among its candidates")
            if (d.theorem_authorized_weight_identities == 0) != (d.selected_route is D):
                fail(f"{at}.theorem_authorized_weight_identities", "is not zero exactly when direct is selected")
            if not candidates and (d.status not in (S.DIRECT_ONLY, S.ERROR_FALLBACK) or d.proofs or d.timings):
                fail(f"{at}.candidates", f"are none, yet its status is {d.status.value} or it holds proofs or timings")
            if candidates and d.status is S.DIRECT_ONLY:
                fail(f"{at}.candidates", "are not none, yet its status is direct_only")
            proved, proof_blocks = _profile_blocks(
                fail, f"{at}.proofs", [(p.profile, p.route) for p in d.proofs], (), candidates
            )
            reproved = {1} if d.process_cache_hit else {1, len(candidates)}  # a cached route, or all
            if d.proofs and (proof_blocks != n_profiles or len(proved) not in reproved):
                fail(
                    f"{at}.proofs",
                    "cover neither every candidate nor the one route a cached outcome re-proves, on every profile",
                )
            for name, per_route in (("proof_submissions", lambda r: 1), ("proof_dispatches", route_dispatches)):
                low, high = (n_profiles, n_profiles * (1 + sum(map(per_route, proved)))) if d.proofs else (0, 0)
                if not low <= getattr(d, name) <= high:
                    fail(
                        f"{at}.{name}", f"is {getattr(d, name)}, outside {low}..={high} for its {len(d.proofs)} proofs"
                    )
            timed, timed_blocks = _profile_blocks(
                fail, f"{at}.timings", [(t.profile, t.route) for t in d.timings], (D,), candidates
            )
            if d.process_cache_hit and (d.timing_submissions or d.timing_dispatches):
                fail(f"{at}.timing_submissions", "and timing_dispatches of a cache hit are not zero")
            if d.process_cache_hit or d.status not in _PROVED_STATUSES:
                continue  # a cached outcome, or a fallback that may have stopped anywhere
            if not d.proofs:
                fail(f"{at}.proofs", f"are missing from a decision of status {d.status.value}")
            if d.status is S.INCOHERENT_GROUPED:
                continue
            if timed_blocks != n_profiles or not set(timed[1:]) <= set(proved):
                fail(f"{at}.timings", "do not time direct and its coherent candidates on every profile")
            rounds = n_profiles * cal.CALIBRATION_SAMPLES
            if d.timing_submissions != rounds * len(timed):
                fail(
                    f"{at}.timing_submissions", f"is {d.timing_submissions}, not {rounds} rounds of {len(timed)} routes"
                )
            if d.timing_dispatches != rounds * sum(map(route_dispatches, timed)):
                fail(f"{at}.timing_dispatches", f"is {d.timing_dispatches}, not the dispatches of {rounds} rounds")

        totals = {
            "direct_decisions": sum(d.selected_route is D for d in receipt.decisions),
            "proof_dispatches": sum(d.proof_dispatches for d in receipt.decisions),
            "timing_dispatches": sum(d.timing_dispatches for d in receipt.decisions),
        }
        for name, total in totals.items():
            if getattr(receipt, name) != total:
                fail(name, f"is {getattr(receipt, name)}, but its decisions add up to {total}")

    def validated(self, registry, epoch, limits, cases) -> list:
        """The case entries (collect_cases) after the activation preconditions."""
        limits = limits or self.limits_type()
        rp.check_activation(self, registry, epoch, (limits.max_elapsed_ms, limits.max_cases, limits.max_submissions))
        return collect_cases(self.op, cases, limits.max_cases)

    def run(self, registry, device, epoch, limits, cases, **options):
        return run(self.op, self, self._freeze, registry, device, epoch, limits or self.limits_type(), cases, **options)

    def declared(self, registry, device, epoch, limits, cases) -> tuple:
        entries = self.validated(registry, epoch or 1, limits, cases)
        build_fp = prepare(self.op, registry, formats_of(self.op, [e["shape"] for e in entries]))[0]
        return build_fp, [e["shape"].key for e in entries]

    def cache_key(self, registry, device, epoch, limits, cases) -> dict:
        entries = self.validated(registry, epoch, limits, cases)
        build_fp = prepare(self.op, registry, formats_of(self.op, [e["shape"] for e in entries]))[0]
        return {"validators": cal.plan_validators(device, build_fp), "shapes": [e["shape"].to_dict() for e in entries]}

    def explained_outcome(self, d) -> dict:
        return {"route": d.selected_route, "status": d.status, "diagnostic": d.diagnostic, "timings": d.timings}

    def unexplained_outcome(self, route) -> dict:
        status = (
            DenseMatmulIdSelectionStatus.DIRECT_FASTEST
            if route is self.op.direct
            else DenseMatmulIdSelectionStatus.CALIBRATED_WINNER
        )
        return {"route": route, "status": status, "timings": ()}
