"""Saved route plans and their calibration receipts fail closed, for every plan kind.

* A plan's id is recomputed from its own contents and checked whether or not the file holds a
  receipt: a plan saved without one, its route flipped (and its id zeroed or kept), is refused.
* A receipt is validated as strictly as the plan: numbers within their ranges (finite,
  non-negative timings within a day, counts within u64, relative errors >= 0), integer fields
  written as integers, lists as long as the rest of the receipt implies (one proof per candidate
  and profile, one timing per timed route and profile), counts that add up, no unknown keys.

Every refusal is a PlanFileMismatch (a routemm.Error) naming the field. The saved receipts under
bench/results still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import routemm
from routemm import calibration as cal
from routemm import q4_0
from routemm.plans import _route_plan as rp
from routemm.plans import dense_q4_plan as dq

KINDS = ["dense_q4", "dense_matmul_id", "quantized_matmul_id"]
EXPERT_ID_KINDS = KINDS[1:]
ROOT = Path(__file__).resolve().parents[2]


def _winner(slow: str):
    """A timing hook under which every candidate beats the route named `slow` on both clocks."""

    def timer(route, round_index, measured):
        wall, gpu = (100, 90) if route == slow else (70, 60)
        return wall - 2 + round_index, gpu - 2 + round_index

    return timer


class Saved:
    """A CPU calibration of one plan kind whose candidate wins, saved with its receipt."""

    def __init__(self, kind: str, root: Path):
        self.kind = kind
        self.device = device = routemm.Device("cpu")
        rng = np.random.default_rng(41)
        if kind == "dense_q4":
            blocks = q4_0.quantize(rng.standard_normal((64, 64)).astype(np.float32))
            weight = device.from_numpy(blocks.reshape(-1))
            self.cases = [routemm.DenseQ4CalibrationCase(weight, routemm.DenseQ4BaseShape(64, 64), (9, 40))]
            calibrate, self.load = routemm.calibrate_dense_q4_routes, routemm.load_dense_q4_plan
            self.direct = routemm.DenseQ4Route.COMPATIBILITY_V2.value
            self.candidate = routemm.DenseQ4Route.TENSOR_64X32.value
        elif kind == "dense_matmul_id":
            weight = device.from_numpy(rng.standard_normal((6, 8, 32)).astype(np.float32))
            params = routemm.DenseMatmulIdParams(9, 8, 32, 2, 6, 8 * 32 * 4)
            self.cases = [routemm.DenseMatmulIdCalibrationCase(weight, params)]
            calibrate, self.load = routemm.calibrate_dense_matmul_id_routes, routemm.load_dense_matmul_id_plan
            self.direct = routemm.DenseMatmulIdRoute.DIRECT.value
            self.candidate = routemm.DenseMatmulIdRoute.GROUPED_PREFILL.value
        else:
            stack = q4_0.quantize(rng.standard_normal((6, 8, 64)).astype(np.float32)).reshape(6, -1)
            weight = device.from_numpy(np.ascontiguousarray(stack))
            params = routemm.GgmlQuantizedMatmulIdParams(9, 8, 64, 2, 6, routemm.GgmlType.Q4_0, stack.shape[1])
            self.cases = [routemm.GgmlQuantizedMatmulIdCalibrationCase(weight, params)]
            calibrate, self.load = routemm.calibrate_quantized_matmul_id_routes, routemm.load_quantized_matmul_id_plan
            self.direct = routemm.GgmlQuantizedMatmulIdRoute.DIRECT.value
            self.candidate = routemm.GgmlQuantizedMatmulIdRoute.GROUPED.value
        self.plan, self.receipt = calibrate(
            routemm.KernelRegistry(device), device, 3, None, self.cases, _timer=_winner(self.direct)
        )
        assert {d.route.value for d in self.plan.decisions} == {self.candidate}
        self.doc = json.loads(self.plan.save(root / f"{kind}.json").read_text())
        self.root = root

    def reload(self, doc):
        path = self.root / "altered.json"
        path.write_text(json.dumps(doc))
        return self.load(path, routemm.KernelRegistry(self.device), self.device, self.cases)


@pytest.fixture(scope="module")
def saved_of(tmp_path_factory):
    """The Saved calibration of a kind, made once per module."""
    made = {}

    def get(kind: str) -> Saved:
        if kind not in made:
            made[kind] = Saved(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.fixture(params=KINDS)
def saved(request, saved_of):
    return saved_of(request.param)


def _altered(doc, where, value):
    """A copy of `doc` with the value at path `where` replaced (KeyError: deleted; a callable: applied)."""
    doc = json.loads(json.dumps(doc))
    *path, last = where
    node = doc
    for key in path:
        node = node[key]
    if value is KeyError:
        del node[last]
    elif callable(value):
        node[last] = value(node[last])
    else:
        node[last] = value
    return doc


def _without_receipt(doc):
    return {**doc, "receipt": None}


# ---- The plan id is recomputed for every kind, with or without a receipt ----------------------------


def test_every_plan_kind_recomputes_its_plan_id(saved):
    kind = type(saved.plan).KIND
    assert kind.recompute_plan_id(saved.plan) == saved.plan.plan_id
    saved_plan = type(saved.plan).from_dict(saved.doc["plan"])
    assert kind.recompute_plan_id(saved_plan) == saved_plan.plan_id


def test_plan_without_receipt_reloads_its_routes(saved):
    plan, receipt = saved.reload(_without_receipt(saved.doc))
    assert plan._lookup == saved.plan._lookup and receipt.timing_submissions == 0


@pytest.mark.parametrize("plan_id", ["zeroed", "kept"])
def test_plan_without_receipt_with_a_flipped_route_refused(saved, plan_id):
    doc = _altered(_without_receipt(saved.doc), ("plan", "decisions", 0, "route"), saved.direct)
    if plan_id == "zeroed":
        doc["plan"]["plan_id"] = "0" * 64
    with pytest.raises(cal.PlanFileMismatch, match="plan altered after it was saved: .*plan id"):
        saved.reload(doc)


@pytest.mark.parametrize(
    "where,value",
    [
        (("plan", "activation_epoch"), 4),
        (("plan", "registry_authority_id"), 424242),
        (("plan", "decisions", 0, "shape", "m"), 10),
    ],
    ids=["epoch", "authority", "shape"],
)
def test_plan_without_receipt_with_an_altered_field_refused(saved, where, value):
    with pytest.raises(cal.PlanFileMismatch):
        saved.reload(_altered(_without_receipt(saved.doc), where, value))


@pytest.mark.parametrize("kind", EXPERT_ID_KINDS)
def test_expert_id_plan_id_covers_its_authority_digest(saved_of, kind):
    saved = saved_of(kind)
    assert saved.doc["plan"]["authority_digest"] == saved.plan.authority_digest
    doc = _altered(_without_receipt(saved.doc), ("plan", "authority_digest"), "5" * 64)
    with pytest.raises(cal.PlanFileMismatch, match="plan id"):
        saved.reload(doc)


def test_plan_file_with_its_receipt_removed_refused(saved):
    doc = {k: v for k, v in saved.doc.items() if k != "receipt"}
    with pytest.raises(cal.PlanFileMismatch, match="receipt"):
        saved.reload(doc)


def test_plan_file_with_an_unknown_top_level_key_refused(saved):
    with pytest.raises(cal.PlanFileMismatch, match="unknown key.*surprise"):
        saved.reload({**saved.doc, "surprise": 1})


# ---- Receipt numbers ----------------------------------------------------------------------------


def _cases(common, expert_id, dense_q4) -> list:
    """pytest params (kind, where, value, field) of the cases every kind has, the expert-ID kinds
    have and the dense Q4 kind has."""
    groups = ((common, KINDS), (expert_id, EXPERT_ID_KINDS), (dense_q4, ["dense_q4"]))
    return [
        pytest.param(
            kind,
            where,
            value,
            field,
            id=f"{kind}-{'.'.join(map(str, where[1:]))}={getattr(value, '__name__', value)!r}",
        )
        for cases, kinds in groups
        for where, value, field in cases
        for kind in kinds
    ]


TIMING = ("receipt", "decisions", 0, "timings", 0, "wall")
PROOF = ("receipt", "decisions", 0, "proofs", 0)
NUMBERS = _cases(
    [
        (("receipt", "elapsed_ms"), -1.0, "elapsed_ms"),
        (("receipt", "elapsed_ms"), 2**64, "elapsed_ms"),
        (("receipt", "elapsed_ms"), 1e308, "elapsed_ms"),
        (("receipt", "deadline_overrun_ms"), -0.5, "deadline_overrun_ms"),
        ((*TIMING, "median_us"), -5.0, "median_us"),
        ((*TIMING, "median_us"), 1e308, "median_us"),
        ((*TIMING, "p75_us"), 2**64, "p75_us"),
        ((*TIMING, "samples"), 2**64, "samples"),
        ((*TIMING, "samples"), 0, "samples"),
        ((*TIMING, "samples"), 5.0, "samples"),
        ((*TIMING, "samples"), True, "samples"),
        (("receipt", "proof_submissions"), 2**64, "proof_submissions"),
        (("receipt", "proof_submissions"), 1.0, "proof_submissions"),
        (("receipt", "declared_shapes"), 2.0, "declared_shapes"),
        (("receipt", "decisions", 0, "timing_submissions"), 2**64, "timing_submissions"),
        (("receipt", "activation_epoch"), 3.0, "activation_epoch"),
    ],
    [
        ((*PROOF, "rel_frobenius_error"), -1.0, "rel_frobenius_error"),
        ((*PROOF, "tolerance"), -1e-3, "tolerance"),
        ((*PROOF, "status_bits"), 2**64, "status_bits"),
        ((*PROOF, "status_bits"), 128, "status_bits"),
        ((*PROOF, "status_bits"), 0.0, "status_bits"),
        (("receipt", "decisions", 0, "proof_dispatches"), 2**64, "proof_dispatches"),
        (("receipt", "decisions", 0, "theorem_authorized_weight_identities"), 1.0, "theorem_authorized"),
    ],
    [
        (("receipt", "proof_gpu_us"), -1.0, "proof_gpu_us"),
        (("receipt", "proof_gpu_us"), 1e308, "proof_gpu_us"),
        (("receipt", "decisions", 0, "proof_gpu_us"), -1.0, "proof_gpu_us"),
        (("receipt", "decisions", 0, "proof_scratch_bytes"), 2**64, "proof_scratch_bytes"),
        (("receipt", "peak_proof_scratch_bytes"), 1.0e3, "peak_proof_scratch_bytes"),
    ],
)


@pytest.mark.parametrize("kind,where,value,field", NUMBERS)
def test_out_of_range_receipt_number_refused(saved_of, kind, where, value, field):
    saved = saved_of(kind)
    with pytest.raises(cal.PlanFileMismatch, match=f"malformed calibration receipt: .*{field}"):
        saved.reload(_altered(saved.doc, where, value))


# ---- Receipt lists and counts ---------------------------------------------------------------------


def emptied(items):
    return []


def tripled(items):
    return items * 3


def first_only(items):
    return items[:1]


def plus_one(n):
    return n + 1


def p25_above_median(p25):
    return p25 + 1e3


def a_day_of_overrun(ms):
    return 86_400_000.0


def flipped(route):
    return "flip"  # replaced by the kind's direct route: the receipt's route and status disagree


INCONSISTENT = _cases(
    [
        (("receipt", "decisions", 0, "timings"), emptied, "timings"),
        (("receipt", "decisions", 0, "timings"), tripled, "timings"),
        (("receipt", "decisions"), tripled, "decisions"),
        (("receipt", "decisions"), emptied, "decisions"),
        (("receipt", "declared_shapes"), plus_one, "declared_shapes"),
        (("receipt", "process_cache_hits"), plus_one, "process_cache_hits"),
        (("receipt", "calibrated_decisions"), lambda n: n + 5, "calibrated_decisions"),
        (("receipt", "proof_submissions"), plus_one, "proof_submissions"),
        (("receipt", "timing_submissions"), plus_one, "timing_submissions"),
        (("receipt", "cleanup_submissions"), plus_one, "cleanup_submissions"),
        (("receipt", "calibration_submissions"), plus_one, "calibration_submissions"),
        (("receipt", "decisions", 0, "calibration_submissions"), plus_one, "calibration_submissions"),
        (("receipt", "deadline_overrun_ms"), a_day_of_overrun, "deadline_overrun_ms"),
        ((*TIMING, "p25_us"), p25_above_median, "p25_us"),
        (("receipt", "decisions", 0, "selected_route"), flipped, "selected_route"),
    ],
    [
        (("receipt", "decisions", 0, "proofs"), emptied, "proofs"),
        (("receipt", "decisions", 0, "proofs"), tripled, "proofs"),
        (("receipt", "decisions", 0, "candidates"), emptied, "candidates"),
        (("receipt", "decisions", 0, "candidates"), tripled, "candidates"),
        (("receipt", "decisions", 0, "timings"), first_only, "timings"),
        (("receipt", "direct_decisions"), plus_one, "direct_decisions"),
        (("receipt", "proof_dispatches"), plus_one, "proof_dispatches"),
        (("receipt", "timing_dispatches"), plus_one, "timing_dispatches"),
    ],
    [
        (("receipt", "compatibility_route_decisions"), plus_one, "compatibility_route_decisions"),
        (("receipt", "authorized_shape_weight_pairs"), plus_one, "authorized_shape_weight_pairs"),
        (("receipt", "proof_route_dispatches"), plus_one, "proof_route_dispatches"),
        (("receipt", "decisions", 0, "proof_auxiliary_dispatches"), plus_one, "proof_auxiliary_dispatches"),
        (("receipt", "peak_proof_scratch_bytes"), plus_one, "peak_proof_scratch_bytes"),
    ],
)


@pytest.mark.parametrize("kind,where,change,field", INCONSISTENT)
def test_inconsistent_receipt_refused(saved_of, kind, where, change, field):
    saved = saved_of(kind)
    if change is flipped:
        change = saved.direct
    with pytest.raises(cal.PlanFileMismatch, match=f"malformed calibration receipt: .*{field}"):
        saved.reload(_altered(saved.doc, where, change))


def test_reloaded_receipt_is_itself_a_valid_receipt(saved):
    """A receipt made by a reload (every outcome pinned from the file) saves and reloads again."""
    registry = routemm.KernelRegistry(saved.device)
    path = saved.root / "first.json"
    path.write_text(json.dumps(saved.doc))
    plan, receipt = saved.load(path, registry, saved.device, saved.cases)
    again = plan.save(saved.root / "again.json", receipt)
    plan2, receipt2 = saved.load(again, routemm.KernelRegistry(saved.device), saved.device, saved.cases)
    assert plan2._lookup == saved.plan._lookup
    assert [d.timings for d in receipt2.decisions] == [d.timings for d in saved.receipt.decisions]


# ---- Receipts saved in the tree -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    sorted(
        str(p.relative_to(ROOT))
        for pattern in ("calibration/*-receipt.json", "q4_plan_receipt-*.json")
        for p in (ROOT / "bench" / "results").glob(pattern)
    ),
)
def test_saved_receipts_in_the_tree_load(name):
    doc = json.loads((ROOT / name).read_text())
    receipt = rp.read_receipt(dq.KIND, doc)
    assert receipt.declared_shapes == len(receipt.decisions) > 0
