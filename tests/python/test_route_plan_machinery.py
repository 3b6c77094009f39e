"""The plan machinery every plan kind shares: per-kind records, kinds and the entry points."""

from __future__ import annotations

import dataclasses

import pytest
import routemm
from routemm.plans import _expert_id_plan as ex
from routemm.plans import _route_plan as rp
from routemm.plans import dense_matmul_id_plan as dp
from routemm.plans import dense_q4_plan as dq
from routemm.plans import quantized_matmul_id_plan as qp


def test_kind_records_are_named_frozen_records_of_their_schema():
    for cls, module, schema in (
        (dp.DenseMatmulIdRoutePlan, dp.__name__, "dense_matmul_id_route_plan.schema.json"),
        (dp.DenseMatmulIdCalibrationDecision, dp.__name__, "dense_matmul_id_calibration_receipt.schema.json"),
        (dp.DenseMatmulIdAutoReceipt, dp.__name__, "dense_matmul_id_plan_auto_receipt.schema.json"),
        (qp.GgmlQuantizedMatmulIdRoutePlan, qp.__name__, "ggml_quantized_matmul_id_route_plan.schema.json"),
        (
            qp.GgmlQuantizedMatmulIdCandidateProof,
            qp.__name__,
            "ggml_quantized_matmul_id_calibration_receipt.schema.json",
        ),
        (qp.GgmlQuantizedMatmulIdAutoReceipt, qp.__name__, "ggml_quantized_matmul_id_plan_auto_receipt.schema.json"),
        (dq.DenseQ4PlanDecision, dq.__name__, "dense_q4_route_plan.schema.json"),
        (dq.DenseQ4TimingDistribution, dq.__name__, "dense_q4_calibration_receipt.schema.json"),
    ):
        assert (cls.__module__, cls.__qualname__, cls.SCHEMA) == (module, cls.__name__, schema)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen and cls.__doc__
    fields = dataclasses.fields(dp.DenseMatmulIdRoutePlan)
    assert [f.name for f in fields][-2:] == ["theorem_sha256", "schema_version"]
    assert fields[-1].default == dp.SCHEMA_VERSION
    assert [f.name for f in dataclasses.fields(dp.DenseMatmulIdRouteTiming)] == ["profile", "route", "wall", "gpu"]


def test_expert_id_records_decode_their_kinds_types():
    timing = dp.DenseMatmulIdTimingDistribution(1.0, 2.0, 3.0, 5)
    rt = dp.DenseMatmulIdRouteTiming(
        ex.DenseMatmulIdRoutingProfile.BALANCED, routemm.DenseMatmulIdRoute.DIRECT, timing, timing
    )
    back = dp.DenseMatmulIdRouteTiming.from_dict(rt.to_dict())
    assert back == rt and type(back.wall) is dp.DenseMatmulIdTimingDistribution
    assert back.route is routemm.DenseMatmulIdRoute.DIRECT


def test_every_kind_is_a_plan_kind_bound_to_its_plan():
    for module in (dp, dq):
        assert isinstance(module.KIND, rp.PlanKind) and module.KIND.plan_type.KIND is module.KIND
    assert dq.KIND.plannable_routes == (routemm.DenseQ4Route.COMPATIBILITY_V2, routemm.DenseQ4Route.TENSOR_64X32)


def test_unknown_calibration_options_are_refused(device):
    with pytest.raises(TypeError):
        routemm.calibrate_dense_matmul_id_routes(routemm.KernelRegistry(device), device, 1, None, [], _fault=1)
