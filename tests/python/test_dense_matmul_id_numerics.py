"""dense_matmul_id against a float64 reference, route bit-identity, guards, invalid ids, edge values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdMultiplicity as Mult
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import NP_DTYPE, WEIGHT_DTYPES, Case, distinct_ids, finfo, invalid_rows, random_weights, sprinkle_invalid
from tolerances import assert_close

ROUTES = (Route.DIRECT, Route.GROUPED_PREFILL)
E = 8


def _check(case: Case, result, *, use_table=True, scale=1.0, context=""):
    ref, mag = case.reference()
    bad = invalid_rows(case.ids, case.n_experts)
    # Invalid ids: rows of exactly +0.0 (all bits zero), in every route.
    assert np.all(result.out[bad].view(np.uint32) == 0), f"{context}: invalid-id rows not +0.0"
    assert_close(result.out, ref, mag, dtype=case.dtype, k=case.k, use_table=use_table, scale=scale, context=context)


def _check_routes(case: Case, context: str) -> dict:
    """Runs both routes, checks each against the reference and checks they agree bit for bit."""
    results = {route: case.run(route) for route in ROUTES}
    for route, result in results.items():
        _check(case, result, context=f"{context} {route.value}")
    assert np.array_equal(results[Route.DIRECT].out.view(np.uint32), results[Route.GROUPED_PREFILL].out.view(np.uint32))
    return results


def _inputs(rng, m, top_k, k, slotted):
    shape = (m * top_k, k) if slotted else (m, k)
    return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 33])
@pytest.mark.parametrize("top_k", [1, 6])
def test_route_matrix_small_tails(device, registry, rng, dtype, slotted, m, top_k):
    """K=35 / N=7 tails, 12-byte padded stride, 16-byte view offsets, some invalid ids: both routes
    match the reference and each other bit for bit."""
    n, k = 7, 35
    w = random_weights(rng, dtype, (E, n, k))
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, E), E)
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, slotted), ids, slotted=slotted, pad=12)
    _check_routes(case, f"{dtype}")


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("m", [9, 33])
def test_route_matrix_larger_shape(device, registry, rng, dtype, slotted, m):
    n, k, top_k = 40, 300, 6
    pad = 14 if dtype is not DType.F32 else 12
    w = random_weights(rng, dtype, (E, n, k))
    ids = distinct_ids(rng, m, top_k, E)
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, slotted), ids, slotted=slotted, pad=pad)
    _check_routes(case, f"{dtype}")


@pytest.mark.parametrize(
    "dtype,pad", [(DType.F32, 0), (DType.F16, 14), (DType.BF16, 14), (DType.F16, 2)], ids=lambda v: str(v)
)
def test_padded_strides(device, registry, rng, dtype, pad):
    m, top_k, n, k = 9, 6, 7, 35
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(
        device,
        registry,
        dtype,
        w,
        _inputs(rng, m, top_k, k, False),
        distinct_ids(rng, m, top_k, E),
        slotted=False,
        pad=pad,
    )
    assert case.stride == n * k * dtype.size + pad
    _check_routes(case, f"{dtype} pad {pad}")


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.value)
def test_invalid_ids_give_positive_zero_rows(device, registry, rng, dtype, route):
    """0xFFFFFFFF, n_experts, n_experts + 1 and 0x80000000: every such row is all +0.0 bits."""
    m, top_k, n, k = 9, 4, 7, 35
    ids = distinct_ids(rng, m, top_k, E)
    ids[0] = [E, 0xFFFFFFFF, E + 1, 0x80000000]  # a token with nothing valid
    ids[3, 1] = 0xFFFFFFFF
    ids[8, 3] = E
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, False), ids, slotted=False)
    result = case.run(route)
    bad = invalid_rows(ids, E)
    assert bad.sum() == 6
    assert np.all(result.out[bad].view(np.uint32) == 0)
    assert np.all(result.out[~bad] != 0)  # random data: valid rows are not silently zeroed
    _check(case, result, context=route.value)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
def test_repeated_ids_may_repeat_direct(device, registry, rng, dtype):
    """Duplicate ids within a token with MAY_REPEAT on the direct route (m=33, slotted)."""
    m, top_k, n, k = 33, 6, 7, 35
    ids = rng.integers(0, E, size=(m, top_k)).astype(np.uint32)
    ids[:, 1] = ids[:, 0]  # every token repeats an id
    ids[5] = 3  # one token with a single expert in every slot
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, True), ids, slotted=True, mult=Mult.MAY_REPEAT)
    result = case.run(Route.DIRECT)
    _check(case, result, context=f"{dtype} may_repeat")
    # Same slotted rows with the same expert give the same output only where the inputs agree: check
    # the repeated slots were each computed from their own input row.
    ref, _ = case.reference()
    assert not np.allclose(ref[0 * top_k + 0], ref[0 * top_k + 1])


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("m,top_k", [(1, 8), (8, 8), (47, 6), (64, 8)])
def test_aligned_rows_shared_experts(device, registry, rng, dtype, slotted, m, top_k):
    """The vectorised path (16-byte aligned rows, k % 8 == 0) with k = 200 (not a multiple of 64),
    n = 13 (a partial column tile) and 8 experts, so many of up to 512 flat rows share an expert;
    some ids invalid. Both routes match the reference and each other bit for bit, and every valid
    row is written."""
    n, k = 13, 200
    w = random_weights(rng, dtype, (E, n, k))
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, E), E)
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, slotted), ids, slotted=slotted, pad=0)
    for result in _check_routes(case, f"{dtype}").values():
        assert np.all(result.out[~invalid_rows(ids, E)] != 0), "a valid row was left unwritten or zeroed"


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("rows", [63, 1024, 1031], ids=lambda r: f"rows{r}")
def test_aligned_rows_expert_group_sizes(device, registry, rng, dtype, slotted, rows):
    """Experts routed from 1, 2, 7, 8, 9 and 17 flat rows (and the rest of the rows spread over two
    more experts or invalid), shuffled, on the vectorised path with top_k = 1: a kernel that
    computes the rows of one expert in groups sees full groups, partial groups and lone rows, up
    to and past 1024 flat rows. Both routes match the reference and each other bit for bit."""
    n, k, top_k = 11, 136, 1
    sizes = [1, 2, 7, 8, 9, 17]
    ids = np.concatenate([np.full(c, e, np.uint32) for e, c in enumerate(sizes)])
    rest = rows - ids.size
    spread = rng.choice(np.array([6, 7, E, 0xFFFFFFFF], np.uint32), size=rest, p=[0.45, 0.45, 0.05, 0.05])
    ids = rng.permutation(np.concatenate([ids, spread])).reshape(rows, top_k)
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, rows, top_k, k, slotted), ids, slotted=slotted, pad=0)
    for result in _check_routes(case, f"{dtype} rows={rows}").values():
        assert np.all(result.out[~invalid_rows(ids, E)] != 0), "a valid row was left unwritten or zeroed"


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("k", [8, 64, 128, 192, 264, 520])
def test_aligned_rows_grouped_slice_counts(device, registry, rng, dtype, k):
    """The vectorised grouped path over 1 to 9 K slices of 64 (one slice, so no prefetch; fewer
    slices than double-buffering turns over, more, and a partial last slice), with experts of more than one
    32-row tile and two column tiles (n = 70): both routes match the reference and each other bit
    for bit, and every valid row is written."""
    m, top_k, n = 80, 4, 70
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, E), E)
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, True), ids, slotted=True, pad=0)
    for result in _check_routes(case, f"{dtype} k={k}").values():
        assert np.all(result.out[~invalid_rows(ids, E)] != 0), "a valid row was left unwritten or zeroed"


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("pad", [0, 12], ids=["aligned", "padded"])
def test_grouped_many_tiles(device, registry, rng, dtype, pad):
    """More 32 x 64 tiles than a GPU keeps resident (8 experts x 5 row tiles x 17 column tiles),
    so a persistent grid runs several per block, with row and column tails, a partial K slice and
    some invalid ids; aligned and padded (element-wise) weight stacks. Both routes match the
    reference and each other bit for bit, and every valid row is written."""
    m, top_k, n, k = 130, 8, 1030, 72
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, E), E)
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, False), ids, slotted=False, pad=pad)
    for result in _check_routes(case, f"{dtype} many tiles pad={pad}").values():
        assert np.all(result.out[~invalid_rows(ids, E)] != 0), "a valid row was left unwritten or zeroed"


def _expected_lists(ids: np.ndarray, n_experts: int, m: int):
    """The map's list: for every expert, every flat row naming it, in flat-row order (ids >=
    n_experts skipped, repeated ids within a token each routed)."""
    flat = ids.reshape(-1).astype(np.int64)
    lists = [np.flatnonzero(flat == e).tolist() for e in range(n_experts)]
    return np.array([len(v) for v in lists], np.uint32), lists


def _routed_segments(case: Case, n_experts: int) -> tuple[np.ndarray, list[list[int]]]:
    """Counts and per-expert segments of the map's list (one list, expert after expert)."""
    counts = case.scratch.expert_counts.numpy().reshape(-1).view(np.uint32)
    routed = case.scratch.routed_rows.numpy().reshape(-1).view(np.uint32)
    starts = np.concatenate([[0], np.cumsum(counts.astype(np.int64))])
    return counts, [routed[starts[e] : starts[e + 1]].tolist() for e in range(n_experts)]


