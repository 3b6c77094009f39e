"""CPU benchmarks of the expert-ID matmul on the Qwen3-30B-A3B expert projection.

Both routes at decode (m=1, top_k=8) and prefill (m=512), f32 and bf16 weights, beside the best
NumPy formulation of the same product (per-expert gather + matmul through NumPy's BLAS; bf16 weights
converted to f32 first, as NumPy must) and the machine's memory-copy bandwidth, all in one run.
The expert IDs change every round, so decode streams weights from memory, not from cache.
"""

from __future__ import annotations

import concurrent.futures
import os

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm.dense_matmul_id import ids_distinct_per_token

E, TOP_K, N, K = 128, 8, 768, 2048
SHAPE = "qwen3-30b-a3b"
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
ROUNDS = {1: 30, 512: 3}
ROUTES = {1: ["direct"], 512: ["direct", "grouped_prefill"]}


@pytest.fixture(scope="module", params=sorted(DTYPES))
def stack(request, device):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((E, N, K), dtype=np.float32) * 0.02).astype(DTYPES[request.param])
    return request.param, weights, device.from_numpy(weights)


def _router_ids(rng, m):
    return np.argsort(rng.random((m, E)), axis=1)[:, :TOP_K].astype(np.uint32)


def _numpy_formulation(weights, x, ids):
    """Per-expert gather and BLAS matmul (bf16 weights converted to f32 per used expert)."""
    out = np.empty((ids.size, N), dtype=np.float32)
    flat_ids = ids.reshape(-1)
    for e in np.unique(flat_ids):
        rows = np.nonzero(flat_ids == e)[0]
        w = weights[e]
        if w.dtype != np.float32:
            w = w.astype(np.float32)
        out[rows] = x[rows // TOP_K] @ w.T
    return out


def _record(results, benchmark, *, m, dtype, route, impl, ids, note=""):
    seconds = benchmark.stats.stats.median
    touched = len(np.unique(ids))
    weight_bytes = touched * N * K * np.dtype(DTYPES[dtype]).itemsize
    flops = 2 * m * TOP_K * N * K
    results.add(
        op="dense_matmul_id",
        shape=SHAPE,
        m=m,
        weight_dtype=dtype,
        route=route,
        impl=impl,
        time_us=seconds * 1e6,
        bytes=weight_bytes,
        flops=flops,
        TBps=weight_bytes / seconds / 1e12,
        TFLOPs=flops / seconds / 1e12,
        note=note,
    )


def test_memory_copy_bandwidth(benchmark, results):
    """The ceiling decode is measured against: a 512 MB copy split over every core (NumPy releases
    the GIL while copying), counting bytes read plus bytes written."""
    threads = os.cpu_count() or 1
    src = np.ones(128 * 1024 * 1024, dtype=np.float32)
    dst = np.empty_like(src)
    parts = list(zip(np.array_split(dst, threads), np.array_split(src, threads), strict=True))
    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def copy():
        list(pool.map(lambda pair: np.copyto(*pair), parts))

    benchmark.pedantic(copy, rounds=5, warmup_rounds=1)
    pool.shutdown()
    seconds = benchmark.stats.stats.median
    results.ceilings["copy_TBps"] = 2 * src.nbytes / seconds / 1e12
    results.add(
        op="memcpy",
        shape="512MB",
        m=0,
        weight_dtype="f32",
        route="-",
        impl=f"numpy_{threads}_threads",
        time_us=seconds * 1e6,
        bytes=2 * src.nbytes,
        TBps=2 * src.nbytes / seconds / 1e12,
        note="bytes read + written",
    )


@pytest.mark.parametrize("m", sorted(ROUNDS))
@pytest.mark.parametrize("route", ["direct", "grouped_prefill"])
def test_routemm(benchmark, results, device, registry, stack, m, route):
    if route not in ROUTES[m]:
        pytest.skip(f"{route} is not a route for m={m}")
    dtype, weights, w_buf = stack
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K), dtype=np.float32)
    x_buf = device.from_numpy(x)
    out = device.alloc(m * TOP_K * N * 4, routemm.DType.F32, [m * TOP_K, N])
    params = routemm.DenseMatmulIdParams(
        m, N, K, TOP_K, E, N * K * np.dtype(DTYPES[dtype]).itemsize, route=routemm.DenseMatmulIdRoute(route)
    )
    scratch = routemm.DenseMatmulIdScratch(device, E, m) if route == "grouped_prefill" else None
    id_sets = [_router_ids(rng, m) for _ in range(ROUNDS[m] + 2)]
    id_bufs = iter([(ids, device.from_numpy(ids)) for ids in id_sets])
    last = {}

    def setup():
        last["ids"], id_buf = next(id_bufs)
        return (id_buf,), {}

    def run(id_buf):
        encoder = device.command_encoder()
        routemm.dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out, scratch, params)
        encoder.commit_and_wait()

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS[m], warmup_rounds=1)
    # Correctness of the measured configuration, on the last ids used.
    ids = last["ids"]
    want = _numpy_formulation(weights, x, ids)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-3, atol=1e-3)
    assert ids_distinct_per_token(ids)
    _record(results, benchmark, m=m, dtype=dtype, route=route, impl="routemm", ids=ids)


@pytest.mark.parametrize("m", sorted(ROUNDS))
def test_numpy(benchmark, results, stack, m):
    dtype, weights, _ = stack
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, K), dtype=np.float32)
    id_sets = iter([_router_ids(rng, m) for _ in range(ROUNDS[m] + 2)])
    last = {}

    def setup():
        last["ids"] = next(id_sets)
        return (weights, x, last["ids"]), {}

    benchmark.pedantic(_numpy_formulation, setup=setup, rounds=ROUNDS[m], warmup_rounds=1)
    _record(
        results,
        benchmark,
        m=m,
        dtype=dtype,
        route="per_expert_matmul",
        impl="numpy",
        ids=last["ids"],
        note="bf16 converted to f32 per used expert" if dtype == "bf16" else "",
    )
