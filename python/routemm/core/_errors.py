"""Exception classes raised by routemm; the native core maps its errors onto these."""


class Error(Exception):
    """Base class of every error routemm raises."""


class InvalidArgumentError(Error, ValueError):
    """Bad caller input: the message names the operation and the offending value."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (None or a NumPy array where a buffer, an encoder, a registry,
    a scratch or params go): an InvalidArgumentError that is also a TypeError; the message names
    the operation, the argument and the type it got."""


class OutOfMemoryError(Error, MemoryError):
    """An allocation of a possible size failed: the device has no memory for it now (an impossible
    size is an InvalidArgumentError instead)."""


class KernelNotFoundError(Error, LookupError):
    """A pipeline is not registered on this device (or its lookup was made to fail on purpose)."""


class CommandBufferError(Error):
    """A submission failed on the device; ``pipeline_label`` names the pipeline whose launch failed
    ("" when the failure belongs to no single launch)."""

    pipeline_label: str = ""


class CalibrationError(Error):
    """A route calibration could not measure what it needs (e.g. a GPU interval that is not a
    finite, positive time); the message names the measurement."""


class UnsupportedError(Error, NotImplementedError):
    """A computation routemm does not provide, refused where it is asked for: e.g. backward through
    an op on tensors (routemm's kernels compute the forward pass only); the message names the
    operation and the arguments."""


class MissingDependencyError(Error, ImportError):
    """An optional package a feature needs is not installed; the message says how to install it."""