@pytest.mark.parametrize("top_k", [6, 12])
@pytest.mark.parametrize("m", [1, 255, 256, 700, 2100])
def test_grouped_map_lists_in_token_order(device, registry, rng, m, top_k):
    """The grouped route's map writes, for every expert, its count and its routed flat rows in
    flat-row order, the experts' segments one after another (invalid ids skipped), over one to many
    tiles, with experts that no token picks and a token with no valid slot; top_k = 12 is wider than
    the ids a thread keeps in registers."""
    n_experts, n, k = 37, 5, 16
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts - 3), n_experts)
    ids[m // 2, :] = 0xFFFFFFFF
    w = random_weights(rng, DType.F32, (n_experts, n, k))
    case = Case(device, registry, DType.F32, w, _inputs(rng, m, top_k, k, False), ids, slotted=False, pad=0)
    case.scratch.expert_counts.copy_from_numpy(np.full(n_experts, 0xDEADBEEF, np.uint32))
    _check(case, case.run(Route.GROUPED_PREFILL), context=f"map m={m}")
    counts, lists = _routed_segments(case, n_experts)
    want_counts, want_lists = _expected_lists(ids, n_experts, m)
    assert np.array_equal(counts, want_counts)
    assert lists == want_lists


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
@pytest.mark.parametrize("m", [1, 9, 300])
def test_grouped_routes_ids_repeated_within_a_token(device, registry, rng, dtype, slotted, m):
    """Ids that repeat within a token although the call declares them distinct: grouped_prefill
    writes every slot's row (none is left stale), matches the reference and is bit-identical to
    direct. One expert is named by every slot of every third token, so it holds more rows than
    there are tokens (more than its row tiles of the grid cover)."""
    n_experts, top_k, n, k = E, 4, 7, 35
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, n_experts), n_experts)
    ids[::3, :] = 5
    ids[:, 2] = ids[:, 1]
    w = random_weights(rng, dtype, (n_experts, n, k))
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, slotted), ids, slotted=slotted)
    _check_routes(case, f"{dtype} repeated")
    counts, lists = _routed_segments(case, n_experts)
    want_counts, want_lists = _expected_lists(ids, n_experts, m)
    assert np.array_equal(counts, want_counts) and lists == want_lists
    assert counts[5] > m


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
def test_aligned_rows_one_expert_dominates(device, registry, rng, dtype):
    """MAY_REPEAT on the vectorised direct path with two experts over 320 flat rows: duplicates
    within a token are computed from their own input rows, and a token with no valid slot gives
    zero rows."""
    m, top_k, n, k = 40, 8, 9, 64
    ids = rng.integers(0, 2, size=(m, top_k)).astype(np.uint32)
    ids[7] = E + 1  # one token with no valid slot
    w = random_weights(rng, dtype, (E, n, k))
    case = Case(
        device, registry, dtype, w, _inputs(rng, m, top_k, k, True), ids, slotted=True, pad=0, mult=Mult.MAY_REPEAT
    )
    result = case.run(Route.DIRECT)
    _check(case, result, context=f"{dtype} one expert dominates")
    assert np.all(result.out[~invalid_rows(ids, E)] != 0)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("k", [24576, 24584])
