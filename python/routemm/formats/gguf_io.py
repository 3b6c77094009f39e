"""Load one tensor of a GGUF file into a routemm buffer, without a float round trip.

GGUF (version 2 and 3, little endian): a header, key/value metadata, tensor infos (name, dims
innermost first, GGML type, offset), then the tensor data section aligned to `general.alignment`
(default 32). Supported tensor types: the GGML block formats of formats/ggml.py's table (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4: U8 buffers of the raw blocks, shaped [*outer,
inner / block_values * block_bytes], e.g. inner / 32 * 18 for Q4_0), F32, F16 and BF16 (buffers
of that dtype, row-major shape). On the CPU
backend the buffer is a read-only view of a memory map of the file (zero copy; the map lives as
long as the buffer); other backends, and `copy=True`, get a copy of the bytes.

The zero-copy map reads the file itself for as long as the buffer lives: if the file is truncated
or replaced in place meanwhile, touching the missing pages raises SIGBUS and ends the process
(an operating-system property of memory maps, not something a library can catch). Callers that
cannot guarantee the file stays as it is pass `copy=True`, which reads the tensor with ordinary
file reads into a buffer of its own.

A malformed file is an InvalidArgumentError naming the problem: a bad magic or version, truncation,
names that are not UTF-8, a metadata key or tensor name given twice (ggml and the `gguf` package
refuse these too), a `general.alignment` that is not a uint32 power of two and a multiple of 8
(ggml and the `gguf` package want a uint32 power of two, the GGUF spec a multiple of 8), a tensor
data offset that is not a multiple of the alignment, more dimensions than GGML has, a shape whose
dimensions or sizes pass 2^63 - 1 (each dimension, and the product in values and in bytes with
zero dimensions counted as one: a zero-size tensor too), extents beyond the file, metadata arrays
nested deeper than MAX_ARRAY_NESTING. The header is parsed with ordinary reads (no map).

This reader is self-contained (no `gguf` package needed at run time); the tests check it against
files written by gguf.GGUFWriter.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Optional

import numpy as np

from .. import _core
from ..core._core_api import DType, check_type
from ..core._devices import _default_device
from ..core._errors import InvalidArgumentError, InvalidArgumentTypeError
from .ggml import FORMATS

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
MAX_ARRAY_NESTING = 8  # metadata arrays of arrays deeper than this are refused

# GGML tensor type ids (ggml.h) this loader understands: id -> (name, routemm dtype, values per
# block, bytes per block).
# GGML type ids of the block formats routemm has codecs for (formats/ggml.py's table gives their
# geometry, so a format is added in one place).
_BLOCK_TYPE_IDS = {
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "q4_k": 12,
    "q5_k": 13,
    "q6_k": 14,
    "mxfp4": 39,
}
_TENSOR_TYPES = {
    0: ("f32", DType.F32, 1, 4),
    1: ("f16", DType.F16, 1, 2),
    30: ("bf16", DType.BF16, 1, 2),
    **{
        _BLOCK_TYPE_IDS[name]: (name, DType.U8, f.block_values, f.block_bytes)
        for name, f in FORMATS.items()
        if name in _BLOCK_TYPE_IDS
    },
}
_SUPPORTED_NAMES = ", ".join(entry[0] for entry in sorted(_TENSOR_TYPES.values()))

# GGUF metadata value types: id -> struct format of a scalar (strings and arrays are special).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_VALUE_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
    8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}  # fmt: skip


class _Cursor:
    """Sequential reads of a file of known size; every read past the end is a truncation error."""

    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.pos, self.path = f, size, 0, path

    def fail(self, message: str):
        raise InvalidArgumentError(f"gguf_tensor: {self.path} {message}")

    def take(self, n: int) -> bytes:
        if n > self.size - self.pos:
            self.fail("is truncated")
        data = self.f.read(n)
        if len(data) != n:
            self.fail("is truncated")
        self.pos += n
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"has a string that is not UTF-8 at byte {self.pos - len(raw)}")

    def value(self, type_id: int, depth: int = 0):
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                self.fail(f"nests metadata arrays deeper than {MAX_ARRAY_NESTING}")
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            return [self.value(item_type, depth + 1) for _ in range(count)]
        self.fail(f"has unknown metadata type {type_id}")


def _read_index(f, size: int, path: str):
    """(tensor infos by name, absolute offset of the data section, metadata by key)."""
    cur = _Cursor(f, size, path)
    if cur.take(4) != _MAGIC:
        cur.fail("is not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        cur.fail(f"has unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    alignment = _DEFAULT_ALIGNMENT
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:  # ambiguous: which value a reader takes would be its own choice
            cur.fail(f"has metadata key {key!r} twice")
        type_id = cur.unpack("<I")
        value = cur.value(type_id)
        metadata[key] = value
        if key == "general.alignment":
            # Powers of two keep the padding arithmetic exact; a multiple of 8 (the spec's rule)
            # puts every tensor of a mapped file at an address each buffer dtype can use.
            if type_id != _UINT32 or value == 0 or value & (value - 1) or value % 8:
                kind = _VALUE_TYPE_NAMES.get(type_id, f"type {type_id}")
                cur.fail(
                    f"has general.alignment {value!r} ({kind}); it must be a positive integer, a power of "
                    "two and a multiple of 8, stored as uint32"
                )
            alignment = value
    infos = {}
    for _ in range(n_tensors):
        name = cur.string()
        if name in infos:
            cur.fail(f"has two tensors named {name!r}")
        n_dims = cur.unpack("<I")
        if n_dims > GGML_MAX_DIMS:
            cur.fail(f"gives tensor {name!r} {n_dims} dimensions; GGML has at most {GGML_MAX_DIMS}")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        type_id, offset = cur.unpack("<I"), cur.unpack("<Q")
        if offset % alignment:
            cur.fail(f"is malformed: tensor {name!r} is at data offset {offset}, not a multiple of {alignment}")
        infos[name] = (dims, type_id, offset)
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    return infos, data_start, metadata


def _fspath(path, op: str):
    """`path` as os.fspath gives it; anything but a str, bytes or os.PathLike is refused for `op`
    (check_type's refusal, for a kind that is a union)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise InvalidArgumentTypeError(f"{op}: path must be a str, bytes or os.PathLike, not {type(path).__name__}")
    return os.fspath(path)


def _index_of(path, op: str = "gguf_tensor") -> tuple:
    """_read_index of the file at `path`, with a read failure an InvalidArgumentError."""
    path = _fspath(path, op)
    try:
        with open(path, "rb") as f:
            return _read_index(f, os.fstat(f.fileno()).st_size, path)
    except OSError as e:
        raise InvalidArgumentError(f"{op}: cannot read {path}: {e}") from None


def gguf_metadata(path) -> dict:
    """The key/value metadata of the GGUF file at `path` (arrays as lists)."""
    return _index_of(path, "gguf_metadata")[2]


def _type_name(path, infos: dict, name: str) -> str:
    if name not in infos:
        raise InvalidArgumentError(f"gguf_tensor: {os.fspath(path)} has no tensor {name!r}")
    type_id = infos[name][1]
    return _TENSOR_TYPES[type_id][0] if type_id in _TENSOR_TYPES else f"ggml_type_{type_id}"


def gguf_tensor_type(path, name: str) -> str:
    """The GGML type name ("q4_0", "f32", ...; "ggml_type_<id>" for others) of tensor `name`."""
    check_type("gguf_tensor_type:", "name", name, str)
    return _type_name(path, _index_of(path, "gguf_tensor_type")[0], name)


def _gguf_index(path, op: str = "gguf_tensor") -> tuple[dict, dict]:
    """(metadata, {tensor name: (type name, shape in values, outermost first)}) of the GGUF file
    at `path`, from one read of its header."""
    infos, _, metadata = _index_of(path, op)
    index = {}
    for name, (dims, _type_id, _offset) in infos.items():
        index[name] = (_type_name(path, infos, name), [int(d) for d in reversed(dims)])
    return metadata, index


def _moe_layer_indices(metadata: dict, names) -> list[int]:
    """The layers N (within `<arch>.block_count` where the file has it) that have a MoE router
    `blk.N.ffn_gate_inp.weight`, in order."""
    found = []
    for name in names:
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2:] == ["ffn_gate_inp", "weight"]:
            found.append(int(parts[1]))
    count = metadata.get(f"{metadata.get('general.architecture')}.block_count")
    if isinstance(count, int) and not isinstance(count, bool):
        found = [n for n in found if n < count]
    return sorted(found)


