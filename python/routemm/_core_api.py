"""Python half of the core types: NumPy copies, dispatch receipts, capture nodes, identities.

The native classes (Device, Buffer, CommandEncoder, KernelRegistry) come from routemm._core; the
methods that shape Python values (NumPy arrays, dataclasses) are defined here and attached to them.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import ml_dtypes
import numpy as np

from . import _core
from ._errors import InvalidArgumentError
from ._json import JsonRecord
from ._record_checks import SchemaVersioned

DType = _core.DType
# str(DType.BF16) == "bf16", the name every message uses (set here: pybind11's enum __str__ wins
# over one defined in the binding).
DType.__str__ = lambda self: self.type_name

_NUMPY_TO_DTYPE = {
    np.dtype(np.float32): DType.F32,
    np.dtype(np.float16): DType.F16,
    np.dtype(ml_dtypes.bfloat16): DType.BF16,
    np.dtype(np.uint8): DType.U8,
    np.dtype(np.uint16): DType.U16,
    np.dtype(np.uint32): DType.U32,
    np.dtype(np.int32): DType.I32,
}
_DTYPE_TO_NUMPY = {v: k for k, v in _NUMPY_TO_DTYPE.items()}


def numpy_dtype(dtype: DType) -> np.dtype:
    """The NumPy dtype holding elements of `dtype` (bf16 through ml_dtypes)."""
    return _DTYPE_TO_NUMPY[dtype]


def dtype_of(array_dtype) -> DType:
    try:
        return _NUMPY_TO_DTYPE[np.dtype(array_dtype)]
    except KeyError:
        raise InvalidArgumentError(f"no routemm dtype for numpy dtype {np.dtype(array_dtype)}") from None


# ---- Device / Buffer ----------------------------------------------------------------------------


def _device_from_numpy(self: _core.Device, array, dtype: Optional[DType] = None) -> _core.Buffer:
    """Copy a NumPy array into a new buffer on this device.

    With `dtype`, the array's bytes are reinterpreted as that dtype (its itemsize must match), e.g.
    uint16 bit patterns as BF16; without it the dtype follows the array's.
    """
    array = np.asarray(array)
    if dtype is None:
        dtype = dtype_of(array.dtype)
    elif not isinstance(dtype, DType):
        raise InvalidArgumentError(f"from_numpy: dtype must be a routemm.DType, got {dtype!r}")
    elif array.dtype.itemsize != dtype.size:
        raise InvalidArgumentError(f"from_numpy: {array.dtype} elements cannot be read as {dtype.type_name}")
    data = np.ascontiguousarray(array)
    buffer = self.alloc(data.nbytes, dtype, list(data.shape) if data.ndim else [1])
    buffer._write_bytes(data.reshape(-1).view(np.uint8))
    return buffer


def _buffer_numpy(self: _core.Buffer) -> np.ndarray:
    """Copy this buffer's logical bytes to a new NumPy array of its dtype and shape."""
    return self._read_bytes().view(numpy_dtype(self.dtype)).reshape(self.shape)


def _buffer_copy_from_numpy(self: _core.Buffer, array) -> None:
    """Overwrite this buffer's logical bytes with `array` (same number of bytes)."""
    data = np.ascontiguousarray(array)
    self._write_bytes(data.reshape(-1).view(np.uint8))


_core.Device.from_numpy = _device_from_numpy
_core.Buffer.numpy = _buffer_numpy
_core.Buffer.copy_from_numpy = _buffer_copy_from_numpy


# ---- Dispatch receipts and capture --------------------------------------------------------------


class DispatchKind(enum.Enum):
    THREADS = "threads"
    THREAD_GROUPS = "thread_groups"


@dataclasses.dataclass(frozen=True)
class EncodedKernelDispatch(JsonRecord, SchemaVersioned):
    """One dispatch as it was encoded: pipeline label, dispatch call and geometry."""

    SCHEMA = "encoded_kernel_dispatch.schema.json"
    pipeline_label: str
    dispatch_kind: DispatchKind
    grid: tuple[int, int, int]
    threads_per_threadgroup: tuple[int, int, int]
    threadgroup_memory: tuple[tuple[int, int], ...]
    schema_version: int = 1

    @classmethod
    def _from_core(cls, d: dict) -> "EncodedKernelDispatch":
        return cls(
            pipeline_label=d["pipeline_label"],
            dispatch_kind=DispatchKind(d["dispatch_kind"]),
            grid=tuple(d["grid"]),
            threads_per_threadgroup=tuple(d["threads_per_threadgroup"]),
            threadgroup_memory=tuple(tuple(p) for p in d["threadgroup_memory"]),
        )


@dataclasses.dataclass(frozen=True)
class CapturedNode:
    """A captured dispatch (with its bindings and declared byte ranges) or barrier."""

    kind: str  # "dispatch" | "barrier"
    dispatch: Optional[EncodedKernelDispatch] = None
    bindings: tuple[dict, ...] = ()
    reads: tuple[tuple[int, int], ...] = ()
    writes: tuple[tuple[int, int], ...] = ()
    op_kind: str = "other"  # other, rms_norm, elem_mul, elem_add, sdpa, softmax

    @property
    def is_barrier(self) -> bool:
        return self.kind == "barrier"


def _nodes_from_core(nodes: list) -> list[CapturedNode]:
    out = []
    for n in nodes:
        if n["kind"] == "barrier":
            out.append(CapturedNode("barrier"))
        else:
            out.append(
                CapturedNode(
                    "dispatch",
                    EncodedKernelDispatch._from_core(n["dispatch"]),
                    tuple(n["bindings"]),
                    tuple(tuple(r) for r in n["reads"]),
                    tuple(tuple(r) for r in n["writes"]),
                    n["op_kind"],
                )
            )
    return out