def test_aligned_rows_long_k(device, registry, rng, dtype, k):
    """Long rows on the vectorised path (k = 24576 and 24584, 384 chunk slices per lane group):
    both routes match the reference and each other bit for bit, with shared experts and an
    invalid id."""
    m, top_k, n = 3, 2, 5
    w = random_weights(rng, dtype, (2, n, k))
    ids = np.array([[0, 1], [1, 0], [0, 2]], np.uint32)  # shared experts and an invalid id
    case = Case(device, registry, dtype, w, _inputs(rng, m, top_k, k, False), ids, slotted=False, pad=0)
    _check_routes(case, f"{dtype} k={k}")


def _edge_values(dtype: DType) -> np.ndarray:
    fi = finfo(dtype)
    vals = [
        0.0,
        -0.0,
        float(fi.smallest_subnormal),
        -float(fi.smallest_subnormal),
        float(fi.smallest_normal),
        -float(fi.smallest_normal),
        float(fi.max),
        -float(fi.max),
        1.0,
        -1.0,
        0.5,
        1.0009765625,
    ]
    return np.array(vals, dtype=np.float64).astype(NP_DTYPE[dtype])


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
def test_single_term_edge_values_exact(device, registry, dtype):
    """Each output is one product widen(w) * x with w an edge value (±0, ±min subnormal, ±min
    normal, ±max finite, ...): the result is exactly the F32 product (no flush to zero, exact
    widening), in both routes."""
    vals = _edge_values(dtype)
    xs = np.array([1.0, -1.0, 0.5, 2.0, 1.0009765625], np.float32)
    n, k = len(vals), len(xs)
    # Expert e: row c holds vals[c] at inner position (c + e) % k, zeros elsewhere.
    w = np.zeros((E, n, k), NP_DTYPE[dtype])
    for e in range(E):
        for c in range(n):
            w[e, c, (c + e) % k] = vals[c]
    ids = np.arange(E, dtype=np.uint32)[None, :]
    case = Case(device, registry, dtype, w, xs[None, :], ids, slotted=False, pad=12)
    results = {route: case.run(route) for route in ROUTES}
    widened = vals.astype(np.float32)
    for e in range(E):
        with np.errstate(over="ignore", under="ignore"):
            want = widened * xs[(np.arange(n) + e) % k]
        for route, result in results.items():
            got = result.out[e]
            assert np.array_equal(got, want), f"{dtype} {route.value} expert {e}: {got} != {want}"
    assert np.array_equal(results[Route.DIRECT].out.view(np.uint32), results[Route.GROUPED_PREFILL].out.view(np.uint32))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("slotted", [False, True], ids=["shared", "slotted"])
