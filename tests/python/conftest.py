"""Backend selection for the Python suite.

`backend` is parametrised over routemm.available_backends(), narrowed by ROUTEMM_TEST_BACKENDS (a
comma list). A requested backend that is not available here is a SKIP carrying the reason from
routemm.backend_status() -- never a pass; an unknown name is a usage error.
"""

from __future__ import annotations

import os

import pytest
import routemm


def _backend_params():
    status = {name: (available, reason) for name, available, reason in routemm.backend_status()}
    requested = [s.strip() for s in os.environ.get("ROUTEMM_TEST_BACKENDS", "").split(",") if s.strip()]
    if not requested:
        return [pytest.param(name, id=name) for name in routemm.available_backends()]
    params = []
    for name in requested:
        if name not in status:
            raise pytest.UsageError(
                f"ROUTEMM_TEST_BACKENDS names unknown backend {name!r} (known: {', '.join(status)})"
            )
        available, reason = status[name]
        marks = () if available else pytest.mark.skip(reason=f"backend {name} unavailable: {reason}")
        params.append(pytest.param(name, id=name, marks=marks))
    return params


BACKEND_PARAMS = _backend_params()


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def device(backend, request) -> routemm.Device:
    """The backend's device; a test marked needs_kernels(...) is skipped where one is missing."""
    dev = routemm.Device(backend)
    marker = request.node.get_closest_marker("needs_kernels")
    needed = list(marker.args) if marker is not None else []
    # A `route` parameter with a pipeline (Q4_0 matrix routes) needs that pipeline too.
    callspec = getattr(request.node, "callspec", None)
    route_pipeline = getattr(callspec.params.get("route") if callspec else None, "pipeline_name", None)
    if isinstance(route_pipeline, str):
        needed.append(route_pipeline)
    if needed:
        probe = routemm.KernelRegistry(dev)
        missing = [name for name in needed if not probe.has_kernel(name)]
        if missing:
            pytest.skip(f"backend {dev.backend} has no {', '.join(missing)}")
    return dev


@pytest.fixture
def registry(device) -> routemm.KernelRegistry:
    return routemm.KernelRegistry(device)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's node id (varied, reproducible)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# Property-based tests (hypothesis): the "ci" profile keeps them to a few minutes on two cores;
# `pytest --hypothesis-profile=deep` runs fifty times the examples. Tests state their own example
# counts relative to this profile's scale. Fixtures here (device, registry) are safe to share
# between the examples of one test.
try:
    from hypothesis import HealthCheck
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile(
        "ci",
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    _hypothesis_settings.register_profile("deep", parent=_hypothesis_settings.get_profile("ci"), max_examples=5000)
    _hypothesis_settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; the property tests skip without it
    pass


def pytest_generate_tests(metafunc):
    # `tdev`: the torch device of a torch-facing test (torch_devices.py). Parametrised here rather
    # than by a fixture so that torch is imported only for the tests that ask for it.
    if "tdev" in metafunc.fixturenames:
        from torch_devices import torch_devices

        metafunc.parametrize("tdev", torch_devices())