def _take_capture(self: _core.CommandEncoder) -> Optional[list[CapturedNode]]:
    """End capture and return the recorded nodes (None when not capturing)."""
    nodes = self._take_capture()
    return None if nodes is None else _nodes_from_core(nodes)


def _take_encoded_dispatch_receipt(self: _core.CommandEncoder) -> list[EncodedKernelDispatch]:
    """Close the open dispatch receipt and return what it recorded."""
    return [EncodedKernelDispatch._from_core(d) for d in self._take_encoded_dispatch_receipt()]


def _encoder_dispatch(
    self, pipeline, args, grid, threads, *, dispatch_kind=DispatchKind.THREAD_GROUPS, threadgroup_memory=()
):
    """Encode one raw dispatch. args: [(slot, Buffer | bytes | (Buffer, offset))]."""
    self._dispatch(
        pipeline,
        list(args),
        tuple(grid),
        tuple(threads),
        DispatchKind(dispatch_kind) is DispatchKind.THREADS,
        list(threadgroup_memory),
    )


def _encoder_dispatch_tracked(
    self,
    pipeline,
    args,
    grid,
    threads,
    *,
    reads=(),
    writes=(),
    dispatch_kind=DispatchKind.THREAD_GROUPS,
    threadgroup_memory=(),
):
    """Encode one raw dispatch with the buffers it reads and writes (their logical ranges).

    While capturing they become the node's ranges; otherwise, with `auto_barrier` on, a barrier
    goes first when they conflict with the ranges tracked since the last barrier.
    """
    self._dispatch_tracked(
        pipeline,
        list(args),
        tuple(grid),
        tuple(threads),
        DispatchKind(dispatch_kind) is DispatchKind.THREADS,
        list(threadgroup_memory),
        list(reads),
        list(writes),
    )


_core.CommandEncoder.take_capture = _take_capture
_core.CommandEncoder.take_encoded_dispatch_receipt = _take_encoded_dispatch_receipt
_core.CommandEncoder.dispatch = _encoder_dispatch
_core.CommandEncoder.dispatch_tracked = _encoder_dispatch_tracked
_core.CapturedGraph.nodes = property(lambda self: _nodes_from_core(self._nodes), doc="The graph's nodes, in order.")


def stream_handle(stream) -> Optional[int]:
    """The CUDA stream handle (cudaStream_t as an integer) of `stream`: an int, a
    torch.cuda.Stream (its `cuda_stream`), a CuPy stream (its `ptr`), or None for none."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise InvalidArgumentError(f"stream must be a CUDA stream or its integer handle, got {stream!r}")
    handle = stream
    if not isinstance(handle, (int, np.integer)):
        handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream, torch.cuda.ExternalStream
        if handle is None:
            handle = getattr(stream, "ptr", None)  # cupy.cuda.Stream, cupy.cuda.ExternalStream
    if isinstance(handle, (int, np.integer)) and not isinstance(handle, bool) and 0 <= int(handle) < 2**64:
        return int(handle)
    raise InvalidArgumentError(
        f"stream must be an integer handle, a torch.cuda.Stream or a CuPy stream, got {type(stream).__name__}"
    )


def _device_command_encoder(self: _core.Device, stream=None, *, auto_barrier: Optional[bool] = None):
    """A command encoder on this device.

    stream: a caller's CUDA stream (integer cudaStream_t handle, torch.cuda.Stream or CuPy stream):
        the encoder enqueues there, creates no stream, and only wait_until_completed() waits on
        the host. None: the encoder's own queue. Backends without streams refuse one.
    auto_barrier: start with the automatic-barrier tracker on or off (default:
        ROUTEMM_ENCODER_AUTO_BARRIER).
    """
    if auto_barrier is not None and not isinstance(auto_barrier, bool):
        raise InvalidArgumentError(f"auto_barrier must be a bool or None, got {auto_barrier!r}")
    return self._command_encoder(stream_handle(stream), auto_barrier)


_core.Device.command_encoder = _device_command_encoder


# ---- Pipeline identities ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineIdentity(JsonRecord, SchemaVersioned):
    """Who a pipeline is: label, kernel, backend, where its code came from and a hash of it."""

    SCHEMA = "pipeline_identity.schema.json"
    pipeline_label: str
    kernel_name: str
    entry_point: str  # the backend kernel behind the name (differs when re-registered under it)
    backend: str
    origin: str
    content_sha256: str
    schema_version: int = 2


_IDENTITY_FIELDS = tuple(f.name for f in dataclasses.fields(PipelineIdentity))


def _identity_from_core(d: dict) -> PipelineIdentity:
    # The core's dict has exactly these flat string/int fields: built directly, not through the
    # generic JSON decoder (the calibration looks identities up for every traced dispatch).
    return PipelineIdentity(**{name: d[name] for name in _IDENTITY_FIELDS if name in d})


def _pipeline_identity(self: _core.KernelRegistry, label: str) -> PipelineIdentity:
    return _identity_from_core(self._pipeline_identity(label))


def _pipeline_identity_of(self: _core.Pipeline) -> PipelineIdentity:
    return _identity_from_core(self._identity())


_core.KernelRegistry.pipeline_identity = _pipeline_identity
_core.Pipeline.identity = property(_pipeline_identity_of)
