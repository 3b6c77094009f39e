"""quantized_matmul_ggml with Q8_0 weights: the mat-vecs (m <= 8: the nr2 one by default, the
lane-contract one with dense_q8_0_mv_nr2 off) and the matrix route (m > 8) against a float64
reference over the dequantised weights (tails in M, N and K), receipts, routing, geometry, poisoned
outputs and guarded views; on the CPU oracle every pipeline is bit-identical to the others and to
the quantised expert-ID op."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseQ4DecisionSource as Decision
from routemm import DenseQ4Route as Route
from routemm import GgmlType, q8_0
from support import run_ggml_guarded, validate
from tolerances import accumulation_bound

pytestmark = pytest.mark.needs_kernels(*routemm.Q8_MATMUL_PIPELINE_NAMES)

LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
NR2 = routemm.Q8_0_MAT_VEC_NR2_PIPELINE
LANE_MAT_VEC = routemm.Q8_MATMUL_PIPELINE_NAMES[0]
# Backends with the nr2 mat-vec; the others (CUDA: its own Q8_0 geometry) run LANE_MAT_VEC.
NR2_BACKENDS = ("cpu", "metal", "metal_emu")


def _mat_vec_pipeline(device, policy=None):
    """The mat-vec pipeline a call on `device` must take under `policy` (None: the default)."""
    nr2 = (policy or routemm.GgmlRoutingPolicy()).dense_q8_0_mv_nr2
    return NR2 if nr2 and device.backend in NR2_BACKENDS else LANE_MAT_VEC


def _run(device, registry, blocks, x, n, weight_guard=16, input_guard=16, policy=None):
    """Runs one Q8_0 product; the guards (bytes of padding before each view) set the views' alignment."""
    return run_ggml_guarded(device, registry, GgmlType.Q8_0, blocks, x, n, policy, weight_guard, input_guard)


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
    mat_vec = m <= routemm.ops.quantized_matmul.MM_ROUTING_THRESHOLD
    name = _mat_vec_pipeline(device) if mat_vec else routemm.Q8_MATMUL_PIPELINE_NAMES[1]
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


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 7, 70, 129])
def test_mat_vec_geometry_follows_the_policy(device, registry, rng, m, n):
    """Spec §5.5: by default the nr2 mat-vec, grid [ceil(N/2), M, 1], threads [32, 4, 1], 256 bytes
    of threadgroup memory at index 0; with dense_q8_0_mv_nr2 off the lane-contract mat-vec,
    [ceil(N/8), M, 1] x [8, 8, 1], none. Receipt, label and encoded dispatch agree, and the receipt
    records the policy the call ran under. Backends without the nr2 pipeline take the other."""
    k = 64
    blocks = q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    for policy in (routemm.GgmlRoutingPolicy(), routemm.GgmlRoutingPolicy(dense_q8_0_mv_nr2=False)):
        _, receipt = _run(device, registry, blocks, x, n, policy=policy)
        name = _mat_vec_pipeline(device, policy)
        d = receipt.dispatch
        assert receipt.pipeline_label == d.pipeline_label == name + LABEL_SUFFIX
        assert receipt.route == "mat_vec" and receipt.decision is Decision.MAT_VEC_THRESHOLD
        assert receipt.policy == policy
        if name == NR2:
            assert (d.grid, d.threads_per_threadgroup, d.threadgroup_memory) == (
                ((n + 1) // 2, m, 1),
                (32, 4, 1),
                ((0, 256),),
            )
        elif device.backend in NR2_BACKENDS:
            assert (d.grid, d.threads_per_threadgroup, d.threadgroup_memory) == (((n + 7) // 8, m, 1), (8, 8, 1), ())
        validate(receipt)


def test_environment_turns_the_nr2_mat_vec_off(device, registry, rng, monkeypatch):
    """ROUTEMM_Q8_0_MV_NR2=off reaches the dispatcher through GgmlRoutingPolicy.from_environment()
    (calls that pass no policy on a registry without a frozen one)."""
    blocks = q8_0.quantize(rng.standard_normal((5, 32)).astype(np.float32))
    x = rng.standard_normal((1, 32)).astype(np.float32)
    monkeypatch.setenv("ROUTEMM_Q8_0_MV_NR2", "off")
    _, receipt = _run(device, registry, blocks, x, 5)
    assert receipt.pipeline_label == LANE_MAT_VEC + LABEL_SUFFIX and not receipt.policy.dense_q8_0_mv_nr2
    monkeypatch.delenv("ROUTEMM_Q8_0_MV_NR2")
    _, receipt = _run(device, registry, blocks, x, 5)
    assert receipt.pipeline_label == _mat_vec_pipeline(device) + LABEL_SUFFIX


# K: one block; blocks not a multiple of the 64 that the nr2 threadgroup's 128 threads cover per
# step (a K tail) and several steps; N: odd (a half-empty last row pair) and even.
@pytest.mark.parametrize("n,k", [(1, 32), (3, 96), (7, 2080), (10, 4096 + 32), (129, 1024)])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_both_mat_vecs_within_the_accumulation_bound(device, registry, rng, n, k, m):
    """Both Q8_0 mat-vecs meet the F32 accumulation bound against float64; on the CPU oracle they
    compute every output with the same arithmetic (equal bits). Metal's nr2 kernel splits each row
    over 128 threads and reduces in two simd_sum stages, so its bits may differ from the
    lane-contract kernel's."""
    blocks = q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    ref, mag = _reference(blocks, x)
    nr2, _ = _run(device, registry, blocks, x, n)
    lane, _ = _run(device, registry, blocks, x, n, policy=routemm.GgmlRoutingPolicy(dense_q8_0_mv_nr2=False))
    assert np.all(np.abs(nr2 - ref) <= accumulation_bound(k, mag))
    assert np.all(np.abs(lane - ref) <= accumulation_bound(k, mag))
    if device.backend == "cpu":
        np.testing.assert_array_equal(nr2.view(np.uint32), lane.view(np.uint32))


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


# Backends whose Q8_0 mat-vec and matrix routes share one summation order (equal bits per token).
ROUTES_BIT_IDENTICAL = ("cpu", "cuda")


def _reference(blocks, x):
    w = q8_0.dequantize(blocks).astype(np.float64)
    x64 = x.astype(np.float64)
    return x64 @ w.T, np.abs(x64) @ np.abs(w).T


# K: one block, a tail of 1 to 7 blocks past a multiple of 8 (K % 256 != 0), halves of one and
# several 16-block stages, a long row (the ring wraps many times); N: 1 and beyond a multiple of 8.
@pytest.mark.parametrize("n,k", [(1, 32), (9, 288), (17, 544), (23, 2048), (8, 4096 + 96), (11, 14336)])
def test_routes_bit_identical_and_within_the_accumulation_bound(device, registry, rng, n, k):
    """On the CPU and CUDA the Q8_0 routes share one F32 FMA order whatever the token count, so the
    mat-vec (m <= 8, one token at a time or together) and the matrix route give the same bits for a
    token; Metal's matrix route sums in simdgroup-matrix tiles (no promised order). Every result
    is within the rigorous F32 accumulation bound of the CPU contract (exact weights, chains of at
    most K / 8 FMAs, a short reduction)."""
    blocks = q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((13, k)).astype(np.float32)
    ref, mag = _reference(blocks, x)
    matrix, _ = _run(device, registry, blocks, x, n)
    assert np.all(np.abs(matrix - ref) <= accumulation_bound(k, mag))
    for rows in ((0, 1), (3, 5), (5, 13)):  # one, two and eight tokens through the mat-vec
        vec, _ = _run(device, registry, blocks, x[rows[0] : rows[1]], n)
        assert np.all(np.abs(vec - ref[rows[0] : rows[1]]) <= accumulation_bound(k, mag[rows[0] : rows[1]]))
        if device.backend in ROUTES_BIT_IDENTICAL:
            np.testing.assert_array_equal(vec.view(np.uint32), matrix[rows[0] : rows[1]].view(np.uint32))


@pytest.mark.parametrize("weight_guard,input_guard", [(17, 16), (18, 16), (20, 16), (24, 16), (16, 20)])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_unaligned_views_give_the_same_bits(device, registry, rng, weight_guard, input_guard, m):
    """A weight view 1, 2, 4 or 8 bytes off 16-byte alignment (blocks are 34 bytes: any byte
    offset is valid) or an input view 4 bytes off: narrower copies and loads, the same order,
    the same bits as aligned views."""
    n, k = 19, 2048 + 256
    blocks = q8_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    aligned, _ = _run(device, registry, blocks, x, n)
    shifted, _ = _run(device, registry, blocks, x, n, weight_guard=weight_guard, input_guard=input_guard)
    np.testing.assert_array_equal(shifted.view(np.uint32), aligned.view(np.uint32))
    ref, mag = _reference(blocks, x)
    assert np.all(np.abs(shifted - ref) <= accumulation_bound(k, mag))


def test_matrix_route_beyond_65535_row_tiles(device, registry, rng):
    """n = 8 * 65536 + 9 rows: more row tiles of the matrix route than a CUDA grid's y extent
    holds, so the kernel walks the rest; every output is written (the guarded output starts
    poisoned) and correct."""
    n, k, m = 8 * 65536 + 9, 32, 9
    blocks = q8_0.quantize(rng.uniform(-1, 1, (n, k)).astype(np.float32))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    got, receipt = _run(device, registry, blocks, x, n)
    assert receipt.route == Route.COMPATIBILITY_SIMDGROUP.value
    ref, mag = _reference(blocks, x)
    assert np.all(np.abs(got - ref) <= accumulation_bound(k, mag))
