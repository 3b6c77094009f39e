"""Fail closed at the core's edges, from the public Python API: impossible sizes, raw dispatch of
kernels outside their argument contract, DLPack read-only provenance, encoders shared by threads,
interpreter exit with a daemon thread inside a commit, and strict pipeline labels.

These are the robustness tests that .ci/run also runs against an ASan + UBSan build of the
extension: each case here used to be a crash, a heap overflow or a silent wrong answer.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import routemm
from routemm import DispatchKind, DType

CALIBRATION_PARAMS = struct.Struct("<QQII")  # CalibrationKernelParams: 24 bytes
U64 = 2**64


@pytest.fixture
def cpu():
    return routemm.Device("cpu")


@pytest.fixture
def proof(cpu):
    """The calibration proof pipelines, which calibration dispatches raw (no op front door)."""
    registry = routemm.KernelRegistry(cpu)
    return registry.get_pipeline("routemm_calibration_poison_f32"), registry.get_pipeline(
        "routemm_calibration_compare_f32"
    )


def poison_args(control, candidate, guarded: int, logical: int | None = None):
    logical = guarded if logical is None else logical
    return [(0, control), (1, candidate), (2, CALIBRATION_PARAMS.pack(logical, guarded, 0, 0))]


def dispatch(encoder, pipeline, args, elements: int):
    encoder.dispatch(pipeline, args, (elements, 1, 1), (1, 1, 1), dispatch_kind=DispatchKind.THREADS)


# ---- 1: checked size arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [U64 - 1, U64 - 63, 2**63, 2**63 + 5])
def test_impossible_allocation_is_invalid_argument(cpu, nbytes):
    # The rounding to 64 bytes wrapped to 0 for the first two: 64 bytes claiming 2^64 - 1.
    with pytest.raises(routemm.InvalidArgumentError, match="largest possible allocation"):
        cpu.alloc(nbytes, DType.U8)


def test_honest_allocation_failure_is_memory_error(cpu):
    with pytest.raises(MemoryError) as info:
        cpu.alloc(2**62 + 64, DType.U8)
    assert isinstance(info.value, routemm.OutOfMemoryError) and isinstance(info.value, routemm.Error)


def test_views_past_the_parent_are_refused(cpu):
    buf = cpu.alloc(64, DType.U8)
    for offset, nbytes in [(0, 65), (1, 64), (U64 - 1, 2), (64, U64 - 1), (32, U64 - 16)]:
        with pytest.raises(routemm.InvalidArgumentError):
            buf.view(offset, nbytes, DType.U8)


# ---- 2: kernel argument contracts on raw dispatch -----------------------------------------------


@pytest.mark.parametrize("guarded", [2**62, 2**62 + 16, U64 - 1, 17])
def test_poison_beyond_its_buffers_is_refused_before_encoding(cpu, proof, guarded):
    poison, _ = proof
    control = cpu.from_numpy(np.zeros(16, np.float32))
    candidate = cpu.from_numpy(np.zeros(16, np.float32))
    encoder = cpu.command_encoder()
    before = routemm.dispatch_count()
    with pytest.raises(routemm.InvalidArgumentError, match="routemm_calibration_poison_f32"):
        dispatch(encoder, poison, poison_args(control, candidate, guarded), 16)
    assert routemm.dispatch_count() == before and encoder.pending_dispatches == 0
    encoder.commit_and_wait()
    assert not control.numpy().any() and not candidate.numpy().any()


@pytest.mark.parametrize("guarded,status_index", [(2**62, 0), (16, 16), (17, 0)])
def test_compare_beyond_its_buffers_is_refused(cpu, proof, guarded, status_index):
    _, compare = proof
    a = cpu.from_numpy(np.zeros(16, np.float32))
    statuses = cpu.from_numpy(np.zeros(16, np.uint32))
    args = [(0, a), (1, a), (2, statuses), (3, CALIBRATION_PARAMS.pack(min(guarded, 16), guarded, status_index, 0))]
    encoder = cpu.command_encoder()
    with pytest.raises(routemm.InvalidArgumentError, match="routemm_calibration_compare_f32"):
        dispatch(encoder, compare, args, 16)
    assert encoder.pending_dispatches == 0


def test_misaligned_binding_offsets_are_refused(cpu, proof):
    poison, _ = proof
    a = cpu.from_numpy(np.zeros(16, np.float32))
    encoder = cpu.command_encoder()
    for offset in (1, 2, 3, 6):
        with pytest.raises(routemm.InvalidArgumentError, match="not aligned"):
            dispatch(encoder, poison, [(0, (a, offset)), (1, a), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0))], 4)
    dispatch(encoder, poison, [(0, (a, 4)), (1, a), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0))], 4)
    encoder.commit_and_wait()


def test_params_and_slots_outside_the_kernel_abi_are_refused(cpu, proof):
    poison, _ = proof
    a = cpu.from_numpy(np.zeros(16, np.float32))
    encoder = cpu.command_encoder()
    bad = [
        [(0, a), (1, a), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0)[:-1])],  # short params
        [(0, a), (1, a), (2, a)],  # params slot bound to a buffer
        [(0, a), (1, CALIBRATION_PARAMS.pack(4, 4, 0, 0)), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0))],
        [(0, a), (1, a), (2, CALIBRATION_PARAMS.pack(5, 4, 0, 0))],  # logical > guarded
        [(0, a), (1, a), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0)), (7, a)],  # a slot it does not take
        [(1, a), (2, CALIBRATION_PARAMS.pack(4, 4, 0, 0))],  # slot 0 missing
    ]
    for args in bad:
        with pytest.raises(routemm.InvalidArgumentError):
            dispatch(encoder, poison, args, 4)
    assert encoder.pending_dispatches == 0


# ---- 3: DLPack read-only provenance -------------------------------------------------------------


class LegacyOnly:
    """A producer that only speaks the legacy (pre-1.0) protocol, wrapping another producer."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, stream=None):
        return self.inner.__dlpack__()

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


