"""quantized_matmul_id_ggml: Q4_0 / Q8_0 expert stacks against a float64 reference on the
dequantised weights, direct == grouped bit for bit where the backend's grouped route keeps the
direct order (CPU, CUDA; Metal's multiplies on simdgroup matrices and meets the accumulation bound),
direct == the dense mat-vec bit for bit, invalid ids, padded strides, views and poison, the
flattened expert-down form, receipts and schemas, and routemm.matmul_id(..., ggml_type=...).

Runs on every backend that registers the op (ROUTEMM_TEST_BACKENDS selects them)."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DType, GgmlType, q4_0, q8_0
from routemm import GgmlQuantizedMatmulIdRoute as Route
from support import (
    PAD_BYTE,
    distinct_ids,
    guarded,
    guarded_output,
    reference,
    sprinkle_invalid,
    validate,
)

pytestmark = pytest.mark.needs_kernels(
    *routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES, routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]
)

FORMATS = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
TYPES = list(FORMATS)
# Accumulation bound against the float64 reference: F32 FMA chains over K, plus the fixed lane tree.
REL = 2.0**-20
# Backends whose grouped route sums in the direct route's order (bit-identical). Metal's grouped
# route runs on 8x8 simdgroup matrices, whose summation order the hardware does not specify.
GROUPED_BIT_IDENTICAL = ("cpu", "cuda")
# Backends whose direct route follows the dense mat-vec's lane contract (equal bit for bit).
DIRECT_EQUALS_MAT_VEC = ("cpu", "metal", "metal_emu")


def quantized_stack(rng, ggml_type, n_experts, n, k, pad=0):
    """(stack bytes with `pad` bytes of PAD_BYTE between experts, stride, dequantised weights)."""
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.uniform(-1.0, 1.0, (n_experts, n, k)).astype(np.float32))
    matrix = blocks[0].nbytes
    stride = matrix + pad
    data = np.full((n_experts - 1) * stride + matrix, PAD_BYTE, np.uint8)
    for e in range(n_experts):
        data[e * stride : e * stride + matrix] = blocks[e].reshape(-1)
    return data, stride, fmt.dequantize(blocks)


def run(device, registry, ggml_type, route, weights, stride, x, ids, n, n_experts, slotted, scratch=None):
    m, top_k = ids.shape
    k = x.shape[-1]
    w = guarded(device, weights, DType.U8, (weights.size,))
    xb = guarded(device, x, DType.F32, x.shape)
    ib = guarded(device, ids, DType.U32, ids.shape)
    out = guarded_output(device, m * top_k, n)
    params = routemm.GgmlQuantizedMatmulIdParams(
        m, n, k, top_k, n_experts, ggml_type, stride, Layout.SLOTTED if slotted else Layout.SHARED_PER_TOKEN, route
    )
    if route.is_grouped and scratch is None:
        scratch = routemm.DenseMatmulIdScratch(device, n_experts, m)
    encoder = device.command_encoder()
    receipt = routemm.quantized_matmul_id_ggml(encoder, registry, xb.view, w.view, ib.view, out.view, scratch, params)
    encoder.commit_and_wait()
    for guarded_input, what in ((w, "weights"), (xb, "input"), (ib, "ids")):
        guarded_input.assert_unchanged(what)
    out.assert_guards_intact("output")
    return out.view.numpy().reshape(m * top_k, n), receipt, params


def check_against_reference(got, deq, x, ids, slotted):
    ref, mag = reference(deq, x, ids, slotted)
    assert np.all(np.isfinite(got))
    err = np.abs(got.astype(np.float64) - ref)
    assert np.all(err <= REL * mag * x.shape[-1] ** 0.5 + 1e-30), f"max error {err.max()}"
    invalid = ids.reshape(-1).astype(np.int64) >= deq.shape[0]
    assert np.all(got[invalid] == 0) and not np.any(np.signbit(got[invalid]))


def check_grouped(device, grouped, direct, deq, x, ids, slotted):
    """Grouped equals direct bit for bit where the backend promises it, else meets the bound."""
    check_against_reference(grouped, deq, x, ids, slotted)
    if device.backend in GROUPED_BIT_IDENTICAL:
        np.testing.assert_array_equal(grouped.view(np.uint32), direct.view(np.uint32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize(
    "m,top_k,n,k,n_experts", [(1, 8, 70, 96, 12), (3, 2, 9, 32, 5), (9, 4, 130, 320, 8), (33, 6, 64, 64, 16)]
)
def test_routes_match_reference_and_each_other(device, registry, rng, ggml_type, slotted, m, top_k, n, k, n_experts):
    weights, stride, deq = quantized_stack(rng, ggml_type, n_experts, n, k, pad=6)
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts)
    x = rng.standard_normal((m * top_k if slotted else m, k)).astype(np.float32)
    direct, receipt_d, params = run(
        device, registry, ggml_type, Route.DIRECT, weights, stride, x, ids, n, n_experts, slotted
    )
    grouped, receipt_g, _ = run(
        device, registry, ggml_type, Route.GROUPED, weights, stride, x, ids, n, n_experts, slotted
    )
    check_against_reference(direct, deq, x, ids, slotted)
    check_grouped(device, grouped, direct, deq, x, ids, slotted)
    (direct_pipeline,), (_, grouped_pipeline) = Route.DIRECT.pipelines(ggml_type), Route.GROUPED.pipelines(ggml_type)
    assert receipt_d == routemm.GgmlQuantizedMatmulIdDispatchReceipt(ggml_type, Route.DIRECT, 1, direct_pipeline)
    assert receipt_g == routemm.GgmlQuantizedMatmulIdDispatchReceipt(ggml_type, Route.GROUPED, 2, grouped_pipeline)
    for record in (receipt_d, receipt_g, params, routemm.quantized_matmul_id_ggml_capability(params)):
        validate(record)
        assert type(record).from_json(record.to_json()) == record


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_direct_repeated_ids_and_expert_down_form(device, registry, rng, ggml_type):
    """Decode's flattened down projection: m = tokens * top_k rows, top_k = 1, slotted input, ids
    repeating freely (and some invalid, including u32::MAX)."""
    tokens, top_k, n, k, n_experts = 5, 4, 48, 128, 6
    weights, stride, deq = quantized_stack(rng, ggml_type, n_experts, n, k)
    ids = rng.integers(0, 3, (tokens * top_k, 1)).astype(np.uint32)  # heavy repetition
    ids[[2, 7], 0] = [n_experts, 0xFFFFFFFF]
    x = rng.standard_normal((tokens * top_k, k)).astype(np.float32)
    got, _, _ = run(device, registry, ggml_type, Route.DIRECT, weights, stride, x, ids, n, n_experts, True)
    check_against_reference(got, deq, x, ids, True)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_grouped_routes_ids_repeated_within_a_token(device, registry, rng, ggml_type):
    """dense_matmul_id's map routes every slot, repeated ids included (an expert's segment can then
    hold more than m rows, past the grid's row tiles): the grouped route computes every row (bit-
    identical to direct where promised), even when a caller declared distinct ids and a token names
    one expert in several slots."""
    m, top_k, n, k, n_experts = 19, 4, 40, 96, 6
    weights, stride, deq = quantized_stack(rng, ggml_type, n_experts, n, k, pad=2)
    ids = rng.integers(0, 2, (m, top_k)).astype(np.uint32)  # two experts: every token repeats
    ids[3, 1], ids[5, 0] = n_experts, 0xFFFFFFFF
    x = rng.standard_normal((m, k)).astype(np.float32)
    direct, _, _ = run(device, registry, ggml_type, Route.DIRECT, weights, stride, x, ids, n, n_experts, False)
    grouped, _, _ = run(device, registry, ggml_type, Route.GROUPED, weights, stride, x, ids, n, n_experts, False)
    check_against_reference(direct, deq, x, ids, False)
    check_grouped(device, grouped, direct, deq, x, ids, False)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_direct_equals_the_dense_mat_vec_bit_for_bit(device, registry, rng, ggml_type):
    """On the CPU oracle and Metal the direct route and the dense lane-contract mat-vec share one
    lane contract: an expert row computed by the expert-ID op equals quantized_matmul_ggml on that
    expert's matrix, bit for bit (n = 42: a partial 4-row group). For Q8_0 that mat-vec is the one
    dense_q8_0_mv_nr2=False selects; on the CPU the default nr2 mat-vec gives the same bits too."""
    if device.backend not in DIRECT_EQUALS_MAT_VEC:
        pytest.skip(f"{device.backend}'s direct route does not promise the mat-vec's bits")
    n_experts, n, k, m = 3, 42, 256, 4
    weights, stride, _ = quantized_stack(rng, ggml_type, n_experts, n, k)
    ids = np.array([[2], [0], [1], [2]], np.uint32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got, _, _ = run(device, registry, ggml_type, Route.DIRECT, weights, stride, x, ids, n, n_experts, False)
    for row in range(m):
        e = int(ids[row, 0])
        xb = device.from_numpy(x[row : row + 1])
        wb = device.from_numpy(weights[e * stride : e * stride + stride].copy())
        policies = [routemm.GgmlRoutingPolicy(dense_q8_0_mv_nr2=False)]
        if device.backend == "cpu":
            policies.append(routemm.GgmlRoutingPolicy())
        for policy in policies:
            ob = device.alloc(n * 4, DType.F32, [1, n])
            encoder = device.command_encoder()
            routemm.quantized_matmul_ggml(
                encoder, registry, xb, wb, ob, routemm.GgmlQuantizedMatmulParams(1, n, k, ggml_type), policy
            )
            encoder.commit_and_wait()
            np.testing.assert_array_equal(ob.numpy().reshape(-1).view(np.uint32), got[row].view(np.uint32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_all_ids_invalid_give_zero_rows_and_exact_size_weights(device, registry, rng, ggml_type):
    n_experts, n, k = 2, 16, 64
    weights, stride, _ = quantized_stack(rng, ggml_type, n_experts, n, k)
    ids = np.array([[2, 0xFFFFFFFF], [0x80000000, 3]], np.uint32)
    x = rng.standard_normal((2, k)).astype(np.float32)
    # Every route this backend registers (the tensor-core route only where there are tensor cores).
    for route in [r for r in Route if all(registry.has_kernel(name) for name in r.pipelines(ggml_type))]:
        got, _, _ = run(device, registry, ggml_type, route, weights, stride, x, ids, n, n_experts, False)
        assert np.all(got.view(np.uint32) == 0)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_scratch_reuse_across_calls_in_one_encoder(device, registry, rng, ggml_type):
    """Two grouped calls on one encoder share the scratch (ordered by the leading barrier)."""
    n_experts, n, k, m, top_k = 6, 24, 64, 10, 3
    weights, stride, deq = quantized_stack(rng, ggml_type, n_experts, n, k)
    wb = device.from_numpy(weights)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m)
    encoder = device.command_encoder()
    cases = []
    for _ in range(2):
        ids = distinct_ids(rng, m, top_k, n_experts)
        x = rng.standard_normal((m, k)).astype(np.float32)
        ob = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
        params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, n_experts, ggml_type, stride, route=Route.GROUPED)
        routemm.quantized_matmul_id_ggml(
            encoder, registry, device.from_numpy(x), wb, device.from_numpy(ids), ob, scratch, params
        )
        cases.append((ids, x, ob))
    encoder.commit_and_wait()
    for ids, x, ob in cases:
        check_against_reference(ob.numpy(), deq, x, ids, False)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("route", [None, Route.DIRECT, Route.GROUPED])
def test_matmul_id_high_level(device, rng, ggml_type, route):
    n_experts, n, k, m, top_k = 7, 33, 96, 12, 2
    fmt = FORMATS[ggml_type]
    w = fmt.quantize(rng.uniform(-1, 1, (n_experts, n, k)).astype(np.float32))
    assert w.shape == (n_experts, n, k // 32 * ggml_type.block_layout[1])
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, n_experts).astype(np.int64)
    ids[0, 1] = -1  # invalid ids of any integer type give zero rows
    got = routemm.matmul_id(w, x, ids, ggml_type=ggml_type, route=route, device=device)
    check_against_reference(got, fmt.dequantize(w), x, np.where(ids < 0, n_experts, ids), False)
    slotted = rng.standard_normal((m, top_k, k)).astype(np.float32)
    got_slotted = routemm.matmul_id(w, slotted, ids, ggml_type=ggml_type, route=route, device=device)
    check_against_reference(got_slotted, fmt.dequantize(w), slotted, np.where(ids < 0, n_experts, ids), True)


def test_matmul_id_high_level_rejections(rng):
    w = q4_0.quantize(np.zeros((2, 4, 64), np.float32))
    x = np.zeros((3, 64), np.float32)
    ids = np.zeros((3, 2), np.int32)
    with pytest.raises(routemm.InvalidArgumentError, match="distinct per token"):
        routemm.matmul_id(w, x, ids, ggml_type=GgmlType.Q4_0, route=Route.GROUPED)
    with pytest.raises(routemm.InvalidArgumentError, match="does not support q3_k"):
        routemm.matmul_id(w, x, ids, ggml_type=GgmlType.Q3_K)
    with pytest.raises(routemm.InvalidArgumentError, match="must be uint8"):
        routemm.matmul_id(w.astype(np.int8), x, ids, ggml_type=GgmlType.Q4_0)
    with pytest.raises(routemm.InvalidArgumentError, match=r"k / 32 \* 34"):
        routemm.matmul_id(w, x, ids, ggml_type=GgmlType.Q8_0)
    with pytest.raises(
        routemm.InvalidArgumentError,
        match="route 'direct', 'grouped', 'grouped_tensor_lowp', 'direct_int8_dot', 'grouped_int8_dot'",
    ):
        routemm.matmul_id(w, x, ids, ggml_type=GgmlType.Q4_0, route="grouped_prefill")
