"""Saved route plans fail closed, for every plan kind.

* A plan's id is recomputed from its own contents and checked whether or not the file holds a
  receipt: a plan saved without one, its route flipped (and its id zeroed or kept), is refused.

Every refusal is a PlanFileMismatch (a routemm.Error).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import routemm
from routemm import calibration as cal
from routemm import q4_0

KINDS = ["dense_q4", "dense_matmul_id", "quantized_matmul_id"]
EXPERT_ID_KINDS = KINDS[1:]


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
