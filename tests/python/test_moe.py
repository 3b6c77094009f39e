"""The MoE layer: moe_gate and moe_experts against float64 references, their policies and errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import DType
from routemm.ops._reference import moe_experts_reference, moe_gate_reference
from tolerances import MOE_EXPERTS_TOLERANCE, MOE_GATE_TOLERANCE

GATE_ATOL, GATE_RTOL = MOE_GATE_TOLERANCE
EXPERTS_ATOL, EXPERTS_RTOL = MOE_EXPERTS_TOLERANCE
NP_WEIGHT = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


# ---- moe_gate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("m", "n_experts", "top_k"), [(1, 8, 2), (37, 128, 8), (5, 16, 1), (3, 6, 6)])
def test_gate_matches_float64_reference(device, rng, m, n_experts, top_k, renormalize):
    logits = (rng.standard_normal((m, n_experts)) * 3).astype(np.float32)
    weights, ids = routemm.moe_gate(logits, top_k, renormalize=renormalize, device=device)
    ref_w, ref_ids = moe_gate_reference(logits, top_k, renormalize)
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    assert weights.shape == ids.shape == (m, top_k)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, atol=GATE_ATOL, rtol=GATE_RTOL)


def test_gate_ties_go_to_the_lower_expert(device):
    logits = np.array(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [2.0, 1.0, 2.0, 1.0, 2.0],
        ],
        dtype=np.float32,
    )
    weights, ids = routemm.moe_gate(logits, 3, renormalize=False, device=device)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [0, 1, 2], [0, 2, 4]])
    np.testing.assert_allclose(weights[1], [0.2, 0.2, 0.2], rtol=1e-6)
    assert weights[0, 0] == weights[0, 1] == weights[0, 2]


def test_gate_nan_and_infinity_policy(device):
    inf, nan = np.inf, np.nan
    logits = np.array(
        [
            [nan, 1.0, -inf, 0.0],  # NaN ranks as -inf: never above a finite logit
            [0.0, inf, 5.0, inf],  # +inf experts share the mass
            [-inf, -inf, -inf, -inf],  # no mass: weights 0, lowest ids
            [nan, nan, nan, nan],
            [nan, -inf, nan, 2.0],  # NaN and -inf tie (index order) below the finite one
        ],
        dtype=np.float32,
    )
    for renormalize in (False, True):
        weights, ids = routemm.moe_gate(logits, 3, renormalize=renormalize, device=device)
        np.testing.assert_array_equal(ids, [[1, 3, 0], [1, 3, 2], [0, 1, 2], [0, 1, 2], [3, 0, 1]])
        assert np.all(np.isfinite(weights))
        np.testing.assert_array_equal(weights[1], [0.5, 0.5, 0.0])
        np.testing.assert_array_equal(weights[2:4], 0.0)
        np.testing.assert_array_equal(weights[4], [1.0, 0.0, 0.0])
        ref_w, ref_ids = moe_gate_reference(logits, 3, renormalize)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(weights, ref_w, atol=GATE_ATOL, rtol=GATE_RTOL)


@pytest.mark.parametrize("top_k", [0, 9, -1, True, 2.0, None])
def test_gate_rejects_top_k_out_of_bounds(device, top_k):
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(routemm.InvalidArgumentError, match="top_k"):
        routemm.moe_gate(logits, top_k, renormalize=True, device=device)


def test_gate_rejects_bad_input(device):
    with pytest.raises(routemm.InvalidArgumentError, match="float32"):
        routemm.moe_gate(np.zeros((2, 8)), 2, renormalize=True, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="2-D"):
        routemm.moe_gate(np.zeros(8, np.float32), 2, renormalize=True, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="renormalize"):
        routemm.moe_gate(np.zeros((2, 8), np.float32), 2, renormalize=1, device=device)
    with pytest.raises(TypeError):
        routemm.moe_gate(np.zeros((2, 8), np.float32), 2)  # renormalize has no default


def test_gate_front_door_validates_before_encoding(device, registry):
    logits = device.from_numpy(np.zeros((4, 8), np.float32))
    weights = device.alloc(4 * 2 * 4, DType.F32, [4, 2])
    short_ids = device.alloc(4 * 2 * 4 - 4, DType.U32, [7])
    encoder = device.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate ids requires 32 logical bytes"):
        routemm.encode_moe_gate(encoder, registry, logits, weights, short_ids, top_k=2, renormalize=True)
    with pytest.raises(routemm.InvalidArgumentError, match="moe_gate output must not overlap logits"):
        routemm.encode_moe_gate(encoder, registry, logits, logits.view(0, 32, DType.F32, [4, 2]),
                                device.alloc(32, DType.U32, [4, 2]), top_k=2, renormalize=True)  # fmt: skip
    f16_logits = device.alloc(64, DType.F16, [4, 8])
    with pytest.raises(routemm.InvalidArgumentError, match="logits must be f32, got f16"):
        routemm.encode_moe_gate(encoder, registry, f16_logits, weights,
                                device.alloc(32, DType.U32, [4, 2]), top_k=2, renormalize=True)  # fmt: skip
    assert encoder.pending_dispatches == 0


# ---- moe_experts ----------------------------------------------------------------------------------


def _experts_case(rng, m, top_k, n_experts, hidden, inter, dtype="f32"):
    wdtype = NP_WEIGHT[dtype]
    gate_up = (rng.standard_normal((n_experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(wdtype)
    down = (rng.standard_normal((n_experts, hidden, inter)) / np.sqrt(inter)).astype(wdtype)
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    logits = rng.standard_normal((m, n_experts)).astype(np.float32)
    ref_w, ref_ids = moe_gate_reference(logits, top_k, True)
    return x, ref_ids.astype(np.int32), ref_w.astype(np.float32), gate_up, down


def _reference(x, ids, weights, gate_up, down):
    inter = down.shape[2]
    return moe_experts_reference(x, ids, weights, gate_up[:, :inter], gate_up[:, inter:], down)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(("m", "route"), [(1, None), (3, "direct"), (20, "grouped_prefill"), (20, "direct")])
def test_experts_match_float64_reference(device, rng, dtype, m, route):
    x, ids, w, gate_up, down = _experts_case(rng, m, 4, 16, 64, 48, dtype)
    route = None if route is None else routemm.DenseMatmulIdRoute(route)
    out = routemm.moe_experts(x, ids, w, gate_up, down, route=route, device=device)
    assert out.dtype == np.float32 and out.shape == (m, 64)
    np.testing.assert_allclose(out, _reference(x, ids, w, gate_up, down), atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)
    # The (gate, up) pair of a GGUF file gives the same bits as the stacked transformers layout.
    pair = (np.ascontiguousarray(gate_up[:, :48]), np.ascontiguousarray(gate_up[:, 48:]))
    out_pair = routemm.moe_experts(x, ids, w, pair, down, route=route, device=device)
    np.testing.assert_array_equal(out_pair.view(np.uint32), out.view(np.uint32))


def test_experts_routes_are_bit_identical_and_deterministic(device, rng):
    x, ids, w, gate_up, down = _experts_case(rng, 33, 8, 32, 96, 40, "bf16")
    runs = [
        routemm.moe_experts(x, ids, w, gate_up, down, route=route, device=device)
        for route in (routemm.DenseMatmulIdRoute.DIRECT, routemm.DenseMatmulIdRoute.GROUPED_PREFILL, None)
    ]
    for other in runs[1:]:
        np.testing.assert_array_equal(other.view(np.uint32), runs[0].view(np.uint32))


def test_experts_sentinel_ids_contribute_zero_and_read_no_weight(device, rng):
    n_experts = 8
    x, ids, w, gate_up, down = _experts_case(rng, 12, 4, n_experts, 32, 16)
    # Expert-parallel sentinels (>= E) and invalid negatives in some slots, with NaN routing weights
    # there: skipped slots contribute exactly nothing.
    ids = ids.copy()
    w = w.copy()
    ids[::2, 1] = n_experts
    ids[1::3, 3] = n_experts + 5
    ids[5, 0] = -1
    invalid = (ids < 0) | (ids >= n_experts)
    w[invalid] = np.nan
    out = routemm.moe_experts(x, ids, w, gate_up, down, device=device)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, _reference(x, ids, w, gate_up, down), atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)
    # Every id a sentinel and every weight NaN: an exact zero, so no weight value took part.
    all_sentinel = np.full_like(ids, n_experts)
    nan_gate_up, nan_down = np.full_like(gate_up, np.nan), np.full_like(down, np.nan)
    out = routemm.moe_experts(x, all_sentinel, w, nan_gate_up, nan_down, device=device)
    np.testing.assert_array_equal(out, np.zeros_like(out))


def test_experts_take_buffers_as_weights(device, rng):
    x, ids, w, gate_up, down = _experts_case(rng, 4, 2, 8, 32, 16, "f16")
    as_numpy = routemm.moe_experts(x, ids, w, gate_up, down, device=device)
    as_buffers = routemm.moe_experts(x, ids, w, device.from_numpy(gate_up), device.from_numpy(down), device=device)
    np.testing.assert_array_equal(as_buffers, as_numpy)


def test_experts_reject_bad_input(device, rng):
    x, ids, w, gate_up, down = _experts_case(rng, 4, 2, 8, 32, 16)
    call = routemm.moe_experts
    with pytest.raises(routemm.InvalidArgumentError, match="gate_up must be"):
        call(x, ids, w, gate_up[:, :30], down, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="down must be"):
        call(x, ids, w, gate_up, down[:, :31], device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="up must be"):
        call(x, ids, w, (gate_up[:, :16], gate_up[:, :15]), down, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="top_k_weights must have the shape"):
        call(x, ids, w[:, :1], gate_up, down, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="hidden must be float32"):
        call(x.astype(np.float64), ids, w, gate_up, down, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="share one of"):
        call(x, ids, w, gate_up, down.astype(np.float16), device=device)
    repeats = np.zeros_like(ids)
    with pytest.raises(routemm.InvalidArgumentError, match="distinct per token"):
        call(x, repeats, w, gate_up, down, route=routemm.DenseMatmulIdRoute.GROUPED_PREFILL, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="must be uint8"):
        call(x, ids, w, routemm.q4_0.quantize(gate_up), down, ggml_type=routemm.GgmlType.Q4_0, device=device)
    with pytest.raises(routemm.InvalidArgumentError, match="ggml_type must be None"):
        call(x, ids, w, gate_up, down, ggml_type="q3_k", device=device)
    # Repeated ids are fine on the direct route (each slot is its own product).
    out = call(x, repeats, w, gate_up, down, device=device)
    np.testing.assert_allclose(out, _reference(x, repeats, w, gate_up, down), atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)


QUANT = {"q4_0": routemm.q4_0, "q8_0": routemm.q8_0}
NEEDS_QUANTIZED_ID = pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES)


@NEEDS_QUANTIZED_ID
@pytest.mark.parametrize("ggml_type", sorted(QUANT))
@pytest.mark.parametrize(("m", "route"), [(1, None), (20, "grouped_prefill"), (20, "direct")])
def test_quantized_experts_match_float64_reference(device, rng, ggml_type, m, route):
    """Q4_0/Q8_0 experts against the float64 reference on the dequantised weights (dequantisation
    is exact in F32, so only F32 accumulation is left)."""
    codec = QUANT[ggml_type]
    x, ids, w, gate_up, down = _experts_case(rng, m, 4, 16, 64, 32)
    q_gate_up, q_down = codec.quantize(gate_up), codec.quantize(down)
    deq_gate_up = codec.dequantize(q_gate_up, gate_up.shape)
    deq_down = codec.dequantize(q_down, down.shape)
    route = None if route is None else routemm.DenseMatmulIdRoute(route)
    gtype = routemm.GgmlType(ggml_type)
    out = routemm.moe_experts(x, ids, w, q_gate_up, q_down, ggml_type=gtype, route=route, device=device)
    ref = _reference(x, ids, w, deq_gate_up, deq_down)
    np.testing.assert_allclose(out, ref, atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)
    # The GGUF layout (separate gate and up block stacks) gives the same bits.
    pair = (codec.quantize(gate_up[:, :32]), codec.quantize(gate_up[:, 32:]))
    out_pair = routemm.moe_experts(x, ids, w, pair, q_down, ggml_type=gtype, route=route, device=device)
    np.testing.assert_array_equal(out_pair.view(np.uint32), out.view(np.uint32))


@NEEDS_QUANTIZED_ID
def test_quantized_experts_skip_sentinel_ids(device, rng):
    x, ids, w, gate_up, down = _experts_case(rng, 6, 2, 8, 32, 32)
    q_gate_up, q_down = routemm.q8_0.quantize(gate_up), routemm.q8_0.quantize(down)
    ids = ids.copy()
    ids[::2, 0] = 8
    out = routemm.moe_experts(x, ids, w, q_gate_up, q_down, ggml_type=routemm.GgmlType.Q8_0, device=device)
    deq = routemm.q8_0.dequantize
    ref = _reference(x, ids, w, deq(q_gate_up, gate_up.shape), deq(q_down, down.shape))
    np.testing.assert_allclose(out, ref, atol=EXPERTS_ATOL, rtol=EXPERTS_RTOL)


@pytest.mark.parametrize("ggml_type", [None, "q4_0"])
@pytest.mark.parametrize("layout", ["stacked", "pair"])
def test_experts_build_one_routing_map_per_block(device, rng, monkeypatch, ggml_type, layout):
    """A grouped block encodes one map dispatch for its two or three matmuls (they share the ids),
    and gives the direct route's bits, sentinel slots included."""
    if ggml_type is not None and not routemm.KernelRegistry(device).has_kernel(
        routemm.GGML_QUANTIZED_MATMUL_ID_PIPELINE_NAMES[2]
    ):
        pytest.skip(f"backend {device.backend} has no quantised grouped expert-ID kernels")
    x, ids, w, gate_up, down = _experts_case(rng, 24, 4, 16, 64, 32)
    ids = ids.copy()
    ids[::5, 2] = 16  # expert-parallel sentinels
    if ggml_type is not None:
        gate_up, down = routemm.q4_0.quantize(gate_up), routemm.q4_0.quantize(down)
    if layout == "pair":
        half = gate_up.shape[1] // 2
        gate_up = (np.ascontiguousarray(gate_up[:, :half]), np.ascontiguousarray(gate_up[:, half:]))
    encoded = []
    original = routemm.ops.moe._encode_experts

    def recording(encoder, *args, **kwargs):
        encoder.start_encoded_dispatch_receipt(16)
        original(encoder, *args, **kwargs)
        encoded.append([d.pipeline_label for d in encoder.take_encoded_dispatch_receipt()])

    monkeypatch.setattr(routemm.ops.moe, "_encode_experts", recording)
    runs = {}
    for route in (routemm.DenseMatmulIdRoute.GROUPED_PREFILL, routemm.DenseMatmulIdRoute.DIRECT):
        runs[route] = routemm.moe_experts(x, ids, w, gate_up, down, ggml_type=ggml_type, route=route, device=device)
    grouped, direct = encoded
    matmuls = 3 if layout == "pair" else 2
    map_name = routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3]
    assert grouped.count(map_name) == 1 and grouped[0] == map_name
    assert len(grouped) == 1 + matmuls + 2  # the map, the matmuls, SiLU-mul and the combine
    assert map_name not in direct and len(direct) == matmuls + 2
    grouped_out, direct_out = runs[routemm.DenseMatmulIdRoute.GROUPED_PREFILL], runs[routemm.DenseMatmulIdRoute.DIRECT]
    if ggml_type is not None and device.backend in ("metal", "metal_emu"):
        # Metal's quantised grouped route sums in simdgroup-matrix tiles (no promised order): the
        # two routes agree within the experts' tolerance there, bit for bit everywhere else.
        atol, rtol = MOE_EXPERTS_TOLERANCE
        np.testing.assert_allclose(grouped_out, direct_out, atol=atol, rtol=rtol)
    else:
        np.testing.assert_array_equal(grouped_out.view(np.uint32), direct_out.view(np.uint32))


