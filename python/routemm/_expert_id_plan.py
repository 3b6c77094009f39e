"""The records every expert-ID plan kind shares (dense_matmul_id_plan; later the quantised op's).

An expert-ID calibration proves each candidate route against direct on two routing profiles and
times them; its receipts and plan carry the same evidence whatever the weight format. The records
here are generic over a kind's shape, route, timing, proof, decision and primitive-receipt types;
`ExpertIdRecords.declare` makes one kind's concrete record classes (named for its schema files)
in one call, so a kind module declares only its shape record and its routes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Generic, Optional, TypeVar

from . import _route_plan as rp


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
    """A frozen expert-ID plan: besides the common fields, the value-independence theorem its
    decisions rest on."""

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
    def declare(cls, module: str, prefix: str, shape, route, primitive, schema_version: int, auto_schema: str):
        """The records of the kind whose classes are named `prefix` + the record's role (as its
        schema files' `$defs` name them), in `module`; the plan in `{schema}_route_plan`, the
        calibration evidence in `{schema}_calibration_receipt` (schema: the prefix's snake case,
        e.g. dense_matmul_id), the auto receipt in `auto_schema`."""
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in prefix).lstrip("_")
        plan_s, receipt_s = f"{snake}_route_plan.schema.json", f"{snake}_calibration_receipt.schema.json"

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
