"""Zero-copy interop with PyTorch, CuPy, NumPy and any DLPack / __cuda_array_interface__ producer.

`Buffer.from_dlpack(obj)` wraps the producer's memory without copying (the producer object stays
alive while the buffer does); `Buffer.__dlpack__` / `__dlpack_device__` let consumers such as
`torch.from_dlpack` wrap routemm buffers. Streams: routemm asks DLPack producers to order their
pending work before the legacy default stream (stream=1), which routemm's CUDA streams wait on, and
synchronises with a `__cuda_array_interface__` producer's declared stream.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from .. import _core
from ._core_api import dtype_of
from ._errors import InvalidArgumentError

_DL_CPU, _DL_CUDA = 1, 2


@functools.lru_cache(maxsize=None)
def _device_for_dlpack(device_type: int, device_id: int) -> _core.Device:
    name = {_DL_CPU: "cpu", _DL_CUDA: "cuda"}.get(device_type)
    if name is None:
        raise InvalidArgumentError(f"from_dlpack: DLPack device type {device_type} has no routemm backend")
    device = _core.Device(name)
    if tuple(_core._dlpack_device(device)) != (device_type, device_id):
        raise InvalidArgumentError(
            f"from_dlpack: tensor is on {name} device {device_id}, routemm uses {_core._dlpack_device(device)}"
        )
    return device


def from_dlpack(obj, device: Optional[_core.Device] = None) -> _core.Buffer:
    """Wrap `obj` (a DLPack or __cuda_array_interface__ producer, or a Buffer) without copying.

    The tensor must be C-contiguous; its dtype must be one of routemm's. `device` defaults to the
    device the tensor lives on. Read-only survives: the producer is asked for a DLPack 1.0 capsule,
    whose read-only flag makes a read-only buffer (refused as any op's output); a legacy capsule
    that routemm itself exported keeps the writability of the buffer it came from.
    """
    if isinstance(obj, _core.Buffer):
        return obj
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        device_type, device_id = (int(v) for v in obj.__dlpack_device__())
        if device is None:
            device = _device_for_dlpack(device_type, device_id)
        return _core._buffer_from_dlpack_capsule(device, _dlpack_capsule(obj, device_type))
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _from_cuda_array_interface(obj, cai, device)
    raise InvalidArgumentError(
        f"from_dlpack: {type(obj).__name__} implements neither __dlpack__ nor __cuda_array_interface__"
    )


def _dlpack_capsule(obj, device_type: int):
    """The producer's capsule: versioned (DLPack 1.0, it can say read-only) where the producer
    takes `max_version`, else legacy."""
    kwargs = {"stream": 1} if device_type == _DL_CUDA else {}
    try:
        return obj.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:
        pass  # a producer older than DLPack 1.0: no max_version keyword
    if isinstance(obj, np.ndarray) and not obj.flags.writeable:
        # A legacy capsule cannot carry read-only; NumPy refuses to export one for this array.
        raise InvalidArgumentError("from_dlpack: read-only NumPy arrays cannot be shared; pass a copy")
    return obj.__dlpack__(**kwargs)


def _from_cuda_array_interface(obj, cai: dict, device) -> _core.Buffer:
    device = device or _device_for_dlpack(_DL_CUDA, 0)
    shape = tuple(int(d) for d in cai["shape"])
    dtype = dtype_of(np.dtype(cai["typestr"]) if cai["typestr"] != "<V2" else "V2")
    strides = cai.get("strides")
    if strides is not None:
        expected, item = [], dtype.size
        for d in reversed(shape):
            expected.append(item)
            item *= d
        if tuple(strides) != tuple(reversed(expected)) and int(np.prod(shape)) > 1:
            raise InvalidArgumentError(
                "from_dlpack: tensor is not contiguous; pass a contiguous copy (cupy.ascontiguousarray(a))"
            )
    pointer, read_only = cai["data"]
    stream = cai.get("stream")
    if stream:
        _core._wait_for_external_stream(device, int(stream))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size if shape else dtype.size
    return _core._buffer_from_pointer(device, int(pointer), nbytes, dtype, list(shape) or [1], not read_only, obj)


def _buffer_dlpack(self: _core.Buffer, *, stream=None, max_version=None, dl_device=None, copy=None):
    """DLPack export of this buffer's logical view, zero-copy.

    A consumer that passes `max_version` with major version 1 or more gets a DLPack 1.0 versioned
    capsule, flagged read-only when this buffer is not writable; otherwise a legacy capsule, which
    cannot carry that flag (routemm's own `from_dlpack` still recognises its read-only buffers).
    """
    if copy:
        raise BufferError("routemm buffers export without copying")
    if dl_device is not None and tuple(dl_device) != tuple(_core._dlpack_device(self.device)):
        raise BufferError("routemm buffers export only on their own device")
    versioned = max_version is not None and int(max_version[0]) >= 1
    return _core._buffer_to_dlpack_capsule(self, versioned)


def _buffer_dlpack_device(self: _core.Buffer):
    return tuple(_core._dlpack_device(self.device))


_core.Buffer.__dlpack__ = _buffer_dlpack
_core.Buffer.__dlpack_device__ = _buffer_dlpack_device
_core.Buffer.from_dlpack = staticmethod(from_dlpack)
