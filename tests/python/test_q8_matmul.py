"""quantized_matmul_ggml with Q8_0 weights: the mat-vec (m <= 8) and the matrix route (m > 8)
against a float64 reference over the dequantised weights (tails in M, N and K), receipts, routing,
poisoned outputs and guarded views; on the CPU oracle both pipelines are bit-identical to each
other and to the quantised expert-ID op."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseQ4DecisionSource as Decision
from routemm import DenseQ4Route as Route
from routemm import GgmlType, q8_0
from support import guarded, guarded_output, validate

pytestmark = pytest.mark.needs_kernels(*routemm.Q8_MATMUL_PIPELINE_NAMES)

LABEL_SUFFIX = "|700:i1|701:i1|702:i1"


def _run(device, registry, blocks, x, n):
    m, k = x.shape
    weight = guarded(device, blocks, routemm.DType.U8, blocks.shape)
    inp = guarded(device, x, routemm.DType.F32, x.shape)
    out = guarded_output(device, m, n)
    encoder = device.command_encoder()
    receipt = routemm.quantized_matmul_ggml(
        encoder, registry, inp.view, weight.view, out.view, routemm.GgmlQuantizedMatmulParams(m, n, k, GgmlType.Q8_0)
    )
    encoder.commit_and_wait()
    weight.assert_unchanged("weight")
    inp.assert_unchanged("input")
    out.assert_guards_intact("output")
    return out.view.numpy().reshape(m, n), receipt


@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 33, 130])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (70, 320), (129, 1024)])
def test_q8_0_matches_reference(device, registry, rng, m, n, k):
    blocks = q8_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32))
    w = q8_0.dequantize(blocks).astype(np.float64)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    got, receipt = _run(device, registry, blocks, x, n)
    ref = x.astype(np.float64) @ w.T
    mag = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(got - ref) <= 2.0**-20 * mag * k**0.5 + 1e-30)
    mat_vec = m <= routemm.quantized_matmul.MM_ROUTING_THRESHOLD
    name = routemm.Q8_MATMUL_PIPELINE_NAMES[0 if mat_vec else 1]
    assert receipt.ggml_type is GgmlType.Q8_0
    assert receipt.pipeline_label == name + LABEL_SUFFIX == receipt.dispatch.pipeline_label
    assert receipt.route == ("mat_vec" if mat_vec else Route.COMPATIBILITY_SIMDGROUP.value)
    assert receipt.decision is (Decision.MAT_VEC_THRESHOLD if mat_vec else Decision.INELIGIBLE_COMPATIBILITY_FALLBACK)
    assert receipt.dispatch_count == 1
    validate(receipt)


def test_cpu_mat_vec_and_matrix_route_are_bit_identical(rng):
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    n, k = 67, 512
    blocks = q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((20, k)).astype(np.float32)
    matrix, _ = _run(device, registry, blocks, x, n)
    for row in range(0, 20, 7):
        vec, _ = _run(device, registry, blocks, x[row : row + 1], n)
        np.testing.assert_array_equal(vec.view(np.uint32), matrix[row : row + 1].view(np.uint32))


def test_q8_0_has_only_the_simdgroup_matrix_route(device, registry, rng):
    blocks = q8_0.quantize(np.zeros((4, 64), np.float32))
    weight = device.from_numpy(blocks)
    inp = device.from_numpy(np.zeros((9, 64), np.float32))
    out = device.alloc(9 * 4 * 4, routemm.DType.F32, [9, 4])
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="forced dense Q4 MM route requires Q4_0"):
        routemm.encode_q4_route(
            encoder,
            registry,
            inp,
            weight,
            out,
            routemm.GgmlQuantizedMatmulParams(9, 4, 64, GgmlType.Q8_0),
            Route.COMPATIBILITY_V2,
        )
    # Any policy gives the one Q8_0 matrix route.
    for policy in (routemm.GgmlRoutingPolicy(), routemm.GgmlRoutingPolicy(allow_dense_large_tile_mm=False)):
        receipt = routemm.quantized_matmul_ggml(
            encoder, registry, inp, weight, out, routemm.GgmlQuantizedMatmulParams(9, 4, 64, GgmlType.Q8_0), policy
        )
        assert receipt.route == Route.COMPATIBILITY_SIMDGROUP.value
    encoder.commit_and_wait()


def test_q8_0_weight_size_is_checked_with_34_byte_blocks(device, registry):
    weight = device.alloc(4 * 2 * 34 - 1, routemm.DType.U8)
    inp = device.alloc(64 * 4, routemm.DType.F32)
    out = device.alloc(4 * 4, routemm.DType.F32)
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="Weight buffer too small: need 272 bytes, got 271"):
        routemm.quantized_matmul_ggml(
            encoder, registry, inp, weight, out, routemm.GgmlQuantizedMatmulParams(1, 4, 64, GgmlType.Q8_0)
        )
