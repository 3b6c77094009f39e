"""routemm.matmul_id: the NumPy-level front door."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from routemm.dense_matmul_id import AUTO_GROUPED_MIN_TOKENS, auto_grouped
from support import NP_DTYPE, WEIGHT_DTYPES, distinct_ids, random_weights, reference
from tolerances import assert_close

E = 8


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.type_name)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
def test_matches_reference_and_routes_agree(device, rng, dtype, slotted):
    m, top_k, n, k = 9, 6, 7, 35
    w = random_weights(rng, dtype, (E, n, k))
    x = rng.uniform(-1, 1, (m, top_k, k) if slotted else (m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, E)
    outs = {
        r: routemm.matmul_id(w, x, ids, route=r, device=device) for r in (None, Route.DIRECT, Route.GROUPED_PREFILL)
    }
    ref, mag = reference(w, x, ids, slotted)
    for out in outs.values():
        assert out.dtype == np.float32 and out.shape == (m * top_k, n)
        assert_close(out, ref, mag, dtype=dtype, k=k)
    bits = outs[Route.DIRECT].view(np.uint32)
    assert np.array_equal(bits, outs[Route.GROUPED_PREFILL].view(np.uint32))
    assert np.array_equal(bits, outs[None].view(np.uint32))
    assert np.array_equal(w, w.copy())  # inputs are not written (arrays are copied to buffers)


@pytest.mark.parametrize(
    "m,repeat,grouped_if_the_rule_says",
    [
        (9, False, True),  # distinct and m > 8 -> grouped_prefill (map + grouped) where auto_grouped
        (33, False, True),  # 24.75 rows per expert: grouped on every backend
        (8, False, False),  # m <= 8 -> direct
        (1, False, False),
        (9, True, False),  # repeated ids -> direct (grouped would be rejected)
        (9, "invalid", True),  # two *different* out-of-range ids in a token are still distinct ids
    ],
)
def test_route_selection_rule(device, rng, m, repeat, grouped_if_the_rule_says):
    top_k, n, k = 6, 7, 35
    grouped = grouped_if_the_rule_says and auto_grouped(device, m, top_k, E)
    expected_dispatches = 2 if grouped else 1
    w = random_weights(rng, DType.F32, (E, n, k))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, E).astype(np.int64)
    if repeat == "invalid":
        ids[0, 0], ids[0, 1] = -1, E
    elif repeat:
        ids[m - 1, 1] = ids[m - 1, 0]
    before = routemm.dispatch_count()
    out = routemm.matmul_id(w, x, ids, device=device)
    assert routemm.dispatch_count() - before == expected_dispatches
    ref, mag = reference(w, x, np.where(ids < 0, E, ids), False)
    assert_close(out, ref, mag, dtype=DType.F32, k=k)
    if repeat is True:
        with pytest.raises(routemm.InvalidArgumentError, match="distinct expert IDs"):
            routemm.matmul_id(w, x, ids, route=Route.GROUPED_PREFILL, device=device)


def test_auto_grouped_rule_by_backend():
    # Every backend: direct below AUTO_GROUPED_MIN_TOKENS tokens, and when top_k > n_experts.
    for backend in ("cpu", "metal", "cuda"):
        assert not auto_grouped(backend, AUTO_GROUPED_MIN_TOKENS - 1, 2, 8)
        assert not auto_grouped(backend, 4096, 9, 8)
    # CPU and Metal: grouped from there on.
    assert auto_grouped("cpu", AUTO_GROUPED_MIN_TOKENS, 8, 128)
    assert auto_grouped("metal", 64, 8, 128, quantized=True)
    # CUDA: only from 8 rows per expert on average (256 for block stacks).
    assert not auto_grouped("cuda", 127, 8, 128) and auto_grouped("cuda", 128, 8, 128)
    assert not auto_grouped("cuda", 31, 2, 8) and auto_grouped("cuda", 32, 2, 8)
    assert not auto_grouped("cuda", 4095, 8, 128, quantized=True) and auto_grouped("cuda", 4096, 8, 128, quantized=True)
    # A Device and its backend name agree.
    dev = routemm.Device("cpu")
    assert auto_grouped(dev, 9, 8, 128) == auto_grouped("cpu", 9, 8, 128)


def test_automatic_route_follows_the_rule_on_the_receipt(device, rng):
    # Qwen3-like reuse (E 128, top-8): on CUDA direct up to 127 tokens, grouped from 128; on the
    # other backends grouped from 9. The receipt names the route that ran.
    experts, top_k, n, k = 128, 8, 3, 16
    w = random_weights(rng, DType.F32, (experts, n, k))
    for m in (9, 127, 128):
        x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
        ids = distinct_ids(rng, m, top_k, experts)
        _, receipt = routemm.matmul_id(w, x, ids, device=device, return_receipt=True)
        want = Route.GROUPED_PREFILL if auto_grouped(device, m, top_k, experts) else Route.DIRECT
        assert receipt.route == want, (device.backend, m, receipt.route)


def test_invalid_ids_zero_rows(device, rng):
    m, n, k = 4, 5, 9
    w = random_weights(rng, DType.BF16, (E, n, k))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = np.array([[0, 1, 2], [-1, 3, 8], [2**32 - 1, 2**40, 4], [5, 6, 7]], np.int64)
    for route in (None, Route.DIRECT, Route.GROUPED_PREFILL):
        out = routemm.matmul_id(w, x, ids, route=route, device=device)
        flat = ids.reshape(-1)
        bad = (flat < 0) | (flat >= E)
        assert np.all(out[bad].view(np.uint32) == 0)
        ref, mag = reference(w, x, np.where((ids >= 0) & (ids < E), ids, E), False)
        assert_close(out, ref, mag, dtype=DType.BF16, k=k)


def test_out_parameter(device, rng):
    m, top_k, n, k = 3, 2, 4, 8
    w = random_weights(rng, DType.F16, (E, n, k))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = distinct_ids(rng, m, top_k, E)
    out = np.full((m * top_k, n), np.nan, np.float32)
    got = routemm.matmul_id(w, x, ids, out=out, device=device)
    assert got is out
    ref, mag = reference(w, x, ids, False)
    assert_close(out, ref, mag, dtype=DType.F16, k=k)
    for bad in (
        np.zeros((m * top_k, n), np.float64),
        np.zeros((m * top_k, n + 1), np.float32),
        np.zeros((n, m * top_k), np.float32).T,
        np.zeros(m * top_k * n, np.float32),
    ):
        with pytest.raises(routemm.InvalidArgumentError):
            routemm.matmul_id(w, x, ids, out=bad, device=device)
    ro = np.zeros((m * top_k, n), np.float32)
    ro.flags.writeable = False
    with pytest.raises(routemm.InvalidArgumentError):
        routemm.matmul_id(w, x, ids, out=ro, device=device)


def test_default_device(rng):
    w = random_weights(rng, DType.F32, (2, 3, 4))
    x = rng.uniform(-1, 1, (2, 4)).astype(np.float32)
    ids = np.array([[1], [0]])
    out = routemm.matmul_id(w, x, ids)
    ref, mag = reference(w, x, ids, False)
    assert_close(out, ref, mag, dtype=DType.F32, k=4)


def test_bad_shapes_and_dtypes(device, rng):
    w = random_weights(rng, DType.F32, (E, 3, 4))
    x = np.zeros((2, 4), np.float32)
    ids = np.array([[0, 1], [2, 3]])
    bad_calls = [
        (w[0], x, ids),  # weights not 3-D
        (w, x, ids.reshape(-1)),  # ids not 2-D
        (w, np.zeros((2, 5), np.float32), ids),  # wrong k
        (w, np.zeros((3, 4), np.float32), ids),  # wrong m
        (w, np.zeros((2, 3, 4), np.float32), ids),  # wrong slotted top_k
        (w, x.astype(np.float64), ids),  # activations must be float32
        (w, x, ids.astype(np.float32)),  # ids must be integers
        (w.astype(np.float64), x, ids),  # no float64 weights
        (w.astype(np.int32), x, ids),  # non-scalar weight dtype
        (np.zeros((E, 0, 4), np.float32), x, ids),  # zero n
        (w, x, np.zeros((2, 9), np.int64)),  # distinct top_k 9 > 8 experts... but ids repeat
    ]
    for args in bad_calls[:-1]:
        with pytest.raises(routemm.InvalidArgumentError):
            routemm.matmul_id(*args, device=device)
    # top_k > n_experts with repeated ids is legal (may_repeat, direct).
    out = routemm.matmul_id(*bad_calls[-1], device=device)
    assert out.shape == (18, 3)
    with pytest.raises(routemm.InvalidArgumentError, match="must be nonzero"):
        routemm.matmul_id(w, np.zeros((0, 4), np.float32), np.zeros((0, 1), np.int64), device=device)
    with pytest.raises(ValueError):
        routemm.matmul_id(w, x, ids, route="sideways", device=device)


def test_reference_helper_agrees_with_package_oracle(rng):
    """Our float64 reference and routemm.ops._reference agree (two independent writings)."""
    from routemm.ops._reference import dense_matmul_id_reference

    w = random_weights(rng, DType.BF16, (E, 5, 6)).astype(NP_DTYPE[DType.BF16])
    for slotted in (False, True):
        x = rng.uniform(-1, 1, (4, 3, 6) if slotted else (4, 6)).astype(np.float32)
        ids = distinct_ids(rng, 4, 3, E)
        ids[0, 0] = 0xFFFFFFFF
        ours, _ = reference(w, x, ids, slotted)
        np.testing.assert_allclose(dense_matmul_id_reference(w, x, ids), ours, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m", [2, 9])
def test_out_of_range_ids_do_not_count_as_experts(device, rng, m):
    """One expert and ids [[0, 5], [-1, 0], ...]: the out-of-range ids give zero rows and do not
    count as distinct experts (top_k 2 > n_experts 1 is no reason to refuse the call)."""
    n, k = 3, 8
    w = random_weights(rng, DType.F32, (1, n, k))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = np.array([[0, 5], [-1, 0]] * (m // 2) + [[7, 0]] * (m % 2), np.int64)
    out = routemm.matmul_id(w, x, ids, device=device)
    ref, mag = reference(w, x, np.where((ids >= 0) & (ids < 1), ids, 0xFFFFFFFF).astype(np.uint32), False)
    assert_close(out, ref, mag, dtype=DType.F32, k=k)
    flat = ids.reshape(-1)
    assert np.all(out[flat != 0].view(np.uint32) == 0)
    assert np.all(out[flat == 0] != 0)


def test_device_may_be_a_backend_name(device, rng):
    w = random_weights(rng, DType.F32, (E, 5, 16))
    x = rng.uniform(-1, 1, (3, 16)).astype(np.float32)
    ids = distinct_ids(rng, 3, 2, E)
    by_name = routemm.matmul_id(w, x, ids, device=device.backend)
    assert np.array_equal(by_name.view(np.uint32), routemm.matmul_id(w, x, ids, device=device).view(np.uint32))
    for bad in (3, object(), b"cpu"):
        with pytest.raises(routemm.InvalidArgumentError, match="matmul_id device must be"):
            routemm.matmul_id(w, x, ids, device=bad)
    with pytest.raises(routemm.InvalidArgumentError, match="route must be one of"):
        routemm.matmul_id(w, x, ids, device=device, route="fastest")


@pytest.mark.parametrize("route", [None, Route.DIRECT, Route.GROUPED_PREFILL])
def test_torch_tensors_out_of_range_ids_do_not_count_as_experts(rng, route):
    """The same rule for PyTorch tensors (used in place through DLPack): with one expert and
    ids [[0, 5], [-1, 0], ...] the out-of-range ids give zero rows; grouped_prefill, which must be
    declared distinct, cannot be (top_k 2 > n_experts 1) and is refused."""
    torch = pytest.importorskip("torch")
    m, n, k = 10, 3, 8
    w = random_weights(rng, DType.F32, (1, n, k))
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    ids = np.array([[0, 5], [-1, 0]] * (m // 2), np.int64)
    if route is Route.GROUPED_PREFILL:
        with pytest.raises(routemm.InvalidArgumentError, match="top_k <= n_experts"):
            routemm.matmul_id(torch.from_numpy(w), torch.from_numpy(x), torch.from_numpy(ids), route=route)
        return
    out = routemm.matmul_id(torch.from_numpy(w), torch.from_numpy(x), torch.from_numpy(ids), route=route).numpy()
    want = routemm.matmul_id(w, x, ids, route=route, device=routemm.Device("cpu"))
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.all(out[ids.reshape(-1) != 0].view(np.uint32) == 0)
