"""Python half of the core types: NumPy copies, dispatch receipts, capture nodes, identities.

The native classes (Device, Buffer, CommandEncoder, KernelRegistry) come from routemm._core; the
methods that shape Python values (NumPy arrays, dataclasses) are defined here and attached to them.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Optional

import ml_dtypes
import numpy as np

from .. import _core
from ._errors import InvalidArgumentError, InvalidArgumentTypeError
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
    """The routemm dtype of NumPy dtype `array_dtype`; InvalidArgumentError names the supported ones."""
    try:
        return _NUMPY_TO_DTYPE[np.dtype(array_dtype)]
    except KeyError:
        raise InvalidArgumentError(_unsupported_dtype_message(np.dtype(array_dtype))) from None


def _unsupported_dtype_message(dtype: np.dtype) -> str:
    supported = ", ".join(str(d) for d in _NUMPY_TO_DTYPE)
    message = f"no routemm dtype for numpy dtype {dtype}; supported: {supported}"
    if np.issubdtype(dtype, np.integer):
        return message + "; expert ids are uint32: convert with ids.astype(np.uint32)"
    if np.issubdtype(dtype, np.floating):
        return message + "; activations are float32: convert with x.astype(np.float32)"
    return message


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


_native_alloc = _core.Device.alloc
_U64_MAX = 2**64 - 1


def _device_alloc(self: _core.Device, nbytes: Optional[int] = None, dtype: Optional[DType] = None, shape=None):
    """Allocate device memory tagged with `dtype` and `shape` (contents undefined).

    `alloc(nbytes, dtype, shape=None)`; without `nbytes` it is the shape's element count times the
    dtype's size (`alloc(dtype=DType.F32, shape=[4, 8])` is 128 bytes). A shape that does not
    cover exactly `nbytes` is refused by the core.
    """
    if not isinstance(dtype, DType):
        raise InvalidArgumentError(f"alloc: dtype must be a routemm.DType, got {dtype!r}")
    if shape is not None and not isinstance(shape, (list, tuple)):
        raise InvalidArgumentError(f"alloc: shape must be a list or tuple of extents, got {shape!r}")
    if nbytes is None:
        if shape is None:
            raise InvalidArgumentError("alloc needs nbytes, or a shape to infer it from")
        nbytes = _shape_nbytes("alloc", shape, dtype)
    # Checked here so the binding's conversions never see a value they would refuse with a TypeError.
    nbytes = check_uint("alloc", "nbytes", nbytes, 64)
    return _native_alloc(self, nbytes, dtype, [] if shape is None else list(check_shape("alloc", shape)))


def _shape_nbytes(where: str, shape, dtype: DType) -> int:
    """Bytes of a C-contiguous `shape` (a list or tuple) of `dtype`, checked: extents are
    non-negative integers and the total fits a u64."""
    nbytes = dtype.size
    for extent in check_shape(where, shape):
        nbytes *= extent
    if nbytes > _U64_MAX:
        raise InvalidArgumentError(f"{where}: shape {list(shape)} of {dtype} is {nbytes} bytes, over 2^64 - 1")
    return nbytes


# ---- Argument checks shared by the front doors ----------------------------------------------------
# A front door checks its arguments with these before calling into _core, whose own refusal of a
# wrong type would be pybind11's bare TypeError ("incompatible function arguments") naming neither
# the op nor the argument, and before copying or allocating anything.


def check_type(op: str, name: str, value, kind: type, *, optional: bool = False):
    """`value` when it is a `kind` (or None, with `optional`); anything else is an
    InvalidArgumentTypeError naming the op, the argument and the type it got."""
    if isinstance(value, kind) or (optional and value is None):
        return value
    wanted = f"a {kind.__name__}" + (" or None" if optional else "")
    hint = ""
    if kind is _core.Buffer and isinstance(value, np.ndarray):
        hint = " (copy an array to the device with device.from_numpy(array))"
    raise InvalidArgumentTypeError(f"{op} {name} must be {wanted}, not {type(value).__name__}{hint}")


def check_encoding(op: str, encoder, registry, names: tuple[str, ...], *buffers) -> None:
    """The arguments every explicit front door takes: `encoder` a CommandEncoder, `registry` a
    KernelRegistry and `buffers` Buffers (`names` are their argument names, in order). Checked
    on every call, so the common case is a few isinstance tests and the messages are built only
    for a refusal."""
    if isinstance(encoder, _core.CommandEncoder) and isinstance(registry, _core.KernelRegistry):
        for buffer in buffers:
            if not isinstance(buffer, _core.Buffer):
                break
        else:
            return
    check_type(op, "encoder", encoder, _core.CommandEncoder)
    check_type(op, "registry", registry, _core.KernelRegistry)
    for name, value in zip(names, buffers, strict=True):
        check_type(op, name, value, _core.Buffer)


def is_integer(value) -> bool:
    """A Python or NumPy integer that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_uint(op: str, name: str, value, bits: int = 32) -> int:
    """`value` as an int in [0, 2^bits): an integer, never a bool, float or string (no coercion);
    anything else is an InvalidArgumentError "<op> <name> must be a u<bits>, got <value>"."""
    if not is_integer(value) or not 0 <= value < 1 << bits:
        raise InvalidArgumentError(f"{op} {name} must be a u{bits}, got {value!r}")
    return int(value)


