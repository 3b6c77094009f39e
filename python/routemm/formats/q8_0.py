"""GGML Q8_0 blocks: the reference quantiser and dequantiser (byte-identical to ggml and `gguf`).

A row of values (a multiple of 32) becomes a row of 34-byte blocks: a little-endian float16
scale d = max|x| / 127, then 32 signed bytes q = round(x / d) (half away from zero); each value
is d * q. Both directions run in the C++ core (routemm/q8_0.h states the exact rounding
contract). Arrays of any rank are quantised along their last axis:
[E, n, k] float -> [E, n, k // 32 * 34] uint8.
"""

from __future__ import annotations

import numpy as np

from ._ggml_blocks import BlockFormat

BLOCK_VALUES = 32
BLOCK_BYTES = 34
_FORMAT = BlockFormat("q8_0", BLOCK_VALUES, BLOCK_BYTES)


def quantized_shape(shape) -> tuple[int, ...]:
    """Byte shape of a quantised array: (*shape[:-1], shape[-1] // 32 * 34)."""
    return _FORMAT.quantized_shape(shape)


def quantize(array) -> np.ndarray:
    """Quantise a float array whose last dimension is a multiple of 32 (cast to float32).

    Returns uint8 of shape (*shape[:-1], shape[-1] // 32 * 34), byte-identical to
    `gguf.quants.quantize(array, GGMLQuantizationType.Q8_0)`.
    """
    return _FORMAT.quantize(array)


def dequantize(blocks, shape=None) -> np.ndarray:
    """Dequantise Q8_0 bytes to float32 (exact). `shape` is the element shape; by default it is
    (*blocks.shape[:-1], blocks.shape[-1] // 34 * 32)."""
    return _FORMAT.dequantize(blocks, shape)
