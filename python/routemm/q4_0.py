"""GGML Q4_0 blocks: the reference quantiser and dequantiser (byte-identical to ggml and `gguf`).

A row of values (a multiple of 32) becomes a row of 18-byte blocks: a little-endian float16
scale d, then 16 bytes whose low nibble is value j and whose high nibble is value j + 16; each
value is d * (nibble - 8). Both directions run in the C++ core (routemm/q4_0.h states the exact
rounding contract).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import _core
from ._errors import InvalidArgumentError

BLOCK_VALUES = 32
BLOCK_BYTES = 18


def quantized_shape(shape) -> tuple[int, ...]:
    """Byte shape of a quantised array: (*shape[:-1], shape[-1] // 32 * 18)."""
    shape = tuple(int(d) for d in shape)
    if not shape or shape[-1] % BLOCK_VALUES != 0:
        raise InvalidArgumentError(f"q4_0: the last dimension must be a multiple of {BLOCK_VALUES}, got shape {shape}")
    return (*shape[:-1], shape[-1] // BLOCK_VALUES * BLOCK_BYTES)


def _real_float32(array) -> np.ndarray:
    """`array` as float32, refusing what has no real value to quantise: complex numbers (their
    imaginary part would be dropped silently), bools, strings, objects and date-times."""
    data = np.asarray(array)
    if data.dtype.kind in "cbOUSVMm" and data.dtype != np.dtype(ml_dtypes.bfloat16):
        raise InvalidArgumentError(f"q4_0 quantize: values must be real numbers, got {data.dtype}")
    return data.astype(np.float32, copy=False)


def quantize(array) -> np.ndarray:
    """Quantise a float array whose last dimension is a multiple of 32 (cast to float32).

    Returns uint8 of shape (*shape[:-1], shape[-1] // 32 * 18), byte-identical to
    `gguf.quants.quantize(array, GGMLQuantizationType.Q4_0)`.
    """
    values = _real_float32(array)
    out_shape = quantized_shape(values.shape)
    flat = np.ascontiguousarray(values).reshape(-1)
    return _core._q4_0_quantize(flat).reshape(out_shape)


def dequantize(blocks, shape=None) -> np.ndarray:
    """Dequantise Q4_0 bytes to float32 (exact). `shape` is the element shape; by default it is
    (*blocks.shape[:-1], blocks.shape[-1] // 18 * 32)."""
    data = np.asarray(blocks)
    if data.dtype != np.uint8:
        raise InvalidArgumentError(f"q4_0 dequantize: blocks must be uint8, got {data.dtype}")
    if shape is None:
        if data.ndim == 0 or data.shape[-1] % BLOCK_BYTES != 0:
            raise InvalidArgumentError(
                f"q4_0 dequantize: the last dimension must be a multiple of {BLOCK_BYTES} bytes, got shape {data.shape}"
            )
        shape = (*data.shape[:-1], data.shape[-1] // BLOCK_BYTES * BLOCK_VALUES)
    shape = tuple(int(d) for d in shape)
    expected = int(np.prod(quantized_shape(shape), dtype=np.int64))
    if data.size != expected:
        raise InvalidArgumentError(f"q4_0 dequantize: shape {shape} needs {expected} bytes, got {data.size}")
    return _core._q4_0_dequantize(np.ascontiguousarray(data).reshape(-1)).reshape(shape)
