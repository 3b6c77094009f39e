"""Q8_0 block format: routemm.q8_0.quantize is byte-identical to the independent `gguf` reference
(random, constant, all-zero, extreme, tie and subnormal rows, N-dimensional arrays),
dequantize matches gguf's and is exact, and both formats quantise along the last axis."""

from __future__ import annotations

import numpy as np
import pytest
import routemm
from routemm import q4_0, q8_0

gguf = pytest.importorskip("gguf")
Q8 = gguf.GGMLQuantizationType.Q8_0


def _gguf_quantize(values: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf's own 1/d overflows on subnormal scales
        return gguf.quants.quantize(values, Q8)


def _assert_same_bytes(values: np.ndarray) -> None:
    values = np.asarray(values, dtype=np.float32)
    ours = q8_0.quantize(values)
    theirs = _gguf_quantize(values)
    assert ours.dtype == np.uint8 and ours.shape == theirs.shape
    if not np.array_equal(ours, theirs):
        bad = np.argwhere(ours != theirs)[0].tolist()
        pytest.fail(f"first differing byte at {bad}: ours {ours[tuple(bad)]}, gguf {theirs[tuple(bad)]}")


@pytest.mark.parametrize("shape", [(32,), (1, 32), (4, 64), (3, 800), (7, 5, 96), (2, 4096), (3, 2, 4, 64)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e4, 60000.0, 1e6])
def test_random_rows_byte_identical(rng, shape, scale):
    _assert_same_bytes(rng.standard_normal(shape).astype(np.float32) * np.float32(scale))


def test_many_random_rows_byte_identical(rng):
    # 32k blocks of mixed distributions and scales, including heavy tails.
    rows = [
        rng.standard_normal((256, 32 * 32)),
        rng.uniform(-1, 1, (256, 32 * 32)),
        rng.standard_cauchy((256, 32 * 32)),
        rng.laplace(size=(256, 32 * 32)) * 1e-5,
    ]
    _assert_same_bytes(np.concatenate(rows).astype(np.float32))


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, -1.0, 0.1, -7.25, 65504.0, -3e38, 1e-30, 1e-38, 1e-44])
def test_constant_and_zero_rows(value):
    _assert_same_bytes(np.full((3, 64), value, np.float32))


def test_all_zero_rows_give_zero_scale_and_zero_quants():
    for value in (0.0, -0.0):
        blocks = q8_0.quantize(np.full((2, 64), value, np.float32)).reshape(-1, 34)
        assert np.all(blocks == 0)


def _row(*values) -> np.ndarray:
    row = np.zeros(32, np.float32)
    row[: len(values)] = values
    return row


def test_extreme_tie_and_subnormal_rows():
    f32 = np.finfo(np.float32)
    rows = [
        _row(f32.max, -f32.max, 1.0),  # the scale overflows f16 to +inf
        _row(-f32.max, f32.max),
        _row(127.0, 0.5, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5),  # d = 1: exact halves round away from 0
        _row(-127.0, 63.5, -63.5, 0.49999997),
        _row(127 * 65504.0, 1.0),
        _row(127 * 65520.0, 3.0),  # f16 overflow edge
        _row(127 * 2.0**-20, 2.0**-21),  # f16 subnormal scale
        _row(127 * 2.0**-25, 1e-9),  # scale below half the smallest f16 subnormal
        _row(1e-40, -5e-41, 3e-41),  # f32 subnormal maximum: 1/d overflows
        _row(f32.tiny, -f32.tiny / 2),
        _row(f32.tiny * 100, -f32.tiny * 3),
        _row(2e-37, -1e-37, 7e-38),  # 1/d close to the f32 limit
        np.linspace(-1, 1, 32, dtype=np.float32),
        np.arange(32, dtype=np.float32) - 16,
    ]
    _assert_same_bytes(np.stack(rows))


def test_random_subnormal_and_tiny_rows_byte_identical(rng):
    tiny = np.finfo(np.float32).tiny
    for scale in (tiny * 1e-3, tiny * 0.5, tiny * 4, tiny * 300):
        _assert_same_bytes((rng.standard_normal((64, 64)) * scale).astype(np.float32))


def test_dequantize_matches_gguf_and_is_exact(rng):
    values = (rng.standard_normal((16, 320)) * 3).astype(np.float32)
    blocks = q8_0.quantize(values)
    ours = q8_0.dequantize(blocks, values.shape)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, Q8))
    raw = blocks.reshape(-1, 34)
    d = raw[:, :2].copy().view(np.float16).astype(np.float64)
    q = raw[:, 2:].copy().view(np.int8).astype(np.float64)
    np.testing.assert_array_equal(ours.reshape(-1, 32).astype(np.float64), d * q)


def test_round_trip(rng):
    values = rng.uniform(-2, 2, (8, 128)).astype(np.float32)
    blocks = q8_0.quantize(values)
    restored = q8_0.dequantize(blocks)
    assert restored.shape == values.shape and restored.dtype == np.float32
    # Each value is within half a step |d| of the original (plus the f16 rounding of d).
    d = np.abs(blocks.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float32))
    err = np.abs(restored - values).reshape(-1, 32)
    assert np.all(err <= d * 0.5 + np.abs(values).reshape(-1, 32) * 2e-3)


@pytest.mark.parametrize("fmt,block_bytes", [(q4_0, 18), (q8_0, 34)])
def test_expert_stacks_quantise_along_the_last_axis(rng, fmt, block_bytes):
    stack = rng.standard_normal((5, 7, 96)).astype(np.float32)
    blocks = fmt.quantize(stack)
    assert blocks.shape == (5, 7, 96 // 32 * block_bytes) and blocks.dtype == np.uint8
    for e in range(5):
        np.testing.assert_array_equal(blocks[e], fmt.quantize(stack[e]))
    assert fmt.quantized_shape(stack.shape) == blocks.shape
    restored = fmt.dequantize(blocks)
    assert restored.shape == stack.shape
    np.testing.assert_array_equal(restored[3], fmt.dequantize(blocks[3]))
    # A non-contiguous view quantises its values, not its memory.
    view = stack[:, ::2, :]
    np.testing.assert_array_equal(fmt.quantize(view), fmt.quantize(np.ascontiguousarray(view)))


def test_shape_errors():
    with pytest.raises(routemm.InvalidArgumentError, match="multiple of 32"):
        q8_0.quantize(np.zeros((2, 33), np.float32))
    with pytest.raises(routemm.InvalidArgumentError, match="needs 68 bytes"):
        q8_0.dequantize(np.zeros(34, np.uint8), (64,))
    with pytest.raises(routemm.InvalidArgumentError, match="uint8"):
        q8_0.dequantize(np.zeros(34, np.int8))
    with pytest.raises(routemm.InvalidArgumentError, match="multiple of 34 bytes"):
        q8_0.dequantize(np.zeros((2, 35), np.uint8))