def test_edge_value_sums(device, registry, rng, dtype, slotted):
    """Dense rows of edge values with adversarial non-negative activations: where the float64
    reference overflows F32 the result is inf of the same sign, elsewhere it is within the rigorous
    accumulation bound; direct and grouped agree bit for bit."""
    m, top_k, n, k = 9, 6, 7, 35
    fi = finfo(dtype)
    vals = _edge_values(dtype)
    w = vals[rng.integers(0, len(vals), size=(E, n, k))].astype(np.float64)
    # Huge weights of one row share a sign, so no partial sum can overflow unless the total does.
    huge = np.abs(w) == float(fi.max)
    sign = np.where(rng.random((E, n, 1)) < 0.5, -1.0, 1.0)
    w = np.where(huge, sign * float(fi.max), w).astype(NP_DTYPE[dtype])
    xs = np.array([0.0, -0.0, 1.0, 0.5, 1.0009765625, 3.0, 2.0**-20, 1.4e-45], np.float32)
    shape = (m * top_k, k) if slotted else (m, k)
    x = xs[rng.integers(0, len(xs), size=shape)]
    ids = sprinkle_invalid(rng, distinct_ids(rng, m, top_k, E), E)
    case = Case(device, registry, dtype, w, x, ids, slotted=slotted, pad=12 if dtype is DType.F32 else 14)
    results = {route: case.run(route) for route in ROUTES}
    assert np.array_equal(results[Route.DIRECT].out.view(np.uint32), results[Route.GROUPED_PREFILL].out.view(np.uint32))
    got = results[Route.DIRECT].out.astype(np.float64)
    ref, mag = case.reference()
    f32max = float(np.finfo(np.float32).max)
    over = np.abs(ref) >= 2.0**128 * (1 + 2.0**-20)
    fine = np.abs(ref) <= f32max * (1 - 2.0**-20)
    assert np.all(np.isinf(got[over]) & (np.sign(got[over]) == np.sign(ref[over])))
    if dtype is not DType.F16:
        assert over.any(), "test data should overflow somewhere for f32/bf16 weights"
    assert_close(
        results[Route.DIRECT].out[fine],
        ref[fine],
        mag[fine],
        dtype=dtype,
        k=k,
        use_table=False,
        context=f"{dtype} edge sums",
    )
    assert np.all(results[Route.DIRECT].out[invalid_rows(ids, E)].view(np.uint32) == 0)