def read_only_buffer():
    array = np.arange(16, dtype=np.float32)
    array.flags.writeable = False
    buf = routemm.from_dlpack(array)
    assert not buf.writable  # the versioned capsule's read-only flag was honoured
    return buf, array


def test_read_only_survives_versioned_export(cpu):
    buf, array = read_only_buffer()
    np.testing.assert_array_equal(buf.numpy(), array)
    consumer = np.from_dlpack(buf)  # NumPy asks for a versioned capsule
    assert not consumer.flags.writeable
    np.testing.assert_array_equal(consumer, array)
    again = routemm.from_dlpack(consumer)
    assert not again.writable
    writable = cpu.from_numpy(np.zeros(4, np.float32))
    assert np.from_dlpack(writable).flags.writeable


def test_read_only_survives_a_legacy_round_trip(cpu):
    # A legacy capsule cannot say read-only; one that routemm exported keeps its buffer's flag.
    buf, _ = read_only_buffer()
    assert not routemm.from_dlpack(LegacyOnly(buf)).writable
    writable = cpu.from_numpy(np.zeros(4, np.float32))
    assert routemm.from_dlpack(LegacyOnly(writable)).writable


def test_versioned_capsule_only_when_asked(cpu):
    buf = cpu.from_numpy(np.zeros(4, np.float32))
    assert "dltensor_versioned" in repr(buf.__dlpack__(max_version=(1, 0)))
    assert "dltensor_versioned" in repr(buf.__dlpack__(max_version=(1, 3)))
    assert "dltensor_versioned" not in repr(buf.__dlpack__())
    assert "dltensor_versioned" not in repr(buf.__dlpack__(max_version=(0, 8)))


def test_read_only_buffer_as_an_output_is_refused(cpu, proof):
    poison, _ = proof
    buf, array = read_only_buffer()
    for ro in (buf, routemm.from_dlpack(LegacyOnly(buf))):
        encoder = cpu.command_encoder()
        with pytest.raises(routemm.InvalidArgumentError, match="read-only"):
            dispatch(encoder, poison, poison_args(ro, ro, 16), 16)
        encoder.commit_and_wait()
    np.testing.assert_array_equal(array, np.arange(16, dtype=np.float32))
    # The op front doors refuse it too.
    w = np.ones((1, 2, 32), np.float32)
    x = np.ones((1, 32), np.float32)
    with pytest.raises(routemm.InvalidArgumentError, match="read-only|writable"):
        routemm.matmul_id(w, x, np.zeros((1, 1), np.int32), out=np.from_dlpack(buf)[:2].reshape(1, 2), device=cpu)


def test_read_only_gguf_tensor_round_trip(tmp_path, cpu, proof):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t", np.arange(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mapped = routemm.gguf_tensor(path, "t", device=cpu)
    assert not mapped.writable
    for again in (routemm.from_dlpack(LegacyOnly(mapped)), routemm.from_dlpack(np.from_dlpack(mapped))):
        assert not again.writable
        encoder = cpu.command_encoder()
        with pytest.raises(routemm.InvalidArgumentError, match="read-only"):
            dispatch(encoder, proof[0], poison_args(again, again, 16), 16)