def gguf_moe_layers(path) -> list[int]:
    """The MoE layers of the GGUF file at `path` (those with a router `blk.N.ffn_gate_inp.weight`,
    llama.cpp's name), in order: what MoeLayer.from_gguf loads."""
    metadata, index = _gguf_index(path, "gguf_moe_layers")
    return _moe_layer_indices(metadata, index)


def _gguf_header(path, names) -> tuple[dict, dict]:
    """(metadata, {name: type name}) of the GGUF file at `path`, from one read of its header."""
    infos, _, metadata = _index_of(path)
    return metadata, {name: _type_name(path, infos, name) for name in names}


I64_MAX = 2**63 - 1


def _extent(path: str, name: str, infos: dict, data_start: int, file_size: int):
    """(dtype, shape, absolute start, nbytes) of tensor `name`, checked against the file."""
    if name not in infos:
        raise InvalidArgumentError(f"gguf_tensor: {path} has no tensor {name!r}")
    dims, type_id, offset = infos[name]
    if type_id not in _TENSOR_TYPES:
        raise InvalidArgumentError(
            f"gguf_tensor: tensor {name!r} has GGML type {type_id}; supported: {_SUPPORTED_NAMES}"
        )
    type_name, dtype, block_values, block_bytes = _TENSOR_TYPES[type_id]
    shape = [int(d) for d in reversed(dims)] or [1]
    if shape[-1] % block_values != 0:
        raise InvalidArgumentError(
            f"gguf_tensor: {type_name} tensor {name!r} has inner dimension {shape[-1]}, not a "
            f"multiple of {block_values}"
        )
    shape[-1] = shape[-1] // block_values * block_bytes // dtype.size
    # Sizes are signed 64-bit in GGML, NumPy and the buffers. Zero dimensions count as one, so a
    # zero-size tensor's other dimensions are bounded too (its .numpy() would fail otherwise).
    values = math.prod(d or 1 for d in dims)
    span = math.prod(d or 1 for d in shape) * dtype.size
    if any(d > I64_MAX for d in dims) or values > I64_MAX or span > I64_MAX:
        raise InvalidArgumentError(
            f"gguf_tensor: tensor {name!r} has dimensions {dims} beyond 2^63 - 1 (each dimension, and their "
            "product in values and in bytes, zero dimensions counted as one)"
        )
    nbytes = math.prod(shape) * dtype.size  # Python integers: no overflow before the check below
    start = data_start + offset
    if start + nbytes > file_size:
        raise InvalidArgumentError(f"gguf_tensor: tensor {name!r} extends past the end of {path}")
    return dtype, shape, start, nbytes