def test_hf2q_vectors_bf16(device, registry):
    """The two BF16 vectors of spec §8, exactly; weights never modified."""
    eye, d23, d45 = np.eye(2), np.diag([2.0, 3.0]), np.diag([4.0, 5.0])
    w = np.stack([eye, d23, d45]).astype(ml_dtypes.bfloat16)
    x = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.float32)
    ids = np.array([[1], [1], [0], [2]], np.uint32)
    case = Case(device, registry, DType.BF16, w, x, ids, slotted=False, pad=0)
    for route in ROUTES:
        out = case.run(route).out
        assert out.reshape(-1).tolist() == [2, 6, 6, 12, 5, 6, 28, 40]

    w2 = np.stack([eye, d23]).astype(ml_dtypes.bfloat16)
    x2 = np.array([[1, 2], [3, 4]], np.float32)
    ids2 = np.array([[1, 0], [1, 1]], np.uint32)
    case2 = Case(device, registry, DType.BF16, w2, x2, ids2, slotted=False, pad=0, mult=Mult.MAY_REPEAT)
    out2 = case2.run(Route.DIRECT).out
    assert out2.reshape(-1).tolist() == [2, 6, 1, 2, 6, 12, 6, 12]


def test_bf16_widening_keeps_activation_bits(device, registry):
    """BF16 weight 1.0 times activation 1.0009766 is exactly 1.0009766 (activations stay F32)."""
    w = np.ones((1, 1, 1), ml_dtypes.bfloat16)
    x = np.array([[1.0009765625]], np.float32)
    case = Case(device, registry, DType.BF16, w, x, np.zeros((1, 1), np.uint32), slotted=False, pad=0)
    for route in ROUTES:
        assert case.run(route).out[0, 0] == np.float32(1.0009765625)


def test_scratch_reuse_across_calls_in_one_encoder(device, registry, rng):
    """Two grouped calls sharing one scratch in one encoder (the leading barrier orders them)."""
    m, top_k, n, k = 9, 6, 7, 35
    w = random_weights(rng, DType.F32, (E, n, k))
    a = Case(
        device, registry, DType.F32, w, _inputs(rng, m, top_k, k, False), distinct_ids(rng, m, top_k, E), slotted=False
    )
    b = Case(
        device, registry, DType.F32, w, _inputs(rng, m, top_k, k, False), distinct_ids(rng, m, top_k, E), slotted=False
    )
    scratch = routemm.DenseMatmulIdScratch(device, E, m)
    enc = device.command_encoder()
    for c in (a, b):
        routemm.dense_matmul_id(
            enc,
            registry,
            c.weights.view,
            c.input.view,
            c.id_buf.view,
            c.output.view,
            scratch,
            c.params(Route.GROUPED_PREFILL),
        )
    enc.commit_and_wait()
    for c in (a, b):
        got = c.output.view.numpy()
        ref, mag = c.reference()
        assert_close(got, ref, mag, dtype=DType.F32, k=k)