def check_shape(where: str, shape) -> tuple[int, ...]:
    """`shape` (a list or tuple) as a tuple of non-negative integer extents (no coercion: 32.5,
    "32" and True are refused); anything else is an InvalidArgumentError naming `where`."""
    if not isinstance(shape, (list, tuple)) or not all(is_integer(d) and d >= 0 for d in shape):
        shown = list(shape) if isinstance(shape, (list, tuple)) else shape
        raise InvalidArgumentError(f"{where}: shape extents must be non-negative integers, got {shown!r}")
    return tuple(int(d) for d in shape)


_core.Device.alloc = _device_alloc
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


# ---- Specialisation constants and optional pipelines --------------------------------------------


def _check_constants(name: str, constants, kind: type, what: str) -> list:
    """`constants` as a list of (u32 index, value) pairs of `kind` (int: an i32; bool), or an
    InvalidArgumentError that says what the pairs must be."""
    pairs = f"{what} constants are (index, value) pairs, e.g. [(700, 1)]"
    ranges = "the index is a u32, the value an i32" if kind is int else "the index is a u32"
    try:
        entries = list(constants)
    except TypeError:
        raise InvalidArgumentError(f"pipeline '{name}': {pairs}; got {constants!r}") from None
    out = []
    for entry in entries:
        try:
            index, value = entry
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"pipeline '{name}': {entry!r} is not a pair; {pairs}") from None
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise InvalidArgumentError(f"pipeline '{name}': index {index!r} is not an integer; {pairs}")
        if not 0 <= index <= 0xFFFFFFFF:
            raise InvalidArgumentError(f"pipeline '{name}': {what} constant index {index} is out of range ({ranges})")
        if kind is bool:
            if not isinstance(value, (bool, np.bool_)):
                raise InvalidArgumentError(
                    f"pipeline '{name}': bool constant {index} must be True or False, got {value!r}"
                )
        elif isinstance(value, (bool, np.bool_)):
            raise InvalidArgumentError(
                f"pipeline '{name}': int constant {index} is the bool {value!r}; pass booleans as bool_constants "
                f"(labelled |{index}:b0 / |{index}:b1)"
            )
        elif not isinstance(value, (int, np.integer)):
            raise InvalidArgumentError(f"pipeline '{name}': value {value!r} is not an integer; {pairs}")
        elif not -(2**31) <= value < 2**31:
            raise InvalidArgumentError(f"pipeline '{name}': int constant {index} = {value} is out of range ({ranges})")
        out.append((int(index), kind(value)))
    return out


_native_get_pipeline = _core.KernelRegistry.get_pipeline


def _get_pipeline(self: _core.KernelRegistry, name: str, int_constants=()):
    """The pipeline `name` with integer specialisation constants [(index, value)], compiled and
    cached on first use; label `name|<index>:i<value>|...`. A bool value is refused (booleans are
    their own constants: get_pipeline_with_constants)."""
    return _native_get_pipeline(self, name, _check_constants(name, int_constants, int, "int"))


def _get_pipeline_with_constants(self: _core.KernelRegistry, name: str, bool_constants=(), int_constants=()):
    """The pipeline `name` specialised with boolean and integer constants (spec §3.1); label
    `name|<i>:b0|<j>:b1|...|<k>:i<value>|...`, booleans first, each list in the order given."""
    bools = _check_constants(name, bool_constants, bool, "bool")
    ints = _check_constants(name, int_constants, int, "int")
    return self._get_pipeline_with_constants(name, bools, ints)


def _get_pipeline_with_bool_constants(self: _core.KernelRegistry, name: str, bool_constants):
    return _get_pipeline_with_constants(self, name, bool_constants, ())


