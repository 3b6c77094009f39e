"""The reduced-precision CPU routes direct_bf16_dot and grouped_bf16_dot: explicit opt-in, bf16
weights only, within their stated bound of a float64 reference on fresh random inputs (K and N
tails included), bit-identical to each other, and refused before anything is encoded wherever the
instructions are missing (other backends, or a CPU limited below AVX-512 by ROUTEMM_CPU_ISA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import routemm
from routemm import DenseMatmulIdInputLayout as Layout
from routemm import DenseMatmulIdRoute as Route
from routemm import DType
from support import NP_DTYPE, POISON_U32, validate
from tolerances import BF16_DOT_FROBENIUS, bf16_dot_bound

BF16_DOT_ROUTES = (Route.DIRECT_BF16_DOT, Route.GROUPED_BF16_DOT)
PIPELINES = dict(zip(BF16_DOT_ROUTES, routemm.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES, strict=True))


def _case(rng, m, n, k, top_k, experts, layout):
    w = (rng.standard_normal((experts, n, k), dtype=np.float32) / np.sqrt(k)).astype(NP_DTYPE[DType.BF16])
    rows = m if layout is Layout.SHARED_PER_TOKEN else m * top_k
    x = rng.standard_normal((rows, k), dtype=np.float32) * rng.uniform(0.5, 4.0)
    ids = np.argsort(rng.random((m, experts)), axis=1)[:, :top_k].astype(np.uint32)
    ids[0, 0] = 0xFFFFFFFF  # an invalid id: a zero row
    return w, x, ids


def _reference(w, x, ids, layout):
    """(float64 product, sum |w * x|) per output element."""
    m, top_k = ids.shape
    ref = np.zeros((m * top_k, w.shape[1]))
    magnitude = np.zeros_like(ref)
    for flat, e in enumerate(ids.reshape(-1)):
        if e < w.shape[0]:
            row = (x[flat // top_k] if layout is Layout.SHARED_PER_TOKEN else x[flat]).astype(np.float64)
            w64 = w[e].astype(np.float64)
            ref[flat] = w64 @ row
            magnitude[flat] = np.abs(w64) @ np.abs(row)
    return ref, magnitude


def _run(device, registry, w, x, ids, params):
    w_buf, x_buf, id_buf = device.from_numpy(w), device.from_numpy(x), device.from_numpy(ids)
    out = device.from_numpy(np.full((params.m * params.top_k, params.n), POISON_U32, np.uint32).view(np.float32))
    scratch = routemm.DenseMatmulIdScratch(device, params.n_experts, params.m) if params.route.is_grouped else None
    encoder = device.command_encoder()
    encoder.start_encoded_dispatch_receipt(2)
    receipt = routemm.dense_matmul_id(encoder, registry, w_buf, x_buf, id_buf, out, scratch, params)
    dispatches = encoder.take_encoded_dispatch_receipt()
    encoder.commit_and_wait()
    return receipt, dispatches, out.numpy()


def _params(m, n, k, top_k, experts, layout, route, dtype=DType.BF16):
    return routemm.DenseMatmulIdParams(m, n, k, top_k, experts, n * k * dtype.size, layout, route=route)


@pytest.mark.parametrize("layout", list(Layout), ids=lambda v: v.value)
@pytest.mark.parametrize(
    "m,n,k,top_k,experts",
    [
        (1, 13, 35, 4, 8),  # k < 32: one masked step
        (3, 70, 100, 2, 4),  # k % 32 = 4, n % 8 = 6
        (9, 7, 517, 6, 8),  # several steps and a tail, n below one tile
        (70, 130, 64, 8, 16),  # more than one 64-row block for some experts
        (5, 64, 2048, 8, 128),  # the Qwen3 expert width
    ],
)
def test_bf16_dot_routes_within_their_bound_and_bit_identical(
    backend, device, registry, rng, layout, m, n, k, top_k, experts
):
    w, x, ids = _case(rng, m, n, k, top_k, experts, layout)
    if not all(registry.has_kernel(name) for name in PIPELINES.values()):
        if backend == "cpu":
            pytest.skip("this CPU has no AVX512_BF16 (or ROUTEMM_CPU_ISA excludes it)")
        # Other backends refuse the CPU-only routes before encoding anything.
        for route in BF16_DOT_ROUTES:
            before = routemm.dispatch_count()
            with pytest.raises(routemm.KernelNotFoundError, match=PIPELINES[route]):
                _run(device, registry, w, x, ids, _params(m, n, k, top_k, experts, layout, route))
            assert routemm.dispatch_count() == before
        return
    outs = {}
    for route in BF16_DOT_ROUTES:
        receipt, dispatches, out = _run(device, registry, w, x, ids, _params(m, n, k, top_k, experts, layout, route))
        validate(receipt)
        assert receipt.route is route and receipt.dispatch_count == (2 if route.is_grouped else 1)
        expected = ["dense_matmul_id_map_distinct", PIPELINES[route]] if route.is_grouped else [PIPELINES[route]]
        assert [d.pipeline_label for d in dispatches] == expected
        for d in dispatches:
            validate(d)
        assert not np.any(out.view(np.uint32) == POISON_U32), "an output element was never written"
        outs[route] = out
    direct, grouped = outs[Route.DIRECT_BF16_DOT], outs[Route.GROUPED_BF16_DOT]
    np.testing.assert_array_equal(direct.view(np.uint32), grouped.view(np.uint32))
    ref, magnitude = _reference(w, x, ids, layout)
    assert np.all(direct[0].view(np.uint32) == 0), "invalid id must give a zero row"
    err = np.abs(direct.astype(np.float64) - ref)
    bound = bf16_dot_bound(k, magnitude)
    assert np.all(err <= bound), f"worst err / bound {np.max(err / np.maximum(bound, 1e-300)):.3f}"
    frobenius = np.linalg.norm(direct - ref) / np.linalg.norm(ref)
    assert frobenius <= BF16_DOT_FROBENIUS, f"relative Frobenius error {frobenius:.3e}"
    # Reduced precision indeed: the exact route differs (the bound is not vacuous).
    exact = _run(device, registry, w, x, ids, _params(m, n, k, top_k, experts, layout, Route.DIRECT))[2]
    assert not np.array_equal(exact, direct)


@pytest.mark.parametrize("route", BF16_DOT_ROUTES, ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16], ids=str)
def test_bf16_dot_routes_require_bf16_weights(route, dtype):
    params = _params(2, 8, 32, 2, 4, Layout.SHARED_PER_TOKEN, route, dtype)
    with pytest.raises(
        routemm.InvalidArgumentError, match=f"{route.value} requires BF16 weights, got {dtype.type_name}"
    ):
        routemm.dense_matmul_id_capability(dtype, params)


def _run_script(script: str, isa: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ROUTEMM_CPU_ISA=isa)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300
    )


_REFUSAL = """
    import numpy as np, routemm
    from routemm import DenseMatmulIdRoute as Route, DType
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    assert not any(registry.has_kernel(n) for n in routemm.DENSE_MATMUL_ID_BF16_DOT_PIPELINE_NAMES)
    w = device.from_numpy(np.zeros((2, 8, 32), np.uint16).view(__import__("ml_dtypes").bfloat16))
    x = device.from_numpy(np.ones((1, 32), np.float32))
    ids = device.from_numpy(np.array([[0, 1]], np.uint32))
    out = device.from_numpy(np.full((2, 8), 7.0, np.float32))
    for route in (Route.DIRECT_BF16_DOT, Route.GROUPED_BF16_DOT):
        params = routemm.DenseMatmulIdParams(1, 8, 32, 2, 2, 8 * 32 * 2, route=route)
        scratch = routemm.DenseMatmulIdScratch(device, 2, 1)
        encoder = device.command_encoder()
        encoder.start_encoded_dispatch_receipt(2)
        try:
            routemm.dense_matmul_id(encoder, registry, w, x, ids, out, scratch, params)
        except routemm.KernelNotFoundError as e:
            assert "bf16dot" in str(e), e
        else:
            raise AssertionError("a bf16-dot route was encoded without AVX512_BF16")
        assert encoder.take_encoded_dispatch_receipt() == []
        encoder.commit_and_wait()
    assert np.all(out.numpy() == 7.0)
    print("refused")
