"""The reduced-precision int8-dot routes of quantized_matmul_ggml (GgmlRoutingPolicy.dense_int8_dot):
opt-in only, Q4_0 and Q8_0 weights, mat-vec (m <= 8) and matrix (m > 8) pipelines on the CPU, held
per element to the bound of tolerances.int8_dot_bound against float64 on fresh random inputs with
heavy tails, every output element written, nothing outside the output touched; a backend without
the pipelines runs the exact routes. The clones' bit identity is in test_cpu_isa_clones.py."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import GgmlType, q4_0, q8_0
from support import run_ggml_guarded, validate
from tolerances import INT8_DOT_FROBENIUS, int8_dot_bound

FORMATS = {GgmlType.Q4_0: q4_0, GgmlType.Q8_0: q8_0}
INT8 = routemm.GgmlRoutingPolicy(dense_int8_dot=True)
LABEL_SUFFIX = "|700:i1|701:i1|702:i1"
# The tests that run the routes: backends without them (every one but the CPU) are skips.
needs_int8_dot = pytest.mark.needs_kernels(*routemm.GGML_INT8_DOT_PIPELINE_NAMES)


def _pipeline(ggml_type: GgmlType, m: int) -> str:
    names = routemm.GGML_INT8_DOT_PIPELINE_NAMES
    return names[(2 if ggml_type is GgmlType.Q8_0 else 0) + (0 if m <= 8 else 1)]


def _activations(rng, m, k):
    """Heavy-tailed rows (log-normal magnitudes, random signs), one block of zeros, one block below
    2^-100 (rounded to zero by contract) and one block with a single large outlier."""
    x = rng.standard_normal((m, k)) * np.exp(1.5 * rng.standard_normal((m, k)))
    x[:, 32:64] = 0.0
    if k >= 128:
        x[:, 64:96] *= 2.0**-110
        x[:, 96:128] = rng.uniform(-0.01, 0.01, (m, 32))
        x[:, 100] = 50.0
    return x.astype(np.float32)


@needs_int8_dot
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.value)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33])
@pytest.mark.parametrize("n,k", [(70, 32 * 13), (13, 32 * 9)])
def test_int8_dot_routes_within_their_bound(device, registry, ggml_type, m, n, k):
    """K a multiple of 32 but not of the 256-value panel, N not a multiple of any tile; every element
    is written (the output starts poisoned) and within the derived bound of float64."""
    rng = np.random.default_rng([m, n, k, 8])
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32))
    weights = fmt.dequantize(blocks).reshape(n, k).astype(np.float64)
    x = _activations(rng, m, k)
    got, receipt = run_ggml_guarded(device, registry, ggml_type, blocks, x, n, INT8)

    assert receipt.route == "int8_dot" and receipt.dense_route is None
    assert receipt.pipeline_label == _pipeline(ggml_type, m) + LABEL_SUFFIX
    assert receipt.dispatch.pipeline_label == receipt.pipeline_label
    assert receipt.decision.value == ("mat_vec_threshold" if m <= 8 else "policy_int8_dot")
    assert receipt.policy.dense_int8_dot

    ref = x.astype(np.float64) @ weights.T
    err = np.abs(got.astype(np.float64) - ref)
    bound = int8_dot_bound(weights, x)
    assert np.all(np.isfinite(got))
    assert np.all(err <= bound), f"{int((err > bound).sum())} element(s) beyond the bound; worst {err.max():.3e}"
    # The activations really were rounded (the exact routes' error is ~1e-7 relative), and the
    # bound is not loose by orders of magnitude.
    assert (err / bound).max() > 1e-2
    frobenius = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert frobenius <= INT8_DOT_FROBENIUS, f"relative Frobenius error {frobenius:.3e}"


@needs_int8_dot
@pytest.mark.parametrize("ggml_type", list(FORMATS), ids=lambda t: t.value)
@pytest.mark.parametrize("m", [1, 9])
def test_int8_dot_rounds_activations_per_block(device, registry, ggml_type, m):
    """Activations that are already int8 multiples of their block scale (max |x| = 127 d) are
    represented exactly, so the result equals the exact product up to F32 accumulation."""
    rng = np.random.default_rng([m, 3])
    n, k = 24, 32 * 5
    fmt = FORMATS[ggml_type]
    blocks = fmt.quantize(rng.standard_normal((n, k)).astype(np.float32))
    weights = fmt.dequantize(blocks).reshape(n, k).astype(np.float64)
    q = rng.integers(-127, 128, (m, k))
    q.reshape(m, -1, 32)[:, :, 0] = 127  # every block's max |q| is 127
    x = (q * 2.0**-6).astype(np.float32)
    got, _ = run_ggml_guarded(device, registry, ggml_type, blocks, x, n, INT8)
    ref = x.astype(np.float64) @ weights.T
    steps = k // 32 + 1
    np.testing.assert_array_less(
        np.abs(got - ref), steps * 2.0**-23 * (np.abs(x.astype(np.float64)) @ np.abs(weights).T) + 1e-30
    )


@needs_int8_dot
@pytest.mark.parametrize("m", [1, 9])
def test_int8_dot_non_finite_activation_poisons_its_row_only(device, registry, m):
    """A block with inf or NaN has scale NaN by contract: its row's outputs are all NaN, every other
    row is finite."""
    rng = np.random.default_rng(5)
    n, k = 10, 96
    blocks = q4_0.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, 40] = np.inf
    if m > 1:
        x[m - 1, 3] = np.nan
    got, _ = run_ggml_guarded(device, registry, GgmlType.Q4_0, blocks, x, n, INT8)
    assert np.all(np.isnan(got[0])) and np.all(np.isnan(got[m - 1]))
    assert np.all(np.isfinite(got[1 : m - 1]))


@needs_int8_dot
def test_int8_dot_is_opt_in(device, registry, monkeypatch):
    """The default policy never takes it; ROUTEMM_DENSE_INT8_DOT=1 reaches the dispatcher through
    GgmlRoutingPolicy.from_environment() (routing=None), and the knob is in the table."""
    monkeypatch.delenv("ROUTEMM_DENSE_INT8_DOT", raising=False)
    assert not routemm.GgmlRoutingPolicy().dense_int8_dot
    assert not routemm.GgmlRoutingPolicy.from_environment().dense_int8_dot
    rng = np.random.default_rng(2)
    blocks = q8_0.quantize(rng.standard_normal((8, 64)).astype(np.float32))
    x = rng.standard_normal((1, 64)).astype(np.float32)
    _, receipt = run_ggml_guarded(device, registry, GgmlType.Q8_0, blocks, x, 8, None)
    assert receipt.route == "mat_vec" and "int8dot" not in receipt.pipeline_label
    monkeypatch.setenv("ROUTEMM_DENSE_INT8_DOT", "on")
    _, receipt = run_ggml_guarded(device, registry, GgmlType.Q8_0, blocks, x, 8, None)
    assert receipt.route == "int8_dot" and receipt.policy.dense_int8_dot
    assert "ROUTEMM_DENSE_INT8_DOT" in routemm.env.table_markdown()


@needs_int8_dot
def test_int8_dot_receipt_round_trips_and_matches_the_schema(device, registry):
    rng = np.random.default_rng(4)
    blocks = q4_0.quantize(rng.standard_normal((70, 64)).astype(np.float32))
    for m in (3, 12):
        x = rng.standard_normal((m, 64)).astype(np.float32)
        _, receipt = run_ggml_guarded(device, registry, GgmlType.Q4_0, blocks, x, 70, INT8)
        assert type(receipt).from_json(receipt.to_json()) == receipt
        validate(receipt)


def test_backends_without_int8_dot_run_the_exact_routes(backend, device, registry):
    """Metal and CUDA have no int8-dot pipelines: with the policy set they run the exact routes and
    say so; only the CPU registers them."""
    has = [registry.has_kernel(name) for name in routemm.GGML_INT8_DOT_PIPELINE_NAMES]
    assert has == [backend == "cpu"] * 4
    if backend == "cpu":
        return
    rng = np.random.default_rng(6)
    blocks = q4_0.quantize(rng.standard_normal((16, 64)).astype(np.float32))
    for m in (1, 12):
        x = rng.standard_normal((m, 64)).astype(np.float32)
        got, receipt = run_ggml_guarded(device, registry, GgmlType.Q4_0, blocks, x, 16, INT8)
        assert receipt.route != "int8_dot" and "int8dot" not in receipt.pipeline_label
        assert receipt.policy.dense_int8_dot


@needs_int8_dot
@pytest.mark.parametrize("m", [1, 2, 9])
def test_int8_dot_q8_0_takes_every_byte(device, registry, m):
    """Q8_0 weight bytes over the whole int8 range, -128 included (which the gguf quantiser never
    writes, but a file may hold): the products stay exact, so the bound holds."""
    rng = np.random.default_rng([m, 128])
    n, k = 19, 32 * 6
    raw = np.empty((n, k // 32, 34), np.uint8)
    raw[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[:, :, 2:] = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    raw[0, 0, 2:] = 0x80  # a block of -128 only
    blocks = raw.reshape(-1)
    weights = q8_0.dequantize(blocks).reshape(n, k).astype(np.float64)
    x = _activations(rng, m, k)
    got, _ = run_ggml_guarded(device, registry, GgmlType.Q8_0, blocks, x, n, INT8)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64) @ weights.T)
    assert np.all(err <= int8_dot_bound(weights, x))
