"""Shared shape handling of the GGML block formats: N-dimensional arrays are quantised along their
last axis, [..., k] float -> [..., k // block_values * block_bytes] uint8, through the core's one
table of reference codecs (routemm/ggml_formats.h: _core._ggml_quantize / _ggml_dequantize)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import _core
from ..core._core_api import check_shape
from ..core._errors import InvalidArgumentError


class BlockFormat:
    """One block format: its name, values and bytes per block and the core's codec for it."""

    def __init__(self, name: str, block_values: int, block_bytes: int, has_quantizer: bool = True):
        self.name = name
        self.block_values = block_values
        self.block_bytes = block_bytes
        self.has_quantizer = has_quantizer

    def _quantize(self, flat: np.ndarray) -> np.ndarray:
        if not self.has_quantizer:
            raise InvalidArgumentError(f"{self.name} quantize: routemm has no reference quantiser for this format yet")
        return _core._ggml_quantize(self.name, flat)

    def _dequantize(self, flat: np.ndarray) -> np.ndarray:
        return _core._ggml_dequantize(self.name, flat)

    def quantized_shape(self, shape, where: str = "") -> tuple[int, ...]:
        """The byte shape of element `shape` (a list or tuple of non-negative integers: no
        coercion, so 32.5 is refused rather than read as 32)."""
        shape = check_shape(where or f"{self.name} quantized_shape", shape)
        if not shape or shape[-1] % self.block_values != 0:
            raise InvalidArgumentError(
                f"{self.name}: the last dimension must be a multiple of {self.block_values}, got shape {shape}"
            )
        return (*shape[:-1], shape[-1] // self.block_values * self.block_bytes)

    def _real_float32(self, array) -> np.ndarray:
        """`array` as float32, refusing what has no real value to quantise: complex numbers (their
        imaginary part would be dropped silently), bools, strings, objects and date-times."""
        data = np.asarray(array)
        if data.dtype.kind in "cbOUSVMm" and data.dtype != np.dtype(ml_dtypes.bfloat16):
            raise InvalidArgumentError(f"{self.name} quantize: values must be real numbers, got {data.dtype}")
        return data.astype(np.float32, copy=False)

    def quantize(self, array) -> np.ndarray:
        values = self._real_float32(array)
        out_shape = self.quantized_shape(values.shape)
        flat = np.ascontiguousarray(values).reshape(-1)
        return self._quantize(flat).reshape(out_shape)

    def dequantize(self, blocks, shape=None) -> np.ndarray:
        data = np.asarray(blocks)
        if data.dtype != np.uint8:
            raise InvalidArgumentError(f"{self.name} dequantize: blocks must be uint8, got {data.dtype}")
        if shape is None:
            if data.ndim == 0 or data.shape[-1] % self.block_bytes != 0:
                raise InvalidArgumentError(
                    f"{self.name} dequantize: the last dimension must be a multiple of {self.block_bytes} bytes, "
                    f"got shape {data.shape}"
                )
            shape = (*data.shape[:-1], data.shape[-1] // self.block_bytes * self.block_values)
        # Checked and multiplied as Python integers: an extent of 2^64 is a refusal, not an overflow.
        expected = math.prod(self.quantized_shape(shape, f"{self.name} dequantize"))
        if data.size != expected:
            raise InvalidArgumentError(f"{self.name} dequantize: shape {shape} needs {expected} bytes, got {data.size}")
        return self._dequantize(np.ascontiguousarray(data).reshape(-1)).reshape(shape)
