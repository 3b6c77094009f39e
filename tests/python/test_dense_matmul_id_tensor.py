"""The tensor-core routes (grouped_tensor_tf32, grouped_tensor_lowp): explicit opt-in, map + one
tensor dispatch, a stated tolerance against a float64 reference, zero rows for invalid ids, and a
clear refusal on backends that do not register them."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import NP_DTYPE, POISON_U32, validate
from tolerances import TENSOR_ROUTE_FROBENIUS

TENSOR_ROUTES = (Route.GROUPED_TENSOR_TF32, Route.GROUPED_TENSOR_LOWP)


def _pipeline(route: Route, dtype: DType) -> str:
    kind = "tf32" if route is Route.GROUPED_TENSOR_TF32 else "lowp"
    return f"dense_matmul_id_grouped_{kind}_{dtype.type_name}_f32"


def _case(rng, m, n, k, top_k, experts, dtype, layout):
    w = (rng.standard_normal((experts, n, k), dtype=np.float32) / np.sqrt(k)).astype(NP_DTYPE[dtype])
    rows = m if layout is Layout.SHARED_PER_TOKEN else m * top_k
    x = rng.standard_normal((rows, k), dtype=np.float32)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = 0xFFFFFFFF  # an invalid id: a zero row
    return w, x, ids


def _reference(w, x, ids, layout):
    m, top_k = ids.shape
    out = np.zeros((m * top_k, w.shape[1]))
    for flat, e in enumerate(ids.reshape(-1)):
        if e < w.shape[0]:
            row = x[flat // top_k] if layout is Layout.SHARED_PER_TOKEN else x[flat]
            out[flat] = w[e].astype(np.float64) @ row.astype(np.float64)
    return out


def _run(device, registry, w, x, ids, params):
    w_buf, x_buf, id_buf = device.from_numpy(w), device.from_numpy(x), device.from_numpy(ids)
    rows = params.m * params.top_k
    out = device.from_numpy(np.full((rows, params.n), POISON_U32, np.uint32).view(np.float32))
    scratch = routemm.DenseMatmulIdScratch(device, params.n_experts, params.m)
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(2)
    receipt = routemm.dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out, scratch, params)
    dispatches = encoder.take_encoded_dispatch_receipt()
    encoder.commit_and_wait()
    return receipt, dispatches, out.numpy()


@pytest.mark.parametrize("route", TENSOR_ROUTES, ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16], ids=str)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
@pytest.mark.parametrize(
    "m,n,k,top_k,experts",
    [
        (9, 7, 35, 6, 8),
        (33, 130, 300, 2, 4),
        (200, 64, 128, 8, 16),
        (300, 300, 96, 4, 8),
        # Aligned shapes for the Hopper kernel: column and K tails of its 256 x 64 slices, experts
        # of more than 128 rows (a full tile and a remainder for tf32, two balanced tiles for lowp),
        # items of at most 64 rows (one consumer warpgroup idle), and more work items than
        # multiprocessors.
        (260, 520, 1000, 2, 4),
        (300, 520, 200, 8, 64),
    ],
)
def test_tensor_routes_within_tolerance(backend, device, registry, rng, route, dtype, layout, m, n, k, top_k, experts):
    params = routemm.DenseMatmulIdParams(m, n, k, top_k, experts, n * k * dtype.size, layout, route=route)
    if route is Route.GROUPED_TENSOR_LOWP and dtype is DType.F32:
        with pytest.raises(routemm.InvalidArgumentError, match="grouped_tensor_lowp requires F16 or BF16"):
            routemm.dense_matmul_id_capability(dtype, params)
        return
    w, x, ids = _case(rng, m, n, k, top_k, experts, dtype, layout)
    if not registry.has_kernel(_pipeline(route, dtype)):
        before = routemm.dispatch_count()
        with pytest.raises(routemm.KernelNotFoundError, match=_pipeline(route, dtype)):
            _run(device, registry, w, x, ids, params)
        assert routemm.dispatch_count() == before
        return
    receipt, dispatches, out = _run(device, registry, w, x, ids, params)
    validate(receipt)
    assert receipt.route is route and receipt.dispatch_count == 2
    assert [d.pipeline_label for d in dispatches] == ["dense_matmul_id_map_distinct", _pipeline(route, dtype)]
    for d in dispatches:
        validate(d)
    assert not np.any(out.view(np.uint32) == POISON_U32), "an output element was never written"
    ref = _reference(w, x, ids, layout)
    assert np.all(out[0] == 0.0), "invalid id must give a zero row"
    error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert error <= TENSOR_ROUTE_FROBENIUS[route], f"relative Frobenius error {error:.3e}"


@pytest.mark.parametrize("route", TENSOR_ROUTES, ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", [DType.F16, DType.BF16], ids=str)
@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
def test_tensor_routes_route_ids_repeated_within_a_token(device, registry, rng, route, dtype, layout):
    """Ids repeated within tokens although declared distinct: the shared map routes every slot, so
    no row is left unwritten. Expert 3 fills every slot of every other token: 600 rows, more than
    the 300 tokens and than one 128-row tile."""
    m, n, k, top_k, experts = 300, 136, 96, 4, 8
    if not registry.has_kernel(_pipeline(route, dtype)):
        pytest.skip(f"backend {device.backend} has no {_pipeline(route, dtype)}")
    params = routemm.DenseMatmulIdParams(m, n, k, top_k, experts, n * k * dtype.size, layout, route=route)
    w, x, ids = _case(rng, m, n, k, top_k, experts, dtype, layout)
    ids[::2, :] = 3
    ids[1::4, 1] = ids[1::4, 0]
    ids[1, 2] = 0xFFFFFFFF
    _, _, out = _run(device, registry, w, x, ids, params)
    assert not np.any(out.view(np.uint32) == POISON_U32), "an output element was never written"
    ref = _reference(w, x, ids, layout)
    assert np.all(out[1 * top_k + 2].view(np.uint32) == 0), "invalid id must give a zero row"
    error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert error <= TENSOR_ROUTE_FROBENIUS[route], f"relative Frobenius error {error:.3e}"