def test_combine_skips_invalid_slots_in_slot_order(device, registry):
    m, top_k, hidden = 2, 3, 4
    rows = np.arange(m * top_k * hidden, dtype=np.float32).reshape(m * top_k, hidden)
    weights = np.array([[0.5, np.nan, 2.0], [1.0, 1.0, np.inf]], np.float32)
    ids = np.array([[0, 9, 1], [2, 3, 0xFFFFFFFF]], np.uint32)
    out = device.alloc(m * hidden * 4, DType.F32, [m, hidden])
    encoder = device.command_encoder()
    routemm.encode_moe_combine(
        encoder, registry, device.from_numpy(rows), device.from_numpy(weights), device.from_numpy(ids), out,
        n_experts=4,
    )  # fmt: skip
    encoder.commit_and_wait()
    expected = np.stack([0.5 * rows[0] + 2.0 * rows[2], rows[3] + rows[4]])
    np.testing.assert_array_equal(out.numpy(), expected.astype(np.float32))


# ---- PyTorch tensors -------------------------------------------------------------------------------


def test_torch_tensors_match_numpy(device, rng):
    torch = pytest.importorskip("torch")
    if device.backend != "cpu":
        pytest.skip("the NumPy/PyTorch comparison runs on CPU tensors")
    x, ids, w, gate_up, down = _experts_case(rng, 10, 2, 8, 32, 16)
    logits = rng.standard_normal((10, 8)).astype(np.float32)
    tw, tids = routemm.moe_gate(torch.from_numpy(logits), 2, renormalize=True)
    nw, nids = routemm.moe_gate(logits, 2, renormalize=True, device=device)
    assert tw.dtype == torch.float32 and tids.dtype == torch.int32
    np.testing.assert_array_equal(tw.numpy(), nw)
    np.testing.assert_array_equal(tids.numpy(), nids)
    t = torch.from_numpy
    out = routemm.moe_experts(t(x), t(ids).long(), t(w), t(gate_up).requires_grad_(), t(down))
    # A weight that requires grad: the forward runs, and the output's backward refuses (no gradient).
    assert out.requires_grad
    np.testing.assert_array_equal(out.detach().numpy(), routemm.moe_experts(x, ids, w, gate_up, down, device=device))


