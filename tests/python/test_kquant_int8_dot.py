"""The reduced-precision int8-dot routes of the K-quants (Q4_K, Q5_K, Q6_K) on the CPU: the dense
mat-vec and matrix pipelines under GgmlRoutingPolicy.dense_int8_dot and the expert-ID routes
direct_int8_dot / grouped_int8_dot, held per element to tolerances.kquant_int8_dot_bound against
float64 on heavy-tailed inputs, every routed row bit-identical to the dense int8-dot pipeline on its
expert and the two routes to each other, every output written; the other formats beyond Q4_0 /
Q8_0 still refuse the expert-ID int8-dot routes by name. The clones' bit identity is in
test_cpu_isa_clones.py."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm import GgmlType
from routemm.formats import ggml
from support import POISON_U32, run_ggml_guarded, validate
from tolerances import KQUANT_INT8_DOT_FROBENIUS, kquant_int8_dot_bound, kquant_int8_dot_magnitudes

TYPES = (GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K)
INT8 = routemm.GgmlRoutingPolicy(dense_int8_dot=True)
INT8_ROUTES = (Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT)
LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
INVALID = 0xFFFFFFFF


def pipelines(ggml_type: GgmlType) -> tuple[str, str, str, str]:
    name = ggml_type.value
    return (
        f"kernel_mul_mv_{name}_int8dot_f32",
        f"kernel_mul_mm_{name}_int8dot_f32",
        f"quantized_matmul_id_direct_int8dot_{name}_f32",
        f"quantized_matmul_id_grouped_int8dot_{name}_f32",
    )


@pytest.fixture
def kquant_int8(backend, registry):
    """The CPU registers every K-quant int8-dot pipeline; other backends skip (they have none)."""
    missing = [p for t in TYPES for p in pipelines(t) if not registry.has_kernel(p)]
    if missing:
        assert backend != "cpu", f"the CPU backend lacks {missing}"
        pytest.skip(f"{backend} has no K-quant int8-dot pipelines")


def _activations(rng, rows, k):
    """Heavy-tailed rows (log-normal magnitudes), one all-zero 256-value block, one below 2^-100
    (rounded to zero by contract) and one with a single large outlier, where K allows."""
    x = rng.standard_normal((rows, k)) * np.exp(1.2 * rng.standard_normal((rows, k)))
    x[:, :256] = 0.0 if k > 256 else x[:, :256]
    if k >= 1024:
        x[:, 512:768] *= 2.0**-110
        x[:, 800] = 60.0
    return x.astype(np.float32)


def _weights(rng, ggml_type, n, k):
    blocks = ggml.quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    w = ggml.dequantize(blocks, ggml_type).reshape(n, k).astype(np.float64)
    return blocks, w, kquant_int8_dot_magnitudes(blocks, ggml_type, n, k)


def _check_bound(got, x, w, magnitudes):
    ref = x.astype(np.float64) @ w.T
    err = np.abs(got.astype(np.float64) - ref)
    bound = kquant_int8_dot_bound(w, magnitudes, x)
    assert np.all(np.isfinite(got))
    assert np.all(err <= bound), f"{int((err > bound).sum())} element(s) beyond the bound; worst {err.max():.3e}"
    # Rounded indeed (the exact routes are ~1e-7 relative), and the bound is not vacuous.
    assert (err / bound).max() > 1e-2
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= KQUANT_INT8_DOT_FROBENIUS


@pytest.mark.usefixtures("kquant_int8")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("n,k", [(70, 256 * 5), (13, 256), (19, 256 * 18)])
def test_kquant_int8_dot_dense_within_its_bound(device, registry, ggml_type, m, n, k):
    rng = np.random.default_rng([m, n, k, list(GgmlType).index(ggml_type), 5])
    blocks, w, magnitudes = _weights(rng, ggml_type, n, k)
    x = _activations(rng, m, k)
    got, receipt = run_ggml_guarded(device, registry, ggml_type, blocks, x, n, INT8)
    assert receipt.route == "int8_dot" and receipt.dense_route is None
    assert receipt.pipeline_label == pipelines(ggml_type)[0 if m <= 8 else 1] + LABEL_SUFFIX
    assert receipt.decision.value == ("mat_vec_threshold" if m <= 8 else "policy_int8_dot")
    validate(receipt)
    _check_bound(got, x, w, magnitudes)
    # The matrix route's rows are the mat-vec's: every output depends on its row alone.
    if m > 8:
        row, _ = run_ggml_guarded(device, registry, ggml_type, blocks, x[m // 2 : m // 2 + 1], n, INT8)
        np.testing.assert_array_equal(row[0].view(np.uint32), got[m // 2].view(np.uint32))


@pytest.mark.usefixtures("kquant_int8")
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
def test_kquant_int8_dot_exact_for_int8_activations(device, registry, ggml_type):
    """Activations that are int8 multiples of their block's scale (max |x| = 127 d) are taken
    exactly, so the result is the exact product up to F32 rounding: the codes and scales are
    decoded as the dequantiser does."""
    rng = np.random.default_rng([list(GgmlType).index(ggml_type), 7])
    n, k, m = 24, 512, 2
    blocks, w, _ = _weights(rng, ggml_type, n, k)
    q = rng.integers(-127, 128, (m, k))
    q[:, ::256] = 127
    x = (q * np.repeat(2.0 ** rng.integers(-8, 8, (m, k // 256)), 256, axis=1)).astype(np.float32)
    got, _ = run_ggml_guarded(device, registry, ggml_type, blocks, x, n, INT8)
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(got - ref) <= 2.0**-20 * scale)


def _run_id(device, registry, ggml_type, stack, x, ids, route, layout):
    m, top_k = ids.shape
    experts, n = stack.shape[:2]
    k = x.shape[1]
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, experts, ggml_type, stack[0].nbytes, layout, route)
    out = device.from_numpy(np.full((m * top_k, n), POISON_U32, np.uint32).view(np.float32))
    scratch = routemm.DenseMatmulIdScratch(device, experts, m) if route.is_grouped else None
    encoder = device.command_encoder()
    receipt = routemm.quantized_matmul_id_ggml(
        encoder,
        registry,
        device.from_numpy(x),
        device.from_numpy(stack.reshape(-1)),
        device.from_numpy(ids),
        out,
        scratch,
        params,
    )
    encoder.commit_and_wait()
    return receipt, out.numpy().reshape(m * top_k, n)


@pytest.mark.usefixtures("kquant_int8")
@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.value)
@pytest.mark.parametrize("m,n,k,top_k,experts", [(1, 70, 512, 4, 8), (40, 70, 256 * 5, 6, 8)])
def test_kquant_int8_dot_expert_routes_match_dense_and_their_bound(
    device, registry, ggml_type, layout, m, n, k, top_k, experts
):
    rng = np.random.default_rng([m, n, k, top_k, experts, list(GgmlType).index(ggml_type), 9])
    mats = [_weights(rng, ggml_type, n, k) for _ in range(experts)]
    stack = np.stack([b for b, _, _ in mats])
    rows = m if layout is Layout.SHARED_PER_TOKEN else m * top_k
    x = _activations(rng, rows, k)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = INVALID
    if m > 1:
        ids[m - 1, top_k - 1] = experts

    outs = {}
    for route in INT8_ROUTES:
        receipt, out = _run_id(device, registry, ggml_type, stack, x, ids, route, layout)
        validate(receipt)
        assert receipt.route is route and receipt.ggml_type is ggml_type
        assert not np.any(out.view(np.uint32) == POISON_U32), "an output element was never written"
        outs[route] = out
    direct, grouped = outs[Route.DIRECT_INT8_DOT], outs[Route.GROUPED_INT8_DOT]
    np.testing.assert_array_equal(direct.view(np.uint32), grouped.view(np.uint32))

    flat_ids = ids.reshape(-1)
    for flat in np.flatnonzero(flat_ids >= experts):
        assert np.all(direct[flat].view(np.uint32) == 0), f"row {flat} of an invalid id is not zero"
    for e in range(experts):
        flats = np.flatnonzero(flat_ids == e)
        if flats.size == 0:
            continue
        src = np.stack([x[f // top_k] if layout is Layout.SHARED_PER_TOKEN else x[f] for f in flats])
        blocks, w, magnitudes = mats[e]
        # Bit for bit the dense int8-dot pipeline on this expert's matrix (its matrix route when
        # more than 8 rows, its mat-vec otherwise).
        dense, receipt = run_ggml_guarded(device, registry, ggml_type, blocks, src, n, INT8)
        assert receipt.route == "int8_dot"
        np.testing.assert_array_equal(direct[flats].view(np.uint32), dense.view(np.uint32), err_msg=f"expert {e}")
        ref = src.astype(np.float64) @ w.T
        bound = kquant_int8_dot_bound(w, magnitudes, src)
        assert np.all(np.abs(direct[flats] - ref) <= bound), f"expert {e} beyond the bound"
    exact = _run_id(device, registry, ggml_type, stack, x, ids, Route.DIRECT, layout)[1]
    assert not np.array_equal(exact, direct)


@pytest.mark.parametrize("ggml_type", [GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.MXFP4], ids=lambda t: t.value)
@pytest.mark.parametrize("route", INT8_ROUTES, ids=lambda r: r.value)
def test_other_formats_refuse_the_int8_dot_expert_routes(device, registry, ggml_type, route):
    fmt = ggml.block_format(ggml_type)
    n, k, experts = 8, 256, 2
    stack = np.zeros((experts, n, k // fmt.block_values * fmt.block_bytes), np.uint8)
    x = np.zeros((1, k), np.float32)
    ids = np.zeros((1, 1), np.uint32)
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match=f"route {route.value} supports .*not {ggml_type.value}"):
        _run_id(device, registry, ggml_type, stack, x, ids, route, Layout.SHARED_PER_TOKEN)
    assert routemm.dispatch_count() == before


@pytest.mark.usefixtures("kquant_int8")
def test_kquant_int8_dot_routes_through_moe_experts(device):
    """A Q4_K_M layer's mixed stacks (Q4_K gate and up, Q6_K down) take both int8-dot routes of
    moe_experts with the same bits, near the exact route."""
    rng = np.random.default_rng(11)
    experts, hidden, inter, m, top_k = 4, 256, 512, 5, 2
    gate, up = (
        np.stack(
            [ggml.quantize(rng.standard_normal((inter, hidden)).astype(np.float32), "q4_k") for _ in range(experts)]
        )
        for _ in range(2)
    )
    down = np.stack(
        [ggml.quantize(rng.standard_normal((hidden, inter)).astype(np.float32), "q6_k") for _ in range(experts)]
    )
    x = rng.standard_normal((m, hidden)).astype(np.float32)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((m, top_k)).astype(np.float32)
    types = (GgmlType.Q4_K, GgmlType.Q4_K, GgmlType.Q6_K)
    out = {
        route: routemm.moe_experts(x, ids, weights, (gate, up), down, ggml_type=types, route=route, device=device)
        for route in ("direct", "direct_int8_dot", "grouped_int8_dot")
    }
    np.testing.assert_array_equal(out["direct_int8_dot"].view(np.uint32), out["grouped_int8_dot"].view(np.uint32))
    assert not np.array_equal(out["direct"], out["direct_int8_dot"])
    rel = np.linalg.norm(out["direct_int8_dot"] - out["direct"]) / np.linalg.norm(out["direct"])
    assert rel <= KQUANT_INT8_DOT_FROBENIUS
