"""quantized_matmul_ggml validation (spec §5.3): every message, in order, each before anything is
encoded (dispatch_count unchanged, an open receipt stays empty, a capture records nothing)."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseQ4Route as Route
from routemm import DType, GgmlType
from routemm import GgmlQuantizedMatmulParams as Params
from support import Q4_BASE_PIPELINES

# The Q4_0 pipelines exist on the CPU backend; other backends gain them later.
pytestmark = pytest.mark.needs_kernels(*Q4_BASE_PIPELINES)

I32_MAX = 2**31 - 1


def _buffers(
    device,
    m,
    n,
    k,
    *,
    weight_bytes=None,
    input_bytes=None,
    output_bytes=None,
    input_dtype=DType.F32,
    weight_dtype=DType.U8,
    output_dtype=DType.F32,
):
    weight_bytes = n * (k // 32) * 18 if weight_bytes is None else weight_bytes
    input_bytes = m * k * 4 if input_bytes is None else input_bytes
    output_bytes = m * n * 4 if output_bytes is None else output_bytes
    weight = device.alloc(max(weight_bytes, 0), weight_dtype, [max(weight_bytes, 0) // weight_dtype.size])
    inp = device.alloc(input_bytes, input_dtype, [input_bytes // input_dtype.size])
    out = device.alloc(output_bytes, output_dtype, [output_bytes // output_dtype.size])
    weight.copy_from_numpy(np.zeros(weight.nbytes, np.uint8))
    inp.copy_from_numpy(np.zeros(inp.nbytes, np.uint8))
    return inp, weight, out


def _expect_nothing_encoded(device, registry, call, match):
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(1)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.Error, match=match):
        call(encoder)
    assert routemm.dispatch_count() == before
    assert encoder.take_encoded_dispatch_receipt() == []
    assert encoder.pending_dispatches == 0
    capture = device.command_encoder()
    capture.start_capture()
    with pytest.raises(routemm.Error, match=match):
        call(capture)
    assert capture.take_capture() == []


def _op(registry, bufs, params, routing=None, route=None):
    inp, weight, out = bufs

    def call(encoder):
        if route is not None:
            return routemm.encode_q4_route(encoder, registry, inp, weight, out, params, route)
        return routemm.quantized_matmul_ggml(
            encoder, registry, inp, weight, out, params, routing or routemm.GgmlRoutingPolicy()
        )

    return call


def test_messages_in_order(device, registry):
    """Start from a call with every defect and repair them one by one: each step reports the next
    check of spec §5.3's order."""
    steps = [
        # (params, buffer overrides, expected message)
        (
            Params(2**31, 5, 48, GgmlType.Q3_K),
            dict(input_dtype=DType.F16, input_bytes=8, weight_bytes=1, output_bytes=4),
            r"quantized_matmul_ggml requires F32 input, native U8 GGUF blocks, and F32 output; got input f16",
        ),
        (
            Params(2**31, 5, 48, GgmlType.Q3_K),
            dict(input_bytes=8, weight_bytes=1, output_bytes=4),
            r"exceeds the signed kernel ABI",
        ),
        (
            Params(4, 5, 0, GgmlType.Q3_K),
            dict(input_bytes=8, weight_bytes=1, output_bytes=4),
            r"quantized_matmul_ggml does not support q3_k \(supported: q4_0, q8_0, q4_1, q5_0, q5_1, mxfp4, q4_k, q5_k, q6_k\)",
        ),
        (Params(4, 5, 0), dict(input_bytes=8, weight_bytes=1, output_bytes=4), r"M, K, and N must all be > 0"),
        (
            Params(4, 5, 48),
            dict(input_bytes=8, weight_bytes=1, output_bytes=4),
            r"K \(48\) must be divisible by block QK \(32\)",
        ),
        (
            Params(4, 5, 64),
            dict(input_bytes=8, weight_bytes=5 * 2 * 18 - 1, output_bytes=4),
            r"Weight buffer too small: need 180 bytes, got 179",
        ),
        (
            Params(4, 5, 64),
            dict(input_bytes=4 * 64 * 4 - 4, output_bytes=4),
            r"Input buffer too small: need 1024 bytes, got 1020",
        ),
        (Params(4, 5, 64), dict(output_bytes=4 * 5 * 4 - 4), r"Output buffer too small: need 80 bytes, got 76"),
    ]
    for params, overrides, message in steps:
        m, n, k = (min(v, 64) for v in (params.m, params.n, params.k))
        bufs = _buffers(device, m, n, max(k, 32), **overrides)
        _expect_nothing_encoded(device, registry, _op(registry, bufs, params), message)
    # Fully repaired, the call encodes exactly one dispatch.
    bufs = _buffers(device, 4, 5, 64)
    encoder = device.command_encoder()
    receipt = _op(registry, bufs, Params(4, 5, 64))(encoder)
    encoder.commit_and_wait()
    assert receipt.dispatch_count == 1


@pytest.mark.parametrize("field", ["m", "n", "k"])
def test_each_dimension_checked_against_i32(device, registry, field):
    dims = dict(m=4, n=5, k=64)
    dims[field] = I32_MAX + 1
    bufs = _buffers(device, 4, 5, 64)
    _expect_nothing_encoded(device, registry, _op(registry, bufs, Params(**dims)), "exceeds the signed kernel ABI")


