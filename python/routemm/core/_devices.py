"""The devices and kernel registries that the high-level front doors share in one process: the
default device, one device per backend name, and one registry per device, each made on first use."""

from __future__ import annotations

import functools

from .. import _core
from ._errors import InvalidArgumentError


@functools.lru_cache(maxsize=None)
def _default_device() -> _core.Device:
    return _core.Device()


@functools.lru_cache(maxsize=None)
def _named_device(backend: str) -> _core.Device:
    return _core.Device(backend)


def _resolve_device(device, op: str = "matmul_id") -> _core.Device:
    """`device` as given to `op` (matmul_id, moe_gate, moe_experts): None (the best available
    backend), a routemm.Device, or a backend name such as "cpu"."""
    if device is None:
        return _default_device()
    if isinstance(device, _core.Device):
        return device
    if isinstance(device, str):
        return _named_device(device)
    raise InvalidArgumentError(f"{op} device must be a routemm.Device or a backend name, got {device!r}")


@functools.lru_cache(maxsize=8)
def _registry_for(device: _core.Device) -> _core.KernelRegistry:
    return _core.KernelRegistry(device)
