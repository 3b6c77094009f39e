"""The CPU backend's host memory: buffers of 2 MiB or more start on 2 MiB boundaries and ask for
transparent huge pages on Linux (ROUTEMM_CPU_HUGE_PAGES, default 1), smaller ones are 64-byte
aligned; every size round-trips its bytes, and freed mappings are returned."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import routemm
from support import run_python

HUGE = 2 << 20
LINUX = sys.platform.startswith("linux")


def _python(code: str, **env_overrides):
    return run_python(code, unset=("ROUTEMM_CPU_HUGE_PAGES",), **env_overrides)


@pytest.mark.parametrize("nbytes", [1, 4096, HUGE - 1, HUGE, HUGE + 1, 3 * HUGE + 17])
def test_sizes_round_trip_and_alignment(nbytes):
    cpu = routemm.Device("cpu")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    buf = cpu.from_numpy(data)
    assert np.array_equal(buf.numpy(), data)
    assert buf.address % 64 == 0
    huge = LINUX and nbytes >= HUGE and "ROUTEMM_CPU_HUGE_PAGES" not in routemm.env.non_default()
    if huge:
        assert buf.address % HUGE == 0


def _vm_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/status")
def test_freed_buffers_return_their_mappings():
    cpu = routemm.Device("cpu")
    for _ in range(3):  # warm up whatever the first allocations keep
        cpu.alloc(10 << 20, routemm.DType.U8, [10 << 20])
    before = _vm_kb()
    for _ in range(200):  # 2 GB in all if nothing were returned
        buf = cpu.alloc(10 << 20, routemm.DType.U8, [10 << 20])
        del buf
    assert _vm_kb() - before < 64 << 10


@pytest.mark.skipif(not LINUX, reason="huge pages are a Linux feature")
def test_knob_off_is_recorded_and_bad_values_are_refused():
    code = (
        "import numpy as np, routemm\n"
        "b = routemm.Device('cpu').from_numpy(np.arange(3 << 20, dtype=np.uint8))\n"
        "assert np.array_equal(b.numpy(), np.arange(3 << 20, dtype=np.uint8))\n"
        "print(routemm.env.non_default().get('ROUTEMM_CPU_HUGE_PAGES'))\n"
    )
    off = _python(code, ROUTEMM_CPU_HUGE_PAGES="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["0"]
    on = _python(code, ROUTEMM_CPU_HUGE_PAGES="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["None"]
    bad = _python(code, ROUTEMM_CPU_HUGE_PAGES="yes")
    assert bad.returncode != 0
    assert "ROUTEMM_CPU_HUGE_PAGES must be 0 or 1, got 'yes'" in bad.stderr