@NEEDS_QUANTIZED_ID
def test_quantized_experts_take_block_stack_routes(device, rng):
    """Block stacks take GgmlQuantizedMatmulIdRoute values: the int8-dot routes (CPU only) give the
    same bits direct and grouped, within the int8-dot error of the exact block; a float-stack route
    without a block-stack counterpart is refused."""
    x, ids, w, gate_up, down = _experts_case(rng, 12, 4, 16, 64, 32)
    q_gate_up, q_down = routemm.q4_0.quantize(gate_up), routemm.q4_0.quantize(down)
    q4 = routemm.GgmlType.Q4_0

    def call(route):
        return routemm.moe_experts(x, ids, w, q_gate_up, q_down, ggml_type=q4, route=route, device=device)

    exact = call("grouped")
    np.testing.assert_array_equal(
        exact.view(np.uint32), call(routemm.DenseMatmulIdRoute.GROUPED_PREFILL).view(np.uint32)
    )
    with pytest.raises(routemm.InvalidArgumentError, match="takes route 'direct', 'grouped'.*got 'direct_bf16_dot'"):
        call("direct_bf16_dot")
    with pytest.raises(routemm.InvalidArgumentError, match="dense_matmul_id route must be one of"):
        routemm.moe_experts(x, ids, w, gate_up, down, route="direct_int8_dot", device=device)
    route = routemm.GgmlQuantizedMatmulIdRoute
    if not routemm.KernelRegistry(device).has_kernel(routemm.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES[0]):
        with pytest.raises(routemm.KernelNotFoundError):
            call(route.DIRECT_INT8_DOT)
        return
    direct, grouped = call(route.DIRECT_INT8_DOT), call("grouped_int8_dot")
    np.testing.assert_array_equal(direct.view(np.uint32), grouped.view(np.uint32))
    assert not np.array_equal(direct, exact)
    assert np.linalg.norm(direct - exact) / np.linalg.norm(exact) <= 2e-2