def gguf_tensor(path, name: str, device: Optional[_core.Device] = None, *, copy: bool = False) -> _core.Buffer:
    """The tensor `name` of the GGUF file at `path` as a buffer on `device` (default: the best
    available backend). A block format -> U8 blocks [*outer, inner / block_values * block_bytes]
    (routemm.dequantize(blocks.numpy(), type) gives the values); F32/F16/BF16 -> that dtype.

    On a host-accessible device the buffer maps the file (zero copy, read-only) unless `copy` is
    true; a mapped file must not be truncated while the buffer lives (see the module docstring).
    With `copy=True` the tensor is read into a buffer of its own and the file may change later."""
    check_type("gguf_tensor:", "name", name, str)
    return _gguf_tensors(path, [name], device, copy=copy)[name]


def _gguf_tensors(path, names, device: Optional[_core.Device] = None, *, copy: bool = False) -> dict:
    """{name: gguf_tensor(path, name, device, copy=copy)} for `names`, reading the header once."""
    path = _fspath(path, "gguf_tensor")
    if device is None:
        device = _default_device()
    check_type("gguf_tensor:", "device", device, _core.Device, optional=True)
    check_type("gguf_tensor:", "copy", copy, bool)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            infos, data_start, _ = _read_index(f, size, path)  # once for every name
            return {name: _load(f, size, path, name, infos, data_start, device, copy) for name in names}
    except OSError as e:
        raise InvalidArgumentError(f"gguf_tensor: cannot read {path}: {e}") from None


def _load(f, size: int, path: str, name: str, infos: dict, data_start: int, device, copy: bool) -> _core.Buffer:
    """Tensor `name` of the open file `f`, mapped (zero copy) or read into a buffer of its own."""
    dtype, shape, start, nbytes = _extent(path, name, infos, data_start, size)
    if nbytes == 0:
        return device.alloc(0, dtype, shape)
    if not copy and device.host_accessible:
        mapped = np.memmap(f, dtype=np.uint8, mode="r", offset=start, shape=(nbytes,))
        if mapped.ctypes.data % dtype.size == 0:
            # Zero copy: the memory map is the buffer's owner and is closed with it.
            return _core._buffer_from_pointer(
                device, mapped.ctypes.data, nbytes, dtype, shape, False, mapped, file_backed=True
            )
    f.seek(start)
    data = np.empty(nbytes, np.uint8)
    if f.readinto(data) != nbytes:
        raise InvalidArgumentError(f"gguf_tensor: {path} was truncated while it was read")
    buffer = device.alloc(nbytes, dtype, shape)
    buffer._write_bytes(data)
    return buffer