# ---- 4: one encoder, several threads ------------------------------------------------------------


def test_encoder_shared_by_threads_never_crashes(cpu, proof):
    """Threads hammer one encoder (dispatch, commit, receipts): every call either works or raises
    routemm.Error saying the encoder is in use; the process survives and the buffers are right."""
    poison, _ = proof
    n = 1 << 16
    a = cpu.alloc(4 * n, DType.F32)
    b = cpu.alloc(4 * n, DType.F32)
    encoder = cpu.command_encoder()
    refused, unexpected = [], []
    deadline = time.monotonic() + 1.0

    def work(kind: int):
        while time.monotonic() < deadline:
            try:
                if kind == 0:
                    dispatch(encoder, poison, poison_args(a, b, n), n)
                elif kind == 1:
                    encoder.commit_and_wait()
                else:
                    encoder.memory_barrier()
                    _ = encoder.pending_dispatches
            except routemm.Error as error:
                (refused if "in use by another thread" in str(error) else unexpected).append(error)
            except Exception as error:  # noqa: BLE001 - anything else is a failure to report
                unexpected.append(error)

    threads = [threading.Thread(target=work, args=(i % 3,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not unexpected, unexpected[:3]
    encoder.commit_and_wait()
    assert (a.numpy().view(np.uint32) == 0xFFFFFFFF).all()


def test_second_thread_entering_a_committing_encoder_is_refused(cpu, proof):
    poison, _ = proof
    n = 1 << 22  # a commit long enough (tens of ms) for the other thread to arrive during it
    a = cpu.alloc(4 * n, DType.F32)
    b = cpu.alloc(4 * n, DType.F32)
    encoder = cpu.command_encoder()
    for _ in range(8):
        dispatch(encoder, poison, poison_args(a, b, n), n)
    committer = threading.Thread(target=encoder.commit_and_wait)
    committer.start()
    outcome = None
    while committer.is_alive() and outcome is None:
        try:
            _ = encoder.pending_dispatches
        except routemm.Error as error:
            outcome = error
    committer.join()
    if outcome is None:
        pytest.skip("the commit finished before the second thread arrived")
    assert "in use by another thread" in str(outcome)
    assert "give each thread its own" in str(outcome)


# ---- 5: interpreter exit with a daemon thread inside commit_and_wait -----------------------------

EXIT_SCRIPT = textwrap.dedent(
    """
    import struct, threading, time
    import routemm
    from routemm import DispatchKind
    device = routemm.Device("cpu")
    poison = routemm.KernelRegistry(device).get_pipeline("routemm_calibration_poison_f32")
    n = 1 << 20
    a = device.alloc(4 * n, routemm.DType.F32)
    b = device.alloc(4 * n, routemm.DType.F32)
    params = struct.pack("<QQII", n, n, 0, 0)
    encoder = device.command_encoder()
    started = threading.Event()
    def work():
        while True:
            encoder.dispatch(poison, [(0, a), (1, b), (2, params)], (n, 1, 1), (256, 1, 1),
                             dispatch_kind=DispatchKind.THREADS)
            started.set()
            encoder.commit_and_wait()
    threading.Thread(target=work, daemon=True).start()
    started.wait()
    time.sleep(0.02)
    """
)


def test_interpreter_exit_with_a_daemon_thread_in_commit_is_clean():
    for _ in range(5):  # the abort happened 9 runs in 10
        run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
        assert "terminate called" not in run.stderr, run.stderr
        assert run.returncode == 0, run.stderr


# ---- 12: strict pipeline labels -----------------------------------------------------------------


@pytest.mark.parametrize(
    "suffix",
    [
        "|-1:i1",
        "|+700:i1",
        "|700:i 1",
        "|4294967996:i1",
        "|700:i4294967297",
        "|700:i2147483648",
        "|0700:i1",
        "|700:i-0",
    ],
)
def test_malformed_pipeline_labels_are_refused(cpu, suffix):
    registry = routemm.KernelRegistry(cpu)
    with pytest.raises(routemm.InvalidArgumentError, match="malformed pipeline label"):
        registry.pipeline_identity("routemm_calibration_poison_f32" + suffix)


def test_canonical_labels_round_trip(cpu):
    registry = routemm.KernelRegistry(cpu)
    label = "kernel_mul_mm_q4_0_f32|700:i1|701:i-2147483648|4294967295:i2147483647"
    assert registry.pipeline_identity(label).pipeline_label == label