"""


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_bf16_dot_routes_fail_closed_below_avx512(backend, isa):
    """A CPU without AVX512_BF16 (modelled by ROUTEMM_CPU_ISA): no pipeline is registered, a call
    raises KernelNotFoundError before encoding, and the output is untouched."""
    if backend != "cpu":
        pytest.skip("ROUTEMM_CPU_ISA limits the CPU backend")
    result = _run_script(_REFUSAL, isa)
    assert result.returncode == 0 and "refused" in result.stdout, result.stderr


_EXACT_BITS = """
    import hashlib, ml_dtypes, numpy as np, routemm
    from routemm import DenseMatmulIdInputLayout as Layout, DenseMatmulIdRoute as Route
    device = routemm.Device("cpu")
    registry = routemm.KernelRegistry(device)
    rng = np.random.default_rng(11)
    digest = hashlib.sha256()
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        for m, n, k in ((1, 13, 35), (3, 17, 64), (20, 50, 517)):
            w = (rng.standard_normal((6, n, k), dtype=np.float32) / np.sqrt(k)).astype(dtype)
            x = rng.standard_normal((m, k), dtype=np.float32)
            ids = np.argsort(rng.random((m, 6)), axis=1)[:, :4].astype(np.uint32)
            for route in (Route.DIRECT, Route.GROUPED_PREFILL):
                out = routemm.matmul_id(w, x, ids, route=route)
                digest.update(np.ascontiguousarray(out).tobytes())
    print(digest.hexdigest())
"""


def test_exact_routes_give_the_same_bits_under_every_cpu_isa(backend):
    """ROUTEMM_CPU_ISA picks the clone the exact routes run (portable, AVX2, AVX-512); the bits of
    direct and grouped_prefill do not depend on it."""
    if backend != "cpu":
        pytest.skip("ROUTEMM_CPU_ISA limits the CPU backend")
    digests = {}
    for isa in ("portable", "avx2", "avx512"):
        result = _run_script(_EXACT_BITS, isa)
        assert result.returncode == 0, result.stderr
        digests[isa] = result.stdout.strip()
    assert len(set(digests.values())) == 1, digests


def test_cpu_isa_knob_rejects_unknown_values(backend):
    if backend != "cpu":
        pytest.skip("ROUTEMM_CPU_ISA limits the CPU backend")
    result = _run_script(
        "import routemm, numpy as np; routemm.matmul_id(np.ones((1, 8, 8), np.float32), np.ones((1, 8), np.float32), np.zeros((1, 1), np.uint32))",
        "sse9",
    )
    assert result.returncode != 0
    assert "ROUTEMM_CPU_ISA must be portable, avx2 or avx512, got 'sse9'" in result.stderr
