"""quantized_matmul_id_ggml's tensor-core route (grouped_tensor_lowp): the grouped route's map and
scratch with the products on tensor cores. Against a float64 reference on the dequantised blocks
within the stated tolerance (tails of n, m and the expert segments, experts without rows, ids
repeated within a token, invalid ids, shared and slotted input, unaligned views); exact where the
operands make every product and sum exact (the block values enter the MMA as exact integers and
the scale is applied in F32, so no d * q is rounded to f16); every output element written; and a
refusal before encoding on backends that do not register the route (CPU, metal_emu).

Runs on every backend of ROUTEMM_TEST_BACKENDS: the numeric tests need the route's pipelines
(CUDA), the refusal and record tests run everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DType, GgmlType, q4_0, q8_0
from routemm import GgmlQuantizedMatmulIdRoute as Route
from support import PAD_BYTE, POISON_U32, distinct_ids, guarded, guarded_output, sprinkle_invalid, validate
from tolerances import TENSOR_ROUTE_FROBENIUS

FORMATS = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
TYPES = list(FORMATS)
ROUTE = Route.GROUPED_TENSOR_LOWP
TOLERANCE = TENSOR_ROUTE_FROBENIUS[ROUTE]
MAP = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]


def pipeline(ggml_type: GgmlType) -> str:
    return f"quantized_matmul_id_grouped_lowp_{ggml_type.value}_f32"


def stack(blocks: np.ndarray, pad: int) -> tuple[np.ndarray, int]:
    """Experts of uint8 blocks [E, n, row_bytes] back to back, `pad` bytes of PAD_BYTE between."""
    matrix = blocks[0].nbytes
    stride = matrix + pad
    data = np.full((blocks.shape[0] - 1) * stride + matrix, PAD_BYTE, np.uint8)
    for e in range(blocks.shape[0]):
        data[e * stride : e * stride + matrix] = blocks[e].reshape(-1)
    return data, stride


def reference(deq: np.ndarray, x: np.ndarray, ids: np.ndarray, slotted: bool) -> np.ndarray:
    m, top_k = ids.shape
    out = np.zeros((m * top_k, deq.shape[1]))
    for flat, e in enumerate(ids.reshape(-1).astype(np.int64)):
        if e < deq.shape[0]:
            row = x[flat] if slotted else x[flat // top_k]
            out[flat] = deq[e].astype(np.float64) @ row.astype(np.float64)
    return out


def run(device, registry, ggml_type, weights, stride, x, ids, n, n_experts, slotted, *, weight_guard=64, x_guard=64):
    """(output [m * top_k, n], receipt, dispatch labels). The guards set the views' byte offsets:
    64 keeps them 16-byte aligned; 66 or 68 do not (2- and 4-byte aligned)."""
    m, top_k = ids.shape
    w = guarded(device, weights, DType.U8, (weights.size,), guard=np.full(weight_guard, PAD_BYTE, np.uint8))
    xb = guarded(device, x, DType.F32, x.shape, guard=np.full(x_guard, PAD_BYTE, np.uint8))
    ib = guarded(device, ids, DType.U32, ids.shape)
    out = guarded_output(device, m * top_k, n)
    layout = Layout.SLOTTED if slotted else Layout.SHARED_PER_TOKEN
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, x.shape[-1], top_k, n_experts, ggml_type, stride, layout, ROUTE)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m)
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(2)
    receipt = routemm.quantized_matmul_id_ggml(encoder, registry, xb.view, w.view, ib.view, out.view, scratch, params)
    labels = [d.pipeline_label for d in encoder.take_encoded_dispatch_receipt()]
    encoder.commit_and_wait()
    for guarded_input, what in ((w, "weights"), (xb, "input"), (ib, "ids")):
        guarded_input.assert_unchanged(what)
    out.assert_guards_intact("output")
    return out.view.numpy().reshape(m * top_k, n), receipt, labels


def needs_route(registry, ggml_type):
    if not registry.has_kernel(pipeline(ggml_type)):
        pytest.skip(f"{pipeline(ggml_type)} is not registered on this backend")


def check(got, deq, x, ids, slotted):
    assert not np.any(got.view(np.uint32) == POISON_U32), "an output element was never written"
    invalid = ids.reshape(-1).astype(np.int64) >= deq.shape[0]
    assert np.all(got[invalid].view(np.uint32) == 0), "invalid ids must give +0 rows"
    ref = reference(deq, x, ids, slotted)
    if not np.any(ref):  # every id invalid: nothing to be relative to
        assert np.all(got.view(np.uint32) == 0)
        return
    error = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert error <= TOLERANCE, f"relative Frobenius error {error:.3e}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize(
    "m,n,k,top_k,n_experts",
    [
        (1, 8, 32, 1, 1),  # one row, one block, a column tile of 8 of 128
        (9, 70, 96, 4, 12),  # n % 128, experts holding 0..few rows
        (33, 130, 320, 6, 16),  # a second column tile of 2 columns
        (200, 256, 256, 8, 16),  # ~100 rows per expert: a full 64-row tile and a remainder
        (150, 300, 64, 2, 64),  # experts without rows, more items than one wave on small GPUs
    ],
)
def test_within_tolerance_of_the_float64_reference(
    device, registry, rng, ggml_type, slotted, m, n, k, top_k, n_experts
):
    needs_route(registry, ggml_type)
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.uniform(-1.0, 1.0, (n_experts, n, k)).astype(np.float32))
    weights, stride = stack(blocks, pad=6)
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts)
    x = rng.standard_normal((m * top_k if slotted else m, k)).astype(np.float32)
    got, receipt, labels = run(device, registry, ggml_type, weights, stride, x, ids, n, n_experts, slotted)
    assert receipt == routemm.GgmlQuantizedMatmulIdDispatchReceipt(ggml_type, ROUTE, 2, pipeline(ggml_type))
    assert labels == [MAP, pipeline(ggml_type)]
    check(got, fmt.dequantize(blocks), x, ids, slotted)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_ids_repeated_within_a_token_and_long_segments(device, registry, rng, ggml_type):
    """The shared map routes every slot, repeats included: expert 3 fills every slot of every other
    token (600 rows, many 64-row tiles), other tokens repeat one expert in two slots."""
    needs_route(registry, ggml_type)
    m, n, k, top_k, n_experts = 300, 136, 96, 4, 8
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.uniform(-1.0, 1.0, (n_experts, n, k)).astype(np.float32))
    weights, stride = stack(blocks, pad=0)
    ids = distinct_ids(rng, m, top_k, n_experts)
    ids[::2, :] = 3
    ids[1::4, 1] = ids[1::4, 0]
    ids[1, 2] = 0xFFFFFFFF
    x = rng.standard_normal((m, k)).astype(np.float32)
    got, _, _ = run(device, registry, ggml_type, weights, stride, x, ids, n, n_experts, False)
    check(got, fmt.dequantize(blocks), x, ids, False)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
def test_unaligned_views(device, registry, rng, ggml_type, slotted):
    """Weights at a 2-byte offset with an odd-word stride (blocks read 2 bytes at a time) and input
    rows that are not 16-byte aligned (the kernel's element-load instantiation)."""
    needs_route(registry, ggml_type)
    m, n, k, top_k, n_experts = 40, 100, 160, 3, 5
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.uniform(-1.0, 1.0, (n_experts, n, k)).astype(np.float32))
    weights, stride = stack(blocks, pad=2)
    ids = distinct_ids(rng, m, top_k, n_experts)
    x = rng.standard_normal((m * top_k if slotted else m, k)).astype(np.float32)
    got, _, _ = run(
        device, registry, ggml_type, weights, stride, x, ids, n, n_experts, slotted, weight_guard=66, x_guard=68
    )
    check(got, fmt.dequantize(blocks), x, ids, slotted)


