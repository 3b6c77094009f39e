"""quantized_matmul_id_ggml rejections: capability messages in order, per-buffer call checks, and
that a rejected call encodes nothing (the dispatch count does not move and the encoder stays
usable)."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DType, GgmlType
from routemm import GgmlQuantizedMatmulIdRoute as Route

pytestmark = pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES)

U32 = 2**32 - 1
U64 = 2**64 - 1


def _params(**kw):
    base = dict(m=9, n=7, k=64, top_k=4, n_experts=8, ggml_type=GgmlType.Q4_0, expert_stride_bytes=7 * 2 * 18)
    base.update(kw)
    return routemm.GgmlQuantizedMatmulIdParams(**base)


@pytest.mark.parametrize(
    "spec,message",
    [
        (dict(m=0), "M, N, K, top_k, and n_experts must be nonzero"),
        (dict(n_experts=0), "M, N, K, top_k, and n_experts must be nonzero"),
        (
            dict(ggml_type=GgmlType.Q3_K),
            r"does not support q3_k \(supported: q4_0, q8_0, q4_1, q5_0, q5_1, mxfp4, q4_k, q5_k, q6_k\)",
        ),
        (dict(k=48), r"K \(48\) must be divisible by block QK \(32\)"),
        (dict(top_k=9, route=Route.GROUPED), "distinct top_k 9 exceeds n_experts 8"),
        (dict(n_experts=1025, route=Route.GROUPED), "grouped route supports at most 1024 experts"),
        (dict(expert_stride_bytes=251), "expert stride 251 is smaller than one 252-byte matrix"),
        (dict(ggml_type=GgmlType.Q8_0), "expert stride 252 is smaller than one 476-byte matrix"),
        (dict(expert_stride_bytes=253), "expert stride 253 is not aligned to the 2-byte block scale"),
        (dict(n_experts=U32, expert_stride_bytes=U64 - 1, top_k=1), "expert weight offset overflow"),
        (dict(n_experts=2, expert_stride_bytes=U64 - 1, top_k=1), "weight extent overflow"),
        (dict(m=2**31, top_k=2), "flattened routed rows exceed the u32 kernel ABI"),
    ],
)
def test_capability_rejections(spec, message):
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match=f"^quantized_matmul_id_ggml {message}$"):
        routemm.quantized_matmul_id_ggml_capability(_params(**spec))
    assert routemm.dispatch_count() == before


def test_capability_extents():
    cap = routemm.quantized_matmul_id_ggml_capability(
        _params(expert_stride_bytes=300, input_layout=Layout.SLOTTED, route=Route.GROUPED)
    )
    assert cap.required_weight_bytes == 7 * 300 + 252
    assert cap.required_input_bytes == 9 * 4 * 64 * 4
    assert cap.required_ids_bytes == 9 * 4 * 4
    assert cap.required_output_bytes == 9 * 4 * 7 * 4
    assert cap.scratch == routemm.DenseMatmulIdScratchRequirement(8 * 4, 8 * 9 * 4)
    q8 = routemm.quantized_matmul_id_ggml_capability(_params(ggml_type=GgmlType.Q8_0, expert_stride_bytes=476))
    assert q8.required_weight_bytes == 8 * 476 and q8.scratch is None


@pytest.mark.parametrize("field,value", [("m", -1), ("k", 2**32), ("expert_stride_bytes", 2**64), ("top_k", True)])
def test_field_ranges(field, value):
    with pytest.raises(routemm.InvalidArgumentError, match=f"{field} must be a u"):
        routemm.quantized_matmul_id_ggml_capability(_params(**{field: value}))


class Bufs:
    def __init__(self, device, params, **overrides):
        cap = routemm.quantized_matmul_id_ggml_capability(params)
        self.weights = overrides.get("weights") or device.alloc(cap.required_weight_bytes, DType.U8)
        self.input = overrides.get("input") or device.alloc(cap.required_input_bytes, DType.F32)
        self.ids = overrides.get("ids") or device.from_numpy(np.zeros(params.m * params.top_k, np.uint32))
        self.output = overrides.get("output") or device.alloc(cap.required_output_bytes, DType.F32)
        self.scratch = overrides.get("scratch", routemm.DenseMatmulIdScratch(device, params.n_experts, params.m))


def _expect_rejected(device, registry, params, bufs, message):
    encoder = device.command_encoder()
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match=message):
        routemm.quantized_matmul_id_ggml(
            encoder, registry, bufs.input, bufs.weights, bufs.ids, bufs.output, bufs.scratch, params
        )
    encoder.commit_and_wait()
    assert routemm.dispatch_count() == before


@pytest.mark.parametrize("route", list(Route))
def test_call_rejections_encode_nothing(device, registry, route):
    p = _params(route=route)
    cap = routemm.quantized_matmul_id_ggml_capability(p)
    cases = [
        (dict(weights=device.alloc(cap.required_weight_bytes - 1, DType.U8)), "weights requires 2016 logical bytes"),
        (dict(weights=device.alloc(cap.required_weight_bytes, DType.F32)), "weights must be u8, got f32"),
        (dict(input=device.alloc(cap.required_input_bytes, DType.F16)), "input must be f32, got f16"),
        (dict(ids=device.alloc(cap.required_ids_bytes, DType.I32)), "expert IDs must be u32, got i32"),
        (dict(output=device.alloc(cap.required_output_bytes - 4, DType.F32)), "output requires"),
    ]
    parent = device.alloc(cap.required_weight_bytes + 1, DType.U8)
    cases.append((dict(weights=parent.view(1, cap.required_weight_bytes, DType.U8, [])), "weights byte offset 1"))
    if route.is_grouped:
        cases.append((dict(scratch=None), "grouped route requires caller-owned scratch"))
        cases.append((dict(scratch=routemm.DenseMatmulIdScratch(device, 7, 9)), "scratch capacity experts/tokens=7/9"))
    for overrides, message in cases:
        _expect_rejected(device, registry, p, Bufs(device, p, **overrides), message)


def test_output_must_not_overlap_an_input(device, registry):
    p = _params(m=1, n=32, k=32, top_k=1, n_experts=1, expert_stride_bytes=32 * 18)
    cap = routemm.quantized_matmul_id_ggml_capability(p)
    shared = device.alloc(cap.required_output_bytes, DType.F32)
    _expect_rejected(device, registry, p, Bufs(device, p, input=shared, output=shared), "output must not overlap input")


def test_injected_lookup_failure_leaves_no_trace(device, registry):
    p = _params(route=Route.GROUPED)
    name = routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES[2]
    registry.inject_next_pipeline_lookup_failure(name)
    encoder = device.command_encoder()
    encoder.start_capture()
    bufs = Bufs(device, p)
    with pytest.raises(routemm.Error, match=name):
        routemm.quantized_matmul_id_ggml(
            encoder, registry, bufs.input, bufs.weights, bufs.ids, bufs.output, bufs.scratch, p
        )
    assert encoder.take_capture() == []
