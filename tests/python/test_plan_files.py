"""Saved plan files fail closed, and what the library keeps about plans lives as long as its registry.

A plan file is adopted only when it is whole and consistent: every field its plan body repeats
agrees with the file's validators and with its receipt, both documents conform to their schemas,
and (Q4) the plan id matches the plan's contents. Anything else is PlanFileMismatch -- never
KeyError, OverflowError, struct.error or RecursionError.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import numpy as np
import pytest
import routemm
from routemm import calibration as cal
from routemm import q4_0
from routemm.plans import _route_plan as rp

V2 = routemm.DenseQ4Route.COMPATIBILITY_V2
C64 = routemm.DenseQ4Route.TENSOR_64X32
R = routemm.DenseMatmulIdRoute
N, K = 96, 64


def q4_winner(route, round_index, measured):
    wall, gpu = (100, 90) if route == V2.value else (70, 60)
    return wall - 2 + round_index, gpu - 2 + round_index


def id_winner(route, round_index, measured):
    wall, gpu = {R.DIRECT.value: (100, 90), R.GROUPED_PREFILL.value: (70, 60)}.get(route, (85, 75))
    return wall - 2 + round_index, gpu - 2 + round_index


class Saved:
    load = None

    def reload(self, doc_or_text, tmp_path):
        bad = tmp_path / "altered.json"
        bad.write_text(doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text))
        return self.load(bad, routemm.KernelRegistry(self.device), self.device, self.cases)


class Q4(Saved):
    """A saved dense Q4 plan (one base shape, M 9 and 40; the candidate wins both)."""

    load = staticmethod(routemm.load_dense_q4_plan)

    def __init__(self, device, tmp_path):
        rng = np.random.default_rng(7)
        blocks = q4_0.quantize(rng.standard_normal((N, K)).astype(np.float32))
        self.device = device
        self.cases = [
            routemm.DenseQ4CalibrationCase(
                device.from_numpy(blocks.reshape(-1)), routemm.DenseQ4BaseShape(N, K), (9, 40)
            )
        ]
        plan, self.receipt = routemm.calibrate_dense_q4_routes(
            routemm.KernelRegistry(device), device, 3, None, self.cases, _timer=q4_winner
        )
        self.plan = plan
        self.path = plan.save(tmp_path / "q4.json")
        self.doc = json.loads(self.path.read_text())

    @staticmethod
    def other_route(route: str) -> str:
        return V2.value if route == C64.value else C64.value


class ExpertId(Saved):
    """A saved expert-ID plan (one shape; grouped_prefill wins)."""

    load = staticmethod(routemm.load_dense_matmul_id_plan)

    def __init__(self, device, tmp_path):
        rng = np.random.default_rng(8)
        w = device.from_numpy(rng.standard_normal((8, 7, 24)).astype(np.float32))
        p = routemm.DenseMatmulIdParams(9, 7, 24, 2, 8, 7 * 24 * 4)
        self.device = device
        self.cases = [routemm.DenseMatmulIdCalibrationCase(w, p)]
        plan, self.receipt = routemm.calibrate_dense_matmul_id_routes(
            routemm.KernelRegistry(device), device, 3, None, self.cases, _timer=id_winner
        )
        self.plan = plan
        self.path = plan.save(tmp_path / "id.json")
        self.doc = json.loads(self.path.read_text())

    @staticmethod
    def other_route(route: str) -> str:
        return R.DIRECT.value if route != R.DIRECT.value else R.GROUPED_PREFILL.value


@pytest.fixture(params=[Q4, ExpertId], ids=["q4", "expert_id"])
def saved(request, device, tmp_path):
    if request.param is Q4 and not routemm.KernelRegistry(device).has_kernel(C64.pipeline_name):
        pytest.skip(f"backend {device.backend} has no {C64.pipeline_name}")
    return request.param(device, tmp_path)


def _altered(doc, where, value):
    doc = json.loads(json.dumps(doc))
    *path, last = where
    node = doc
    for key in path:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


def test_untouched_file_reloads(saved, tmp_path):
    plan, receipt = saved.reload(saved.doc, tmp_path)
    assert plan._lookup == saved.plan._lookup and receipt.timing_submissions == 0


@pytest.mark.parametrize(
    "where,value",
    [
        (("plan", "decisions", 0, "route"), "flip"),
        (("plan", "plan_id"), "1" * 64),
        (("plan", "build_fingerprint"), "2" * 64),
        (("plan", "device_name"), "another device"),
        (("plan", "device_registry_id"), 12345),
        (("plan", "registry_authority_id"), 424242),
        (("plan", "activation_epoch"), 99),
        (("receipt", "plan_id"), "3" * 64),
        (("receipt", "registry_authority_id"), 424242),
        (("receipt", "decisions", 0, "selected_route"), "flip"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_altered_body_refused(saved, tmp_path, where, value):
    if value == "flip":
        value = saved.other_route(saved.plan.decisions[0].route.value)
    with pytest.raises(cal.PlanFileMismatch, match="altered|malformed"):
        saved.reload(_altered(saved.doc, where, value), tmp_path)


@pytest.mark.parametrize(
    "where,value",
    [
        (("receipt", "surprise"), 1),
        (("receipt", "schema_version"), 99),
        (("receipt", "elapsed_ms"), "fast"),
        (("receipt", "declared_shapes"), -1),
        (("receipt", "decisions", 0, "status"), "winner"),
        (("receipt", "decisions", 0, "timings"), KeyError),
        (("receipt", "decisions", 0, "process_cache_hit"), 1),
        (("receipt", "build_fingerprint"), "zz"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_malformed_receipt_refused(saved, tmp_path, where, value):
    with pytest.raises(cal.PlanFileMismatch, match="malformed calibration receipt"):
        saved.reload(_altered(saved.doc, where, value), tmp_path)


def test_non_finite_receipt_number_refused(saved, tmp_path):
    text = json.dumps(saved.doc).replace('"elapsed_ms": ', '"elapsed_ms": NaN, "x": ', 1)
    with pytest.raises(cal.PlanFileMismatch, match="NaN is not JSON"):
        saved.reload(text, tmp_path)


@pytest.mark.parametrize(
    "where,value",
    [
        (("plan",), KeyError),
        (("receipt",), KeyError),
        (("plan",), [1, 2]),
        (("receipt",), "none"),
        (("validators",), [1]),
        (("plan", "activation_epoch"), 2**64),
        (("plan", "activation_epoch"), 0),
        (("plan", "registry_authority_id"), 2**70),
        (("plan", "decisions"), "all"),
        (("plan", "decisions", 0, "shape", "m"), 10**30),
        (("plan", "decisions"), []),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_malformed_file_is_a_plan_mismatch(saved, tmp_path, where, value):
    with pytest.raises(cal.PlanFileMismatch):
        saved.reload(_altered(saved.doc, where, value), tmp_path)


@pytest.mark.parametrize(
    "text",
    ["", "{", "[" * 100_000, '{"format": "routemm-route-plan", "format_version": 1e999}', "\xff"],
    ids=["empty", "unterminated", "deep", "huge-float", "not-json"],
)
def test_unreadable_text_is_a_plan_mismatch(saved, tmp_path, text):
    with pytest.raises(cal.PlanFileMismatch):
        saved.reload(text, tmp_path)


def test_expert_id_plan_with_another_theorem_refused(device, tmp_path):
    saved = ExpertId(device, tmp_path)
    for part in ("plan", "receipt"):
        with pytest.raises(cal.PlanFileMismatch, match="value-independence theorem"):
            saved.reload(_altered(saved.doc, (part, "theorem_sha256"), "4" * 64), tmp_path)


# ---- Lifetimes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Q4, ExpertId], ids=["q4", "expert_id"])
def test_plans_and_receipts_live_as_long_as_their_registry(device, tmp_path, kind):
    """Nothing the library keeps about a plan outlives its registry and the plan itself: after many
    calibrations with dropped registries the store is back to its size and every plan, receipt and
    registry has been freed (a module-level table kept ~73 KB per calibration forever)."""
    if kind is Q4 and not routemm.KernelRegistry(device).has_kernel(C64.pipeline_name):
        pytest.skip(f"backend {device.backend} has no {C64.pipeline_name}")
    saved = kind(device, tmp_path)
    gc.collect()
    before = rp.store_size()
    refs = []
    for epoch in range(1, 41):
        registry = routemm.KernelRegistry(device)
        if kind is Q4:
            plan, receipt = routemm.calibrate_dense_q4_routes(registry, device, epoch, None, saved.cases)
        else:
            plan, receipt = routemm.calibrate_dense_matmul_id_routes(registry, device, epoch, None, saved.cases)
        assert rp.frozen_plan(registry, type(plan).KIND.name) is plan
        refs += [weakref.ref(plan), weakref.ref(receipt), weakref.ref(registry)]
        del registry, plan, receipt
    gc.collect()
    assert rp.store_size() == before
    assert not [r for r in refs if r() is not None]


def test_plan_saves_while_its_registry_lives(saved, tmp_path):
    # A copy of a frozen plan (from JSON) finds how it was made through the registry holding it.
    copy = type(saved.plan).from_json(saved.plan.to_json())
    registry = routemm.KernelRegistry(saved.device)
    plan, _ = saved.load(saved.path, registry, saved.device, saved.cases)
    again = type(plan).from_json(plan.to_json())
    assert again.save(tmp_path / "again.json").exists()
    del registry, plan
    gc.collect()
    with pytest.raises(routemm.InvalidArgumentError, match="not made by this process"):
        again.save(tmp_path / "gone.json")
    assert copy.origin is None and saved.plan.origin is not None


def test_q4_file_with_a_version_4_receipt_reloads(device, tmp_path):
    """Receipts of schema version 4 named the library version mlx_native_version; files holding one
    still load, as version 5 receipts with that value in routemm_version."""
    if not routemm.KernelRegistry(device).has_kernel(C64.pipeline_name):
        pytest.skip(f"backend {device.backend} has no {C64.pipeline_name}")
    saved = Q4(device, tmp_path)
    old = json.loads(json.dumps(saved.doc))
    assert old["receipt"]["schema_version"] == routemm.DENSE_Q4_RECEIPT_SCHEMA_VERSION == 5
    old["receipt"]["mlx_native_version"] = old["receipt"].pop("routemm_version")
    old["receipt"]["schema_version"] = 4
    plan, receipt = saved.reload(old, tmp_path)
    assert plan._lookup == saved.plan._lookup
    assert receipt.routemm_version == routemm.__version__ and receipt.schema_version == 5
    # Only that exact earlier form is rewritten: a version-4 receipt without the old field is refused.
    old["receipt"]["routemm_version"] = old["receipt"].pop("mlx_native_version")
    with pytest.raises(cal.PlanFileMismatch, match="malformed calibration receipt"):
        saved.reload(old, tmp_path)


@pytest.mark.parametrize(
    "common,q4,expert_id",
    [
        (
            rp.PlanDecision,
            routemm.plans.dense_q4_plan.DenseQ4PlanDecision,
            routemm.plans.dense_matmul_id_plan.DenseMatmulIdPlanDecision,
        ),
        (rp.RoutePlan, routemm.DenseQ4RoutePlan, routemm.DenseMatmulIdRoutePlan),
        (rp.CalibrationDecision, routemm.DenseQ4CalibrationDecision, routemm.DenseMatmulIdCalibrationDecision),
        (rp.CalibrationReceipt, routemm.DenseQ4CalibrationBatchReceipt, routemm.DenseMatmulIdCalibrationReceipt),
    ],
    ids=["plan-decision", "plan", "calibration-decision", "receipt"],
)
def test_both_plan_kinds_share_one_definition_of_their_common_fields(common, q4, expert_id):
    """Every field both kinds' records have comes from one base record (schema_version excepted: each
    kind writes its own), and each kind's own fields follow the common ones."""

    def names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    assert issubclass(q4, common) and issubclass(expert_id, common)
    assert (set(names(q4)) & set(names(expert_id))) - {"schema_version"} == set(names(common))
    for cls in (q4, expert_id):
        assert names(cls)[: len(names(common))] == names(common)