def exact_blocks(rng, ggml_type, n_experts, n, k, scales):
    """uint8 blocks [E, n, k / 32 * block_bytes] with random quants and expert e's scales drawn from
    scales[e] (f16 values)."""
    values, block_bytes = ggml_type.block_layout
    blocks = rng.integers(0, 256, (n_experts, n, k // values, block_bytes), dtype=np.uint8)
    for e in range(n_experts):
        d = rng.choice(np.array(scales[e], np.float16), size=(n, k // values))
        blocks[e, :, :, :2] = d.view(np.uint8).reshape(n, k // values, 2)
    return blocks.reshape(n_experts, n, -1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_weights_enter_exactly(device, registry, rng, ggml_type):
    """Operands for which the exact result is an F32 value: activations in {-1, 0, 1} (exact in
    f16), every quant value of both formats (Q8_0's -128 included), scales with full 11-bit
    significands (1 + 2^-10: d * q is not an f16 for most q) or as large as 2^15 (d * 127 overflows
    f16), two blocks per row. The partial sums of a block are integers below 2^13 and d * sum fits
    24 bits, so the route's result must equal the float64 reference exactly; a route that rounded
    d * q to f16 would not."""
    needs_route(registry, ggml_type)
    n_experts, n, k, m, top_k = 3, 136, 64, 70, 2
    fine = [1 + 2.0**-10, -(1 + 3 * 2.0**-10), 0.5 + 2.0**-11]
    scales = [fine, [2.0**15, -(2.0**14)], fine]
    blocks = exact_blocks(rng, ggml_type, n_experts, n, k, scales)
    weights, stride = stack(blocks, pad=2)
    ids = distinct_ids(rng, m, top_k, n_experts)
    x = rng.integers(-1, 2, (m, k)).astype(np.float32)
    got, _, _ = run(device, registry, ggml_type, weights, stride, x, ids, n, n_experts, False)
    want = reference(FORMATS[ggml_type].dequantize(blocks), x, ids, False)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.array_equal(got.astype(np.float64), want)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_matmul_id_high_level_takes_the_route_by_name(device, rng, ggml_type):
    n_experts, n, k, m, top_k = 6, 40, 96, 20, 2
    fmt = FORMATS[ggml_type]
    w = fmt.quantize(rng.uniform(-1, 1, (n_experts, n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, n_experts).astype(np.int64)
    ids[0, 1] = -1
    if not routemm.KernelRegistry(device).has_kernel(pipeline(ggml_type)):
        with pytest.raises(routemm.KernelNotFoundError, match=pipeline(ggml_type)):
            routemm.matmul_id(w, x, ids, ggml_type=ggml_type, route="grouped_tensor_lowp", device=device)
        return
    got = routemm.matmul_id(w, x, ids, ggml_type=ggml_type, route="grouped_tensor_lowp", device=device)
    check(got, fmt.dequantize(w), x, np.where(ids < 0, n_experts, ids).astype(np.uint32), False)


# ---- Everywhere: refusal where the route is not registered, and its records ---------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_backends_without_the_route_refuse_it_before_encoding(device, registry, rng, ggml_type):
    if registry.has_kernel(pipeline(ggml_type)):
        pytest.skip(f"{device.backend} registers {pipeline(ggml_type)}")
    assert device.backend != "cuda", "CUDA must register the tensor route"
    assert set(routemm.GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES).isdisjoint(
        routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES
    )
    n_experts, n, k, m, top_k = 4, 16, 64, 5, 2
    blocks = FORMATS[ggml_type].quantize(rng.uniform(-1, 1, (n_experts, n, k)).astype(np.float32))
    weights, stride = stack(blocks, pad=0)
    ids = distinct_ids(rng, m, top_k, n_experts)
    x = rng.standard_normal((m, k)).astype(np.float32)
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, n_experts, ggml_type, stride, route=ROUTE)
    scratch = routemm.DenseMatmulIdScratch(device, n_experts, m)
    out = device.alloc(m * top_k * n * 4, DType.F32, [m * top_k, n])
    encoder = device.command_encoder()
    encoder.start_capture()
    before = routemm.dispatch_count()
    with pytest.raises(routemm.KernelNotFoundError, match=pipeline(ggml_type)):
        routemm.quantized_matmul_id_ggml(
            encoder,
            registry,
            device.from_numpy(x),
            device.from_numpy(weights),
            device.from_numpy(ids),
            out,
            scratch,
            params,
        )
    assert encoder.take_capture() == [], "a refused call must leave no barrier or dispatch behind"
    assert routemm.dispatch_count() == before


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_route_records_capability_and_pipelines(ggml_type):
    values, block_bytes = ggml_type.block_layout
    n, k = 70, 96
    stride = n * k // values * block_bytes
    params = routemm.GgmlQuantizedMatmulIdParams(9, n, k, 4, 8, ggml_type, stride, Layout.SLOTTED, ROUTE)
    cap = routemm.quantized_matmul_id_ggml_capability(params)
    grouped = routemm.quantized_matmul_id_ggml_capability(
        routemm.GgmlQuantizedMatmulIdParams(9, n, k, 4, 8, ggml_type, stride, Layout.SLOTTED, Route.GROUPED)
    )
    assert cap.route is ROUTE and ROUTE.is_grouped
    assert cap.scratch == routemm.DenseMatmulIdScratchRequirement(8 * 4, 8 * 9 * 4) == grouped.scratch
    for field in ("required_weight_bytes", "required_input_bytes", "required_ids_bytes", "required_output_bytes"):
        assert getattr(cap, field) == getattr(grouped, field)
    assert ROUTE.pipelines(ggml_type) == (MAP, pipeline(ggml_type))
    assert pipeline(ggml_type) in routemm.GGML_QUANTIZED_MATMUL_ID_TENSOR_PIPELINE_NAMES
    receipt = routemm.GgmlQuantizedMatmulIdDispatchReceipt(ggml_type, ROUTE, 2, pipeline(ggml_type))
    for record in (params, cap, receipt):
        validate(record)
        assert type(record).from_json(record.to_json()) == record


def test_route_shares_the_grouped_validation():
    base = dict(m=9, n=7, k=64, top_k=4, n_experts=8, ggml_type=GgmlType.Q4_0, expert_stride_bytes=7 * 2 * 18)
    with pytest.raises(routemm.InvalidArgumentError, match="distinct top_k 9 exceeds n_experts 8"):
        routemm.quantized_matmul_id_ggml_capability(
            routemm.GgmlQuantizedMatmulIdParams(**{**base, "top_k": 9}, route=ROUTE)
        )
    with pytest.raises(routemm.InvalidArgumentError, match="at most 1024 experts"):
        routemm.quantized_matmul_id_ggml_capability(
            routemm.GgmlQuantizedMatmulIdParams(**{**base, "n_experts": 1025}, route=ROUTE)
        )
    with pytest.raises(routemm.InvalidArgumentError, match=r"K \(48\) must be divisible by block QK \(32\)"):
        routemm.quantized_matmul_id_ggml_capability(
            routemm.GgmlQuantizedMatmulIdParams(**{**base, "k": 48}, route=ROUTE)
        )


def test_scratch_is_required(device, registry):
    params = routemm.GgmlQuantizedMatmulIdParams(2, 8, 32, 1, 2, GgmlType.Q8_0, 8 * 34, route=ROUTE)
    cap = routemm.quantized_matmul_id_ggml_capability(params)
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="grouped route requires caller-owned scratch"):
        routemm.quantized_matmul_id_ggml(
            encoder,
            registry,
            device.alloc(cap.required_input_bytes, DType.F32),
            device.alloc(cap.required_weight_bytes, DType.U8),
            device.from_numpy(np.zeros(2, np.uint32)),
            device.alloc(cap.required_output_bytes, DType.F32),
            None,
            params,
        )
