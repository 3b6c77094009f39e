"""The reduced-precision int8-dot routes of the quantised expert-ID matmul (direct_int8_dot,
grouped_int8_dot): explicit opt-in, Q4_0 and Q8_0 stacks, every routed row bit-identical to the
dense int8-dot pipeline of quantized_matmul_ggml on its expert's matrix and within that contract's
bound of a float64 reference on fresh heavy-tailed inputs (K and N tails, both input layouts,
experts with more routed rows than one mat-vec pass), the two routes bit-identical to each other,
every output element written, invalid ids zero rows, and refused before anything is encoded on
backends without the pipelines. The clones' bit identity is in test_cpu_isa_clones.py."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import GgmlQuantizedMatmulIdRoute as Route
from routemm import GgmlType, q4_0, q8_0
from support import POISON_U32, run_ggml_guarded, validate
from tolerances import INT8_DOT_FROBENIUS, int8_dot_bound

FORMATS = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
INT8_ROUTES = (Route.DIRECT_INT8_DOT, Route.GROUPED_INT8_DOT)
DENSE_INT8 = routemm.GgmlRoutingPolicy(dense_int8_dot=True)
INVALID = 0xFFFFFFFF


def _pipeline(ggml_type: GgmlType, route: Route) -> str:
    names = routemm.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES
    return names[(2 if route.is_grouped else 0) + (1 if ggml_type is GgmlType.Q8_0 else 0)]


def _activations(rng, rows, k):
    """Heavy-tailed rows (log-normal magnitudes), one all-zero block and, where K allows, a block
    below 2^-100 (rounded to zero by contract) and a block with one large outlier."""
    x = rng.standard_normal((rows, k)) * np.exp(1.2 * rng.standard_normal((rows, k)))
    x[:, :32] = 0.0 if k > 32 else x[:, :32]
    if k >= 128:
        x[:, 64:96] *= 2.0**-110
        x[:, 96:128] = rng.uniform(-0.01, 0.01, (rows, 32))
        x[:, 100] = 40.0
    return x.astype(np.float32)


def _case(rng, ggml_type, m, n, k, top_k, experts, layout):
    fmt = FORMATS[ggml_type]
    stack = np.stack([fmt.quantize(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(experts)])
    rows = m if layout is Layout.SHARED_PER_TOKEN else m * top_k
    x = _activations(rng, rows, k)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = INVALID  # a zero row that reads no weight
    if m > 1:
        ids[m - 1, top_k - 1] = experts  # the first id out of range
    return stack, x, ids


def _run(device, registry, ggml_type, stack, x, ids, route, layout):
    m, top_k = ids.shape
    experts, n = stack.shape[:2]
    k = x.shape[1]
    params = routemm.GgmlQuantizedMatmulIdParams(m, n, k, top_k, experts, ggml_type, stack[0].nbytes, layout, route)
    out = device.from_numpy(np.full((m * top_k, n), POISON_U32, np.uint32).view(np.float32))
    scratch = routemm.DenseMatmulIdScratch(device, experts, m) if route.is_grouped else None
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(2)
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
    dispatches = encoder.take_encoded_dispatch_receipt()
    encoder.commit_and_wait()
    return receipt, dispatches, out.numpy().reshape(m * top_k, n)


def _source_row(x, flat, top_k, layout):
    return x[flat // top_k] if layout is Layout.SHARED_PER_TOKEN else x[flat]


@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.value)
@pytest.mark.parametrize(
    "m,n,k,top_k,experts",
    [
        (1, 13, 32, 4, 8),  # one block, N below one column group
        (3, 70, 32 * 13, 2, 4),  # K not a multiple of the 8-block panel, N % 8 = 6
        (1, 200, 32 * 9, 8, 16),  # one decode token, many slots
        (40, 70, 32 * 5, 6, 8),  # ~30 routed rows per expert: the grouped route's matrix items
    ],
)
def test_int8_dot_routes_match_the_dense_pipeline_and_their_bound(
    backend, device, registry, ggml_type, layout, m, n, k, top_k, experts
):
    rng = np.random.default_rng([m, n, k, top_k, experts, 81])
    stack, x, ids = _case(rng, ggml_type, m, n, k, top_k, experts, layout)
    if not all(registry.has_kernel(_pipeline(ggml_type, route)) for route in INT8_ROUTES):
        assert backend != "cpu", "the CPU backend registers the int8-dot routes on every CPU"
        for route in INT8_ROUTES:  # other backends refuse before encoding anything
            before = routemm.dispatch_count()
            with pytest.raises(routemm.KernelNotFoundError, match=_pipeline(ggml_type, route)):
                _run(device, registry, ggml_type, stack, x, ids, route, layout)
            assert routemm.dispatch_count() == before
        return

    outs = {}
    for route in INT8_ROUTES:
        receipt, dispatches, out = _run(device, registry, ggml_type, stack, x, ids, route, layout)
        validate(receipt)
        assert receipt.route is route and receipt.ggml_type is ggml_type
        assert receipt.dispatch_count == (2 if route.is_grouped else 1)
        expected = [_pipeline(ggml_type, route)]
        if route.is_grouped:
            expected.insert(0, routemm.DENSE_MATMUL_ID_PIPELINE_NAMES[3])
        assert [d.pipeline_label for d in dispatches] == expected
        assert not np.any(out.view(np.uint32) == POISON_U32), "an output element was never written"
        outs[route] = out
    direct, grouped = outs[Route.DIRECT_INT8_DOT], outs[Route.GROUPED_INT8_DOT]
    np.testing.assert_array_equal(direct.view(np.uint32), grouped.view(np.uint32))

    fmt = FORMATS[ggml_type]
    flat_ids = ids.reshape(-1)
    for flat in np.flatnonzero(flat_ids >= experts):
        assert np.all(direct[flat].view(np.uint32) == 0), f"row {flat} of an invalid id is not zero"
    valid = np.flatnonzero(flat_ids < experts)
    refs, bounds = [], []
    for flat in valid:
        row = _source_row(x, flat, top_k, layout)[None, :]
        blocks = stack[flat_ids[flat]]
        # Bit for bit the dense int8-dot mat-vec on this expert's matrix.
        dense, dense_receipt = run_ggml_guarded(device, registry, ggml_type, blocks, row, n, DENSE_INT8)
        assert dense_receipt.route == "int8_dot"
        np.testing.assert_array_equal(direct[flat].view(np.uint32), dense[0].view(np.uint32), err_msg=f"row {flat}")
        weights = fmt.dequantize(blocks).reshape(n, k).astype(np.float64)
        refs.append(row.astype(np.float64) @ weights.T)
        bounds.append(int8_dot_bound(weights, row))
    ref, bound = np.concatenate(refs), np.concatenate(bounds)
    got = direct[valid].astype(np.float64)
    err = np.abs(got - ref)
    assert np.all(np.isfinite(got))
    assert np.all(err <= bound), f"{int((err > bound).sum())} element(s) beyond the bound; worst {err.max():.3e}"
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= INT8_DOT_FROBENIUS
    # Reduced precision indeed: the exact route differs, and the bound is not vacuous.
    exact = _run(device, registry, ggml_type, stack, x, ids, Route.DIRECT, layout)[2]
    assert not np.array_equal(exact, direct)
    assert (err / bound).max() > 1e-2


@pytest.mark.needs_kernels(*routemm.GGML_QUANTIZED_MATMUL_ID_INT8_DOT_PIPELINE_NAMES)
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.value)
def test_direct_int8_dot_takes_repeated_ids_and_the_expert_down_form(device, registry, ggml_type):
    """direct_int8_dot, as direct, takes repeated ids: the flattened expert-down form (m = tokens *
    top_k, top_k = 1, slotted rows) gives the bits of the per-token call with a slotted input."""
    rng = np.random.default_rng(5)
    m, top_k, n, k, experts = 4, 3, 40, 32 * 6, 5
    stack = np.stack(
        [FORMATS[ggml_type].quantize(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(experts)]
    )
    x = _activations(rng, m * top_k, k)
    ids = rng.integers(0, 2, (m, top_k)).astype(np.uint32)  # experts 0 and 1 only: repeats
    per_token = _run(device, registry, ggml_type, stack, x, ids, Route.DIRECT_INT8_DOT, Layout.SLOTTED)[2]
    flat = _run(device, registry, ggml_type, stack, x, ids.reshape(-1, 1), Route.DIRECT_INT8_DOT, Layout.SLOTTED)[2]
    np.testing.assert_array_equal(per_token.view(np.uint32), flat.view(np.uint32))


def test_int8_dot_routes_through_matmul_id(backend, device):
    """routemm.matmul_id takes the route names; an unknown name lists every route."""
    rng = np.random.default_rng(9)
    stack = np.stack([q4_0.quantize(rng.standard_normal((16, 64)).astype(np.float32)) for _ in range(3)])
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ids = np.array([[0, 2], [1, 0]])
    with pytest.raises(routemm.InvalidArgumentError, match="'direct_int8_dot', 'grouped_int8_dot'"):
        routemm.matmul_id(stack, x, ids, ggml_type=GgmlType.Q4_0, route="int8", device=device)
    if backend != "cpu":
        with pytest.raises(routemm.KernelNotFoundError):
            routemm.matmul_id(stack, x, ids, ggml_type=GgmlType.Q4_0, route="direct_int8_dot", device=device)
        return
    direct = routemm.matmul_id(stack, x, ids, ggml_type=GgmlType.Q4_0, route="direct_int8_dot", device=device)
    grouped = routemm.matmul_id(stack, x, ids, ggml_type=GgmlType.Q4_0, route=Route.GROUPED_INT8_DOT, device=device)
    np.testing.assert_array_equal(np.asarray(direct).view(np.uint32), np.asarray(grouped).view(np.uint32))


def test_int8_dot_route_records():
    """The routes' capability and pipelines: direct needs no scratch, grouped the map's."""
    for route in INT8_ROUTES:
        params = routemm.GgmlQuantizedMatmulIdParams(2, 8, 64, 2, 4, GgmlType.Q8_0, 8 * 2 * 34, route=route)
        validate(params)
        cap = routemm.quantized_matmul_id_ggml_capability(params)
        validate(cap)
        assert cap.route is route and (cap.scratch is not None) == route.is_grouped
        assert route.is_int8_dot and not Route.DIRECT.is_int8_dot
        assert route.pipelines(GgmlType.Q8_0)[-1] == _pipeline(GgmlType.Q8_0, route)
