"""Q4_0 block format: routemm.q4_0.quantize is byte-identical to the independent `gguf` reference
(random, constant, all-zero, extreme and tie rows, many shapes), dequantize matches gguf's and is
exact, and the round trip is stable."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import q4_0

# The Q4_0 pipelines exist on the CPU backend; other backends gain them later.
pytestmark = pytest.mark.needs_kernels(*routemm.Q4_MATMUL_PIPELINE_NAMES)

gguf = pytest.importorskip("gguf")
Q4 = gguf.GGMLQuantizationType.Q4_0


def _gguf_quantize(values: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's own 1/d overflows on subnormal scales
        return gguf.quants.quantize(values, Q4)


def _assert_same_bytes(values: np.ndarray) -> None:
    values = np.asarray(values, dtype=np.float32)
    ours = q4_0.quantize(values)
    theirs = _gguf_quantize(values)
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    if not np.array_equal(ours, theirs):
        bad = np.argwhere(ours != theirs)[0].tolist()
        pytest.fail(f"first differing byte at {bad}: ours {ours[tuple(bad)]}, gguf {theirs[tuple(bad)]}")


@pytest.mark.parametrize("shape", [(32,), (1, 32), (4, 64), (3, 800), (7, 5, 96), (2, 4096)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4, 60000.0])
def test_random_rows_byte_identical(rng, shape, scale):
    _assert_same_bytes(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))


def test_many_random_rows_byte_identical(rng):
    # 20k blocks of mixed distributions and scales, including heavy tails.
    rows = [
        rng.standard_normal((256, 32 * 8)),
        rng.uniform(-1, 1, (256, 32 * 8)),
        rng.standard_cauchy((256, 32 * 8)),
        rng.laplace(size=(256, 32 * 8)) * 1e-5,
    ]
    _assert_same_bytes(np.concatenate(rows).astype(np.float32))


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -1.0, 0.1, -7.25, 65504.0, -3e38, 1e-30])
def test_constant_and_zero_rows(value):
    _assert_same_bytes(np.full((3, 64), value, np.float32))


def test_all_zero_rows_give_zero_scale_and_nibble_8():
    # +0 / -8 is -0.0 (f16 0x8000), -0 / -8 is +0.0; every nibble is 8 either way.
    for value, scale in ((0.0, [0x00, 0x80]), (-0.0, [0x00, 0x00])):
        blocks = q4_0.quantize(np.full((2, 64), value, np.float32)).reshape(-1, 18)
        assert np.all(blocks[:, :2] == scale)
        assert np.all(blocks[:, 2:] == 0x88)


def _row(*values) -> np.ndarray:
    row = np.zeros(32, np.float32)
    row[: len(values)] = values
    return row


def test_extreme_and_tie_rows():
    f32 = np.finfo(np.float32)
    rows = [
        _row(f32.max, -f32.max, 1.0),  # scale overflows f16 to -inf
        _row(-f32.max, f32.max),  # magnitude tie: the first wins
        _row(3.0, -3.0, 1.5),
        _row(-3.0, 3.0, 1.5),
        _row(-8.0, 0.5, -0.5, 1.5, 2.5, 7.5, -7.5, 3.5),  # d = 1: every x + 8.5 is an exact tie point
        _row(8.0, 0.5, -0.5, 1.5, 2.5, 7.5, -7.5, 3.5),
        _row(-8 * 65504.0, 1.0),
        _row(-8 * 65519.0, 2.0),
        _row(-8 * 65520.0, 3.0),  # f16 overflow edge
        _row(-8 * 2.0**-20, 2.0**-21),  # f16 subnormal scale
        _row(-8 * 2.0**-25, 1e-9),  # scale below half the smallest f16 subnormal
        _row(1e-40, -5e-41, 3e-41),  # f32 subnormal maximum: 1/d overflows
        _row(f32.tiny, -f32.tiny / 2),
        np.linspace(-1, 1, 32, dtype=np.float32),
        np.arange(32, dtype=np.float32) - 16,
    ]
    _assert_same_bytes(np.stack(rows))


def test_dequantize_matches_gguf_and_is_exact(rng):
    values = (rng.standard_normal((16, 320)) * 3).astype(np.float32)
    blocks = q4_0.quantize(values)
    ours = q4_0.dequantize(blocks, values.shape)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, Q4))
    # Exact by construction: d * (q - 8) in float64 gives the same numbers.
    raw = blocks.reshape(-1, 18)
    d = raw[:, :2].copy().view(np.float16).astype(np.float64)
    q = np.concatenate([raw[:, 2:] & 0x0F, raw[:, 2:] >> 4], axis=1).astype(np.float64) - 8
    np.testing.assert_array_equal(ours.reshape(-1, 32).astype(np.float64), d * q)


def test_round_trip(rng):
    values = rng.uniform(-2, 2, (8, 128)).astype(np.float32)
    blocks = q4_0.quantize(values)
    restored = q4_0.dequantize(blocks)
    assert restored.shape == values.shape and restored.dtype == np.float32
    # Each value is within one step |d| of the original (half a step, except where +8 clips to 7).
    d = np.abs(blocks.reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32))
    err = np.abs(restored - values).reshape(-1, 32)
    assert np.all(err <= d * 1.001)
    # Quantising the dequantised values reproduces the blocks (the scale's value is the max's).
    np.testing.assert_array_equal(q4_0.quantize(restored), blocks)


def test_shape_errors():
    with pytest.raises(routemm.InvalidArgumentError, match="multiple of 32"):
        q4_0.quantize(np.zeros((2, 33), np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match="needs 36 bytes"):
        q4_0.dequantize(np.zeros(18, np.uint8), (64,))
    with pytest.raises(routemm.InvalidArgumentError, match="uint8"):
        q4_0.dequantize(np.zeros(18, np.int8))


@pytest.mark.parametrize(
    "values",
    [
        np.ones(32, np.complex64),
        np.full(32, 1 + 2j),
        np.ones(32, bool),
        np.array(["1"] * 32),
        np.array([1.0] * 32, dtype=object),
    ],
    ids=["complex64", "complex128", "bool", "str", "object"],
)
def test_quantize_refuses_values_that_are_not_real_numbers(values):
    """A complex array would lose its imaginary part silently; the others have no real value."""
    with pytest.raises(routemm.InvalidArgumentError, match="values must be real numbers"):
        q4_0.quantize(values)


def test_quantize_accepts_real_dtypes(rng):
    row = rng.uniform(-1, 1, 32)
    want = q4_0.quantize(row.astype(np.float32))
    for dtype in (np.float64, np.float16, ml_dtypes.bfloat16):
        assert np.array_equal(
            q4_0.quantize(row.astype(np.float32).astype(dtype).astype(np.float32)), q4_0.quantize(row.astype(dtype))
        )
    assert np.array_equal(q4_0.quantize(row), want)
    assert q4_0.quantize(np.arange(32, dtype=np.int16)).shape == (18,)
