"""Every GGML block format routemm has a reference codec for, by name, and the generic
`quantize(array, ggml_type)` / `dequantize(blocks, ggml_type, shape=None)` over them.

The table is the core's (routemm/ggml_formats.h): q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k
and mxfp4. Every format's dequantiser is bit-identical to ggml's to_float (dequantize_row_*);
every format's quantiser is byte-identical to ggml's quantize_row_*_ref (no importance matrix;
bench/peer/ggml_quant_check.py compares them with ggml's own library). Arrays of any rank are
(de)quantised along their last axis.
`ggml_type` is a routemm.GgmlType member or its value ("q4_k").
"""

from __future__ import annotations

import numpy as np

from .. import _core
from ..core._errors import InvalidArgumentError
from ._ggml_blocks import BlockFormat

# name -> BlockFormat, in the core's table order.
FORMATS: dict[str, BlockFormat] = {
    name: BlockFormat(name, values, block_bytes, has_quantizer)
    for name, values, block_bytes, has_quantizer in _core.GGML_FORMATS
}


def block_format(ggml_type) -> BlockFormat:
    """The BlockFormat of a GgmlType member or its value; refuses any other type by name."""
    name = getattr(ggml_type, "value", ggml_type)
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise InvalidArgumentError(
            f"ggml_type must be one of {', '.join(FORMATS)} (a routemm.GgmlType or its value), got {ggml_type!r}"
        )
    return fmt


def quantize(array, ggml_type) -> np.ndarray:
    """Quantise float values (the last dimension a multiple of the format's block values) into
    uint8 blocks of shape (*shape[:-1], shape[-1] // block_values * block_bytes)."""
    return block_format(ggml_type).quantize(array)


def dequantize(blocks, ggml_type, shape=None) -> np.ndarray:
    """Dequantise uint8 blocks to float32 (exact). `shape` is the element shape; by default
    (*blocks.shape[:-1], blocks.shape[-1] // block_bytes * block_values)."""
    return block_format(ggml_type).dequantize(blocks, shape)
