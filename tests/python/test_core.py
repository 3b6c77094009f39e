"""DType, Buffer, Device, backend discovery and the ROUTEMM_BACKEND knob."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import routemm
from routemm import DType
from support import run_python

SIZES = {
    DType.F32: (4, "f32"),
    DType.F16: (2, "f16"),
    DType.BF16: (2, "bf16"),
    DType.U8: (1, "u8"),
    DType.U16: (2, "u16"),
    DType.U32: (4, "u32"),
    DType.I32: (4, "i32"),
}
NP = {
    DType.F32: np.float32,
    DType.F16: np.float16,
    DType.BF16: ml_dtypes.bfloat16,
    DType.U8: np.uint8,
    DType.U16: np.uint16,
    DType.U32: np.uint32,
    DType.I32: np.int32,
}


@pytest.mark.parametrize("dtype", list(SIZES), ids=lambda d: SIZES[d][1])
def test_dtype_size_and_name(dtype):
    size, name = SIZES[dtype]
    assert dtype.size == size
    assert dtype.type_name == name
    assert routemm.numpy_dtype(dtype) == np.dtype(NP[dtype])
    assert routemm.dtype_of(NP[dtype]) == dtype


def test_dtype_str_is_lowercase_name():
    """Spec §1.1: Display is the lowercase name ("f32", "bf16", ...)."""
    assert {str(d): name for d, (_, name) in SIZES.items()} == {name: name for _, name in SIZES.values()}


def test_dtype_of_rejects_unknown():
    with pytest.raises(routemm.InvalidArgumentError):
        routemm.dtype_of(np.float64)


def test_errors_hierarchy():
    assert issubclass(routemm.InvalidArgumentError, routemm.Error)
    assert issubclass(routemm.InvalidArgumentError, ValueError)
    assert issubclass(routemm.KernelNotFoundError, routemm.Error)
    assert issubclass(routemm.KernelNotFoundError, LookupError)


# ---- buffers -------------------------------------------------------------------------------------


def test_alloc_fields(device):
    buf = device.alloc(96, DType.F32, [4, 6])
    assert (buf.byte_offset, buf.nbytes, buf.dtype, buf.shape) == (0, 96, DType.F32, (4, 6))
    assert buf.writable and buf.address != 0
    assert buf.logical_range == (buf.address, buf.address + 96)
    assert buf.device == device and buf.device.backend == device.backend
    flat = device.alloc(12, DType.U16)
    assert flat.shape == (6,)


def test_alloc_shape_must_match(device):
    with pytest.raises(routemm.InvalidArgumentError):
        device.alloc(96, DType.F32, [5, 5])
    with pytest.raises(routemm.InvalidArgumentError):
        device.alloc(7, DType.F32)  # not a whole number of f32


def test_views_compose(device, rng):
    data = rng.integers(0, 256, 256, dtype=np.uint8)
    parent = device.from_numpy(data)
    a = parent.view(16, 128, DType.F32, [8, 4])
    assert (a.byte_offset, a.nbytes, a.dtype, a.shape, a.address) == (16, 128, DType.F32, (8, 4), parent.address)
    b = a.view(8, 64, DType.U16)  # relative to a's logical start
    assert (b.byte_offset, b.nbytes, b.shape) == (24, 64, (32,))
    c = b.view(2, 4, DType.U8)
    assert c.byte_offset == 26 and c.address == parent.address
    assert c.logical_range == (parent.address + 26, parent.address + 30)
    assert np.array_equal(c.numpy(), data[26:30])
    assert np.array_equal(b.numpy(), data[24:88].view(np.uint16))
    # Writes through a view land in the parent at the composed offset, and nowhere else.
    c.copy_from_numpy(np.array([1, 2, 3, 4], np.uint8))
    want = data.copy()
    want[26:30] = [1, 2, 3, 4]
    assert np.array_equal(parent.numpy(), want)


def test_view_out_of_range(device):
    parent = device.alloc(64, DType.U8)
    child = parent.view(16, 32, DType.U8)
    for off, n in ((0, 65), (64, 1), (33, 32), (2**63, 2**63)):
        with pytest.raises(routemm.InvalidArgumentError):
            parent.view(off, n, DType.U8)
    # Relative to the child's 32 logical bytes, not the 64-byte allocation.
    with pytest.raises(routemm.InvalidArgumentError):
        child.view(16, 20, DType.U8)
    with pytest.raises(routemm.InvalidArgumentError):
        child.view(0, 33, DType.U8)
    assert child.view(0, 32, DType.U8).nbytes == 32
    assert parent.view(64, 0, DType.U8).nbytes == 0
    with pytest.raises(routemm.InvalidArgumentError):
        parent.view(0, 6, DType.F32)  # not whole elements


@pytest.mark.parametrize("dtype", list(SIZES), ids=lambda d: SIZES[d][1])
def test_from_numpy_round_trip(device, rng, dtype):
    raw = rng.integers(0, 256, size=3 * 5 * dtype.size, dtype=np.uint8)
    arr = raw.view(NP[dtype]).reshape(3, 5)
    buf = device.from_numpy(arr)
    assert (buf.dtype, buf.shape, buf.nbytes) == (dtype, (3, 5), arr.nbytes)
    back = buf.numpy()
    assert back.dtype == np.dtype(NP[dtype]) and back.shape == (3, 5)
    assert np.array_equal(back.view(np.uint8), arr.view(np.uint8))  # bit exact, NaN payloads too
    new = rng.integers(0, 256, size=raw.size, dtype=np.uint8).view(NP[dtype]).reshape(3, 5)
    buf.copy_from_numpy(new)
    assert np.array_equal(buf.numpy().view(np.uint8), new.view(np.uint8))
    with pytest.raises(routemm.InvalidArgumentError):
        buf.copy_from_numpy(new[:2])


def test_from_numpy_reinterprets(device):
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001], np.uint16)
    buf = device.from_numpy(bits, dtype=DType.BF16)
    assert buf.dtype == DType.BF16
    got = buf.numpy()
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert got[:3].astype(np.float32).tolist() == [1.0, -2.0, float("inf")]
    assert got[3].astype(np.float64) == 2.0**-133  # min bf16 subnormal
    f = device.from_numpy(np.array([1.0, -0.0], np.float32), dtype=DType.U32)
    assert f.numpy().tolist() == [0x3F800000, 0x80000000]
    with pytest.raises(routemm.InvalidArgumentError):
        device.from_numpy(np.zeros(4, np.float32), dtype=DType.F16)  # itemsize mismatch


def test_from_numpy_scalar_and_noncontiguous(device):
    s = device.from_numpy(np.float32(2.5))
    assert s.shape == (1,) and s.numpy().tolist() == [2.5]
    a = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    buf = device.from_numpy(a)
    assert buf.shape == (3, 2) and np.array_equal(buf.numpy(), a)


# ---- devices and backends ------------------------------------------------------------------------


def test_backend_status_is_truthful():
    status = routemm.backend_status()
    names = [s[0] for s in status]
    assert {"cpu", "cuda", "metal"} <= set(names)
    assert len(set(names)) == len(names)
    available = [name for name, ok, _ in status if ok]
    assert routemm.available_backends() == available
    assert "cpu" in available
    for name, ok, reason in status:
        assert isinstance(reason, str)
        if ok:
            assert reason == ""
            assert routemm.Device(name).backend == name
        else:
            assert reason, f"unavailable backend {name} without a reason"
            with pytest.raises(routemm.Error, match=name):
                routemm.Device(name)


def test_device_properties(device, backend):
    assert device.backend == backend
    assert isinstance(device.name, str) and device.name
    assert isinstance(device.registry_id, int)
    assert device.command_encoder().device_registry_id == device.registry_id
    assert device == routemm.Device(backend)  # one backend instance per process
    assert device.alloc(4, DType.F32).device == device


def test_unknown_backend_lists_known():
    with pytest.raises(routemm.InvalidArgumentError) as info:
        routemm.Device("bogus")
    for name, _, _ in routemm.backend_status():
        assert name in str(info.value)


def _python(code: str, **env_overrides):
    return run_python(code, unset=("ROUTEMM_BACKEND",), **env_overrides)


def test_default_device_is_best_available():
    r = _python("import routemm; print(routemm.Device().backend, routemm.available_backends()[0])")
    assert r.returncode == 0, r.stderr
    chosen, best = r.stdout.split()
    assert chosen == best


def test_routemm_backend_env_is_read_once():
    code = (
        "import os, routemm\n"
        "d = routemm.Device()\n"
        "os.environ['ROUTEMM_BACKEND'] = 'bogus'\n"
        "print(d.backend, routemm.Device().backend, routemm.env.non_default().get('ROUTEMM_BACKEND'))\n"
    )
    r = _python(code, ROUTEMM_BACKEND="cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "cpu", "cpu"]


def test_routemm_backend_env_bogus_lists_known():
    code = (
        "import routemm\n"
        "try:\n"
        "    routemm.Device()\n"
        "except routemm.InvalidArgumentError as e:\n"
        "    print('ERR', e)\n"
        "print('NAMES', ','.join(s[0] for s in routemm.backend_status()))\n"
        "print('EXPLICIT', routemm.Device('cpu').backend)\n"
    )
    r = _python(code, ROUTEMM_BACKEND="bogus")
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert "bogus" in lines["ERR"]
    for name in lines["NAMES"].split(","):
        assert name in lines["ERR"]
    # Naming a backend explicitly still works: the knob only picks the default.
    assert lines["EXPLICIT"] == "cpu"


def test_env_knob_table():
    names = [k.name for k in routemm.env.KNOBS]
    assert "ROUTEMM_BACKEND" in names and "ROUTEMM_TEST_BACKENDS" in names
    assert len(names) == len(set(names))
    assert "ROUTEMM_BACKEND" in routemm.env.table_markdown()


@pytest.mark.parametrize("level,want", [("bogus", None), ("debug", "10"), ("15", "15"), ("-3", None)])
def test_log_level_knob_never_breaks_import(level, want):
    """ROUTEMM_LOG_LEVEL: a level name or number sets the 'routemm' logger; anything else warns
    and is ignored, and the package still imports."""
    code = "import logging, routemm\nprint(logging.getLogger('routemm').level)\n"
    r = _python(code, ROUTEMM_LOG_LEVEL=level)
    assert r.returncode == 0, r.stderr
    if want is None:
        assert r.stdout.split() == ["0"]
        assert "ignoring ROUTEMM_LOG_LEVEL" in r.stderr and repr(level) in r.stderr
    else:
        assert r.stdout.split() == [want]
        assert "ignoring" not in r.stderr


@pytest.mark.parametrize("dtype", ["bf16", DType.BF16.type_name.upper(), 2, np.float32])
def test_from_numpy_dtype_must_be_a_routemm_dtype(device, dtype):
    with pytest.raises(routemm.InvalidArgumentError, match="from_numpy: dtype must be a routemm.DType"):
        device.from_numpy(np.zeros(4, np.uint16), dtype=dtype)


def test_records_are_built_at_their_own_schema_version():
    """A record constructed directly (not only through from_json) refuses a schema_version other
    than the one its class writes."""
    dispatch = routemm.EncodedKernelDispatch("p", routemm.DispatchKind.THREADS, (1, 1, 1), (1, 1, 1), ())
    params = routemm.DenseMatmulIdParams(1, 1, 1, 1, 1, 4)
    records = [
        (routemm.EncodedKernelDispatch, dict(dispatch.__dict__)),
        (routemm.DenseMatmulIdParams, dict(params.__dict__)),
        (routemm.GgmlQuantizedMatmulParams, dict(m=1, n=32, k=32)),
        (
            routemm.DenseMatmulIdDispatchReceipt,
            dict(weight_dtype=DType.F32, route=routemm.DenseMatmulIdRoute.DIRECT, dispatch_count=1),
        ),
    ]
    for cls, fields in records:
        fields = {name: value for name, value in fields.items() if not name.startswith("_")}
        fields.pop("schema_version", None)
        current = cls(**fields).schema_version
        for bad in (99, current + 1, True, str(current)):
            with pytest.raises(routemm.InvalidArgumentError, match=f"{cls.__name__}: schema_version"):
                cls(**fields, schema_version=bad)
        assert cls(**fields, schema_version=current).schema_version == current
