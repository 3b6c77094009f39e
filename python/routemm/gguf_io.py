"""Load one tensor of a GGUF file into a routemm buffer, without a float round trip.

GGUF (version 2 and 3, little endian): a header, key/value metadata, tensor infos (name, dims
innermost first, GGML type, offset), then the tensor data section aligned to `general.alignment`
(default 32). Supported tensor types: Q4_0 and Q8_0 (U8 buffers of the raw blocks, shaped
[*outer, inner / 32 * 18] and [*outer, inner / 32 * 34]), F32, F16 and BF16 (buffers of that dtype, row-major shape). On the CPU
backend the buffer is a read-only view of a memory map of the file (zero copy; the map lives as
long as the buffer); other backends get a copy of the bytes.

This reader is self-contained (no `gguf` package needed at run time); the tests check it against
files written by gguf.GGUFWriter.
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

from . import _core
from ._core_api import DType
from ._errors import InvalidArgumentError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGML tensor type ids (ggml.h) this loader understands: id -> (name, routemm dtype, values per
# block, bytes per block).
_TENSOR_TYPES = {
    0: ("f32", DType.F32, 1, 4),
    1: ("f16", DType.F16, 1, 2),
    2: ("q4_0", DType.U8, 32, 18),
    8: ("q8_0", DType.U8, 32, 34),
    30: ("bf16", DType.BF16, 1, 2),
}

# GGUF metadata value types: id -> struct format of a scalar (strings and arrays are special).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data: memoryview, path: str):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise InvalidArgumentError(f"gguf_tensor: {self.path} is truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8")

    def value(self, type_id: int):
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_type) for _ in range(count)]
        raise InvalidArgumentError(f"gguf_tensor: {self.path} has unknown metadata type {type_id}")


def _read_index(path: str):
    """(tensor infos by name, absolute offset of the data section, file size, metadata)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = np.memmap(f, dtype=np.uint8, mode="r", shape=(size,)) if size else np.zeros(0, np.uint8)
    cur = _Cursor(memoryview(raw), path)
    if bytes(cur.take(4)) != _MAGIC:
        raise InvalidArgumentError(f"gguf_tensor: {path} is not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise InvalidArgumentError(f"gguf_tensor: {path} has unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    infos = {}
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos[name] = (dims, cur.unpack("<I"), cur.unpack("<Q"))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    return infos, data_start, size, metadata


def gguf_metadata(path) -> dict:
    """The key/value metadata of the GGUF file at `path` (arrays as lists)."""
    path = os.fspath(path)
    return _read_index(path)[3]


def gguf_tensor_type(path, name: str) -> str:
    """The GGML type name ("q4_0", "f32", ...; "ggml_type_<id>" for others) of tensor `name`."""
    path = os.fspath(path)
    infos = _read_index(path)[0]
    if name not in infos:
        raise InvalidArgumentError(f"gguf_tensor: {path} has no tensor {name!r}")
    type_id = infos[name][1]
    return _TENSOR_TYPES[type_id][0] if type_id in _TENSOR_TYPES else f"ggml_type_{type_id}"


def gguf_tensor(path, name: str, device: Optional[_core.Device] = None) -> _core.Buffer:
    """The tensor `name` of the GGUF file at `path` as a buffer on `device` (default: the best
    available backend). Q4_0 -> U8 blocks [*outer, inner / 32 * 18]; F32/F16/BF16 -> that dtype."""
    path = os.fspath(path)
    infos, data_start, file_size, _ = _read_index(path)
    if name not in infos:
        raise InvalidArgumentError(f"gguf_tensor: {path} has no tensor {name!r}")
    dims, type_id, offset = infos[name]
    if type_id not in _TENSOR_TYPES:
        raise InvalidArgumentError(
            f"gguf_tensor: tensor {name!r} has GGML type {type_id}; supported: q4_0, q8_0, f32, f16, bf16"
        )
    type_name, dtype, block_values, block_bytes = _TENSOR_TYPES[type_id]
    shape = [int(d) for d in reversed(dims)] or [1]
    if shape[-1] % block_values != 0:
        raise InvalidArgumentError(
            f"gguf_tensor: {type_name} tensor {name!r} has inner dimension {shape[-1]}, not a "
            f"multiple of {block_values}"
        )
    shape[-1] = shape[-1] // block_values * block_bytes // dtype.size
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size
    start = data_start + offset
    if start + nbytes > file_size:
        raise InvalidArgumentError(f"gguf_tensor: tensor {name!r} extends past the end of {path}")

    if device is None:
        from .dense_matmul_id import _default_device

        device = _default_device()
    if nbytes == 0:
        return device.alloc(0, dtype, shape)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
    if device.host_accessible and mapped.ctypes.data % dtype.size == 0:
        # Zero copy: the memory map is the buffer's owner and is closed with it.
        return _core._buffer_from_pointer(device, mapped.ctypes.data, nbytes, dtype, shape, False, mapped)
    buffer = device.alloc(nbytes, dtype, shape)
    buffer._write_bytes(np.array(mapped))
    return buffer