# registry -> {label: available}; gone with the registry.
_OPTIONAL_PIPELINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _probe_optional_pipeline(self: _core.KernelRegistry, name: str, bool_constants=(), int_constants=()):
    """The pipeline, or None where this registry's device does not have it (spec §3.1's optional
    probe). The answer is cached per registry, i.e. per device: a kernel that is not registered
    (KernelNotFoundError) is unavailable, not an error; any other failure propagates uncached."""
    from ._errors import KernelNotFoundError

    bools = _check_constants(name, bool_constants, bool, "bool")
    ints = _check_constants(name, int_constants, int, "int")
    cache = _OPTIONAL_PIPELINES.setdefault(self, {})
    key = (name, tuple(bools), tuple(ints))
    if cache.get(key) is False:
        return None
    try:
        pipeline = self._get_pipeline_with_constants(name, bools, ints)
    except KernelNotFoundError:
        cache[key] = False
        return None
    cache[key] = True
    return pipeline


_core.KernelRegistry.get_pipeline = _get_pipeline
_core.KernelRegistry.get_pipeline_with_constants = _get_pipeline_with_constants
_core.KernelRegistry.get_pipeline_with_bool_constants = _get_pipeline_with_bool_constants
_core.KernelRegistry.probe_optional_pipeline = _probe_optional_pipeline


# ---- Buffer shape views and host slices ---------------------------------------------------------


def _buffer_with_shape(self: _core.Buffer, shape) -> _core.Buffer:
    """The same storage, offset, length and dtype with a new shape; the element count must not
    change (spec §1.2)."""
    shape = [int(d) for d in shape]
    count = int(np.prod(shape, dtype=object)) if shape else 1
    if any(d < 0 for d in shape) or count * self.dtype.size != self.nbytes:
        raise InvalidArgumentError(
            f"with_shape: shape {tuple(shape)} holds {count} {self.dtype.type_name} elements, the buffer "
            f"{self.nbytes // self.dtype.size}"
        )
    return self.view(0, self.nbytes, self.dtype, shape)


def _host_slice(self: _core.Buffer, dtype, writable: bool, op: str) -> np.ndarray:
    dtype = self.dtype if dtype is None else dtype
    np_dtype = numpy_dtype(dtype) if isinstance(dtype, DType) else np.dtype(dtype)
    if not self.device.host_accessible:
        raise InvalidArgumentError(
            f"{op}: {self.device.backend} memory is not host-accessible; copy it with numpy() instead"
        )
    if writable and not self.writable:
        what = "file-backed" if self.is_file_backed else "read-only"
        raise InvalidArgumentError(f"{op}: Cannot mutate a read-only {what} buffer")
    size = np_dtype.itemsize
    if self.nbytes % size != 0:
        raise InvalidArgumentError(f"{op}: {self.nbytes} logical bytes are not a whole number of {size}-byte elements")
    start = self.address + self.byte_offset
    if start % size != 0:
        raise InvalidArgumentError(f"{op}: logical start 0x{start:x} is not aligned to {size} bytes")
    return self._host_array(np_dtype, writable)


def _buffer_as_slice(self: _core.Buffer, dtype=None) -> np.ndarray:
    """A read-only NumPy view of exactly the logical bytes [byte_offset, byte_offset + nbytes),
    without copying (spec §1.2 as_slice), as `dtype` (default: the buffer's). Host-accessible
    backends only (CPU); refused with a message when the length is not a whole number of elements
    or the start is misaligned for the element. The view keeps the memory alive; it must not be
    read while a submission writes the buffer."""
    return _host_slice(self, dtype, False, "as_slice")


def _buffer_as_mut_slice(self: _core.Buffer, dtype=None) -> np.ndarray:
    """as_slice, writable; refused for read-only (e.g. file-backed) buffers."""
    return _host_slice(self, dtype, True, "as_mut_slice")


_core.Buffer.with_shape = _buffer_with_shape
_core.Buffer.as_slice = _buffer_as_slice
_core.Buffer.as_mut_slice = _buffer_as_mut_slice


# ---- Identity fields of spec §3.2 ---------------------------------------------------------------

# origin values whose content hash covers source text compiled at run time; every other origin is
# a precompiled machine image (a CUDA fatbin, a metallib, the CPU backend's compiled code).
RUNTIME_SOURCE_ORIGINS = frozenset({"runtime_source"})


def _identity_origin_kind(self: PipelineIdentity) -> str:
    """Spec §3.2's origin: "runtime_source" or "precompiled"."""
    return "runtime_source" if self.origin in RUNTIME_SOURCE_ORIGINS else "precompiled"


def _identity_runtime_source_sha256(self: PipelineIdentity) -> Optional[str]:
    return self.content_sha256 if self.origin_kind == "runtime_source" else None


def _identity_precompiled_sha256(self: PipelineIdentity) -> Optional[str]:
    return self.content_sha256 if self.origin_kind == "precompiled" else None


PipelineIdentity.origin_kind = property(_identity_origin_kind)
PipelineIdentity.runtime_source_sha256 = property(_identity_runtime_source_sha256)
PipelineIdentity.precompiled_sha256 = property(_identity_precompiled_sha256)