@pytest.mark.parametrize("field", ["m", "n", "k"])
def test_each_dimension_must_be_positive(device, registry, field):
    dims = dict(m=4, n=5, k=64)
    dims[field] = 0
    bufs = _buffers(device, 4, 5, 64)
    _expect_nothing_encoded(device, registry, _op(registry, bufs, Params(**dims)), r"M, K, and N must all be > 0")


@pytest.mark.parametrize(
    "which,dtype", [("weight_dtype", DType.F32), ("output_dtype", DType.BF16), ("input_dtype", DType.U8)]
)
def test_dtype_rejections(device, registry, which, dtype):
    bufs = _buffers(device, 4, 5, 64, **{which: dtype})
    _expect_nothing_encoded(
        device,
        registry,
        _op(registry, bufs, Params(4, 5, 64)),
        "requires F32 input, native U8 GGUF blocks, and F32 output",
    )


# The types without kernels (the others: test_ggml_format_kernels.py).
@pytest.mark.parametrize("ggml_type", [GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.IQ4_NL, GgmlType.IQ4_XS])
def test_unsupported_types(device, registry, ggml_type):
    bufs = _buffers(device, 4, 5, 256)
    _expect_nothing_encoded(
        device, registry, _op(registry, bufs, Params(4, 5, 256, ggml_type)), f"does not support {ggml_type.value}"
    )


def test_forced_route_requires_q4_0_and_m_above_8(device, registry):
    for params in (Params(8, 5, 64), Params(1, 5, 64), Params(9, 5, 64, GgmlType.Q8_0)):
        bufs = _buffers(device, 9, 5, 64)
        _expect_nothing_encoded(
            device,
            registry,
            _op(registry, bufs, params, route=Route.TENSOR_64X32),
            r"forced dense Q4 MM route requires Q4_0 and M > 8",
        )
    bufs = _buffers(device, 9, 5, 64, output_bytes=8)
    _expect_nothing_encoded(
        device, registry, _op(registry, bufs, Params(9, 5, 64), route=Route.COMPATIBILITY_V2), "Output buffer too small"
    )


@pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)  # the tensor-API routes too
@pytest.mark.parametrize("m", [1, 9])
def test_injected_lookup_failure_leaves_no_trace(device, registry, m):
    bufs = _buffers(device, m, 5, 64)
    name = "kernel_mul_mv_q4_0_f32" if m == 1 else "kernel_mul_mm_q4_0_tensor_v2_f32"
    registry.inject_next_pipeline_lookup_failure(name)
    encoder = device.command_encoder()
    before = routemm.dispatch_count()
    with pytest.raises(routemm.KernelNotFoundError, match=name):
        _op(registry, bufs, Params(m, 5, 64))(encoder)
    assert routemm.dispatch_count() == before and encoder.pending_dispatches == 0


def test_output_overlap_and_read_only(device, registry):
    inp, weight, out = _buffers(device, 2, 2, 32)
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="output must not overlap input"):
        alias = inp.view(0, 16, DType.F32, [4])
        routemm.quantized_matmul_ggml(
            encoder, registry, inp, weight, alias, Params(2, 2, 32), routemm.GgmlRoutingPolicy()
        )
    assert encoder.pending_dispatches == 0


def test_receipt_without_room_fails_before_encoding(device, registry):
    bufs = _buffers(device, 2, 2, 32)
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(1)
    _op(registry, bufs, Params(2, 2, 32))(encoder)
    with pytest.raises(routemm.InvalidArgumentError, match="no room"):
        _op(registry, bufs, Params(2, 2, 32))(encoder)
    assert len(encoder.take_encoded_dispatch_receipt()) == 1
    encoder.commit_and_wait()


def test_params_must_be_u32():
    with pytest.raises(routemm.InvalidArgumentError, match="u32"):
        Params(-1, 2, 32)._native()
    with pytest.raises(routemm.InvalidArgumentError, match="u32"):
        Params(2**32, 2, 32)._native()


@pytest.mark.parametrize("value", ["no", "yes", "", 0, 1, None])
def test_routing_policy_bool_must_be_a_bool(value):
    """'no' is truthy: a policy built from it would allow the large tile it was meant to forbid."""
    with pytest.raises(routemm.InvalidArgumentError, match="allow_dense_large_tile_mm must be a bool"):
        routemm.GgmlRoutingPolicy(allow_dense_large_tile_mm=value)


@pytest.mark.parametrize("value", ["simd", None, 1])
def test_routing_policy_preference_must_be_a_member(value):
    with pytest.raises(routemm.InvalidArgumentError, match="dense_tensor_mm must be one of"):
        routemm.GgmlRoutingPolicy(dense_tensor_mm=value)


def test_routing_policy_accepts_members_values_and_numpy_bools():
    policy = routemm.GgmlRoutingPolicy("force_simd", np.bool_(False), dense_q8_0_mv_nr2=np.bool_(False))
    assert policy._native() == ("force_simd", False, False, False)
    native = routemm.GgmlRoutingPolicy(routemm.GgmlTensorMmPreference.AUTO_PROBE, True)._native()
    assert native == ("auto_probe", True, True, False)
